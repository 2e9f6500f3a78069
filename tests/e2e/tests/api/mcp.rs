//! Server tools over MCP (DESIGN §14), against the reference servers from npm and a server
//! on the official SDK, over stdio and streamable HTTP: the tools worker's catalogue, the
//! permission chain inside a turn (ask, allow, allow_always, deny, the policy's deny), a
//! turn paused on a prompt and answered after a full restart, stop during a long call, and
//! the worker's own guarantees (error results, timeouts, list-changed, a server killed
//! mid-call, a call delivered again after its worker was killed: run once).

use std::path::PathBuf;
use std::time::Duration;

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use reqwest::Method;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_e2e::api::{Api, Body, Options, ALICE};
use turnlog_e2e::mcp::{bin, catalog_ready, script};
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_runtime::tools::{ToolCallRequest, ToolsBus};

/// A directory of the test's own for the filesystem server.
fn files_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("turnlog-mcp-files")
        .join(format!("{tag}-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    // The server compares paths after resolving links (/tmp may be one).
    dir.canonicalize().unwrap()
}

/// The filesystem server (write_file behind `ask`, high danger; move_file left out), the
/// everything server (echo and the long operation allowed, get-sum denied) and the suites'
/// changing server, all over stdio.
fn servers(files: &std::path::Path) -> String {
    format!(
        r#"
[[servers]]
label = "fs"
command = "{fs}"
args = ["{files}"]
exclude = ["move_file"]
[servers.tools.write_file]
policy = "ask"
danger_level = "high"
[servers.tools.read_text_file]
policy = "allow"
danger_level = "low"

[[servers]]
label = "everything"
command = "{everything}"
[servers.tools.echo]
policy = "allow"
[servers.tools.trigger-long-running-operation]
policy = "allow"
[servers.tools.get-sum]
policy = "deny"

[[servers]]
label = "changing"
command = "node"
args = ["{changing}"]
[servers.tools.grow]
policy = "allow"
[servers.tools.fail]
policy = "allow"
"#,
        fs = bin("mcp-server-filesystem"),
        files = files.display(),
        everything = bin("mcp-server-everything"),
        changing = script("changing-server.mjs"),
    )
}

fn options(mock: &MockHandle, servers: String) -> Options {
    Options { llm_url: Some(mock.base_url()), mcp_servers: Some(servers), ..Options::default() }
}

/// The stack with the tools worker on [`servers`], and the distiller.
async fn with_servers(files: &std::path::Path) -> (Api, MockHandle) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let env = turnlog_testkit::test_env().await;
    // And a server for Bob only: Alice's turns never see it.
    let bobs = format!(
        "{}\n[[servers]]\nlabel = \"bobs\"\ncommand = \"{}\"\nowners = [\"bob\"]\n",
        servers(files),
        bin("mcp-server-everything")
    );
    let mut configs = Api::configs(&env, options(&mock, bobs));
    let distiller = turnlog_e2e::config::distiller(&env, &mock.base_url());
    configs.workers.push(turnlog_dev::Worker::Distiller(distiller));
    let api = Api::on(env, configs).await;
    catalog_ready(&api.bus, &["fs", "everything", "changing", "bobs"]).await;
    (api, mock)
}

/// The session's events of `kind`, their payloads.
async fn payloads(api: &Api, id: SessionId, kind: &str) -> Vec<Value> {
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .map(|e| e["payload"].clone())
        .collect()
}

/// Sends `text` and follows the turn's stream; `on` sees each event and may answer it
/// with a request of its own (a permission decision, a stop). The events, in order.
async fn drive<F, Fut>(api: &Api, id: SessionId, text: &str, mut on: F) -> Vec<(String, Value)>
where
    F: FnMut(String, Value) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let resp = api.message_request(id, ALICE, text).await;
    assert_eq!(resp.status(), 200);
    let mut out = Vec::new();
    let mut events = resp.bytes_stream().eventsource();
    while let Some(e) =
        tokio::time::timeout(Duration::from_secs(60), events.next()).await.expect("the turn went silent")
    {
        let e = e.unwrap();
        let data: Value = serde_json::from_str(&e.data).unwrap();
        on(e.event.clone(), data.clone()).await;
        out.push((e.event, data));
    }
    out
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    let mut names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    names.dedup();
    names
}

