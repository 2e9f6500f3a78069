// LangChain's ChatOpenAI (`@langchain/openai`) on the Responses API (`useResponsesApi:
// true`): a SystemMessage and the whole history resent each turn, the AIMessage it
// returned included (sent back as the response's output item: `msg_…` id, `status`).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { AIMessageChunk, HumanMessage, SystemMessage, ToolMessage } from '@langchain/core/messages';
import { ChatOpenAI } from '@langchain/openai';
import {
  MODEL, TOKEN, V1, assertModelSaw, assertStoredOnce, modelRequest, ownEvents, question, recordingFetch, sessionIds,
} from './native.mjs';

const SYSTEM = 'You are a terse train guide.';

function chat(options = {}) {
  const wire = recordingFetch();
  const llm = new ChatOpenAI({
    model: MODEL,
    apiKey: TOKEN,
    configuration: { baseURL: V1, fetch: wire.fetch },
    useResponsesApi: true,
    maxRetries: 0,
    ...options,
  });
  return { llm, wire };
}

/** The second request resent the history: system, user, the first answer as its output
 * item (turnlog's id), user (guards that the test exercises the pattern it names). */
function assertResentHistory(body) {
  assert.deepEqual(
    body.input.map((i) => `${i.role}${i.id ? `:${i.id.slice(0, 4)}` : ''}`),
    ['system', 'user', 'assistant:msg_', 'user'],
    `the turn-2 request: ${JSON.stringify(body)}`,
  );
}

test('invoke: SystemMessage and the history with the returned AIMessage', async () => {
  const before = await sessionIds();
  const { llm, wire } = chat();
  const q1 = question('Langchain-invoke: Oslo to Bergen by train.');
  const q2 = question('Langchain-invoke: which side has the view?');
  const history = [new SystemMessage(SYSTEM), new HumanMessage(q1)];
  const a1 = await llm.invoke(history);
  history.push(a1, new HumanMessage(q2));
  const a2 = await llm.invoke(history);

  assert.ok(wire.bodies.every((b) => b.url.endsWith('/responses')));
  assertResentHistory(wire.bodies[1].body);
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [a1.text, a2.text] });
  await assertModelSaw(stored, SYSTEM);
});

test('invoke without a SystemMessage: the resent history alone', async () => {
  const before = await sessionIds();
  const { llm, wire } = chat();
  const q1 = question('Langchain-nosystem: the Flåm railway.');
  const q2 = question('Langchain-nosystem: in winter too?');
  const history = [new HumanMessage(q1)];
  const a1 = await llm.invoke(history);
  history.push(a1, new HumanMessage(q2));
  const a2 = await llm.invoke(history);

  assert.deepEqual(
    wire.bodies[1].body.input.map((i) => i.role),
    ['user', 'assistant', 'user'],
  );
  assert.ok(wire.bodies[1].body.input[1].id?.startsWith('msg_'), JSON.stringify(wire.bodies[1].body));
  await assertStoredOnce(before, { users: [q1, q2], answers: [a1.text, a2.text] });
});

test('stream: SystemMessage and the history with the concatenated chunks', async () => {
  const before = await sessionIds();
  const { llm, wire } = chat({ streaming: true });
  const collect = async (messages) => {
    let full = null;
    for await (const chunk of await llm.stream(messages)) full = full ? full.concat(chunk) : chunk;
    assert.ok(full instanceof AIMessageChunk);
    return full;
  };
  const q1 = question('Langchain-stream: the night train to Trondheim.');
  const q2 = question('Langchain-stream: is there a sleeper?');
  const history = [new SystemMessage(SYSTEM), new HumanMessage(q1)];
  const a1 = await collect(history);
  history.push(a1, new HumanMessage(q2));
  const a2 = await collect(history);

  assert.ok(wire.bodies.every((b) => b.body.stream === true));
  assertResentHistory(wire.bodies[1].body);
  const stored = await assertStoredOnce(before, { users: [q1, q2], answers: [a1.text, a2.text] });
  await assertModelSaw(stored, SYSTEM);
});

test('tool calling: bindTools, the AIMessage with tool_calls and a ToolMessage back, on both APIs (DESIGN §14)', async () => {
  const weather = {
    type: 'function',
    function: {
      name: 'weather', description: "A city's weather",
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    },
  };
  for (const responses of [true, false]) {
    const before = await sessionIds();
    const headers = { 'X-Session-Id': `clients-langchain-tools-${Date.now()}` };
    const llm = new ChatOpenAI({
      model: MODEL,
      apiKey: TOKEN,
      configuration: { baseURL: V1, defaultHeaders: headers },
      useResponsesApi: responses,
      maxRetries: 0,
    });
    const tooled = llm.bindTools([weather]);
    const q = `Langchain-tools-${responses}: the weather in Bergen? [mock tool=weather:{"city":"Bergen"} steps=1 words=4]`;
    const history = [new SystemMessage(SYSTEM), new HumanMessage(q)];
    const step = await tooled.invoke(history);
    assert.equal(step.tool_calls.length, 1, JSON.stringify(step));
    assert.deepEqual(step.tool_calls[0].args, { city: 'Bergen' });
    history.push(step, new ToolMessage({ tool_call_id: step.tool_calls[0].id, content: 'Rain, 9C' }));
    const answer = await tooled.invoke(history);
    assert.ok(answer.text, JSON.stringify(answer));
    assert.equal(answer.tool_calls?.length ?? 0, 0);
    const fresh = [...(await sessionIds())].filter((id) => !before.has(id));
    assert.equal(fresh.length, 1, `${responses ? 'responses' : 'chat'}: one session`);
    const events = (await ownEvents(fresh[0]))
      .filter((e) => ['user_message', 'assistant_turn', 'tool_execution'].includes(e.kind));
    assert.deepEqual(events.map((e) => e.kind), ['user_message', 'assistant_turn', 'tool_execution', 'assistant_turn']);
    assert.equal(events[2].payload.output, 'Rain, 9C');
    for (const e of [events[1], events[3]]) await modelRequest(fresh[0], e.seq); // verified
  }
});
