//! Metrics, health, readiness and traces of every service as separate processes (issue
//! 27): the writer and the three workers on TURNLOG_METRICS_LISTEN, the ingress on its API
//! port. After one chat turn each `/metrics` passes a strict text-format check and
//! carries its service's metrics with the turn counted; `/healthz` and `/readyz` answer; the
//! turn is one trace across the bus, in the JSON logs and in the spans exported over OTLP.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Attr;
use prost::Message as _;
use serde_json::json;
use turnlog_testkit::prometheus::{check_exposition, Exposition};
use turnlog_testkit::{
    eventually, free_port, private_nats, private_postgres, test_env, test_env_on, TurnlogProcess,
};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");

/// A service's `/metrics`, checked strictly (every line well formed, one TYPE a family,
/// no family split, no series twice, histograms cumulative with `+Inf` = `_count`).
async fn scrape(http: &reqwest::Client, base: &str) -> Exposition {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    check_exposition(&text).unwrap_or_else(|e| panic!("{base}/metrics: {e}\n{text}"))
}

/// A sample's value (a histogram's count) for `name` whose labels include `labels`.
fn value(s: &Exposition, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    s.value(name, labels)
}

/// A span as an OTLP collector receives it.
#[derive(Debug, Clone)]
struct ReceivedSpan {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

/// An OTLP/HTTP (protobuf) trace receiver on a free port, keeping what it is sent.
async fn otlp_receiver() -> (String, Arc<Mutex<Vec<ReceivedSpan>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&spans);
    let receive = move |body: axum::body::Bytes| async move {
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        for rs in request.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    Attr::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                kept.lock().unwrap().push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                });
            }
        }
        ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
    };
    let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new session's first turn, its create and its message sent with the client's
/// `traceparent` (once the ingress answers); the session's id and the turn's stream.
async fn traced_turn(
    http: &reqwest::Client,
    ingress: &str,
    traceparent: &str,
    text: &str,
) -> (String, reqwest::Response) {
    let session: serde_json::Value = eventually(Duration::from_secs(30), || async {
        let r = http
            .post(format!("{ingress}/v1/sessions"))
            .header("traceparent", traceparent)
            .json(&json!({}))
            .send()
            .await
            .ok()?;
        r.status().is_success().then_some(())?;
        r.json().await.ok()
    })
    .await;
    let id = session["id"].as_str().unwrap().to_owned();
    let turn = http
        .post(format!("{ingress}/v1/sessions/{id}/messages"))
        .header("traceparent", traceparent)
        .json(&json!({ "text": text }))
        .send()
        .await
        .unwrap();
    (id, turn)
}

