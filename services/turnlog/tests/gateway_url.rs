//! A gateway URL with credentials (`http://user:pw@gw/v1`) given to `turnlog dev`: the
//! banner and the warnings name the gateway without them, and turns stored through it
//! record its host only.

use std::time::Duration;

use serde_json::{json, Value};
use turnlog_mock_llm::MockConfig;
use turnlog_testkit::{eventually, free_port, test_env, TurnlogProcess};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");
const SECRET: &str = "s3cret-pw";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_shows_and_stores_the_gateway_without_its_credentials() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.expect("the mock model");
    let host = mock.addr().to_string();
    let llm_url = format!("http://gwuser:{SECRET}@{host}/v1");
    let data_dir =
        std::env::temp_dir().join(format!("turnlog-gateway-url-{}", uuid::Uuid::new_v4().simple()));
    let listen = format!("127.0.0.1:{}", free_port());
    let data = data_dir.to_string_lossy().into_owned();
    let vars = [
        ("TURNLOG_LISTEN", listen.as_str()),
        ("TURNLOG_LLM_URL", llm_url.as_str()),
        ("TURNLOG_DATA_DIR", data.as_str()),
        ("RUST_LOG", "info"),
    ];
    // TURNLOG_MODEL stays `mock`, which a configured gateway warns about, naming its URL.
    let dev = TurnlogProcess::start(BIN, &env, &["dev"], &vars);
    let log = || std::fs::read_to_string(dev.log_path()).unwrap_or_default();
    eventually(Duration::from_secs(60), || async { log().contains("turnlog dev is ready").then_some(()) })
        .await;

    let base = format!("http://{listen}");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("a client");
    let session: Value = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({}))
        .send()
        .await
        .expect("create a session")
        .json()
        .await
        .expect("a session");
    let id = session["id"].as_str().expect("an id");
    let turn = http
        .post(format!("{base}/v1/sessions/{id}/messages"))
        .json(&json!({"text": "hello [mock words=3]"}))
        .send()
        .await
        .expect("send a message")
        .text()
        .await
        .expect("the turn's stream");
    assert!(turn.contains("\"status\":\"completed\""), "{turn}");
    let provider: String =
        sqlx::query_scalar("SELECT payload->>'provider' FROM session_events WHERE kind = 'assistant_turn'")
            .fetch_one(&env.pool)
            .await
            .expect("the stored answer");
    assert_eq!(provider, host);

    let printed = log();
    assert!(printed.contains(&format!("http://{host}/v1 (TURNLOG_LLM_URL)")), "the banner names the gateway");
    assert!(printed.contains("TURNLOG_MODEL is still `mock`"), "the warning is printed");
    assert!(!printed.contains(SECRET) && !printed.contains("gwuser"), "credentials printed:\n{printed}");
    drop(dev);
    let _ = std::fs::remove_dir_all(&data_dir);
}
