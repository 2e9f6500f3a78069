//! The compactor against real Postgres, NATS and the mock model, with the writer in-process
//! and turns simulated on the bus; the long-conversation tests run all three workers.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use turnlog_compactor::{CompactReply, CompactRequest, CompactStatus, CompactorConfig, SUMMARY_MARKER_TASK};
use turnlog_core::events::{CompactionApplied, MemoryExtracted};
use turnlog_core::ids::SessionId;
use turnlog_e2e::config::{self, fast_consumer};
use turnlog_e2e::rig::{failing_mock, filler, owner, Rig, OWNER};
use turnlog_mock_llm::MockConfig;
use turnlog_runtime::worker::ConsumerSettings;

/// No window is known for this model, so TURNLOG_CONTEXT_BUDGET decides.
const MODEL: &str = "mock-unknown";
const BUDGET: u32 = 4_000;

/// The compactor of these tests: [`MODEL`]'s turns within [`BUDGET`].
fn compactor_config(rig: &Rig, base_url: &str) -> CompactorConfig {
    CompactorConfig { context_budget: BUDGET, ..config::compactor(&rig.env, base_url, MODEL) }
}

/// The user's side of turn `i`: every third one states a fact with a name and a number.
fn question(i: usize) -> String {
    match i {
        0 => "My name is Zora Quill and my locker code is 4817. Please keep that in mind.".to_owned(),
        i if i % 3 == 0 => format!("Also note that Bruno needs {} chairs for the hall on day {i}.", 10 + i),
        i => format!("{} what do you think", filler(12, i)),
    }
}

async fn compactions(rig: &Rig, session: SessionId) -> Vec<(i64, CompactionApplied)> {
    rig.events_of(session, "compaction_applied")
        .await
        .into_iter()
        .map(|(seq, _, p)| (seq, serde_json::from_value(p).unwrap()))
        .collect()
}

