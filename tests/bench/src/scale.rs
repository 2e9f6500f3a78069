//! `turnlog-bench scale` (issue 26): appends per second end to end with partitions × writers
//! ∈ {1×1, 2×2, 4×2}, on one nats-server and on a three-node cluster with one and with three
//! replicas, all in one run; and the CPU each append costs the writers, nats-server and
//! Postgres (from /proc), the figures README.md's cost model is built from.
//!
//! Writers are real `turnlog writer` processes; the nats-servers are the testkit's private
//! ones (so their CPU is theirs alone); Postgres is DATABASE_URL's (every process named
//! `postgres` on this machine is counted, so run it on an otherwise idle machine).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use turnlog_runtime::bus::Bus;
use turnlog_testkit::{free_port, private_nats, private_nats_cluster, test_env_on, TestEnv, TurnlogProcess};

use bytes::Bytes;
use futures::StreamExt as _;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::AppendRequest;
use uuid::Uuid;

use crate::writer::{message, owner, sessions_on};

/// Appends per configuration.
const APPENDS: usize = 60_000;
const SHAPES: [(u32, usize); 3] = [(1, 1), (2, 2), (4, 2)];

struct Row {
    nats: &'static str,
    partitions: u32,
    writers: usize,
    per_s: f64,
    /// CPU milliseconds per 1,000 appends: writers, nats-server(s), Postgres.
    cpu: [f64; 3],
}

pub(crate) async fn run() -> anyhow::Result<()> {
    let bin = crate::soak::turnlog_binary()?;
    let single = private_nats(free_port()).await;
    let cluster = private_nats_cluster().await;
    let cluster_pids: Vec<u32> = (0..turnlog_testkit::CLUSTER_NODES).map(|i| cluster.pid(i)).collect();
    let topologies: [(&str, String, usize, Vec<u32>); 3] = [
        ("1 node, R1", single.url(), 1, vec![single.pid()]),
        ("3 nodes, R1", cluster.urls(), 1, cluster_pids.clone()),
        ("3 nodes, R3", cluster.urls(), 3, cluster_pids),
    ];
    let mut rows = Vec::new();
    for (nats, url, replicas, nats_pids) in &topologies {
        for (partitions, writers) in SHAPES {
            let row = one(&bin, nats, url, *replicas, partitions, writers, nats_pids).await?;
            eprintln!(
                "{:<12} {}×{}: {:>7.0} appends/s; CPU ms per 1,000: writers {:.0}, NATS {:.0}, Postgres {:.0}",
                row.nats, row.partitions, row.writers, row.per_s, row.cpu[0], row.cpu[1], row.cpu[2]
            );
            rows.push(row);
        }
    }

    println!(
        "\n| NATS | partitions × writers | appends/s | CPU ms / 1,000 appends: writers | NATS | Postgres |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {}×{} | {:.0} | {:.0} | {:.0} | {:.0} |",
            r.nats, r.partitions, r.writers, r.per_s, r.cpu[0], r.cpu[1], r.cpu[2]
        );
    }
    let key =
        |r: &Row| format!("{}_{}x{}", r.nats.replace([' ', ','], "").to_lowercase(), r.partitions, r.writers);
    let figures: Vec<String> = rows.iter().map(|r| format!("{}={:.0}", key(r), r.per_s)).collect();
    // The cost model's inputs: CPU per append on the cluster with three replicas, 4×2.
    let last = rows.last().context("no runs")?;
    println!(
        "\nRESULT scale {} cpu_us_per_append_writer={:.0} cpu_us_per_append_nats={:.0} cpu_us_per_append_postgres={:.0} cores={}",
        figures.join(" "),
        last.cpu[0],
        last.cpu[1],
        last.cpu[2],
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    Ok(())
}

