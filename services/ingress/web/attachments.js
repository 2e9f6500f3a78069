// Attachments: files are uploaded (POST /v1/files) as soon as they are chosen, dropped on
// the chat or pasted into the message, and wait in the composer's tray (a thumbnail for an
// image, a chip with name and size for a document) until the message is sent with their
// ids. In the transcript a message shows its images as thumbnails, fetched with the token
// once they scroll near (so never linked, and each fetched once), opened full size in a
// lightbox, and its documents as chips.
//
// Images are shown from data: URLs: the page's policy allows `img-src 'self' data:` and no
// blob: URLs.

import { api, uploadFile } from './api.js';
import { $, h, toast } from './dom.js';

/** What the server takes beside a message (turns.rs MAX_ATTACHMENTS). */
const MAX_ATTACHMENTS = 32;
/** A chosen image bigger than this is not previewed before its upload ends. */
const PREVIEW_MAX_BYTES = 20 * 1024 * 1024;
/** Image data kept for the transcript, in characters of data: URLs. */
const CACHE_MAX_CHARS = 64 * 1024 * 1024;
/** A thumbnail's height and the range of its width (its image's shape, when known). */
const THUMB = { height: 112, min: 64, max: 224 };

// ---------------------------------------------------------------------------------------
// Sizes and names for people.

/** `bytes` as people read it: 532 B, 1.2 KB, 14 MB. */
export function humanSize(bytes) {
  if (typeof bytes !== 'number' || !(bytes >= 0)) return '';
  if (bytes < 1024) return `${bytes} B`;
  const units = ['KB', 'MB', 'GB'];
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  return `${value < 10 ? value.toFixed(1) : Math.round(value)} ${units[unit]}`;
}

const KIND_NAMES = {
  'application/pdf': 'PDF',
  'text/plain': 'text',
  'text/markdown': 'markdown',
  'text/html': 'HTML',
};

/** A document's name, or (an older message's has none) what kind of document it is. */
function documentName(d) {
  return d.name || `${KIND_NAMES[d.mime] ?? d.mime ?? 'a'} document`;
}

function documentIcon() {
  const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  svg.setAttribute('viewBox', '0 0 16 16');
  svg.setAttribute('class', 'doc-icon');
  svg.setAttribute('aria-hidden', 'true');
  const path = document.createElementNS('http://www.w3.org/2000/svg', 'path');
  path.setAttribute('d', 'M4 1.5h5l3.5 3.5v9.5h-8.5zM9 1.5V5h3.5M6 8.5h4.5M6 11h4.5');
  svg.append(path);
  return svg;
}

// ---------------------------------------------------------------------------------------
// Image data: fetched with the token, read into a data: URL, kept (the newest used last)
// until the cache is full.

const cache = new Map(); // id → {url: Promise<string>, chars}
let cachedChars = 0;

function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error ?? new Error('could not read the image'));
    reader.readAsDataURL(blob);
  });
}

/** Keeps `url` (a promise of a data: URL) as the image of file `id`. */
function keep(id, url) {
  forget(id);
  const entry = { url, chars: 0 };
  cache.set(id, entry);
  url.then(
    (data) => {
      if (cache.get(id) !== entry) return;
      entry.chars = data.length;
      cachedChars += data.length;
      // The least recently used go first; the one just read stays however big it is.
      for (const old of cache.keys()) {
        if (cachedChars <= CACHE_MAX_CHARS) break;
        if (old !== id) forget(old);
      }
    },
    () => cache.get(id) === entry && forget(id), // tried again when next wanted
  );
  return url;
}

function forget(id) {
  const entry = cache.get(id);
  if (!entry) return;
  cachedChars -= entry.chars;
  cache.delete(id);
}

/** The image of file `id` as a data: URL, fetched once (and kept by the browser's cache
 * too: the server marks a file's bytes immutable). */
