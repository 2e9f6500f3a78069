// The HTTP API: JSON in and out (files and imports up as multipart, exports down as
// files), errors as ApiError with the server's code, and the bearer token, asked for when
// the server answers 401 and kept in local storage.

import { $ } from './dom.js';

const TOKEN_KEY = 'turnlog.token';

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** `cache` is the fetch's: by default nothing comes from the browser's cache (a file's
 * bytes, which never change, may). */
export async function api(path, { method = 'GET', body, headers = {}, raw = false, signal, cache = 'no-store' } = {}) {
  for (;;) {
    const token = localStorage.getItem(TOKEN_KEY);
    const all = { ...headers };
    if (token) all.Authorization = `Bearer ${token}`;
    if (body !== undefined) all['Content-Type'] = 'application/json';
    const res = await fetch(path, {
      method,
      headers: all,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache,
    });
    // Authentication comes before anything is written, so sending again is safe.
    if (res.status === 401) {
      await askForToken(token ? 'The stored token was not accepted.' : 'This server needs an API token.');
      continue;
    }
    if (!res.ok) throw await errorOf(res);
    if (raw) return res;
    return res.status === 204 ? null : res.json();
  }
}

async function errorOf(res) {
  return errorFrom(res.status, res.statusText, await res.text().catch(() => ''));
}

function errorFrom(status, statusText, text) {
  try {
    const { error } = JSON.parse(text);
    return new ApiError(status, error.code, error.message);
  } catch {
    return new ApiError(status, `http_${status}`, statusText || `HTTP ${status}`);
  }
}

/** Uploads `file` (POST /v1/files, multipart, one field `file`) and answers the server's
 * metadata of it; `onProgress(sent, total)` follows the upload (see `sendForm`). */
export function uploadFile(file, { name = file.name, onProgress, signal } = {}) {
  const form = new FormData();
  form.append('file', file, name);
  return sendForm('/v1/files', form, { onProgress: (sent, total) => onProgress?.(sent, total ?? file.size), signal });
}

/** POSTs `form` (multipart) to `path` and answers the server's JSON. XMLHttpRequest, as
 * fetch cannot tell how much of a body went out: `onProgress(sent, total)` follows the
 * upload (`total` undefined when unknown), and `onSent()` runs once all of it is out and the
 * server is working on it. An abort of `signal` rejects with an AbortError; a connection
 * that failed with an ApiError of status 0. */
export async function sendForm(path, form, { onProgress, onSent, signal } = {}) {
  for (;;) {
    const token = localStorage.getItem(TOKEN_KEY);
    const res = await new Promise((resolve, reject) => {
      if (signal?.aborted) return reject(new DOMException('The upload was cancelled.', 'AbortError'));
      const xhr = new XMLHttpRequest();
      xhr.open('POST', path);
      if (token) xhr.setRequestHeader('Authorization', `Bearer ${token}`);
      xhr.upload.addEventListener('progress', (e) => onProgress?.(e.loaded, e.lengthComputable ? e.total : undefined));
      xhr.upload.addEventListener('load', () => onSent?.());
      xhr.addEventListener('load', () => resolve(xhr));
      xhr.addEventListener('error', () =>
        // A server refusing a body it will not read may close the connection before it is sent.
        reject(new ApiError(0, 'network', 'the upload did not reach the server, or the server closed the connection (a file over its size limit?)')),
      );
      xhr.addEventListener('abort', () => reject(new DOMException('The upload was cancelled.', 'AbortError')));
      signal?.addEventListener('abort', () => xhr.abort(), { once: true });
      xhr.send(form);
    });
    // Authentication comes before anything is stored, so sending again is safe.
    if (res.status === 401) {
      await askForToken(token ? 'The stored token was not accepted.' : 'This server needs an API token.');
      continue;
    }
    if (res.status < 200 || res.status > 299) throw errorFrom(res.status, res.statusText, res.responseText);
    return JSON.parse(res.responseText);
  }
}

/** Downloads what `path` answers (GET, with the token) as a file: the name the server gives
 * in its Content-Disposition, else `fallback`. Through fetch and a Blob rather than a link,
 * as a link would not send the token. */
export async function download(path, fallback) {
  const res = await api(path, { raw: true });
  const blob = await res.blob();
  const name = filenameOf(res.headers.get('Content-Disposition')) || fallback;
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  // The browser has the file once the click is handled; a minute is ample.
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
  return name;
}

/** The file name of a Content-Disposition value (`filename*=UTF-8''…` before `filename=`),
 * without any directory part; null when it names none. */
export function filenameOf(disposition) {
  if (!disposition) return null;
  let name = null;
  const extended = /filename\*\s*=\s*([^']*)'[^']*'([^;]+)/i.exec(disposition);
  if (extended) {
    try {
      name = decodeURIComponent(extended[2].trim());
    } catch {
      name = null;
    }
  }
  if (!name) {
    const plain = /filename\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]+))/i.exec(disposition);
    if (plain) name = plain[1] !== undefined ? plain[1].replace(/\\(.)/g, '$1') : plain[2].trim();
  }
  name = name?.split(/[\\/]/).pop().trim();
  return name || null;
}

let tokenWanted = null; // one prompt however many requests were refused

function askForToken(why) {
  const dialog = $('#token-dialog');
  $('#token-why').textContent = why;
  if (!tokenWanted) {
    let resolve;
    tokenWanted = new Promise((r) => (resolve = r));
    tokenWanted.resolve = resolve;
    $('#token-input').value = '';
    dialog.showModal();
    $('#token-button').hidden = false;
  }
  return tokenWanted;
}

/** Wires the token prompt; `onChange` runs after the user replaced the token. */
export function setupTokenDialog(onChange) {
  const dialog = $('#token-dialog');
  // Without a token nothing works, so Esc does not dismiss the prompt.
  dialog.addEventListener('cancel', (e) => tokenWanted && e.preventDefault());
  $('#token-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const token = $('#token-input').value.trim();
    if (!token) return;
    localStorage.setItem(TOKEN_KEY, token);
    dialog.close();
    const waiting = tokenWanted;
    tokenWanted = null;
    waiting?.resolve();
  });
  $('#token-button').hidden = !localStorage.getItem(TOKEN_KEY);
  $('#token-button').addEventListener('click', async () => {
    localStorage.removeItem(TOKEN_KEY);
    await askForToken('Enter the token to use from now on.');
    onChange();
  });
}
