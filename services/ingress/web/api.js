// The HTTP API: JSON in and out, errors as ApiError with the server's code, and the
// bearer token, asked for when the server answers 401 and kept in local storage.

import { $ } from './dom.js';

const TOKEN_KEY = 'turnlog.token';

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export async function api(path, { method = 'GET', body, headers = {}, raw = false, signal } = {}) {
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
      cache: 'no-store',
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
  try {
    const { error } = await res.json();
    return new ApiError(res.status, error.code, error.message);
  } catch {
    return new ApiError(res.status, `http_${res.status}`, res.statusText || `HTTP ${res.status}`);
  }
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