export function imageURL(id) {
  const entry = cache.get(id);
  if (entry) {
    cache.delete(id); // most recently used: last to go
    cache.set(id, entry);
    return entry.url;
  }
  const url = api(`/v1/files/${encodeURIComponent(id)}/content`, { raw: true, cache: 'default' })
    .then((res) => res.blob())
    .then(readAsDataURL);
  return keep(id, url);
}

// Thumbnails load when they come within a screen of the transcript's view.

let observer = null;
const watched = new Map(); // img → load()
let sweep = 0;

function lazyLoad(img, load) {
  observer ??= new IntersectionObserver(
    (entries) => {
      for (const e of entries) {
        if (!e.isIntersecting) continue;
        observer.unobserve(e.target);
        const run = watched.get(e.target);
        watched.delete(e.target);
        run?.();
      }
    },
    { root: $('#transcript'), rootMargin: '100% 0px' },
  );
  watched.set(img, load);
  observer.observe(img);
  // A transcript drawn again leaves its old thumbnails behind: stop watching those once
  // the new ones are in the page.
  if (!sweep) {
    sweep = requestAnimationFrame(() => {
      sweep = 0;
      for (const node of watched.keys()) {
        if (node.isConnected) continue;
        observer.unobserve(node);
        watched.delete(node);
      }
    });
  }
}

/** A message's image as a thumbnail button that opens it full size. */
function thumbnail(image, index, count) {
  const size = image.width && image.height ? ` ${image.width}×${image.height}` : '';
  const label = `Open image ${count > 1 ? `${index + 1} of ${count} ` : ''}(${image.mime ?? 'image'}${size})`;
  const img = h('img', { alt: '', decoding: 'async' });
  const button = h('button', {
    type: 'button',
    class: 'thumb loading',
    'aria-label': label,
    title: 'Open full size',
    dataset: { file: image.id },
    onclick: () => openLightbox(image),
  }, img);
  const ratio = image.width > 0 && image.height > 0 ? image.width / image.height : 1;
  button.style.width = `${Math.round(Math.min(THUMB.max, Math.max(THUMB.min, THUMB.height * ratio)))}px`;
  button.style.height = `${THUMB.height}px`;
  lazyLoad(img, () =>
    imageURL(image.id).then(
      (url) => {
        img.src = url;
        button.classList.remove('loading');
      },
      (e) => {
        button.classList.replace('loading', 'broken');
        button.title = `The image could not be loaded: ${e.message}`;
        button.disabled = true;
      },
    ),
  );
  return button;
}

/** A document as a chip: its name and size. */
function documentChip(d) {
  const size = humanSize(d.bytes);
  return h(
    'span',
    { class: 'chip doc', title: d.mime, dataset: { file: d.id } },
    documentIcon(),
    h('span', { class: 'name', text: documentName(d) }),
    size ? h('span', { class: 'size', text: size }) : null,
  );
}

/** A user message's images and documents, or null when it has none. */
export function attachmentsOf(item) {
  const images = item.images ?? [];
  const documents = item.documents ?? [];
  if (!images.length && !documents.length) return null;
  return h(
    'div',
    { class: 'attached', role: 'group', 'aria-label': 'Attachments' },
    images.map((image, i) => thumbnail(image, i, images.length)),
    documents.map(documentChip),
  );
}

// ---------------------------------------------------------------------------------------
// The lightbox: one image full size, closed by a click anywhere or Esc.

function openLightbox(image) {
  const dialog = $('#lightbox');
  const img = $('#lightbox-img');
  img.removeAttribute('src');
  img.alt = `Image (${image.mime ?? 'image'})`;
  const size = image.width && image.height ? ` · ${image.width}×${image.height}` : '';
  $('#lightbox-caption').textContent = `${image.mime ?? 'image'}${size}`;
  dialog.dataset.file = image.id;
  dialog.dataset.state = 'loading';
  dialog.showModal();
  imageURL(image.id).then(
    (url) => {
      if (!dialog.open || dialog.dataset.file !== image.id) return;
      img.src = url;
      dialog.dataset.state = 'ready';
    },
    (e) => {
      if (!dialog.open || dialog.dataset.file !== image.id) return;
      dialog.dataset.state = 'failed';
      $('#lightbox-caption').textContent = `The image could not be loaded: ${e.message}`;
    },
  );
}