/// The JSON log lines of a process that name `session` (in a field or a span's).
fn lines_of_session(p: &TurnlogProcess, session: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p.log_path())
        .unwrap()
        .lines()
        .filter(|l| l.contains(session))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_serves_metrics_health_readiness_and_one_trace_per_turn() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let llm = mock.base_url();
    let (otlp, spans) = otlp_receiver().await;
    let http = reqwest::Client::new();
    let mut processes = Vec::new();
    let mut bases = Vec::new();
    let common = [
        ("TURNLOG_LLM_URL", llm.as_str()),
        ("TURNLOG_MODEL", "mock"),
        ("TURNLOG_LOG_FORMAT", "json"),
        ("RUST_LOG", "info,turnlog_writer=debug,turnlog_runtime::worker=debug,turnlog_ingress=debug"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    for role in ["writer", "distiller", "memory", "compactor"] {
        let listen = format!("127.0.0.1:{}", free_port());
        let mut vars = vec![("TURNLOG_METRICS_LISTEN", listen.as_str()), ("TURNLOG_FACTS_WAIT", "1s")];
        vars.extend(common);
        processes.push(TurnlogProcess::start(BIN, &env, &[role], &vars));
        bases.push((role, format!("http://{listen}")));
    }
    let listen = format!("127.0.0.1:{}", free_port());
    let mut vars = vec![("TURNLOG_LISTEN", listen.as_str())];
    vars.extend(common);
    processes.push(TurnlogProcess::start(BIN, &env, &["ingress"], &vars));
    let ingress = format!("http://{listen}");
    bases.push(("ingress", ingress.clone()));
    for (role, base) in &bases {
        let ready = eventually(Duration::from_secs(30), || async {
            let r = http.get(format!("{base}/readyz")).send().await.ok()?;
            r.status().is_success().then_some(())
        })
        .await;
        assert_eq!(ready, (), "{role}");
        let health = http.get(format!("{base}/healthz")).send().await.unwrap();
        assert!(health.status().is_success(), "{role} /healthz");
    }

    // One chat turn, in a trace the client started.
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let client_span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let text = "Petra moved the review to Friday, room 4. [mock words=6]";
    let (session, turn) = traced_turn(&http, &ingress, &traceparent, text).await;
    assert!(turn.status().is_success());
    let body: Vec<_> = turn.bytes_stream().collect().await;
    assert!(!body.is_empty());

    // Each worker handled the turn (the compactor's post-turn check too).
    for worker in ["distiller", "memory", "compactor"] {
        let base = &bases.iter().find(|(r, _)| *r == worker).unwrap().1;
        eventually(Duration::from_secs(30), || async {
            let s = scrape(&http, base).await;
            (value(&s, "turnlog_worker_processed_total", &[("worker", worker)])? >= 1.0).then_some(())
        })
        .await;
        let s = scrape(&http, base).await;
        for name in ["turnlog_worker_handler_seconds", "turnlog_worker_pending_messages"] {
            assert!(value(&s, name, &[("worker", worker)]).is_some(), "{worker}: {name}");
        }
        for name in [
            "turnlog_worker_failed_total",
            "turnlog_worker_redelivered_total",
            "turnlog_worker_dead_lettered_total",
        ] {
            assert_eq!(value(&s, name, &[("worker", worker)]), Some(0.0), "{worker}: {name}");
        }
        if worker == "compactor" {
            // One short turn is far from any budget: nothing compacted, nothing refused.
            assert_eq!(value(&s, "turnlog_compactor_compactions_total", &[]), Some(0.0));
            assert!(s.types.contains_key("turnlog_compactor_refusals_total"));
        }
    }

    let writer = &bases[0].1;
    let s = scrape(&http, writer).await;
    assert!(value(&s, "turnlog_writer_batch_requests", &[]).unwrap() >= 3.0, "create, message, answer");
    assert!(value(&s, "turnlog_writer_commit_seconds", &[]).unwrap() >= 1.0);
    assert_eq!(value(&s, "turnlog_writer_partitions_held", &[]), Some(1.0));
    let applied = value(&s, "turnlog_writer_applied_position", &[("partition", "0")]).unwrap();
    assert!(applied >= 3.0, "{applied}");
    let published = eventually(Duration::from_secs(10), || async {
        let s = scrape(&http, writer).await;
        let p = value(&s, "turnlog_writer_published_position", &[("partition", "0")])?;
        (p >= applied).then_some(p)
    })
    .await;
    assert!(published >= applied);
    for name in ["turnlog_writer_search_indexed_position", "turnlog_writer_unread_messages"] {
        assert!(value(&s, name, &[("partition", "0")]).is_some(), "writer: {name}");
    }
    assert!(s.types.contains_key("turnlog_writer_dead_letters_total"));

    let s = scrape(&http, &ingress).await;
    assert_eq!(value(&s, "turnlog_turns_total", &[("status", "completed")]), Some(1.0));
    assert_eq!(value(&s, "turnlog_turn_first_delta_seconds", &[]), Some(1.0));
    assert_eq!(value(&s, "turnlog_turn_pre_upstream_seconds", &[]), Some(1.0));
    assert!(value(&s, "turnlog_turn_relay_seconds", &[]).unwrap() >= 1.0, "a delta or more relayed");
    // The mock reports usage: prompt tokens, some of them cached on a later call.
    let input = value(&s, "turnlog_model_input_tokens_total", &[("model", "mock")]).unwrap();
    assert!(input > 0.0, "{input}");
    assert!(value(&s, "turnlog_model_cached_input_tokens_total", &[("model", "mock")]).is_some());
    assert!(value(&s, "turnlog_model_output_tokens_total", &[("model", "mock")]).unwrap() > 0.0);

    // Every log line about the session, in every process, carries the trace id of the
    // client's requests: the ingress's, the writer's applies of the create, the message and
    // the answer, each worker's handling.
    let roles = ["writer", "distiller", "memory", "compactor", "ingress"];
    for (role, p) in roles.iter().zip(&processes) {
        let lines = eventually(Duration::from_secs(10), || async {
            let lines = lines_of_session(p, &session);
            let expected = match *role {
                "writer" => lines.iter().filter(|l| l["message"] == "request applied").count() >= 2,
                "ingress" => !lines.is_empty(),
                _ => lines.iter().any(|l| l["message"] == "event handled"),
            };
            expected.then_some(lines)
        })
        .await;
        let untraced: Vec<_> = lines.iter().filter(|l| l["trace_id"] != trace_id.as_str()).collect();
        assert!(untraced.is_empty(), "{role}: lines about the session outside its trace: {untraced:#?}");
    }

    // The exported spans: one trace whose parent links cross the bus, from the client's
    // span through the ingress and the writer to each worker.
    let services =
        ["turnlog-ingress", "turnlog-writer", "turnlog-distiller", "turnlog-memory", "turnlog-compactor"];
    let trace = eventually(Duration::from_secs(20), || async {
        let got: Vec<ReceivedSpan> =
            spans.lock().unwrap().iter().filter(|s| s.trace_id == trace_id).cloned().collect();
        let handled = |service: &str| got.iter().any(|s| s.service == service && s.name == "worker.handle");
        let workers = ["turnlog-distiller", "turnlog-memory", "turnlog-compactor"].iter().all(|s| handled(s));
        // Every span's parent is exported too (a child ends, and is sent, first), but the
        // ingress's first span's: the client's.
        let ids: HashSet<&str> = got.iter().map(|s| s.span_id.as_str()).collect();
        let whole = got.iter().all(|s| s.parent == client_span || ids.contains(s.parent.as_str()));
        (workers && whole).then_some(got)
    })
    .await;
    let by_id: HashMap<&str, &ReceivedSpan> = trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let parent_service = |s: &ReceivedSpan| by_id.get(s.parent.as_str()).map(|p| p.service.as_str());
    for s in &trace {
        assert!(services.contains(&s.service.as_str()), "{s:?}");
    }
    let roots: Vec<_> = trace.iter().filter(|s| s.parent == client_span).collect();
    assert!(roots.iter().all(|s| s.service == "turnlog-ingress" && s.name == "http"), "{roots:?}");
    // The writer applied the message and the answer as children of the ingress's spans…
    let applies_from_ingress = trace
        .iter()
        .filter(|s| s.name == "writer.apply" && parent_service(s) == Some("turnlog-ingress"))
        .count();
    assert!(applies_from_ingress >= 2, "{trace:#?}");
    // …and each worker handled the committed answer as a child of the writer's apply.
    let workers: HashSet<&str> = trace
        .iter()
        .filter(|s| s.name == "worker.handle" && parent_service(s) == Some("turnlog-writer"))
        .map(|s| s.service.as_str())
        .collect();
    assert_eq!(workers.len(), 3, "{trace:#?}");

    for p in &mut processes {
        p.terminate();
    }
}

/// `/readyz` follows the connections: a writer and two workers answer 503 while their
/// NATS server is down, and again while their Postgres is down (`/healthz` still 200: the
/// process lives), and 200 once it is back. The workers' body names what is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_nats_and_postgres_connections() {
    let mut nats = private_nats(free_port()).await;
    let mut pg = private_postgres(free_port()).await;
    let env = test_env_on(Some(&pg.url()), Some(&nats.url())).await;
    let http = reqwest::Client::new();
    let mut processes = Vec::new();
    let mut bases = Vec::new();
    for role in ["writer", "distiller", "compactor"] {
        let listen = format!("127.0.0.1:{}", free_port());
        let vars = [
            ("TURNLOG_METRICS_LISTEN", listen.as_str()),
            ("TURNLOG_LLM_URL", "http://127.0.0.1:9/v1"),
            ("TURNLOG_MODEL", "mock"),
        ];
        processes.push(TurnlogProcess::start(BIN, &env, &[role], &vars));
        bases.push(format!("http://{listen}"));
    }
    let get = |path: &'static str| {
        let (http, bases) = (http.clone(), bases.clone());
        async move {
            let mut replies = Vec::new();
            for base in &bases {
                let reply =
                    match http.get(format!("{base}{path}")).timeout(Duration::from_secs(5)).send().await {
                        Ok(r) => Some((r.status().as_u16(), r.text().await.unwrap_or_default())),
                        Err(_) => None,
                    };
                replies.push(reply);
            }
            replies
        }
    };
    let all = |want: u16, replies: Vec<Option<(u16, String)>>| {
        replies.iter().all(|r| r.as_ref().is_some_and(|(code, _)| *code == want)).then_some(replies)
    };
    let healthy = || async { assert!(all(200, get("/healthz").await).is_some(), "a process died") };
    eventually(Duration::from_secs(30), || async { all(200, get("/readyz").await) }).await;

    nats.kill();
    eventually(Duration::from_secs(15), || async { all(503, get("/readyz").await) }).await;
    healthy().await;
    nats.restart().await;
    eventually(Duration::from_secs(30), || async { all(200, get("/readyz").await) }).await;

    pg.kill();
    let down = eventually(Duration::from_secs(15), || async { all(503, get("/readyz").await) }).await;
    for (reply, worker) in down[1..].iter().zip(["distiller", "compactor"]) {
        let body = &reply.as_ref().unwrap().1;
        assert!(body.contains(&format!("{worker} postgres")), "{worker}: {body}");
    }
    healthy().await;
    pg.start().await;
    eventually(Duration::from_secs(30), || async { all(200, get("/readyz").await) }).await;
    for p in &mut processes {
        p.terminate();
    }
}

