//! Server tools inside a turn (DESIGN §14): the catalogue the tools worker publishes,
//! offered beside the client's tools; and the permission chain a step's server calls go
//! through once the step is stored — `allow` sends the call to the tools worker, `deny`
//! records it denied, `ask` raises a `permission_request` and waits for the answer (up to
//! `TURNLOG_PERMISSION_WAIT`, then the turn pauses). The turn goes on when every server call
//! has its result; it pauses when client calls (or unanswered prompts) remain.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use turnlog_core::events::{Event, EventBody, PendingReason, PermissionRequest, ToolCall, ToolExecution};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::stream::{waiting_calls, PermissionEvent, Required, ToolResultEvent, TurnEvent};
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read;
use turnlog_runtime::tools::{namespaced, CatalogTool, Policy, ServerCatalog, ToolCallRequest, SEPARATOR};

use super::{remote, ActiveTurn, ServerTools, ToolOffer};
use crate::idempotency::derived;
use crate::writes::submit;
use crate::Ingress;

/// How long the catalogue read from the bus is used before it is read again.
const CATALOG_FRESH: Duration = Duration::from_secs(1);
/// Beyond a call's deadline, how long the turn waits for the worker's word before it
/// records the call as `timeout` itself (a worker that is down, or a call never picked up).
const DEADLINE_GRACE: Duration = Duration::from_secs(10);
/// How often a waiting turn reads its log again even when no event woke it.
const RECHECK_EVERY: Duration = Duration::from_secs(2);
/// Most events of the current turn read at once.
const CURRENT_TURN_EVENTS: i64 = 20_000;

/// The servers' tools as last read from the bus.
#[derive(Default)]
pub struct Catalog(Mutex<Option<(Instant, Arc<Vec<ServerCatalog>>)>>);

impl Catalog {
    /// The catalogue entries that serve `owner` (empty when no tools worker published any).
    pub async fn for_owner(&self, app: &Ingress, owner: &Owner) -> Vec<ServerCatalog> {
        let cached = self.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let all = match cached {
            Some((at, all)) if at.elapsed() < CATALOG_FRESH => all,
            _ => match app.tools.catalog().await {
                Ok(all) => {
                    let all = Arc::new(all);
                    *self.0.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some((Instant::now(), Arc::clone(&all)));
                    all
                }
                Err(e) => {
                    tracing::warn!(error = %e, "tool catalogue unreadable; offering no server tools");
                    cached.map(|(_, all)| all).unwrap_or_default()
                }
            },
        };
        all.iter().filter(|s| s.serves(owner)).cloned().collect()
    }
}

/// A server tool found by its namespaced name.
fn find<'a>(catalog: &'a [ServerCatalog], name: &str) -> Option<(&'a ServerCatalog, &'a CatalogTool)> {
    let (label, tool) = name.split_once(SEPARATOR)?;
    let server = catalog.iter().find(|s| s.label == label)?;
    Some((server, server.tools.iter().find(|t| t.name == tool)?))
}

/// The catalogue's part a turn offers: every entry, or the named servers with the tools
/// each allows.
pub fn offered(catalog: &[ServerCatalog], which: &ServerTools) -> Vec<ServerCatalog> {
    match which {
        ServerTools::All => catalog.to_vec(),
        ServerTools::Named(named) => named
            .iter()
            .filter_map(|n| {
                let mut entry = catalog.iter().find(|s| s.label == n.label)?.clone();
                if let Some(allowed) = &n.allowed_tools {
                    entry.tools.retain(|t| allowed.contains(&t.name));
                }
                Some(entry)
            })
            .collect(),
    }
}

/// The names the model may call that are server tools: the catalogue's tools among `offer`'s.
pub(super) fn server_names(offer: Option<&ToolOffer>, catalog: &[ServerCatalog]) -> HashSet<String> {
    let Some(offer) = offer else { return HashSet::new() };
    let Ok(tools) = serde_json::from_str::<Vec<serde_json::Value>>(&offer.tools) else {
        return HashSet::new();
    };
    tools
        .iter()
        .filter_map(|t| t.pointer("/function/name").and_then(serde_json::Value::as_str))
        .filter(|n| find(catalog, n).is_some())
        .map(str::to_owned)
        .collect()
}

