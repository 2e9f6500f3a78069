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

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// A pool for `url` with bounded waits, so a dead database surfaces as an error instead
/// of a hang.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("turnlog").options(SESSION_SETTINGS))
        .await
}

/// A single connection whose statements are planned once, for any parameters (generic
/// plans): for statements whose plan cannot depend on them, such as the writer's commit of
/// arrays (planning it afresh took 3 ms of a 37 ms batch of 500). JIT is off as in the pool.
pub async fn connect_generic_plans(url: &str, application_name: &str) -> Result<PgConnection, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let options = options
        .application_name(application_name)
        .options([("jit", "off"), ("plan_cache_mode", "force_generic_plan")]);
    PgConnection::connect_with(&options).await
}

/// Applies pending migrations. Safe when several processes start at once: sqlx holds a
/// Postgres advisory lock while it migrates.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
