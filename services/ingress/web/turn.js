// Streaming a turn: send, retry, or re-attach to one that runs; and the composer, whose
// buttons follow whether a turn streams.

import { api, ApiError } from './api.js';
import { restoreTray, takeTray, trayContents } from './attachments.js';
import { attachmentIds, followBranch } from './branches.js';
import { $, h, sleep, toast } from './dom.js';
import { renderMarkdown } from './markdown.js';
import { markCurrentRow, updateListRow } from './session-list.js';
import { refreshCurrent, renderHeader, renderTranscript } from './session.js';
import { clearSnapshot, saveSnapshotSoon } from './snapshot.js';
import { readEvents } from './sse.js';
import { state } from './state.js';
import { liveView, permissionCard } from './transcript.js';

const RECONNECTS = 3;
const TITLE_CHARS = 60;
// A session's turn lease outlives its turn when the holder died (it expires by itself in
// about 10 s), so a send refused while nothing streams is tried again for this long.
const BUSY_WAIT_MS = 15_000;

function scheduleRender(turn) {
  if (turn.view.frame) return;
  turn.view.frame = requestAnimationFrame(() => {
    turn.view.frame = 0;
    drawLive(turn);
  });
}

function drawLive(turn) {
  const v = turn.view;
  const transcript = $('#transcript');
  const atBottom = transcript.scrollTop + transcript.clientHeight >= transcript.scrollHeight - 80;
  v.reasoning.hidden = !turn.reasoning;
  v.reasoningText.textContent = turn.reasoning;
  v.md.replaceChildren(renderMarkdown(turn.text));
  if (turn.checkpoint) turn.checkpoint.node.hidden = turn.text.startsWith(turn.checkpoint.text);
  v.errors.replaceChildren(...turn.errors.map((e) => h('p', { class: 'error-line', text: `${e.code}: ${e.message}` })));
  // This stream's tool traffic in order: each call the model makes, each prompt a server
  // tool raises (answered here, the turn goes on on this stream), each result.
  v.tools.replaceChildren(
    ...turn.tools.map((t) => {
      if (t.kind === 'call') return h('p', { class: 'tool-line', text: `Tool call: ${t.name}(${t.arguments})` });
      if (t.kind === 'result') return h('p', { class: 'tool-line', text: `Result of ${t.call_id}: ${t.status}${t.digest ? ` — ${t.digest}` : ''}` });
      if (t.answered) return h('p', { class: 'tool-line', text: `${t.answered === 'deny' ? 'Denied' : 'Allowed'} ${t.tool}` });
      return permissionCard(t, (decision) => answerLive(turn, t, decision));
    }),
  );
  const started = turn.text || turn.reasoning;
  const asking = turn.tools.some((t) => t.kind === 'permission' && !t.answered);
  const done = new Set(turn.tools.filter((t) => t.kind === 'result').map((t) => t.call_id));
  const running = turn.tools.some((t) => t.kind === 'call' && t.source !== 'client' && !done.has(t.call_id));
  v.status.textContent = turn.stopping
    ? 'Stopping…'
    : asking
      ? 'Waiting for your answer…'
      : running
        ? 'Running tools…'
        : started
          ? 'Answering…'
          : turn.waiting
            ? 'Waiting for the previous turn to end…'
            : 'Waiting for the model…';
  if (atBottom) transcript.scrollTop = transcript.scrollHeight;
}

/** Runs one turn's stream in the open session. `open(signal)` makes the first request;
 * later ones re-attach after the last event received. Resolves with the error that kept
 * the turn from starting, if any. */
export async function runTurn(sessionId, open, { resume = null, reattached = false, through } = {}) {
  const turn = {
    sessionId,
    reattached,
    through,
    checkpoint: null,
    text: resume?.text ?? '',
    reasoning: resume?.reasoning ?? '',
    lastId: resume?.lastId ?? 0,
    userSeq: resume?.userSeq ?? null,
    errors: [],
    tools: [],
    ended: null,
    stopping: false,
    controller: new AbortController(),
    view: liveView(),
  };
  state.turn = turn;
  renderTranscript();
  drawLive(turn);

  let failed = null;
  try {
    await follow(turn, open);
  } catch (e) {
    if (turn.controller.signal.aborted) return null; // the user left; the turn goes on without us
    failed = e;
  }
  if (state.turn !== turn) return failed;
  state.turn = null;
  state.pendingText = null;
  state.pendingFiles = null;
  clearSnapshot();
  updateComposer();
  if (failed) toast(failed instanceof ApiError ? failed.message : `The answer stream was lost: ${failed.message}`);
  await refreshCurrent({ toTop: true });
  return failed;
}

