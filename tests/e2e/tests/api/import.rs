//! `POST /v1/import` (issue 25): a ChatGPT export becomes sessions and forks at their
//! branch points, once however often it is sent; a turnlog export of a session family
//! comes back into an empty database with the same transcripts and contexts; bad files
//! import nothing of what is wrong with them.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_core::events::*;
use turnlog_core::log_builder::assistant_turn;
use turnlog_e2e::api::{Api, Body, Options, ALICE, BOB, WAIT};
use turnlog_e2e::rig::owner;

const FIXTURE: &str = include_str!("../../fixtures/chatgpt/conversations.json");

fn user(text: &str) -> EventBody {
    EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() })
}

/// The caller's listed sessions.
async fn sessions(api: &Api, token: &str) -> Vec<Value> {
    let r = api.get("/v1/sessions?limit=100", token).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["sessions"].as_array().unwrap().clone()
}

async fn transcript(api: &Api, id: &str) -> Vec<Value> {
    let r = api.get(&format!("/v1/sessions/{id}?limit=1000"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["items"].as_array().unwrap().clone()
}

/// A transcript item as (seq, kind, text).
type Shown = (i64, String, String);

fn texts(items: &[Value]) -> Vec<Shown> {
    items
        .iter()
        .map(|i| {
            (
                i["seq"].as_i64().unwrap(),
                i["kind"].as_str().unwrap().to_owned(),
                i["text"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

async fn event_count(api: &Api) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&api.env.pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chatgpt_export_becomes_sessions_and_forks_once() {
    let api = Api::start().await;
    let r = api.import(ALICE, Some("chatgpt"), FIXTURE.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let s = &r.json;
    assert_eq!((s["conversations"].as_u64(), s["sessions"].as_u64()), (Some(3), Some(5)), "{s}");
    assert_eq!(s["messages"], 13, "{s}");
    assert_eq!(s["failed"], json!([]));
    let skipped: Vec<&str> =
        s["skipped"].as_array().unwrap().iter().map(|k| k["what"].as_str().unwrap()).collect();
    assert_eq!(skipped.len(), 4, "{skipped:?}");
    assert!(skipped.iter().any(|w| w.starts_with("an image, 1024×768")), "{skipped:?}");
    assert!(skipped.contains(&"custom instructions"), "{skipped:?}");

    let listed = sessions(&api, ALICE).await;
    assert_eq!(listed.len(), 5);
    // Placed by their original last activity, newest first: Tokyo (two days later), the plot,
    // then Porto's three branches.
    let titles: Vec<&str> = listed.iter().map(|s| s["title"].as_str().unwrap()).collect();
    assert_eq!(&titles[..2], ["日本語の質問", "Código y gráficos"]);
    assert_eq!(listed[0]["active_at"], "2023-11-16T22:13:24Z");
    let porto: Vec<&Value> = listed.iter().filter(|s| s["title"] == "Trip to Porto 🇵🇹").collect();
    let main = porto.iter().find(|s| s["forked_from"].is_null()).unwrap();
    let main_id = main["id"].as_str().unwrap();
    let items = transcript(&api, main_id).await;
    assert_eq!(
        texts(&items),
        [
            (2, "user".into(), "Plan three days in Porto for me — here is the map we got.\n\n[not imported: an image, 1024×768]".into()),
            (3, "assistant".into(), "Day 1: Ribeira and the Dom Luís I bridge. Day 2: Livraria Lello and Clérigos. Day 3: Foz do Douro.".into()),
            (4, "user".into(), "What about food?".into()),
            (5, "assistant".into(), "Eat bacalhau à Brás and finish with pastéis de nata.".into()),
        ]
    );
    assert_eq!(items[1]["model"], "gpt-4o");
    assert_eq!(
        items[1]["imported"],
        json!({"source": "chatgpt", "id": "a1", "created_at": "2023-11-14T22:13:40Z"})
    );
    // An imported answer was sent by no request of this log.
    assert_eq!(api.get(&format!("/v1/sessions/{main_id}/requests/3"), ALICE).await.status, 404);

    // The regenerated answer forks after its question, the edit after the first answer.
    let mut forks: Vec<(i64, Vec<Shown>)> = Vec::new();
    for f in porto.iter().filter(|s| !s["forked_from"].is_null()) {
        assert_eq!(f["forked_from"]["session_id"], main_id);
        let own: Vec<_> = texts(&transcript(&api, f["id"].as_str().unwrap()).await);
        forks.push((f["forked_from"]["through_seq"].as_i64().unwrap(), own));
    }
    forks.sort();
    assert_eq!(forks[0].0, 3);
    // A fork's own events follow its session_started, at through_seq + 1.
    assert_eq!(
        forks[0].1[2..],
        [
            (5, "user".into(), "Actually, make it Lisbon instead.".into()),
            (6, "assistant".into(), "Lisbon: Alfama on day 1, Belém on day 2, Sintra on day 3.".into()),
        ]
    );
    assert_eq!(forks[1].0, 4);
    assert_eq!(forks[1].1[3..], [(6, "assistant".into(), "Try a francesinha at Café Santiago.".into())]);

    // The tool call, its output and the reasoning are one answer, with notes.
    let plot = listed.iter().find(|s| s["title"] == "Código y gráficos").unwrap();
    let items = transcript(&api, plot["id"].as_str().unwrap()).await;
    assert_eq!(items.len(), 2);
    assert_eq!(
        items[1]["text"],
        "[not imported: a call to python]\n\n[not imported: the output of python]\n\nAquí está la gráfica: una parábola que llega a 9 en x = 3."
    );
    let blocks = items[1]["blocks"].as_array().unwrap();
    assert_eq!(blocks[0]["type"], "reasoning");
    assert_eq!(items[1]["model"], "o3");

    // Again: nothing is added.
    let before = event_count(&api).await;
    let r = api.import(ALICE, None, FIXTURE.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        (r.json["conversations"].as_u64(), r.json["unchanged"].as_u64()),
        (Some(3), Some(3)),
        "{}",
        r.text
    );
    assert_eq!((r.json["sessions"].as_u64(), r.json["messages"].as_u64()), (Some(0), Some(0)));
    assert_eq!(event_count(&api).await, before);
    assert_eq!(sessions(&api, ALICE).await.len(), 5);
    // Another owner's import is their own: Bob sees none of Alice's.
    assert!(sessions(&api, BOB).await.is_empty());
    assert_eq!(api.dead_letters().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turnlog_export_of_a_family_comes_back_the_same_into_an_empty_database() {
    let source = Api::start().await;
    let root = source.create(ALICE, Some("Zürich — plans ✈")).await;
    source.append(root, "alice", &user("Wir fliegen am 3. März nach Zürich.")).await;
    source.append(root, "alice", &EventBody::AssistantTurn(assistant_turn("Gute Reise! 🧳", None))).await;
    source.append(root, "alice", &user("Und das Hotel?")).await;
    source
        .append(root, "alice", &EventBody::AssistantTurn(assistant_turn("Das Storchen, am Fluss.", None)))
        .await;
    let facts = EventBody::MemoryExtracted(MemoryExtracted {
        turn_seq: 3,
        memories: vec![ExtractedMemory {
            id: uuid::Uuid::now_v7(),
            text: "Flight to Zürich on 3 March.".into(),
        }],
        error: None,
    });
    source.append(root, "alice", &facts).await;
    let compaction = EventBody::CompactionApplied(CompactionApplied {
        summary: "A trip to Zürich on 3 March; hotel Storchen.".into(),
        replaces_through_seq: 5,
        facts_extracted: vec![],
    });
    source.append(root, "alice", &compaction).await;
    source.append(root, "alice", &user("What should we pack?")).await;
    let pending = PendingState { partial: "Warm layers and".into(), ..Default::default() };
    source.append(root, "alice", &EventBody::PendingState(pending)).await;
    // A fork after the first answer, with answers of its own, and a fork of the fork.
    let r = source
        .call(
            Method::POST,
            &format!("/v1/sessions/{root}/fork"),
            Some(ALICE),
            Body::Json(json!({"through_seq": 3})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let fork: turnlog_core::ids::SessionId = r.json["id"].as_str().unwrap().parse().unwrap();
    source
        .call(
            Method::PATCH,
            &format!("/v1/sessions/{fork}"),
            Some(ALICE),
            Body::Json(json!({"title": "Zürich — Variante", "archived": true})),
        )
        .await;
    source.append(fork, "alice", &user("Lieber mit dem Zug?")).await;
    source
        .append(fork, "alice", &EventBody::AssistantTurn(assistant_turn("Der Zug dauert 4 Stunden.", None)))
        .await;
    let r = source
        .call(
            Method::POST,
            &format!("/v1/sessions/{fork}/fork"),
            Some(ALICE),
            Body::Json(json!({"through_seq": 5})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let nested: turnlog_core::ids::SessionId = r.json["id"].as_str().unwrap().parse().unwrap();
    source
        .call(
            Method::PATCH,
            &format!("/v1/sessions/{nested}"),
            Some(ALICE),
            Body::Json(json!({"title": "Zürich — Zug"})),
        )
        .await;
    source.append(nested, "alice", &user("Erste Klasse?")).await;

    // What `turnlog export --owner alice` writes.
    let mut export = Vec::new();
    let n = turnlog_runtime::export::owner(
        &source.env.pool,
        &owner("alice"),
        turnlog_runtime::export::ExportFormat::Turnlog,
        &mut export,
    )
    .await
    .unwrap();
    assert_eq!(n, 3);
    // The session route writes the same family, from any of its sessions.
    let r = source.get(&format!("/v1/sessions/{nested}/export?format=turnlog"), ALICE).await;
    assert_eq!(r.text.as_bytes(), export.as_slice());

    let target = Api::start().await;
    let r = target.import(ALICE, Some("turnlog"), &export).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        (r.json["conversations"].as_u64(), r.json["sessions"].as_u64()),
        (Some(1), Some(3)),
        "{}",
        r.text
    );

    let by_title = |list: Vec<Value>| -> HashMap<String, Value> {
        list.into_iter().map(|s| (s["title"].as_str().unwrap().to_owned(), s)).collect()
    };
    let mut before = by_title(sessions(&source, ALICE).await);
    before.extend(by_title(
        source.get("/v1/sessions?archived=true", ALICE).await.json["sessions"].as_array().unwrap().clone(),
    ));
    let mut after = by_title(sessions(&target, ALICE).await);
    after.extend(by_title(
        target.get("/v1/sessions?archived=true", ALICE).await.json["sessions"].as_array().unwrap().clone(),
    ));
    assert_eq!(after.len(), 3, "{after:?}");
    for (title, was) in &before {
        let now = &after[title];
        assert_eq!(now["archived"], was["archived"], "{title}");
        assert_eq!(now["forked_from"]["through_seq"], was["forked_from"]["through_seq"], "{title}");
        let (a, b) = (was["id"].as_str().unwrap(), now["id"].as_str().unwrap());
        let (old, new) = (transcript(&source, a).await, transcript(&target, b).await);
        // Messages and answers keep their original time (the other items show the import's).
        let shown = |items: &[Value]| -> Vec<Value> {
            items
                .iter()
                .map(|i| {
                    let time = match i["kind"].as_str() {
                        Some("user" | "assistant") => {
                            i["imported"]["created_at"].as_str().or(i["created_at"].as_str())
                        }
                        _ => None,
                    };
                    json!([
                        i["seq"],
                        i["kind"],
                        i["text"],
                        time.map(|t| t.parse::<chrono::DateTime<chrono::Utc>>().unwrap())
                    ])
                })
                .collect()
        };
        assert_eq!(shown(&new), shown(&old), "{title}");
        let old = source.get(&format!("/v1/sessions/{a}/context"), ALICE).await;
        let new = target.get(&format!("/v1/sessions/{b}/context"), ALICE).await;
        assert_eq!(new.status, 200, "{}", new.text);
        assert_eq!(new.json["messages"].to_string(), old.json["messages"].to_string(), "{title}");
    }
    // The extracted fact came along, under an id of the new log.
    let memories: Vec<(String,)> =
        sqlx::query_as("SELECT text FROM memories").fetch_all(&target.env.pool).await.unwrap();
    assert_eq!(memories, [("Flight to Zürich on 3 March.".to_owned(),)]);

    // Twice is once.
    let before = event_count(&target).await;
    let r = target.import(ALICE, None, &export).await;
    assert_eq!(r.json["unchanged"], 1, "{}", r.text);
    assert_eq!(event_count(&target).await, before);
    assert_eq!(target.dead_letters().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_import_nothing_of_what_is_wrong() {
    let api = Api::with(Options { import_max_bytes: Some(8 * 1024 * 1024), ..Options::default() }).await;
    let nothing = |r: &turnlog_e2e::api::Reply, status: u16, words: &str| {
        assert_eq!(r.status, status, "{}", r.text);
        assert!(r.json["error"]["message"].as_str().unwrap().contains(words), "{}", r.text);
    };
    // Cut short, after whole conversations: nothing at all.
    let r = api.import(ALICE, None, &FIXTURE.as_bytes()[..FIXTURE.len() - 200]).await;
    nothing(&r, 400, "ends early");
    // Another format than the one named.
    let sharegpt =
        json!([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]);
    let r = api.import(ALICE, Some("chatgpt"), sharegpt.to_string().as_bytes()).await;
    nothing(&r, 400, "not a ChatGPT export");
    let r = api.import(ALICE, Some("excel"), b"[]").await;
    nothing(&r, 400, "format must be");
    let r = api.import(ALICE, None, b"<html></html>").await;
    nothing(&r, 400, "");
    let r = api.import(ALICE, Some(&"chatgpt ".repeat(500)), FIXTURE.as_bytes()).await;
    nothing(&r, 400, "at most 1024 bytes");
    // Larger than TURNLOG_IMPORT_MAX_BYTES: 50 MB.
    let big = vec![b' '; 50_000_000];
    let r = api.import(ALICE, None, &big).await;
    nothing(&r, 413, "TURNLOG_IMPORT_MAX_BYTES");
    let r = api
        .send(
            api.request(Method::POST, "/v1/import")
                .bearer_auth(ALICE)
                .header("content-type", "text/csv")
                .body("a,b"),
        )
        .await;
    nothing(&r, 415, "multipart");
    assert_eq!(event_count(&api).await, 0);

    // A conversation whose nodes form a cycle fails alone; the others are imported.
    let mut file: Vec<Value> = serde_json::from_str(FIXTURE).unwrap();
    let mut cyclic = file[2].clone();
    cyclic["conversation_id"] = json!("cyclic");
    cyclic["title"] = json!("Im Kreis");
    cyclic["mapping"]["u1"]["parent"] = json!("a2");
    file.push(cyclic);
    let r = api.import(ALICE, None, Value::Array(file).to_string().as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["conversations"], 3);
    let failed = r.json["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["conversation"], "Im Kreis");
    assert!(failed[0]["reason"].as_str().unwrap().contains("cycle"), "{}", r.text);
    assert!(sessions(&api, ALICE).await.iter().all(|s| s["title"] != "Im Kreis"));

    // ShareGPT as JSON lines in a plain JSON body.
    let lines = "{\"id\": \"sg-1\", \"conversations\": [{\"from\": \"human\", \"value\": \"Olá!\"}, {\"from\": \"gpt\", \"value\": \"Olá, tudo bem?\"}]}\n";
    let r = api.call(Method::POST, "/v1/import", Some(ALICE), Body::Raw(lines.as_bytes().to_vec())).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["messages"], 2, "{}", r.text);
    // A message the log cannot store fails its conversation before anything of it is appended.
    let nul = json!([{"id": "sg-2", "conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "bad\u{0}"}]}]);
    let before = event_count(&api).await;
    let r = api.import(ALICE, Some("sharegpt"), nul.to_string().as_bytes()).await;
    assert!(r.json["failed"][0]["reason"].as_str().unwrap().contains("NUL"), "{}", r.text);
    assert_eq!(event_count(&api).await, before);
    // Session metadata the log would refuse fails its conversation here, not in the writer.
    let pairs: serde_json::Map<String, Value> = (0..20).map(|i| (format!("k{i}"), json!("v"))).collect();
    let header = json!({"format": "turnlog", "version": 1, "session": {"id": uuid::Uuid::now_v7(), "metadata": pairs}});
    let started =
        json!({"seq": 1, "event_id": uuid::Uuid::now_v7(), "kind": "session_started", "payload": {}});
    let r = api.import(ALICE, None, format!("{header}\n{started}\n").as_bytes()).await;
    assert!(r.json["failed"][0]["reason"].as_str().unwrap().contains("16 pairs"), "{}", r.text);
    assert_eq!(event_count(&api).await, before);
    // So does an id too long for its index, or a time Postgres cannot hold (each wedged a
    // partition once: issue 37).
    let header = json!({"format": "turnlog", "version": 1, "session": {"id": uuid::Uuid::now_v7()}});
    let answer = |payload: Value| json!({"seq": 2, "event_id": uuid::Uuid::now_v7(), "kind": "assistant_turn", "payload": payload});
    for (payload, says) in [
        (json!({"attempt_id": "a".repeat(8 * 1024)}), "attempt_id is 8192 bytes"),
        (
            json!({"imported": {"source": "chatgpt", "id": "m", "created_at": "-20000-01-01T00:00:00Z"}}),
            "year -20000",
        ),
    ] {
        let r =
            api.import(ALICE, None, format!("{header}\n{started}\n{}\n", answer(payload)).as_bytes()).await;
        assert!(r.json["failed"][0]["reason"].as_str().unwrap().contains(says), "{}", r.text);
        assert_eq!(event_count(&api).await, before);
    }
    assert_eq!(api.dead_letters().await, 0);
}

/// A session of a turnlog export: its id, its fork point, its events after its
/// `session_started` as (kind, payload).
type Exported<'a> = (uuid::Uuid, Option<(uuid::Uuid, i64)>, Vec<(&'a str, Value)>);

/// A turnlog export of `sessions`, as JSON lines.
fn turnlog_file(sessions: &[Exported<'_>]) -> Vec<u8> {
    let mut text = String::new();
    for (id, from, events) in sessions {
        let forked = from.map(|(p, t)| json!({"session_id": p, "through_seq": t}));
        let header = json!({"format": "turnlog", "version": 1, "session": {"id": id, "title": "Crafted", "forked_from": forked}});
        text.push_str(&format!("{header}\n"));
        let first = from.map_or(1, |(_, t)| t + 1);
        let mut lines = vec![("session_started", json!({}))];
        lines.extend(events.iter().cloned());
        for (i, (kind, payload)) in lines.into_iter().enumerate() {
            let line = json!({"seq": first + i as i64, "event_id": uuid::Uuid::now_v7(), "kind": kind, "payload": payload});
            text.push_str(&format!("{line}\n"));
        }
    }
    text.into_bytes()
}

fn hi() -> (&'static str, Value) {
    ("user_message", json!({"text": "hi"}))
}

fn yo() -> (&'static str, Value) {
    ("assistant_turn", json!({"llm": {"message": {"content": "yo"}}}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_that_fails_appends_nothing() {
    let api = Api::start().await;
    let (root, fork) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    // A fork through a seq past its parent's end; a compaction of seqs the log does not hold.
    let files = [
        (turnlog_file(&[(root, None, vec![hi()]), (fork, Some((root, 5)), vec![hi()])]), "seq 5"),
        (
            turnlog_file(&[(
                root,
                None,
                vec![
                    hi(),
                    yo(),
                    ("compaction_applied", json!({"summary": "s", "replaces_through_seq": 999})),
                ],
            )]),
            "replaces_through_seq 999",
        ),
    ];
    let mut left = Vec::new();
    for (file, says) in files {
        let r = api.import(ALICE, None, &file).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let (events, listed) = (event_count(&api).await, sessions(&api, ALICE).await.len());
        if events > 0 || listed > 0 {
            left.push(format!("{says}: {events} events, {listed} sessions; {}", r.text));
        }
        let reason = r.json["failed"][0]["reason"].as_str().unwrap_or("");
        if !reason.contains(says) {
            left.push(format!("{reason:?} should say {says}"));
        }
        assert_eq!(r.json["sessions"], 0, "{}", r.text);
    }
    assert!(left.is_empty(), "{left:#?}");
    assert_eq!(api.dead_letters().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_conversation_is_found_before_anything_of_it_is_appended() {
    let api = Api::start().await;
    // A conversation imported before that has changed since: found before the first append,
    // though its main session alone could take what is new.
    let node = |id: &str, parent: Option<&str>, children: &[&str], role: &str, text: &str, t: f64| {
        let message = json!({"id": id, "author": {"role": role}, "create_time": t,
                             "content": {"content_type": "text", "parts": [text]}});
        (id.to_owned(), json!({"id": id, "parent": parent, "children": children, "message": message}))
    };
    let conversation = |nodes: Vec<(String, Value)>, current: &str| {
        let mapping: serde_json::Map<String, Value> = nodes.into_iter().collect();
        json!([{"conversation_id": "changing", "title": "Changing", "mapping": mapping, "current_node": current}])
            .to_string()
    };
    let before = conversation(
        vec![
            node("u1", None, &["a1", "b1"], "user", "question", 1.7e9),
            node("a1", Some("u1"), &[], "assistant", "answer", 1.7e9 + 1.0),
            node("b1", Some("u1"), &[], "assistant", "another answer", 1.7e9 + 2.0),
        ],
        "a1",
    );
    let r = api.import(ALICE, None, before.as_bytes()).await;
    assert_eq!((r.json["sessions"].as_u64(), r.json["messages"].as_u64()), (Some(2), Some(3)), "{}", r.text);
    let imported = event_count(&api).await;
    // The main path goes on; the fork's answer now follows a question it did not before.
    let after = conversation(
        vec![
            node("u1", None, &["a1", "x1"], "user", "question", 1.7e9),
            node("a1", Some("u1"), &["u2"], "assistant", "answer", 1.7e9 + 1.0),
            node("u2", Some("a1"), &["a2"], "user", "and then?", 1.7e9 + 3.0),
            node("a2", Some("u2"), &[], "assistant", "then this", 1.7e9 + 4.0),
            node("x1", Some("u1"), &["b1"], "user", "inserted", 1.7e9 + 1.5),
            node("b1", Some("x1"), &[], "assistant", "another answer", 1.7e9 + 2.0),
        ],
        "a2",
    );
    let r = api.import(ALICE, None, after.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.json["failed"][0]["reason"].as_str().unwrap_or("").contains("changed"), "{}", r.text);
    assert_eq!(event_count(&api).await, imported, "nothing of the changed conversation is appended");
    assert_eq!(api.dead_letters().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_is_not_an_object_fails_its_conversation() {
    let api = Api::start().await;
    // A JSON array decodes as the struct whose fields it lists, but is no payload.
    let file = turnlog_file(&[(uuid::Uuid::now_v7(), None, vec![("user_message", json!(["hi"]))])]);
    let r = api.import(ALICE, None, &file).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let reason = r.json["failed"][0]["reason"].as_str().unwrap_or_else(|| panic!("{}", r.text));
    assert!(reason.contains("not a JSON object"), "{reason}");
    assert_eq!(event_count(&api).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_request_that_cannot_be_rebuilt_is_a_404_not_a_500() {
    let api = Api::start().await;
    // An answer whose recorded request names its system prompt by hash alone, and no
    // earlier request carries the text: the request cannot be rebuilt, which is not a 500.
    let request = json!({"through_seq": 2, "model": "m", "params": {}, "system": {"sha256": "ab".repeat(32)},
                         "tokens": 1, "body_sha256": "cd".repeat(32)});
    let answer = json!({"llm": {"message": {"content": "yo"}}, "request": request});
    let file = turnlog_file(&[(uuid::Uuid::now_v7(), None, vec![hi(), ("assistant_turn", answer)])]);
    let r = api.import(ALICE, None, &file).await;
    assert_eq!(r.json["messages"], 2, "{}", r.text);
    let id = sessions(&api, ALICE).await[0]["id"].as_str().unwrap().to_owned();
    let r = api.get(&format!("/v1/sessions/{id}/requests/3"), ALICE).await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.json["error"]["message"].as_str().unwrap().contains("system prompt"), "{}", r.text);
    assert_eq!(api.dead_letters().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_lists_a_thousand_failures_and_counts_the_rest() {
    let api = Api::start().await;
    // One good conversation, then 1,500 that are not.
    let mut lines =
        String::from("{\"id\": \"ok\", \"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n");
    for i in 0..1500 {
        lines.push_str(&format!("{{\"id\": \"bad-{i}\", \"conversations\": []}}\n"));
    }
    let r = api.import(ALICE, Some("sharegpt"), lines.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["conversations"], 1);
    assert_eq!(r.json["failed"].as_array().unwrap().len(), turnlog_runtime::import::MAX_LISTED);
    assert_eq!(r.json["failed_total"], 1500);
    assert_eq!(r.json["skipped_total"], 0);
}

/// A streamed upload: `head`, then `pad` spaces, then (once `release` says so) the end;
/// `sent` counts the bytes handed to the connection.
fn held_upload(
    head: &'static str,
    pad: usize,
    sent: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: tokio::sync::watch::Receiver<bool>,
) -> reqwest::Body {
    use std::sync::atomic::Ordering;
    const CHUNK: usize = 64 * 1024;
    let chunks = (pad / CHUNK) + 1;
    let stream = futures::stream::unfold((0usize, release), move |(i, mut release)| {
        let sent = sent.clone();
        async move {
            let chunk = match i {
                0 => bytes::Bytes::from_static(head.as_bytes()),
                i if i <= chunks => bytes::Bytes::from(vec![b' '; CHUNK]),
                i if i == chunks + 1 => {
                    let _ = release.wait_for(|r| *r).await;
                    bytes::Bytes::from_static(b"\n")
                }
                _ => return None,
            };
            sent.fetch_add(chunk.len(), Ordering::SeqCst);
            Some((Ok::<_, std::io::Error>(chunk), (i + 1, release)))
        }
    });
    reqwest::Body::wrap_stream(stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_waits_for_an_import_slot_before_it_is_read() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let api = Api::start().await;
    let (release, held) = tokio::sync::watch::channel(false);
    let post = |body: reqwest::Body| {
        api.request(Method::POST, "/v1/import")
            .bearer_auth(ALICE)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // Uploads that stop short of their end hold every import slot: each is read (so it has
    // its slot) well past what the connection buffers.
    let mut holders = Vec::new();
    for _ in 0..turnlog_runtime::import::FILES_AT_ONCE {
        let sent = Arc::new(AtomicUsize::new(0));
        holders.push(tokio::spawn(post(held_upload("{\"nope\": 1}", 12 << 20, sent.clone(), held.clone()))));
        let deadline = tokio::time::Instant::now() + WAIT;
        while sent.load(Ordering::SeqCst) < 12 << 20 {
            assert!(tokio::time::Instant::now() < deadline, "a holding upload was not read");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // One more waits for a slot unread: only what the connection buffers leaves the client,
    // not the 32 MB the route would spool to disk meanwhile.
    let sent = Arc::new(AtomicUsize::new(0));
    let (_, never) = tokio::sync::watch::channel(true);
    let waiting = tokio::spawn(post(held_upload("{\"nope\": 1}", 32 << 20, sent.clone(), never)));
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = sent.load(Ordering::SeqCst);
        if (now > 0 && now == last) || now > 32 << 20 {
            break;
        }
        last = now;
    }
    assert!(
        sent.load(Ordering::SeqCst) < 16 << 20,
        "{} bytes read before a slot was free",
        sent.load(Ordering::SeqCst)
    );
    assert!(!waiting.is_finished());
    // Once the holders end, it is read and answered.
    release.send_replace(true);
    for h in holders {
        assert_eq!(h.await.unwrap().unwrap().status(), 400);
    }
    let r = waiting.await.unwrap().unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("cannot tell the format"));
}

/// Everything of `owner`'s in the log, as text: sessions, events and memories.
async fn rows_of(api: &Api, owner: &str) -> String {
    let sessions: Vec<(uuid::Uuid, i64, Option<String>, Option<uuid::Uuid>)> =
        sqlx::query_as("SELECT id, last_seq, title, forked_from FROM sessions WHERE owner = $1 ORDER BY id")
            .bind(owner)
            .fetch_all(&api.env.pool)
            .await
            .unwrap();
    let events: Vec<(uuid::Uuid, i64, uuid::Uuid, Value)> = sqlx::query_as(
        "SELECT e.session_id, e.seq, e.event_id, e.payload FROM session_events e
           JOIN sessions s ON s.id = e.session_id WHERE s.owner = $1 ORDER BY e.session_id, e.seq",
    )
    .bind(owner)
    .fetch_all(&api.env.pool)
    .await
    .unwrap();
    format!("{sessions:?}\n{events:?}")
}

/// A second owner importing the first's export, and a crafted turnlog file whose session
/// ids and fork points name the first owner's sessions, gets sessions of its own: the
/// first owner's rows stay as they were, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_owners_import_never_touches_the_first_owners_sessions() {
    let api = Api::start().await;
    let r = api.import(ALICE, Some("chatgpt"), FIXTURE.as_bytes()).await;
    assert_eq!((r.status, r.json["sessions"].as_u64()), (200, Some(5)), "{}", r.text);
    let alice: Vec<uuid::Uuid> =
        sessions(&api, ALICE).await.iter().map(|s| s["id"].as_str().unwrap().parse().unwrap()).collect();
    let before = rows_of(&api, "alice").await;

    let r = api.import(BOB, Some("chatgpt"), FIXTURE.as_bytes()).await;
    assert_eq!((r.status, r.json["sessions"].as_u64()), (200, Some(5)), "{}", r.text);
    assert_eq!(r.json["failed"], json!([]), "{}", r.text);
    let crafted =
        turnlog_file(&[(alice[0], None, vec![hi(), yo()]), (alice[1], Some((alice[0], 2)), vec![hi()])]);
    let r = api.import(BOB, Some("turnlog"), &crafted).await;
    assert_eq!((r.status, r.json["sessions"].as_u64()), (200, Some(2)), "{}", r.text);

    assert_eq!(rows_of(&api, "alice").await, before, "Bob's imports changed Alice's rows");
    let bob: Vec<uuid::Uuid> =
        sessions(&api, BOB).await.iter().map(|s| s["id"].as_str().unwrap().parse().unwrap()).collect();
    assert_eq!(bob.len(), 7, "{bob:?}");
    assert!(bob.iter().all(|id| !alice.contains(id)), "Bob was given one of Alice's session ids");
    for id in &alice {
        let r = api.get(&format!("/v1/sessions/{id}"), BOB).await;
        assert_eq!(r.status, 404, "{}", r.text);
    }
    assert_eq!(api.dead_letters().await, 0);
}
