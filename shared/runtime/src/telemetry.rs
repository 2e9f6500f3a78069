//! Prometheus metrics and health of the writer and the workers (`TURNLOG_METRICS_LISTEN`):
//! each service registers what it exports under its own key in one process-wide
//! [`registry`], and [`serve`] answers `/metrics` (text format 0.0.4), `/healthz` and
//! `/readyz` from it. The values are plain atomics the services update as they work; the
//! text is written at scrape time, so recording costs an atomic add and nothing else.
//!
//! Names follow Prometheus conventions: a `turnlog_` prefix, base units (`_seconds`),
//! `_total` on counters, and bounded label sets (partition, worker, reason).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};

type Render = Box<dyn Fn(&mut String) + Send + Sync>;
type Check = Box<dyn Fn() -> bool + Send + Sync>;

/// How long `/readyz` waits for Postgres to answer `SELECT 1`.
pub const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// What one process exports: renderers and readiness checks by key (a second service of
/// the same key in one process replaces the first, so the text never repeats a family).
#[derive(Default)]
pub struct Registry {
    renders: Mutex<BTreeMap<String, Render>>,
    checks: Mutex<BTreeMap<String, Check>>,
    databases: Mutex<BTreeMap<String, sqlx::PgPool>>,
}

/// The process's registry.
pub fn registry() -> &'static Registry {
    static REGISTRY: LazyLock<Registry> = LazyLock::new(Registry::default);
    &REGISTRY
}

impl Registry {
    pub fn export(&self, key: &str, render: impl Fn(&mut String) + Send + Sync + 'static) {
        self.renders.lock().unwrap_or_else(PoisonError::into_inner).insert(key.to_owned(), Box::new(render));
    }

    /// A readiness condition: `/readyz` answers 200 only while every one holds.
    pub fn ready_when(&self, key: &str, check: impl Fn() -> bool + Send + Sync + 'static) {
        self.checks.lock().unwrap_or_else(PoisonError::into_inner).insert(key.to_owned(), Box::new(check));
    }

    /// A readiness condition on Postgres: `/readyz` asks `pool` for `SELECT 1` each time
    /// (within [`PROBE_TIMEOUT`]) and is 503 naming `key` when it does not answer.
    pub fn ready_while_postgres_answers(&self, key: &str, pool: sqlx::PgPool) {
        self.databases.lock().unwrap_or_else(PoisonError::into_inner).insert(key.to_owned(), pool);
    }

    /// The Prometheus text exposition of everything registered.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for render in self.renders.lock().unwrap_or_else(PoisonError::into_inner).values() {
            render(&mut out);
        }
        out
    }

    /// The checks that do not hold now, by key; `starting` while the process's service has
    /// registered none yet (it has not connected to anything).
    pub async fn not_ready(&self) -> Vec<String> {
        let mut failing: Vec<String> = {
            let checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
            if checks.is_empty() {
                return vec!["starting".to_owned()];
            }
            checks.iter().filter(|(_, check)| !check()).map(|(key, _)| key.clone()).collect()
        };
        let databases: Vec<(String, sqlx::PgPool)> =
            self.databases.lock().unwrap_or_else(PoisonError::into_inner).clone().into_iter().collect();
        let probes = databases.into_iter().map(|(key, pool)| async move {
            let answered = tokio::time::timeout(PROBE_TIMEOUT, sqlx::query("SELECT 1").execute(&pool)).await;
            (!matches!(answered, Ok(Ok(_)))).then(|| format!("{key} postgres"))
        });
        failing.extend(futures::future::join_all(probes).await.into_iter().flatten());
        failing
    }
}

/// A histogram with fixed bucket bounds, updated with atomics.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    /// Sum in millionths of the unit (so microseconds for seconds).
    sum_micros: AtomicU64,
    count: AtomicU64,
}

/// Bucket bounds for latencies in seconds.
pub const SECONDS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros.fetch_add((value.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Writes a family's `# HELP` and `# TYPE` lines.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes one sample; `labels` as `key="value"` pairs (values must not need escaping:
/// every label here is a name, a number or a reason code).
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    let _ = write!(out, "{name}");
    if !labels.is_empty() {
        let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let _ = write!(out, "{{{}}}", pairs.join(","));
    }
    let _ = writeln!(out, " {value}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Writes a histogram's `_bucket`, `_sum` and `_count` samples (no HELP/TYPE lines).
pub fn histogram(out: &mut String, name: &str, labels: &[(&str, &str)], h: &Histogram) {
    let mut cumulative = 0;
    for (bound, bucket) in h.bounds.iter().zip(&h.buckets) {
        cumulative += bucket.load(Ordering::Relaxed);
        let le = bound.to_string();
        let mut with_le = labels.to_vec();
        with_le.push(("le", &le));
        sample(out, &format!("{name}_bucket"), &with_le, cumulative as f64);
    }
    let count = h.count.load(Ordering::Relaxed);
    let mut with_le = labels.to_vec();
    with_le.push(("le", "+Inf"));
    sample(out, &format!("{name}_bucket"), &with_le, count as f64);
    sample(out, &format!("{name}_sum"), labels, h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6);
    sample(out, &format!("{name}_count"), labels, count as f64);
}

/// Binds `TURNLOG_METRICS_LISTEN` (so a taken port fails the service at start).
pub async fn bind(listen: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("TURNLOG_METRICS_LISTEN {listen}: {e}"))
}

/// Serves `/metrics`, `/healthz` (the process answers) and `/readyz` (every readiness
/// check holds; otherwise 503 naming the ones that do not) until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(|| async {
                ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], registry().render())
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|| async {
                let not_ready = registry().not_ready().await;
                if not_ready.is_empty() {
                    (StatusCode::OK, "ready\n".to_owned()).into_response()
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", not_ready.join(", ")))
                        .into_response()
                }
            }),
        );
    if let Ok(listen) = listener.local_addr() {
        tracing::info!(%listen, "metrics, health and readiness served");
    }
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_renders_cumulative_buckets() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        family(&mut out, "x_seconds", "histogram", "x");
        histogram(&mut out, "x_seconds", &[("worker", "memory")], &h);
        assert!(out.contains("x_seconds_bucket{worker=\"memory\",le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{worker=\"memory\",le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{worker=\"memory\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_seconds_sum{worker=\"memory\"} 4.25\n"), "{out}");
        assert!(out.contains("x_seconds_count{worker=\"memory\"} 4\n"), "{out}");
    }
}