/// Most tools a turn offers in all, and most bytes the servers' may add to a request.
const MAX_OFFERED_TOOLS: usize = 128;
const MAX_SERVER_TOOLS_BYTES: usize = 128 * 1024;

/// `offer` with the servers' tools after the client's (whose text is kept byte for byte),
/// as many as fit [`MAX_OFFERED_TOOLS`] and [`MAX_SERVER_TOOLS_BYTES`] (the rest left out,
/// and logged); None when neither has any.
pub(super) fn with_server_tools(offer: Option<ToolOffer>, catalog: &[ServerCatalog]) -> Option<ToolOffer> {
    let client_tools = offer
        .as_ref()
        .and_then(|o| serde_json::from_str::<Vec<serde_json::Value>>(&o.tools).ok())
        .map_or(0, |t| t.len());
    let mut bytes = 0;
    let mut tools: Vec<String> = Vec::new();
    for (s, t) in catalog.iter().flat_map(|s| s.tools.iter().map(move |t| (s, t))) {
        let mut function =
            serde_json::json!({"name": namespaced(&s.label, &t.name), "parameters": t.input_schema});
        if let Some(d) = &t.description {
            function["description"] = d.as_str().into();
        }
        let text = serde_json::json!({"type": "function", "function": function}).to_string();
        bytes += text.len();
        if client_tools + tools.len() >= MAX_OFFERED_TOOLS || bytes > MAX_SERVER_TOOLS_BYTES {
            tracing::warn!(server = %s.label, tool = %t.name, "server tool not offered: the turn's tools are full");
            continue;
        }
        tools.push(text);
    }
    if tools.is_empty() {
        return offer;
    }
    let mut offer = offer.unwrap_or_else(|| ToolOffer { tools: "[]".into(), ..Default::default() });
    let client = offer.tools.trim_end();
    let client = client.strip_suffix(']').unwrap_or(client);
    let comma = if client.trim_end().ends_with('[') { "" } else { "," };
    offer.tools = format!("{client}{comma}{}]", tools.join(","));
    Some(offer)
}

/// Refuses a client tool named like a server tool the turn offers: the name must say who runs it.
pub async fn check_client_names(
    app: &Ingress,
    owner: &Owner,
    offer: Option<&ToolOffer>,
) -> Result<(), crate::ApiError> {
    if offer.is_none() {
        return Ok(());
    }
    let catalog = app.catalog.for_owner(app, owner).await;
    if let Some(name) = server_names(offer, &catalog).into_iter().next() {
        return Err(crate::ApiError::bad_request(format!(
            "tools: {name} is the name of a server tool (<label>__<tool>); name client tools otherwise"
        )));
    }
    Ok(())
}

/// A permission request's answer as the log holds it: the first one decides.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub seq: i64,
    pub decision: String,
    /// The call the request is for.
    pub call_id: Option<String>,
}

