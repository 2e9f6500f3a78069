//! The shape the distiller and memory extraction share: a durable consumer of committed
//! `assistant_turn`s whose handler skips a turn already handled (its event id is derived
//! from the turn), reads the turn's material, asks the mini model for a JSON answer and
//! appends what it made of it through the writer. Each worker keeps only its prompt, its
//! validation and the event it builds ([`TurnTask`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sqlx::PgPool;
use turnlog_core::events::EventKind;
use turnlog_core::ids::EventId;
use turnlog_core::message::{ChatMessage, Role};
use turnlog_core::turn::TurnMaterial;
use uuid::Uuid;

use crate::bus::{append_and_wait, AppendRequest, Bus, CommittedEvent, Outcome};
use crate::read::{recorded_outcome, turn_events};
use crate::settings::Backbone;
use crate::upstream::{ask_for_json, ChatRequest, JsonAnswerError, UpstreamClient, UpstreamConfig};
use crate::worker::{ConsumerSettings, Delivery, HandleError, Handler, Origin, Worker, WorkerStats};

/// Most events of one turn read for its material (tool-heavy turns have many).
const MAX_TURN_EVENTS: i64 = 2_000;

/// The config of a worker on finished turns (the distiller's, memory extraction's).
#[derive(Debug, Clone)]
pub struct TurnWorkerConfig {
    pub backbone: Backbone,
    pub upstream: UpstreamConfig,
    /// `TURNLOG_MINI_MODEL`.
    pub mini_model: String,
    pub consumer: ConsumerSettings,
    /// Deadline of one model call (a JSON answer's retry included).
    pub call_deadline: Duration,
    /// How long an append waits for the writer's outcome.
    pub append_timeout: Duration,
}

/// What one worker does with a finished turn, on the connections [`TurnWorker`] holds.
/// Deliveries are at least once: a task must be idempotent (deterministic event ids).
pub trait TurnTask: Send + Sync + 'static {
    fn handle(
        &self,
        worker: &TurnWorker,
        turn: CommittedEvent,
        delivery: Delivery,
    ) -> impl Future<Output = Result<(), HandleError>> + Send;
}

/// What every turn task reaches: the log (read-only), the bus, the mini model.
pub struct TurnWorker {
    pub pool: PgPool,
    pub bus: Bus,
    pub upstream: UpstreamClient,
    /// The mini model.
    pub model: String,
    pub call_deadline: Duration,
    pub append_timeout: Duration,
}

impl TurnWorker {
    /// Whether the writer has recorded an outcome for `request_id` already.
    pub async fn already_applied(&self, request_id: Uuid) -> Result<bool, HandleError> {
        let outcome = recorded_outcome(&self.pool, request_id)
            .await
            .map_err(|e| HandleError::retry("read_failed", e))?;
        Ok(outcome.is_some())
    }

    /// The turn's material; None when the turn is no longer stored.
    pub async fn material(&self, turn: &CommittedEvent) -> Result<Option<TurnMaterial>, HandleError> {
        let events = turn_events(&self.pool, turn.session_id, turn.seq, MAX_TURN_EVENTS)
            .await
            .map_err(|e| HandleError::retry("read_failed", e))?;
        Ok(TurnMaterial::from_events(&events, turn.seq))
    }

    /// The material of a turn still to `task` (the verb a log line says): None when the
    /// event `event_id` is applied already (a redelivered turn costs no model call), or
    /// when the turn is no longer stored.
    pub async fn material_to(
        &self,
        turn: &CommittedEvent,
        event_id: EventId,
        task: &str,
    ) -> Result<Option<TurnMaterial>, HandleError> {
        if self.already_applied(event_id.0).await? {
            return Ok(None);
        }
        let material = self.material(turn).await?;
        if material.is_none() {
            tracing::info!("turn no longer stored (session deleted); nothing to {task}");
        }
        Ok(material)
    }

    /// The mini model's JSON answer to `prompt` about the turn, checked by `validate`.
    pub async fn ask_json<T, F, E>(
        &self,
        prompt: &str,
        material: &TurnMaterial,
        validate: F,
    ) -> Result<T, JsonAnswerError>
    where
        T: serde::de::DeserializeOwned,
        F: Fn(T) -> Result<T, E>,
        E: std::fmt::Display,
    {
        let request = ChatRequest {
            model: self.model.clone(),
            messages: vec![
                ChatMessage::text(Role::System, prompt),
                ChatMessage::text(Role::User, material.render()),
            ],
            max_tokens: Some(1_500),
            temperature: Some(0.0),
            response_format_json: true,
            ..ChatRequest::default()
        };
        ask_for_json(&self.upstream, request, self.call_deadline, validate).await
    }

    /// Appends through the writer and waits for its outcome.
    pub async fn append(&self, request: &AppendRequest) -> Result<Outcome, HandleError> {
        append_and_wait(&self.bus, &self.pool, request, self.append_timeout)
            .await
            .map_err(|e| HandleError::retry("append_failed", e))
    }
}

struct OnTurns<T> {
    worker: TurnWorker,
    task: T,
}

impl<T: TurnTask> Handler for OnTurns<T> {
    async fn handle(&self, turn: CommittedEvent, delivery: Delivery) -> Result<(), HandleError> {
        // A step that asks for tools is not its turn's end (DESIGN §14): the turn's answer
        // comes later, and is what these workers act on.
        if turnlog_core::events::payload_asks_for_tools(&turn.payload) {
            return Ok(());
        }
        self.task.handle(&self.worker, turn, delivery).await
    }
}

/// Runs `task` on every committed `assistant_turn` of `origin` until `shutdown`, on the
/// durable consumer `name` every copy shares; logs `started` once it runs.
pub async fn run<T: TurnTask>(
    name: &str,
    origin: Origin,
    started: &str,
    config: TurnWorkerConfig,
    task: T,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let connections = u32::try_from(config.consumer.concurrency).unwrap_or(u32::MAX).saturating_add(2);
    let pool = config.backbone.connect_reads(connections).await.context("connecting to Postgres")?;
    crate::telemetry::registry().ready_while_postgres_answers(name, pool.clone());
    let bus = config.backbone.connect_bus().await?;
    let upstream = UpstreamClient::new(config.upstream.clone()).context("building the model client")?;
    let worker = TurnWorker {
        pool,
        bus: bus.clone(),
        upstream,
        model: config.mini_model.clone(),
        call_deadline: config.call_deadline,
        append_timeout: config.append_timeout,
    };
    let consumer = Worker::new(name, &[EventKind::AssistantTurn], config.consumer).origin(origin);
    tracing::info!(consumer = %consumer.consumer_name(&bus), model = %config.mini_model, "{started}");
    consumer.run(bus, Arc::new(OnTurns { worker, task }), Arc::new(WorkerStats::default()), shutdown).await;
    Ok(())
}
