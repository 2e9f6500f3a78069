// Small DOM helpers shared by the client's modules: building elements (text is always set
// as text), a search snippet's marked words, times and numbers for people, a toast for news
// and errors, and a modal question.

export const $ = (selector) => document.querySelector(selector);

/** An element with attributes, properties and children; strings become text nodes. */
export function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = value;
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  node.append(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

const ENTITIES = { '&amp;': '&', '&lt;': '<', '&gt;': '>', '&quot;': '"', '&#39;': "'" };

/** A search snippet (HTML-escaped text whose matched words are in `<mark>…</mark>`, and no
 * other markup) as text and `mark` elements. It is split on those exact tokens and its
 * entities decoded in one pass, so no text of a message is ever parsed as HTML. */
export function marked(snippet) {
  let inMark = false;
  const nodes = [];
  for (const part of snippet.split(/(<mark>|<\/mark>)/)) {
    if (part === '<mark>' || part === '</mark>') inMark = part === '<mark>';
    else if (part) {
      const text = part.replace(/&(?:amp|lt|gt|quot|#39);/g, (entity) => ENTITIES[entity]);
      nodes.push(inMark ? h('mark', { text }) : text);
    }
  }
  return nodes;
}

const numberFormat = new Intl.NumberFormat();
export const fmt = (n) => numberFormat.format(n);
export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

let toastTimer = 0;
export function toast(message, kind = 'error') {
  const node = $('#toast');
  node.textContent = message;
  node.dataset.kind = kind;
  node.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (node.hidden = true), 5000);
}

/** A modal question: with `value`, a text field whose text it answers; else true. Null when cancelled. */
export function ask({ title, message = '', value, confirm, danger = false }) {
  const dialog = $('#ask-dialog');
  const input = $('#ask-input');
  const ok = $('#ask-ok');
  $('#ask-title').textContent = title;
  $('#ask-message').textContent = message;
  const wantsText = value !== undefined;
  input.hidden = !wantsText;
  input.disabled = !wantsText;
  input.required = wantsText;
  input.value = value ?? '';
  ok.textContent = confirm;
  ok.classList.toggle('danger', danger);
  dialog.returnValue = '';
  dialog.showModal();
  if (wantsText) input.select();
  else ok.focus();
  return new Promise((resolve) => {
    dialog.addEventListener(
      'close',
      () => resolve(dialog.returnValue === 'ok' ? (wantsText ? input.value : true) : null),
      { once: true },
    );
  });
}

const relative = new Intl.RelativeTimeFormat(undefined, { numeric: 'auto' });
export function ago(iso) {
  const seconds = (Date.parse(iso) - Date.now()) / 1000;
  const abs = Math.abs(seconds);
  if (abs < 45) return 'just now';
  if (abs < 3600) return relative.format(Math.round(seconds / 60), 'minute');
  if (abs < 86400) return relative.format(Math.round(seconds / 3600), 'hour');
  if (abs < 7 * 86400) return relative.format(Math.round(seconds / 86400), 'day');
  return new Date(iso).toLocaleDateString();
}

export function time(iso) {
  return h('time', { datetime: iso, title: new Date(iso).toLocaleString(), text: ago(iso) });
}
