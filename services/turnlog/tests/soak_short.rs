//! The reliability soak, short: about 75 s of chat load from 8 clients on real `turnlog`
//! processes (two ingress copies, a writer and its standby, two copies of each worker) while
//! the active writer is SIGKILLed, one ingress copy is SIGKILLed and nats-server is killed
//! and restarted. Fails on any violation of the checker (DESIGN.md §9): an acknowledged
//! event lost or stored twice, a gap, a cut turn that kept less than its last checkpoint,
//! a 5xx for a client's mistake, or a process kind not back within a generous bound. The
//! long version with every fault kind is `cargo run --release -p turnlog-bench -- soak`.

use turnlog_testkit::soak::{run, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_loses_nothing_and_recovers_from_every_fault() {
    let report = run(SoakConfig::short(env!("CARGO_BIN_EXE_turnlog"))).await.expect("soak set-up");
    println!("{}", report.render());
    assert_eq!(report.faults, 3, "every scheduled fault ran");
    assert!(report.acked > 100, "too little load to prove anything: {}", report.result_line());
    assert!(
        report.cuts_bounded > 0,
        "no turn cut by the ingress kill was held against the checkpoint bound: {}",
        report.result_line()
    );
    assert!(
        report.violations.is_empty(),
        "{} violations, first: {:?}\n{}",
        report.violations.len(),
        report.violations.first(),
        report.result_line()
    );
}
