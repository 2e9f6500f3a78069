//! Appending (DESIGN §6 "append_and_wait"): publishing a request to TURNLOG_APPEND and
//! waiting for the writer's outcome, asking JetStream whether the request was stored only
//! when the outcome is late; or publishing until JetStream acknowledges it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::HeaderMap;
use bytes::Bytes;
use sqlx::PgPool;

use turnlog_core::ids::SessionId;

use super::{js_err, AppendOp, AppendRequest, Bus, BusError, REPLY_HEADER};
use crate::outcome::{purge_pending, recorded_outcome, Outcome, OutcomeStatus, Refusal};

impl Bus {
    /// Publishes a request to TURNLOG_APPEND and waits for JetStream's PubAck.
    pub async fn publish_append(
        &self,
        req: &AppendRequest,
        reply_to: Option<&str>,
    ) -> Result<jetstream::publish::PublishAck, BusError> {
        let body = serde_json::to_vec(req).map_err(js_err)?;
        self.publish_append_raw(req.session_id, &req.request_id.to_string(), Bytes::from(body), reply_to)
            .await
    }

    /// Publishes already-serialized request bytes (also how poison is injected in tests).
    pub async fn publish_append_raw(
        &self,
        session: SessionId,
        msg_id: &str,
        body: Bytes,
        reply_to: Option<&str>,
    ) -> Result<jetstream::publish::PublishAck, BusError> {
        let subject = self.names.append_subject(self.partition_of(session), session);
        let traceparent = crate::trace::current_traceparent();
        let msg = append_message(body, msg_id, reply_to, traceparent.as_deref());
        let ack = self.js.send_publish(subject, msg).await.map_err(js_err)?;
        ack.await.map_err(js_err)
    }

    /// Publishes an append request until it is acknowledged or `deadline` passes: while
    /// JetStream elects a new stream leader (4–9 s after a node dies) a publish finds no
    /// responder, and the same `Nats-Msg-Id` sent again is stored once (DESIGN §6).
    async fn publish_append_until(
        &self,
        req: &AppendRequest,
        reply_to: Option<&str>,
        deadline: tokio::time::Instant,
    ) -> Result<jetstream::publish::PublishAck, Unacknowledged> {
        let body = Bytes::from(serde_json::to_vec(req).map_err(Unacknowledged::Encode)?);
        let subject = self.names.append_subject(self.partition_of(req.session_id), req.session_id);
        let msg_id = req.request_id.to_string();
        let traceparent = crate::trace::current_traceparent();
        let mut republished = 0;
        loop {
            let msg = append_message(body.clone(), &msg_id, reply_to, traceparent.as_deref());
            let publish = async {
                let ack = self.js.send_publish(subject.clone(), msg).await?;
                ack.await
            };
            let error = match tokio::time::timeout_at(deadline, publish).await {
                Ok(Ok(ack)) => {
                    if republished > 0 {
                        tracing::info!(request_id = %req.request_id, republished, "append acknowledged after republishing");
                    }
                    return Ok(ack);
                }
                Ok(Err(e)) if is_transient(e.kind()) => Unacknowledged::Publish(e),
                Ok(Err(e)) => return Err(Unacknowledged::Publish(e)),
                Err(_) => Unacknowledged::NoAck,
            };
            if tokio::time::Instant::now() + REPUBLISH_EVERY >= deadline {
                return Err(error);
            }
            if republished == 0 {
                tracing::warn!(request_id = %req.request_id, %error, "append not acknowledged; republishing until the deadline");
            }
            republished += 1;
            tokio::time::sleep(REPUBLISH_EVERY).await;
        }
    }
}

/// An append request as published with a PubAck: its body and [`append_headers`].
pub fn append_message(
    body: Bytes,
    msg_id: &str,
    reply_to: Option<&str>,
    traceparent: Option<&str>,
) -> PublishMessage {
    PublishMessage::build().payload(body).headers(append_headers(msg_id, reply_to, traceparent))
}

