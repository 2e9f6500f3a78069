// turnlog's web client: the session list, search (hits with their matched words, opening
// the session at the message found), a transcript of every item kind (a page at a time,
// older ones as it scrolls up), a composer that streams turns (and picks a running turn up
// again after a reload) and takes attachments (attachments.js), branches (DESIGN §10:
// branch, edit, regenerate, and a switcher where branches part), and a context inspector
// (the next request, or what an answer was sent, §11), export of a session as a file and
// import of other apps' exports. Plain DOM, no framework; text from messages reaches the
// page only as text.
//
// This module starts the client and wires the page's controls to the modules that do each
// job: state.js (what the client holds), session-list.js, search.js, session.js (opening a
// session and drawing its transcript), branches.js, turn.js (streaming a turn, the
// composer), snapshot.js (a running turn kept across a reload), session-actions.js (rename,
// archive, delete), import-export.js and inspector.js; below them api.js, sse.js,
// transcript.js, attachments.js, markdown.js and dom.js. Those modules call one another
// (their imports go round in circles), so none of them runs another's code while loading:
// init() below, once all are loaded, starts the client.

import { setupTokenDialog } from './api.js';
import { setupAttachments } from './attachments.js';
import { $ } from './dom.js';
import { setupExport, setupImport } from './import-export.js';
import { inspect, loadInspector, toggleInspector } from './inspector.js';
import { startSearch } from './search.js';
import { remove, rename, toggleArchive } from './session-actions.js';
import { reloadList, setupList } from './session-list.js';
import { maybeLoadEarlier, openSession, route } from './session.js';
import { saveSnapshotNow } from './snapshot.js';
import { search, showMenu, state } from './state.js';
import { autosize, retry, send, stop } from './turn.js';

function setupComposer() {
  const input = $('#message');
  $('#composer').addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  input.addEventListener('input', () => autosize());
  $('#stop').addEventListener('click', stop);
  $('#retry').addEventListener('click', retry);
  setupAttachments();
}

function setupKeys() {
  document.addEventListener('keydown', (e) => {
    if (document.querySelector('dialog[open]')) return;
    if (e.key === 'Escape' && state.turn) {
      e.preventDefault();
      stop();
    } else if (e.key === '/' && !e.target.closest('input, textarea, [contenteditable]')) {
      e.preventDefault();
      $('#search').focus();
    }
  });
}

function init() {
  setupTokenDialog(() => {
    reloadList();
    startSearch(search.q);
    if (state.current?.id) openSession(state.current.id);
  });
  setupList();
  setupComposer();
  setupKeys();
  $('#transcript').addEventListener('scroll', maybeLoadEarlier, { passive: true });
  $('#new-chat').addEventListener('click', () => {
    location.hash = '#/new';
    $('#message').focus();
  });
  $('#back').addEventListener('click', () => (location.hash = '#/'));
  $('#more').addEventListener('click', (e) => {
    e.stopPropagation();
    showMenu(!$('#chat-header').classList.contains('menu-open'));
  });
  document.addEventListener('click', (e) => {
    if (!e.target.closest('#more')) showMenu(false);
  });
  setupExport();
  setupImport();
  $('#rename').addEventListener('click', rename);
  $('#archive').addEventListener('click', toggleArchive);
  $('#delete').addEventListener('click', remove);
  $('#context-toggle').addEventListener('click', () => {
    if (!state.inspectorOpen) state.inspecting = null; // opened from here, it shows the next request
    toggleInspector();
  });
  $('#inspector-close').addEventListener('click', () => toggleInspector(false));
  $('#inspector-next').addEventListener('click', () => inspect(null));
  $('#inspector-refresh').addEventListener('click', loadInspector);
  $('#ask-cancel').addEventListener('click', () => $('#ask-dialog').close('cancel'));
  // A reload mid-turn continues from the newest event this tab has seen.
  window.addEventListener('pagehide', saveSnapshotNow);
  window.addEventListener('hashchange', route);
  reloadList();
  route();
}

init();
