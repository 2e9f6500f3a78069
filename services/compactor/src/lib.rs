//! turnlog's compactor: keeps every session's next request within its token budget. It
//! checks after each committed `assistant_turn` and after the turn's late `turn_memory`,
//! on a durable consumer for each, and before each send when the ingress asks on
//! `<prefix>.compact.<session_id>` (one queue group across all copies); it replies once
//! any compaction is committed.

mod compact;
mod locks;
mod metrics;
mod summary;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use turnlog_core::events::EventKind;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{Bus, CommittedEvent};
pub use turnlog_runtime::bus::{CompactReply, CompactRequest, CompactStatus};
use turnlog_runtime::settings::Backbone;
use turnlog_runtime::upstream::{UpstreamClient, UpstreamConfig};
use turnlog_runtime::worker::{ConsumerSettings, Delivery, HandleError, Handler, Worker, WorkerStats};

pub use compact::{compaction_event_id, Checked, CompactError, Compactor, Settings, REFUSALS_PER_HALVING};
pub use summary::{max_summary_tokens, SUMMARY_MARKER_TASK};

#[derive(Debug, Clone)]
pub struct CompactorConfig {
    pub backbone: Backbone,
    pub upstream: UpstreamConfig,
    /// `TURNLOG_MODEL`: sizes the budget when neither the request nor the turn names a model.
    pub model: String,
    /// `TURNLOG_SUMMARY_MODEL`.
    pub summary_model: String,
    /// `TURNLOG_CONTEXT_BUDGET`: the budget when the model's window is unknown.
    pub context_budget: u32,
    pub consumer: ConsumerSettings,
    /// The longest wait for the span's `memory_extracted` events before summarizing.
    pub facts_wait: Duration,
    /// Deadline of one summary call.
    pub summary_deadline: Duration,
    /// How long an append waits for the writer's outcome.
    pub append_timeout: Duration,
    /// `TURNLOG_TOOL_HISTORY`: the ingress's, so both count and plan the same history.
    pub tool_history: turnlog_core::llm_context::ToolHistory,
}

fn failed_reply(error: impl std::fmt::Display) -> CompactReply {
    CompactReply {
        status: CompactStatus::Failed,
        through_seq: None,
        tokens: None,
        budget: None,
        error: Some(error.to_string()),
    }
}

fn reply_from_checked(checked: Checked) -> CompactReply {
    let status = match (checked.compacted_through, checked.within_budget()) {
        (Some(_), _) => CompactStatus::Compacted,
        (None, true) => CompactStatus::NotNeeded,
        (None, false) => CompactStatus::Failed,
    };
    let error =
        (status == CompactStatus::Failed).then(|| "over budget and nothing could be compacted".to_owned());
    CompactReply {
        status,
        through_seq: checked.compacted_through,
        tokens: Some(checked.tokens),
        budget: Some(checked.budget),
        error,
    }
}

/// Runs the post-turn consumer and the pre-send responder until `shutdown`; both finish
/// the checks in hand before returning.
pub async fn run(config: CompactorConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let concurrency = config.consumer.concurrency.max(1);
    // Checks after answers, after residues and before sends run side by side, each with up
    // to `concurrency`.
    let connections = u32::try_from(3 * concurrency).unwrap_or(u32::MAX).saturating_add(2);
    let pool = config.backbone.connect_reads(connections).await.context("connecting to Postgres")?;
    turnlog_runtime::telemetry::registry().ready_while_postgres_answers("compactor", pool.clone());
    let bus = config.backbone.connect_bus().await?;
    let upstream = UpstreamClient::new(config.upstream.clone()).context("building the model client")?;
    turnlog_core::tokens::warm_up();
    crate::metrics::metrics();
    let compactor = Arc::new(Compactor::new(
        pool,
        bus.clone(),
        upstream,
        Settings {
            default_model: config.model.clone(),
            summary_model: config.summary_model.clone(),
            fallback_budget: config.context_budget,
            facts_wait: config.facts_wait,
            summary_deadline: config.summary_deadline,
            tool_history: config.tool_history,
            append_timeout: config.append_timeout,
        },
    ));
    // After each answer, and after its late residue, which can push a session over budget
    // as much as the answer itself can: a durable consumer for each kind (nats-server 2.9
    // filters a consumer by one subject), each with its counters. The residue consumer took
    // over from `compactor`, which took the whole feed before. A replay goes over both.
    let kinds = [EventKind::AssistantTurn, EventKind::TurnMemory];
    let workers = if config.consumer.replay.is_some() {
        vec![Worker::new("compactor", &kinds, config.consumer.clone())]
    } else {
        vec![
            Worker::new("compactor", &kinds[..1], config.consumer.clone()),
            Worker::new("compactor-residue", &kinds[1..], config.consumer.clone()).taking_over("compactor"),
        ]
    };
    let names: Vec<String> = workers.iter().map(|w| w.consumer_name(&bus)).collect();
    tracing::info!(
        consumers = %names.join(", "),
        model = %config.model,
        summary_model = %config.summary_model,
        "compactor running"
    );
    let handler = Arc::new(PostTurn(compactor.clone()));
    let post_turn = futures::future::join_all(workers.iter().map(|w| {
        w.run(
            bus.clone(),
            handler.clone(),
            Arc::new(WorkerStats::default()),
            shutdown.clone().cancelled_owned(),
        )
    }));
    let (_, pre_send) = tokio::join!(post_turn, serve_pre_send(bus, compactor, concurrency, shutdown));
    pre_send
}

