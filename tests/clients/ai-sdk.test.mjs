// The Vercel AI SDK (`ai` + `@ai-sdk/openai`): its default provider model `openai(name)` is
// the Responses API. The default multi-turn pattern: `system` plus `messages`, and the next
// turn resends `[...messages, ...result.response.messages, nextUserMessage]` — the system
// prompt as an input message, the earlier answer as an `item_reference` to its id.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, jsonSchema, stepCountIs, streamText, tool } from 'ai';
import {
  MODEL, TOKEN, V1, assertModelSaw, assertStoredOnce, modelRequest, ownEvents, question, recordingFetch, sessionIds,
} from './native.mjs';

const SYSTEM = 'You are a terse packing assistant.';

function provider() {
  const wire = recordingFetch();
  return { openai: createOpenAI({ baseURL: V1, apiKey: TOKEN, fetch: wire.fetch }), wire };
}

/** The answer's item id the SDK keeps in response.messages, for the item_reference. */
const itemIdOf = (responseMessages) => responseMessages[0].content[0].providerOptions?.openai?.itemId;

/** The second request resent the history as this SDK version does: system, user, then a
 * reference to the answer (guards that the test exercises the pattern it names). */
function assertResentHistory(body, role, itemId) {
  assert.deepEqual(
    body.input.map((i) => i.type === 'item_reference' ? `item_reference:${i.id}` : i.role),
    [role, 'user', `item_reference:${itemId}`, 'user'],
    `the turn-2 request: ${JSON.stringify(body)}`,
  );
}

test('generateText: system + messages, then messages + response.messages', async () => {
  const before = await sessionIds();
  const { openai, wire } = provider();
  const q1 = question('Aisdk-generate: four nights in Oslo in March.');
  const q2 = question('Aisdk-generate: do I need boots?');
  let messages = [{ role: 'user', content: q1 }];
  const r1 = await generateText({ model: openai(MODEL), system: SYSTEM, messages, maxRetries: 0 });
  messages = [...messages, ...r1.response.messages, { role: 'user', content: q2 }];
  const r2 = await generateText({ model: openai(MODEL), system: SYSTEM, messages, maxRetries: 0 });

  assert.equal(wire.bodies.length, 2);
  assert.ok(wire.bodies.every((b) => b.url.endsWith('/responses')), 'the default provider model is the Responses API');
  assertResentHistory(wire.bodies[1].body, 'system', itemIdOf(r1.response.messages));
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.text, r2.text] });
  await assertModelSaw(stored, SYSTEM);
});

/** streamText's text and response messages; a failed request is thrown as itself (the SDK
 * would otherwise log it and report only that no output was generated). */
async function streamed(options) {
  let failure = null;
  const result = streamText({ ...options, maxRetries: 0, onError: ({ error }) => (failure ??= error) });
  try {
    const text = await result.text;
    return { text, response: await result.response, finishReason: await result.finishReason };
  } catch (e) {
    throw failure ?? e;
  }
}

test('generateText without a system prompt: the resent history alone (an item_reference)', async () => {
  const before = await sessionIds();
  const { openai, wire } = provider();
  const q1 = question('Aisdk-nosystem: a cabin near Geilo.');
  const q2 = question('Aisdk-nosystem: firewood?');
  let messages = [{ role: 'user', content: q1 }];
  const r1 = await generateText({ model: openai(MODEL), messages, maxRetries: 0 });
  messages = [...messages, ...r1.response.messages, { role: 'user', content: q2 }];
  const r2 = await generateText({ model: openai(MODEL), messages, maxRetries: 0 });

  assert.deepEqual(wire.bodies[1].body.input[1], { type: 'item_reference', id: itemIdOf(r1.response.messages) });
  await assertStoredOnce(before, { users: [q1, q2], answers: [r1.text, r2.text] });
});

test('streamText: system + messages, then messages + response.messages', async () => {
  const before = await sessionIds();
  const { openai, wire } = provider();
  const q1 = question('Aisdk-stream: a weekend in Bergen.');
  const q2 = question('Aisdk-stream: will it rain?');
  let messages = [{ role: 'user', content: q1 }];
  const { text: a1, response: response1 } = await streamed({ model: openai(MODEL), system: SYSTEM, messages });
  messages = [...messages, ...response1.messages, { role: 'user', content: q2 }];
  const { text: a2, finishReason } = await streamed({ model: openai(MODEL), system: SYSTEM, messages });
  assert.equal(finishReason, 'stop');

  assert.ok(wire.bodies.every((b) => b.body.stream === true));
  assertResentHistory(wire.bodies[1].body, 'system', itemIdOf(response1.messages));
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [a1, a2] });
  await assertModelSaw(stored, SYSTEM);
});

