// Transcript items as DOM (DESIGN.md §3: user, assistant, tool, permission, compaction,
// interrupted, error), and the live answer of a streaming turn. Model and user text go
// through the safe markdown renderer or into text nodes, never through HTML parsing.

import { attachmentsOf } from './attachments.js';
import { fmt, h, time } from './dom.js';
import { renderMarkdown } from './markdown.js';

/** One item. `actions` (absent for a message not yet stored): `answerPermission(item,
 * decision)` answers a permission prompt; `edit(item, node)`, `branch(item)` and
 * `regenerate(item)` start a branch from a message, the last for `isLastAnswer(item)` only;
 * `showRequest(item)` opens what an answer's attempt (or a failed one's) sent (§11). */
export function renderItem(item, actions) {
  const render = RENDERERS[item.kind] ?? renderUnknown;
  const node = render(item, actions);
  node.dataset.kind = item.kind;
  node.dataset.seq = String(item.seq);
  return node;
}

/** Names of the apps messages are imported from (`imported.source`). */
const SOURCES = { chatgpt: 'ChatGPT', sharegpt: 'ShareGPT', turnlog: 'turnlog' };

/** The line under an item: `parts`, its seq and its time. An imported message shows its
 * original time (when the export kept one) and where it came from. */
function meta(item, ...parts) {
  const imported = item.imported;
  let origin = null;
  if (imported) {
    const source = SOURCES[imported.source] ?? imported.source ?? 'another app';
    origin = h('span', {
      class: 'imported-tag',
      text: `imported from ${source}`,
      title: `Imported ${new Date(item.created_at).toLocaleString()}${imported.id ? ` (id ${imported.id} there)` : ''}`,
    });
  }
  return h(
    'div',
    { class: 'meta' },
    ...parts.filter(Boolean).map((p) => (typeof p === 'string' ? h('span', { text: p }) : p)),
    item.seq ? h('span', { class: 'seq', text: `#${item.seq}` }) : null,
    time(imported?.created_at ?? item.created_at),
    origin,
  );
}

/** The buttons under a stored message (`kind` 'user', 'answer' or 'failed'): those that
 * branch the conversation from it, and for an attempt the request it sent. */
function tools(item, actions, kind) {
  if (!actions || !(item.seq > 0)) return null;
  const tool = (text, label, run) => h('button', { type: 'button', class: 'quiet', text, 'aria-label': label, onclick: run });
  const what = kind === 'failed' ? 'failed attempt' : 'answer';
  const sent = tool('What was sent', `What was sent for ${what} #${item.seq}`, () => actions.showRequest(item));
  const buttons =
    kind === 'user'
      ? [tool('Edit', `Edit message #${item.seq}`, (e) => actions.edit(item, e.currentTarget.closest('.item')))]
      : kind === 'failed'
        ? [sent]
        : [
            tool('Branch from here', `Branch from here: answer #${item.seq}`, () => actions.branch(item)),
            actions.isLastAnswer(item) ? tool('Regenerate', `Regenerate answer #${item.seq}`, () => actions.regenerate(item)) : null,
            sent,
          ];
  return h('span', { class: 'tools' }, buttons);
}

function markdown(text) {
  const div = h('div', { class: 'md' });
  div.append(renderMarkdown(text));
  return div;
}

function reasoningBlock(text, open = false) {
  return h(
    'details',
    { class: 'reasoning', open },
    h('summary', { text: 'Reasoning' }),
    h('div', { class: 'reasoning-text', text }),
  );
}

function json(value) {
  return h('pre', { class: 'json', text: JSON.stringify(value, null, 2) });
}

function usageText(usage) {
  if (!usage) return null;
  let text = `${fmt(usage.input_tokens)} in · ${fmt(usage.output_tokens)} out`;
  if (usage.cached_input_tokens) text += ` · ${fmt(usage.cached_input_tokens)} cached`;
  return text;
}

function durationText(ms) {
  if (ms === undefined || ms === null) return null;
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
}

const smallCost = new Intl.NumberFormat(undefined, { maximumSignificantDigits: 3 });
const cost = new Intl.NumberFormat(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 2 });