/// An append request's headers: its id for JetStream's dedup (`Nats-Msg-Id`), where the
/// writer replies, and the producer's trace context.
pub fn append_headers(msg_id: &str, reply_to: Option<&str>, traceparent: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    if let Some(r) = reply_to {
        headers.insert(REPLY_HEADER, r);
    }
    if let Some(t) = traceparent {
        headers.insert(crate::trace::TRACEPARENT, t);
    }
    headers
}

/// Why an append was not acknowledged by its deadline.
#[derive(Debug, thiserror::Error)]
enum Unacknowledged {
    #[error("{0}")]
    Encode(serde_json::Error),
    /// The last publish failed (only a failure that does not pass by itself ends it early).
    #[error("{0}")]
    Publish(jetstream::context::PublishError),
    #[error("no PubAck before the deadline")]
    NoAck,
}

/// How often a producer republishes an unacknowledged append.
const REPUBLISH_EVERY: Duration = Duration::from_millis(250);

/// How long `append_and_wait` waits for the outcome of a request it published without a
/// PubAck before it asks JetStream (at most half its timeout): longer than a busy writer's
/// outcome takes, short against a leader election (4–9 s).
pub const CONFIRM_AFTER: Duration = Duration::from_millis(500);

/// Appends of this process whose outcome had not come after [`CONFIRM_AFTER`], so they
/// were published again with a PubAck (`turnlog_append_confirms_total`).
static CONFIRMED: AtomicU64 = AtomicU64::new(0);

/// How many appends of this process had no outcome after [`CONFIRM_AFTER`] and were
/// published again with a PubAck, so far.
pub fn appends_confirmed() -> u64 {
    CONFIRMED.load(Ordering::Relaxed)
}

/// Exports `turnlog_append_confirms_total`: a writer that is behind, lost publishes, or
/// repeats (each answered [`CONFIRM_AFTER`] late).
pub(super) fn export_metrics() {
    crate::telemetry::registry().export("appends", |out| {
        let name = "turnlog_append_confirms_total";
        crate::telemetry::family(
            out,
            name,
            "counter",
            "Appends whose outcome was late and that were published again with a PubAck",
        );
        crate::telemetry::sample(out, name, &[], appends_confirmed() as f64);
    });
}

/// How often `append_and_wait` looks the outcome up in `request_outcomes` once JetStream
/// said the request was stored before: first at once, then after 25 ms, doubling to 400 ms
/// (a writer that is behind is not polled forty times a second by every waiting producer).
const LOOK_UP_FIRST: Duration = Duration::from_millis(25);
const LOOK_UP_MOST: Duration = Duration::from_millis(400);

/// Publish failures that pass by themselves: no responder (async-nats's "stream not found":
/// a leader election, or nats-server restarting), a lost connection, a late PubAck, and
/// errors the server puts in the PubAck (such as a stream without a quorum).
fn is_transient(kind: jetstream::context::PublishErrorKind) -> bool {
    use jetstream::context::PublishErrorKind as K;
    matches!(kind, K::StreamNotFound | K::TimedOut | K::BrokenPipe | K::Other)
}

#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// NATS (or the writer behind it) could not take the request in time; retrying with
    /// the same request id is safe.
    #[error("the bus could not take the request: {0}")]
    Unavailable(String),
    /// Published, but no outcome arrived before the deadline; resending the same request
    /// id is always safe.
    #[error("outcome unknown after {0:?}")]
    OutcomeUnknown(Duration),
}

