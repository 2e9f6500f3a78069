//! Reads are bounded: every query of the ingress runs under TURNLOG_STATEMENT_TIMEOUT (a
//! read cut off is a 503 with Retry-After, and the next one is served), and a search looks
//! its words up in the full-text indexes instead of computing a tsvector per row.

use std::time::{Duration, Instant};

use turnlog_core::events::{EventBody, UserMessage};
use turnlog_e2e::api::{Api, Options, ALICE};
use turnlog_e2e::rig::owner;
use turnlog_runtime::read::{self, ListQuery};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_past_the_statement_timeout_is_503_and_the_service_keeps_serving() {
    let api =
        Api::with(Options { statement_timeout: Duration::from_millis(200), ..Options::default() }).await;
    let id = api.create(ALICE, Some("held up")).await;
    let text = EventBody::UserMessage(UserMessage { text: "still here".into(), ..Default::default() });
    api.append(id, "alice", &text).await;
    let path = format!("/v1/sessions/{id}");

    // Another connection holds a lock that every read of the log waits for.
    let mut locker = api.env.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE session_events IN ACCESS EXCLUSIVE MODE").execute(&mut *locker).await.unwrap();
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), api.get(&path, ALICE))
        .await
        .expect("a read waiting on a lock was not cut off by the statement timeout");
    assert_eq!((r.status, r.error_code()), (503, "unavailable"), "{}", r.text);
    let retry_after: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    assert!(!r.text.contains("statement timeout"), "internal detail leaked: {}", r.text);
    // Meanwhile reads that do not need the locked table are served.
    assert_eq!(api.get("/v1/sessions", ALICE).await.status, 200);

    locker.rollback().await.unwrap();
    let r = api.get(&path, ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["items"][0]["text"], "still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_pool_of_every_service_cancels_a_long_statement() {
    let api = Api::start().await;
    // The pool the ingress and the workers build, with a short limit.
    let pool = turnlog_runtime::db::connect_reads(&api.env.database_url, 1, Duration::from_millis(100))
        .await
        .unwrap();
    let err = sqlx::query("SELECT pg_sleep(2)").execute(&pool).await.unwrap_err();
    assert!(turnlog_runtime::db::is_query_canceled(&err), "{err}");
    // The connection is fine afterwards.
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await.unwrap();
    assert_eq!(one, 1);
}

/// §9.6: only the writer writes Postgres. The readers' pools refuse any write (SQLSTATE
/// 25006), the ingress's own pool included; the same database takes it from the writer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_a_readers_pool_fails() {
    let api = Api::start().await;
    let config = turnlog_e2e::config::ingress(&api.env);
    let ingress = turnlog_ingress::Ingress::connect(config).await.unwrap();
    let readers =
        turnlog_runtime::db::connect_reads(&api.env.database_url, 1, Duration::from_secs(5)).await.unwrap();
    let write = "INSERT INTO sessions (id, owner, last_seq, created_at, updated_at, active_at) \
                 VALUES (gen_random_uuid(), 'mallory', 0, now(), now(), now())";
    for pool in [&ingress.pool, &readers] {
        let err = sqlx::query(write).execute(pool).await.unwrap_err();
        let code = err.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("25006"), "{err}");
        // Not even inside an explicit transaction.
        let mut tx = pool.begin().await.unwrap();
        assert!(sqlx::query(write).execute(&mut *tx).await.is_err());
    }
    let writable = turnlog_runtime::db::connect(&api.env.database_url, 1).await.unwrap();
    sqlx::query(write).execute(&writable).await.unwrap();
}

/// Sessions of two owners with ten user messages each, every message naming one of 5,000
/// topics, written straight into the tables (the test may write Postgres; the service may
/// not), so the planner has the statistics of a real deployment.
async fn seed_many_sessions(pool: &sqlx::PgPool) {
    sqlx::query(
        "INSERT INTO sessions (id, owner, title, archived, last_seq, created_at, updated_at, active_at)
         SELECT gen_random_uuid(), CASE WHEN i % 2 = 0 THEN 'alice' ELSE 'bob' END, 'session ' || i,
                i % 7 = 0, 11, now() - i * interval '1 second', now() - i * interval '1 second',
                now() - i * interval '1 second'
           FROM generate_series(1, 3000) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
         SELECT s.id, n + 1, gen_random_uuid(), 'user_message',
                jsonb_build_object('text', 'message ' || n || ' about topic t' || abs(hashtext(s.id::text || n) % 5000)),
                5, 0, s.created_at
           FROM sessions s, generate_series(1, 10) AS n",
    )
    .execute(pool)
    .await
    .unwrap();
    // What the writer's search indexer does for committed events.
    sqlx::query(
        "INSERT INTO search_entries (session_id, seq, owner, kind, body, created_at)
         SELECT e.session_id, e.seq, s.owner, 'user', turnlog_search_text(e.kind, e.payload), e.created_at
           FROM session_events e JOIN sessions s ON s.id = e.session_id",
    )
    .execute(pool)
    .await
    .unwrap();
    // And what it does after a large write: merge the index's pending list (gin.rs), which
    // the planner otherwise prices as a scan of every pending row.
    sqlx::query("SELECT gin_clean_pending_list('search_entries_fts')").execute(pool).await.unwrap();
    for table in ["sessions", "session_events", "search_entries"] {
        sqlx::query(&format!("ANALYZE {table}")).execute(pool).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_uses_the_full_text_indexes_and_finds_what_a_scan_would() {
    let api = Api::start().await;
    let pool = &api.env.pool;
    seed_many_sessions(pool).await;
    // A topic some of alice's sessions mention, and a title word.
    let topic: String = sqlx::query_scalar(
        "SELECT substring(e.payload ->> 'text' from 't[0-9]+$') FROM session_events e
           JOIN sessions s ON s.id = e.session_id WHERE s.owner = 'alice' ORDER BY e.seq, s.id LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();

    for q in [topic.as_str(), "2024"] {
        let query = ListQuery { limit: 50, q: Some(q.to_owned()), archived: false, before: None };
        let plan = read::explain_list_sessions(pool, &owner("alice"), &query).await.unwrap();
        assert!(
            plan.contains("search_entries_fts") && plan.contains("sessions_title_fts"),
            "search for {q:?} does not use the full-text indexes:\n{plan}"
        );

        // The same sessions a word-by-word scan finds: by message text or by title, archived
        // ones included, newest first.
        let expected: Vec<String> = sqlx::query_scalar(
            "SELECT s.id::text FROM sessions s
              WHERE s.owner = 'alice'
                AND ($1 = ANY (string_to_array(s.title, ' '))
                     OR EXISTS (SELECT 1 FROM session_events e WHERE e.session_id = s.id
                                   AND $1 = ANY (string_to_array(e.payload ->> 'text', ' '))))
              ORDER BY s.active_at DESC, s.id DESC LIMIT 50",
        )
        .bind(q)
        .fetch_all(pool)
        .await
        .unwrap();
        assert!(!expected.is_empty(), "{q} matches nothing");
        let r = api.get(&format!("/v1/sessions?q={q}&limit=50"), ALICE).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let found: Vec<String> = r.json["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(found, expected, "q={q}");
    }
}
