// What the client holds: the open session (its loaded items, branches and running turn),
// the session list's pages and the search shown in its place; and which pane and which
// menu show, on a phone's narrow screen.

import { $ } from './dom.js';

export const state = {
  /** The open session: {id, session, items, earlier, forks, parent}; null for a new chat.
   * `items` are the pages loaded so far; `earlier` is the cursor of the older ones (null:
   * none left); `forks` are its branches; `parent`, for a branch, is `{session, forks}` of
   * the session it branched from (null when that is gone, undefined when not loaded). */
  current: null,
  /** Where the next session opened keeps a message on screen: {id, seq, top}; without
   * `top`, a search hit's message, shown and highlighted. */
  anchor: null,
  /** Older items are on their way. */
  loadingEarlier: false,
  /** The turn being streamed in the open session, if any. */
  turn: null,
  /** The message just sent, shown until the transcript has it, and its attachments
   * (`{images, documents}` as the transcript has them). */
  pendingText: null,
  pendingFiles: null,
  opening: 0,
  inspectorOpen: false,
  /** The attempt whose request the inspector shows, `{sessionId, item}`; null: the next
   * request. */
  inspecting: null,
};

export const list = { sessions: [], next: null, done: false, loading: false, gen: 0, archived: false };
/** The search shown instead of the list while the search box holds words. */
export const search = { q: '', next: null, gen: 0 };

export function showPane(pane) {
  document.body.dataset.pane = pane;
}

/** The session actions' menu (a phone folds them under ⋯). */
export function showMenu(open) {
  $('#chat-header').classList.toggle('menu-open', open);
  $('#more').setAttribute('aria-expanded', String(open));
}