async fn pre_send(
    rig: &Rig,
    session: SessionId,
    owner: &str,
    model: Option<&str>,
    reserve: u32,
) -> CompactReply {
    let request = CompactRequest {
        session_id: session,
        owner: turnlog_core::ids::Owner::parse(owner).unwrap(),
        model: model.map(Into::into),
        reserve_tokens: reserve,
    };
    let subject = rig.bus.names.compact_subject(session);
    let body = serde_json::to_vec(&request).unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(30), rig.bus.client.request(subject, body.into()))
        .await
        .expect("the compactor answers within 30 s")
        .expect("request");
    serde_json::from_slice(&reply.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_120_turn_conversation_stays_within_budget_and_keeps_its_first_facts() {
    let mut rig = Rig::start().await;
    let url = rig.mock.base_url();
    let (d, m, c) =
        (config::distiller(&rig.env, &url), config::memory(&rig.env, &url), compactor_config(&rig, &url));
    rig.spawn(|stop| turnlog_distiller::run(d, stop));
    rig.spawn(|stop| turnlog_memory::run(m, stop));
    rig.spawn(|stop| turnlog_compactor::run(c, stop));
    let s = rig.create_session().await;

    let started = std::time::Instant::now();
    let mut peak = 0;
    for i in 0..120 {
        rig.turn(s, &question(i), &filler(110, i)).await;
        rig.settle(&["distiller", "memory", "compactor"]).await;
        let tokens = rig.next_request_tokens(s).await;
        assert!(tokens <= BUDGET, "after turn {i} the next request is {tokens} tokens, over {BUDGET}");
        peak = peak.max(tokens);
    }
    let elapsed = started.elapsed();

    let done = compactions(&rig, s).await;
    assert!(done.len() >= 5, "several compactions expected, got {}", done.len());
    for (_, c) in &done {
        assert!(!c.summary.trim().is_empty());
        assert!(turnlog_core::tokens::count(&c.summary) <= BUDGET / 4);
    }
    // Each compaction folds the previous summary in: the name and the number of turn 1
    // are in the newest summary, and in the memories.
    let newest = &done.last().unwrap().1.summary;
    assert!(newest.contains("Zora Quill") && newest.contains("4817"), "{newest}");
    let remembered: Vec<String> = sqlx::query_scalar("SELECT text FROM memories WHERE owner = $1")
        .bind(OWNER)
        .fetch_all(&rig.env.pool)
        .await
        .unwrap();
    assert!(remembered.iter().any(|t| t.contains("Zora Quill") && t.contains("4817")), "{remembered:?}");
    // The compactions recorded the facts extracted from the turns they replaced.
    assert!(done.iter().all(|(_, c)| !c.facts_extracted.is_empty()));
    let extracted = rig.events_of(s, "memory_extracted").await;
    assert_eq!(extracted.len(), 120, "one extraction per turn");
    println!(
        "120 turns in {elapsed:?}: {} compactions, peak next request {peak} tokens of {BUDGET}, \
         {} summary calls, {} distillations, {} extractions",
        done.len(),
        rig.model_calls(SUMMARY_MARKER_TASK),
        rig.model_calls(turnlog_distiller::DISTILL_MARKER),
        rig.model_calls(turnlog_memory::MEMORY_MARKER),
    );
    rig.stop().await;
}

/// A session whose history is about `turns` × 150 tokens, then an unanswered question of
/// about `question_words` tokens — as the ingress leaves it right before asking. Needs a
/// compactor running.
async fn session_with_question(rig: &Rig, turns: usize, question_words: usize) -> SessionId {
    let s = rig.create_session().await;
    for i in 0..turns {
        rig.turn(s, &question(i), &filler(130, i)).await;
    }
    // The post-turn checks measure the session as it is when they run: let them finish
    // before the question arrives, so the question is left to the pre-send check.
    rig.settle(&["compactor"]).await;
    rig.user(s, &format!("Here is the draft from Ilse. {}", filler(question_words, 99))).await;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_send_checks_compact_when_over_budget_and_only_then() {
    let mut rig = Rig::start().await;
    let c = compactor_config(&rig, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_compactor::run(c, stop));

    let small = session_with_question(&rig, 2, 20).await;
    let reply = pre_send(&rig, small, OWNER, None, 300).await;
    assert_eq!(reply.status, CompactStatus::NotNeeded, "{reply:?}");
    assert_eq!(reply.budget, Some(BUDGET));
    assert!(compactions(&rig, small).await.is_empty());

    // The history alone fits (the post-turn checks leave it), the question pushes it over.
    let big = session_with_question(&rig, 14, 1_800).await;
    rig.settle(&["compactor"]).await;
    assert!(compactions(&rig, big).await.is_empty());
    let reserve = 250;
    assert!(rig.next_request_tokens(big).await + reserve > BUDGET);
    let reply = pre_send(&rig, big, OWNER, None, reserve).await;
    assert_eq!(reply.status, CompactStatus::Compacted, "{reply:?}");
    let done = compactions(&rig, big).await;
    assert_eq!(done.len(), 1);
    assert_eq!(reply.through_seq, Some(done[0].1.replaces_through_seq));
    let after = rig.next_request_tokens(big).await + reserve;
    assert!(after <= BUDGET, "{after}");
    assert_eq!(reply.tokens, Some(after));
    // The question stays live: the summary replaces only answered turns.
    let last_user: i64 = rig.events_of(big, "user_message").await.last().unwrap().0;
    assert!(done[0].1.replaces_through_seq < last_user);
    assert!(pre_send(&rig, big, OWNER, None, reserve).await.status == CompactStatus::NotNeeded);

    // The model's window sets the budget when it is known (60% of mock-small's 6,700).
    let reply = pre_send(&rig, small, OWNER, Some("mock-small"), 0).await;
    assert_eq!((reply.status, reply.budget), (CompactStatus::NotNeeded, Some(4_020)));
    // Another owner's session does not exist for the caller.
    let reply = pre_send(&rig, small, "mallory", None, 0).await;
    assert_eq!(reply.status, CompactStatus::Failed);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_compactor_copies_apply_one_compaction_per_need() {
    let mut rig = Rig::start().await;
    for _ in 0..3 {
        let c = compactor_config(&rig, &rig.mock.base_url());
        rig.spawn(|stop| turnlog_compactor::run(c, stop));
    }
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(session_with_question(&rig, 14, 1_800).await);
    }
    rig.settle(&["compactor"]).await;
    // Every session asked three times at once, as three ingress copies might.
    let mut asks = Vec::new();
    for s in &sessions {
        for _ in 0..3 {
            let (rig, s) = (&rig, *s);
            asks.push(async move { (s, pre_send(rig, s, OWNER, None, 250).await) });
        }
    }
    let replies = futures::future::join_all(asks).await;
    for s in &sessions {
        let done = compactions(&rig, *s).await;
        assert_eq!(done.len(), 1, "one compaction for session {s}");
        for (_, reply) in replies.iter().filter(|(r, _)| r == s) {
            match reply.status {
                CompactStatus::Compacted => {
                    assert_eq!(reply.through_seq, Some(done[0].1.replaces_through_seq))
                }
                CompactStatus::NotNeeded => {}
                CompactStatus::Failed => panic!("{reply:?}"),
            }
        }
        assert!(replies.iter().any(|(r, reply)| r == s && reply.status == CompactStatus::Compacted));
        assert!(rig.next_request_tokens(*s).await + 250 <= BUDGET);
    }
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_proceeds_while_distillation_and_extraction_keep_failing() {
    let mut rig = Rig::start().await;
    let broken = turnlog_mock_llm::spawn(failing_mock()).await.unwrap();
    let slow_retries = ConsumerSettings { retry_backoff: vec![Duration::from_secs(4)], ..fast_consumer() };
    let d = config::distiller(&rig.env, &broken.base_url());
    let m = turnlog_memory::MemoryConfig {
        consumer: slow_retries,
        ..config::memory(&rig.env, &broken.base_url())
    };
    let mut c = compactor_config(&rig, &rig.mock.base_url());
    c.facts_wait = Duration::from_millis(500);
    rig.spawn(|stop| turnlog_distiller::run(d, stop));
    rig.spawn(|stop| turnlog_memory::run(m, stop));
    rig.spawn(|stop| turnlog_compactor::run(c, stop));

    let s = rig.create_session().await;
    let turns = 28;
    for i in 0..turns {
        rig.turn(s, &question(i), &filler(110, i)).await;
    }
    // The first compaction does not wait for the extractions still retrying.
    let first = turnlog_testkit::eventually(Duration::from_secs(30), || async {
        compactions(&rig, s).await.into_iter().next()
    })
    .await;
    rig.settle(&["distiller", "memory", "compactor"]).await;
    assert!(rig.next_request_tokens(s).await <= BUDGET);

    let extracted = rig.events_of(s, "memory_extracted").await;
    assert_eq!(extracted.len(), turns);
    for (_, _, payload) in &extracted {
        let m: MemoryExtracted = serde_json::from_value(payload.clone()).unwrap();
        assert!(m.memories.is_empty() && m.error.is_some(), "{m:?}");
    }
    let span_extractions: Vec<i64> = extracted
        .iter()
        .filter(|(_, _, p)| p["turn_seq"].as_i64().is_some_and(|t| t <= first.1.replaces_through_seq))
        .map(|(seq, _, _)| *seq)
        .collect();
    assert!(!span_extractions.is_empty() && span_extractions.iter().all(|seq| *seq > first.0));
    assert!(first.1.facts_extracted.is_empty());

    let dead = rig.dead_letters().await;
    assert_eq!(dead.len(), turns, "each distillation dead-lettered once");
    assert!(dead.iter().all(|(_, l)| l.reason == "distill_failed"));
    assert!(rig.events_of(s, "turn_memory").await.is_empty());
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_summaries_are_never_stored_and_shrink_the_span_after_three() {
    let mut rig = Rig::start().await;
    // A reasoning-heavy model: its thinking uses up the output cap, so every summary comes
    // back empty and cut off at the length limit.
    let mut config = MockConfig::default();
    config.defaults.reasoning = 400;
    let thinker = turnlog_mock_llm::spawn(config).await.unwrap();
    let c = compactor_config(&rig, &thinker.base_url());
    rig.spawn(|stop| turnlog_compactor::run(c, stop));
    let s = session_with_question(&rig, 14, 1_800).await;

    let reply = pre_send(&rig, s, OWNER, None, 0).await;
    assert_eq!(reply.status, CompactStatus::Failed, "{reply:?}");
    assert!(compactions(&rig, s).await.is_empty(), "a refused summary is never stored");
    let spans: Vec<usize> = thinker
        .log()
        .entries()
        .iter()
        .filter(|r| {
            r.body["messages"][0]["content"].as_str().is_some_and(|t| t.contains(SUMMARY_MARKER_TASK))
        })
        .map(|r| r.body["messages"][1]["content"].as_str().unwrap().len())
        .collect();
    assert_eq!(spans.len(), 6, "two rounds of three attempts: {spans:?}");
    assert!(spans[..3].iter().all(|l| *l == spans[0]));
    assert!(spans[3..].iter().all(|l| *l == spans[3]));
    assert!(spans[3] < spans[0], "after three refusals the span is halved: {spans:?}");
    rig.stop().await;
}

/// Imported answers (issue 25) are compacted by the next pre-send check, not once each as
/// they arrive, and their facts (extracted later, on a consumer of their own) are not
/// waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_answers_are_compacted_before_the_next_turn_without_waiting_for_their_facts() {
    use turnlog_core::events::{
        AssistantTurn, Block, BlockType, EventBody, Imported, LlmMessage, LlmPart, MessageContent, UiPart,
    };
    let mut rig = Rig::start().await;
    let mut c = compactor_config(&rig, &rig.mock.base_url());
    c.facts_wait = Duration::from_secs(25);
    rig.spawn(|stop| turnlog_compactor::run(c, stop));

    let s = rig.create_session().await;
    for i in 0..30 {
        rig.user(s, &question(i)).await;
        let text = filler(130, i);
        let imported = Imported { source: "chatgpt".into(), id: format!("a{i}"), created_at: None };
        let body = EventBody::AssistantTurn(AssistantTurn {
            ui: UiPart {
                blocks: vec![Block { kind: BlockType::Text, text: Some(text.clone()), meta: None }],
            },
            llm: LlmPart {
                message: LlmMessage { content: Some(MessageContent::Text(text)), ..Default::default() },
            },
            imported: Some(Box::new(imported)),
            ..Default::default()
        });
        let request =
            turnlog_runtime::bus::AppendRequest::append(s, &owner(OWNER), uuid::Uuid::now_v7(), &body);
        rig.send(&request).await;
    }
    rig.settle(&["compactor"]).await;
    assert!(compactions(&rig, s).await.is_empty(), "no post-turn compaction of imported answers");
    assert!(rig.next_request_tokens(s).await > BUDGET);

    let asked = std::time::Instant::now();
    let reply = pre_send(&rig, s, OWNER, None, 200).await;
    assert_eq!(reply.status, CompactStatus::Compacted, "{reply:?}");
    // No memory worker runs: a wait for the turns' facts would take the whole 25 s.
    assert!(asked.elapsed() < Duration::from_secs(15), "{:?}", asked.elapsed());
    assert!(rig.next_request_tokens(s).await + 200 <= BUDGET);
    rig.stop().await;
}

/// An earlier version's compactor had one consumer on the whole feed. The compactor now has
/// one for answers and one for residues (DESIGN §6): the residue consumer starts where the
/// old consumer's acknowledgements stood, and the old consumer is switched in place to
/// answers only. No residue is skipped, and after the switch each consumer receives only its
/// own kind. (That a consumer keeps its old filter while something is pending under it is
/// `memory::an_earlier_import_consumer_extracts_its_backlog_before_it_switches`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_whole_feed_consumer_is_split_without_skipping_a_residue() {
    use async_nats::jetstream::consumer::DeliverPolicy;
    use futures::StreamExt as _;
    use turnlog_core::events::{EventBody, TurnMemory};

    let mut rig = Rig::start().await;
    let old = rig.earlier_consumer("compactor", "*.*").await;
    let s = rig.create_session().await;
    // A turn and its residue, as the distiller appends it.
    async fn turn_with_residue(rig: &Rig, s: SessionId, i: usize) {
        let answer = rig.turn(s, &question(i), &filler(20, i)).await;
        let residue = EventBody::TurnMemory(TurnMemory { turn_seq: answer, ..Default::default() });
        rig.send(&turnlog_runtime::bus::AppendRequest::append(
            s,
            &owner(OWNER),
            uuid::Uuid::now_v7(),
            &residue,
        ))
        .await;
    }
    turn_with_residue(&rig, s, 1).await;
    rig.settle(&[]).await;
    // The earlier version handled everything so far (each ack confirmed, so the ack floor
    // read next is where it stands)...
    let mut handled = 0;
    let mut batch = old.fetch().max_messages(100).messages().await.unwrap();
    while let Some(m) = batch.next().await {
        m.unwrap().double_ack().await.unwrap();
        handled += 1;
    }
    assert_eq!(handled, 2, "the answer and the residue (the feed stores no other kind of these)");
    let acked = rig.consumer_info("compactor").await.ack_floor.stream_sequence;
    // ...and was stopped before a second turn.
    turn_with_residue(&rig, s, 2).await;
    rig.settle(&[]).await;

    let c = compactor_config(&rig, &rig.mock.base_url());
    rig.spawn(|stop| turnlog_compactor::run(c, stop));
    rig.settle(&["compactor"]).await;
    let residue = rig.consumer_info("compactor-residue").await;
    assert_eq!(residue.config.deliver_policy, DeliverPolicy::ByStartSequence { start_sequence: acked + 1 });
    // (Delivery counts below allow one more: a pull answered late is handed back and comes
    // again.)
    assert!((1..=2).contains(&residue.delivered.consumer_sequence), "the second turn's residue alone");
    // Switched once its backlog was through (looked at every 5 s).
    rig.switched_to("compactor", "assistant_turn.*").await;
    let before = rig.consumer_info("compactor").await.delivered.consumer_sequence;

    turn_with_residue(&rig, s, 3).await;
    rig.settle(&["compactor"]).await;
    let answers = rig.consumer_info("compactor").await.delivered.consumer_sequence - before;
    assert!((1..=2).contains(&answers), "the answer alone, not the question or the residue: {answers}");
    let residues = rig.consumer_info("compactor-residue").await.delivered.consumer_sequence
        - residue.delivered.consumer_sequence;
    assert!((1..=2).contains(&residues), "the residue alone: {residues}");
    rig.stop().await;
}
