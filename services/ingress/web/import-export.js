// Export (a menu among the session's actions) and import (the sidebar's button): a session
// down as a file in one of the server's formats, and other apps' exports up as sessions.

import { download, sendForm } from './api.js';
import { $, fmt, h, toast } from './dom.js';
import { startSearch } from './search.js';
import { reloadList } from './session-list.js';
import { search, showMenu, state } from './state.js';

const PLURAL = new Intl.PluralRules('en-US');
const count = (n, one, many = `${one}s`) => `${fmt(n)} ${PLURAL.select(n) === 'one' ? one : many}`;

function exportItems() {
  return [...document.querySelectorAll('#export-menu [role=menuitem]')];
}

/** Opens or closes the Export menu; opened, `focus` ('first' or 'last') picks the item to
 * focus, and closed with `focus`, the Export button takes the focus back. */
export function showExportMenu(open, focus = null) {
  const menu = $('#export-menu');
  if (menu.hidden === !open) {
    if (!open && focus) $('#export').focus();
    return;
  }
  menu.hidden = !open;
  $('#export').setAttribute('aria-expanded', String(open));
  $('#export-wrap').classList.toggle('open', open);
  if (open) {
    const items = exportItems();
    (focus === 'last' ? items.at(-1) : items[0])?.focus();
  } else if (focus) {
    $('#export').focus();
  }
}

/** Downloads the open session as `format`. */
async function exportAs(format, ext) {
  const session = state.current?.session;
  const button = $('#export');
  if (!session || button.getAttribute('aria-busy') === 'true') return;
  showExportMenu(false, true);
  showMenu(false);
  button.setAttribute('aria-busy', 'true');
  button.textContent = 'Exporting…';
  try {
    const name = await download(`/v1/sessions/${session.id}/export?format=${encodeURIComponent(format)}`, `session-${session.id}.${ext}`);
    toast(`Exported as ${name}.`, 'info');
  } catch (e) {
    toast(`Could not export: ${e.message}`);
  } finally {
    button.removeAttribute('aria-busy');
    button.textContent = 'Export';
  }
}

export function setupExport() {
  const button = $('#export');
  const menu = $('#export-menu');
  button.addEventListener('click', (e) => {
    e.stopPropagation(); // on a phone it sits in the ⋯ menu, which a click elsewhere closes
    showExportMenu(menu.hidden, 'first');
  });
  button.addEventListener('keydown', (e) => {
    if (e.key === 'ArrowDown' || e.key === 'ArrowUp') {
      e.preventDefault();
      showExportMenu(true, e.key === 'ArrowUp' ? 'last' : 'first');
    }
  });
  menu.addEventListener('click', (e) => {
    e.stopPropagation();
    const item = e.target.closest('[role=menuitem]');
    if (item) exportAs(item.dataset.format, item.dataset.ext);
  });
  menu.addEventListener('keydown', (e) => {
    const items = exportItems();
    const at = items.indexOf(document.activeElement);
    const moveTo = (i) => items[(i + items.length) % items.length].focus();
    if (e.key === 'ArrowDown') moveTo(at + 1);
    else if (e.key === 'ArrowUp') moveTo(at - 1);
    else if (e.key === 'Home') moveTo(0);
    else if (e.key === 'End') moveTo(items.length - 1);
    else if (e.key === 'Escape') showExportMenu(false, true);
    else if (e.key === 'Tab') showExportMenu(false);
    else return;
    e.preventDefault();
    e.stopPropagation(); // Esc here closes the menu, and stops no answer
  });
  // The focus leaving the menu (a click elsewhere, the window left) closes it.
  $('#export-wrap').addEventListener('focusout', (e) => {
    if (!menu.hidden && !$('#export-wrap').contains(e.relatedTarget)) showExportMenu(false);
  });
  document.addEventListener('click', (e) => {
    if (!e.target.closest('#export-wrap')) showExportMenu(false);
  });
}

/** Whether an import is on its way (one at a time). */
let importing = false;

/** Sends `file` to POST /v1/import (its format found by the server) and shows what came
 * of it: counts, the conversations that failed and the parts skipped; then the list again. */
async function importFile(file) {
  if (importing) return;
  importing = true;
  const button = $('#import');
  button.disabled = true;
  button.setAttribute('aria-busy', 'true');
  button.textContent = 'Importing…';
  showImportResult('working', `Uploading ${file.name}…`);
  const form = new FormData();
  form.append('file', file, file.name);
  let summary;
  try {
    summary = await sendForm('/v1/import', form, {
      onProgress: (sent, total) => {
        if (total) showImportResult('working', `Uploading ${file.name}… ${Math.floor((sent / total) * 100)}%`);
      },
      onSent: () => showImportResult('working', `Importing ${file.name}…`),
    });
  } catch (e) {
    showImportResult('error', `Could not import ${file.name}: ${e.message}`);
    return;
  } finally {
    importing = false;
    button.disabled = false;
    button.removeAttribute('aria-busy');
    button.textContent = 'Import…';
  }
  showImportResult(summary.failed?.length ? 'partial' : 'done', importText(summary), summary);
  if (search.q) startSearch(search.q);
  reloadList();
}

/** "Imported 12 conversations, 340 messages; 3 parts skipped; 1 failed". `conversations`
 * counts those found imported already too, `unchanged` those of them that were whole. */
function importText({ conversations = 0, unchanged, sessions = 0, messages = 0, skipped = [], failed = [] }) {
  const before = unchanged ?? (!sessions && !messages ? conversations : 0);
  const fresh = conversations - before;
  const old = `${count(before, 'conversation')} ${before === 1 ? 'was' : 'were'} imported before`;
  let text = !fresh && before ? `Nothing new: ${old}` : `Imported ${count(fresh, 'conversation')}, ${count(messages, 'message')}`;
  if (fresh && before) text += `; ${old}`;
  if (skipped.length) text += `; ${count(skipped.length, 'part')} skipped`;
  if (failed.length) text += `; ${fmt(failed.length)} failed`;
  return `${text}.`;
}

/** The import's status line under the button (`state`: working, done, partial, error), with
 * the summary's failed conversations listed and its skipped parts folded away. */
function showImportResult(kind, text, summary = null) {
  const box = $('#import-result');
  box.hidden = false;
  box.dataset.state = kind;
  $('#import-status').textContent = text;
  $('#import-dismiss').hidden = kind === 'working';
  const failed = summary?.failed ?? [];
  const skipped = summary?.skipped ?? [];
  const named = (c) => h('strong', { text: c.conversation || 'A conversation' });
  $('#import-failed').replaceChildren(...failed.map((f) => h('li', {}, named(f), `: ${f.reason}`)));
  $('#import-failed').hidden = !failed.length;
  $('#import-skipped ul').replaceChildren(
    ...skipped.map((s) => h('li', {}, named(s), `: ${s.what}${s.reason ? ` (${s.reason})` : ''}`)),
  );
  $('#import-skipped summary').textContent = `${count(skipped.length, 'part')} skipped`;
  $('#import-skipped').hidden = !skipped.length;
}

export function setupImport() {
  const input = $('#import-input');
  $('#import').addEventListener('click', () => input.click());
  input.addEventListener('change', () => {
    const file = input.files?.[0];
    input.value = ''; // the same file again is a change too
    if (file) importFile(file);
  });
  $('#import-dismiss').addEventListener('click', () => {
    $('#import-result').hidden = true;
    $('#import').focus();
  });
}
