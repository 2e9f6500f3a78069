//! Garbage collection of what tests leave on long-lived servers: each test environment is
//! recorded when made, and environments older than an hour (their database and JetStream
//! streams) are removed by whichever test process next finds a sweep due.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use sqlx::Connection;

use turnlog_local_servers::Postmaster;

use crate::process::log_dir;
use crate::servers::{lock_state, state_dir};
use crate::util::file_age;

/// At most one sweep per this interval, across all test processes of this user.
const SWEEP_EVERY: Duration = Duration::from_secs(120);
/// A test environment this old is abandoned: no test runs for an hour.
const ENV_MAX_AGE: Duration = Duration::from_secs(3600);
/// Past this age a database still in use is dropped anyway (a leaked connection).
const FORCE_AFTER: Duration = Duration::from_secs(6 * 3600);
/// Records of environments on servers we no longer use are forgotten after a week.
const FORGET_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);
/// Process logs are kept a day for reading failures.
const LOG_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// A sweep stops after this long and leaves the rest to the next one, so no single test
/// is slowed much.
const BUDGET: Duration = Duration::from_secs(5);

/// What is left to remove of one test environment. A part is `None` once removed, or from
/// the start when its server was passed in explicitly ([`test_env_on`](crate::test_env_on)):
/// such a server (a [`PrivatePostgres`](crate::PrivatePostgres), say) belongs to its test.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    /// The admin URL of the server holding `database`.
    postgres: Option<String>,
    /// The URL of the NATS server holding the prefix's streams.
    nats: Option<String>,
    database: String,
    bus_prefix: String,
}

fn records_dir() -> PathBuf {
    state_dir().join("envs")
}

fn record_path(bus_prefix: &str) -> PathBuf {
    records_dir().join(format!("{bus_prefix}.json"))
}

/// Remembers a new environment for the sweep. Best effort: a missing record only means the
/// environment is not collected.
pub(crate) fn record(postgres: Option<&str>, nats: Option<&str>, database: &str, bus_prefix: &str) {
    if postgres.is_none() && nats.is_none() {
        return;
    }
    let record = Record {
        postgres: postgres.map(str::to_owned),
        nats: nats.map(str::to_owned),
        database: database.to_owned(),
        bus_prefix: bus_prefix.to_owned(),
    };
    if let Ok(bytes) = serde_json::to_vec(&record) {
        let _ = std::fs::create_dir_all(records_dir())
            .and_then(|()| std::fs::write(record_path(bus_prefix), bytes));
    }
}

pub(crate) fn forget(bus_prefix: &str) {
    let _ = std::fs::remove_file(record_path(bus_prefix));
}

/// Whether this process should sweep now; claims the sweep (touches the stamp) if so.
fn claim_sweep() -> bool {
    let Ok(lock) = lock_state() else {
        return false;
    };
    let stamp = lock.dir.join("last-sweep");
    if file_age(&stamp).is_some_and(|age| age < SWEEP_EVERY) {
        return false;
    }
    std::fs::write(&stamp, b"").is_ok()
}

/// Runs a sweep of old environments on these servers if one is due. Never fails a test:
/// problems are printed and left for the next sweep.
pub(crate) async fn maybe_sweep(admin_url: &str, nats_url: &str) {
    if !tokio::task::spawn_blocking(claim_sweep).await.unwrap_or(false) {
        return;
    }
    remove_old_files(&log_dir(), LOG_MAX_AGE);
    remove_stale_private_servers();
    let mut due = Vec::new();
    for (path, age) in aged_files(&records_dir()) {
        let record: Option<Record> = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        match record {
            Some(r) if age >= FORGET_AFTER => {
                eprintln!(
                    "turnlog-testkit: forgetting test environment {} (servers unused for a week)",
                    r.bus_prefix
                );
                let _ = std::fs::remove_file(&path);
            }
            Some(r) if age >= ENV_MAX_AGE => {
                let here = r.postgres.as_deref() == Some(admin_url) || r.nats.as_deref() == Some(nats_url);
                if here {
                    due.push((age, r));
                }
            }
            Some(_) => {}
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    if due.is_empty() {
        return;
    }
    if let Err(e) = sweep(admin_url, nats_url, due).await {
        eprintln!("turnlog-testkit: sweeping old test environments: {e:#}");
    }
}

async fn sweep(admin_url: &str, nats_url: &str, due: Vec<(Duration, Record)>) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut streams: Option<(async_nats::jetstream::Context, Vec<String>)> = None;
    for (age, mut record) in due {
        if started.elapsed() > BUDGET {
            break;
        }
        if record.postgres.as_deref() == Some(admin_url)
            && drop_database(admin_url, &record.database, age >= FORCE_AFTER).await.is_ok()
        {
            record.postgres = None;
        }
        if record.nats.as_deref() == Some(nats_url) {
            if streams.is_none() {
                let jetstream = async_nats::jetstream::new(connect_nats(nats_url).await?);
                let names = jetstream.stream_names().try_collect().await.context("listing streams")?;
                streams = Some((jetstream, names));
            }
            if let Some((jetstream, names)) = &streams {
                if delete_streams(jetstream, names, &record.bus_prefix).await.is_ok() {
                    record.nats = None;
                }
            }
        }
        if record.postgres.is_none() && record.nats.is_none() {
            forget(&record.bus_prefix);
        } else {
            // Keep what is left for a sweep on the other server; the file's age is kept
            // too, as the rewrite goes through a copy whose time is set back.
            rewrite(&record, age);
        }
    }
    Ok(())
}

/// Saves what is left of `record`, keeping the file's modification time (its age).
fn rewrite(record: &Record, age: Duration) {
    let path = record_path(&record.bus_prefix);
    let Ok(bytes) = serde_json::to_vec(record) else {
        return;
    };
    let written = std::fs::write(&path, bytes).and_then(|()| {
        let file = std::fs::File::options().write(true).open(&path)?;
        file.set_modified(std::time::SystemTime::now() - age)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&path);
    }
}

pub(crate) async fn connect_nats(url: &str) -> anyhow::Result<async_nats::Client> {
    // A cluster's nodes come comma-separated, as NATS_URL takes them.
    let servers: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(servers)
        .await
        .with_context(|| format!("cannot connect to NATS at {url}"))
}

/// Drops `database` if it exists. Without `force` a database someone is connected to is
/// left alone (an error), so a sweep never pulls one from under a running test.
pub(crate) async fn drop_database(admin_url: &str, database: &str, force: bool) -> anyhow::Result<()> {
    let mut admin = admin_connection(admin_url).await?;
    // `database` is ours ([a-z0-9_]); quoting keeps it one identifier all the same.
    let sql = if force {
        format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)")
    } else {
        format!("DROP DATABASE IF EXISTS \"{database}\"")
    };
    let result = sqlx::raw_sql(&sql).execute(&mut admin).await;
    let _ = admin.close().await;
    result.with_context(|| format!("cannot drop database {database}"))?;
    Ok(())
}

