//! The operator tools against real Postgres, NATS and the mock model, with the live writer
//! in-process: a rebuild reproduces the live database (and verify says so, or names what
//! differs), replays add nothing the second time, and a redriven dead letter commits once.

mod deletes;
mod unstorable;

use std::time::{Duration, Instant};

use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_distiller::DISTILL_MARKER;
use turnlog_e2e::history;
use turnlog_e2e::rig::{filler, owner, Rig, OWNER};
use turnlog_ops::dead::{self, DeadEntry};
use turnlog_ops::{ReplayFrom, Verdict};
use turnlog_runtime::bus::{append_and_wait, AppendRequest, DeadLetter, OutcomeStatus};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_from_the_append_stream_reproduces_the_live_database() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let rig = Rig::start().await;
    let shape = history::Shape { sessions: 50, turns: 38, awkward: true };
    let history = history::history(shape);
    let started = Instant::now();
    let last = history::publish(&rig.bus, &history.messages).await;
    history::applied_through(&rig.env.pool, last, WAIT).await;
    let live = &rig.env.pool;
    let events = count(live, "SELECT count(*) FROM session_events").await;
    assert_eq!(events, history.events(), "the live writer applied the history as planned");
    assert!(events >= 10_000, "{events} events");
    eprintln!("{events} events applied live in {:?}", started.elapsed());
    let kinds = count(live, "SELECT count(DISTINCT kind) FROM session_events").await;
    assert_eq!(kinds, 11, "every kind is in the history");
    assert!(count(live, "SELECT count(*) FROM session_events WHERE kind = 'compaction_applied'").await > 100);
    let doomed = history.deleted.expect("a deleted session");
    let gone = format!("SELECT count(*) FROM session_events WHERE session_id = '{doomed}'");
    assert_eq!(count(live, &gone).await, 0);

    let target = rig.env.extra_database().await;
    let started = Instant::now();
    let summary = turnlog_ops::rebuild(&target, &rig.bus, false).await.expect("rebuild");
    eprintln!("rebuilt in {:?}: {summary:?}", started.elapsed());
    assert_eq!(summary.events, events as u64, "the deleted session is not brought back");
    assert_eq!(summary.dead_lettered, 6, "the poison is refused again");
    assert_eq!(summary.unread, 0, "every request in the stream was applied");
    let rebuilt = turnlog_runtime::db::connect(&target, 2).await.expect("target");

    let verdict = turnlog_ops::verify(&rig.env.database_url, &target).await.expect("verify");
    assert_eq!(
        verdict,
        Verdict::Identical {
            sessions: 50,
            events: events as u64,
            memories: memories(live).await,
            search: count(live, "SELECT count(*) FROM search_entries").await as u64,
            files: 0,
        }
    );
    // Outcomes, rejected ones included, are recorded as the live writer recorded them —
    // except the delete's own, whose request went with the session's purge.
    let outcomes = "SELECT count(*) FROM request_outcomes";
    assert_eq!(count(&rebuilt, outcomes).await, count(live, outcomes).await - 1);
    for id in &history.rejected {
        let o =
            turnlog_runtime::read::recorded_outcome(&rebuilt, *id).await.unwrap().expect("outcome recorded");
        let l = turnlog_runtime::read::recorded_outcome(live, *id).await.unwrap().expect("outcome recorded");
        assert_eq!((o.status, &o.reason), (OutcomeStatus::Rejected, &l.reason));
    }
    // The indexes and constraints set aside during the load are all back, as migrated.
    for catalog in [
        "SELECT string_agg(indexdef, E'\\n' ORDER BY indexname) FROM pg_indexes WHERE schemaname = 'public'",
        "SELECT string_agg(conname || ' ' || pg_get_constraintdef(oid), E'\\n' ORDER BY conname)
           FROM pg_constraint WHERE connamespace = 'public'::regnamespace",
    ] {
        let of =
            |pool| async move { sqlx::query_scalar::<_, String>(catalog).fetch_one(pool).await.unwrap() };
        assert_eq!(of(&rebuilt).await, of(live).await);
    }
    let positions = "SELECT stream_seq * 1000000 + published_seq FROM writer_positions";
    assert_eq!(count(&rebuilt, positions).await, count(live, positions).await, "a writer can carry on");

    // A rebuild never writes into a database holding anything.
    let refused = turnlog_ops::rebuild(&target, &rig.bus, false).await.expect_err("non-empty target");
    assert!(format!("{refused:#}").contains("not empty"), "{refused:#}");
    // Nor into one an unfinished rebuild left without the events' constraints.
    let damaged = rig.env.extra_database().await;
    let pool = turnlog_runtime::db::connect(&damaged, 1).await.expect("damaged");
    sqlx::query("ALTER TABLE session_events DROP CONSTRAINT session_events_session_id_event_id_key")
        .execute(&pool)
        .await
        .expect("drop the unique constraint");
    pool.close().await;
    let refused = turnlog_ops::rebuild(&damaged, &rig.bus, false).await.expect_err("damaged target");
    assert!(format!("{refused:#}").contains("lacks its unique constraint"), "{refused:#}");
    // A write the target refuses part-way through the load — an event's (on any of the
    // loading connections) or a memory's (in batch order on the first) — stops the rebuild
    // with the database's reason, whatever the other connections are doing meanwhile.
    let late = i64::try_from(last).unwrap() * 3 / 4;
    for (table, check) in [("session_events", "stream_seq"), ("memories", "turn_seq")] {
        let refusing = rig.env.extra_database().await;
        let pool = turnlog_runtime::db::connect(&refusing, 1).await.expect("refusing");
        let bound: i64 = if table == "memories" { 150 } else { late };
        sqlx::raw_sql(&format!("ALTER TABLE {table} ADD CONSTRAINT refused_late CHECK ({check} < {bound})"))
            .execute(&pool)
            .await
            .expect("add the check");
        pool.close().await;
        let rebuilt = tokio::time::timeout(WAIT, turnlog_ops::rebuild(&refusing, &rig.bus, false));
        let refused = rebuilt.await.expect("the rebuild ends").expect_err("a refused write");
        assert!(format!("{refused:#}").contains("refused_late"), "{table}: {refused:#}");
    }

    // One payload altered: verify names it.
    let (session, seq, payload): (Uuid, i64, serde_json::Value) = sqlx::query_as(
        "SELECT session_id, seq, payload FROM session_events WHERE kind = 'user_message'
          ORDER BY session_id, seq LIMIT 1 OFFSET 77",
    )
    .fetch_one(&rebuilt)
    .await
    .unwrap();
    sqlx::query("UPDATE session_events SET payload = jsonb_set(payload, '{text}', '\"altered\"') WHERE session_id = $1 AND seq = $2")
        .bind(session)
        .bind(seq)
        .execute(&rebuilt)
        .await
        .unwrap();
    match turnlog_ops::verify(&rig.env.database_url, &target).await.expect("verify") {
        Verdict::Different(what) => {
            assert!(
                what.starts_with(&format!("event (session {session}, seq {seq}): payload differs")),
                "{what}"
            );
            assert!(what.contains("\"altered\""), "{what}");
        }
        same => panic!("an altered payload went unnoticed: {same:?}"),
    }
    // Put back, and a missing row instead: named too.
    sqlx::query("UPDATE session_events SET payload = $3 WHERE session_id = $1 AND seq = $2")
        .bind(session)
        .bind(seq)
        .bind(&payload)
        .execute(&rebuilt)
        .await
        .unwrap();
    let memory: Uuid = sqlx::query_scalar(
        "DELETE FROM memories WHERE id = (SELECT id FROM memories ORDER BY id LIMIT 1) RETURNING id",
    )
    .fetch_one(&rebuilt)
    .await
    .unwrap();
    let verdict = turnlog_ops::verify(&rig.env.database_url, &target).await.expect("verify");
    assert_eq!(verdict, Verdict::Different(format!("memory {memory} only in A")));
    rebuilt.close().await;
    rig.stop().await;
}

