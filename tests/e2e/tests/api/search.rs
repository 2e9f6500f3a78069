//! `GET /v1/search` (DESIGN §2) over the index the writer keeps off its commit path: user
//! messages, answers and titles, best first with marked snippets, owner-scoped, archived
//! included, forks with their own hits only, deleted sessions gone, and an index that
//! catches up after a restart.

use reqwest::Method;
use serde_json::{json, Value};
use turnlog_e2e::api::{Api, Body, Options, ALICE, BOB};
use turnlog_mock_llm::MockConfig;

/// The hits for `q` once the index has caught up with the log (it trails it by a fraction
/// of a second).
async fn hits(api: &Api, token: &str, q: &str) -> Vec<Value> {
    api.env.search_caught_up().await;
    let r = api.get(&format!("/v1/search?q={q}&limit=100"), token).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json["hits"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_finds_messages_answers_and_titles_of_the_owner_only() {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api =
        Api::with(Options { llm_url: Some(mock.base_url()), partitions: 4, ..Options::default() }).await;
    let trip = api.create(ALICE, Some("Zanzibar trip")).await;
    let r = api.message(trip, ALICE, "Which ferry goes to Zanzibar from Dar? [mock words=5]").await;
    assert_eq!(r.end()["status"], "completed");
    let answer_seq = r.end()["assistant_seq"].as_i64().unwrap();
    // The mock's answer echoes no question words: append one that names the island.
    let other = api.create(ALICE, None).await;
    let answer = turnlog_core::log_builder::assistant_turn("Zanzibar is warm in June.", None);
    api.append(other, "alice", &turnlog_core::events::EventBody::AssistantTurn(answer)).await;
    let bobs = api.create(BOB, Some("Zanzibar for Bob")).await;
    api.message(bobs, BOB, "Zanzibar again [mock words=3]").await;

    let found = hits(&api, ALICE, "zanzibar").await;
    let kinds: Vec<&str> = found.iter().map(|h| h["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds[0], "title", "a title weighs double: {found:?}");
    assert!(kinds.contains(&"user") && kinds.contains(&"assistant"), "{kinds:?}");
    for h in &found {
        assert!(h["snippet"].as_str().unwrap().contains("<mark>Zanzibar</mark>"), "{h}");
        assert_ne!(h["session_id"], bobs.to_string(), "another owner's hits stay theirs");
    }
    let user_hit = found.iter().find(|h| h["kind"] == "user").unwrap();
    assert_eq!(
        (&user_hit["session_id"], &user_hit["session_title"]),
        (&json!(trip.to_string()), &json!("Zanzibar trip"))
    );
    assert_eq!(user_hit["seq"], answer_seq - 1);
    let bob = hits(&api, BOB, "zanzibar").await;
    assert!(bob.len() >= 2 && bob.iter().all(|h| h["session_id"] == bobs.to_string()), "{bob:?}");

    // Text is escaped in snippets; archived sessions are found; paging is by cursor.
    let tags = api.create(ALICE, None).await;
    api.append(tags, "alice", &user("a <script>alert(1)</script> near the Zanzibar coast")).await;
    let page = api
        .call(
            Method::PATCH,
            &format!("/v1/sessions/{tags}"),
            Some(ALICE),
            Body::Json(json!({"archived": true})),
        )
        .await;
    assert_eq!(page.status, 200);
    let found = hits(&api, ALICE, "zanzibar").await;
    let escaped = found.iter().find(|h| h["session_id"] == tags.to_string()).unwrap();
    let snippet = escaped["snippet"].as_str().unwrap();
    assert!(
        snippet.contains("&lt;/script&gt;") && !snippet.contains("<script") && !snippet.contains("</script"),
        "{escaped}"
    );
    let mut paged: Vec<Value> = Vec::new();
    let mut path = "/v1/search?q=zanzibar&limit=2".to_owned();
    loop {
        let page = api.get(&path, ALICE).await;
        paged.extend(page.json["hits"].as_array().unwrap().iter().cloned());
        match page.json["next"].as_str() {
            Some(next) => path = format!("/v1/search?q=zanzibar&limit=2&cursor={next}"),
            None => break,
        }
    }
    assert_eq!(paged, found, "the pages add up to the whole list");

    // A fork shows its own hits only; a deleted session's hits are gone.
    let fork = api.call(Method::POST, &format!("/v1/sessions/{trip}/fork"), Some(ALICE), Body::None).await;
    let fork: String = fork.json["id"].as_str().unwrap().to_owned();
    api.append(fork.parse().unwrap(), "alice", &user("on the branch: Zanzibar by plane")).await;
    let found = hits(&api, ALICE, "zanzibar").await;
    let of_fork: Vec<&str> =
        found.iter().filter(|h| h["session_id"] == fork).map(|h| h["kind"].as_str().unwrap()).collect();
    assert_eq!(of_fork.len(), 2, "its title (its parent's) and its own message: {of_fork:?}");
    assert!(of_fork.contains(&"title") && of_fork.contains(&"user"));
    let r = api.call(Method::DELETE, &format!("/v1/sessions/{other}"), Some(ALICE), Body::None).await;
    assert_eq!(r.status, 204);
    assert!(hits(&api, ALICE, "zanzibar").await.iter().all(|h| h["session_id"] != other.to_string()));

    // The client's mistakes.
    for query in ["", "q=", "q=x&limit=0", "q=x&cursor=abc", "q=x&cursor=-1"] {
        let r = api.get(&format!("/v1/search?{query}"), ALICE).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{query}: {}", r.text);
    }
    api.stop().await;
}

fn user(text: &str) -> turnlog_core::events::EventBody {
    turnlog_core::events::EventBody::UserMessage(turnlog_core::events::UserMessage {
        text: text.into(),
        ..Default::default()
    })
}

/// `api` stopped, its search index emptied and its position reset (as if the index had
/// fallen behind when its writer stopped), and started again on the same database.
async fn restarted_with_an_empty_index(api: Api) -> Api {
    let env = api.stop().await;
    sqlx::query("DELETE FROM search_entries").execute(&env.pool).await.unwrap();
    sqlx::query("UPDATE search_positions SET stream_seq = 0").execute(&env.pool).await.unwrap();
    let mut configs = turnlog_e2e::config::stack(&env);
    configs.ingress.tokens = turnlog_ingress::ApiTokens::parse(turnlog_e2e::api::TOKENS).unwrap();
    Api::on(env, configs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_catches_up_from_its_position_after_a_restart() {
    let api = Api::start().await;
    let s = api.create(ALICE, None).await;
    for i in 0..20 {
        api.append(s, "alice", &user(&format!("note {i} about Lisbon"))).await;
    }
    assert_eq!(hits(&api, ALICE, "lisbon").await.len(), 20);
    // As if the index had fallen behind when its writer stopped.
    let api = restarted_with_an_empty_index(api).await;
    assert_eq!(hits(&api, ALICE, "lisbon").await.len(), 20);
    api.stop().await;
}

/// The rows the writer indexes from the events in hand hold what `turnlog_search_text`
/// (the bulk paths' definition: catch-up, rebuild) makes of the stored events: joined text
/// blocks and nothing else, the first 65,536 characters of a long text, no row for an
/// answer without text; and the catch-up after a restart writes the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_index_and_the_stored_definition_agree() {
    use turnlog_core::events::{AssistantTurn, Block, BlockType, EventBody, UiPart};
    let block = |kind: BlockType, text: &str| Block { kind, text: Some(text.into()), meta: None };
    let api = Api::start().await;
    let s = api.create(ALICE, None).await;
    let answers = [
        vec![
            block(BlockType::Reasoning, "hidden thought"),
            block(BlockType::Text, "Porto "),
            block(BlockType::Text, "in June"),
        ],
        vec![block(BlockType::ToolCall, "{\"cmd\": \"ls\"}")],
        vec![block(BlockType::Text, "")],
    ];
    for blocks in answers {
        let turn = AssistantTurn { ui: UiPart { blocks }, ..Default::default() };
        api.append(s, "alice", &EventBody::AssistantTurn(turn)).await;
    }
    // 70,000 characters of two bytes each, in words: past the cap by characters, not bytes.
    api.append(s, "alice", &user(&"éé ".repeat(23_334))).await;
    api.append(s, "alice", &user("an ordinary question about Lisbon")).await;

    let differing = || async {
        api.env.search_caught_up().await;
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT (SELECT count(*) FROM search_entries),
                    (SELECT count(*) FROM session_events e
                      WHERE turnlog_search_text(e.kind, e.payload) IS NOT NULL),
                    (SELECT count(*) FROM session_events e
                       LEFT JOIN search_entries se USING (session_id, seq)
                      WHERE se.body IS DISTINCT FROM turnlog_search_text(e.kind, e.payload))",
        )
        .fetch_one(&api.env.pool)
        .await
        .unwrap()
    };
    let (rows, expected, differ) = differing().await;
    assert_eq!((rows, expected, differ), (3, 3, 0), "rows, events with text, rows that differ");
    let long: i32 = sqlx::query_scalar("SELECT max(char_length(body)) FROM search_entries")
        .fetch_one(&api.env.pool)
        .await
        .unwrap();
    assert_eq!(long, 65_536);

    let api = restarted_with_an_empty_index(api).await;
    let differing = || async {
        api.env.search_caught_up().await;
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM session_events e LEFT JOIN search_entries se USING (session_id, seq)
              WHERE se.body IS DISTINCT FROM turnlog_search_text(e.kind, e.payload)",
        )
        .fetch_one(&api.env.pool)
        .await
        .unwrap()
    };
    assert_eq!(differing().await, 0, "the catch-up's rows");
    api.stop().await;
}
