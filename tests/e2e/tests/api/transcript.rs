//! `GET /v1/sessions/{id}` pages the transcript (`?before=&limit=`, `earlier` cursor): the
//! pages, followed back to the start, are exactly the whole log's transcript — also where a
//! checkpoint's or a permission request's visibility depends on events past the page — and
//! a page reads only the events it needs.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_core::events::*;
use turnlog_core::ids::{EventId, SessionId};
use turnlog_core::log_builder::{assistant_turn, permission_request, LogBuilder};
use turnlog_core::ui_transcript::{transcript_item, ui_transcript};
use turnlog_e2e::api::{Api, Body, ALICE};
use turnlog_e2e::rig::owner;
use turnlog_runtime::read;

fn pending(partial: &str, attempt: Option<&str>, reason: Option<PendingReason>) -> EventBody {
    EventBody::PendingState(PendingState {
        partial: partial.into(),
        attempt_id: attempt.map(Into::into),
        reason,
        request: None,
    })
}

fn permission(id: &str) -> EventBody {
    permission_request(id, "low")
}

fn resolved(id: &str) -> EventBody {
    EventBody::PermissionResolved(PermissionResolved { id: id.into(), decision: "allow".into() })
}

fn user(text: &str) -> EventBody {
    EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() })
}

fn failed(attempt: Option<&str>) -> EventBody {
    EventBody::TurnFailed(TurnFailed {
        code: "upstream_error".into(),
        message: "the model went away".into(),
        attempt_id: attempt.map(Into::into),
        request: None,
    })
}

fn tool() -> EventBody {
    EventBody::ToolExecution(ToolExecution {
        call_id: "c1".into(),
        name: "ls".into(),
        status: "ok".into(),
        ..Default::default()
    })
}

/// A log with every way an item's visibility depends on later events.
fn tricky_log() -> Vec<EventBody> {
    use PendingReason::*;
    vec![
        user("q1"),
        pending("a", Some("a1"), None),  // superseded by the next checkpoint
        pending("ab", Some("a1"), None), // answered below
        EventBody::AssistantTurn(assistant_turn("abc", Some("a1"))),
        user("q2"),
        permission("p1"), // resolved much later
        tool(),
        pending("x", None, None),               // superseded in its run
        pending("xy", None, Some(Interrupted)), // final: closes its run, shown
        pending("r", None, None),               // the run ends with a user message: shown
        EventBody::TurnMemory(TurnMemory { turn_seq: 5, ..Default::default() }),
        user("q3"),
        pending("f", Some("a2"), None), // its attempt failed: shown
        failed(Some("a2")),
        resolved("p1"),
        permission("p2"),         // never resolved
        pending("s", None, None), // answered by the next event
        EventBody::AssistantTurn(assistant_turn("sure", None)),
        EventBody::CompactionApplied(CompactionApplied {
            summary: "q1 to q3".into(),
            replaces_through_seq: 13,
            facts_extracted: vec![],
        }),
        EventBody::MemoryExtracted(MemoryExtracted { turn_seq: 19, memories: vec![], error: None }),
        user("q4"),
        pending("stop", Some("a3"), Some(Stopped)),
        pending("tail", None, None), // the newest event: shown
    ]
}

/// The whole log's transcript as JSON, from the log itself.
async fn whole_transcript(api: &Api, id: SessionId) -> Vec<Value> {
    let events = read::all_events(&api.env.pool, &owner("alice"), id).await.unwrap().unwrap();
    ui_transcript(&events).iter().map(|i| serde_json::to_value(i).unwrap()).collect()
}