/// The compactor's pre-send check (a NATS request, asked when a request is over budget)
/// joins the trace of the turn that asks: a window of 50 tokens puts the first turn over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pre_send_check_joins_the_turns_trace() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let llm = mock.base_url();
    let (otlp, spans) = otlp_receiver().await;
    let listen = format!("127.0.0.1:{}", free_port());
    let vars = [
        ("TURNLOG_LLM_URL", llm.as_str()),
        ("TURNLOG_MODEL", "mock"),
        ("TURNLOG_MODEL_WINDOWS", "mock=50"),
        ("TURNLOG_LISTEN", listen.as_str()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut processes: Vec<TurnlogProcess> = ["writer", "compactor", "ingress"]
        .iter()
        .map(|role| TurnlogProcess::start(BIN, &env, &[role], &vars))
        .collect();
    let http = reqwest::Client::new();
    let ingress = format!("http://{listen}");
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let text = "Petra moved the review to Friday, room 4, and asked for the notes.";
    let (_, turn) = traced_turn(&http, &ingress, &traceparent, text).await;
    let _: Vec<_> = turn.bytes_stream().collect().await;
    let check = eventually(Duration::from_secs(20), || async {
        let got = spans.lock().unwrap().clone();
        let check = got.iter().find(|s| s.trace_id == trace_id && s.name == "compactor.pre_send")?.clone();
        let parent = got.iter().find(|s| s.span_id == check.parent)?.clone();
        Some((check, parent))
    })
    .await;
    assert_eq!(check.0.service, "turnlog-compactor");
    assert_eq!((check.1.service.as_str(), check.1.trace_id.as_str()), ("turnlog-ingress", trace_id.as_str()));
    for p in &mut processes {
        p.terminate();
    }
}

/// A server tool's call (DESIGN §14) runs in `turnlog tools`, a process of its own, in a
/// span of the turn's trace: the tools worker's `tool_call` span's parent is the ingress's.
/// Its metrics count the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_tool_call_joins_the_turns_trace() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let llm = mock.base_url();
    let (otlp, spans) = otlp_receiver().await;
    let servers = std::env::temp_dir().join(format!("turnlog-mcp-{}.toml", uuid::Uuid::new_v4().simple()));
    let everything = turnlog_e2e::mcp::bin("mcp-server-everything");
    std::fs::write(
        &servers,
        format!("[[servers]]\nlabel = \"everything\"\ncommand = \"{everything}\"\n[servers.tools.echo]\npolicy = \"allow\"\n"),
    )
    .unwrap();
    let servers_path = servers.display().to_string();
    let listen = format!("127.0.0.1:{}", free_port());
    let metrics_listen = format!("127.0.0.1:{}", free_port());
    let vars = [
        ("TURNLOG_LLM_URL", llm.as_str()),
        ("TURNLOG_MODEL", "mock"),
        ("TURNLOG_LISTEN", listen.as_str()),
        ("TURNLOG_MCP_SERVERS", servers_path.as_str()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut processes: Vec<TurnlogProcess> =
        ["writer", "ingress"].iter().map(|role| TurnlogProcess::start(BIN, &env, &[role], &vars)).collect();
    let mut tools_vars = vars.to_vec();
    tools_vars.push(("TURNLOG_METRICS_LISTEN", metrics_listen.as_str()));
    processes.push(TurnlogProcess::start(BIN, &env, &["tools"], &tools_vars));
    let bus = turnlog_runtime::bus::Bus::connect(&env.nats_url, &env.bus_prefix, 1).await.unwrap();
    turnlog_e2e::mcp::catalog_ready(&bus, &["everything"]).await;
    let http = reqwest::Client::new();
    let ingress = format!("http://{listen}");
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let text = "Echo it [mock tool=everything__echo:{\"message\":\"traced\"} words=2]";
    let (_, turn) = traced_turn(&http, &ingress, &traceparent, text).await;
    let body = String::from_utf8(turn.bytes().await.unwrap().to_vec()).unwrap();
    assert!(body.contains("\"status\":\"completed\""), "{body}");
    let call = eventually(Duration::from_secs(20), || async {
        let got = spans.lock().unwrap().clone();
        let call = got.iter().find(|s| s.trace_id == trace_id && s.name == "tool_call")?.clone();
        let parent = got.iter().find(|s| s.span_id == call.parent)?.clone();
        Some((call, parent))
    })
    .await;
    assert_eq!(call.0.service, "turnlog-tools");
    assert_eq!((call.1.service.as_str(), call.1.trace_id.as_str()), ("turnlog-ingress", trace_id.as_str()));
    let exposition = scrape(&http, &format!("http://{metrics_listen}")).await;
    let labels = [("server", "everything"), ("tool", "echo"), ("status", "ok")];
    assert_eq!(value(&exposition, "turnlog_tool_calls_total", &labels), Some(1.0));
    for p in &mut processes {
        p.terminate();
    }
    let _ = std::fs::remove_file(servers);
}
