"""The OpenAI Agents SDK (`openai-agents`, pinned in requirements.txt) against turnlog:
an agent with `instructions` run for two turns with `to_input_list()`, with
`OpenAIConversationsSession`, with `conversation_id`, an agent with an `output_type`, and
an agent with a `@function_tool` on Responses and on Chat Completions (DESIGN §14);
each checked through the native API: every message stored once, in the expected sessions.

Run by ./run (run.mjs) against a fresh `turnlog dev`: TURNLOG_BASE and TURNLOG_TOKEN. The
tests run one at a time, so the sessions that appear during a test are the test's.
"""

import asyncio
import json
import os
import re
import time
import unittest
import urllib.parse
import urllib.request

from openai import AsyncOpenAI
from pydantic import BaseModel

from agents import (
    Agent,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    OpenAIConversationsSession,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)

BASE = os.environ["TURNLOG_BASE"] + "/v1"
TOKEN = os.environ["TURNLOG_TOKEN"]
MODEL = "mock"  # `turnlog dev`'s built-in mock model
SYSTEM = "You are a terse hiking guide."

set_tracing_disabled(True)  # nothing goes to OpenAI's trace endpoint
set_default_openai_api("responses")  # the default, stated


def question(text):
    """A user message the mock answers with a few words (the directive stays in the text)."""
    return f"{text} [mock words=6]"


def get(path):
    req = urllib.request.Request(BASE + path, headers={"Authorization": "Bearer " + TOKEN})
    with urllib.request.urlopen(req) as resp:
        return json.load(resp)


def session_ids():
    """Every session id the owner has, through every page of the list."""
    ids, query = set(), "limit=200"
    while True:
        page = get("/sessions?" + query)
        ids.update(s["id"] for s in page["sessions"])
        if not page["next"]:
            return ids
        query = "limit=200&" + urllib.parse.urlencode(page["next"])


def own_events(session):
    """A session's own events (a fork's log also shows its ancestors' up to the fork)."""
    events, after = [], None
    while True:
        page = get(f"/sessions/{session}/events?limit=1000" + ("" if after is None else f"&after={after}"))
        events += [e for e in page["events"] if e["session_id"] == session]
        if page["next_after"] is None:
            return events
        after = page["next_after"]


def text(content):
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [])


def stored_since(before):
    """The sessions that appeared since `before`, oldest first, and their own user
    messages and answers, in order; `turns` are the answers' (session, seq)."""
    fresh = sorted(session_ids() - before)
    users, answers, turns = [], [], []
    for session in fresh:
        for e in own_events(session):
            if e["kind"] == "user_message":
                users.append(e["payload"]["text"])
            elif e["kind"] == "assistant_turn":
                answers.append(text(e["payload"].get("llm", {}).get("message", {}).get("content")))
                turns.append((session, e["seq"]))
    return {"sessions": fresh, "users": users, "answers": answers, "turns": turns}


def model_request(session, seq):
    """The request turnlog sent the model for the answer at `seq`, rebuilt from the log."""
    audit = get(f"/sessions/{session}/requests/{seq}")
    assert audit["verified"], audit
    return audit["body"]


def added_by_turnlog(content):
    """What turnlog adds to a model request besides the conversation, as user messages: the
    per-turn extras (today's date, recall) and the distiller's turn memories (DESIGN §3)."""
    return content.startswith("[context for this turn; not part of the conversation]") or bool(
        re.match(r"\[turn memory of turn #\d+\]", content)
    )


def conversation_of(body):
    """The request's conversation: no system messages, nothing turnlog added."""
    return [
        (m["role"], text(m["content"]))
        for m in body["messages"]
        if m["role"] != "system" and not added_by_turnlog(text(m["content"]))
    ]


@function_tool
def trail_length(trail: str) -> str:
    """How long a hiking trail is.

    Args:
        trail: The trail's name.
    """
    return f"{trail} is 14 km"


