// What turnlog stored, read through its native API (docs/api.md): the owner's sessions,
// each session's own events (a fork's log also shows its ancestors' events up to the fork
// point: those are not its own), and the audited model requests (DESIGN §11). The tests
// run one at a time (run.mjs), so the sessions that appear during a test are the test's.
import assert from 'node:assert/strict';

export const BASE = process.env.TURNLOG_BASE;
export const TOKEN = process.env.TURNLOG_TOKEN;
export const V1 = `${BASE}/v1`;
if (!BASE || !TOKEN) throw new Error('TURNLOG_BASE and TURNLOG_TOKEN are not set: start the tests with ./run');

/** The model `turnlog dev` answers with (its built-in mock). */
export const MODEL = 'mock';

/** A user message the mock answers with a few words (the directive stays in the text). */
export const question = (text) => `${text} [mock words=6]`;

export async function get(path) {
  const res = await fetch(`${V1}${path}`, { headers: { authorization: `Bearer ${TOKEN}` } });
  const body = await res.text();
  assert.equal(res.status, 200, `GET /v1${path}: ${res.status} ${body}`);
  return JSON.parse(body);
}

/** Every session id the owner has, through every page of the list. */
export async function sessionIds() {
  const ids = new Set();
  let query = 'limit=200';
  for (;;) {
    const page = await get(`/sessions?${query}`);
    for (const s of page.sessions) ids.add(s.id);
    if (!page.next) return ids;
    query = `limit=200&${new URLSearchParams(page.next)}`;
  }
}

/** A session's own events (not its ancestors'), in order. */
export async function ownEvents(id) {
  const events = [];
  let after = null;
  for (;;) {
    const page = await get(`/sessions/${id}/events?limit=1000${after === null ? '' : `&after=${after}`}`);
    events.push(...page.events.filter((e) => e.session_id === id));
    if (page.next_after === null || page.next_after === undefined) return events;
    after = page.next_after;
  }
}

const text = (content) =>
  typeof content === 'string'
    ? content
    : (content ?? []).map((p) => p.text ?? '').join('');

/** The messages stored since `before` (a set of session ids): the new sessions, oldest
 * first, and their own user messages and answers, in order. */
export async function storedSince(before) {
  const fresh = [...(await sessionIds())].filter((id) => !before.has(id)).sort();
  const users = [];
  const answers = [];
  const turns = []; // {session, seq} of each answer, for its audited request
  for (const id of fresh) {
    for (const e of await ownEvents(id)) {
      if (e.kind === 'user_message') users.push(e.payload.text);
      if (e.kind === 'assistant_turn') {
        answers.push(text(e.payload.llm?.message?.content));
        turns.push({ session: id, seq: e.seq });
      }
    }
  }
  return { sessions: fresh, users, answers, turns };
}

/** Asserts that exactly `sessions` sessions appeared since `before` and that together they
 * hold exactly these user messages and answers, each once, in order. */
export async function assertStoredOnce(before, { users, answers, sessions = 1 }) {
  assert.ok(answers.every((a) => typeof a === 'string' && a !== ''), `the client got every answer: ${JSON.stringify(answers)}`);
  // An answer's event may land a moment after its response ends: wait (a little) for
  // fewer answers than expected, never for more.
  let stored = await storedSince(before);
  for (let i = 0; i < 20 && stored.answers.length < answers.length; i++) {
    await new Promise((r) => setTimeout(r, 100));
    stored = await storedSince(before);
  }
  const seen = JSON.stringify(stored, null, 1);
  assert.equal(stored.sessions.length, sessions, `expected ${sessions} new session(s); stored: ${seen}`);
  assert.deepEqual(stored.users, users, `the user messages, each once; stored: ${seen}`);
  assert.deepEqual(stored.answers, answers, `the answers, each once; stored: ${seen}`);
  return stored;
}

/** The request turnlog sent the model for the answer at `seq` (rebuilt from the log). */
export async function modelRequest(session, seq) {
  const audit = await get(`/sessions/${session}/requests/${seq}`);
  assert.ok(audit.verified, `the audited request of ${session}/${seq} does not verify: ${JSON.stringify(audit)}`);
  return audit.body;
}

/** What turnlog adds to a model request besides the conversation, as user messages: the
 * per-turn extras (today's date, recall) and the distiller's turn memories (DESIGN §3). */
const addedByTurnlog = (content) =>
  content.startsWith('[context for this turn; not part of the conversation]') || /^\[turn memory of turn #\d+\]/.test(content);

/** Asserts that every stored answer was asked for with `system` as (part of) the system
 * prompt, and with the conversation so far — each earlier message once — after it. */
export async function assertModelSaw(stored, system) {
  for (const [i, { session, seq }] of stored.turns.entries()) {
    const body = await modelRequest(session, seq);
    const systemText = body.messages
      .filter((m) => m.role === 'system')
      .map((m) => text(m.content))
      .join('\n');
    assert.ok(systemText.includes(system), `answer ${i + 1}'s request lacks the system prompt: ${JSON.stringify(body.messages)}`);
    const conversation = body.messages
      .filter((m) => m.role !== 'system' && !addedByTurnlog(text(m.content)))
      .map((m) => [m.role, text(m.content)]);
    const expected = [];
    for (let j = 0; j <= i; j++) {
      expected.push(['user', stored.users[j]]);
      if (j < i) expected.push(['assistant', stored.answers[j]]);
    }
    assert.deepEqual(conversation, expected, `answer ${i + 1}'s request to the model`);
  }
}

/** A fetch that records each JSON request body it sends (what the client put on the wire). */
export function recordingFetch() {
  const bodies = [];
  const wrapped = async (url, init = {}) => {
    if (typeof init.body === 'string') bodies.push({ url: String(url), body: JSON.parse(init.body) });
    return fetch(url, init);
  };
  return { fetch: wrapped, bodies };
}

/** A session id without dashes, as in `conv_<32 hex>`. */
export const hex = (id) => id.replaceAll('-', '');
