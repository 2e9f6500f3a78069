//! Forks, edits and regenerates over HTTP (DESIGN §10), on four partitions: a fork reads its
//! parent's log through the fork point without a copy, lands on its parent's partition,
//! keeps the provider's prompt cache, and deleting a member of a family keeps exactly what
//! the surviving branches inherit — the same after a rebuild.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_compactor::CompactorConfig;
use turnlog_core::events::{EventBody, ExtractedMemory, ForkPoint, MemoryExtracted, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_e2e::api::{Api, Body, Options, ALICE, BOB};
use turnlog_e2e::config;
use turnlog_e2e::rig::{filler, owner, Rig, OWNER};
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_ops::Verdict;
use turnlog_runtime::bus::{append_and_wait, partition_of, AppendRequest, OutcomeStatus};
use turnlog_runtime::read;
use turnlog_testkit::eventually;

const PARTITIONS: u32 = 4;

async fn forks_api() -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let opts = Options { llm_url: Some(mock.base_url()), partitions: PARTITIONS, ..Options::default() };
    (Api::with(opts).await, mock)
}

async fn fork(api: &Api, id: impl std::fmt::Display, body: Value) -> Value {
    let r = api.call(Method::POST, &format!("/v1/sessions/{id}/fork"), Some(ALICE), Body::Json(body)).await;
    assert_eq!(r.status, 201, "{}", r.text);
    r.json
}

fn id_of(session: &Value) -> SessionId {
    session["id"].as_str().unwrap().parse().unwrap()
}

/// A session's transcript items and the model's context messages.
async fn views(api: &Api, id: SessionId) -> (Value, Value) {
    let detail = api.get(&format!("/v1/sessions/{id}"), ALICE).await;
    assert_eq!(detail.status, 200, "{}", detail.text);
    let context = api.get(&format!("/v1/sessions/{id}/context"), ALICE).await;
    assert_eq!(context.status, 200, "{}", context.text);
    (detail.json["items"].clone(), context.json["messages"].clone())
}

/// Every event of a session's branch log through `/events`: (owning session, seq, kind).
async fn branch_log(api: &Api, id: SessionId) -> Vec<(String, i64, String)> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = api.get(&format!("/v1/sessions/{id}/events?after={after}&limit=7"), ALICE).await;
        assert_eq!(page.status, 200, "{}", page.text);
        for e in page.json["events"].as_array().unwrap() {
            let owner = e["session_id"].as_str().unwrap().to_owned();
            out.push((owner, e["seq"].as_i64().unwrap(), e["kind"].as_str().unwrap().to_owned()));
        }
        match page.json["next_after"].as_i64() {
            Some(next) => after = next,
            None => return out,
        }
    }
}

async fn stored_events(api: &Api, id: SessionId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM session_events WHERE session_id = $1")
        .bind(id.0)
        .fetch_one(&api.env.pool)
        .await
        .unwrap()
}

