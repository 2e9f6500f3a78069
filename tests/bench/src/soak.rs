//! `turnlog-bench soak --minutes N [--clients N] [--seed N] [--faults a,b,...] [--cluster]`:
//! the reliability soak — real
//! `turnlog` processes under chat load while processes and servers are killed, restarted
//! and frozen, then a checker that proves nothing acknowledged was lost (the machinery is
//! `turnlog_testkit::soak`, shared with the short CI test). Exits 1 on any violation.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context as _;
use turnlog_testkit::soak::{self, FaultKind, SoakConfig};

pub(crate) async fn run(args: &[String]) -> anyhow::Result<()> {
    let mut minutes = 3.0;
    let mut clients = None;
    let mut seed = None;
    let mut faults = None;
    let mut cluster = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--cluster" {
            cluster = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--minutes" => minutes = value.parse().context("--minutes: a number")?,
            "--clients" => clients = Some(value.parse().context("--clients: a number")?),
            "--seed" => seed = Some(value.parse().context("--seed: a number")?),
            "--faults" => {
                let kinds: Option<Vec<FaultKind>> = value.split(',').map(FaultKind::from_name).collect();
                let names: Vec<&str> = FaultKind::ALL.iter().chain(&FaultKind::CLUSTER).map(|k| k.name()).collect();
                faults = Some(kinds.with_context(|| format!("--faults: a list of {}", names.join(", ")))?);
            }
            other => anyhow::bail!(
                "unknown flag {other}; usage: soak --minutes N [--clients N] [--seed N] [--faults a,b,...] [--cluster]"
            ),
        }
    }
    let mut config = SoakConfig::bench(turnlog_binary()?, minutes);
    if cluster {
        // Three NATS nodes (replicas 3), four partitions over two writers; the leader kills
        // join the schedule.
        config.cluster = true;
        config.faults = FaultKind::CLUSTER.iter().chain(&FaultKind::ALL).copied().collect();
    }
    if let Some(c) = clients {
        config.clients = c;
    }
    if let Some(s) = seed {
        config.seed = s;
    }
    if let Some(f) = faults {
        config.faults = f;
    }
    let report = soak::run(config).await?;
    println!("{}", report.render());
    if !report.violations.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// The `turnlog` binary beside this one (TURNLOG_BIN overrides). Under `cargo run`, which
/// builds only the bench, it is built first so the soak never runs a stale binary.
pub(crate) fn turnlog_binary() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("TURNLOG_BIN") {
        return Ok(bin.into());
    }
    let exe = std::env::current_exe().context("locating turnlog-bench")?;
    let dir = exe.parent().context("turnlog-bench has no directory")?.to_path_buf();
    if let Some(cargo) = std::env::var_os("CARGO") {
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "turnlog", "--bin", "turnlog"]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().context("running cargo build -p turnlog")?;
        anyhow::ensure!(status.success(), "cargo build -p turnlog failed ({status})");
    }
    let bin = dir.join("turnlog");
    anyhow::ensure!(
        bin.exists(),
        "{} not found: build it (cargo build --release -p turnlog) or set TURNLOG_BIN",
        bin.display()
    );
    Ok(bin)
}
