//! The tools worker's metrics: calls by server, tool and status, their latency per server,
//! the calls running now, and server restarts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use turnlog_runtime::telemetry::{self, family, histogram, sample, Histogram};

#[derive(Default)]
pub(crate) struct Metrics {
    calls: Mutex<BTreeMap<(String, String, String), u64>>,
    latency: Mutex<BTreeMap<String, Arc<Histogram>>>,
    restarts: Mutex<BTreeMap<String, u64>>,
    running: AtomicI64,
}

impl Metrics {
    /// Registers the renderer (one per process, replacing an earlier copy's).
    pub(crate) fn register() -> Arc<Self> {
        let m = Arc::new(Self::default());
        let r = Arc::clone(&m);
        telemetry::registry().export("tools", move |out| r.render(out));
        m
    }

    pub(crate) fn started(&self) {
        self.running.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn finished(&self, server: &str, tool: &str, status: &str, seconds: f64) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.recorded(server, tool, status);
        let h = Arc::clone(
            self.latency
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(server.to_owned())
                .or_insert_with(|| Arc::new(Histogram::new(telemetry::SECONDS))),
        );
        h.observe(seconds);
    }

    /// A call that ended without running (its server down, its deadline passed, a crash).
    pub(crate) fn recorded(&self, server: &str, tool: &str, status: &str) {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        *calls.entry((server.to_owned(), tool.to_owned(), status.to_owned())).or_default() += 1;
    }

    pub(crate) fn restarted(&self, server: &str) {
        *self
            .restarts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(server.to_owned())
            .or_default() += 1;
    }

    fn render(&self, out: &mut String) {
        family(out, "turnlog_tool_calls_total", "counter", "Server tool calls by server, tool and status.");
        for ((server, tool, status), n) in self.calls.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let labels = [("server", server.as_str()), ("tool", tool.as_str()), ("status", status.as_str())];
            sample(out, "turnlog_tool_calls_total", &labels, *n as f64);
        }
        family(out, "turnlog_tool_call_seconds", "histogram", "How long server tool calls took.");
        for (server, h) in self.latency.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            histogram(out, "turnlog_tool_call_seconds", &[("server", server)], h);
        }
        family(out, "turnlog_tool_calls_running", "gauge", "Server tool calls running now.");
        sample(out, "turnlog_tool_calls_running", &[], self.running.load(Ordering::Relaxed) as f64);
        family(out, "turnlog_tool_server_restarts_total", "counter", "MCP server connections restarted.");
        for (server, n) in self.restarts.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            sample(out, "turnlog_tool_server_restarts_total", &[("server", server)], *n as f64);
        }
    }
}