/// Records `decision` (`allow`, `allow_always`, `deny`) for permission request `perm_id`
/// of session `id`, unless it is answered already. The resolution's event id is derived
/// from the request's seq, so concurrent or repeated answers collapse into one event; the
/// first in the log decides, and a different later decision is a 409. An unknown session
/// or request is a 404.
pub async fn resolve_permission(
    app: &Ingress,
    caller: &crate::auth::Caller,
    id: SessionId,
    perm_id: &str,
    decision: &str,
) -> Result<Resolved, crate::ApiError> {
    use crate::ApiError;
    let status = || async {
        read::permission_status(&app.pool, caller.owner(), id, perm_id)
            .await?
            .ok_or_else(ApiError::session_not_found)
    };
    let found = status().await?;
    let request_seq =
        found.request_seq.ok_or_else(|| ApiError::NotFound("permission request not found".into()))?;
    if found.resolution.is_none() {
        let event = EventBody::PermissionResolved(turnlog_core::events::PermissionResolved {
            id: perm_id.to_owned(),
            decision: decision.to_owned(),
        });
        let event_id = turnlog_core::ids::EventId::derived(
            id,
            request_seq,
            turnlog_core::events::EventKind::PermissionResolved.as_str(),
        );
        submit(app, &AppendRequest::append(id, caller.owner(), event_id.0, &event)).await?;
    }
    // Whoever resolved first (this request, a retry of it, or a racing one) decided.
    let (seq, decided) = status()
        .await?
        .resolution
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("resolution committed but not in the log")))?;
    if decided != decision {
        return Err(ApiError::Conflict(format!("permission request already resolved: {decided}")));
    }
    Ok(Resolved { seq, decision: decided, call_id: found.call_id })
}

/// How waiting for a step's server calls ended.
pub(super) enum Settled {
    /// Every call of the step has its result: the next step runs.
    Ready,
    /// Client calls or unanswered prompts remain: the turn pauses for them.
    Paused(Vec<Required>),
    /// The turn was stopped (by its user: running calls are recorded `cancelled`), or
    /// interrupted by a shutdown.
    Stopped,
    /// The log could not be read or written.
    Failed(String),
}

/// The id of a call's `permission_request` event, and the request's `id`.
fn permission_ids(owner: &Owner, session: SessionId, call_id: &str) -> (uuid::Uuid, String) {
    let event_id = derived(owner, &format!("permission {session}"), call_id);
    (event_id, format!("perm_{}", event_id.simple()))
}

/// The event id of a call's result (the same for a client's result, the worker's, or the
/// turn's own record of a denial, a timeout or a cancellation).
pub fn result_event_id(owner: &Owner, session: SessionId, call_id: &str) -> uuid::Uuid {
    derived(owner, &format!("tool result {session}"), call_id)
}

/// What one waiting turn keeps between its reads of the log.
struct Waiting {
    /// Calls sent to the worker, with the moment past which the turn records them itself.
    dispatched: HashMap<String, (uuid::Uuid, Instant)>,
    /// Results the stream has told.
    told: HashSet<String>,
    /// Prompts the stream has told.
    raised: HashSet<String>,
}