/// Every page from the newest back to the start, `limit` items each; the items in seq order.
async fn follow_pages(api: &Api, id: SessionId, limit: usize) -> Vec<Value> {
    let mut pages: Vec<Vec<Value>> = Vec::new();
    let mut path = format!("/v1/sessions/{id}?limit={limit}");
    loop {
        let r = api.get(&path, ALICE).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        let items = r.json["items"].as_array().unwrap().clone();
        assert!(items.len() <= limit, "{path}: {} items", items.len());
        let earlier = &r.json["earlier"];
        if earlier.is_null() {
            pages.push(items);
            break;
        }
        assert_eq!(items.len(), limit, "{path}: a page with an earlier one is full");
        assert_eq!(earlier["before"], items[0]["seq"], "{path}: earlier.before is the page's first seq");
        path = format!("/v1/sessions/{id}?limit={limit}&before={}", earlier["before"]);
        pages.push(items);
        assert!(pages.len() < 100, "paging does not end");
    }
    pages.into_iter().rev().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transcript_pages_add_up_to_the_whole_transcript() {
    let api = Api::start().await;
    let id = api.create(ALICE, Some("long")).await;
    for body in tricky_log() {
        api.append(id, "alice", &body).await;
    }
    let whole = whole_transcript(&api, id).await;
    let seqs: Vec<i64> = whole.iter().map(|i| i["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        [2, 5, 6, 8, 10, 11, 13, 14, 15, 17, 19, 20, 22, 23, 24],
        "the log is not the one meant"
    );

    // Without parameters: the newest 200 (all of them here), no earlier page.
    let r = api.get(&format!("/v1/sessions/{id}"), ALICE).await;
    assert_eq!(r.json["items"].as_array().unwrap(), &whole);
    assert!(r.json["earlier"].is_null(), "{}", r.text);
    for limit in [1, 2, 3, 4, 5, 7, 14, 15, 1000] {
        assert_eq!(follow_pages(&api, id, limit).await, whole, "limit {limit}");
    }
    // Any seq is a valid `before`, also one of a hidden event or past the end.
    let r = api.get(&format!("/v1/sessions/{id}?before=18&limit=2"), ALICE).await;
    let page: Vec<i64> =
        r.json["items"].as_array().unwrap().iter().map(|i| i["seq"].as_i64().unwrap()).collect();
    assert_eq!((page, &r.json["earlier"]), (vec![15, 17], &json!({"before": 15})));
    let r = api.get(&format!("/v1/sessions/{id}?before=999999&limit=1"), ALICE).await;
    assert_eq!(r.json["items"][0]["seq"], 24);
    let r = api.get(&format!("/v1/sessions/{id}?before=1"), ALICE).await;
    assert_eq!((&r.json["items"], &r.json["earlier"]), (&json!([]), &Value::Null));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_transcript_paging_is_400() {
    let api = Api::start().await;
    let id = api.create(ALICE, None).await;
    for query in ["limit=0", "limit=1001", "limit=-3", "before=0", "before=-1", "before=soon", "limit=ten"] {
        let r = api.get(&format!("/v1/sessions/{id}?{query}"), ALICE).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{query}: {}", r.text);
    }
    assert_eq!(api.get(&format!("/v1/sessions/{id}?limit=1000&before=5"), ALICE).await.status, 200);
    assert_eq!(api.get(&format!("/v1/sessions/{}?limit=5", SessionId::new()), ALICE).await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_description_names_the_transcript_paging() {
    let api = Api::start().await;
    let doc = api.call(Method::GET, "/v1/openapi.json", None, Body::None).await.json;
    let params: Vec<&str> = doc["paths"]["/v1/sessions/{id}"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(params, ["id", "before", "limit"]);
    let detail = &doc["components"]["schemas"]["SessionDetail"]["properties"];
    assert!(detail["earlier"].is_object() && detail["items"].is_object(), "{detail}");
}

/// A small deterministic generator (SplitMix64), so a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len() as u64) as usize]
    }
}

/// A log of `len` random events, weighted toward the kinds whose visibility depends on
/// others: checkpoints with and without attempt ids, answers, failures, permissions.
fn random_log(rng: &mut Rng, len: usize) -> LogBuilder {
    let mut log = LogBuilder::new();
    let attempt = |rng: &mut Rng| (rng.below(3) > 0).then(|| rng.pick(&["a1", "a2", "a3"]).to_owned());
    for _ in 0..len {
        let body = match rng.below(12) {
            0..=1 => user("question"),
            2..=4 => {
                let reason = [None, None, Some(PendingReason::Interrupted), Some(PendingReason::Stopped)]
                    [rng.below(4) as usize];
                pending("partial", attempt(rng).as_deref(), reason)
            }
            5..=6 => EventBody::AssistantTurn(assistant_turn("answer", attempt(rng).as_deref())),
            7 => failed(attempt(rng).as_deref()),
            8 => permission(rng.pick(&["p1", "p2", "p3"])),
            9 => resolved(rng.pick(&["p1", "p2", "p3"])),
            10 => tool(),
            _ => EventBody::TurnMemory(TurnMemory { turn_seq: 1, ..Default::default() }),
        };
        log.push(body);
    }
    log
}

/// Writes `events` as session `id`'s log straight into the tables (the test may write
/// Postgres; the service may not): hundreds of logs through the writer would take minutes.
async fn store_log(pool: &sqlx::PgPool, id: SessionId, events: &[Event]) {
    store_branch(pool, id, &[], events).await;
}

/// [`store_log`] for a fork whose lineage (ancestors root first, each with the last seq
/// its branch reads) is `lineage`.
async fn store_branch(pool: &sqlx::PgPool, id: SessionId, lineage: &[(SessionId, i64)], events: &[Event]) {
    sqlx::query(
        "INSERT INTO sessions (id, owner, archived, last_seq, created_at, updated_at, active_at, lineage,
                               lineage_through)
         VALUES ($1, 'alice', false, $2, now(), now(), now(), $3, $4)",
    )
    .bind(id.0)
    .bind(events.last().map_or(0, |e| e.seq))
    .bind(lineage.iter().map(|(s, _)| s.0).collect::<Vec<_>>())
    .bind(lineage.iter().map(|(_, t)| *t).collect::<Vec<_>>())
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
         SELECT $1, seq, event_id, kind, payload, 0, 0, created_at
           FROM unnest($2::bigint[], $3::uuid[], $4::text[], $5::jsonb[], $6::timestamptz[])
             AS t(seq, event_id, kind, payload, created_at)",
    )
    .bind(id.0)
    .bind(events.iter().map(|e| e.seq).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.event_id.0).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.kind().as_str().to_owned()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.body.to_payload()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.created_at).collect::<Vec<_>>())
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_of_random_logs_is_the_slice_of_the_whole_transcript() {
    let api = Api::start().await;
    let pool = &api.env.pool;
    for seed in 0..60u64 {
        let mut rng = Rng(seed);
        let len = 5 + rng.below(60) as usize;
        let log = random_log(&mut rng, len);
        let id = SessionId::new();
        store_log(pool, id, &log.events).await;
        let whole = ui_transcript(&log.events);
        for _ in 0..6 {
            let before = 1 + rng.below(len as u64 + 3) as i64;
            let limit = 1 + rng.below(6) as usize;
            let page = read::transcript_page(pool, &owner("alice"), id, before, limit as i64)
                .await
                .unwrap()
                .unwrap();
            let items: Vec<_> = page.events.iter().filter_map(transcript_item).collect();
            assert_eq!(
                items.len(),
                page.events.len(),
                "seed {seed}: a page holds an event that shows nothing"
            );
            let older: Vec<_> = whole.iter().filter(|i| i.seq < before).cloned().collect();
            let expected = &older[older.len().saturating_sub(limit)..];
            assert_eq!(items, expected, "seed {seed}, before {before}, limit {limit}");
            let earlier = (older.len() > limit).then(|| expected[0].seq);
            assert_eq!(page.earlier, earlier, "seed {seed}, before {before}, limit {limit}");
        }
    }
}

/// A random log split into a chain of forks (DESIGN §10): each ancestor also holds events
/// of its own after the fork point — noise its forks must never read, with the same
/// attempt and permission ids as theirs — and the tip's pages, raw log and last user
/// message are exactly those of the unsplit log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forks_reads_are_its_branch_log_and_nothing_its_ancestors_added_later() {
    let api = Api::start().await;
    let pool = &api.env.pool;
    for seed in 0..40u64 {
        let mut rng = Rng(10_000 + seed);
        let len = 6 + rng.below(50) as usize;
        let log = random_log(&mut rng, len);
        let events = &log.events;
        let n = events.len();
        let mut cuts: Vec<usize> =
            (0..1 + rng.below(3)).map(|_| 1 + rng.below(n as u64 - 1) as usize).collect();
        cuts.sort_unstable();
        cuts.dedup();
        cuts.push(n);
        let mut lineage: Vec<(SessionId, i64)> = Vec::new();
        let mut start = 0;
        let mut tip = SessionId::new();
        for (k, end) in cuts.iter().enumerate() {
            let mut own = events[start..*end].to_vec();
            if k + 1 < cuts.len() {
                let len = 1 + rng.below(8) as usize;
                let noise = random_log(&mut rng, len);
                for e in noise.events.into_iter().skip(1) {
                    let seq = own.last().map_or(0, |l| l.seq) + 1;
                    own.push(Event { seq, ..e });
                }
            }
            tip = SessionId::new();
            store_branch(pool, tip, &lineage, &own).await;
            lineage.push((tip, events[end - 1].seq));
            start = *end;
        }
        let whole = ui_transcript(events);
        for _ in 0..6 {
            let before = 1 + rng.below(n as u64 + 3) as i64;
            let limit = 1 + rng.below(6) as i64;
            let page =
                read::transcript_page(pool, &owner("alice"), tip, before, limit).await.unwrap().unwrap();
            let items: Vec<_> = page.events.iter().filter_map(transcript_item).collect();
            let older: Vec<_> = whole.iter().filter(|i| i.seq < before).cloned().collect();
            let expected = &older[older.len().saturating_sub(limit as usize)..];
            assert_eq!(items, expected, "seed {seed}, cuts {cuts:?}, before {before}, limit {limit}");
        }
        let all = read::all_events(pool, &owner("alice"), tip).await.unwrap().unwrap();
        assert_eq!(&all, events, "seed {seed}: the raw log");
        let tail = read::live_tail(pool, &owner("alice"), tip).await.unwrap().unwrap();
        assert_eq!(&tail.events, events, "seed {seed}: the live tail");
        let last_user = events.iter().rev().find(|e| e.kind() == EventKind::UserMessage).map(|e| e.seq);
        let found = read::last_user_message(pool, &owner("alice"), tip).await.unwrap().map(|(seq, _, _)| seq);
        assert_eq!(found, last_user, "seed {seed}: the last user message");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_and_a_permission_answer_read_only_the_events_they_need() {
    let api = Api::start().await;
    let pool = &api.env.pool;
    let id = SessionId::new();
    let mut log = LogBuilder::new();
    for i in 0..4 {
        log.push(user(&format!("q{i}")));
    }
    log.push(permission("p1"));
    // Seq 2 is left for an event of a kind a newer writer may add (kinds are added, never
    // changed): neither the newest page nor a permission answer has a reason to read it.
    for e in log.events.iter_mut().skip(1) {
        e.seq += 1;
    }
    store_log(pool, id, &log.events).await;
    sqlx::query(
        "INSERT INTO session_events (session_id, seq, event_id, kind, payload, tokens, stream_seq, created_at)
         VALUES ($1, 2, $2, 'kind_from_the_future', '{}', 0, 0, now())",
    )
    .bind(id.0)
    .bind(EventId::new().0)
    .execute(pool)
    .await
    .unwrap();

    let r = api.get(&format!("/v1/sessions/{id}?limit=3"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let seqs: Vec<i64> =
        r.json["items"].as_array().unwrap().iter().map(|i| i["seq"].as_i64().unwrap()).collect();
    assert_eq!((seqs, &r.json["earlier"]), (vec![5, 6, 7], &json!({"before": 5})));
    let answer = api.decide(id, "p1", "allow").await;
    assert_eq!((answer.status, &answer.json["seq"]), (200, &json!(8)), "{}", answer.text);
    let r = api.get(&format!("/v1/sessions/{id}?limit=1"), ALICE).await;
    assert_eq!(r.json["items"][0]["text"], "q3", "the answered request left the transcript");
}
