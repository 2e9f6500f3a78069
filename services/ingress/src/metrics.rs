//! Prometheus metrics of the HTTP surface: requests by route, method and status, and a
//! latency histogram. Each ingress owns its recorder (no process-global one), so several
//! servers in one process — tests, `turnlog dev` — keep separate counts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use tokio_util::sync::CancellationToken;

const REQUESTS: &str = "turnlog_http_requests_total";
const LATENCY: &str = "turnlog_http_request_duration_seconds";
const TURNS: &str = "turnlog_turns_total";
const FIRST_DELTA: &str = "turnlog_turn_first_delta_seconds";
const PRE_UPSTREAM: &str = "turnlog_turn_pre_upstream_seconds";
const RELAY: &str = "turnlog_turn_relay_seconds";
const UPSTREAM_ERRORS: &str = "turnlog_upstream_errors_total";
const CHECKPOINTS: &str = "turnlog_checkpoints_total";
const INPUT_TOKENS: &str = "turnlog_model_input_tokens_total";
const CACHED_TOKENS: &str = "turnlog_model_cached_input_tokens_total";
const OUTPUT_TOKENS: &str = "turnlog_model_output_tokens_total";
const TURNS_ACTIVE: &str = "turnlog_turns_active";
const STREAMS_ACTIVE: &str = "turnlog_turn_streams_active";
/// Upper bounds of the latency buckets, in seconds.
const LATENCY_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Upper bounds of the relay buckets (a delta's way to its clients takes microseconds).
const RELAY_BUCKETS: [f64; 10] = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1];
/// Label of requests that matched no route, so scanners cannot mint a series per path.
const UNMATCHED: &str = "unmatched";

