//! Paging by the composite `(active_at, id)` cursor through HTTP, where every session has
//! the same `active_at`: nothing lost, nothing repeated, the cursor echoed exactly.

use std::collections::HashSet;

use futures::StreamExt;
use reqwest::Method;
use turnlog_e2e::api::{Api, Body, ALICE};

const SESSIONS: usize = 500;
/// One instant for all of them, with microseconds that a lossy echo would break.
const TIED: &str = "2024-05-01T10:00:00.123456Z";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_over_tied_timestamps_loses_and_repeats_nothing() {
    let api = Api::start().await;
    let created: HashSet<String> = futures::stream::iter(0..SESSIONS)
        .map(|i| {
            let api = &api;
            async move { api.create(ALICE, Some(&format!("session {i}"))).await.to_string() }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert_eq!(created.len(), SESSIONS);
    // The test may write Postgres; the service may not.
    sqlx::query("UPDATE sessions SET active_at = $1::timestamptz")
        .bind(TIED)
        .execute(&api.env.pool)
        .await
        .unwrap();

    let mut seen: Vec<String> = Vec::new();
    let mut path = "/v1/sessions?limit=7".to_owned();
    let mut pages = 0;
    loop {
        let r = api.get(&path, ALICE).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        pages += 1;
        let page = r.json["sessions"].as_array().unwrap();
        assert!(page.len() <= 7);
        seen.extend(page.iter().map(|s| s["id"].as_str().unwrap().to_owned()));
        let next = &r.json["next"];
        if next.is_null() {
            break;
        }
        let before = next["before"].as_str().unwrap();
        assert_eq!(before, TIED, "before must be echoed with its microseconds");
        // Sent back exactly as received (percent-encoded as any client would).
        path = format!(
            "/v1/sessions?limit=7&before={}&before_id={}",
            before.replace(':', "%3A"),
            next["before_id"].as_str().unwrap()
        );
        assert!(pages <= SESSIONS, "paging does not end");
    }
    let unique: HashSet<String> = seen.iter().cloned().collect();
    assert_eq!(seen.len(), SESSIONS, "repeated or lost rows across {pages} pages");
    assert_eq!(unique, created);
    // Ties are broken by id, newest (largest) first.
    let mut sorted = seen.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(seen, sorted);
    assert_eq!(pages, SESSIONS.div_ceil(7) + usize::from(SESSIONS.is_multiple_of(7)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_a_cursor_is_400_and_archived_sessions_page_separately() {
    let api = Api::start().await;
    let ids = [
        api.create(ALICE, Some("kept one")).await,
        api.create(ALICE, Some("kept two")).await,
        api.create(ALICE, Some("archived needle")).await,
    ];
    let r = api
        .call(
            Method::PATCH,
            &format!("/v1/sessions/{}", ids[2]),
            Some(ALICE),
            Body::Json(serde_json::json!({"archived": true})),
        )
        .await;
    assert_eq!((r.status, &r.json["archived"]), (200, &serde_json::json!(true)), "{}", r.text);

    let r = api.get("/v1/sessions?limit=1", ALICE).await;
    let next = r.json["next"].clone();
    let (before, before_id) = (next["before"].as_str().unwrap(), next["before_id"].as_str().unwrap());
    for path in [format!("/v1/sessions?before={before}"), format!("/v1/sessions?before_id={before_id}")] {
        let r = api.get(&path, ALICE).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{path}");
    }
    let r = api.get(&format!("/v1/sessions?limit=1&before={before}&before_id={before_id}"), ALICE).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["sessions"][0]["id"], ids[0].to_string());
    assert!(r.json["next"].is_object(), "a full page has a next cursor");

    let listed = |r: &turnlog_e2e::api::Reply| -> Vec<String> {
        r.json["sessions"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_owned()).collect()
    };
    let active = listed(&api.get("/v1/sessions", ALICE).await);
    assert_eq!(active, vec![ids[1].to_string(), ids[0].to_string()]);
    let archived = api.get("/v1/sessions?archived=true", ALICE).await;
    assert_eq!(listed(&archived), vec![ids[2].to_string()]);
    assert!(archived.json["next"].is_null());
    // Search spans archived sessions too.
    api.env.search_caught_up().await;
    assert_eq!(listed(&api.get("/v1/sessions?q=needle", ALICE).await), vec![ids[2].to_string()]);
}
