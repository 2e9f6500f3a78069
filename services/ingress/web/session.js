// Opening a session and drawing its transcript: the newest page first, older ones as the
// transcript scrolls up, a running turn's live answer at the end.

import { api } from './api.js';
import { branchFrom, editMessage, keepOnScreen, placeBranchNavs, regenerate } from './branches.js';
import { $, h, toast } from './dom.js';
import { showExportMenu } from './import-export.js';
import { inspect, loadContext, loadInspector } from './inspector.js';
import { reveal } from './search.js';
import { markCurrentRow, updateListRow } from './session-list.js';
import { clearSnapshot, snapshotFor } from './snapshot.js';
import { showMenu, showPane, state } from './state.js';
import { renderItem, waitingView } from './transcript.js';
import { answerPaused, attach, leaveTurn, sendToolResults, updateComposer } from './turn.js';

// Transcript items per request; older ones load as the transcript scrolls up.
const TRANSCRIPT_PAGE = 50;

export function route() {
  const match = /^#\/s\/([0-9a-f-]{36})$/i.exec(location.hash);
  if (match) {
    showPane('chat');
    if (state.current?.id !== match[1]) openSession(match[1]);
    return;
  }
  showPane(location.hash === '#/new' ? 'chat' : 'list');
  newChat();
}

function newChat() {
  leaveTurn();
  state.opening++;
  state.current = null;
  document.title = 'turnlog';
  renderHeader();
  renderTranscript();
  markCurrentRow();
  state.inspecting = null;
  if (state.inspectorOpen) loadInspector();
}

export async function openSession(id) {
  leaveTurn();
  state.inspecting = null; // a request of the session left
  const opening = ++state.opening;
  const anchor = state.anchor?.id === id ? state.anchor : null;
  state.anchor = null;
  state.current = { id, session: null, items: [], earlier: null, forks: [] };
  markCurrentRow();
  renderHeader();
  $('#transcript').replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let detail;
  try {
    detail = await loadDetail(id, anchor?.seq);
  } catch (e) {
    if (opening !== state.opening) return;
    if (e.status === 404) {
      toast('That session does not exist (any more).');
      location.hash = '#/';
    } else {
      $('#transcript').replaceChildren(h('p', { class: 'hint', text: `Could not load the session: ${e.message}` }));
    }
    return;
  }
  if (opening !== state.opening) return;
  showDetail(detail);
  if (detail.turn_active) attach(id, snapshotFor(id, detail.items));
  else clearSnapshot();
  // After attach, whose live answer redraws the transcript.
  if (anchor?.top !== undefined) keepOnScreen(anchor);
  else if (anchor) reveal(anchor.seq);
  if (state.inspectorOpen) loadInspector();
}

/** A session's newest page, older ones too down to the item at `through` when given, and
 * for a branch its parent's title and branches (`parent`; null when it cannot be read). */
async function loadDetail(id, through) {
  const detail = await api(`/v1/sessions/${id}?limit=${TRANSCRIPT_PAGE}`);
  while (through !== undefined && detail.earlier && (detail.items[0]?.seq ?? Infinity) > through) {
    // Seqs of items are distinct, so this many reach `through` in one request.
    const limit = Math.min(1000, Math.max(TRANSCRIPT_PAGE, (detail.items[0]?.seq ?? 0) - through));
    const page = await api(`/v1/sessions/${id}?limit=${limit}&before=${detail.earlier.before}`);
    detail.items = [...page.items, ...detail.items];
    detail.earlier = page.earlier ?? null;
  }
  const from = detail.session.forked_from;
  if (from) {
    try {
      const { session, forks } = await api(`/v1/sessions/${from.session_id}?limit=1`);
      detail.parent = { session, forks };
    } catch {
      detail.parent = null; // deleted (its inherited part stays, hidden), or not readable now
    }
  }
  return detail;
}

/** Shows the newest page of a session; older pages already loaded stay above it. */
function showDetail(detail) {
  const previous = state.current?.id === detail.session.id ? state.current : null;
  let items = detail.items;
  let earlier = detail.earlier ?? null;
  const first = items[0]?.seq;
  if (previous && earlier && first !== undefined) {
    const older = previous.items.filter((i) => i.seq < first);
    if (older.length) {
      items = [...older, ...items];
      earlier = previous.earlier;
    }
  }
  state.current = {
    id: detail.session.id,
    session: detail.session,
    items,
    earlier,
    forks: detail.forks ?? [],
    parent: detail.parent,
    requiresAction: detail.requires_action ?? null,
  };
  document.title = `${detail.session.title || 'Untitled'} · turnlog`;
  renderHeader();
  renderTranscript();
}

/** Loads the page of items before the oldest one shown, keeping the view where it is. */
async function loadEarlier() {
  const current = state.current;
  if (!current?.earlier || state.loadingEarlier) return;
  state.loadingEarlier = true;
  showEarlierStatus();
  const opening = state.opening;
  let page;
  try {
    page = await api(`/v1/sessions/${current.id}?limit=${TRANSCRIPT_PAGE}&before=${current.earlier.before}`);
  } catch (e) {
    state.loadingEarlier = false;
    if (state.current === current) showEarlierStatus(`Could not load earlier messages: ${e.message}`);
    return;
  }
  state.loadingEarlier = false;
  if (opening !== state.opening || state.current !== current) return; // another session opened meanwhile
  const first = current.items[0]?.seq ?? Infinity;
  const older = page.items.filter((i) => i.seq < first);
  current.items = [...older, ...current.items];
  current.earlier = page.earlier ?? null;
  const transcript = $('#transcript');
  const fromBottom = transcript.scrollHeight - transcript.scrollTop;
  $('#earlier').after(...older.map((item) => renderItem(item, itemActions)));
  placeBranchNavs();
  transcript.scrollTop = transcript.scrollHeight - fromBottom;
  showEarlierStatus();
  maybeLoadEarlier();
}

