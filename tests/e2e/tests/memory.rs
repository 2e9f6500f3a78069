//! Memory extraction against real Postgres, NATS and the mock model, with the writer
//! in-process and turns simulated on the bus.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use turnlog_core::events::MemoryExtracted;
use turnlog_core::ids::EventId;
use turnlog_e2e::config;
use turnlog_e2e::rig::{failing_mock, filler, model_calls, Rig};
use turnlog_memory::{memory_id, MEMORY_MARKER};

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
        let c = config::memory(&rig.env, &rig.mock.base_url());
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
    let c = config::memory(&rig.env, &broken.base_url());
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
    assert_eq!(model_calls(&broken, MEMORY_MARKER), 3);
    assert!(rig.dead_letters().await.is_empty());
    assert!(stored_memories(&rig).await.is_empty());
    rig.stop().await;
}

/// Recall matches on the turn's distinctive words, ranks by all of them, and falls back to
/// every word when no distinctive one matches; the common words come from Postgres's
/// statistics of the memories (ANALYZE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recall_matches_distinctive_words_and_ranks_by_all() {
    use std::sync::Arc;
    use turnlog_e2e::rig::{owner, OWNER};
    use turnlog_runtime::read::{recall_relevant, CommonWords};

    let rig = Rig::start().await;
    let s = rig.create_session().await;
    // 400 memories: "the", "user", "maria" … in most of them; "birthday" in two.
    sqlx::query(
        "INSERT INTO memories (id, owner, session_id, turn_seq, text, created_at)
         SELECT gen_random_uuid(), $1, $2, 1, t, now() - g * interval '1 second'
           FROM (SELECT g, CASE WHEN g % 4 = 0 THEN format('Maria liked the plan number %s.', g)
                                ELSE format('The user said the meeting with client %s is on day %s.', g, g % 28) END AS t
                   FROM generate_series(1, 398) g
                 UNION ALL SELECT 400, 'Maria''s birthday is on May 3.'
                 UNION ALL SELECT 399, 'Jonas''s birthday is on June 9.') x",
    )
    .bind(OWNER)
    .bind(s.0)
    .execute(&rig.env.pool)
    .await
    .unwrap();
    let recall = |text: &'static str, common: Arc<[String]>| {
        let pool = rig.env.pool.clone();
        async move {
            let got = recall_relevant(&pool, &owner(OWNER), text, 5, &common).await.unwrap();
            got.into_iter().map(|m| m.text).collect::<Vec<_>>()
        }
    };

    // Before ANALYZE no word is common: the memories sharing any word are candidates.
    let words = Arc::new(CommonWords::default());
    words.refresh(&rig.env.pool).await.unwrap();
    assert!(words.current(&rig.env.pool).is_empty());
    assert_eq!(recall("When is Maria's birthday?", Arc::from([])).await.len(), 5);

    sqlx::query("ANALYZE memories").execute(&rig.env.pool).await.unwrap();
    words.refresh(&rig.env.pool).await.unwrap();
    let common = words.current(&rig.env.pool);
    for word in ["the", "user", "maria", "is", "on"] {
        assert!(common.contains(&word.to_owned()), "{word} is common: {common:?}");
    }
    assert!(!common.contains(&"birthday".to_owned()), "{common:?}");

    // Only the memories with "birthday" are candidates, Maria's first: it shares more words.
    assert_eq!(
        recall("When is Maria's birthday?", common.clone()).await,
        ["Maria's birthday is on May 3.", "Jonas's birthday is on June 9."]
    );
    // No distinctive word matches ("what" is in none): every word does, as without statistics.
    let maria = recall("What about Maria?", common.clone()).await;
    assert_eq!(maria.len(), 5, "{maria:?}");
    assert!(maria.iter().all(|m| m.contains("Maria")), "{maria:?}");
    rig.stop().await;
}

