// The context inspector: what the model would be sent next and its size, or (DESIGN §11)
// what one attempt was sent, rebuilt from the log and checked against the hash recorded
// when it went out.

import { api } from './api.js';
import { $, fmt, h } from './dom.js';
import { state } from './state.js';

/** Counts the inspector's loads: one overtaken by a newer load draws nothing. */
let inspectorLoads = 0;

function contentText(content) {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return JSON.stringify(content);
  return content.map(partText).join('\n\n');
}

/** A content part as text. An image sent as a data URL shows its type and size, not its
 * bytes; one the context only refers to shows its id. */
function partText(part) {
  if (part.type === 'text') return part.text;
  if (part.type === 'image_url') {
    const url = part.image_url?.url ?? '';
    const data = /^data:([^;,]*)[^,]*,/.exec(url);
    return data ? `[image ${data[1]}, ${fmt(url.length - data[0].length)} characters of base64]` : `[image ${url}]`;
  }
  return `[${part.type} ${part.id ?? ''} ${part.mime ?? ''}]`;
}

/** Where the provider's cache ended in a request it billed `input` tokens for, `cached` of
 * them from its cache. A provider caches a prefix of the request but says only how long it
 * was, so each message's tokens are estimated as its share of `input` by length (role and
 * text), summed in order: the prefix ends in the message where the sum reaches `cached`.
 * Returns that message's index, -1 when nothing was cached. Lengths stand in for tokens, so
 * the place is approximate; the counts shown beside it are the provider's own. */
function cacheEndsIn(messages, input, cached) {
  if (!(cached > 0) || !(input > 0) || !messages.length) return -1;
  const lengths = messages.map((m) => m.role.length + contentText(m.content).length + 2);
  const total = lengths.reduce((a, b) => a + b, 0);
  let sum = 0;
  for (const [i, length] of lengths.entries()) {
    sum += length;
    if ((sum / total) * input >= cached) return i;
  }
  return messages.length - 1;
}

/** A request's messages, role and text (a long one scrolls in its box). With `cache`
 * (`{end, note}`), the messages through `end` are marked as served from the provider's
 * cache, and a line where that prefix ends says so. */
function messageList(messages, cache = null) {
  return h(
    'ol',
    { class: 'ctx-messages' },
    messages.map((m, i) => {
      const cached = cache && i <= cache.end;
      return h(
        'li',
        { class: `ctx-msg role-${m.role}`, dataset: cached ? { cache: i < cache.end ? 'all' : 'part' } : undefined },
        h('span', { class: 'role', text: m.role }),
        cached ? h('span', { class: 'cached-tag', text: i < cache.end ? 'cached' : 'partly cached' }) : null,
        h('pre', { text: contentText(m.content) }),
        cached && i === cache.end ? h('p', { class: 'cache-end', text: cache.note }) : null,
      );
    }),
  );
}

/** Shows the next request, or the one the inspected attempt sent. */
export function loadInspector() {
  const sent = state.inspecting;
  $('#inspector-title').textContent = sent ? `What was sent for #${sent.item.seq}` : 'What the model sees next';
  $('#inspector-next').hidden = !sent;
  return sent ? loadRequest(sent) : loadContext();
}

/** Opens the inspector on the request `item`'s attempt sent, or (null) on the next one. */
export function inspect(item) {
  state.inspecting = item && state.current ? { sessionId: state.current.id, item } : null;
  toggleInspector(true);
  if (!item) return;
  // The inspector's column narrows the transcript: keep the answer asked about in view.
  $(`#transcript > [data-seq="${item.seq}"]`)?.scrollIntoView({ block: 'nearest' });
  $('#inspector-title').focus({ preventScroll: true });
}