function setupLightbox() {
  const dialog = $('#lightbox');
  dialog.addEventListener('click', () => dialog.close());
  dialog.addEventListener('close', () => {
    $('#lightbox-img').removeAttribute('src');
    delete dialog.dataset.file;
  });
}

// ---------------------------------------------------------------------------------------
// The composer's tray.

/** Files chosen for the next message: {key, file, name, size, state ('uploading', 'ready'
 * or 'failed'), meta (the server's, once uploaded), error, preview, controller, node}. */
let tray = [];
let keys = 0;

function trayNode(entry) {
  const kind = entry.meta?.kind ?? (entry.preview ? 'image' : 'document');
  const remove = h('button', {
    type: 'button',
    class: 'remove',
    text: '×',
    'aria-label': entry.state === 'failed' ? `Dismiss ${entry.name}` : `Remove ${entry.name}`,
    title: entry.state === 'failed' ? 'Dismiss' : 'Remove',
    onclick: () => removeEntry(entry),
  });
  const progress =
    entry.state === 'uploading'
      ? (entry.progress = h('progress', { max: '1', 'aria-label': `Uploading ${entry.name}` }))
      : null;
  if (progress && entry.sent !== undefined) progress.value = entry.sent;
  const attrs = {
    class: `attachment ${kind}`,
    dataset: { state: entry.state, kind, ...(entry.meta && { id: entry.meta.id }) },
    title: entry.state === 'failed' ? `${entry.name}: ${entry.error}` : `${entry.name}, ${humanSize(entry.size)}`,
  };
  if (kind === 'image' && entry.state !== 'failed') {
    return h(
      'li',
      attrs,
      h('img', { class: 'thumb', alt: entry.name, src: entry.preview }),
      progress,
      remove,
    );
  }
  return h(
    'li',
    attrs,
    documentIcon(),
    h('span', { class: 'name', text: entry.name }),
    entry.state === 'failed'
      ? h('span', { class: 'error', role: 'alert', text: entry.error })
      : h('span', { class: 'size', text: humanSize(entry.meta?.bytes ?? entry.size) }),
    progress,
    remove,
  );
}

function drawTray() {
  const list = $('#tray');
  for (const entry of tray) entry.node = trayNode(entry);
  list.replaceChildren(...tray.map((e) => e.node));
  list.hidden = !tray.length;
}

function redraw(entry) {
  if (!tray.includes(entry)) return;
  const node = trayNode(entry);
  entry.node?.replaceWith(node);
  entry.node = node;
}

function removeEntry(entry) {
  entry.controller?.abort();
  const i = tray.indexOf(entry);
  if (i < 0) return;
  tray.splice(i, 1);
  // Uploaded but never sent: it goes from the user's files too (a message that already
  // attached the same file keeps its bytes, DESIGN §12).
  if (entry.meta?.id) api(`/v1/files/${entry.meta.id}`, { method: 'DELETE' }).catch(() => {});
  drawTray();
  // Keyboard users stay in the tray, or go back to the message.
  const next = tray[Math.min(i, tray.length - 1)]?.node.querySelector('button.remove');
  (next ?? $('#message')).focus();
}

/** Uploads `files` into the tray, each at once. */
export function addFiles(files) {
  files = [...files];
  if (!files.length) return;
  const room = MAX_ATTACHMENTS - tray.filter((e) => e.state !== 'failed').length;
  if (files.length > room) {
    toast(`A message takes at most ${MAX_ATTACHMENTS} attachments; ${room > 0 ? `only ${room} more` : 'no more'} can be added.`);
    files = files.slice(0, Math.max(0, room));
  }
  const added = files.map((file) => ({
    key: ++keys,
    file,
    name: file.name || (file.type.startsWith('image/') ? 'pasted image' : 'pasted file'),
    size: file.size,
    state: 'uploading',
    meta: null,
    error: '',
    preview: null,
    controller: new AbortController(),
    node: null,
  }));
  tray.push(...added);
  drawTray();
  for (const entry of added) upload(entry);
}