/// Runs the server calls of the turn's latest step through the permission chain and waits
/// for their results, telling the stream each prompt and result. Returns when the step
/// has every result, or the turn must pause or stop.
pub(super) async fn settle(
    app: &Arc<Ingress>,
    turn: &Arc<ActiveTurn>,
    owner: &Owner,
    permission_wait: Duration,
) -> Settled {
    let session = turn.session;
    // Woken by the writer's publishes of this session's events (every kind, stored or not:
    // DESIGN §6); a re-read every few seconds covers a missed message.
    let mut feed =
        match app.bus.client.subscribe(format!("{}.events.*.{session}", app.bus.names.prefix())).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow the session's events; reading the log instead");
                None
            }
        };
    let permission_deadline = Instant::now() + permission_wait;
    let mut w = Waiting { dispatched: HashMap::new(), told: HashSet::new(), raised: HashSet::new() };
    let mut first = true;
    loop {
        let events = match read::current_turn(&app.pool, owner, session, CURRENT_TURN_EVENTS).await {
            Ok(Some(events)) => events,
            Ok(None) => return Settled::Failed("the session is gone".into()),
            Err(e) => return Settled::Failed(format!("the session's log could not be read: {e}")),
        };
        // Results recorded before this wait began were told by whoever recorded them.
        for e in &events {
            if let EventBody::ToolExecution(x) = &e.body {
                if w.told.insert(x.call_id.clone()) && !first {
                    let told = ToolResultEvent {
                        call_id: x.call_id.clone(),
                        status: x.status.clone(),
                        digest: x.result_digest.clone(),
                    };
                    emit(app, turn, TurnEvent::ToolResult(told)).await;
                }
            }
        }
        first = false;
        let waiting = waiting_calls(&events);
        if waiting.is_empty() {
            return Settled::Ready;
        }
        let step_sources = sources(&events);
        let catalog = app.catalog.for_owner(app, owner).await;
        let always = match read::always_allowed(&app.pool, owner, session).await {
            Ok(a) => a,
            Err(e) => return Settled::Failed(format!("the session's permissions could not be read: {e}")),
        };
        let mut paused = Vec::new();
        let mut asking = false;
        for call in &waiting {
            if !is_server(&step_sources, &call.id) {
                paused.push(Required::tool(call));
                continue;
            }
            if w.dispatched.contains_key(&call.id) {
                continue;
            }
            let outcome = match find(&catalog, &call.name) {
                None => Some(("error", format!("the server tool {} is not available now", call.name))),
                Some((_, tool)) => {
                    let (perm_event, perm_id) = permission_ids(owner, session, &call.id);
                    let decided = decision(&events, &perm_id);
                    let allowed = tool.policy == Policy::Allow
                        || always.contains(&call.name)
                        || matches!(decided, Some("allow" | "allow_always"));
                    if tool.policy == Policy::Deny {
                        Some(("denied", "denied: the operator's policy does not allow this tool".to_owned()))
                    } else if allowed {
                        if let Err(e) = dispatch(app, owner, session, call, &mut w).await {
                            return Settled::Failed(e);
                        }
                        None
                    } else if decided == Some("deny") {
                        Some(("denied", "denied by the user".to_owned()))
                    } else {
                        // Ask: raise the prompt once (its event id is the call's), then wait.
                        let requested = events
                            .iter()
                            .any(|e| matches!(&e.body, EventBody::PermissionRequest(p) if p.id == perm_id));
                        let args: serde_json::Value =
                            serde_json::from_str(&call.arguments).unwrap_or_default();
                        if !requested {
                            let body = EventBody::PermissionRequest(PermissionRequest {
                                id: perm_id.clone(),
                                call_id: call.id.clone(),
                                tool: call.name.clone(),
                                args: args.clone(),
                                danger_level: tool.danger_level.as_str().into(),
                                rationale: rationale(&events),
                            });
                            if let Err(e) =
                                submit(app, &AppendRequest::append(session, owner, perm_event, &body)).await
                            {
                                return Settled::Failed(format!(
                                    "the permission request could not be stored: {e}"
                                ));
                            }
                        }
                        if w.raised.insert(call.id.clone()) {
                            let p = PermissionEvent {
                                id: perm_id.clone(),
                                call_id: call.id.clone(),
                                tool: call.name.clone(),
                                args,
                                danger_level: tool.danger_level.as_str().into(),
                            };
                            emit(app, turn, TurnEvent::Permission(p)).await;
                        }
                        asking = true;
                        paused.push(Required::permission(call, &perm_id));
                        None
                    }
                }
            };
            if let Some((status, output)) = outcome {
                if let Err(e) = record(app, owner, session, call, status, &output).await {
                    return Settled::Failed(e);
                }
            }
        }
        // Calls the worker has not answered past their deadline (and its grace) are the turn's to record.
        let now = Instant::now();
        for call in &waiting {
            if let Some((_, at)) = w.dispatched.get(&call.id) {
                if now >= *at {
                    let output =
                        format!("the tool did not answer within {} s", app.config.tool_timeout.as_secs());
                    if let Err(e) = record(app, owner, session, call, "timeout", &output).await {
                        return Settled::Failed(e);
                    }
                }
            }
        }
        let running = waiting.iter().any(|c| w.dispatched.get(&c.id).is_some_and(|(_, at)| now < *at));
        if !running && !paused.is_empty() && (!asking || now >= permission_deadline) {
            return Settled::Paused(paused);
        }
        let wake = async {
            match feed.as_mut() {
                Some(f) => {
                    let _ = tokio::time::timeout(RECHECK_EVERY, f.next()).await;
                }
                None => tokio::time::sleep(RECHECK_EVERY).await,
            }
        };
        let until_permission = permission_deadline.saturating_duration_since(now);
        tokio::select! {
            () = wake => {}
            () = tokio::time::sleep(until_permission), if asking => {}
            () = turn.stop.cancelled() => {
                // A shutdown leaves the calls to the worker, which records them.
                if turn.stop_reason() == PendingReason::Interrupted {
                    return Settled::Stopped;
                }
                return stopped(app, owner, session, &waiting, &w).await;
            }
        }
    }
}

