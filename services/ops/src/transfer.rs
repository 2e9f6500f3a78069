//! `turnlog import` and `turnlog export` (issue 25): an owner's conversations brought in from
//! an export file, or written out, by an operator.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use turnlog_core::ids::Owner;
use turnlog_core::import::Format;
use turnlog_runtime::export::ExportFormat;
use turnlog_runtime::import::{ImportLanes, Importer, Summary};
use turnlog_runtime::settings::Backbone;

/// How long one append waits for the writer's outcome.
const APPEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Imports `path` into `owner`'s sessions with a progress bar (on a terminal), then prints
/// the summary: conversations, messages, what was skipped and why, what failed.
pub async fn import(
    backbone: &Backbone,
    owner: &Owner,
    format: Option<Format>,
    path: &Path,
    show_progress: bool,
) -> anyhow::Result<Summary> {
    let pool = backbone.connect_reads(32).await.context("connecting to Postgres")?;
    let bus = backbone.connect_bus().await?;
    let importer = Importer {
        lanes: Arc::new(ImportLanes::new(bus.partitions)),
        bus,
        pool,
        owner: owner.clone(),
        append_timeout: APPEND_TIMEOUT,
    };
    let bar = crate::progress::bar(show_progress, "import", "conversations");
    let started = Instant::now();
    let summary = importer
        .file(path, format, |s, checked| {
            bar.set_length(checked.conversations as u64);
            bar.set_position((s.conversations + s.failed_total) as u64);
            bar.set_message(format!("{} of {} messages", s.messages, checked.messages));
        })
        .await
        .with_context(|| format!("nothing was imported from {}", path.display()))?;
    bar.finish_and_clear();
    let rate = crate::progress::rate(summary.messages as u64, started.elapsed());
    println!(
        "imported {} conversations ({} already there whole): {} sessions, {} messages, {} events in {:.1}s ({rate:.0} messages/s)",
        summary.conversations,
        summary.unchanged,
        summary.sessions,
        summary.messages,
        summary.events,
        started.elapsed().as_secs_f64(),
    );
    if !summary.skipped.is_empty() {
        println!("skipped {} parts (a note stands in each one's place):", summary.skipped_total);
        for s in &summary.skipped {
            println!("  {}: {} — {}", s.conversation, s.what, s.reason);
        }
        more(summary.skipped_total - summary.skipped.len());
    }
    if !summary.failed.is_empty() {
        println!("{} conversations not imported:", summary.failed_total);
        for f in &summary.failed {
            println!("  {}: {}", f.conversation, f.reason);
        }
        more(summary.failed_total - summary.failed.len());
    }
    Ok(summary)
}

/// The line for what a summary counts but does not list.
fn more(unlisted: usize) {
    if unlisted > 0 {
        println!("  … and {unlisted} more");
    }
}

/// Writes every session of `owner` to stdout in `format`; returns how many.
pub async fn export(backbone: &Backbone, owner: &Owner, format: ExportFormat) -> anyhow::Result<usize> {
    let pool = backbone.connect_reads(2).await.context("connecting to Postgres")?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let n = turnlog_runtime::export::owner(&pool, owner, format, &mut out).await?;
    std::io::Write::flush(&mut out).context("writing the export")?;
    Ok(n)
}