async fn turn(api: &Api, id: SessionId, text: &str) -> Value {
    let r = api.message(id, ALICE, text).await;
    assert_eq!(r.status, 200, "{:?}", r.json);
    assert_eq!(r.end()["status"], "completed", "{:?}", r.events);
    r.events[0].data.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_reads_its_parents_log_through_the_fork_point_and_copies_nothing() {
    let (api, _mock) = forks_api().await;
    let parent = api.create(ALICE, Some("trip planning")).await;
    for i in 0..3 {
        turn(&api, parent, &format!("question {i} [mock words=8]")).await;
    }
    // session_started, then three turns: 7 events.
    let (parent_items, parent_context) = views(&api, parent).await;

    let f = fork(&api, parent, json!({})).await;
    let child = id_of(&f);
    assert_eq!(f["title"], "trip planning", "titled like its parent");
    assert_eq!(f["forked_from"], json!({"session_id": parent.to_string(), "through_seq": 7}));
    assert_eq!(
        partition_of(child, PARTITIONS),
        partition_of(parent, PARTITIONS),
        "on the parent's partition"
    );
    assert_eq!(stored_events(&api, child).await, 1, "only its own session_started is stored");
    let (items, context) = views(&api, child).await;
    assert_eq!((items, context.clone()), (parent_items.clone(), parent_context.clone()));
    let log = branch_log(&api, child).await;
    assert_eq!(log.len(), 8);
    assert!(
        log[..7].iter().all(|(owner, _, _)| *owner == parent.to_string()),
        "inherited events name the parent"
    );
    assert_eq!(log[7], (child.to_string(), 8, "session_started".to_owned()));
    assert_eq!(log.iter().map(|e| e.1).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>(), "gapless");

    // The fork's own turn continues the branch; the parent does not see it.
    let meta = turn(&api, child, "question on the branch [mock words=8]").await;
    assert_eq!(meta["session_id"], child.to_string());
    assert_eq!(meta["user_seq"], 9);
    assert_eq!(views(&api, parent).await, (parent_items, parent_context));
    let (_, child_context) = views(&api, child).await;
    assert_eq!(
        child_context.as_array().unwrap()[..context.as_array().unwrap().len()],
        context.as_array().unwrap()[..]
    );

    // The parent goes on after the fork exists: nothing of its later events reaches the
    // fork's log, transcript or context.
    let child_before = (branch_log(&api, child).await, views(&api, child).await);
    turn(&api, parent, "the parent goes on [mock words=8]").await;
    api.append(
        parent,
        "alice",
        &EventBody::UserMessage(UserMessage { text: "and on".into(), ..Default::default() }),
    )
    .await;
    assert!(branch_log(&api, parent).await.len() >= 10, "the parent grew");
    assert_eq!((branch_log(&api, child).await, views(&api, child).await), child_before);

    // A fork through an earlier seq, and one through a seq the child inherited.
    let early = id_of(&fork(&api, parent, json!({"through_seq": 3})).await);
    assert_eq!(branch_log(&api, early).await.len(), 4);
    let grand = fork(&api, child, json!({"through_seq": 5})).await;
    assert_eq!(grand["forked_from"], json!({"session_id": child.to_string(), "through_seq": 5}));
    let grand_id = id_of(&grand);
    let mut expected: Vec<_> = log[..5].to_vec();
    expected.push((grand_id.to_string(), 6, "session_started".to_owned()));
    assert_eq!(branch_log(&api, grand_id).await, expected, "the parent's first five events, then its own");

    // The parent lists its forks; the list shows each branch as a session.
    let detail = api.get(&format!("/v1/sessions/{parent}"), ALICE).await;
    let forks: Vec<&str> =
        detail.json["forks"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap()).collect();
    assert_eq!(forks, [child.to_string(), early.to_string()]);
    let list = api.get("/v1/sessions", ALICE).await;
    assert_eq!(list.json["sessions"].as_array().unwrap().len(), 4);

    // Bad fork points are the client's mistake; another owner's session is not found.
    for body in [json!({"through_seq": 0}), json!({"through_seq": 1000}), json!({"through_seq": "x"})] {
        let r = api
            .call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(ALICE), Body::Json(body))
            .await;
        assert_eq!(r.status, 400, "{}", r.text);
    }
    let r = api.call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(BOB), Body::None).await;
    assert_eq!(r.status, 404, "{}", r.text);
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_and_regenerate_run_in_forks_and_keep_the_prompt_cache() {
    let (api, mock) = forks_api().await;
    let parent = api.create(ALICE, None).await;
    // Long enough that the mock's prompt cache reports hits (1,024 tokens and more).
    turn(&api, parent, &format!("{} [mock words=20]", filler(1500, 1))).await;
    let second = turn(&api, parent, "and the second question [mock words=20]").await;
    let second_user = second["user_seq"].as_i64().unwrap();
    let answers = |m: &MockHandle| {
        m.log().entries().into_iter().filter(|r| r.path.ends_with("/chat/completions")).collect::<Vec<_>>()
    };
    let parent_request = answers(&mock).last().unwrap().body["messages"].clone();

    // Regenerate the last answer: a fork through its user message runs it again.
    let path = format!("/v1/sessions/{parent}/retry");
    let headers = [("idempotency-key", "regen-1")];
    let r = api.turn(Method::POST, &path, ALICE, Some(json!({"of": second_user + 1})), &headers).await;
    assert_eq!(r.status, 200, "{:?}", r.json);
    let regen: SessionId = r.events[0].data["session_id"].as_str().unwrap().parse().unwrap();
    assert_ne!(regen, parent);
    assert_eq!(r.events[0].data["user_seq"], second_user, "no second copy of the message");
    assert_eq!(r.headers["x-session-id"], regen.to_string().as_str());
    let end = r.end().clone();
    assert_eq!(end["status"], "completed");
    assert!(end["usage"]["cached_input_tokens"].as_u64().unwrap_or(0) >= 1024, "the cache hit: {end}");
    let regen_request = answers(&mock).last().unwrap().body["messages"].clone();
    assert_eq!(regen_request, parent_request, "the fork's first request is the parent's, byte for byte");
    // The resend answers from the same fork, without a new turn or a new fork.
    let calls = answers(&mock).len();
    let again = api.turn(Method::POST, &path, ALICE, Some(json!({"of": second_user + 1})), &headers).await;
    assert_eq!(again.events[0].data["session_id"], regen.to_string());
    assert_eq!(again.end()["status"], "completed");
    assert_eq!(answers(&mock).len(), calls);

    // Edit the second question: a fork through the seq before it runs the new text.
    let send = format!("/v1/sessions/{parent}/messages");
    let edit = json!({"text": "the edited second question [mock words=5]", "edit_of": second_user});
    let headers = [("idempotency-key", "edit-1")];
    let r = api.turn(Method::POST, &send, ALICE, Some(edit.clone()), &headers).await;
    assert_eq!(r.status, 200, "{:?}", r.json);
    let edited: SessionId = r.events[0].data["session_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        r.events[0].data["user_seq"],
        second_user + 1,
        "the fork's session_started is at {second_user}"
    );
    assert!(r.end()["usage"]["cached_input_tokens"].as_u64().unwrap_or(0) >= 1024);
    let again = api.turn(Method::POST, &send, ALICE, Some(edit), &headers).await;
    assert_eq!(again.events[0].data["session_id"], edited.to_string(), "a resend answers from the fork");
    let (items, _) = views(&api, edited).await;
    let texts: Vec<&str> = items
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["kind"] == "user")
        .map(|i| i["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[1], "the edited second question [mock words=5]");
    let detail = api.get(&format!("/v1/sessions/{parent}"), ALICE).await;
    assert_eq!(detail.json["forks"].as_array().unwrap().len(), 2, "one fork each, resends included");

    // Not an answer / not a user message: the client's mistake.
    let r = api.turn(Method::POST, &path, ALICE, Some(json!({"of": second_user})), &[]).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"));
    let r = api.turn(Method::POST, &send, ALICE, Some(json!({"text": "x", "edit_of": 1})), &[]).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"));
    // Seqs at the edge of the integers are the client's mistake too, not an overflow.
    for seq in [i64::MIN, 0, -1, i64::MAX] {
        let r = api.turn(Method::POST, &path, ALICE, Some(json!({"of": seq})), &[]).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "of {seq}");
        let r = api.turn(Method::POST, &send, ALICE, Some(json!({"text": "x", "edit_of": seq})), &[]).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "edit_of {seq}");
    }
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_nest_64_deep_and_read_their_whole_branch() {
    let (api, _mock) = forks_api().await;
    let root = api.create(ALICE, None).await;
    let message = |text: String| EventBody::UserMessage(UserMessage { text, ..Default::default() });
    api.append(root, "alice", &message("level 0".into())).await;
    let mut tip = root;
    for level in 1..=64 {
        tip = id_of(&fork(&api, tip, json!({})).await);
        api.append(tip, "alice", &message(format!("level {level}"))).await;
    }
    let (items, context) = views(&api, tip).await;
    let texts: Vec<String> =
        items.as_array().unwrap().iter().map(|i| i["text"].as_str().unwrap().to_owned()).collect();
    assert_eq!(texts, (0..=64).map(|l| format!("level {l}")).collect::<Vec<_>>());
    assert_eq!(context.as_array().unwrap().len(), 65);
    let log = branch_log(&api, tip).await;
    assert_eq!(log.iter().map(|e| e.1).collect::<Vec<_>>(), (1..=130).collect::<Vec<_>>());
    assert_eq!(log.iter().map(|e| &e.0).collect::<HashSet<_>>().len(), 65, "each level's events are its own");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_refuses_forks_it_cannot_apply() {
    let (api, _mock) = forks_api().await;
    let parent = api.create(ALICE, None).await;
    let target = partition_of(parent, PARTITIONS);
    let draw = |same: bool| {
        std::iter::repeat_with(SessionId::new)
            .find(|id| (partition_of(*id, PARTITIONS) == target) == same)
            .unwrap()
    };
    let from = |through_seq| ForkPoint { session_id: parent, through_seq };
    let cases = [
        (AppendRequest::fork(draw(false), &owner("alice"), None, from(1)), "wrong_partition"),
        (AppendRequest::fork(draw(true), &owner("alice"), None, from(2)), "bad_fork_point"),
        (AppendRequest::fork(draw(true), &owner("bob"), None, from(1)), "owner_mismatch"),
        (
            AppendRequest::fork(
                draw(true),
                &owner("alice"),
                None,
                ForkPoint { session_id: SessionId::new(), through_seq: 1 },
            ),
            "unknown_session",
        ),
    ];
    let dead_before = api.dead_letters().await;
    for (req, reason) in &cases {
        let outcome = append_and_wait(&api.bus, &api.env.pool, req, Duration::from_secs(15)).await.unwrap();
        assert_eq!((outcome.status, outcome.reason.as_deref()), (OutcomeStatus::Rejected, Some(*reason)));
    }
    eventually(Duration::from_secs(10), || async {
        (api.dead_letters().await == dead_before + 4).then_some(())
    })
    .await;
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_branch_keeps_what_its_forks_inherit_until_the_last_one_goes() {
    let (api, _mock) = forks_api().await;
    let a = api.create(ALICE, Some("root")).await;
    turn(&api, a, "a one [mock words=5]").await;
    turn(&api, a, "a two [mock words=5]").await; // a: 1..=5
    let b = id_of(&fork(&api, a, json!({"through_seq": 3})).await); // b: 4 = session_started
    turn(&api, b, "b one [mock words=5]").await; // 5, 6
    api.append(b, "alice", &memories(6, "kept: c inherits this extraction")).await; // 7
    turn(&api, b, "b two [mock words=5]").await; // 8, 9
    api.append(b, "alice", &memories(9, "goes: above c's fork point")).await; // 10
    let c = id_of(&fork(&api, b, json!({"through_seq": 7})).await); // c: 8 = session_started
    turn(&api, c, "c one [mock words=5]").await;
    let before_a = views(&api, a).await;
    let before_c = views(&api, c).await;
    rebuilt_identical(&api).await;

    // The middle one goes: 404 everywhere, gone from lists; a and c project as before.
    let r = api.call(Method::DELETE, &format!("/v1/sessions/{b}"), Some(ALICE), Body::None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    for path in ["", "/events", "/context", "/fork"] {
        let method = if path == "/fork" { Method::POST } else { Method::GET };
        let r = api.call(method, &format!("/v1/sessions/{b}{path}"), Some(ALICE), Body::None).await;
        assert_eq!(r.status, 404, "{path}: {}", r.text);
    }
    assert_eq!(api.message(b, ALICE, "hello").await.status, 404);
    let listed: Vec<String> = api.get("/v1/sessions", ALICE).await.json["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(!listed.contains(&b.to_string()) && listed.len() == 2, "{listed:?}");
    assert_eq!(views(&api, a).await, before_a);
    assert_eq!(views(&api, c).await, before_c);
    // b keeps what c inherits (4..=7), nothing above, hidden and untitled; of its
    // memories, those extracted by the events it keeps.
    let kept: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM session_events WHERE session_id = $1 ORDER BY seq")
            .bind(b.0)
            .fetch_all(&api.env.pool)
            .await
            .unwrap();
    assert_eq!(kept, [4, 5, 6, 7]);
    let remembered: Vec<String> = sqlx::query_scalar("SELECT text FROM memories WHERE session_id = $1")
        .bind(b.0)
        .fetch_all(&api.env.pool)
        .await
        .unwrap();
    assert_eq!(remembered, ["kept: c inherits this extraction"]);
    let (title, hidden): (Option<String>, Option<i64>) =
        sqlx::query_as("SELECT title, hidden_seq FROM sessions WHERE id = $1")
            .bind(b.0)
            .fetch_one(&api.env.pool)
            .await
            .unwrap();
    assert_eq!(title, None);
    assert!(hidden.is_some());
    purged(&api).await;
    rebuilt_identical(&api).await;

    // The last session inheriting b's prefix goes: so does the prefix.
    let r = api.call(Method::DELETE, &format!("/v1/sessions/{c}"), Some(ALICE), Body::None).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(stored_events(&api, b).await, 0);
    assert_eq!(stored_events(&api, c).await, 0);
    let memories: i64 =
        sqlx::query_scalar("SELECT count(*) FROM memories").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(memories, 0);
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sessions").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(rows, 1, "only a is left");
    assert_eq!(views(&api, a).await, before_a);
    purged(&api).await;
    rebuilt_identical(&api).await;
    api.stop().await;
}

/// A `memory_extracted` of the turn at `turn_seq` with one memory.
fn memories(turn_seq: i64, text: &str) -> EventBody {
    EventBody::MemoryExtracted(MemoryExtracted {
        turn_seq,
        memories: vec![ExtractedMemory { id: uuid::Uuid::now_v7(), text: text.into() }],
        error: None,
    })
}

/// Waits until every delete's stream messages are removed.
async fn purged(api: &Api) {
    eventually(Duration::from_secs(30), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pending_purges").fetch_one(&api.env.pool).await.ok()?;
        (n == 0).then_some(())
    })
    .await;
}

/// A rebuild of a fresh database from the APPEND stream is identical to the live one.
async fn rebuilt_identical(api: &Api) {
    api.env.search_caught_up().await;
    let target = api.env.extra_database().await;
    turnlog_ops::rebuild(&target, &api.bus, false).await.expect("rebuild");
    let verdict = turnlog_ops::verify(&api.env.database_url, &target).await.expect("verify");
    assert!(matches!(verdict, Verdict::Identical { .. }), "{verdict}");
}

/// Draws a fork id on `parent`'s partition, as the ingress does.
fn fork_id(parent: SessionId) -> SessionId {
    let target = partition_of(parent, PARTITIONS);
    std::iter::repeat_with(SessionId::new).find(|id| partition_of(*id, PARTITIONS) == target).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_memories_and_titles_work_across_a_fork_point() {
    const BUDGET: u32 = 4_000;
    let mut rig = Rig::start_with(None, PARTITIONS).await;
    let url = rig.mock.base_url();
    let (d, m) = (config::distiller(&rig.env, &url), config::memory(&rig.env, &url));
    let c = CompactorConfig { context_budget: BUDGET, ..config::compactor(&rig.env, &url, "mock-unknown") };
    rig.spawn(|stop| turnlog_distiller::run(d, stop));
    rig.spawn(|stop| turnlog_memory::run(m, stop));
    rig.spawn(|stop| turnlog_compactor::run(c, stop));
    let workers = ["distiller", "memory", "compactor"];
    let question =
        |i: usize| format!("Note that Bruno needs {} chairs on day {i}. {}", 10 + i, filler(12, i));

    let parent = rig.create_session().await;
    let mut i = 0;
    while rig.events_of(parent, "compaction_applied").await.len() < 2 {
        assert!(i < 40, "the parent should compact twice within 40 turns");
        rig.turn(parent, &question(i), &filler(110, i)).await;
        rig.settle(&workers).await;
        i += 1;
    }
    let parent_title = rig.title(parent).await;
    assert!(parent_title.is_some(), "the distiller titled the parent after its first turn");
    let compactions = rig.events_of(parent, "compaction_applied").await;
    let (first_seq, first) = (compactions[0].0, compactions[0].2.clone());
    let second_seq = compactions[1].0;

    // A fork between the parent's two compactions inherits the first one.
    let fork = fork_id(parent);
    let through = second_seq - 1;
    rig.send(&AppendRequest::fork(
        fork,
        &owner(OWNER),
        None,
        ForkPoint { session_id: parent, through_seq: through },
    ))
    .await;
    let row = read::get_session(&rig.env.pool, &owner(OWNER), fork).await.unwrap().unwrap();
    assert_eq!(row.compaction_seq, Some(first_seq));
    assert_eq!(row.compacted_through, first["replaces_through_seq"].as_i64());
    let tail = read::live_tail(&rig.env.pool, &owner(OWNER), fork).await.unwrap().unwrap();
    // The live tail: the inherited compaction and what follows the boundary it replaced.
    let seqs: Vec<i64> = tail.events.iter().map(|e| e.seq).collect();
    let boundary = first["replaces_through_seq"].as_i64().unwrap();
    assert_eq!(seqs, (boundary + 1..=through + 1).collect::<Vec<_>>(), "through its own session_started");
    assert!(seqs.contains(&first_seq));
    let parent_events = |rig: &Rig| {
        let pool = rig.env.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM session_events WHERE session_id = $1")
                .bind(parent.0)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let parent_before = parent_events(&rig).await;

    let mut forked_turns = Vec::new();
    for j in 0..12 {
        forked_turns.push(rig.turn(fork, &question(100 + j), &filler(110, 100 + j)).await);
        rig.settle(&workers).await;
        let tokens = rig.next_request_tokens(fork).await;
        assert!(tokens <= BUDGET, "after the fork's turn {j} its next request is {tokens} tokens");
    }
    // Its compactions are its own, and may reach below the fork point.
    let own = rig.events_of(fork, "compaction_applied").await;
    assert!(!own.is_empty(), "the fork compacted");
    assert!(own.iter().all(|(seq, _, _)| *seq > through));
    // Derived events of its turns are the fork's; the parent got nothing from them.
    let extracted: Vec<i64> = rig
        .events_of(fork, "memory_extracted")
        .await
        .iter()
        .map(|(_, _, p)| p["turn_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(extracted, forked_turns, "one extraction per own turn, none for inherited turns");
    assert_eq!(rig.events_of(fork, "turn_memory").await.len(), forked_turns.len());
    assert_eq!(parent_events(&rig).await, parent_before);
    // The fork's first turn is not its branch's first: the distiller does not title it.
    assert_eq!(rig.title(fork).await, None);
    // The fork's first compaction folded in inherited turns: their facts come from the parent.
    let facts: Vec<String> = own[0].2["facts_extracted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let parent_memories: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM memories WHERE session_id = $1")
            .bind(parent.0)
            .fetch_all(&rig.env.pool)
            .await
            .unwrap();
    assert!(facts.iter().any(|f| parent_memories.contains(f)), "facts {facts:?}");
    rig.stop().await;
}
