//! Where a response is, and where a new one runs (DESIGN §13): a response id names an
//! attempt, found on this copy, in the log, or on the copy running it; a new response runs
//! in its conversation, after its previous response (forked there when that is not its
//! conversation's latest answer, §10), or in a new conversation.

use futures::stream::BoxStream;
use futures::StreamExt as _;
use turnlog_core::events::EventKind;
use turnlog_core::ids::{AttemptId, SessionId};
use turnlog_core::stream::{StreamEvent, TurnEvent};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, StoredEvent};

use super::request::CreateResponse;
use crate::auth::Caller;
use crate::openai::{parse_conversation, parse_response, OaiError};
use crate::sessions::{fork_request, owned_session};
use crate::turn::{follow_local, remote_attempt, remote_stream};
use crate::AppState;

/// The session the response runs in, and the `create` to submit first when it is new: the
/// named conversation; the conversation of `previous_response_id`, forked after it when
/// it is not that conversation's latest answer (DESIGN §10); or a new conversation.
pub async fn target(
    app: &AppState,
    caller: &Caller,
    req: &CreateResponse,
) -> Result<(SessionId, Option<AppendRequest>), OaiError> {
    if let Some(id) = req.conversation_id() {
        let id = parse_conversation(id)?;
        owned_session(app, caller, id).await.map_err(|_| OaiError::not_found("conversation"))?;
        return Ok((id, None));
    }
    if let Some(previous) = &req.previous_response_id {
        let attempt = parse_response(previous)?;
        let event = read::attempt_event(&app.pool, caller.owner(), &attempt)
            .await?
            .ok_or_else(|| OaiError::not_found("previous response"))?;
        let session = SessionId(event.session_id);
        let row = owned_session(app, caller, session)
            .await
            .map_err(|_| OaiError::not_found("previous response"))?;
        let later = read::last_user_message(&app.pool, caller.owner(), session).await?;
        if later.is_some_and(|(user_seq, _, _)| user_seq > event.seq) {
            let create = fork_request(app, caller, &row, event.seq, None, "response").await?;
            return Ok((create.session_id, Some(create)));
        }
        return Ok((session, None));
    }
    let id = SessionId::new();
    Ok((id, Some(AppendRequest::create(id, caller.owner(), None))))
}

/// Where a response is: running (on this copy or another), with its session and its native
/// events from the first; or stored, by its attempt's newest event.
pub enum Located {
    Running(SessionId, BoxStream<'static, StreamEvent>),
    Stored(StoredEvent),
}

/// Finds the caller's response of attempt `attempt` (DESIGN §13): this copy's running
/// turns; the log, when it holds the attempt's outcome; another copy running it (asked on
/// its attempt subject); else the log's latest checkpoint (a copy that died mid-answer).
pub async fn locate(app: &AppState, caller: &Caller, attempt: &AttemptId) -> Result<Located, OaiError> {
    let not_found = || OaiError::not_found("response");
    if let Some(turn) = app.turns.by_attempt(attempt) {
        owned_session(app, caller, turn.session).await.map_err(|_| not_found())?;
        return Ok(Located::Running(turn.session, follow_local(turn, 0)));
    }
    let stored = read::attempt_event(&app.pool, caller.owner(), attempt).await?;
    if stored.as_ref().is_some_and(is_outcome) {
        return Ok(Located::Stored(stored.ok_or_else(not_found)?));
    }
    if let Some(session) = remote_attempt(app, attempt).await {
        owned_session(app, caller, session).await.map_err(|_| not_found())?;
        if let Some(events) = remote_stream(app, session, 0).await {
            let mut events = events.boxed().peekable();
            let first = std::pin::Pin::new(&mut events).peek().await;
            let ours = |e: &StreamEvent| matches!(&e.event, TurnEvent::Meta(m) if m.attempt_id.as_ref() == Some(attempt));
            if first.is_some_and(ours) {
                return Ok(Located::Running(session, events.boxed()));
            }
        }
    }
    stored.map(Located::Stored).ok_or_else(not_found)
}

/// Whether an attempt's event is its outcome (a checkpoint is not).
fn is_outcome(event: &StoredEvent) -> bool {
    event.kind != EventKind::PendingState || event.payload.get("reason").is_some_and(|r| !r.is_null())
}
