//! The Responses API's layer (DESIGN §13): a response is one turn's attempt. `request`
//! reads what a client sends, `history` reconciles a resent history with the sessions
//! it came from, `locate` finds where a response runs or is stored,
//! `translate` turns a turn's native events (or its outcome in the log) into OpenAI's
//! objects and `response.*` events, and `stream` answers with them.

pub mod history;
pub mod locate;
pub mod request;
pub mod stream;
pub mod translate;

pub use locate::{locate, target, Located};
pub use request::{Approval, CreateResponse, RetrieveParams, StoredInput};
pub use stream::{answer, created_response, last_response, numbered, stored_response};
pub use translate::{replay_finished, Echo, McpList};
