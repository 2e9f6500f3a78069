//! Metrics, health and readiness of every service as separate processes (issue 27): the
//! writer and the three workers on TURNLOG_METRICS_LISTEN, the ingress on its API port.
//! After one chat turn each `/metrics` parses with a Prometheus text-format parser and
//! carries its service's metrics with the turn counted; `/healthz` and `/readyz` answer.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use futures::StreamExt as _;
use prometheus_parse::{Scrape, Value};
use serde_json::json;
use turnlog_testkit::{eventually, free_port, test_env, TurnlogProcess};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");

async fn scrape(http: &reqwest::Client, base: &str) -> Scrape {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap_or_else(|e| panic!("{base}: {e}\n{text}"))
}

/// A sample's value (a histogram's count) for `name` whose labels include `labels`.
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    s.samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match &x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(buckets) => buckets.iter().map(|b| b.count).fold(0.0, f64::max),
            Value::Summary(_) => f64::NAN,
        })
        .reduce(f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_serves_metrics_health_and_readiness() {
    let env = test_env().await;
    let mock = turnlog_mock_llm::spawn(turnlog_mock_llm::MockConfig::default()).await.unwrap();
    let llm = mock.base_url();
    let http = reqwest::Client::new();
    let mut processes = Vec::new();
    let mut bases = Vec::new();
    for role in ["writer", "distiller", "memory", "compactor"] {
        let listen = format!("127.0.0.1:{}", free_port());
        let vars = [
            ("TURNLOG_METRICS_LISTEN", listen.as_str()),
            ("TURNLOG_LLM_URL", llm.as_str()),
            ("TURNLOG_MODEL", "mock"),
            ("TURNLOG_FACTS_WAIT", "1s"),
        ];
        processes.push(TurnlogProcess::start(BIN, &env, &[role], &vars));
        bases.push((role, format!("http://{listen}")));
    }
    let listen = format!("127.0.0.1:{}", free_port());
    let vars =
        [("TURNLOG_LISTEN", listen.as_str()), ("TURNLOG_LLM_URL", llm.as_str()), ("TURNLOG_MODEL", "mock")];
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

    // One chat turn.
    let session: serde_json::Value = http
        .post(format!("{ingress}/v1/sessions"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = session["id"].as_str().unwrap();
    let turn = http
        .post(format!("{ingress}/v1/sessions/{id}/messages"))
        .json(&json!({"text": "Petra moved the review to Friday, room 4. [mock words=6]"}))
        .send()
        .await
        .unwrap();
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
            assert!(s.docs.contains_key("turnlog_compactor_refusals_total"));
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
    assert!(s.docs.contains_key("turnlog_writer_dead_letters_total"));

    let s = scrape(&http, &ingress).await;
    assert_eq!(value(&s, "turnlog_turns_total", &[("status", "completed")]), Some(1.0));
    assert_eq!(value(&s, "turnlog_turn_first_delta_seconds", &[]), Some(1.0));
    // The mock reports usage: prompt tokens, some of them cached on a later call.
    let input = value(&s, "turnlog_model_input_tokens_total", &[("model", "mock")]).unwrap();
    assert!(input > 0.0, "{input}");
    assert!(value(&s, "turnlog_model_cached_input_tokens_total", &[("model", "mock")]).is_some());
    assert!(value(&s, "turnlog_model_output_tokens_total", &[("model", "mock")]).unwrap() > 0.0);

    for p in &mut processes {
        p.terminate();
    }
}
