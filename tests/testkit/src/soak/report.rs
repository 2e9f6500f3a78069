//! The soak's report: violations by kind, a row per fault kind (runs, events acknowledged
//! while it and its recovery lasted, lost, duplicated, recovery time), resident memory per
//! process, and the one `RESULT soak ...` line the benchmark ends with.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::check::Checked;
use super::client::Purpose;
use super::faults::{FaultKind, FaultRun};
use super::{lock, Shared, SoakConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ViolationKind {
    /// Something a client saw acknowledged is not in the log as seen (or a cut turn kept
    /// less than its last checkpoint).
    Lost,
    /// Something stored twice.
    Duplicated,
    /// Seqs not gapless, or a session's `last_seq` off.
    Gap,
    /// Stored text or status that differs from what the client was told.
    Mismatch,
    /// A turn without its memory_extracted after the workers had time to catch up.
    Worker,
    /// A stored event missing from the committed-event feed.
    Feed,
    /// A process kind not serving again within the bound after a fault.
    Recovery,
    /// A 5xx the client did not deserve.
    Http5xx,
    /// Resident memory grew more than allowed.
    Rss,
    Other,
}

#[derive(Debug, Clone)]
pub struct Violation {
    pub kind: ViolationKind,
    pub detail: String,
    /// When the thing checked happened (Unix seconds): decides its fault row.
    pub at: f64,
}

#[derive(Debug, Clone)]
pub(crate) struct RssSample {
    pub slot: String,
    pub pid: u32,
    /// Seconds since the start.
    pub t: f64,
    pub kib: u64,
}

/// One process run's resident memory.
#[derive(Debug, Clone)]
pub struct RssLine {
    pub process: String,
    pub pid: u32,
    pub first_mb: f64,
    /// At minute 2 (or the first sample after it).
    pub base_mb: Option<f64>,
    pub last_mb: f64,
    pub max_mb: f64,
    /// last / base - 1, when this run lasted from minute 2 to the end.
    pub growth: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct FaultRow {
    pub fault: String,
    pub runs: usize,
    pub acked: usize,
    pub lost: usize,
    pub duplicated: usize,
    /// Seconds: the slowest and the median recovery; None when a run never recovered.
    pub recovery_max: Option<f64>,
    pub recovery_median: Option<f64>,
    /// What the recovery column means for this row.
    pub recovery_note: &'static str,
}

#[derive(Debug, Clone)]
pub struct SoakReport {
    pub duration_s: f64,
    pub clients: usize,
    /// The ingress copies' `TURNLOG_MAX_TURNS_PER_OWNER`.
    pub turn_cap_per_owner: usize,
    /// Whether the soak's Postgres commits durably (its private server does not: fsync off).
    pub durable: bool,
    pub faults: usize,
    pub acked: usize,
    pub lost: usize,
    pub duplicated: usize,
    pub max_recovery_s: f64,
    /// The longest write outage of a NATS leader kill (seconds), when one ran; the cap when
    /// writes did not resume.
    pub max_write_outage_s: Option<f64>,
    /// 503s the clients saw, during faults or not.
    pub unavailable_503: usize,
    pub max_rss_mb: f64,
    /// The largest growth among the judged process runs (0.05 = 5%).
    pub max_rss_growth: Option<f64>,
    /// Turns cut by a kill whose stored checkpoint was held against the 2 s bound (§9.4).
    pub cuts_bounded: usize,
    pub rows: Vec<FaultRow>,
    pub rss: Vec<RssLine>,
    pub violations: Vec<Violation>,
    /// Lines describing each fault run and the counters.
    pub details: Vec<String>,
}

const NONE_ROW: &str = "none (warm-up, before the first fault)";
const MODEL_ROW: &str = "model failure / hang / stall (in messages, all along)";

pub(crate) fn build(
    config: &SoakConfig,
    shared: &Shared,
    runs: Vec<FaultRun>,
    checked: Checked,
) -> SoakReport {
    let mut windows = lock(&shared.windows).clone();
    windows.sort_by(|a, b| a.2.total_cmp(&b.2));
    let window_of = |t: f64| windows.iter().rev().find(|w| w.2 <= t).map(|w| w.0);

    let (rss, max_rss_mb, max_rss_growth) = rss_lines(config, shared);
    let mut violations = lock(&shared.violations).clone();
    if let Some(g) = max_rss_growth.filter(|g| *g > config.rss_growth_limit) {
        let worst = rss.iter().filter(|l| l.growth == Some(g)).map(|l| l.process.clone()).collect::<Vec<_>>();
        violations.push(Violation {
            kind: ViolationKind::Rss,
            detail: format!(
                "resident memory of {} grew {:.1}% from minute {:.0} to the end (limit {:.0}%)",
                worst.join(", "),
                g * 100.0,
                config.rss_judged_from.as_secs_f64() / 60.0,
                config.rss_growth_limit * 100.0
            ),
            at: super::now_s(),
        });
    }

    // Rows: each fault kind that ran, then the warm-up and the in-message model faults.
    let mut rows = Vec::new();
    let mut kinds: Vec<FaultKind> = runs.iter().map(|r| r.kind).collect();
    kinds.sort();
    kinds.dedup();
    let count = |kind: Option<FaultKind>, which: ViolationKind| {
        violations.iter().filter(|v| v.kind == which && window_of(v.at) == kind).count()
    };
    for kind in kinds.iter().copied().map(Some).chain([None]) {
        let of_kind: Vec<&FaultRun> = runs.iter().filter(|r| Some(r.kind) == kind).collect();
        let mut recoveries: Vec<f64> = of_kind.iter().filter_map(|r| r.recovery).collect();
        recoveries.sort_by(f64::total_cmp);
        let all = recoveries.len() == of_kind.len();
        rows.push(FaultRow {
            fault: kind.map_or(NONE_ROW, FaultKind::label).to_owned(),
            runs: of_kind.len(),
            acked: checked.acked.iter().filter(|(_, _, t)| window_of(*t) == kind).count(),
            lost: count(kind, ViolationKind::Lost),
            duplicated: count(kind, ViolationKind::Duplicated),
            recovery_max: recoveries.last().copied().filter(|_| all && kind.is_some()),
            recovery_median: recoveries.get(recoveries.len() / 2).copied().filter(|_| kind.is_some()),
            recovery_note: "until the affected kinds serve again",
        });
    }
    let records = lock(&shared.records).clone();
    let model: Vec<_> = records.iter().filter(|r| r.purpose == Purpose::ModelFault).collect();
    let mut model_waits: Vec<f64> =
        model.iter().filter(|r| r.end.is_some()).map(|r| r.end_at - r.started).collect();
    model_waits.sort_by(f64::total_cmp);
    let model_marker = format!("({:?})", Purpose::ModelFault);
    let model_count = |which: ViolationKind| {
        violations.iter().filter(|v| v.kind == which && v.detail.contains(&model_marker)).count()
    };
    rows.push(FaultRow {
        fault: MODEL_ROW.to_owned(),
        runs: model.len(),
        acked: model
            .iter()
            .map(|r| usize::from(r.user_seq.is_some()) + usize::from(r.end.as_ref().is_some_and(has_seq)))
            .sum(),
        lost: model_count(ViolationKind::Lost),
        duplicated: model_count(ViolationKind::Duplicated),
        recovery_max: model_waits.last().copied(),
        recovery_median: model_waits.get(model_waits.len() / 2).copied(),
        recovery_note: "until the client has its `end`",
    });

    let cap = config.recovery_cap.as_secs_f64();
    let max_recovery_s = runs.iter().map(|r| r.recovery.unwrap_or(cap)).fold(0.0, f64::max);
    let max_write_outage_s = runs.iter().filter_map(|r| r.outage).map(|o| o.unwrap_or(cap)).reduce(f64::max);
    let mut details = Vec::new();
    for r in &runs {
        let probes: Vec<String> = r
            .probes
            .iter()
            .map(|(name, s)| s.map_or(format!("{name} NOT RECOVERED"), |s| format!("{name} {s:.1}s")))
            .collect();
        let outage = match r.outage {
            Some(Some(s)) => format!("; write outage {s:.1}s"),
            Some(None) => "; writes did not resume".to_owned(),
            None => String::new(),
        };
        details.push(format!(
            "{:>6.1}s {} (run {}), ended at {:.1}s: {}{outage}",
            r.at,
            r.kind.label(),
            r.run,
            r.healed_at,
            probes.join(", ")
        ));
    }
    details.push(counters_line(shared));
    let ages = &checked.checkpoint_ages;
    let max_age = ages.iter().copied().fold(0.0, f64::max);
    details.push(format!(
        "log: {} events in {} sessions, {} compactions, {} memories; {} turns answered without a \
         residue; settled {:.1} s after the load; {} completed turns not confirmed stored in \
         time ({} of them stored after all); dead letters {}; feed repeats {}; cut turns checked \
         {} ({} kept a checkpoint; at most {max_age:.2} s of streamed text lost at a kill); model-fault directives hidden by a \
         later worker note {}",
        checked.events,
        checked.sessions,
        checked.compactions,
        checked.memories,
        checked.turns_without_residue.len(),
        checked.settled_in,
        checked.unconfirmed,
        checked.unconfirmed_stored,
        checked.dead_letters,
        checked.feed_duplicates,
        checked.cuts_checked,
        ages.len(),
        checked.directives_masked,
    ));

    for c in checked.cuts.iter().take(12) {
        details.push(format!("cut: {c}"));
    }
    if !checked.turns_without_residue.is_empty() {
        details.push(format!(
            "answers without a turn_memory (an empty residue, or a lost one): {}",
            checked.turns_without_residue.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    violations.sort_by(|a, b| a.kind.cmp(&b.kind).then(a.at.total_cmp(&b.at)));
    SoakReport {
        duration_s: config.duration.as_secs_f64(),
        clients: config.clients,
        turn_cap_per_owner: config.turn_cap_per_owner(),
        durable: false,
        faults: runs.len(),
        acked: checked.acked.len(),
        lost: violations.iter().filter(|v| v.kind == ViolationKind::Lost).count(),
        duplicated: violations.iter().filter(|v| v.kind == ViolationKind::Duplicated).count(),
        max_recovery_s,
        max_write_outage_s,
        unavailable_503: shared.counters.unavailable_503.load(Ordering::Relaxed),
        max_rss_mb,
        max_rss_growth,
        cuts_bounded: checked.checkpoint_ages.len(),
        rows,
        rss,
        violations,
        details,
    }
}

fn has_seq(end: &serde_json::Value) -> bool {
    ["assistant_seq", "pending_seq", "failed_seq"].iter().any(|f| end.get(*f).is_some())
}

fn counters_line(shared: &Shared) -> String {
    let c = &shared.counters;
    let n = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
    format!(
        "turns {} (completed {}, interrupted {}, stopped {}, failed {}, cut by a fault {}); left \
         early {}, re-attached {}, retries {}, resends {}, gave up {}; model faults asked {}; \
         mistakes {} (503 during a fault {}); 503s seen {} ({} outside faults); poison published {}",
        n(&c.turns),
        n(&c.completed),
        n(&c.interrupted),
        n(&c.stopped),
        n(&c.failed),
        n(&c.cut),
        n(&c.left_early),
        n(&c.reattached),
        n(&c.retries),
        n(&c.resends),
        n(&c.gave_up),
        n(&c.model_faults),
        n(&c.mistakes),
        n(&c.mistakes_503),
        n(&c.unavailable_503),
        n(&c.unavailable_503_calm),
        n(&c.poison_sent),
    )
}

/// Per process run: memory at the start, at minute 2 and at the end. Growth is judged only
/// for runs alive from minute 2 to the end, and only when the load lasted long enough.
fn rss_lines(config: &SoakConfig, shared: &Shared) -> (Vec<RssLine>, f64, Option<f64>) {
    let samples = lock(&shared.rss).clone();
    let mut by_run: BTreeMap<(String, u32), Vec<(f64, u64)>> = BTreeMap::new();
    for s in &samples {
        by_run.entry((s.slot.clone(), s.pid)).or_default().push((s.t, s.kib));
    }
    let from = config.rss_judged_from.as_secs_f64();
    let end = config.duration.as_secs_f64();
    let judged = end >= from + 120.0;
    let mb = |kib: u64| kib as f64 / 1024.0;
    let mut lines = Vec::new();
    for ((process, pid), s) in by_run {
        let (Some(first), Some(last)) = (s.first(), s.last()) else { continue };
        let base = s.iter().find(|(t, _)| *t >= from);
        let spans = first.0 <= from + 10.0 && last.0 >= end - 15.0;
        let growth = base.filter(|_| judged && spans).map(|b| last.1 as f64 / b.1.max(1) as f64 - 1.0);
        lines.push(RssLine {
            process,
            pid,
            first_mb: mb(first.1),
            base_mb: base.map(|b| mb(b.1)),
            last_mb: mb(last.1),
            max_mb: mb(s.iter().map(|(_, k)| *k).max().unwrap_or(0)),
            growth,
        });
    }
    let max = lines.iter().map(|l| l.max_mb).fold(0.0, f64::max);
    let growth = lines.iter().filter_map(|l| l.growth).reduce(f64::max);
    (lines, max, growth)
}

impl SoakReport {
    /// The `RESULT` line the benchmark ends with.
    pub fn result_line(&self) -> String {
        let growth = self.max_rss_growth.map_or("na".to_owned(), |g| format!("{:.1}", g * 100.0));
        let outage = self.max_write_outage_s.map_or(String::new(), |s| format!(" max_write_outage_s={s:.1}"));
        format!(
            "RESULT soak faults={} acked={} lost={} duplicated={} max_recovery_s={:.1} max_rss_mb={:.0} \
             violations={} max_rss_growth_pct={growth} cuts_bounded={} clients={} turn_cap_per_owner={} \
             durable={}{outage}",
            self.faults,
            self.acked,
            self.lost,
            self.duplicated,
            self.max_recovery_s,
            self.max_rss_mb,
            self.violations.len(),
            self.cuts_bounded,
            self.clients,
            self.turn_cap_per_owner,
            u8::from(self.durable)
        )
    }

    /// The per-fault table, as Markdown (the README carries it).
    pub fn markdown_table(&self) -> String {
        let mut out = String::from(
            "| fault | runs | events acknowledged | lost | duplicated | recovery max (median) |\n\
             |---|---:|---:|---:|---:|---|\n",
        );
        for r in &self.rows {
            let recovery = match (r.recovery_max, r.recovery_median, r.runs) {
                (_, _, 0) => "—".to_owned(),
                (Some(max), Some(median), _) => format!("{max:.1} s ({median:.1} s)"),
                (None, Some(median), _) => format!("**not recovered** ({median:.1} s)"),
                _ => "—".to_owned(),
            };
            let recovery = if r.fault == MODEL_ROW && r.runs > 0 {
                format!("{recovery}: {}", r.recovery_note)
            } else {
                recovery
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                r.fault, r.runs, r.acked, r.lost, r.duplicated, recovery
            );
        }
        out
    }

    /// Resident memory per process slot: its runs (each restart is a new one), the most any
    /// run used, and the growth of the run that lasted from minute 2 to the end, if any.
    pub fn rss_table(&self) -> String {
        let mut out = String::from(
            "| process | runs | max RSS | RSS at minute 2 → end (run alive throughout) | growth |\n\
             |---|---:|---:|---|---:|\n",
        );
        let mut slots: BTreeMap<&str, Vec<&RssLine>> = BTreeMap::new();
        for l in &self.rss {
            slots.entry(l.process.as_str()).or_default().push(l);
        }
        for (process, runs) in slots {
            let max = runs.iter().map(|l| l.max_mb).fold(0.0, f64::max);
            let judged = runs.iter().find(|l| l.growth.is_some());
            let (span, growth) = match judged {
                Some(l) => (
                    format!("{:.0} → {:.0} MB", l.base_mb.unwrap_or(0.0), l.last_mb),
                    format!("{:+.1}%", l.growth.unwrap_or(0.0) * 100.0),
                ),
                None => ("—".to_owned(), "not judged".to_owned()),
            };
            let _ = writeln!(out, "| {process} | {} | {max:.0} MB | {span} | {growth} |", runs.len());
        }
        out
    }

    /// Everything, for a terminal: fault runs, counters, the table, memory, violations, and
    /// the `RESULT` line last.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nsoak: {:.0} s of load, {} clients (per-owner turn cap {}), {} faults",
            self.duration_s, self.clients, self.turn_cap_per_owner, self.faults
        );
        for d in &self.details {
            let _ = writeln!(out, "  {d}");
        }
        let _ = writeln!(out, "\n{}", self.markdown_table());
        let _ = writeln!(out, "{}", self.rss_table());
        let mut by_kind: BTreeMap<ViolationKind, usize> = BTreeMap::new();
        for v in &self.violations {
            *by_kind.entry(v.kind).or_default() += 1;
        }
        let _ = writeln!(out, "\nviolations: {} {by_kind:?}", self.violations.len());
        for v in self.violations.iter().take(60) {
            let _ = writeln!(out, "  {:?}: {}", v.kind, v.detail);
        }
        if self.violations.len() > 60 {
            let _ = writeln!(out, "  ... and {} more", self.violations.len() - 60);
        }
        let _ = writeln!(out, "\n{}", self.result_line());
        out
    }
}

/// A status line every 30 s while the load runs.
pub(crate) async fn progress(shared: Arc<Shared>, until: Instant) {
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(30)).await;
        if shared.config.progress {
            let violations = lock(&shared.violations).len();
            shared.say(&format!("{}; violations so far {violations}", counters_line(&shared)));
        }
    }
}
