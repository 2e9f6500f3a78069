//! turnlog-core: what every turnlog service shares — the event model, the two projections
//! of a session's log (what the model sees, what the user sees), compaction planning,
//! token budgeting and request assembly. Pure logic here has no I/O and no clock.

pub mod budget;
pub mod bus;
pub mod compaction;
pub mod config;
pub mod db;
pub mod events;
pub mod ids;
pub mod lease;
pub mod llm_context;
pub mod log_builder;
pub mod message;
pub mod read;
pub mod request;
pub mod tokens;
pub mod ui_transcript;
pub mod upstream;
pub mod worker;

pub use events::{Event, EventBody, EventKind};
pub use ids::{EventId, Owner, SessionId};
pub use llm_context::{llm_context, ProjectedMessage};
pub use message::{ChatMessage, Content, ContentPart, Role};
pub use ui_transcript::{ui_transcript, TranscriptItem};