struct PostTurn(Arc<Compactor>);

impl Handler for PostTurn {
    async fn handle(&self, event: CommittedEvent, _delivery: Delivery) -> Result<(), HandleError> {
        // An import (issue 25) appends many answers at once: its sessions are compacted by
        // the pre-send check of their next live turn, not once per imported answer. (Its
        // answers have a subject of their own on the feed, which this consumer does not
        // take; an earlier version published them on the live one.)
        if event.is_imported() {
            return Ok(());
        }
        // A step that asks for tools is not the turn's end; the pre-send check runs before
        // every step (DESIGN §14).
        if turnlog_core::events::payload_asks_for_tools(&event.payload) {
            return Ok(());
        }
        // The model that served the turn sizes the budget; a residue names none.
        let model = event.payload.get("model").and_then(|m| m.as_str());
        // The system prompt and extras are not known here; the pre-send check counts them.
        match self.0.ensure_within_budget(event.session_id, &event.owner, model, 0).await {
            Ok(_) | Err(CompactError::NotFound) => Ok(()),
            Err(e @ CompactError::Refused(_)) => {
                tracing::warn!(session_id = %event.session_id, error = %e, "compaction refused by the writer");
                Ok(())
            }
            Err(e @ CompactError::Upstream(_)) => Err(HandleError::retry("compaction_failed", e)),
            Err(e @ CompactError::Append(_)) => Err(HandleError::retry("append_failed", e)),
            Err(e @ CompactError::Read(_)) => Err(HandleError::retry("read_failed", e)),
        }
    }
}

/// Answers pre-send checks on `<prefix>.compact.*` as one queue group with every other
/// copy, so each request is handled once.
async fn serve_pre_send(
    bus: Bus,
    compactor: Arc<Compactor>,
    concurrency: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let subject = format!("{}.compact.*", bus.names.prefix());
    let group = format!("{}-compactor", bus.names.prefix());
    // Core NATS subscriptions are restored by the client after a reconnect.
    let mut requests =
        bus.client.queue_subscribe(subject.clone(), group).await.context("subscribing to pre-send checks")?;
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut in_hand = JoinSet::new();
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = requests.next() => m,
        };
        let Some(message) = message else { break };
        let permit = permits.clone().acquire_owned().await.context("request permits closed")?;
        let (bus, compactor) = (bus.clone(), compactor.clone());
        // The check joins the trace of the turn that asks.
        let span = tracing::info_span!("compactor.pre_send");
        let traceparent = turnlog_runtime::trace::from_headers(message.headers.as_ref());
        turnlog_runtime::trace::follow(&span, traceparent.as_deref());
        let task = async move {
            let reply = answer(&compactor, &message).await;
            if let Some(to) = message.reply {
                match serde_json::to_vec(&reply) {
                    Ok(body) => {
                        if let Err(e) = bus.client.publish(to, body.into()).await {
                            tracing::warn!(error = %e, "could not answer a pre-send check");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "could not encode a pre-send reply"),
                }
            }
            drop(permit);
        };
        in_hand.spawn(task.instrument(span));
        while in_hand.try_join_next().is_some() {}
    }
    // Stop taking requests (the queue group sends them to the other copies), then finish
    // the ones in hand.
    let _ = requests.unsubscribe().await;
    while let Some(done) = in_hand.join_next().await {
        if let Err(e) = done {
            tracing::error!(error = %e, "pre-send check panicked");
        }
    }
    let _ = bus.client.flush().await;
    tracing::info!(%subject, "pre-send checks stopped");
    Ok(())
}

async fn answer(compactor: &Compactor, message: &async_nats::Message) -> CompactReply {
    let request: CompactRequest = match serde_json::from_slice(&message.payload) {
        Ok(r) => r,
        Err(e) => return failed_reply(format!("bad request: {e}")),
    };
    let named = message.subject.rsplit('.').next().and_then(|s| s.parse::<SessionId>().ok());
    if named != Some(request.session_id) {
        return failed_reply("bad request: session_id does not match the subject");
    }
    let checked = compactor
        .ensure_within_budget(
            request.session_id,
            &request.owner,
            request.model.as_deref(),
            request.reserve_tokens,
        )
        .await;
    match checked {
        Ok(checked) => reply_from_checked(checked),
        Err(e) => failed_reply(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_status_follows_what_the_check_did() {
        let checked = |c, tokens| Checked { compacted_through: c, tokens, budget: 100 };
        assert_eq!(reply_from_checked(checked(None, 90)).status, CompactStatus::NotNeeded);
        let r = reply_from_checked(checked(Some(7), 90));
        assert_eq!((r.status, r.through_seq), (CompactStatus::Compacted, Some(7)));
        assert_eq!(reply_from_checked(checked(None, 190)).status, CompactStatus::Failed);
        let wire = serde_json::to_value(reply_from_checked(checked(None, 90))).unwrap();
        assert_eq!(wire, serde_json::json!({"status": "not_needed", "tokens": 90, "budget": 100}));
    }

    #[test]
    fn request_wire_shape() {
        let s = SessionId::new();
        let r: CompactRequest = serde_json::from_value(
            serde_json::json!({"session_id": s, "owner": "alice", "reserve_tokens": 120}),
        )
        .unwrap();
        assert_eq!(
            r,
            CompactRequest {
                session_id: s,
                owner: turnlog_core::ids::Owner::parse("alice").unwrap(),
                model: None,
                reserve_tokens: 120
            }
        );
    }
}