/// On a stop: the calls the worker runs are cancelled (MCP cancellation) and recorded
/// `cancelled`; a prompt not answered stays, for a new message to cancel.
async fn stopped(
    app: &Ingress,
    owner: &Owner,
    session: SessionId,
    waiting: &[ToolCall],
    w: &Waiting,
) -> Settled {
    for call in waiting {
        if let Some((event_id, _)) = w.dispatched.get(&call.id) {
            app.tools.cancel(*event_id).await;
            if let Err(e) =
                record(app, owner, session, call, "cancelled", "cancelled: the turn was stopped").await
            {
                tracing::warn!(error = %e, "a stopped call's cancellation was not recorded");
            }
        }
    }
    Settled::Stopped
}

async fn emit(app: &Arc<Ingress>, turn: &Arc<ActiveTurn>, event: TurnEvent) {
    if let Some(e) = turn.emit(event) {
        remote::publish_live(app, turn.session, &e).await;
    }
}

/// Each call's `source` in the turn's steps, by call id (from its `tool_call` block).
pub fn sources(events: &[Event]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for e in events {
        if let EventBody::AssistantTurn(t) = &e.body {
            for b in &t.ui.blocks {
                let Some(meta) = &b.meta else { continue };
                let field = |k: &str| meta.get(k).and_then(serde_json::Value::as_str).map(str::to_owned);
                if let (Some(id), Some(source)) = (field("call_id"), field("source")) {
                    out.insert(id, source);
                }
            }
        }
    }
    out
}

/// Whether call `id` is a server tool's (by its `source`).
pub fn is_server(sources: &HashMap<String, String>, id: &str) -> bool {
    sources.get(id).is_some_and(|s| s.starts_with("mcp:"))
}

/// The first answer to permission request `perm_id` in the turn (the first decides).
fn decision<'a>(events: &'a [Event], perm_id: &str) -> Option<&'a str> {
    events.iter().find_map(|e| match &e.body {
        EventBody::PermissionResolved(r) if r.id == perm_id => Some(r.decision.as_str()),
        _ => None,
    })
}

/// What the model said in the step that asks, shown with its prompt (at most 500 characters).
fn rationale(events: &[Event]) -> String {
    events
        .iter()
        .rev()
        .find_map(|e| match &e.body {
            EventBody::AssistantTurn(t) if t.asks_for_tools() => {
                Some(t.ui.blocks.iter().filter_map(|b| b.text.clone()).collect::<Vec<_>>().join(" "))
            }
            _ => None,
        })
        .map(|t| t.chars().take(500).collect())
        .unwrap_or_default()
}

/// Sends an allowed call to the tools worker, once per wait.
async fn dispatch(
    app: &Ingress,
    owner: &Owner,
    session: SessionId,
    call: &ToolCall,
    w: &mut Waiting,
) -> Result<(), String> {
    let Some((label, tool)) = call.name.split_once(SEPARATOR) else {
        return Err(format!("{} is not a server tool's name", call.name));
    };
    let event_id = result_event_id(owner, session, &call.id);
    let timeout = app.config.tool_timeout;
    let request = ToolCallRequest {
        session_id: session,
        owner: owner.clone(),
        call_id: call.id.clone(),
        label: label.to_owned(),
        tool: tool.to_owned(),
        arguments: call.arguments.clone(),
        event_id,
        deadline: chrono::Utc::now() + timeout,
    };
    app.tools
        .dispatch(&request)
        .await
        .map_err(|e| format!("the call could not be sent to the tools worker: {e}"))?;
    w.dispatched.insert(call.id.clone(), (event_id, Instant::now() + timeout + DEADLINE_GRACE));
    Ok(())
}