pub struct HttpMetrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl HttpMetrics {
    pub fn new() -> anyhow::Result<Self> {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(LATENCY.into()), &LATENCY_BUCKETS)?
            .set_buckets_for_metric(Matcher::Full(FIRST_DELTA.into()), &LATENCY_BUCKETS)?
            .set_buckets_for_metric(Matcher::Full(PRE_UPSTREAM.into()), &LATENCY_BUCKETS)?
            .set_buckets_for_metric(Matcher::Full(RELAY.into()), &RELAY_BUCKETS)?
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::describe_counter!(REQUESTS, "HTTP requests answered, by route, method and status");
            metrics::describe_histogram!(
                LATENCY,
                metrics::Unit::Seconds,
                "Time to the response head, by route and method"
            );
            metrics::describe_counter!(TURNS, "Turns ended, by status");
            metrics::describe_histogram!(
                FIRST_DELTA,
                metrics::Unit::Seconds,
                "Time from a turn's start to its first delta"
            );
            metrics::describe_histogram!(
                PRE_UPSTREAM,
                metrics::Unit::Seconds,
                "Time from a turn's request to its model call: the user message's append, the lease, the compaction check, the context"
            );
            metrics::describe_histogram!(
                RELAY,
                metrics::Unit::Seconds,
                "Time from a delta read off the model's stream to its hand-over to the turn's clients"
            );
            metrics::describe_counter!(
                UPSTREAM_ERRORS,
                "Model calls of turns that failed, by kind (an HTTP status, timeout, connect, incomplete, malformed, provider)"
            );
            metrics::describe_counter!(INPUT_TOKENS, "Prompt tokens the model reported, by model");
            metrics::describe_counter!(
                CACHED_TOKENS,
                "Prompt tokens the model reported served from its prompt cache, by model"
            );
            metrics::describe_counter!(OUTPUT_TOKENS, "Completion tokens the model reported, by model");
            metrics::describe_counter!(CHECKPOINTS, "Checkpoints of streaming answers published");
            metrics::describe_gauge!(TURNS_ACTIVE, "Turns this copy is running");
            metrics::describe_gauge!(STREAMS_ACTIVE, "Open turn event streams");
        });
        Ok(Self { recorder, handle })
    }

    pub fn turn_finished(&self, status: &str) {
        let status = status.to_owned();
        metrics::with_local_recorder(&self.recorder, || {
            metrics::counter!(TURNS, "status" => status).increment(1)
        });
    }

    pub fn first_delta(&self, after: Duration) {
        metrics::with_local_recorder(&self.recorder, || {
            metrics::histogram!(FIRST_DELTA).record(after.as_secs_f64())
        });
    }

    pub fn pre_upstream(&self, took: Duration) {
        metrics::with_local_recorder(&self.recorder, || {
            metrics::histogram!(PRE_UPSTREAM).record(took.as_secs_f64())
        });
    }

    pub fn relayed(&self, took: Duration) {
        metrics::with_local_recorder(&self.recorder, || {
            metrics::histogram!(RELAY).record(took.as_secs_f64())
        });
    }

    /// A failed model call; `kind` is one of a few words or an HTTP status code.
    pub fn upstream_error(&self, kind: String) {
        metrics::with_local_recorder(&self.recorder, || {
            metrics::counter!(UPSTREAM_ERRORS, "kind" => kind).increment(1)
        });
    }

    /// A turn's usage as the model reported it; `model` is a configured name (or `other`),
    /// so the label set stays bounded.
    pub fn usage(&self, model: String, input: u64, cached: u64, output: u64) {
        metrics::with_local_recorder(&self.recorder, || {
            metrics::counter!(INPUT_TOKENS, "model" => model.clone()).increment(input);
            metrics::counter!(CACHED_TOKENS, "model" => model.clone()).increment(cached);
            metrics::counter!(OUTPUT_TOKENS, "model" => model).increment(output);
        });
    }

    pub fn checkpoint(&self) {
        metrics::with_local_recorder(&self.recorder, || metrics::counter!(CHECKPOINTS).increment(1));
    }

    pub fn turns_active(&self, n: usize) {
        metrics::with_local_recorder(&self.recorder, || metrics::gauge!(TURNS_ACTIVE).set(n as f64));
    }

    /// Counts an open turn event stream until the guard drops.
    pub fn stream_opened(self: &Arc<Self>) -> StreamGuard {
        metrics::with_local_recorder(&self.recorder, || metrics::gauge!(STREAMS_ACTIVE).increment(1.0));
        StreamGuard(Arc::clone(self))
    }

    /// The Prometheus text exposition: the HTTP surface's, then whatever else runs in this
    /// process (`turnlog dev`'s writer and workers).
    pub fn render(&self) -> String {
        self.handle.render() + &turnlog_runtime::telemetry::registry().render()
    }

    fn record(&self, route: &str, method: &str, status: u16, elapsed: Duration) {
        metrics::with_local_recorder(&self.recorder, || {
            let (route, method) = (route.to_owned(), method.to_owned());
            let labels =
                [("route", route.clone()), ("method", method.clone()), ("status", status.to_string())];
            metrics::counter!(REQUESTS, &labels).increment(1);
            metrics::histogram!(LATENCY, "route" => route, "method" => method).record(elapsed.as_secs_f64());
        });
    }

    /// Folds recorded latencies into their buckets now and then, so memory stays bounded
    /// between scrapes.
    pub fn spawn_upkeep(self: &Arc<Self>, shutdown: CancellationToken) {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => this.handle.run_upkeep(),
                }
            }
        });
    }
}

/// Methods outside the standard set share one label, for the same reason as [`UNMATCHED`].
fn method_label(method: &axum::http::Method) -> &str {
    use axum::http::Method;
    const KNOWN: [Method; 8] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
        Method::TRACE,
    ];
    if KNOWN.contains(method) {
        method.as_str()
    } else {
        "other"
    }
}

/// Middleware: counts and times every request under its route template.
pub async fn track(State(metrics): State<Arc<HttpMetrics>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or(UNMATCHED, MatchedPath::as_str).to_owned();
    let method = method_label(req.method()).to_owned();
    let started = Instant::now();
    let response = next.run(req).await;
    metrics.record(&route, &method, response.status().as_u16(), started.elapsed());
    response
}

/// An open turn event stream, counted in the gauge while it lives.
pub struct StreamGuard(Arc<HttpMetrics>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        metrics::with_local_recorder(&self.0.recorder, || metrics::gauge!(STREAMS_ACTIVE).decrement(1.0));
    }
}
