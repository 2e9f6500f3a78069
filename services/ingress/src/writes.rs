//! The ingress's one way to change anything: an append request to the writer through
//! `append_and_wait`, with the configured deadline. An event too large for the log is a
//! 413 before anything is sent; a bus or writer that cannot answer in time is a 503
//! (resending is safe); a request the writer refused maps to a 4xx.

use std::time::Duration;

use turnlog_runtime::bus::{append_and_wait, AppendOp, AppendRequest, Outcome, Refusal, RequestKind};

use crate::error::ApiError;
use crate::{validate, Ingress};

/// The least a delete waits for its outcome.
const DELETE_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends `req` and waits for the writer's outcome; only an applied request is Ok. In a span
/// of its own where spans are recorded; otherwise in its caller's span and trace context (a
/// span per append is worth its cost only in a trace that can be recorded).
pub async fn submit(app: &Ingress, req: &AppendRequest) -> Result<Outcome, ApiError> {
    if turnlog_runtime::trace::recording() {
        submit_in_span(app, req).await
    } else {
        send(app, req).await
    }
}

#[tracing::instrument(
    name = "submit",
    skip_all,
    fields(op = req.op.name(), session_id = %req.session_id, request_id = %req.request_id),
    err(Display, level = "debug")
)]
async fn submit_in_span(app: &Ingress, req: &AppendRequest) -> Result<Outcome, ApiError> {
    send(app, req).await
}

async fn send(app: &Ingress, req: &AppendRequest) -> Result<Outcome, ApiError> {
    if let AppendOp::Append { kind: RequestKind::Known(kind), payload, .. } = &req.op {
        validate::event(*kind, payload)?;
    }
    // A delete is answered once its session's stream messages are removed, one at a time
    // (DESIGN.md §6): a long session takes longer than an append may.
    let deadline = match req.op {
        AppendOp::Delete => app.config.append_timeout.max(DELETE_TIMEOUT),
        _ => app.config.append_timeout,
    };
    let outcome = append_and_wait(&app.bus, &app.pool, req, deadline).await?;
    if outcome.is_applied() {
        return Ok(outcome);
    }
    let reason = outcome.reason.unwrap_or_else(|| Refusal::Other("rejected".into()));
    tracing::info!(%reason, op = req.op.name(), session_id = %req.session_id, request_id = %req.request_id, "the writer refused the request");
    Err(refusal(&reason))
}

/// A refusal reason (the writer's dead-letter reasons and failed conditions) as the client
/// sees it.
fn refusal(reason: &Refusal) -> ApiError {
    match reason {
        // The session went away (deleted) or is another owner's between the check and the write.
        Refusal::UnknownSession | Refusal::OwnerMismatch => ApiError::session_not_found(),
        // Applied once, then deleted with its session; a resend within the bus's duplicate
        // window is not applied again (`turnlog_runtime::bus::Refusal::SessionDeleted`).
        Refusal::SessionDeleted => ApiError::Conflict(
            "the session this request created or wrote to has been deleted since; send a new request \
             (with a new Idempotency-Key)"
                .into(),
        ),
        Refusal::TooLarge => ApiError::PayloadTooLarge("the event is larger than the log accepts".into()),
        Refusal::UnstorableText => ApiError::bad_request("text must not contain NUL characters"),
        // A fork's checks (DESIGN §10): the route checked them first, so these follow a
        // change of the parent between the check and the write.
        Refusal::BadForkPoint => ApiError::bad_request("through_seq is past the end of the session's log"),
        Refusal::TooDeep => ApiError::bad_request(format!(
            "forks nest at most {} deep: fork an ancestor instead",
            turnlog_core::branch::MAX_FORK_DEPTH
        )),
        // The ingress draws fork ids on the parent's partition: this is its own bug.
        Refusal::WrongPartition => {
            ApiError::internal(anyhow::anyhow!("a fork id was drawn on the wrong partition"))
        }
        Refusal::BadPayload | Refusal::BadRequest => {
            ApiError::bad_request(format!("the log refused the request ({reason})"))
        }
        other => ApiError::Conflict(format!("the log refused the request ({other})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn refusals_are_client_errors() {
        for (reason, status) in [
            (&Refusal::UnknownSession, StatusCode::NOT_FOUND),
            (&Refusal::OwnerMismatch, StatusCode::NOT_FOUND),
            (&Refusal::TooLarge, StatusCode::PAYLOAD_TOO_LARGE),
            (&Refusal::UnstorableText, StatusCode::BAD_REQUEST),
            (&Refusal::ExpectFailed, StatusCode::CONFLICT),
            (&Refusal::SessionExists, StatusCode::CONFLICT),
            (&Refusal::SessionDeleted, StatusCode::CONFLICT),
        ] {
            assert_eq!(refusal(reason).status(), status, "{reason}");
        }
    }
}
