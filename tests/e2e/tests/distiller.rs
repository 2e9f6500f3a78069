//! The distiller against real Postgres, NATS and the mock model, with the writer in-process
//! and turns simulated on the bus.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use turnlog_core::events::TurnMemory;
use turnlog_core::ids::EventId;
use turnlog_distiller::{DISTILL_MARKER, TITLE_MARKER};
use turnlog_e2e::config;
use turnlog_e2e::rig::{failing_mock, filler, model_calls, Rig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_distill_each_turn_once_and_replays_add_nothing() {
    let mut rig = Rig::start().await;
    for _ in 0..2 {
        let c = config::distiller(&rig.env, &rig.mock.base_url());
        rig.spawn(|stop| turnlog_distiller::run(c, stop));
    }
    let a = rig.create_session().await;
    let b = rig.create_session().await;
    let mut with_facts = Vec::new();
    for i in 0..8 {
        let session = if i % 2 == 0 { a } else { b };
        let seq = rig
            .turn(
                session,
                &format!("Please remind Marta that invoice {i} is due on the {}th.", 10 + i),
                &filler(30, i),
            )
            .await;
        with_facts.push((session, seq));
    }
    // A turn without names or numbers leaves no residue, so nothing is appended for it.
    let plain = rig.turn(a, "what do you think about it", &filler(20, 9)).await;
    rig.settle(&["distiller"]).await;

    let mut memories = rig.events_of(a, "turn_memory").await;
    memories.extend(rig.events_of(b, "turn_memory").await);
    assert_eq!(memories.len(), with_facts.len(), "one turn_memory per turn with a residue: {memories:?}");
    for (i, (session, turn_seq)) in with_facts.iter().enumerate() {
        let found: Vec<_> = memories
            .iter()
            .filter(|(_, _, p)| p["turn_seq"] == *turn_seq)
            .filter(|(_, id, _)| *id == EventId::derived(*session, *turn_seq, "turn_memory").0)
            .collect();
        assert_eq!(found.len(), 1, "turn {turn_seq}");
        let memory: TurnMemory = serde_json::from_value(found[0].2.clone()).unwrap();
        assert!(
            memory.key_findings.iter().any(|f| f.contains("Marta") && f.contains(&format!("invoice {i} "))),
            "{memory:?}"
        );
    }
    assert!(rig.events_of(a, "turn_memory").await.iter().all(|(_, _, p)| p["turn_seq"] != plain));
    // Titles come from the first exchange, once per session, through `title_if_empty`.
    assert_eq!(rig.title(a).await.as_deref(), Some("Please remind Marta that invoice 0"));
    assert_eq!(rig.title(b).await.as_deref(), Some("Please remind Marta that invoice 1"));
    assert_eq!(rig.model_calls(TITLE_MARKER), 2);

    // Replays: the same committed events under new message ids, then a consumer reset that
    // redelivers the whole feed to both copies. Neither appends or costs a model call for
    // a turn already distilled.
    let distills = rig.model_calls(DISTILL_MARKER);
    assert_eq!(distills, with_facts.len() + 1);
    let republished = rig.republish_feed().await;
    assert_eq!(republished, 9 + with_facts.len(), "the feed stores the answers and the residues");
    rig.settle(&["distiller"]).await;
    rig.reset_consumer("distiller").await;
    // The copies notice the deleted consumer and create it again from the feed's start.
    support_wait_for_consumer(&rig).await;
    rig.settle(&["distiller"]).await;
    let mut after = rig.events_of(a, "turn_memory").await;
    after.extend(rig.events_of(b, "turn_memory").await);
    assert_eq!(after.len(), memories.len(), "replays appended nothing");
    // Only the turn without a residue is distilled again (nothing records it was done).
    assert_eq!(
        rig.model_calls(DISTILL_MARKER),
        distills + 3,
        "replays of distilled turns cost no model call"
    );
    assert_eq!(rig.model_calls(TITLE_MARKER), 2);
    assert!(rig.dead_letters().await.is_empty());
    rig.stop().await;
}

/// Waits until the distillers have recreated their deleted consumer.
async fn support_wait_for_consumer(rig: &Rig) {
    let stream = rig.bus.js.get_stream(rig.bus.names.events_stream()).await.unwrap();
    turnlog_testkit::eventually(Duration::from_secs(30), || {
        let stream = stream.clone();
        let name = rig.consumer("distiller");
        async move { stream.consumer_info(name).await.ok().filter(|i| i.delivered.stream_sequence > 0) }
    })
    .await;
}

/// A recorded multi-step tool turn (DESIGN §14): the distiller is woken by its answer only
/// (not by its steps), sends the mini model the question, every tool's name, arguments
/// and output in order and the answer, and its residue names the file the calls changed,
/// the failure and why (the error result), and the findings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_step_tool_turn_is_distilled_from_its_calls_and_results() {
    use turnlog_core::events::{EventBody, ToolExecution};
    let mut rig = Rig::start().await;
    let c = config::distiller(&rig.env, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_distiller::run(c, stop));
    let session = rig.create_session().await;
    let mut log = turnlog_core::log_builder::LogBuilder::new();
    log.user("Fix the build before Ingrid ships it.");
    let write = r#"{"path":"src/main.rs","content":"fn main() {}"}"#;
    log.tool_step("Writing the fix.", "call_w", "write_file", write);
    log.push(EventBody::ToolExecution(ToolExecution {
        call_id: "call_w".into(),
        name: "write_file".into(),
        source: Some("client".into()),
        args: serde_json::from_str(write).ok(),
        output: Some("wrote 12 bytes".into()),
        status: "ok".into(),
        ..Default::default()
    }));
    log.tool_step("", "call_t", "run_tests", "{}");
    log.push(EventBody::ToolExecution(ToolExecution {
        call_id: "call_t".into(),
        name: "run_tests".into(),
        source: Some("client".into()),
        args: Some(serde_json::json!({})),
        output: Some("cargo test failed because the linker ran out of memory".into()),
        is_error: Some(true),
        status: "error".into(),
        ..Default::default()
    }));
    log.assistant("The fix is in; Ingrid must rerun the 14 tests on a larger machine.");
    let mut answer = 0;
    for e in log.events.iter().filter(|e| !matches!(e.body, EventBody::SessionStarted(_))) {
        let request = turnlog_runtime::bus::AppendRequest::append(
            session,
            &turnlog_e2e::rig::owner(turnlog_e2e::rig::OWNER),
            uuid::Uuid::now_v7(),
            &e.body,
        );
        answer = rig.send(&request).await.seq.unwrap();
    }
    rig.settle(&["distiller"]).await;
    // One distillation, of the whole turn.
    assert_eq!(rig.model_calls(DISTILL_MARKER), 1);
    let asked = rig
        .mock
        .log()
        .entries()
        .into_iter()
        .find(|r| r.body["messages"][0]["content"].as_str().is_some_and(|c| c.contains(DISTILL_MARKER)))
        .unwrap();
    let material = asked.body["messages"][1]["content"].as_str().unwrap().to_owned();
    let write_line = material
        .find("- write_file (ok) with content: fn main() {}, path: src/main.rs → result: wrote 12 bytes");
    let test_line =
        material.find("- run_tests (error) → error: cargo test failed because the linker ran out of memory");
    assert!(write_line.is_some() && test_line > write_line, "{material}");
    assert!(material.contains("Fix the build before Ingrid") && material.contains("14 tests"), "{material}");

    let memories = rig.events_of(session, "turn_memory").await;
    assert_eq!(memories.len(), 1, "{memories:?}");
    let memory: TurnMemory = serde_json::from_value(memories[0].2.clone()).unwrap();
    assert_eq!(memories[0].2["turn_seq"], answer);
    assert_eq!(memory.files_changed, ["src/main.rs"]);
    assert!(
        memory
            .failures
            .iter()
            .any(|f| f.what.contains("run_tests") && f.why == "the linker ran out of memory"),
        "{memory:?}"
    );
    assert!(memory.key_findings.iter().any(|f| f.contains("14 tests")), "{memory:?}");
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_model_sends_each_turn_to_the_dead_letters_after_max_deliveries() {
    let mut rig = Rig::start().await;
    let broken = turnlog_mock_llm::spawn(failing_mock()).await.unwrap();
    let c = config::distiller(&rig.env, &broken.base_url());
    rig.spawn(|stop| turnlog_distiller::run(c, stop));
    let s = rig.create_session().await;
    let t1 = rig.turn(s, "Book the venue for Ada on May 3.", &filler(10, 1)).await;
    let t2 = rig.turn(s, "Budget is 4000 euros.", &filler(10, 2)).await;
    rig.settle(&["distiller"]).await;

    let dead = rig.dead_letters().await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let prefix = &rig.env.bus_prefix;
    for (subject, letter) in &dead {
        assert_eq!(subject, &format!("{prefix}.dead.distill_failed.{s}"));
        assert_eq!(letter.reason, "distill_failed");
        assert!(
            letter.detail.contains("after 3 deliveries") && letter.detail.contains("500"),
            "{}",
            letter.detail
        );
        let event: serde_json::Value = serde_json::from_str(&letter.request).unwrap();
        assert!(event["seq"] == t1 || event["seq"] == t2);
    }
    // Every delivery made exactly one call (a model error is not an invalid answer).
    assert_eq!(model_calls(&broken, DISTILL_MARKER), 2 * 3);
    assert!(rig.events_of(s, "turn_memory").await.is_empty());
    assert_eq!(rig.title(s).await, None);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_distilling_across_a_nats_restart() {
    let mut nats = turnlog_testkit::private_nats(turnlog_testkit::free_port()).await;
    let mut rig = Rig::start_on(Some(&nats.url())).await;
    let c = config::distiller(&rig.env, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_distiller::run(c, stop));
    let s = rig.create_session().await;
    rig.turn(s, "Ship 12 crates to Oslo.", &filler(10, 1)).await;
    rig.settle(&["distiller"]).await;
    assert_eq!(rig.events_of(s, "turn_memory").await.len(), 1);

    // A crash of the server: the distiller's consumer (durable, in the server's store)
    // and its connection come back without anyone restarting the distiller.
    nats.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.restart().await;
    let turn = rig.turn(s, "Then ship 7 more to Bergen.", &filler(10, 2)).await;
    rig.settle(&["distiller"]).await;
    let memories = rig.events_of(s, "turn_memory").await;
    assert_eq!(memories.len(), 2, "{memories:?}");
    assert_eq!(memories[1].2["turn_seq"], turn);
    rig.stop().await;
}