function costText(item) {
  if (item.cost === undefined || item.cost === null) return null;
  const amount = item.cost < 1 ? smallCost.format(item.cost) : cost.format(item.cost);
  return `${amount} ${item.currency ?? ''}`.trim();
}

const RENDERERS = {
  user(item, actions) {
    return h(
      'article',
      { class: 'item user' },
      attachmentsOf(item),
      h('div', { class: 'bubble' }, h('div', { class: 'text', text: item.text ?? '' })),
      meta(item, tools(item, actions, 'user')),
    );
  },

  assistant(item, actions) {
    const blocks = item.blocks?.length ? item.blocks : [{ type: 'text', text: item.text ?? '' }];
    const body = blocks.map((b) => {
      switch (b.type) {
        case 'reasoning':
          return reasoningBlock(b.text ?? '');
        case 'text':
          return markdown(b.text ?? '');
        case 'tool_call': {
          const call = b.meta ?? {};
          return h(
            'div',
            { class: 'tool-call' },
            h('span', { class: 'label', text: 'Tool call' }),
            ' ',
            h('strong', { text: call.name ?? '?' }),
            call.call_id ? h('code', { class: 'dim', text: ` ${call.call_id}` }) : null,
            json(typeof call.arguments === 'string' ? parseJson(call.arguments) : (call.arguments ?? b.text)),
          );
        }
        default:
          return null; // meta blocks carry nothing to read
      }
    });
    return h(
      'article',
      { class: 'item assistant' },
      h('div', { class: 'bubble' }, body),
      meta(item, item.model, usageText(item.usage), durationText(item.duration_ms), costText(item), tools(item, actions, 'answer')),
    );
  },

  tool(item) {
    const t = item.tool ?? {};
    const digest = t.result_digest ?? '';
    return h(
      'article',
      { class: 'item tool', dataset: { callId: t.call_id ?? '' } },
      h(
        'details',
        { class: 'card' },
        h(
          'summary',
          {},
          h('span', { class: 'label', text: 'Tool' }),
          h('strong', { text: t.name ?? '?' }),
          h('span', { class: `status status-${t.status}`, text: t.status ?? '' }),
          digest ? h('span', { class: 'digest', text: digest }) : null,
          durationText(t.duration_ms) ? h('span', { class: 'dim', text: durationText(t.duration_ms) }) : null,
        ),
        t.args !== undefined ? h('div', {}, h('h4', { text: 'Arguments' }), json(t.args)) : null,
        t.output ? h('div', {}, h('h4', { text: 'Output' }), h('pre', { class: 'tool-output', text: t.output })) : null,
      ),
      meta(item),
    );
  },

  permission(item, actions) {
    return h('article', { class: 'item permission' }, permissionCard(item.permission ?? {}, (decision) => actions.answerPermission(item, decision)), meta(item));
  },

  compaction(item) {
    return h(
      'div',
      { class: 'item compaction', role: 'separator' },
      h(
        'details',
        {},
        h('summary', { text: `older messages summarized through #${item.through_seq}` }),
        h('div', { class: 'summary', text: item.text ?? '' }),
      ),
    );
  },

  interrupted(item, actions) {
    const stopped = item.reason === 'stopped';
    const node = h(
      'article',
      { class: 'item assistant interrupted' },
      h(
        'div',
        { class: 'bubble' },
        markdown(item.text ?? ''),
        h('div', { class: 'ending', text: stopped ? 'Stopped by you' : 'Interrupted mid-answer' }),
      ),
      meta(item, tools(item, actions, 'answer')),
    );
    node.dataset.reason = item.reason ?? 'interrupted';
    return node;
  },

  error(item, actions) {
    return h(
      'article',
      { class: 'item error' },
      h(
        'div',
        { class: 'card' },
        h('div', { class: 'card-head' }, h('span', { class: 'label', text: 'The answer failed' }), h('code', { text: item.code ?? '' })),
        h('p', { text: item.text ?? '' }),
      ),
      meta(item, tools(item, actions, 'failed')),
    );
  },
};