/// Records a server call's result the turn decides itself (denied, timed out, cancelled,
/// unavailable), with the id the worker's would have: the first record stands.
async fn record(
    app: &Ingress,
    owner: &Owner,
    session: SessionId,
    call: &ToolCall,
    status: &str,
    output: &str,
) -> Result<(), String> {
    let source = call.name.split_once(SEPARATOR).map(|(label, _)| format!("mcp:{label}"));
    let body = EventBody::ToolExecution(ToolExecution {
        call_id: call.id.clone(),
        name: call.name.clone(),
        source,
        args: serde_json::from_str(&call.arguments).ok(),
        output: Some(output.to_owned()),
        is_error: Some(true),
        result_digest: Some(output.chars().take(120).collect()),
        status: status.into(),
        duration_ms: None,
    });
    let req = AppendRequest::append(session, owner, result_event_id(owner, session, &call.id), &body);
    submit(app, &req).await.map(|_| ()).map_err(|e| format!("a tool's result could not be stored: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnlog_runtime::tools::DangerLevel;

    fn catalog() -> Vec<ServerCatalog> {
        vec![ServerCatalog {
            label: "fs".into(),
            owners: None,
            tools: vec![CatalogTool {
                name: "write_file".into(),
                description: Some("Write a file".into()),
                input_schema: serde_json::json!({"type": "object"}),
                policy: Policy::Ask,
                danger_level: DangerLevel::High,
            }],
            up: true,
            updated_at: chrono::Utc::now(),
        }]
    }

    #[test]
    fn server_tools_follow_the_clients_byte_for_byte() {
        let client = r#"[ {"type":"function","function":{"name":"weather"}} ]"#;
        let offer = ToolOffer {
            tools: client.into(),
            tool_choice: Some("\"auto\"".into()),
            parallel_tool_calls: None,
        };
        let merged = with_server_tools(Some(offer), &catalog()).unwrap();
        assert!(
            merged.tools.starts_with(r#"[ {"type":"function","function":{"name":"weather"}} ,{"#),
            "{}",
            merged.tools
        );
        let list: Vec<serde_json::Value> = serde_json::from_str(&merged.tools).unwrap();
        assert_eq!(list[1]["function"]["name"], "fs__write_file");
        assert_eq!(merged.tool_choice.as_deref(), Some("\"auto\""));
        assert_eq!(server_names(Some(&merged), &catalog()), HashSet::from(["fs__write_file".to_owned()]));
        // Only the server's, and nothing at all.
        let only = with_server_tools(None, &catalog()).unwrap();
        assert_eq!(serde_json::from_str::<Vec<serde_json::Value>>(&only.tools).unwrap().len(), 1);
        assert!(with_server_tools(None, &[]).is_none());
    }

    #[test]
    fn a_turn_offers_at_most_128_tools_however_many_the_servers_have() {
        let mut many = catalog();
        let tool = many[0].tools[0].clone();
        many[0].tools = (0..300).map(|i| CatalogTool { name: format!("t{i}"), ..tool.clone() }).collect();
        let client = ToolOffer {
            tools: r#"[{"type":"function","function":{"name":"w"}}]"#.into(),
            ..Default::default()
        };
        let merged = with_server_tools(Some(client), &many).unwrap();
        let list: Vec<serde_json::Value> = serde_json::from_str(&merged.tools).unwrap();
        assert_eq!(list.len(), MAX_OFFERED_TOOLS);
        assert_eq!(list[0]["function"]["name"], "w");
    }
}
