//! The writer's Prometheus metrics (DESIGN §6; served by `TURNLOG_METRICS_LISTEN`): batch
//! size and commit latency, each partition's applied, published and search-indexed APPEND
//! position and what waits unread, dead letters by reason, partitions held.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex, PoisonError};

use turnlog_runtime::telemetry::{family, histogram, sample, Histogram, SECONDS};

/// Requests per commit.
const BATCH: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0];

#[derive(Debug, Default, Clone, Copy)]
struct Positions {
    held: bool,
    applied: i64,
    published: i64,
    indexed: i64,
    /// APPEND messages of the partition after the last one read (JetStream's count).
    unread: u64,
}

pub(crate) struct WriterMetrics {
    batch: Histogram,
    commit: Histogram,
    partitions: Mutex<BTreeMap<u32, Positions>>,
    dead_letters: Mutex<BTreeMap<String, u64>>,
    search_skipped: std::sync::atomic::AtomicU64,
}

/// This process's writer metrics (the writers of one process add up).
pub(crate) fn metrics() -> &'static WriterMetrics {
    static METRICS: LazyLock<WriterMetrics> = LazyLock::new(|| WriterMetrics {
        batch: Histogram::new(BATCH),
        commit: Histogram::new(SECONDS),
        partitions: Mutex::default(),
        dead_letters: Mutex::default(),
        search_skipped: Default::default(),
    });
    &METRICS
}

impl WriterMetrics {
    fn partition(&self, partition: u32, f: impl FnOnce(&mut Positions)) {
        f(self.partitions.lock().unwrap_or_else(PoisonError::into_inner).entry(partition).or_default());
    }

    pub(crate) fn committed(&self, partition: u32, requests: usize, seconds: f64, applied: i64) {
        self.batch.observe(requests as f64);
        self.commit.observe(seconds);
        self.partition(partition, |p| p.applied = applied);
    }

    pub(crate) fn published(&self, partition: u32, through: i64) {
        self.partition(partition, |p| p.published = through);
    }

    pub(crate) fn indexed(&self, partition: u32, through: i64) {
        self.partition(partition, |p| p.indexed = through);
    }

    pub(crate) fn unread(&self, partition: u32, pending: u64) {
        self.partition(partition, |p| p.unread = pending);
    }

    pub(crate) fn held(&self, partition: u32, held: bool) {
        self.partition(partition, |p| p.held = held);
    }

    pub(crate) fn dead_letter(&self, reason: &str) {
        *self
            .dead_letters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(reason.to_owned())
            .or_default() += 1;
    }

    pub(crate) fn search_skipped(&self) {
        self.search_skipped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn render(&self, out: &mut String) {
        family(out, "turnlog_writer_batch_requests", "histogram", "Requests applied per commit");
        histogram(out, "turnlog_writer_batch_requests", &[], &self.batch);
        family(out, "turnlog_writer_commit_seconds", "histogram", "Time to load, apply and commit one batch");
        histogram(out, "turnlog_writer_commit_seconds", &[], &self.commit);
        let partitions = self.partitions.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let held: Vec<(String, Positions)> =
            partitions.iter().filter(|(_, p)| p.held).map(|(n, p)| (n.to_string(), *p)).collect();
        family(out, "turnlog_writer_partitions_held", "gauge", "Partitions this process applies");
        sample(out, "turnlog_writer_partitions_held", &[], held.len() as f64);
        for (name, help, get) in [
            (
                "turnlog_writer_applied_position",
                "Last APPEND stream sequence applied, by partition held",
                (|p: &Positions| p.applied as f64) as fn(&Positions) -> f64,
            ),
            ("turnlog_writer_published_position", "Last APPEND sequence whose events are on the feed", |p| {
                p.published as f64
            }),
            ("turnlog_writer_search_indexed_position", "Last APPEND sequence indexed for search", |p| {
                p.indexed as f64
            }),
            (
                "turnlog_writer_unread_messages",
                "APPEND messages of the partition not yet read by its writer",
                |p| p.unread as f64,
            ),
        ] {
            family(out, name, "gauge", help);
            for (n, p) in &held {
                sample(out, name, &[("partition", n)], get(p));
            }
        }
        family(out, "turnlog_writer_dead_letters_total", "counter", "Requests dead-lettered, by reason");
        for (reason, n) in self.dead_letters.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            sample(out, "turnlog_writer_dead_letters_total", &[("reason", reason)], *n as f64);
        }
        family(
            out,
            "turnlog_writer_search_skipped_total",
            "counter",
            "Events the search index could not take",
        );
        let skipped = self.search_skipped.load(std::sync::atomic::Ordering::Relaxed);
        sample(out, "turnlog_writer_search_skipped_total", &[], skipped as f64);
    }
}
