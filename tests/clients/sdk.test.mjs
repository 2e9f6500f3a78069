// The official `openai` Node SDK: Responses with a system prompt (`instructions`, or a
// `developer` / `system` input message), two turns by `previous_response_id` and by
// `conversation`; Chat Completions with a session header and the whole history resent.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import OpenAI from 'openai';
import { MODEL, TOKEN, V1, assertModelSaw, assertStoredOnce, hex, question, sessionIds } from './native.mjs';

const client = new OpenAI({ baseURL: V1, apiKey: TOKEN, maxRetries: 0 });
const SYSTEM = 'You are a terse travel agent.';

/** A response's text from its output items (a streamed `response.completed` event's
 * response has no `output_text` convenience). */
const textOf = (response) =>
  response.output
    .filter((o) => o.type === 'message')
    .flatMap((o) => o.content)
    .filter((c) => c.type === 'output_text')
    .map((c) => c.text)
    .join('');

test('responses: instructions, then previous_response_id continues the same session', async () => {
  const before = await sessionIds();
  const q1 = question('Sdk-prev: we fly to Oslo on 3 March.');
  const q2 = question('Sdk-prev: what should we pack?');
  const r1 = await client.responses.create({ model: MODEL, instructions: SYSTEM, input: q1 });
  const r2 = await client.responses.create({ model: MODEL, instructions: SYSTEM, input: q2, previous_response_id: r1.id });
  assert.equal(r2.status, 'completed');
  assert.equal(r2.previous_response_id, r1.id);
  assert.equal(r2.conversation?.id, r1.conversation?.id);
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.output_text, r2.output_text] });
  await assertModelSaw(stored, SYSTEM);
});

test('responses: a developer input message is the system prompt; two turns in a conversation (the second streamed)', async () => {
  const before = await sessionIds();
  const q1 = question('Sdk-conv: we land at 14:30.');
  const q2 = question('Sdk-conv: and we stay four nights.');
  const conv = await client.conversations.create();
  const r1 = await client.responses.create({
    model: MODEL,
    conversation: conv.id,
    input: [
      { role: 'developer', content: SYSTEM },
      { role: 'user', content: q1 },
    ],
  });
  let r2 = null;
  const stream = await client.responses.create({
    model: MODEL,
    conversation: conv.id,
    input: [
      { role: 'developer', content: SYSTEM },
      { role: 'user', content: q2 },
    ],
    stream: true,
  });
  let deltas = '';
  for await (const event of stream) {
    if (event.type === 'response.output_text.delta') deltas += event.delta;
    if (event.type === 'response.completed') r2 = event.response;
  }
  assert.equal(r2?.status, 'completed');
  const a2 = textOf(r2);
  assert.equal(a2, deltas);
  assert.equal(r1.conversation?.id, conv.id);
  assert.equal(r2.conversation?.id, conv.id);

  const items = [];
  for await (const item of client.conversations.items.list(conv.id, { order: 'asc' })) items.push(item);
  assert.deepEqual(
    items.map((i) => [i.role, i.content[0].text]),
    [
      ['user', q1],
      ['assistant', r1.output_text],
      ['user', q2],
      ['assistant', a2],
    ],
    'the developer message is the system prompt, not an item',
  );
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.output_text, a2] });
  assert.equal(hex(stored.sessions[0]), conv.id.slice('conv_'.length));
  await assertModelSaw(stored, SYSTEM);
});

test('responses: a system input message is the system prompt, then previous_response_id', async () => {
  const before = await sessionIds();
  const q1 = question('Sdk-system: my name is Petra.');
  const q2 = question('Sdk-system: what is my name?');
  const r1 = await client.responses.create({
    model: MODEL,
    input: [
      { role: 'system', content: SYSTEM },
      { role: 'user', content: q1 },
    ],
  });
  const r2 = await client.responses.create({
    model: MODEL,
    input: [
      { role: 'system', content: SYSTEM },
      { role: 'user', content: q2 },
    ],
    previous_response_id: r1.id,
  });
  assert.equal(r2.conversation?.id, r1.conversation?.id);
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.output_text, r2.output_text] });
  await assertModelSaw(stored, SYSTEM);
});

test('chat.completions: X-Session-Id and the whole history resent (the second streamed)', async () => {
  const before = await sessionIds();
  const headers = { 'X-Session-Id': `clients-sdk-${Date.now()}` };
  const q1 = question('Sdk-chat: we go to Bergen next.');
  const q2 = question('Sdk-chat: by train or by plane?');
  const messages = [
    { role: 'system', content: SYSTEM },
    { role: 'user', content: q1 },
  ];
  const { data: c1, response } = await client.chat.completions.create({ model: MODEL, messages }, { headers }).withResponse();
  const session = response.headers.get('x-session-id');
  assert.ok(session, 'the answer names the session');
  // The SDK's message as it came back (with `refusal: null`), as a chat front end keeps it.
  messages.push(c1.choices[0].message, { role: 'user', content: q2 });
  const stream = await client.chat.completions.create(
    { model: MODEL, messages, stream: true, stream_options: { include_usage: true } },
    { headers },
  );
  let a2 = '';
  for await (const chunk of stream) a2 += chunk.choices[0]?.delta?.content ?? '';
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [c1.choices[0].message.content, a2] });
  assert.equal(stored.sessions[0], session);
  await assertModelSaw(stored, SYSTEM);
});