async function follow(turn, open) {
  const { signal } = turn.controller;
  const onEvent = (e) => onTurnEvent(turn, e);
  let res = await open(signal, turn); // an error here (409, 503, …) means no turn started
  for (let failures = 0; ; ) {
    if (res?.status === 204) return; // no turn runs (any more)
    if (res) {
      try {
        await readEvents(res.body, onEvent);
      } catch (e) {
        if (signal.aborted) throw e;
      }
    }
    if (turn.ended) return;
    // The connection dropped before `end`; the turn goes on at the server.
    if (++failures > RECONNECTS) throw new Error('the server stopped answering');
    await sleep(400 * failures);
    try {
      res = await api(`/v1/sessions/${turn.sessionId}/stream`, {
        raw: true,
        signal,
        headers: turn.lastId ? { 'Last-Event-ID': String(turn.lastId) } : {},
      });
    } catch (e) {
      if (signal.aborted) throw e;
      res = null;
    }
  }
}

/** Makes a send or retry request, again while the session's lease is held by a turn that
 * no longer streams (see BUSY_WAIT_MS). A turn that does stream belongs to someone else:
 * its 409 stands. */
export async function whenFree(turn, request) {
  const { signal } = turn.controller;
  const until = Date.now() + BUSY_WAIT_MS;
  for (;;) {
    try {
      return await request(signal);
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 409) || Date.now() > until) throw e;
      const running = await api(`/v1/sessions/${turn.sessionId}/stream`, { raw: true, signal });
      if (running.status !== 204) {
        running.body?.cancel();
        throw e;
      }
      const { turn_active: held } = await api(`/v1/sessions/${turn.sessionId}?limit=1`, { signal });
      if (!held) throw e; // a conflict of another kind, such as nothing to retry
      turn.waiting = true;
      scheduleRender(turn);
      await sleep(1000);
    }
  }
}

function onTurnEvent(turn, event) {
  const id = Number(event.id);
  if (Number.isFinite(id) && id > 0) {
    if (id <= turn.lastId) return; // already have it
    turn.lastId = id;
  }
  let data = {};
  try {
    data = JSON.parse(event.data);
  } catch {
    return;
  }
  switch (event.event) {
    case 'meta':
      turn.userSeq = data.user_seq ?? null;
      if (turn.through !== undefined && data.session_id && data.session_id !== turn.sessionId) followBranch(turn, data.session_id);
      break;
    case 'delta':
      turn.text += data.text ?? '';
      break;
    case 'reasoning':
      turn.reasoning += data.text ?? '';
      break;
    case 'error':
      turn.errors.push(data);
      break;
    case 'tool_call':
      turn.tools.push({ kind: 'call', ...data });
      break;
    case 'permission':
      turn.tools.push({ kind: 'permission', ...data });
      break;
    case 'tool_result':
      turn.tools.push({ kind: 'result', ...data });
      break;
    case 'end':
      turn.ended = data;
      break;
    default:
      return;
  }
  saveSnapshotSoon(turn);
  scheduleRender(turn);
}

/** Answers a prompt of the turn being streamed: the turn hears it and goes on here. */
async function answerLive(turn, prompt, decision) {
  try {
    await api(`/v1/sessions/${turn.sessionId}/permissions/${encodeURIComponent(prompt.id)}`, { method: 'POST', body: { decision } });
    prompt.answered = decision;
  } catch (e) {
    toast(`Could not answer: ${e.message}`);
  }
  scheduleRender(turn);
}

/** Answers the prompt a paused turn waits for and follows the turn as it goes on (the
 * answer's response is its stream; JSON when the turn runs elsewhere, which the
 * re-attach then follows). */
export function answerPaused(permissionId, decision) {
  const id = state.current?.id;
  if (!id || state.turn) return;
  runTurn(id, (signal) =>
    api(`/v1/sessions/${id}/permissions/${encodeURIComponent(permissionId)}`, { method: 'POST', body: { decision }, raw: true, signal }),
  );
}