export async function loadContext() {
  const load = ++inspectorLoads;
  const body = $('#inspector-body');
  const id = state.current?.id;
  if (!id) {
    body.replaceChildren(h('p', { class: 'hint', text: 'Open a session to see what the model is sent.' }));
    return;
  }
  body.replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let ctx;
  try {
    ctx = await api(`/v1/sessions/${id}/context`);
  } catch (e) {
    if (load === inspectorLoads) body.replaceChildren(h('p', { class: 'hint', text: `Could not load the context: ${e.message}` }));
    return;
  }
  if (load !== inspectorLoads || state.current?.id !== id) return;
  const share = ctx.budget ? Math.min(100, (ctx.tokens / ctx.budget) * 100) : 0;
  const fill = h('div', { class: 'fill' });
  fill.style.width = `${share}%`; // CSSOM, which the style policy allows (attributes it would not)
  const meter = h(
    'div',
    { class: 'meter', role: 'meter', 'aria-valuemin': 0, 'aria-valuemax': ctx.budget, 'aria-valuenow': ctx.tokens, 'aria-label': 'Tokens against the budget' },
    fill,
  );
  meter.classList.toggle('high', share >= 85);
  const facts = [
    ['Model', ctx.model],
    ['Context window', ctx.window ? `${fmt(ctx.window)} tokens` : 'unknown'],
    ['Summarized through', ctx.compacted_through ? `#${ctx.compacted_through}` : 'nothing yet'],
    ['Messages', fmt(ctx.messages.length)],
  ];
  const extras = ctx.extras ?? {};
  const parts = [
    h('p', { class: 'ctx-tokens', text: `${fmt(ctx.tokens)} of ${fmt(ctx.budget)} tokens (${share.toFixed(0)}%)` }),
    meter,
    h('dl', { class: 'facts' }, facts.map(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })])),
    ctx.system
      ? h('details', { class: 'ctx-system' }, h('summary', { text: 'System prompt' }), h('pre', { text: ctx.system }))
      : h('p', { class: 'dim', text: 'No system prompt (TURNLOG_SYSTEM_PROMPT is empty).' }),
    extras.date || extras.memories?.length
      ? h(
          'details',
          { class: 'ctx-extras' },
          h('summary', { text: 'Extras for this turn' }),
          extras.date ? h('p', { text: `Date: ${extras.date}` }) : null,
          extras.memories?.length ? h('ul', {}, extras.memories.map((m) => h('li', { text: m }))) : null,
        )
      : null,
    messageList(ctx.messages),
  ];
  body.replaceChildren(...parts.filter(Boolean));
}

/** The request an attempt sent (GET /requests/{seq}): its messages and parameters as the
 * server rebuilt them from the log, whether those bytes hash to what was recorded when it
 * was sent, and how much of it the provider served from its cache (the answer's usage). */
async function loadRequest({ sessionId, item }) {
  const load = ++inspectorLoads;
  const body = $('#inspector-body');
  body.replaceChildren(h('p', { class: 'hint', text: 'Loading…' }));
  let sent;
  try {
    sent = await api(`/v1/sessions/${sessionId}/requests/${item.seq}`);
  } catch (e) {
    if (load !== inspectorLoads) return;
    // Imported answers, those from before requests were recorded, and attempts that failed
    // before sending have none: that is an answer, not an error.
    const text =
      e.status === 404
        ? `No request recorded for this ${item.kind === 'error' ? 'attempt' : 'answer'}.`
        : `Could not load the request: ${e.message}`;
    body.replaceChildren(h('p', { class: 'hint sent-none', text }));
    return;
  }
  if (load !== inspectorLoads) return;
  const { model, messages = [], ...params } = sent.body;
  const input = item.usage?.input_tokens;
  const cached = item.usage?.cached_input_tokens;
  const known = typeof cached === 'number' && input > 0;
  const end = known ? cacheEndsIn(messages, input, cached) : -1;
  const share = known ? `${fmt(cached)} of ${fmt(input)} input tokens` : '';
  const facts = [
    ['Model', model ?? sent.model],
    ['Messages', fmt(messages.length)],
    ...Object.entries(params).map(([k, v]) => [k, typeof v === 'string' ? v : JSON.stringify(v)]),
  ];
  const parts = [
    h(
      'div',
      { class: 'sent-check', dataset: { verified: String(sent.verified) } },
      h('span', { class: 'verdict', text: sent.verified ? '✓ Verified' : '✗ Not verified' }),
      h('span', {
        text: sent.verified
          ? 'Rebuilt from the log, these are the exact bytes sent.'
          : 'Rebuilt from the log, these are not the bytes sent: the code that builds requests has changed since.',
      }),
      h('span', { class: 'sha' }, 'SHA-256 ', h('code', { text: sent.body_sha256 })),
    ),
    h('p', { class: 'ctx-tokens', text: `${fmt(sent.tokens)} tokens, as the budget counted them` }),
    known
      ? h('p', {
          class: 'cache-share',
          text: cached > 0 ? `${share} were served from the provider's cache (${Math.round((cached / input) * 100)}%).` : `None of the ${fmt(input)} input tokens came from the provider's cache.`,
        })
      : item.usage
        ? h('p', { class: 'dim', text: 'The provider did not say how much of this request it had cached.' })
        : null,
    h('dl', { class: 'facts' }, facts.map(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })])),
    messageList(messages, end >= 0 ? { end, note: `The provider's cache ends about here (${share}, placed by length).` } : null),
  ];
  body.replaceChildren(...parts.filter(Boolean));
}

export function toggleInspector(open = !state.inspectorOpen) {
  state.inspectorOpen = open;
  document.body.classList.toggle('inspecting', open);
  $('#inspector').hidden = !open;
  $('#context-toggle').setAttribute('aria-pressed', String(open));
  if (open) loadInspector();
}