test('generateText with the system prompt as a developer message (what reasoning models get)', async () => {
  const before = await sessionIds();
  const { openai, wire } = provider();
  const providerOptions = { openai: { systemMessageMode: 'developer' } };
  const q1 = question('Aisdk-developer: a day in Tromsø.');
  const q2 = question('Aisdk-developer: northern lights?');
  let messages = [{ role: 'user', content: q1 }];
  const r1 = await generateText({ model: openai(MODEL), system: SYSTEM, messages, providerOptions, maxRetries: 0 });
  messages = [...messages, ...r1.response.messages, { role: 'user', content: q2 }];
  const r2 = await generateText({ model: openai(MODEL), system: SYSTEM, messages, providerOptions, maxRetries: 0 });

  assertResentHistory(wire.bodies[1].body, 'developer', itemIdOf(r1.response.messages));
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.text, r2.text] });
  await assertModelSaw(stored, SYSTEM);
});

test('openai.chat (Chat Completions) with a session header: system + messages resent', async () => {
  const before = await sessionIds();
  const { openai, wire } = provider();
  const headers = { 'X-Session-Id': `clients-aisdk-${Date.now()}` };
  const q1 = question('Aisdk-chat: a ferry to Kiel.');
  const q2 = question('Aisdk-chat: how long is it?');
  let messages = [{ role: 'user', content: q1 }];
  const r1 = await generateText({ model: openai.chat(MODEL), system: SYSTEM, messages, headers, maxRetries: 0 });
  messages = [...messages, ...r1.response.messages, { role: 'user', content: q2 }];
  const r2 = await generateText({ model: openai.chat(MODEL), system: SYSTEM, messages, headers, maxRetries: 0 });

  assert.ok(wire.bodies.every((b) => b.url.endsWith('/chat/completions')));
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [r1.text, r2.text] });
  await assertModelSaw(stored, SYSTEM);
});

test('tools: a loop of several steps, on Responses and on Chat Completions (DESIGN §14)', async () => {
  for (const api of ['responses', 'chat']) {
    const before = await sessionIds();
    const { openai, wire } = provider();
    const headers = api === 'chat' ? { 'X-Session-Id': `clients-aisdk-tools-${Date.now()}` } : undefined;
    const model = api === 'chat' ? openai.chat(MODEL) : openai(MODEL);
    const asked = [];
    const weather = tool({
      description: "A city's weather",
      inputSchema: jsonSchema({
        type: 'object', properties: { city: { type: 'string' } }, required: ['city'], additionalProperties: false,
      }),
      execute: async ({ city }) => {
        asked.push(city);
        return `${city}: -3C, snow`;
      },
    });
    // The mock asks for the tool twice, then answers.
    const prompt = `Aisdk-tools-${api}: the weather? [mock tool=weather:{"city":"Oslo"} steps=2 words=4]`;
    const r = await generateText({
      model, system: SYSTEM, prompt, tools: { weather }, stopWhen: stepCountIs(5), headers, maxRetries: 0,
    });
    assert.deepEqual(asked, ['Oslo', 'Oslo'], api);
    assert.equal(r.steps.length, 3, api);
    assert.ok(r.text, api);
    assert.equal(wire.bodies.length, 3, api);
    const fresh = [...(await sessionIds())].filter((id) => !before.has(id));
    assert.equal(fresh.length, 1, `${api}: one session, not ${fresh.length}`);
    const events = (await ownEvents(fresh[0]))
      .filter((e) => ['user_message', 'assistant_turn', 'tool_execution'].includes(e.kind));
    assert.deepEqual(
      events.map((e) => e.kind),
      ['user_message', 'assistant_turn', 'tool_execution', 'assistant_turn', 'tool_execution', 'assistant_turn'],
      api,
    );
    assert.equal(events[0].payload.text, prompt);
    for (const step of events.filter((e) => e.kind === 'assistant_turn')) {
      const body = await modelRequest(fresh[0], step.seq); // verified
      assert.deepEqual(body.tools.map((t) => t.function.name), ['weather'], api);
    }
  }
});
