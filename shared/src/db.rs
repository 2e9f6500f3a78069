//! The one way to reach Postgres: a pool builder and the migrations. Every service reads
//! through this; only the writer writes.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// A pool for `url` with bounded waits, so a dead database surfaces as an error instead
/// of a hang.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("turnlog"))
        .await
}

/// Applies pending migrations. Safe when several processes start at once: sqlx holds a
/// Postgres advisory lock while it migrates.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