pub(crate) async fn admin_connection(admin_url: &str) -> anyhow::Result<sqlx::PgConnection> {
    match tokio::time::timeout(Duration::from_secs(10), sqlx::PgConnection::connect(admin_url)).await {
        Ok(conn) => conn.with_context(|| format!("cannot connect to Postgres at {admin_url}")),
        Err(_) => anyhow::bail!("connecting to Postgres at {admin_url} timed out after 10 s"),
    }
}

/// Whether stream `name` belongs to bus prefix `prefix`: stream names are the upper-cased
/// prefix and a suffix (`TABC_APPEND`); a key-value bucket or object store named after the
/// prefix is backed by a stream `KV_<bucket>` / `OBJ_<bucket>`.
pub(crate) fn stream_belongs(name: &str, prefix: &str) -> bool {
    let upper = prefix.to_uppercase();
    let bare = name.strip_prefix("KV_").or_else(|| name.strip_prefix("OBJ_")).unwrap_or(name);
    bare.starts_with(&upper)
}

/// Deletes the streams among `names` that belong to `prefix`; how many.
pub(crate) async fn delete_streams(
    jetstream: &async_nats::jetstream::Context,
    names: &[String],
    prefix: &str,
) -> anyhow::Result<usize> {
    let mut deleted = 0;
    for name in names.iter().filter(|n| stream_belongs(n, prefix)) {
        jetstream.delete_stream(name).await.with_context(|| format!("cannot delete stream {name}"))?;
        deleted += 1;
    }
    Ok(deleted)
}

/// Data of per-test private servers whose test was killed before its drop ran (a SIGKILL
/// from the test runner's timeout). A Postgres directory is left alone while its
/// postmaster lives; a nats store has no pid file, so only its age (a day) counts.
fn remove_stale_private_servers() {
    for (path, age) in aged_files(&crate::postgres::base_dir()) {
        let is_private = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("private-"));
        let running = Postmaster::read(&path).is_some_and(|postmaster| postmaster.alive());
        if is_private && !running && age >= ENV_MAX_AGE {
            let _ = std::fs::remove_dir_all(path);
        }
    }
    for (path, age) in aged_files(&std::env::temp_dir()) {
        let is_store =
            path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("turnlog-testkit-nats-"));
        if is_store && age >= LOG_MAX_AGE {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

/// Entries directly in `dir` with their ages.
fn aged_files(dir: &Path) -> Vec<(PathBuf, Duration)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries.filter_map(Result::ok).filter_map(|e| Some((e.path(), file_age(&e.path())?))).collect()
}

fn remove_old_files(dir: &Path, max_age: Duration) {
    for (path, age) in aged_files(dir) {
        if age >= max_age && path.is_file() {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::stream_belongs;

    #[test]
    fn streams_belong_by_upper_cased_prefix() {
        assert!(stream_belongs("TABC123_APPEND", "tabc123"));
        assert!(stream_belongs("KV_TABC123_TURNS", "tabc123"));
        assert!(stream_belongs("OBJ_TABC123_FILES", "tabc123"));
        assert!(!stream_belongs("TURNLOG_APPEND", "tabc123"));
        assert!(!stream_belongs("KV_TURNLOG_TURNS", "tabc123"));
    }
}
