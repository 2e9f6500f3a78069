//! turnlog-runtime: what every turnlog service does over the network and the database —
//! the bus contract and `append_and_wait`, turn leases, the Postgres pool and the read-side
//! queries, the upstream model client, the worker consumer loop, and the settings every
//! service shares. The pure logic it serves lives in `turnlog-core`.

pub mod budget;
pub mod bus;
pub mod db;
pub mod export;
pub mod files;
pub mod import;
pub mod lease;
mod outcome;
pub mod read;
mod secret;
pub mod settings;
pub mod telemetry;
pub mod tools;
pub mod trace;
pub mod turn_worker;
pub mod upstream;
pub mod worker;