/** Stops reading the open session's stream (the turn itself goes on at the server). */
export function leaveTurn() {
  state.pendingText = null;
  state.pendingFiles = null;
  const turn = state.turn;
  if (!turn) return;
  state.turn = null;
  turn.controller.abort();
  clearSnapshot();
}

export function attach(sessionId, snapshot) {
  const headers = snapshot?.lastId ? { 'Last-Event-ID': String(snapshot.lastId) } : {};
  const open = (signal) => api(`/v1/sessions/${sessionId}/stream`, { raw: true, signal, headers });
  runTurn(sessionId, open, { resume: snapshot, reattached: true });
}

export async function send() {
  const input = $('#message');
  const text = input.value;
  if (state.turn || state.pendingText !== null) return;
  const files = trayContents();
  if (!text.trim()) {
    if (files.images.length || files.documents.length || files.pending) toast('Write a message to go with the attachments.');
    return;
  }
  if (files.pending) {
    toast(`Wait for ${files.pending === 1 ? 'the attachment' : `${files.pending} attachments`} to finish uploading.`);
    return;
  }
  const attached = { images: files.images, documents: files.documents };
  const taken = takeTray();
  state.pendingText = text;
  state.pendingFiles = attached;
  input.value = '';
  autosize();
  let id = state.current?.id;
  if (!id) {
    // A new chat: the session is made on its first message, titled after it.
    const title = text.trim().split('\n')[0].slice(0, TITLE_CHARS).trim();
    let session;
    try {
      session = await api('/v1/sessions', { method: 'POST', body: title ? { title } : {} });
    } catch (e) {
      state.pendingText = null;
      state.pendingFiles = null;
      input.value = text;
      restoreTray(taken);
      toast(`Could not create the session: ${e.message}`);
      return;
    }
    id = session.id;
    state.opening++;
    state.current = { id, session, items: [], earlier: null, forks: [] };
    location.hash = `#/s/${id}`;
    updateListRow(session, { toTop: true });
    markCurrentRow();
    document.title = `${session.title || 'Untitled'} · turnlog`;
    renderHeader();
  }
  const body = { text, ...attachmentIds(attached) };
  const failed = await runTurn(id, (signal, turn) =>
    whenFree(turn, () => api(`/v1/sessions/${id}/messages`, { method: 'POST', body, raw: true, signal })),
  );
  // Nothing was sent: give the text and the attachments back to edit.
  if (failed instanceof ApiError) {
    restoreTray(taken);
    if (!input.value) {
      input.value = text;
      autosize();
    }
  }
}

/** Sends the results a paused turn waits for and follows the turn as it goes on. */
export function sendToolResults(results) {
  const id = state.current?.id;
  if (!id || state.turn) return;
  runTurn(id, (signal) =>
    api(`/v1/sessions/${id}/tool_results`, { method: 'POST', body: { results }, raw: true, signal }),
  );
}

export async function stop() {
  const turn = state.turn;
  if (!turn || turn.stopping) return;
  turn.stopping = true;
  scheduleRender(turn);
  try {
    await api(`/v1/sessions/${turn.sessionId}/stop`, { method: 'POST' });
  } catch (e) {
    if (e.status !== 409) toast(`Could not stop: ${e.message}`);
  }
}

export function retry() {
  const id = state.current?.id;
  if (!id || state.turn) return;
  runTurn(id, (signal, turn) =>
    whenFree(turn, () => api(`/v1/sessions/${id}/retry`, { method: 'POST', raw: true, signal })),
  );
}

function canRetry() {
  const last = state.current?.items.at(-1);
  return !state.turn && (last?.kind === 'interrupted' || last?.kind === 'error');
}

export function updateComposer() {
  const streaming = !!state.turn;
  $('#send').hidden = streaming;
  $('#stop').hidden = !streaming;
  $('#retry').hidden = !canRetry();
  $('#composer').dataset.streaming = String(streaming);
  $('#transcript').dataset.streaming = String(streaming);
}

export function autosize(input = $('#message')) {
  input.style.height = 'auto';
  input.style.height = `${input.scrollHeight}px`;
}