/** A server tool's permission prompt (DESIGN §14): the tool, its danger level, why the
 * model asks, its arguments, and the answers — `answer(decision)` with `allow`,
 * `allow_always` (this tool for the rest of the session) or `deny`. */
export function permissionCard(p, answer) {
  const decide = (decision, button) => {
    for (const b of button.parentElement.querySelectorAll('button')) b.disabled = true;
    answer(decision);
  };
  return h(
    'div',
    { class: 'card permission-card' },
    h(
      'div',
      { class: 'card-head' },
      h('span', { class: 'label', text: 'Permission needed' }),
      h('strong', { text: p.tool ?? '?' }),
      h('span', { class: `badge danger-${p.danger_level}`, text: p.danger_level ?? '' }),
    ),
    p.rationale ? h('p', { text: p.rationale }) : null,
    json(p.args ?? {}),
    h(
      'div',
      { class: 'actions' },
      h('button', { class: 'primary', text: 'Allow', onclick: (e) => decide('allow', e.currentTarget) }),
      h('button', { text: 'Always allow', title: 'Allow this tool for the rest of the session', onclick: (e) => decide('allow_always', e.currentTarget) }),
      h('button', { class: 'danger', text: 'Deny', onclick: (e) => decide('deny', e.currentTarget) }),
    ),
  );
}

/** A turn paused for the client's tools (DESIGN §14): what it waits for, each call with a
 * box for its result, and the button that sends them and follows the turn as it goes on. */
export function waitingView(required, send) {
  const calls = required.filter((r) => r.kind === 'tool');
  const boxes = calls.map((c) =>
    h('textarea', { class: 'tool-result-input', rows: 2, placeholder: `Result of ${c.name}`, 'aria-label': `Result of ${c.name} (${c.call_id})` }),
  );
  const errors = calls.map((c) => h('input', { type: 'checkbox', 'aria-label': `${c.name} failed` }));
  const button = h('button', {
    class: 'primary',
    text: calls.length === 1 ? 'Send result' : 'Send results',
    onclick: () => {
      button.disabled = true;
      send(calls.map((c, i) => ({ call_id: c.call_id, output: boxes[i].value, is_error: errors[i].checked })));
    },
  });
  return h(
    'article',
    { class: 'item waiting', dataset: { kind: 'waiting' } },
    h(
      'div',
      { class: 'card' },
      h(
        'div',
        { class: 'card-head' },
        h('span', { class: 'label', text: 'Paused' }),
        h('strong', { text: `Waiting for ${calls.length === 1 ? 'a tool result' : `${calls.length} tool results`}` }),
      ),
      ...calls.map((c, i) =>
        h(
          'div',
          { class: 'waiting-call' },
          h('div', {}, h('strong', { text: c.name }), h('code', { class: 'dim', text: ` ${c.call_id}` })),
          json(parseJson(c.arguments)),
          boxes[i],
          h('label', { class: 'dim' }, errors[i], ' the tool failed'),
        ),
      ),
      h('div', { class: 'actions' }, button),
    ),
  );
}

function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function renderUnknown(item) {
  return h('article', { class: 'item unknown' }, h('p', { class: 'dim', text: `(${item.kind})` }), meta(item));
}

/** The answer of the turn being streamed; turn.js fills its parts as events arrive. */
export function liveView() {
  const reasoningText = h('div', { class: 'reasoning-text' });
  const reasoning = h('details', { class: 'reasoning', hidden: true }, h('summary', { text: 'Reasoning…' }), reasoningText);
  const md = h('div', { class: 'md' });
  const errors = h('div', { class: 'live-errors' });
  const tools = h('div', { class: 'live-tools' });
  const status = h('div', { class: 'meta live-status', text: 'Waiting for the model…' });
  const node = h(
    'article',
    { class: 'item assistant live', 'aria-busy': 'true', dataset: { kind: 'live' } },
    h('div', { class: 'bubble' }, reasoning, tools, md, errors),
    status,
  );
  return { node, reasoning, reasoningText, md, tools, errors, status, frame: 0 };
}
