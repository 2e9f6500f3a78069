//! turnlog's operator tools, over history kept in JetStream (DESIGN.md §6): `replay` runs a
//! worker again over past committed events, `rebuild` applies TURNLOG_APPEND into an empty
//! database with the writer's own code, `verify` compares two databases, and `dead`
//! inspects and redrives dead letters, `import` / `export` bring conversations in and take
//! them out. Each prints what an operator reads and returns it.

pub mod dead;
mod progress;
mod rebuild;
mod replay;
pub mod transfer;
mod verify;

pub use rebuild::rebuild;
pub use replay::{parse_since, replay, ReplaySummary, SinceError};
pub use turnlog_runtime::worker::{Replay, ReplayFrom};
pub use turnlog_writer::RebuildSummary;
pub use verify::{verify, Verdict};
