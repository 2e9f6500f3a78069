//! Server tools on the bus (DESIGN §14): the catalogue the tools worker publishes and the
//! ingress offers, the calls the ingress sends and one copy of the worker runs once, and
//! their cancellation.
//!
//! - The catalogue: a KV bucket `<P>_TOOL_CATALOG`, one entry per configured server (its
//!   label), replaced whenever the server's tools change.
//! - Calls: the work-queue stream `<P>_TOOL_CALLS` (`<p>.tools.call.<session>`), one
//!   durable consumer shared by the worker's copies; a call's message id is the event id its
//!   `tool_execution` gets, so a resend within the dedup window is one message.
//! - Claims: a KV bucket `<P>_TOOL_CLAIMS`, one key per call, created by the copy that
//!   starts it. A call delivered again whose claim exists was cut off by a crash: it is not
//!   run again (at most once).
//! - Cancellation: core NATS `<p>.tools.cancel.<event id>`, heard by the copy running it.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use turnlog_core::ids::{Owner, SessionId};
use uuid::Uuid;

use crate::bus::{Bus, BusError};

/// What a server tool needs before it runs (`TURNLOG_MCP_SERVERS`, per tool; default `ask`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Allow,
    #[default]
    Ask,
    Deny,
}

/// How much harm a tool can do, shown with every prompt for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DangerLevel {
    Low,
    #[default]
    Medium,
    High,
}

impl DangerLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            DangerLevel::Low => "low",
            DangerLevel::Medium => "medium",
            DangerLevel::High => "high",
        }
    }
}

/// One tool of a server, as the model is offered it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogTool {
    /// The server's own name for it.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The server's JSON schema of its arguments.
    pub input_schema: serde_json::Value,
    pub policy: Policy,
    pub danger_level: DangerLevel,
}

/// A configured server's entry in the catalogue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerCatalog {
    pub label: String,
    /// The owners it serves; None: every owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owners: Option<Vec<String>>,
    pub tools: Vec<CatalogTool>,
    /// Whether the worker is connected to it now (its calls fail at once while not).
    pub up: bool,
    pub updated_at: DateTime<Utc>,
}

impl ServerCatalog {
    pub fn serves(&self, owner: &Owner) -> bool {
        self.owners.as_ref().is_none_or(|o| o.iter().any(|x| x == owner.as_str()))
    }
}

/// The name a server tool has everywhere turnlog shows it: `<label>__<tool>`.
pub fn namespaced(label: &str, tool: &str) -> String {
    format!("{label}{SEPARATOR}{tool}")
}

/// Between a server's label and its tool's name.
pub const SEPARATOR: &str = "__";

/// A call the ingress sends to the tools worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRequest {
    pub session_id: SessionId,
    pub owner: Owner,
    /// The model's call id.
    pub call_id: String,
    pub label: String,
    /// The server's name for the tool.
    pub tool: String,
    /// The arguments as the model wrote them (a JSON object's text).
    pub arguments: String,
    /// The id the call's `tool_execution` is appended with (and this message's id).
    pub event_id: Uuid,
    /// Past this the ingress records the call as `timeout` itself; a copy that gets the call
    /// later does not start it.
    pub deadline: DateTime<Utc>,
}

/// The tools' part of the bus (DESIGN §6: the streams are the topology's).
#[derive(Clone)]
pub struct ToolsBus {
    pub bus: Bus,
    catalog: kv::Store,
    claims: kv::Store,
}

impl ToolsBus {
    /// The catalogue's and the claims' buckets (made by [`Bus::ensure_topology`]).
    pub async fn open(bus: &Bus) -> Result<Self, BusError> {
        let err = |e: &dyn std::fmt::Display| BusError::JetStream(e.to_string());
        let catalog = bus.js.get_key_value(bus.names.tool_catalog_bucket()).await.map_err(|e| err(&e))?;
        let claims = bus.js.get_key_value(bus.names.tool_claims_bucket()).await.map_err(|e| err(&e))?;
        Ok(Self { bus: bus.clone(), catalog, claims })
    }

