// The snapshot: what this tab has of the running turn, saved together with the id of the
// last event it holds, so after a reload the stream resumes right after it.

import { lastUserSeq } from './session.js';
import { state } from './state.js';

// The turn being streamed, kept per tab so a reload continues after its last event.
const SNAPSHOT_KEY = 'turnlog.turn';
const SNAPSHOT_MAX_AGE_MS = 120_000;
const SNAPSHOT_EVERY_MS = 250;

let snapshotTimer = 0;
let snapshotTurn = null;

export function saveSnapshotSoon(turn) {
  snapshotTurn = turn;
  if (turn.ended) {
    clearSnapshot();
    return;
  }
  if (!snapshotTimer) snapshotTimer = setTimeout(saveSnapshotNow, SNAPSHOT_EVERY_MS);
}

export function saveSnapshotNow() {
  clearTimeout(snapshotTimer);
  snapshotTimer = 0;
  const t = snapshotTurn;
  if (!t || t.ended || state.turn !== t) return;
  const snapshot = {
    sessionId: t.sessionId,
    userSeq: t.userSeq,
    lastId: t.lastId,
    text: t.text,
    reasoning: t.reasoning,
    savedAt: Date.now(),
  };
  try {
    sessionStorage.setItem(SNAPSHOT_KEY, JSON.stringify(snapshot));
  } catch {
    // Storage full or refused: a reload then replays the turn from its start.
  }
}

export function clearSnapshot() {
  clearTimeout(snapshotTimer);
  snapshotTimer = 0;
  snapshotTurn = null;
  sessionStorage.removeItem(SNAPSHOT_KEY);
}

/** The saved snapshot when it belongs to the turn now running in `sessionId`: same session,
 * same question, saved moments ago. Otherwise null, and the turn is replayed from its start. */
export function snapshotFor(sessionId, items) {
  let snapshot;
  try {
    snapshot = JSON.parse(sessionStorage.getItem(SNAPSHOT_KEY) ?? 'null');
  } catch {
    return null;
  }
  const fits =
    snapshot?.sessionId === sessionId &&
    Date.now() - snapshot.savedAt < SNAPSHOT_MAX_AGE_MS &&
    snapshot.userSeq === lastUserSeq(items);
  return fits ? snapshot : null;
}