/// An import's answers (issue 25) go to the feed under subjects of their own (DESIGN §6):
/// memory extraction reads them on `memory-imported`, and the live consumers (the live
/// `memory` one, the distiller's) never receive them, nor `memory-imported` a live turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imports_answers_reach_only_the_consumer_of_imports() {
    use turnlog_core::events::{AssistantTurn, EventBody, Imported, LlmMessage, LlmPart, MessageContent};
    use turnlog_e2e::rig::{owner, OWNER};

    let mut rig = Rig::start().await;
    let c = config::memory(&rig.env, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_memory::run(c, stop));
    let d = config::distiller(&rig.env, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_distiller::run(d, stop));
    let s = rig.create_session().await;
    rig.turn(s, "My sister Lena moves to Porto in June.", &filler(20, 1)).await;
    for i in 0..3 {
        rig.user(s, &format!("I promised to call Omar on day {i}.")).await;
        let text = filler(20, 10 + i);
        let body = EventBody::AssistantTurn(AssistantTurn {
            llm: LlmPart {
                message: LlmMessage { content: Some(MessageContent::Text(text)), ..Default::default() },
            },
            imported: Some(Box::new(Imported {
                source: "chatgpt".into(),
                id: format!("a{i}"),
                created_at: None,
            })),
            ..Default::default()
        });
        rig.send(&turnlog_runtime::bus::AppendRequest::append(s, &owner(OWNER), uuid::Uuid::now_v7(), &body))
            .await;
    }
    rig.settle(&["memory", "distiller"]).await;

    assert_eq!(rig.events_of(s, "memory_extracted").await.len(), 4, "the live turn and the three imported");
    let answers: Vec<String> = rig
        .stream_messages(&rig.bus.names.events_stream())
        .await
        .into_iter()
        .map(|(subject, _)| subject)
        .filter(|subject| subject.contains(".assistant_turn"))
        .collect();
    let prefix = &rig.env.bus_prefix;
    let imported =
        answers.iter().filter(|a| **a == format!("{prefix}.events.assistant_turn-imported.{s}")).count();
    assert_eq!((answers.len(), imported), (4, 3), "{answers:?}");
    // Each consumer's filter, and the answers delivered to it (one delivery more allowed:
    // a pull answered late is handed back and comes again).
    for (consumer, token, answers) in [
        ("memory", "assistant_turn", 1),
        ("distiller", "assistant_turn", 1),
        ("memory-imported", "assistant_turn-imported", 3),
    ] {
        let info = rig.consumer_info(consumer).await;
        assert_eq!(info.config.filter_subject, format!("{prefix}.events.{token}.*"));
        let delivered = info.delivered.consumer_sequence;
        assert!((answers..=answers + 1).contains(&delivered), "{consumer}: {delivered} deliveries");
    }
    rig.stop().await;
}

/// An earlier version's `memory-imported` consumer took every `assistant_turn`, and an
/// earlier writer published imported answers on the live subject. Upgraded, the consumer
/// keeps that filter until nothing is pending under it, so an imported answer the earlier
/// writer published is still extracted, and only then switches to imports' own subjects
/// (DESIGN §6). Switching at once would skip it: the live consumer leaves imports alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_import_consumer_extracts_its_backlog_before_it_switches() {
    use turnlog_core::events::{AssistantTurn, EventBody, Imported, LlmMessage, LlmPart, MessageContent};
    use turnlog_e2e::rig::{owner, OWNER};

    let mut rig = Rig::start().await;
    let prefix = rig.env.bus_prefix.clone();
    let stream = rig.bus.js.get_stream(rig.bus.names.events_stream()).await.unwrap();
    rig.earlier_consumer("memory-imported", "assistant_turn.*").await;
    let s = rig.create_session().await;
    rig.turn(s, "My sister Lena moves to Porto in June.", &filler(20, 1)).await;
    rig.user(s, "I promised to call Omar on Friday.").await;
    let body = EventBody::AssistantTurn(AssistantTurn {
        llm: LlmPart {
            message: LlmMessage { content: Some(MessageContent::Text(filler(20, 2))), ..Default::default() },
        },
        imported: Some(Box::new(Imported { source: "chatgpt".into(), id: "a1".into(), created_at: None })),
        ..Default::default()
    });
    let answer = rig
        .send(&turnlog_runtime::bus::AppendRequest::append(s, &owner(OWNER), uuid::Uuid::now_v7(), &body))
        .await
        .seq
        .unwrap();
    rig.settle(&[]).await;
    // As an earlier writer published it: on the live subject.
    let published = stream
        .get_last_raw_message_by_subject(&format!("{prefix}.events.assistant_turn-imported.{s}"))
        .await
        .unwrap();
    stream.delete_message(published.sequence).await.unwrap();
    let earlier = format!("{prefix}.events.assistant_turn.{s}");
    rig.bus.js.publish(earlier, published.payload).await.unwrap().await.unwrap();

    let c = config::memory(&rig.env, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_memory::run(c, stop));
    rig.settle(&["memory"]).await;
    // Extracted by two consumers at once, so in either order.
    let mut turns: Vec<i64> = rig
        .events_of(s, "memory_extracted")
        .await
        .iter()
        .map(|(_, _, p)| p["turn_seq"].as_i64().unwrap())
        .collect();
    turns.sort_unstable();
    assert_eq!(turns, [answer - 2, answer], "the live answer and the imported one");
    rig.switched_to("memory-imported", "assistant_turn-imported.*").await;
    rig.stop().await;
}