class AgentsSdk(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.loop = asyncio.new_event_loop()
        cls.client = AsyncOpenAI(base_url=BASE, api_key=TOKEN, max_retries=0)
        set_default_openai_client(cls.client, use_for_tracing=False)

    @classmethod
    def tearDownClass(cls):
        cls.loop.run_until_complete(cls.client.close())
        cls.loop.close()

    def run_async(self, coro):
        return self.loop.run_until_complete(coro)

    def agent(self, **kw):
        return Agent(name="Guide", instructions=SYSTEM, model=MODEL, **kw)

    def assert_stored_once(self, before, users, answers, sessions=1):
        self.assertTrue(all(isinstance(a, str) and a for a in answers), f"the client got every answer: {answers}")
        # An answer's event may land a moment after its response ends: wait (a little) for
        # fewer answers than expected, never for more.
        stored = stored_since(before)
        for _ in range(20):
            if len(stored["answers"]) >= len(answers):
                break
            time.sleep(0.1)
            stored = stored_since(before)
        seen = json.dumps(stored, indent=1)
        self.assertEqual(len(stored["sessions"]), sessions, f"expected {sessions} new session(s); stored: {seen}")
        self.assertEqual(stored["users"], users, f"the user messages, each once; stored: {seen}")
        self.assertEqual(stored["answers"], answers, f"the answers, each once; stored: {seen}")
        return stored

    def assert_model_saw(self, stored, system=SYSTEM):
        """Each answer was asked for with the instructions as the system prompt and the
        conversation so far, each earlier message once."""
        for i, (session, seq) in enumerate(stored["turns"]):
            body = model_request(session, seq)
            system_text = "\n".join(text(m["content"]) for m in body["messages"] if m["role"] == "system")
            self.assertIn(system, system_text, f"answer {i + 1}'s request: {body['messages']}")
            expected = []
            for j in range(i + 1):
                expected.append(("user", stored["users"][j]))
                if j < i:
                    expected.append(("assistant", stored["answers"][j]))
            self.assertEqual(conversation_of(body), expected, f"answer {i + 1}'s request to the model")

    def test_runner_run_then_to_input_list(self):
        """Turn 2 resends turn 1 as input items: the user message (no id) and the answer as
        the response's output item (turnlog's `msg_` id, `status: completed`)."""
        before = session_ids()
        q1, q2 = question("Agents-input-list: a hike to Preikestolen."), question("Agents-input-list: how long?")
        r1 = self.run_async(Runner.run(self.agent(), q1))
        history = r1.to_input_list()
        self.assertEqual([i.get("role") for i in history], ["user", "assistant"])
        self.assertTrue(history[1]["id"].startswith("msg_"), history)
        r2 = self.run_async(Runner.run(self.agent(), history + [{"role": "user", "content": q2}]))
        stored = self.assert_stored_once(before, [q1, q2], [r1.final_output, r2.final_output])
        self.assert_model_saw(stored)

    def test_runner_run_streamed_then_to_input_list(self):
        before = session_ids()
        q1, q2 = question("Agents-streamed: a hike to Trolltunga."), question("Agents-streamed: which month?")

        async def turn(agent_input):
            result = Runner.run_streamed(self.agent(), agent_input)
            async for _ in result.stream_events():
                pass
            return result

        r1 = self.run_async(turn(q1))
        r2 = self.run_async(turn(r1.to_input_list() + [{"role": "user", "content": q2}]))
        stored = self.assert_stored_once(before, [q1, q2], [r1.final_output, r2.final_output])
        self.assert_model_saw(stored)

    def test_openai_conversations_session_two_turns(self):
        """The session creates a conversation, adds each user message with items.create,
        calls responses.create *without* the conversation (input: the history, the user
        item with its conversation id, the answers without theirs), then adds the answer
        with items.create: each message must still be stored once, in the conversation."""
        before = session_ids()
        q1, q2 = question("Agents-session: a hut trip in Jotunheimen."), question("Agents-session: do we need a map?")
        session = OpenAIConversationsSession(openai_client=self.client)
        r1 = self.run_async(Runner.run(self.agent(), q1, session=session))
        r2 = self.run_async(Runner.run(self.agent(), q2, session=session))
        conversation = self.run_async(session._get_session_id())
        self.assertTrue(conversation.startswith("conv_"), conversation)

        async def items():
            return [i async for i in self.client.conversations.items.list(conversation, order="asc")]

        listed = self.run_async(items())
        self.assertEqual(
            [(i.role, i.content[0].text) for i in listed],
            [("user", q1), ("assistant", r1.final_output), ("user", q2), ("assistant", r2.final_output)],
        )
        stored = self.assert_stored_once(before, [q1, q2], [r1.final_output, r2.final_output])
        self.assertEqual(stored["sessions"][0].replace("-", ""), conversation[len("conv_"):])
        self.assert_model_saw(stored)

    def test_runner_run_with_conversation_id(self):
        """The pattern that needs nothing of the server but `conversation`: only the new
        user message goes each turn."""
        before = session_ids()
        q1, q2 = question("Agents-conversation: skiing in Hemsedal."), question("Agents-conversation: in April?")
        conversation = self.run_async(self.client.conversations.create())
        r1 = self.run_async(Runner.run(self.agent(), q1, conversation_id=conversation.id))
        r2 = self.run_async(Runner.run(self.agent(), q2, conversation_id=conversation.id))
        stored = self.assert_stored_once(before, [q1, q2], [r1.final_output, r2.final_output])
        self.assertEqual(stored["sessions"][0].replace("-", ""), conversation.id[len("conv_"):])
        self.assert_model_saw(stored)

    def test_output_type_reaches_the_model_and_parses(self):
        """An `output_type` is sent as `text.format` (json_schema, strict); turnlog must pass
        it to the model (the audited request's `response_format`), and the answer must parse
        as the type. With `turnlog dev` that needs its mock model to answer a
        `response_format: json_schema` request with a JSON value of the schema."""

        class Trip(BaseModel):
            destination: str
            nights: int

        before = session_ids()
        q = question("Agents-output-type: four nights in Lofoten.")
        agent = Agent(name="Planner", instructions=SYSTEM, model=MODEL, output_type=Trip)
        try:
            result = self.run_async(Runner.run(agent, q))
            error = None
        except ModelBehaviorError as e:  # the answer did not parse as a Trip
            result, error = None, e
        stored = stored_since(before)
        self.assertEqual((len(stored["sessions"]), stored["users"], len(stored["answers"])), (1, [q], 1), stored)
        body = model_request(*stored["turns"][0])
        fmt = body.get("response_format")
        self.assertIsNotNone(fmt, f"text.format did not reach the model: {json.dumps(body)}")
        self.assertEqual(fmt.get("type"), "json_schema", fmt)
        self.assertEqual(fmt["json_schema"]["name"], "final_output", fmt)
        self.assertEqual(sorted(fmt["json_schema"]["schema"]["properties"]), ["destination", "nights"], fmt)
        self.assertIsNone(error, f"the answer is not a Trip (does the model honour response_format?): {error}")
        self.assertIsInstance(result.final_output, Trip)
        self.assertEqual(json.loads(stored["answers"][0]), result.final_output.model_dump())
        self.assert_model_saw(stored)

    def test_an_agent_runs_a_function_tool_on_responses_and_on_chat_completions(self):
        """The agent's loop: the model calls the tool, the SDK runs it and sends the result,
        the model answers. The turn is one session's: the question, the step that asked, the
        result, the answer, each once, every step's request audited."""
        for api in ("responses", "chat"):
            with self.subTest(api=api):
                before = session_ids()
                q = f'Agents-tools-{api}: how long is Besseggen? [mock tool=trail_length:{{"trail":"Besseggen"}} steps=1 words=5]'
                chat_client = None
                model = MODEL
                if api == "chat":
                    headers = {"X-Session-Id": f"agents-tools-{time.time_ns()}"}
                    chat_client = AsyncOpenAI(base_url=BASE, api_key=TOKEN, max_retries=0, default_headers=headers)
                    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=chat_client)
                agent = Agent(name="Guide", instructions=SYSTEM, model=model, tools=[trail_length])
                try:
                    result = self.run_async(Runner.run(agent, q))
                finally:
                    if chat_client:
                        self.run_async(chat_client.close())
                self.assertTrue(result.final_output)
                fresh = sorted(session_ids() - before)
                self.assertEqual(len(fresh), 1, fresh)
                events = [e for e in own_events(fresh[0]) if e["kind"] in ("user_message", "assistant_turn", "tool_execution")]
                self.assertEqual([e["kind"] for e in events], ["user_message", "assistant_turn", "tool_execution", "assistant_turn"])
                self.assertEqual(events[0]["payload"]["text"], q)
                tool = events[2]["payload"]
                self.assertEqual((tool["name"], tool["output"]), ("trail_length", "Besseggen is 14 km"))
                self.assertEqual(text(events[3]["payload"]["llm"]["message"]["content"]), result.final_output)
                for step in (events[1], events[3]):
                    body = model_request(fresh[0], step["seq"])
                    self.assertEqual([t["function"]["name"] for t in body["tools"]], ["trail_length"])
                # The second step's request holds the first's call and its result.
                last = model_request(fresh[0], events[3]["seq"])["messages"]
                self.assertEqual([m["role"] for m in last[-2:]], ["assistant", "tool"])
                self.assertEqual(last[-1]["content"], "Besseggen is 14 km")


if __name__ == "__main__":
    unittest.main()