fn end(events: &[(String, Value)]) -> &Value {
    &events.last().unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_behind_ask_runs_once_the_user_allows_it() {
    let files = files_dir("ask");
    let (api, mock) = with_servers(&files).await;
    let id = api.create(ALICE, None).await;
    let target = files.join("note.txt");
    let text = format!(
        r#"Save a note [mock tool=fs__write_file:{{"path":"{}","content":"hello"}} words=3]"#,
        target.display()
    );
    let events = drive(&api, id, &text, |name, data| {
        let api = &api;
        async move {
            if name == "permission" {
                let decided = api.decide(id, data["id"].as_str().unwrap(), "allow").await;
                // The turn is live: the answer is JSON, and the turn goes on on its stream.
                assert_eq!((decided.status, decided.json["decision"].as_str()), (200, Some("allow")));
            }
        }
    })
    .await;
    assert_eq!(names(&events), ["meta", "tool_call", "permission", "tool_result", "delta", "end"]);
    let (_, call) = &events[1];
    assert_eq!((call["name"].as_str(), call["source"].as_str()), (Some("fs__write_file"), Some("mcp:fs")));
    let (_, prompt) = &events[2];
    assert_eq!(prompt["tool"], "fs__write_file");
    assert_eq!(prompt["danger_level"], "high");
    assert_eq!(prompt["args"]["content"], "hello");
    assert_eq!(end(&events)["status"], "completed");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "hello");

    // Recorded once, as the server's, with its answer; the model got that answer.
    let runs = payloads(&api, id, "tool_execution").await;
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!((runs[0]["status"].as_str(), runs[0]["source"].as_str()), (Some("ok"), Some("mcp:fs")));
    let output = runs[0]["output"].as_str().unwrap();
    assert!(output.contains("Successfully wrote"), "{output}");
    assert_eq!(payloads(&api, id, "permission_resolved").await[0]["decision"], "allow");
    // The distiller read the real tool traffic: the turn's residue names the file written.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let memory = loop {
        if let Some(m) = payloads(&api, id, "turn_memory").await.pop() {
            break m;
        }
        assert!(tokio::time::Instant::now() < deadline, "no turn_memory");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let changed: Vec<&str> =
        memory["files_changed"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(changed.contains(&target.to_str().unwrap()), "{memory}");
    // The turn's model calls (not the distiller's).
    let sent: Vec<Value> = mock
        .log()
        .entries()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions") && !r.body.to_string().contains("[turnlog:"))
        .map(|r| r.body)
        .collect();
    assert_eq!(sent.len(), 2);
    let offered: Vec<&str> = sent[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert!(offered.contains(&"fs__write_file") && offered.contains(&"everything__echo"), "{offered:?}");
    assert!(!offered.contains(&"fs__move_file"), "the filter leaves it out");
    assert!(!offered.iter().any(|t| t.starts_with("bobs__")), "another owner's server");
    let last = sent[1]["messages"].as_array().unwrap().last().unwrap();
    assert_eq!((last["role"].as_str(), last["content"].as_str()), (Some("tool"), Some(output)));
    // Every step's request rebuilds from the log (§11).
    let events = api.get(&format!("/v1/sessions/{id}/events?limit=1000"), ALICE).await.json;
    let steps: Vec<&Value> =
        events["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "assistant_turn").collect();
    assert_eq!(steps.len(), 2);
    for e in steps {
        let audit = api.get(&format!("/v1/sessions/{id}/requests/{}", e["seq"]), ALICE).await.json;
        assert_eq!(audit["verified"], true, "{audit}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_allow_always_and_the_policies() {
    let files = files_dir("chain");
    let (api, _mock) = with_servers(&files).await;
    let id = api.create(ALICE, None).await;
    let write = |name: &str| {
        format!(r#"{{"path":"{}","content":"{name}"}}"#, files.join(format!("{name}.txt")).display())
    };
    let answer = |decision: &'static str| {
        let api = &api;
        move |name: String, data: Value| async move {
            if name == "permission" {
                assert_eq!(api.decide(id, data["id"].as_str().unwrap(), decision).await.status, 200);
            }
        }
    };

    // Denied by the user, beside an allowed call: the model goes on with both results.
    let text = format!(
        "Two [mock tool=fs__write_file:{} tool=everything__echo:{{\"message\":\"hi\"}} words=2]",
        write("one")
    );
    let events = drive(&api, id, &text, answer("deny")).await;
    assert_eq!(end(&events)["status"], "completed");
    let results: Vec<&Value> = events.iter().filter(|(n, _)| n == "tool_result").map(|(_, d)| d).collect();
    let mut statuses: Vec<&str> = results.iter().map(|r| r["status"].as_str().unwrap()).collect();
    statuses.sort();
    assert_eq!(statuses, ["denied", "ok"]);
    assert!(!files.join("one.txt").exists());
    let runs = payloads(&api, id, "tool_execution").await;
    let denied = runs.iter().find(|r| r["status"] == "denied").unwrap();
    assert_eq!(denied["output"], "denied by the user");
    assert!(runs.iter().any(|r| r["output"] == "Echo: hi"), "{runs:?}");

    // allow_always: this call, and the tool's later calls in the session without a prompt.
    let events = drive(
        &api,
        id,
        &format!("Again [mock tool=fs__write_file:{} words=2]", write("two")),
        answer("allow_always"),
    )
    .await;
    assert_eq!(end(&events)["status"], "completed");
    assert!(files.join("two.txt").exists());
    let events = drive(
        &api,
        id,
        &format!("Once more [mock tool=fs__write_file:{} words=2]", write("three")),
        answer("deny"),
    )
    .await;
    assert!(!names(&events).contains(&"permission"), "{events:?}");
    assert_eq!(end(&events)["status"], "completed");
    assert_eq!(std::fs::read_to_string(files.join("three.txt")).unwrap(), "three");

    // The operator's deny: no prompt, no call.
    let events =
        drive(&api, id, "Sum [mock tool=everything__get-sum:{\"a\":1,\"b\":2} words=2]", answer("allow"))
            .await;
    assert!(!names(&events).contains(&"permission"));
    let last = payloads(&api, id, "tool_execution").await.pop().unwrap();
    assert_eq!(
        (last["status"].as_str(), last["name"].as_str()),
        (Some("denied"), Some("everything__get-sum"))
    );

    // A client tool may not take a server tool's name.
    let tools = json!([{"type": "function", "function": {"name": "fs__write_file"}}]);
    let refused = api
        .call(
            Method::POST,
            &format!("/v1/sessions/{id}/messages"),
            Some(ALICE),
            Body::Json(json!({"text": "x", "tools": tools})),
        )
        .await;
    assert_eq!(refused.status, 400, "{}", refused.text);
}

fn short_permission_wait(c: &mut turnlog_ingress::IngressConfig) {
    c.permission_wait = Duration::from_secs(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_answered_after_a_full_restart_continues_the_turn() {
    let files = files_dir("restart");
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let opts = || Options { ingress: Some(short_permission_wait), ..options(&mock, servers(&files)) };
    let api = Api::with(opts()).await;
    catalog_ready(&api.bus, &["fs"]).await;
    let id = api.create(ALICE, None).await;
    let target = files.join("later.txt");
    let text = format!(
        r#"Later [mock tool=fs__write_file:{{"path":"{}","content":"late"}} words=3]"#,
        target.display()
    );
    // Nobody answers: the turn pauses, waiting for the permission.
    let events = drive(&api, id, &text, |_, _| async {}).await;
    let end = end(&events).clone();
    assert_eq!(end["status"], "requires_action", "{events:?}");
    let required = &end["required"][0];
    assert_eq!(
        (required["kind"].as_str(), required["name"].as_str()),
        (Some("permission"), Some("fs__write_file"))
    );
    let perm = required["permission_id"].as_str().unwrap().to_owned();
    let session = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json;
    assert_eq!(session["requires_action"][0]["permission_id"], perm.as_str(), "{session}");

    // Every service stops and starts again; the answer continues the same turn.
    let env = api.stop().await;
    let configs = Api::configs(&env, opts());
    let api = Api::on(env, configs).await;
    catalog_ready(&api.bus, &["fs"]).await;
    let body = json!({"decision": "allow"});
    let continued = api
        .turn(Method::POST, &format!("/v1/sessions/{id}/permissions/{perm}"), ALICE, Some(body), &[])
        .await;
    assert_eq!(continued.status, 200, "{}", continued.json);
    let kinds: Vec<&str> = continued.events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"meta"));
    assert!(kinds.contains(&"tool_result"), "{kinds:?}");
    assert_eq!(continued.end()["status"], "completed");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "late");
    // The same answer again: recorded already, the turn is over: plain JSON.
    let again = api.decide(id, &perm, "allow").await;
    assert_eq!((again.status, again.json["decision"].as_str()), (200, Some("allow")));
    assert_eq!(api.decide(id, &perm, "deny").await.status, 409);
    let session = api.get(&format!("/v1/sessions/{id}"), ALICE).await.json;
    assert!(session["requires_action"].is_null(), "{session}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_during_a_long_call_cancels_it() {
    let files = files_dir("stop");
    let (api, _mock) = with_servers(&files).await;
    let id = api.create(ALICE, None).await;
    let text =
        "Wait [mock tool=everything__trigger-long-running-operation:{\"duration\":30,\"steps\":30} words=3]";
    let started = std::time::Instant::now();
    let events = drive(&api, id, text, |name, _| {
        let api = &api;
        async move {
            if name == "tool_call" {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let r =
                    api.call(Method::POST, &format!("/v1/sessions/{id}/stop"), Some(ALICE), Body::None).await;
                assert_eq!(r.status, 202, "{}", r.text);
            }
        }
    })
    .await;
    assert_eq!(end(&events)["status"], "stopped", "{events:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "the stop waited for the call");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let runs = payloads(&api, id, "tool_execution").await;
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["status"], "cancelled");
    // The worker heard the cancellation: nothing runs there any more.
    let metrics = turnlog_runtime::telemetry::registry().render();
    assert!(metrics.contains("turnlog_tool_calls_running 0"), "{metrics}");
}

/// Sends a call straight to the tools worker, as the ingress does, and waits for its record.
async fn call(api: &Api, session: SessionId, label: &str, tool: &str, arguments: &str) -> Value {
    let tools = ToolsBus::open(&api.bus).await.unwrap();
    let call_id = format!("call_{}", uuid::Uuid::now_v7().simple());
    let event_id = uuid::Uuid::now_v7();
    let request = ToolCallRequest {
        session_id: session,
        owner: Owner::parse("alice").unwrap(),
        call_id: call_id.clone(),
        label: label.into(),
        tool: tool.into(),
        arguments: arguments.into(),
        event_id,
        deadline: chrono::Utc::now() + chrono::Duration::seconds(60),
    };
    tools.dispatch(&request).await.unwrap();
    recorded(api, session, &call_id, Duration::from_secs(60)).await
}

async fn recorded(api: &Api, session: SessionId, call_id: &str, within: Duration) -> Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(r) =
            payloads(api, session, "tool_execution").await.into_iter().find(|r| r["call_id"] == call_id)
        {
            return r;
        }
        assert!(tokio::time::Instant::now() < deadline, "call {call_id} never recorded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_lists_calls_times_out_and_follows_list_changes() {
    let files = files_dir("worker");
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    // Streamable HTTP too: the everything server on a port of its own.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut http = tokio::process::Command::new(bin("mcp-server-everything"))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .kill_on_drop(true)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let with_http = format!(
        "{}\n[[servers]]\nlabel = \"web\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nheaders = {{ X-Test = \"HOME\" }}\n[servers.tools.echo]\npolicy = \"allow\"\n",
        servers(&files)
    );
    let api = Api::with(Options { tool_timeout: Duration::from_secs(3), ..options(&mock, with_http) }).await;
    let catalog = catalog_ready(&api.bus, &["fs", "everything", "changing", "web"]).await;
    let fs = catalog.iter().find(|s| s.label == "fs").unwrap();
    assert!(
        fs.tools.iter().any(|t| t.name == "write_file") && !fs.tools.iter().any(|t| t.name == "move_file")
    );
    let id = api.create(ALICE, None).await;

    let ok = call(&api, id, "web", "echo", r#"{"message":"over http"}"#).await;
    assert_eq!((ok["status"].as_str(), ok["output"].as_str()), (Some("ok"), Some("Echo: over http")));
    assert_eq!(ok["source"], "mcp:web");
    let failed = call(&api, id, "changing", "fail", "{}").await;
    assert_eq!(
        (failed["status"].as_str(), failed["output"].as_str()),
        (Some("error"), Some("the disk is on fire"))
    );
    let bad = call(&api, id, "everything", "echo", "[1]").await;
    assert_eq!(bad["status"], "error");
    let slow =
        call(&api, id, "everything", "trigger-long-running-operation", r#"{"duration":20,"steps":20}"#).await;
    assert_eq!(slow["status"], "timeout", "{slow}");

    // list_changed: a tool the server adds is offered.
    assert!(!catalog.iter().any(|s| s.tools.iter().any(|t| t.name == "grown")));
    assert_eq!(call(&api, id, "changing", "grow", "{}").await["status"], "ok");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let catalog = ToolsBus::open(&api.bus).await.unwrap().catalog().await.unwrap();
        if catalog.iter().any(|s| s.label == "changing" && s.tools.iter().any(|t| t.name == "grown")) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the new tool never reached the catalogue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(call(&api, id, "changing", "grown", r#"{"word":"tall"}"#).await["output"], "grown: tall");
    let _ = http.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_call_fails_it_and_comes_back() {
    let files = files_dir("kill");
    let pidfile = files.join("server.pid");
    // The everything server behind a shell that says its pid, to kill it mid-call.
    let servers = format!(
        "[[servers]]\nlabel = \"victim\"\ncommand = \"sh\"\nargs = [\"-c\", \"echo $$ > {} && exec {}\"]\n[servers.tools.trigger-long-running-operation]\npolicy = \"allow\"\n[servers.tools.echo]\npolicy = \"allow\"\n",
        pidfile.display(),
        bin("mcp-server-everything")
    );
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(options(&mock, servers)).await;
    catalog_ready(&api.bus, &["victim"]).await;
    let id = api.create(ALICE, None).await;
    let pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_owned();
    let killer = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(std::process::Command::new("kill").args(["-9", &pid]).status().unwrap().success());
    };
    let (cut, ()) = tokio::join!(
        call(&api, id, "victim", "trigger-long-running-operation", r#"{"duration":30,"steps":30}"#),
        killer
    );
    assert_eq!(cut["status"], "error", "{cut}");
    // Restarted with back-off; its calls work again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let fresh = std::fs::read_to_string(&pidfile).unwrap_or_default();
        if fresh.trim() != pid && !fresh.trim().is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the server was not restarted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    catalog_ready(&api.bus, &["victim"]).await;
    assert_eq!(call(&api, id, "victim", "echo", r#"{"message":"back"}"#).await["status"], "ok");
    let metrics = turnlog_runtime::telemetry::registry().render();
    assert!(metrics.contains("turnlog_tool_server_restarts_total{server=\"victim\"}"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_delivered_again_after_its_worker_was_killed_runs_once() {
    let files = files_dir("redeliver");
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    // The stack without a tools worker: two copies run beside it, one to be killed.
    let api = Api::with(Options { llm_url: Some(mock.base_url()), ..Options::default() }).await;
    let config =
        turnlog_tools::ToolsConfig::parse(turnlog_e2e::config::backbone(&api.env), &servers(&files)).unwrap();
    let first = tokio::spawn(turnlog_tools::run(config.clone(), CancellationToken::new()));
    catalog_ready(&api.bus, &["everything"]).await;
    let id = api.create(ALICE, None).await;
    // A call that takes long, sent while only the first copy runs.
    let tools = ToolsBus::open(&api.bus).await.unwrap();
    let request = ToolCallRequest {
        session_id: id,
        owner: Owner::parse("alice").unwrap(),
        call_id: "call_once".into(),
        label: "everything".into(),
        tool: "trigger-long-running-operation".into(),
        arguments: r#"{"duration":8,"steps":8}"#.into(),
        event_id: uuid::Uuid::now_v7(),
        deadline: chrono::Utc::now() + chrono::Duration::seconds(120),
    };
    tools.dispatch(&request).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Killed mid-call (its server process goes with it); the second copy gets the call
    // once JetStream's ack wait runs out, finds it claimed, and does not run it again.
    first.abort();
    let _ = first.await;
    let shutdown = CancellationToken::new();
    let second = tokio::spawn(turnlog_tools::run(config, shutdown.clone()));
    let record = recorded(&api, id, "call_once", Duration::from_secs(60)).await;
    assert_eq!(record["status"], "error", "{record}");
    assert_eq!(record["output"], turnlog_tools::INTERRUPTED);
    assert_eq!(payloads(&api, id, "tool_execution").await.len(), 1);
    shutdown.cancel();
    second.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_cut_off_while_its_call_waits_is_retried_from_the_log() {
    let files = files_dir("cut");
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let with_worker = || options(&mock, servers(&files));
    // First without a tools worker: the call waits on the bus when every service stops.
    let env = turnlog_testkit::test_env().await;
    let mut configs = Api::configs(&env, with_worker());
    let tools = configs.tools.take();
    let api = Api::on(env, configs).await;
    // The catalogue a worker published before (the one started below, once, for it).
    let publisher = tokio::spawn(turnlog_tools::run(tools.unwrap(), CancellationToken::new()));
    catalog_ready(&api.bus, &["everything"]).await;
    publisher.abort();
    let _ = publisher.await;
    let id = api.create(ALICE, None).await;
    let resp = api
        .message_request(id, ALICE, "Echo [mock tool=everything__echo:{\"message\":\"later\"} words=3]")
        .await;
    let mut events = resp.bytes_stream().eventsource();
    while let Some(e) = events.next().await {
        if e.unwrap().event == "tool_call" {
            break;
        }
    }
    drop(events);
    let env = api.stop().await;

    // Everything starts again, the worker too: it runs the call that waited, once.
    let configs = Api::configs(&env, with_worker());
    let api = Api::on(env, configs).await;
    let call_id = payloads(&api, id, "assistant_turn").await[0]["llm"]["message"]["tool_calls"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let result = recorded(&api, id, &call_id, Duration::from_secs(30)).await;
    assert_eq!((result["status"].as_str(), result["output"].as_str()), (Some("ok"), Some("Echo: later")));
    // A retry goes on from the log: the next step, not the question again.
    let retry =
        api.turn(Method::POST, &format!("/v1/sessions/{id}/retry"), ALICE, Some(json!({})), &[]).await;
    assert_eq!(retry.end()["status"], "completed", "{:?}", retry.events);
    assert_eq!(payloads(&api, id, "user_message").await.len(), 1);
    assert_eq!(payloads(&api, id, "tool_execution").await.len(), 1);
}
