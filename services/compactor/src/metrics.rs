//! The compactor's own Prometheus metrics (beside the worker loop's): compactions stored,
//! summaries refused by why, races lost to another compactor, summary tokens written.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};

use turnlog_runtime::telemetry::{family, registry, sample};

#[derive(Default)]
pub(crate) struct CompactorMetrics {
    compactions: AtomicU64,
    lost_races: AtomicU64,
    summary_tokens: AtomicU64,
    refusals: Mutex<BTreeMap<&'static str, u64>>,
}

/// This process's compactor metrics, exported once it runs.
pub(crate) fn metrics() -> &'static CompactorMetrics {
    static METRICS: LazyLock<CompactorMetrics> = LazyLock::new(|| {
        registry().export("compactor", |out| metrics().render(out));
        CompactorMetrics::default()
    });
    &METRICS
}

impl CompactorMetrics {
    pub(crate) fn compacted(&self, summary_tokens: u32) {
        self.compactions.fetch_add(1, Ordering::Relaxed);
        self.summary_tokens.fetch_add(u64::from(summary_tokens), Ordering::Relaxed);
    }

    pub(crate) fn lost_race(&self) {
        self.lost_races.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self, why: &'static str) {
        *self.refusals.lock().unwrap_or_else(PoisonError::into_inner).entry(why).or_default() += 1;
    }

    fn render(&self, out: &mut String) {
        for (name, help, value) in [
            ("turnlog_compactor_compactions_total", "Compactions stored", &self.compactions),
            (
                "turnlog_compactor_lost_races_total",
                "Compactions another compactor stored first",
                &self.lost_races,
            ),
            (
                "turnlog_compactor_summary_tokens_total",
                "Tokens of the summaries stored",
                &self.summary_tokens,
            ),
        ] {
            family(out, name, "counter", help);
            sample(out, name, &[], value.load(Ordering::Relaxed) as f64);
        }
        let name = "turnlog_compactor_refusals_total";
        family(
            out,
            name,
            "counter",
            "Summaries not stored because the model refused or failed the task, by why",
        );
        for (why, n) in self.refusals.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            sample(out, name, &[("why", why)], *n as f64);
        }
    }
}
