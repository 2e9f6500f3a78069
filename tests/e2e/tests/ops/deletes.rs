//! A session deleted and created again under the same id (an Idempotency-Key's chat sent
//! again, any producer reusing an id): the delete removes only what came before it from the
//! streams, so the live database and one rebuilt from TURNLOG_APPEND hold the same second
//! life, and the feed carries its answer.

use std::time::Duration;

use async_nats::jetstream::stream::RawMessageErrorKind;
use tokio_util::sync::CancellationToken;
use turnlog_core::events::{AssistantTurn, EventBody, ExtractedMemory, MemoryExtracted, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_e2e::rig::{owner, OWNER};
use turnlog_ops::Verdict;
use turnlog_runtime::bus::{append_and_wait, AppendRequest, Bus, CommittedEvent, Outcome};
use turnlog_testkit::{eventually, test_env, TestEnv};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

type Writer = (CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>);

fn start_writer(env: &TestEnv) -> Writer {
    let stop = CancellationToken::new();
    (stop.clone(), tokio::spawn(turnlog_writer::run(turnlog_e2e::config::writer(env), stop)))
}

async fn stop_writer((stop, task): Writer) {
    stop.cancel();
    task.await.expect("writer panicked").expect("writer failed");
}

async fn send(bus: &Bus, env: &TestEnv, req: &AppendRequest) -> Outcome {
    let outcome = append_and_wait(bus, &env.pool, req, WAIT).await.expect("an outcome");
    assert!(outcome.is_applied(), "{outcome:?}");
    outcome
}

fn user(session: SessionId, text: &str) -> AppendRequest {
    let body = EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() });
    AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &body)
}

/// An answer with no text: a kind the feed stores (DESIGN §6), not indexed for search.
fn answer(session: SessionId) -> AppendRequest {
    AppendRequest::append(
        session,
        &owner(OWNER),
        Uuid::now_v7(),
        &EventBody::AssistantTurn(AssistantTurn::default()),
    )
}

/// A first life: created, a message, an answer, a memory extracted from them.
async fn first_life(bus: &Bus, env: &TestEnv, session: SessionId) {
    send(bus, env, &AppendRequest::create(session, &owner(OWNER), Some("first life".into()))).await;
    send(bus, env, &user(session, "first life: remember Zanzibar")).await;
    send(bus, env, &answer(session)).await;
    let memory = EventBody::MemoryExtracted(MemoryExtracted {
        turn_seq: 3,
        memories: vec![ExtractedMemory { id: Uuid::now_v7(), text: "likes Zanzibar".into() }],
        error: None,
    });
    send(bus, env, &AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &memory)).await;
}

/// The event ids of a session's events on the feed, in feed order (read one by one by
/// subject: nats-server 2.9 refuses a consumer on `events.*.<session>` when the feed stores
/// some kinds only).
async fn on_the_feed(bus: &Bus, session: SessionId) -> Vec<Uuid> {
    let stream = bus.js.get_stream_no_info(bus.names.events_stream()).await.expect("the feed");
    let subject = bus.names.events_subject("*", session);
    let (mut next, mut out) = (1, Vec::new());
    loop {
        match stream.get_first_raw_message_by_subject(&subject, next).await {
            Ok(m) => {
                next = m.sequence + 1;
                out.push(serde_json::from_slice::<CommittedEvent>(&m.payload).expect("an event").event_id.0);
            }
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return out,
            Err(e) => panic!("reading the feed: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_deleted_and_created_again_rebuilds_as_it_is_live() {
    let env = test_env().await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.expect("bus");
    bus.ensure_topology(None).await.expect("topology");
    let writer = start_writer(&env);
    let (queued, live, bystander) = (SessionId::new(), SessionId::new(), SessionId::new());
    for s in [queued, live, bystander] {
        first_life(&bus, &env, s).await;
    }

    // `queued`: the delete and the second life wait in the stream together, so the delete's
    // removal runs with the second life's requests already behind it.
    stop_writer(writer).await;
    bus.publish_append(&AppendRequest::delete(queued, &owner(OWNER)), None).await.expect("published");
    let queued_again = AppendRequest::create(queued, &owner(OWNER), Some("second life".into()));
    let queued_message = user(queued, "second life");
    let queued_answer = answer(queued);
    for r in [&queued_again, &queued_message, &queued_answer] {
        bus.publish_append(r, None).await.expect("published");
    }
    let writer = start_writer(&env);
    // `live`: deleted (answered once its messages are gone), then created again at once.
    send(&bus, &env, &AppendRequest::delete(live, &owner(OWNER))).await;
    let live_again = AppendRequest::create(live, &owner(OWNER), Some("second life".into()));
    assert_eq!(send(&bus, &env, &live_again).await.seq, Some(1));
    let live_message = user(live, "second life");
    assert_eq!(send(&bus, &env, &live_message).await.seq, Some(2));
    let live_answer = answer(live);
    assert_eq!(send(&bus, &env, &live_answer).await.seq, Some(3));
    send(&bus, &env, &user(bystander, "still here")).await;
    eventually(WAIT, || async {
        let purges: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pending_purges").fetch_one(&env.pool).await.ok()?;
        let queued_events: i64 =
            sqlx::query_scalar("SELECT count(*) FROM session_events WHERE session_id = $1")
                .bind(queued.0)
                .fetch_one(&env.pool)
                .await
                .ok()?;
        (purges == 0 && queued_events == 3).then_some(())
    })
    .await;
    env.feed_published().await;

    for (s, again, message, answer) in [
        (queued, &queued_again, &queued_message, &queued_answer),
        (live, &live_again, &live_message, &live_answer),
    ] {
        let events: Vec<(i64, Uuid)> =
            sqlx::query_as("SELECT seq, event_id FROM session_events WHERE session_id = $1 ORDER BY seq")
                .bind(s.0)
                .fetch_all(&env.pool)
                .await
                .expect("events");
        assert_eq!(
            events,
            [(1, again.request_id), (2, message.request_id), (3, answer.request_id)],
            "only the second life is live"
        );
        let memories: i64 = sqlx::query_scalar("SELECT count(*) FROM memories WHERE session_id = $1")
            .bind(s.0)
            .fetch_one(&env.pool)
            .await
            .expect("memories");
        assert_eq!(memories, 0, "the first life's memory went with it");
        // The first life's answer left the feed; the second life's reached it, though the
        // first life's `<session>:<seq>` came within the feed's duplicate window.
        assert_eq!(on_the_feed(&bus, s).await, [answer.request_id]);
    }
    assert_eq!(on_the_feed(&bus, bystander).await.len(), 1, "another session's answer stays");
    stop_writer(writer).await;

    let target = env.extra_database().await;
    let summary = turnlog_ops::rebuild(&target, &bus, false).await.expect("rebuild");
    assert_eq!(summary.unread, 0, "{summary:?}");
    let verdict = turnlog_ops::verify(&env.database_url, &target).await.expect("verify");
    // Search rows: the user messages of the second lives and the bystander's two.
    assert_eq!(verdict, Verdict::Identical { sessions: 3, events: 11, memories: 1, search: 4, files: 0 });
    let rebuilt = turnlog_runtime::db::connect(&target, 1).await.expect("target");
    let title: Option<String> = sqlx::query_scalar("SELECT title FROM sessions WHERE id = $1")
        .bind(queued.0)
        .fetch_one(&rebuilt)
        .await
        .expect("the second life, rebuilt");
    assert_eq!(title.as_deref(), Some("second life"));
    rebuilt.close().await;
}
