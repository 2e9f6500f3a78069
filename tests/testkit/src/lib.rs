//! turnlog-testkit: the one test harness every turnlog suite uses. Each test gets a fresh
//! migrated database and its own bus prefix on shared servers (from DATABASE_URL / NATS_URL,
//! or private ones started once per run), plus real child processes and fault-test servers.
//!
//! ```ignore
//! use std::time::Duration;
//! use turnlog_testkit::{eventually, test_env, TurnlogProcess};
//!
//! #[tokio::test]
//! async fn writer_applies_appends() {
//!     let env = test_env().await; // fresh database + bus prefix
//!     let _writer = TurnlogProcess::start(env!("CARGO_BIN_EXE_turnlog"), &env, &["writer"], &[]);
//!     let nats = env.nats().await;
//!     // ... publish to format!("{}.append.0.{id}", env.bus_prefix) ...
//!     let seq: i64 = eventually(Duration::from_secs(10), || async {
//!         sqlx::query_scalar("SELECT max(seq) FROM session_events").fetch_one(&env.pool).await.ok()?
//!     })
//!     .await;
//! }
//! ```
//!
//! Servers: DATABASE_URL (any database on the server to use) and NATS_URL are used when
//! set, each independently; otherwise one private Postgres and one nats-server per user are
//! started by the first test that needs them (state in `/var/tmp/turnlog-testkit-<uid>/`)
//! and reused by every later test process and run. They stay running; stop them and delete
//! their data with [`stop_private_servers`] or
//! `cargo run -p turnlog-testkit --bin turnlog-testkit-stop`.
//!
//! Environments are not dropped when a test ends (a failed test's database stays for
//! inspection); [`TestEnv::cleanup`] removes one at once, and environments older than an
//! hour are swept by later tests. Process logs are under `$TMPDIR/turnlog-testkit-logs-<uid>/`
//! and a failing test prints the tail of each of its processes' logs.

pub mod checker;
mod env;
mod nats;
mod netns;
mod postgres;
mod process;
pub mod prometheus;
mod servers;
pub mod soak;
mod sweep;
mod util;

pub use env::{test_env, test_env_on, try_test_env_on, TestEnv};
pub use nats::{
    private_nats, private_nats_cluster, private_nats_for, PrivateNats, PrivateNatsCluster, CLUSTER_NODES,
};
pub use netns::{test_host, TestHost};
pub use postgres::{private_postgres, private_postgres_for, PrivatePostgres, STATEMENTS_VAR};
pub use process::{ExternalProcess, TurnlogProcess};
pub use servers::{stop_private_servers, STATE_DIR_VAR};
pub use util::{eventually, free_port};