/** The marker above the oldest item shown: a button for older items, or nothing. */
function showEarlierStatus(error = '') {
  const marker = $('#earlier');
  if (!marker) return;
  const more = !!state.current?.earlier;
  marker.hidden = !more && !error;
  marker.dataset.complete = String(!more);
  const button = marker.querySelector('button');
  button.hidden = !more || state.loadingEarlier;
  marker.querySelector('.hint').textContent = error || (state.loadingEarlier ? 'Loading earlier messages…' : '');
}

/** Loads older items when the top of the transcript is in view (also when the items shown
 * do not fill it). */
export function maybeLoadEarlier() {
  const transcript = $('#transcript');
  if (state.current?.earlier && transcript.scrollTop < 200) loadEarlier();
}

/** Reads the open session again (after a turn, a permission answer, …). */
export async function refreshCurrent({ toTop = false } = {}) {
  const id = state.current?.id;
  if (!id) return;
  const opening = state.opening;
  try {
    const detail = await loadDetail(id);
    if (opening !== state.opening || state.current?.id !== id) return;
    showDetail(detail);
    updateListRow(detail.session, { toTop });
  } catch (e) {
    toast(`Could not reload the session: ${e.message}`);
  }
  // A request once sent never changes; only the next one needs reading again.
  if (state.inspectorOpen && !state.inspecting) loadContext();
}

export function renderHeader() {
  const session = state.current?.session;
  $('#chat-title').textContent = state.current ? session?.title || 'Untitled' : 'New chat';
  for (const id of ['#rename', '#export-wrap', '#archive', '#delete', '#more']) $(id).hidden = !session;
  showMenu(false);
  showExportMenu(false);
  $('#archive').textContent = session?.archived ? 'Unarchive' : 'Archive';
  updateComposer();
}

export function lastUserSeq(items) {
  return items.findLast((i) => i.kind === 'user')?.seq ?? 0;
}

function lastAnswerSeq() {
  return state.current?.items.findLast((i) => i.kind === 'assistant')?.seq;
}

const itemActions = {
  answerPermission,
  edit: editMessage,
  branch: branchFrom,
  regenerate,
  isLastAnswer: (item) => item.seq === lastAnswerSeq(),
  showRequest: (item) => inspect(item),
};

export function renderTranscript() {
  const transcript = $('#transcript');
  const items = state.current?.items ?? [];
  const nodes = items.map((item) => renderItem(item, itemActions));
  // A turn running before this page saw it has checkpoints in the log: the newest shows as
  // an `interrupted` item at the end. The live answer stands in for it once it holds the
  // same text (an earlier attempt's partial stays).
  const last = items.at(-1);
  if (state.turn?.reattached && last?.kind === 'interrupted' && last.seq > lastUserSeq(items)) {
    state.turn.checkpoint = { node: nodes.at(-1), text: last.text ?? '' };
  }
  if (state.pendingText !== null) {
    const pending = renderItem({ kind: 'user', text: state.pendingText, ...state.pendingFiles, seq: 0, created_at: new Date().toISOString() });
    pending.classList.add('pending');
    nodes.push(pending);
  }
  if (state.turn) nodes.push(state.turn.view.node);
  else if (state.current?.requiresAction?.some((r) => r.kind === 'tool')) nodes.push(waitingView(state.current.requiresAction, sendToolResults));
  if (!nodes.length && !state.current?.earlier) {
    nodes.push(
      h(
        'div',
        { class: 'empty' },
        h('h2', { text: state.current ? 'Nothing here yet' : 'Start a conversation' }),
        h('p', { text: 'Type below. Enter sends, Shift+Enter adds a line, Esc stops an answer.' }),
      ),
    );
  }
  const earlier = h(
    'div',
    { id: 'earlier', class: 'earlier' },
    h('button', { type: 'button', class: 'quiet', text: 'Load earlier messages', onclick: loadEarlier }),
    h('p', { class: 'hint', 'aria-live': 'polite' }),
  );
  transcript.replaceChildren(earlier, ...nodes);
  placeBranchNavs();
  showEarlierStatus();
  transcript.scrollTop = transcript.scrollHeight;
  updateComposer();
  maybeLoadEarlier();
}

async function answerPermission(item, decision) {
  const { id, tool } = item.permission;
  const current = state.current;
  // A turn paused on this prompt goes on with the answer: follow it.
  if (!state.turn && current.requiresAction?.some((r) => r.permission_id === id)) {
    current.items = current.items.filter((i) => i.kind !== 'permission' || i.permission?.id !== id);
    answerPaused(id, decision);
    return;
  }
  try {
    await api(`/v1/sessions/${current.id}/permissions/${encodeURIComponent(id)}`, {
      method: 'POST',
      body: { decision },
    });
    // An answered request leaves the transcript, also from an older page kept on screen.
    current.items = current.items.filter((i) => i.kind !== 'permission' || i.permission?.id !== id);
    toast(decision === 'deny' ? `Denied ${tool}.` : `Allowed ${tool}.`, 'info');
  } catch (e) {
    toast(`Could not answer: ${e.message}`);
  }
  refreshCurrent();
}
