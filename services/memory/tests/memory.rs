//! Memory extraction against real Postgres, NATS and the mock model, with the writer
//! in-process and turns simulated on the bus.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

#[path = "../../compactor/tests/support/mod.rs"]
mod support;

use std::time::Duration;

use support::{failing_mock, fast_consumer, filler, turn_worker, Rig};
use turnlog_core::events::MemoryExtracted;
use turnlog_core::ids::EventId;
use turnlog_memory::{memory_id, MemoryConfig, MEMORY_MARKER};

fn config(rig: &Rig, base_url: &str) -> MemoryConfig {
    turn_worker(rig, base_url, fast_consumer())
}

async fn stored_memories(rig: &Rig) -> Vec<(uuid::Uuid, i64, String)> {
    sqlx::query_as("SELECT id, turn_seq, text FROM memories ORDER BY turn_seq, text")
        .fetch_all(&rig.env.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_gets_exactly_one_extraction_with_stable_memory_ids() {
    let mut rig = Rig::start().await;
    for _ in 0..2 {
        let c = config(&rig, &rig.mock.base_url());
        rig.spawn(|stop| turnlog_memory::run(c, stop));
    }
    let s = rig.create_session().await;
    let t1 =
        rig.turn(s, "My sister Lena moves to Porto in June. I prefer tea over coffee.", &filler(20, 1)).await;
    let t2 = rig.turn(s, "what would you suggest", &filler(20, 2)).await;
    let t3 =
        rig.turn(s, "I promised to call Omar on Friday. Our budget is 1200 dollars.", &filler(20, 3)).await;
    rig.settle(&["memory"]).await;

    let extracted = rig.events_of(s, "memory_extracted").await;
    assert_eq!(extracted.len(), 3, "exactly one per assistant_turn: {extracted:?}");
    let mut expected_rows = Vec::new();
    for (turn, texts) in [
        (t1, vec!["My sister Lena moves to Porto in June."]),
        (t2, vec![]),
        (t3, vec!["I promised to call Omar on Friday.", "Our budget is 1200 dollars."]),
    ] {
        let event_id = EventId::derived(s, turn, "memory_extracted");
        let (_, id, payload) = extracted.iter().find(|(_, _, p)| p["turn_seq"] == turn).unwrap();
        assert_eq!(*id, event_id.0);
        let m: MemoryExtracted = serde_json::from_value(payload.clone()).unwrap();
        assert_eq!(m.error, None);
        let got: Vec<&str> = m.memories.iter().map(|m| m.text.as_str()).collect();
        assert_eq!(got, texts, "turn {turn}");
        for (i, memory) in m.memories.iter().enumerate() {
            assert_eq!(memory.id, memory_id(event_id, i));
            expected_rows.push((memory.id, turn, memory.text.clone()));
        }
    }
    expected_rows.sort_by(|a, b| (a.1, &a.2).cmp(&(b.1, &b.2)));
    assert_eq!(stored_memories(&rig).await, expected_rows, "the writer stored each memory once");

    // A full replay of the feed adds no event, no memory and no model call.
    let calls = rig.model_calls(MEMORY_MARKER);
    rig.republish_feed().await;
    rig.reset_consumer("memory").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    rig.settle(&["memory"]).await;
    assert_eq!(rig.events_of(s, "memory_extracted").await.len(), 3);
    assert_eq!(stored_memories(&rig).await, expected_rows);
    assert_eq!(rig.model_calls(MEMORY_MARKER), calls);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_model_ends_in_an_empty_extraction_with_its_error() {
    let mut rig = Rig::start().await;
    let broken = turnlog_mock_llm::spawn(failing_mock()).await.unwrap();
    let c = config(&rig, &broken.base_url());
    rig.spawn(|stop| turnlog_memory::run(c, stop));
    let s = rig.create_session().await;
    let turn = rig.turn(s, "Remember that Ines was born in 1990.", &filler(10, 1)).await;
    rig.settle(&["memory"]).await;

    let extracted = rig.events_of(s, "memory_extracted").await;
    assert_eq!(extracted.len(), 1);
    let m: MemoryExtracted = serde_json::from_value(extracted[0].2.clone()).unwrap();
    assert_eq!(m.turn_seq, turn);
    assert!(m.memories.is_empty());
    // The status code, not the provider's body or address.
    assert_eq!(m.error.as_deref(), Some("the model gateway answered 500"));
    // It tried on every delivery, then gave up gracefully instead of dead-lettering.
    assert_eq!(support::model_calls(&broken, MEMORY_MARKER), 3);
    assert!(rig.dead_letters().await.is_empty());
    assert!(stored_memories(&rig).await.is_empty());
    rig.stop().await;
}
