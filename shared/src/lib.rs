//! turnlog-core: what every turnlog service shares — the event model, the two projections
//! of a session's log (what the model sees, what the user sees), compaction planning,
//! token budgeting and request assembly. Pure logic here has no I/O and no clock.

pub mod events;
pub mod ids;
pub mod message;
pub mod tokens;

pub use events::{Event, EventBody, EventKind};
pub use ids::{EventId, Owner, SessionId};
pub use message::{ChatMessage, Content, ContentPart, Role};
