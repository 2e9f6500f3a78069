//! turnlog-local-servers: running Postgres and nats-server of our own on this machine, the
//! one implementation behind `turnlog dev`'s private servers and the testkit's. It holds
//! the mechanics (finding binaries, running Postgres as the `postgres` user when we are
//! root, initdb and pg_ctl, nats-server with JetStream, ports, signals, liveness, a locked
//! record of what runs); where
//! the data lives, which settings and when to start or stop stay with the callers.

mod nats;
mod os;
mod postgres;
mod state;

pub use nats::{nats_server_args, nats_server_bin, NatsServer};
pub use nix::sys::signal::Signal;
pub use os::{
    accepts, append_log, current_uid, find_executable, free_port, is_executable, is_root, port_is_free,
    process_alive, signal, tail_lines, wait_accepting, wait_gone, RunAs,
};
pub use postgres::{
    ensure_database, kill_postmaster, local_url, make_owned_dir, postgres_user, Cluster, PgBins, Postmaster,
};
pub use state::{open_lock_file, read_record, write_record};
