//! turnlog-core: the pure heart of turnlog — the event model, the two projections of a
//! session's log (what the model sees, what the user sees), compaction planning, token
//! budgeting, request assembly, the request body and its audit, and a finished turn's
//! material. No I/O and no async runtime; the projections, planning and budget are
//! functions of their arguments (only new ids read the clock: `SessionId::new`,
//! `EventId::new` are time-ordered v7 UUIDs).

// Module order: a module uses only modules before it, so the graph has no cycles.
//   ids, message → request_body → events (with the recorded request they carry) →
//   llm_context, ui_transcript, turn, storable, branch, log_builder → tokens → request →
//   audit, budget, compaction, import.
pub mod audit;
pub mod branch;
pub mod budget;
pub mod compaction;
pub mod events;
pub mod ids;
pub mod import;
pub mod limits;
pub mod llm_context;
pub mod log_builder;
pub mod message;
pub mod request;
pub mod request_body;
pub mod storable;
pub mod stream;
pub mod tokens;
pub mod turn;
pub mod ui_transcript;

pub use events::{Event, EventBody, EventKind};
pub use ids::{EventId, Owner, SessionId};
pub use llm_context::{llm_context, ProjectedMessage};
pub use message::{ChatMessage, Content, ContentPart, Role};
pub use ui_transcript::{ui_transcript, TranscriptItem};