/// Appends through the writer and waits for the outcome (DESIGN §6). The request goes out
/// as a plain NATS message with the reply header: the stream stores it, and the writer's
/// outcome says so, so no PubAck is asked for. When no outcome has come after
/// [`CONFIRM_AFTER`] (a writer that is behind, a publish lost with no stream leader, or a
/// repeat, which JetStream drops silently), the same request is published again with a
/// PubAck, until acknowledged or the deadline: stored now, wait for the outcome; a
/// duplicate, look the outcome up in `request_outcomes` (while still listening) until found
/// or the deadline passes.
pub async fn append_and_wait(
    bus: &Bus,
    pool: &PgPool,
    req: &AppendRequest,
    timeout: Duration,
) -> Result<Outcome, AppendError> {
    let started = tokio::time::Instant::now();
    let deadline = started + timeout;
    let mut reply = bus.replies.wait();
    let (inbox, replies) = (reply.subject.clone(), &mut reply.rx);

    let body = Bytes::from(serde_json::to_vec(req).map_err(|e| AppendError::Unavailable(e.to_string()))?);
    let subject = bus.names.append_subject(bus.partition_of(req.session_id), req.session_id);
    let headers = append_headers(
        &req.request_id.to_string(),
        Some(&inbox),
        crate::trace::current_traceparent().as_deref(),
    );
    // A failed send (the connection is gone) is the confirming publish's to find out.
    if bus.client.publish_with_headers(subject, headers, body).await.is_ok() {
        let confirm_at = started + CONFIRM_AFTER.min(timeout / 2);
        if let Some(outcome) = outcome_on(replies, req, confirm_at).await {
            return Ok(outcome);
        }
    }
    CONFIRMED.fetch_add(1, Ordering::Relaxed);

    let ack = bus
        .publish_append_until(req, Some(&inbox), deadline)
        .await
        .map_err(|e| AppendError::Unavailable(format!("not acknowledged within {timeout:?}: {e}")))?;
    if !ack.duplicate {
        // Stored only now: the first publish was lost (or could not be sent).
        if let Some(outcome) = outcome_on(replies, req, deadline).await {
            return Ok(outcome);
        }
    }
    // Stored before: by this call (the writer is behind, and its reply may still come
    // here), or by an earlier sender, whose reply went there. The database knows — unless
    // the request's session was deleted since ([`Refusal::SessionDeleted`]).
    let mut wait = LOOK_UP_FIRST;
    loop {
        match recorded_outcome(pool, req.request_id).await {
            // A delete is answered once its session's messages are gone (as the writer's
            // reply is), so that nothing of the session is left behind it.
            Ok(Some(outcome)) if req.op == AppendOp::Delete => {
                if let Ok(false) = purge_pending(pool, req.session_id).await {
                    return Ok(outcome);
                }
            }
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) if removed_from_stream(bus, ack.sequence).await => {
                return Ok(Outcome {
                    request_id: req.request_id,
                    status: OutcomeStatus::Rejected,
                    seq: None,
                    reason: Some(Refusal::SessionDeleted),
                });
            }
            Ok(None) | Err(_) => {}
        }
        let next = (tokio::time::Instant::now() + wait).min(deadline);
        if let Some(outcome) = outcome_on(replies, req, next).await {
            return Ok(outcome);
        }
        if next >= deadline {
            return Err(AppendError::OutcomeUnknown(timeout));
        }
        wait = (wait * 2).min(LOOK_UP_MOST);
    }
}

/// The writer's outcome for `req` on the inbox, if it comes before `until` (a delete's is
/// sent only after its purge, so it is taken as it comes). Returns at `until` even when
/// the inbox has closed, so a caller's look-ups keep their pace.
async fn outcome_on(
    replies: &mut tokio::sync::mpsc::Receiver<async_nats::Message>,
    req: &AppendRequest,
    until: tokio::time::Instant,
) -> Option<Outcome> {
    loop {
        match tokio::time::timeout_at(until, replies.recv()).await {
            Ok(Some(msg)) => match serde_json::from_slice::<Outcome>(&msg.payload) {
                Ok(outcome) if outcome.request_id == req.request_id => return Some(outcome),
                _ => {}
            },
            Ok(None) => {
                tokio::time::sleep_until(until).await;
                return None;
            }
            Err(_) => return None,
        }
    }
}

/// Whether TURNLOG_APPEND message `seq` is gone. Only a deleted session's purge removes
/// messages while they can still be resent (the stream keeps every message at least as long
/// as its duplicate window), and it removes only messages already applied.
async fn removed_from_stream(bus: &Bus, seq: u64) -> bool {
    let Ok(stream) = bus.js.get_stream_no_info(bus.names.append_stream()).await else { return false };
    matches!(stream.get_raw_message(seq).await, Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound)
}