async function upload(entry) {
  const { file } = entry;
  if (file.type.startsWith('image/') && file.size <= PREVIEW_MAX_BYTES) {
    entry.preview = await readAsDataURL(file).catch(() => null);
    redraw(entry);
  }
  try {
    entry.meta = await uploadFile(file, {
      name: entry.name,
      signal: entry.controller.signal,
      onProgress: (sent, total) => {
        entry.sent = total ? sent / total : 0;
        if (entry.progress) entry.progress.value = entry.sent;
      },
    });
    entry.state = 'ready';
    // The transcript shows the message's image from what was chosen, without fetching it.
    if (entry.meta.kind === 'image' && entry.preview) keep(entry.meta.id, Promise.resolve(entry.preview));
    else if (entry.meta.kind === 'image') entry.preview = await imageURL(entry.meta.id).catch(() => null);
  } catch (e) {
    if (e.name === 'AbortError') return;
    entry.state = 'failed';
    entry.error = e.message || 'the upload failed';
  }
  entry.controller = null;
  redraw(entry);
}

/** The attachments ready to send, as the message takes them and as the transcript shows
 * them; `pending` counts those still uploading. */
export function trayContents() {
  const ready = tray.filter((e) => e.state === 'ready');
  const image = (m) => ({ id: m.id, mime: m.mime, ...(m.width && { width: m.width }), ...(m.height && { height: m.height }) });
  const doc = (m) => ({ id: m.id, mime: m.mime, name: m.name, bytes: m.bytes });
  return {
    pending: tray.filter((e) => e.state === 'uploading').length,
    images: ready.filter((e) => e.meta.kind === 'image').map((e) => image(e.meta)),
    documents: ready.filter((e) => e.meta.kind !== 'image').map((e) => doc(e.meta)),
  };
}

/** Empties the tray for a message being sent; `restoreTray` with its answer puts the ready
 * ones back when the message was not sent. */
export function takeTray() {
  const taken = tray.filter((e) => e.state === 'ready');
  tray = [];
  drawTray();
  return taken;
}

export function restoreTray(taken) {
  const missing = taken.filter((e) => !tray.includes(e));
  tray = [...missing, ...tray];
  drawTray();
}

// ---------------------------------------------------------------------------------------
// Wiring: the attach button, dropping files on the chat, pasting an image.

export function setupAttachments() {
  const input = $('#file-input');
  $('#attach').addEventListener('click', () => input.click());
  input.addEventListener('change', () => {
    addFiles(input.files);
    input.value = ''; // the same file can be chosen again
  });

  const chat = $('#chat');
  const hasFiles = (e) => [...(e.dataTransfer?.types ?? [])].includes('Files');
  let depth = 0; // enter and leave pair up over the chat's children
  const highlight = (on) => {
    if (!on) depth = 0;
    chat.classList.toggle('dropping', on);
  };
  chat.addEventListener('dragenter', (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    depth++;
    highlight(true);
  });
  chat.addEventListener('dragover', (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    e.dataTransfer.dropEffect = 'copy';
  });
  chat.addEventListener('dragleave', (e) => {
    if (!hasFiles(e)) return;
    if (--depth <= 0) highlight(false);
  });
  chat.addEventListener('drop', (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    highlight(false);
    addFiles(e.dataTransfer.files);
    $('#message').focus();
  });
  // A file dropped beside the chat is not opened in place of the app.
  window.addEventListener('dragover', (e) => hasFiles(e) && e.preventDefault());
  window.addEventListener('drop', (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    highlight(false);
  });
  window.addEventListener('dragend', () => highlight(false));

  $('#message').addEventListener('paste', (e) => {
    const files = [...(e.clipboardData?.files ?? [])];
    if (!files.length) return; // text pastes as usual
    e.preventDefault();
    addFiles(files);
  });

  setupLightbox();
}
