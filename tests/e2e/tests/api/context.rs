//! `/context` shows what the next send would use: after a compaction the summary comes
//! first, and the token count summed from the stored per-event counts equals encoding the
//! assembled request from scratch.

use turnlog_core::events::*;
use turnlog_core::llm_context::{llm_messages, SUMMARY_MARKER};
use turnlog_core::request::{assemble, Extras};
use turnlog_core::tokens::request_tokens;
use turnlog_e2e::api::{Api, Options, ALICE};
use turnlog_e2e::rig::owner;
use turnlog_runtime::read;

const SYSTEM: &str = "You are turnlog's careful assistant. Keep every number the user gives you.";

fn answer(text: &str) -> EventBody {
    EventBody::AssistantTurn(AssistantTurn {
        ui: UiPart { blocks: vec![Block { kind: BlockType::Text, text: Some(text.into()), meta: None }] },
        llm: LlmPart {
            message: LlmMessage { content: Some(MessageContent::Text(text.into())), ..Default::default() },
        },
        ..Default::default()
    })
}

fn user(text: &str) -> EventBody {
    EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_after_a_compaction_starts_with_the_summary_and_counts_exactly() {
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        system_prompt: SYSTEM.into(),
        ..Options::default()
    })
    .await;
    let id = api.create(ALICE, Some("budgeting")).await;
    let path = format!("/v1/sessions/{id}/context");

    // Before anything is said: the system prompt alone.
    let r = api.get(&path, ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["messages"], serde_json::json!([]));
    assert_eq!(r.json["tokens"], request_tokens(&assemble(SYSTEM, vec![], &Extras::default())));

    api.append(id, "alice", &user("What is 17 times 23? My budget is 4,200 euros.")).await;
    api.append(id, "alice", &answer("17 × 23 = 391.")).await;
    api.append(id, "alice", &user("And the budget per month over 12 months?")).await;
    api.append(id, "alice", &answer("4,200 / 12 = 350 euros a month.")).await;
    let summary = "The user asked 17×23 (391) and split a 4,200 euro budget over 12 months (350/month).";
    let compaction = EventBody::CompactionApplied(CompactionApplied {
        summary: summary.into(),
        replaces_through_seq: 3,
        facts_extracted: vec![],
    });
    api.append(id, "alice", &compaction).await;
    api.append(id, "alice", &user("Now for 18 months?")).await;
    let pending =
        EventBody::PendingState(PendingState { partial: "4,200 / 18 = 233.".into(), ..Default::default() });
    api.append(id, "alice", &pending).await;

    let r = api.get(&path, ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let messages = r.json["messages"].as_array().unwrap();
    let first = messages[0]["content"].as_str().unwrap();
    assert_eq!(messages[0]["role"], "user");
    assert!(first.starts_with(SUMMARY_MARKER) && first.contains(summary), "{first}");
    assert_eq!(r.json["compacted_through"], 3);
    assert_eq!(r.json["system"], SYSTEM);
    assert_eq!(r.json["extras"], serde_json::json!({}));

    // The same messages as projecting the whole log, and the same size as encoding it all.
    let events = read::all_events(&api.env.pool, &owner("alice"), id).await.unwrap().unwrap();
    let expected = llm_messages(&events);
    assert_eq!(r.json["messages"], serde_json::to_value(&expected).unwrap());
    assert_eq!(expected.len(), 5, "summary, user 4, assistant 5, user 7, live pending 8");
    let encoded = request_tokens(&assemble(SYSTEM, expected, &Extras::default()));
    assert_eq!(r.json["tokens"], encoded);

    // The budget is 60% of the mock model's window, from the gateway's /models.
    assert_eq!(r.json["model"], "mock");
    assert_eq!(r.json["window"], 128_000);
    assert_eq!(r.json["budget"], 76_800);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gateway_the_budget_is_the_fallback() {
    let api = Api::start().await;
    let id = api.create(ALICE, None).await;
    let r = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["budget"], 60_000);
    assert!(r.json["window"].is_null() && r.json["compacted_through"].is_null());
    assert_eq!(r.json["system"], "");
}