async fn one(
    bin: &std::path::Path,
    nats: &'static str,
    url: &str,
    replicas: usize,
    partitions: u32,
    writers: usize,
    nats_pids: &[u32],
) -> anyhow::Result<Row> {
    let mut env = test_env_on(None, Some(url)).await;
    env.partitions = partitions;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, partitions).await?.with_replicas(replicas);
    bus.ensure_topology(None).await?;
    let replicas_var = replicas.to_string();
    let mut procs: Vec<TurnlogProcess> = (0..writers)
        .map(|_| {
            TurnlogProcess::start(
                bin,
                &env,
                &["writer"],
                &[("TURNLOG_STREAM_REPLICAS", replicas_var.as_str())],
            )
        })
        .collect();
    settle(&env, partitions, writers.min(partitions as usize)).await?;
    let sessions = sessions_on(&bus, &env, 64).await?;

    let writer_pids: Vec<u32> = procs.iter().map(TurnlogProcess::pid).collect();
    let before = [crate::cpu::of(&writer_pids), crate::cpu::of(nats_pids), crate::cpu::of(&postgres_pids())];
    let started = Instant::now();
    let appends = applied_load(&bus, &env, &sessions, APPENDS).await?;
    let elapsed = started.elapsed();
    let after = [crate::cpu::of(&writer_pids), crate::cpu::of(nats_pids), crate::cpu::of(&postgres_pids())];
    let per_s = appends as f64 / elapsed.as_secs_f64();
    let cpu = [0, 1, 2].map(|i| (after[i] - before[i]) * 1e6 / (appends as f64).max(1.0));

    for p in &mut procs {
        p.terminate();
    }
    for p in &mut procs {
        p.wait_exit(Duration::from_secs(20)).await;
    }
    drop(bus);
    env.cleanup().await;
    Ok(Row { nats, partitions, writers, per_s, cpu })
}

/// Producers that publish `total` appends as fast as JetStream acknowledges them (at most
/// 256 unacknowledged each), timed until the writers have applied them all: from the first
/// publish to the last commit. Returns how many were applied (all, unless the writers stop
/// making progress for a minute).
async fn applied_load(
    bus: &Bus,
    env: &TestEnv,
    sessions: &[SessionId],
    total: usize,
) -> anyhow::Result<usize> {
    const PRODUCERS: usize = 16;
    const WINDOW: usize = 256;
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM session_events WHERE kind = 'user_message'")
            .fetch_one(&env.pool)
            .await
    };
    let before = count().await?;
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let bus = bus.clone();
        let mine: Vec<SessionId> = sessions.iter().skip(p).step_by(PRODUCERS).copied().collect();
        let n = total / PRODUCERS;
        tasks.push(tokio::spawn(async move {
            let mut acks = futures::stream::FuturesUnordered::new();
            for i in 0..n {
                let session = mine[i % mine.len()];
                let req = AppendRequest::append(session, &owner(), Uuid::now_v7(), &message(i));
                let subject = bus.names.append_subject(bus.partition_of(session), session);
                let msg = async_nats::jetstream::message::PublishMessage::build()
                    .payload(Bytes::from(serde_json::to_vec(&req)?))
                    .message_id(req.request_id.to_string());
                let ack = bus.js.send_publish(subject, msg).await?;
                acks.push(std::future::IntoFuture::into_future(ack));
                if i >= WINDOW {
                    acks.next().await.context("ack")??;
                }
            }
            while let Some(a) = acks.next().await {
                a?;
            }
            anyhow::Ok(n)
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await??;
    }
    let (mut last, mut moved) = (0, Instant::now());
    loop {
        let applied = usize::try_from(count().await? - before).unwrap_or(0);
        if applied >= sent {
            return Ok(applied);
        }
        if applied > last {
            (last, moved) = (applied, Instant::now());
        } else if moved.elapsed() > Duration::from_secs(60) {
            eprintln!("  the writers stopped at {applied} of {sent} appends");
            return Ok(applied);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every partition is held, by `holders` distinct writers.
async fn settle(env: &TestEnv, partitions: u32, holders: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held = turnlog_writer::holders(&env.pool, partitions).await?;
        let mut names: Vec<&String> = held.iter().map(|(_, n)| n).collect();
        names.sort();
        names.dedup();
        if held.len() == partitions as usize && names.len() == holders {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "writers did not settle: {held:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every process named `postgres` (the server and its backends).
fn postgres_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres")
        })
        .collect()
}