    /// Replaces a server's catalogue entry.
    pub async fn publish_catalog(&self, entry: &ServerCatalog) -> Result<(), BusError> {
        let body = serde_json::to_vec(entry).map_err(|e| BusError::JetStream(e.to_string()))?;
        self.catalog.put(&entry.label, body.into()).await.map_err(|e| BusError::JetStream(e.to_string()))?;
        Ok(())
    }

    /// Every server's current entry.
    pub async fn catalog(&self) -> Result<Vec<ServerCatalog>, BusError> {
        use futures::TryStreamExt as _;
        let err = |e: &dyn std::fmt::Display| BusError::JetStream(e.to_string());
        let keys: Vec<String> = match self.catalog.keys().await {
            Ok(k) => k.try_collect().await.map_err(|e| err(&e))?,
            Err(e) => return Err(err(&e)),
        };
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(v) = self.catalog.get(&key).await.map_err(|e| err(&e))? {
                match serde_json::from_slice::<ServerCatalog>(&v) {
                    Ok(entry) => out.push(entry),
                    Err(e) => tracing::warn!(server = %key, error = %e, "unreadable tool catalogue entry"),
                }
            }
        }
        out.sort_by(|a, b| a.label.cmp(&b.label));
        Ok(out)
    }

    /// Sends a call to the tools worker (acknowledged by JetStream).
    pub async fn dispatch(&self, call: &ToolCallRequest) -> Result<(), BusError> {
        let err = |e: &dyn std::fmt::Display| BusError::JetStream(e.to_string());
        let body = serde_json::to_vec(call).map_err(|e| err(&e))?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, call.event_id.to_string().as_str());
        if let Some(t) = crate::trace::current_traceparent() {
            headers.insert(crate::trace::TRACEPARENT, t.as_str());
        }
        let subject = self.bus.names.tool_call_subject(call.session_id);
        let ack =
            self.bus.js.publish_with_headers(subject, headers, body.into()).await.map_err(|e| err(&e))?;
        ack.await.map_err(|e| err(&e))?;
        Ok(())
    }

    /// Asks the copy running the call to cancel it (nobody may be listening).
    pub async fn cancel(&self, event_id: Uuid) {
        let subject = self.bus.names.tool_cancel_subject(event_id);
        if let Err(e) = self.bus.client.publish(subject, Bytes::new()).await {
            tracing::debug!(error = %e, "tool call cancellation not sent");
        }
    }

    /// Claims a call for `holder`: true for the first claim of it, ever.
    pub async fn claim(&self, event_id: Uuid, holder: &str) -> Result<bool, BusError> {
        match self.claims.create(event_id.to_string(), Bytes::from(holder.to_owned())).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(BusError::JetStream(e.to_string())),
        }
    }

    /// The durable consumer the worker's copies share.
    pub async fn calls_consumer(
        &self,
        ack_wait: Duration,
        max_deliver: i64,
    ) -> Result<jetstream::consumer::PullConsumer, BusError> {
        let err = |e: &dyn std::fmt::Display| BusError::JetStream(e.to_string());
        let stream = self.bus.js.get_stream(self.bus.names.tool_calls_stream()).await.map_err(|e| err(&e))?;
        stream
            .get_or_create_consumer(
                "tools",
                jetstream::consumer::pull::Config {
                    durable_name: Some("tools".into()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait,
                    max_deliver,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| err(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_filter_the_catalogue() {
        let mut entry = ServerCatalog {
            label: "fs".into(),
            owners: None,
            tools: vec![],
            up: true,
            updated_at: Utc::now(),
        };
        assert!(entry.serves(&Owner::parse("alice").unwrap()));
        entry.owners = Some(vec!["bob".into()]);
        assert!(!entry.serves(&Owner::parse("alice").unwrap()));
        assert!(entry.serves(&Owner::parse("bob").unwrap()));
        assert_eq!(namespaced("fs", "write_file"), "fs__write_file");
    }
}
