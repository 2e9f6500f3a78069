//! The reliability soak, short: about 75 s of chat load from 8 clients on real `turnlog`
//! processes (two ingress copies, a writer and its standby, two copies of each worker) while
//! the active writer is SIGKILLed, one ingress copy is SIGKILLed and nats-server is killed
//! and restarted. Fails on any violation of the checker (DESIGN.md §9): an acknowledged
//! event lost or stored twice, a gap, a cut turn that kept less than its last checkpoint,
//! a 5xx for a client's mistake, or a process kind not back within a generous bound. The
//! long version with every fault kind is `cargo run --release -p turnlog-bench -- soak`.

use turnlog_testkit::soak::{run, SoakConfig, SoakReport};

/// Runs the soak and checks what every short soak must show: each scheduled fault ran,
/// enough load to prove anything, no violation. Returns the report for further checks.
async fn soak(config: SoakConfig) -> SoakReport {
    let report = run(config).await.expect("soak set-up");
    println!("{}", report.render());
    assert_eq!(report.faults, 3, "every scheduled fault ran");
    assert!(report.acked > 100, "too little load to prove anything: {}", report.result_line());
    assert!(
        report.violations.is_empty(),
        "{} violations, first: {:?}\n{}",
        report.violations.len(),
        report.violations.first(),
        report.result_line()
    );
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_loses_nothing_and_recovers_from_every_fault() {
    let report = soak(SoakConfig::short(env!("CARGO_BIN_EXE_turnlog"))).await;
    assert!(
        report.cuts_bounded > 0,
        "no turn cut by the ingress kill was held against the checkpoint bound: {}",
        report.result_line()
    );
}

/// The same on a three-node NATS cluster with replicas 3, four partitions and two writers
/// sharing them (issue 26): the node leading TURNLOG_APPEND, then the one leading
/// TURNLOG_EVENTS, is SIGKILLed under chat load, then a writer. Nothing acknowledged is lost
/// or duplicated, no client sees a 5xx outside the faults, and writes resume within the
/// bound (the outage is printed with the report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_on_a_nats_cluster_survives_leader_kills() {
    let report = soak(SoakConfig::short_cluster(env!("CARGO_BIN_EXE_turnlog"))).await;
    assert!(report.max_write_outage_s.is_some(), "no leader kill ran: {}", report.result_line());
    // Writes wait (TURNLOG_APPEND_TIMEOUT 20 s) and republish through the election.
    assert_eq!(report.unavailable_503, 0, "clients saw 503s: {}", report.result_line());
}