async fn memories(pool: &sqlx::PgPool) -> u64 {
    u64::try_from(count(pool, "SELECT count(*) FROM memories").await).expect("a count")
}

async fn replay_distiller(
    rig: &Rig,
    from: ReplayFrom,
    session: Option<SessionId>,
) -> turnlog_ops::ReplaySummary {
    let replay = turnlog_ops::Replay::new(from, session);
    let mut config = turnlog_e2e::config::distiller(&rig.env, &rig.mock.base_url());
    config.consumer.replay = Some(replay.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let replay =
        turnlog_ops::replay("distiller", &replay, false, stop, |stop| turnlog_distiller::run(config, stop));
    tokio::time::timeout(WAIT, replay).await.expect("replay finished in time").expect("replay")
}

/// The feed's last sequence once it holds everything committed so far.
async fn feed_end(rig: &Rig) -> u64 {
    rig.env.feed_published().await;
    turnlog_e2e::rig::feed_last_seq(&rig.bus).await.expect("the feed's last sequence")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_distiller_twice_adds_nothing_the_second_time() {
    let rig = Rig::start().await;
    let (a, b) = (rig.create_session().await, rig.create_session().await);
    let mut turns = Vec::new();
    let mut from = ReplayFrom::Sequence(1);
    for i in 0..6 {
        if i == 3 {
            // No distiller runs: the later half of the feed is the range to replay.
            from = ReplayFrom::Sequence(feed_end(&rig).await + 1);
        }
        let s = if i % 2 == 0 { a } else { b };
        let question = format!("Please remind Marta that invoice {i} is due on the {}th.", 10 + i);
        turns.push((s, rig.turn(s, &question, &filler(20, i)).await));
    }
    let memories_of = |rig: &Rig| {
        let pool = rig.env.pool.clone();
        async move {
            sqlx::query_as::<_, (Uuid, i64)>(
                "SELECT session_id, (payload->>'turn_seq')::int8 FROM session_events WHERE kind = 'turn_memory'
                  ORDER BY 1, 2",
            )
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let all = "SELECT count(*) FROM session_events";

    let first = replay_distiller(&rig, from, None).await;
    assert_eq!((first.total, first.handled, first.dead_lettered), (3, 3, 0), "{first:?}");
    let mut later: Vec<(Uuid, i64)> = turns[3..].iter().map(|(s, seq)| (s.0, *seq)).collect();
    later.sort();
    assert_eq!(memories_of(&rig).await, later, "the later turns, and only they, are distilled");
    let (events, calls) = (count(&rig.env.pool, all).await, rig.model_calls(DISTILL_MARKER));
    assert_eq!(calls, 3);

    let second = replay_distiller(&rig, from, None).await;
    assert_eq!(second.handled, 3, "{second:?}");
    assert!(second.through_seq > first.through_seq, "the feed grew by the first replay's appends");
    assert_eq!(count(&rig.env.pool, all).await, events, "the second replay appended nothing");
    assert_eq!(rig.model_calls(DISTILL_MARKER), calls, "nor asked the model again");

    // One session's turns from the feed's start: only that session's earlier turns are new.
    let of_a = replay_distiller(&rig, ReplayFrom::Sequence(1), Some(a)).await;
    assert_eq!(of_a.handled, 3, "{of_a:?}");
    let distilled = memories_of(&rig).await;
    assert!(turns.iter().filter(|(s, _)| *s == a).all(|(s, seq)| distilled.contains(&(s.0, *seq))));
    assert!(
        !distilled.contains(&(turns[1].0 .0, turns[1].1)),
        "session b's early turn was not in the replay"
    );

    // Memory extraction replays live and imported answers together: the whole feed (a
    // consumer on `events.*.<session>` is refused when the feed stores some kinds only),
    // with the other sessions' events skipped.
    let replay = turnlog_ops::Replay::new(ReplayFrom::Sequence(1), Some(a));
    let mut config = turnlog_e2e::config::memory(&rig.env, &rig.mock.base_url());
    config.consumer.replay = Some(replay.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let run = turnlog_ops::replay("memory", &replay, false, stop, |stop| turnlog_memory::run(config, stop));
    let summary = tokio::time::timeout(WAIT, run).await.expect("replay finished in time").expect("replay");
    assert_eq!(summary.dead_lettered, 0, "{summary:?}");
    let extracted: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT session_id, (payload->>'turn_seq')::int8 FROM session_events WHERE kind = 'memory_extracted'
          ORDER BY 1, 2",
    )
    .fetch_all(&rig.env.pool)
    .await
    .unwrap();
    let mut of_a: Vec<(Uuid, i64)> =
        turns.iter().filter(|(s, _)| *s == a).map(|(s, seq)| (s.0, *seq)).collect();
    of_a.sort();
    assert_eq!(extracted, of_a, "session a's answers, and only they");
    rig.stop().await;
}

fn hello(session: SessionId) -> AppendRequest {
    let body = EventBody::UserMessage(UserMessage {
        text: "hello before the session existed".into(),
        ..Default::default()
    });
    AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &body)
}

async fn dead_letters(rig: &Rig) -> Vec<DeadEntry> {
    let mut entries = Vec::new();
    dead::list(&rig.bus, |e| entries.push(e.clone())).await.expect("list");
    entries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_dead_letter_commits_once_after_its_cause_is_fixed() {
    let rig = Rig::start().await;
    let early = SessionId::new();
    let request = hello(early);
    let outcome = append_and_wait(&rig.bus, &rig.env.pool, &request, WAIT).await.unwrap();
    assert_eq!(outcome.reason.as_deref(), Some("unknown_session"));
    let letters = dead_letters(&rig).await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!((letter.letter.reason.as_str(), letter.session()), ("unknown_session", "none"));
    assert_eq!(dead::show(&rig.bus, letter.seq).await.unwrap(), *letter);
    let timeout = Duration::from_secs(10);

    // Redriven before the fix: refused again, as a new dead letter.
    let again = dead::redrive(&rig.bus, Some(&rig.env.pool), letter.seq, timeout).await.unwrap();
    let o = again.outcome.expect("an outcome");
    assert_eq!((o.status, o.reason.as_deref()), (OutcomeStatus::Rejected, Some("unknown_session")));
    assert_eq!(dead_letters(&rig).await.len(), 2);

    // The cause fixed (the session now exists), the redrive commits — once.
    let create = AppendRequest::create(early, &owner(OWNER), None);
    assert!(append_and_wait(&rig.bus, &rig.env.pool, &create, WAIT).await.unwrap().is_applied());
    let fixed = dead::redrive(&rig.bus, Some(&rig.env.pool), letter.seq, timeout).await.unwrap();
    let o = fixed.outcome.expect("an outcome");
    assert_eq!((o.status, o.seq), (OutcomeStatus::Committed, Some(2)));
    let twice = dead::redrive(&rig.bus, None, letter.seq, timeout).await.unwrap();
    let o = twice.outcome.expect("an outcome");
    assert_eq!((o.status, o.seq), (OutcomeStatus::Duplicate, Some(2)));
    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM session_events WHERE session_id = $1 ORDER BY seq")
            .bind(early.0)
            .fetch_all(&rig.env.pool)
            .await
            .unwrap();
    assert_eq!(kinds, ["session_started", "user_message"], "committed once");

    // A worker's dead letter is a committed event: redone by a replay, not a redrive.
    let event = serde_json::json!({"session_id": early, "owner": OWNER, "seq": 2, "event_id": request.request_id,
        "kind": "assistant_turn", "payload": {}, "created_at": "2026-01-01T00:00:00Z"});
    let worker_letter = DeadLetter {
        reason: "distill_failed".into(),
        detail: "distiller: distill_failed: HTTP 500 (after 3 deliveries)".into(),
        stream_seq: Some(4),
        request: event.to_string(),
    };
    let subject = rig.bus.names.dead_subject("distill_failed", Some(early));
    let body = serde_json::to_vec(&worker_letter).unwrap();
    let ack = rig.bus.js.publish(subject, body.into()).await.unwrap().await.unwrap();
    let refused = dead::redrive(&rig.bus, None, ack.sequence, timeout).await.expect_err("not a request");
    assert!(format!("{refused:#}").contains("turnlog replay --worker distiller --from-seq 4"), "{refused:#}");

    // The database stays a function of the APPEND stream, redrives included (once the
    // search index, which trails the log, has the redriven message too).
    rig.env.search_caught_up().await;
    let target = rig.env.extra_database().await;
    turnlog_ops::rebuild(&target, &rig.bus, false).await.expect("rebuild");
    let verdict = turnlog_ops::verify(&rig.env.database_url, &target).await.expect("verify");
    assert!(verdict.is_identical(), "{verdict}");
    rig.stop().await;
}
