//! CPU time (user + system) per process, from `/proc/<pid>/stat`: what the CPU figures of
//! the benches (`cpu_us_per_append`, `cpu_ms_per_turn`, the scale-out table) are read from.
//! Each part is a process tree the bench started: a service process, a private nats-server,
//! or a private Postgres (its postmaster and every backend).

use turnlog_testkit::{PrivateNats, PrivatePostgres, TurnlogProcess};

/// Clock ticks a second in `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;

/// The time fields of `/proc/<pid>/stat` in seconds: (utime + stime, cutime + cstime), the
/// second being the children it has reaped (a Postgres backend that exited).
fn stat(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which is in parentheses and may hold spaces), from `state`.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    let field = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some(((field(11)? + field(12)?) / TICKS, (field(13)? + field(14)?) / TICKS))
}

/// The parent pid of `pid`.
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split_whitespace().nth(1)?.parse().ok()
}

/// CPU seconds the processes `pids` have used themselves.
pub(crate) fn of(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&pid| stat(pid)).map(|(own, _)| own).sum()
}

/// CPU seconds of the process tree under `root`: its own, its reaped children's and its
/// live children's (one level: a postmaster's backends and helpers).
pub(crate) fn tree(root: u32) -> f64 {
    let Some((own, reaped)) = stat(root) else { return 0.0 };
    let children: Vec<u32> = std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|&pid| parent(pid) == Some(root))
                .collect()
        })
        .unwrap_or_default();
    own + reaped + of(&children)
}

/// One part of a measured system.
pub(crate) enum Part {
    /// Processes counted by themselves (a service, a nats-server).
    Processes(Vec<u32>),
    /// A postmaster and its backends.
    Postgres(u32),
}

impl Part {
    pub(crate) fn turnlog(procs: &[&TurnlogProcess]) -> Part {
        Part::Processes(procs.iter().map(|p| p.pid()).collect())
    }

    pub(crate) fn nats(nats: &PrivateNats) -> Part {
        Part::Processes(vec![nats.pid()])
    }

    pub(crate) fn postgres(pg: &PrivatePostgres) -> Part {
        Part::Postgres(pg.pid())
    }

    fn seconds(&self) -> f64 {
        match self {
            Part::Processes(pids) => of(pids),
            Part::Postgres(root) => tree(*root),
        }
    }
}

/// The postmaster of the server `pool` is connected to (on this machine): the parent of
/// one of its backends. A shared server's tree counts whatever else it runs meanwhile.
pub(crate) async fn postmaster(pool: &sqlx::PgPool) -> anyhow::Result<u32> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(pool).await?;
    let backend = u32::try_from(backend)?;
    parent(backend)
        .ok_or_else(|| anyhow::anyhow!("Postgres backend {backend} is not a process of this machine"))
}

/// Named parts whose CPU a run is charged with.
pub(crate) struct Meter {
    parts: Vec<(&'static str, Part)>,
}

/// CPU seconds of each part over a run, in the meter's order.
pub(crate) struct Spent {
    pub(crate) parts: Vec<(&'static str, f64)>,
}

impl Spent {
    pub(crate) fn total(&self) -> f64 {
        self.parts.iter().map(|(_, s)| s).sum()
    }

    /// `name=<seconds × scale / units>` for each part, with `prefix`: the RESULT line's split.
    pub(crate) fn split(&self, prefix: &str, scale: f64, units: f64) -> String {
        self.parts
            .iter()
            .map(|(name, s)| format!("{prefix}_{name}={:.2}", s * scale / units))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `name a, name b, …` in the same units, for the printed line.
    pub(crate) fn describe(&self, scale: f64, units: f64, unit: &str) -> String {
        self.parts
            .iter()
            .map(|(name, s)| format!("{name} {:.2} {unit}", s * scale / units))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Meter {
    pub(crate) fn new(parts: Vec<(&'static str, Part)>) -> Meter {
        Meter { parts }
    }

    fn sample(&self) -> Vec<f64> {
        self.parts.iter().map(|(_, p)| p.seconds()).collect()
    }

    /// Runs `work` and returns its output with the CPU each part spent meanwhile.
    pub(crate) async fn measure<T>(&self, work: impl std::future::Future<Output = T>) -> (T, Spent) {
        let before = self.sample();
        let out = work.await;
        let after = self.sample();
        let parts =
            self.parts.iter().zip(before.iter().zip(after)).map(|((n, _), (b, a))| (*n, a - b)).collect();
        (out, Spent { parts })
    }
}

/// With [`turnlog_testkit::STATEMENTS_VAR`] set, where a private Postgres spends its time:
/// `pg_stat_statements` reset by [`statements_reset`] before a run and listed after it by
/// [`statements_top`] (the statements of every database of the server, by total time),
/// with how many of the run's updates of session rows were HOT (this database's table
/// statistics, reset with them).
pub(crate) async fn statements_reset(pool: &sqlx::PgPool) {
    if std::env::var_os(turnlog_testkit::STATEMENTS_VAR).is_some() {
        let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(pool).await;
        let _ = sqlx::query("SELECT pg_stat_statements_reset()").execute(pool).await;
        let _ = sqlx::query("SELECT pg_stat_reset()").execute(pool).await;
    }
}

/// See [`statements_reset`]: the `n` statements that took longest in all (running and
/// planning), per `units`.
pub(crate) async fn statements_top(pool: &sqlx::PgPool, n: i64, units: f64, unit: &str) {
    if std::env::var_os(turnlog_testkit::STATEMENTS_VAR).is_none() {
        return;
    }
    let rows: Result<Vec<(f64, f64, i64, String)>, _> = sqlx::query_as(
        // A long statement's start and end: the reads over a branch share their start.
        "SELECT total_exec_time, total_plan_time, calls,
                CASE WHEN length(q) > 160 THEN left(q, 50) || ' … ' || right(q, 110) ELSE q END
           FROM (SELECT *, regexp_replace(query, '\\s+', ' ', 'g') AS q FROM pg_stat_statements) s
          ORDER BY total_exec_time + total_plan_time DESC LIMIT $1",
    )
    .bind(n)
    .fetch_all(pool)
    .await;
    match rows {
        Ok(rows) => {
            println!("  {:>12} {:>12} {:>7}", format!("run µs{unit}"), format!("plan µs{unit}"), "calls");
            for (run, plan, calls, query) in rows {
                println!("  {:>12.1} {:>12.1} {calls:>7}  {query}", run * 1e3 / units, plan * 1e3 / units);
            }
        }
        Err(e) => println!("  pg_stat_statements unreadable: {e}"),
    }
    // Backends report their table statistics within about a second of going idle.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let updates: Result<(i64, i64), _> =
        sqlx::query_as("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'sessions'")
            .fetch_one(pool)
            .await;
    match updates {
        Ok((all, hot)) => println!(
            "  session row updates: {:.2}{unit}, HOT {:.2}{unit} ({:.0}%)",
            all as f64 / units,
            hot as f64 / units,
            100.0 * hot as f64 / (all.max(1) as f64)
        ),
        Err(e) => println!("  table statistics unreadable: {e}"),
    }
}
