//! The Chat Completions layer (DESIGN §13): chat front ends that resend their whole
//! conversation every time get durable sessions by sending a session header. `request`
//! reads what a client sends; `turn` finds the branch of the header's family the request
//! continues and what is new ([`crate::openai::branches`]) and runs the turn there (the
//! model gets turnlog's context, not the client's array); `answer` folds the turn into
//! chunks or a completion. Without a session header the request is passed through
//! ([`crate::passthrough`]) and nothing is stored.

pub mod answer;
pub mod request;
pub mod turn;

use axum::body::Bytes;
use axum::response::Response;

use crate::auth::Caller;
use crate::openai::OaiError;
use crate::{passthrough, AppState};

pub use answer::{chunks, completion};
pub use request::{conversation, options, session_header, CompletionRequest, Conversation, Image};
pub use turn::{reconcile, run, Family, Reconciled, Target, Turn};

/// A request that stores nothing: the client's own body to the gateway (with the default
/// model when it names none), within the caps, its answer back as it came.
pub async fn pass_through(
    app: &AppState,
    caller: &Caller,
    body: Bytes,
    without_model: bool,
) -> Result<Response, OaiError> {
    let slot = passthrough::slot(app, caller)?;
    let upstream = passthrough::gateway(app)?;
    Ok(passthrough::forward(app, &upstream, body, without_model, slot).await?)
}
