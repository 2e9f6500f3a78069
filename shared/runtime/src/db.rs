//! The one way to reach Postgres: a pool builder, the writer's own connections and the
//! migrations. Every service reads through this; only the writer writes.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, PgPool};

/// Per-connection settings. JIT compiling costs milliseconds per statement, and turnlog's
/// array statements look expensive to the planner while running in well under that. A
/// cached generic plan is chosen while tables are small (a sequential scan) and then kept
/// as they grow, so every statement is planned for its actual parameters.
const SESSION_SETTINGS: [(&str, &str); 2] = [("jit", "off"), ("plan_cache_mode", "force_custom_plan")];

/// Postgres's TCP keepalive for every connection: probe after 3 s of silence, every second,
/// give up after 3 unanswered probes. A process that dies has its kernel close its sockets,
/// but a host that dies or drops off the network says nothing, and with the OS's defaults
/// (the first probe after 2 hours) the server would keep its sessions, and their locks,
/// that long: the writer's partition locks, and the search indexer's, above all.
const KEEPALIVE: [(&str, &str); 3] =
    [("tcp_keepalives_idle", "3"), ("tcp_keepalives_interval", "1"), ("tcp_keepalives_count", "3")];

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// How long a read query may run by default (`TURNLOG_STATEMENT_TIMEOUT`).
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool for `url` with bounded waits, so a dead database surfaces as an error instead
/// of a hang. Its statements run as long as they need: for the writer and the tools.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    pool(max_connections, options.options(SESSION_SETTINGS)).await
}

/// A pool for services that only read (the ingress, the workers): every statement is
/// cancelled by Postgres after `statement_timeout`, so one slow or blocked query cannot
/// hold a connection, and the request waiting on it, indefinitely; and every transaction is
/// read-only, so only the writer can change the log (DESIGN.md §9.6), whatever a bug in a
/// reader tries. Its statements may keep a generic plan (`plan_cache_mode` auto, not
/// `SESSION_SETTINGS`' custom plans): they look rows up by key, where a generic plan is
/// the custom one, and planning them anew each time was over half of Postgres's CPU per
/// turn (docs/benchmarks.md, CPU per turn). Postgres plans them again when ANALYZE changes
/// the tables' statistics.
pub async fn connect_reads(
    url: &str,
    max_connections: u32,
    statement_timeout: Duration,
) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    // Postgres reads a bare number as milliseconds; zero would mean no limit.
    let millis = statement_timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
    let options = options.options(SESSION_SETTINGS).options([
        ("statement_timeout", millis.as_str()),
        ("default_transaction_read_only", "on"),
        ("plan_cache_mode", "auto"),
    ]);
    pool(max_connections, options).await
}

async fn pool(max_connections: u32, options: PgConnectOptions) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.options(KEEPALIVE).application_name("turnlog"))
        .await
}

/// Whether `e` is Postgres cancelling a statement (SQLSTATE 57014): the statement timeout
/// ran out, or an operator cancelled it. Either way the same request may succeed later.
pub fn is_query_canceled(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("57014"))
}

/// A single connection whose statements are planned once, for any parameters (generic
/// plans): for statements whose plan cannot depend on them, such as the writer's commit of
/// arrays (planning it afresh took 3 ms of a 37 ms batch of 500). JIT is off as in the pool.
///
/// The writer holds its partition locks on these connections: with `KEEPALIVE` and
/// `tcp_user_timeout` (6 s of unacknowledged data, for a host lost mid-commit) a lost writer
/// host frees its partitions within about 6 s. (Not on the pools: a reader that stops
/// reading a large result for 6 s would lose its connection.)
pub async fn connect_generic_plans(url: &str, application_name: &str) -> Result<PgConnection, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let options = options
        .application_name(application_name)
        .options([("jit", "off"), ("plan_cache_mode", "force_generic_plan"), ("tcp_user_timeout", "6000")])
        .options(KEEPALIVE);
    PgConnection::connect_with(&options).await
}

/// Applies pending migrations. Safe when several processes start at once: sqlx holds a
/// Postgres advisory lock while it migrates.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
