//! A turn seen from other ingress copies, over core NATS: every event goes out on
//! `live.<session>`; the copy running the turn answers `turn.<session>` with the events so
//! far (in pieces under 512 KiB), `control.<session>` stop requests, and
//! `attempt.<attempt id>` with its session (how a response is found by its id alone). A
//! follower subscribes to `live` first, then asks for the snapshot, so no event falls in
//! between.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use turnlog_core::events::PendingReason;
use turnlog_core::ids::{AttemptId, SessionId};

use super::{ActiveTurn, StreamEvent};
use crate::Ingress;

/// Snapshot pieces stay under NATS's 1 MiB default payload with room to spare.
const PIECE_BYTES: usize = 512 * 1024;
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// A follower whose turn went quiet this long checks whether the turn still exists.
const QUIET_CHECK: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize)]
struct SnapshotRequest {
    after: u64,
}

#[derive(Serialize, Deserialize)]
struct SnapshotPiece {
    events: Vec<StreamEvent>,
    last: bool,
    /// On the last piece: the turn has emitted its `end` (absent from older copies).
    #[serde(default)]
    over: bool,
}

#[derive(Serialize, Deserialize)]
struct Control {
    op: String,
}

/// Sends a turn event to followers on other copies (best effort: they resync by snapshot).
pub(super) async fn publish_live(app: &Ingress, session: SessionId, e: &StreamEvent) {
    if let Ok(body) = serde_json::to_vec(e) {
        let _ = app.bus.client.publish(app.bus.names.live_subject(session), body.into()).await;
    }
}

/// Answers snapshot and stop requests for `turn` while it runs.
pub(super) async fn serve(app: &Arc<Ingress>, turn: &Arc<ActiveTurn>) -> Option<tokio::task::JoinHandle<()>> {
    let names = &app.bus.names;
    let client = app.bus.client.clone();
    let mut snapshots = client.subscribe(names.turn_subject(turn.session)).await.ok()?;
    let mut controls = client.subscribe(names.control_subject(turn.session)).await.ok()?;
    let mut attempts = client.subscribe(names.attempt_subject(&turn.attempt_id)).await.ok()?;
    let turn = Arc::clone(turn);
    Some(tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(msg) = controls.next() => {
                    let op = serde_json::from_slice::<Control>(&msg.payload).map(|c| c.op).unwrap_or_default();
                    if op == "stop" {
                        turn.stop(PendingReason::Stopped);
                    }
                    if let Some(reply) = msg.reply {
                        let _ = client.publish(reply, serde_json::json!({"ok": op == "stop"}).to_string().into()).await;
                    }
                }
                Some(msg) = attempts.next() => {
                    if let Some(reply) = msg.reply {
                        let _ = client.publish(reply, serde_json::json!({"session_id": turn.session}).to_string().into()).await;
                    }
                }
                Some(msg) = snapshots.next() => {
                    let Some(reply) = msg.reply else { continue };
                    let after = serde_json::from_slice::<SnapshotRequest>(&msg.payload).map_or(0, |r| r.after);
                    // Read before the events, so `over` never hides an `end` they lack.
                    let over = turn.is_over();
                    for piece in pieces(turn.followed_after(after), over) {
                        if let Ok(body) = serde_json::to_vec(&piece) {
                            let _ = client.publish(reply.clone(), body.into()).await;
                        }
                    }
                }
                else => return,
            }
        }
    }))
}

/// Splits events into snapshot pieces under [`PIECE_BYTES`]; the last one says so, and
/// whether the turn is `over`.
fn pieces(events: Vec<Arc<StreamEvent>>, over: bool) -> Vec<SnapshotPiece> {
    let piece = || SnapshotPiece { events: Vec::new(), last: false, over: false };
    let mut out = vec![piece()];
    let mut size = 0;
    for e in events {
        let len = e.event.data().to_string().len() + 64;
        if size + len > PIECE_BYTES && !out.last().is_none_or(|p| p.events.is_empty()) {
            out.push(piece());
            size = 0;
        }
        size += len;
        if let Some(p) = out.last_mut() {
            p.events.push((*e).clone());
        }
    }
    if let Some(p) = out.last_mut() {
        p.last = true;
        p.over = over;
    }
    out
}

/// The session of attempt `attempt_id` when another copy runs it (None at once when no copy
/// does: NATS answers "no responders").
pub async fn remote_attempt(app: &Ingress, attempt_id: &AttemptId) -> Option<SessionId> {
    let asked = app.bus.client.request(app.bus.names.attempt_subject(attempt_id), "".into());
    let reply = tokio::time::timeout(ASK_TIMEOUT, asked).await.ok()?.ok()?;
    let value: serde_json::Value = serde_json::from_slice(&reply.payload).ok()?;
    value["session_id"].as_str()?.parse().ok()
}

/// Asks whichever copy runs the session's turn to stop it; false when none answers.
pub async fn remote_stop(app: &Ingress, session: SessionId) -> bool {
    let body = serde_json::json!({"op": "stop"}).to_string();
    let asked = app.bus.client.request(app.bus.names.control_subject(session), body.into());
    matches!(tokio::time::timeout(ASK_TIMEOUT, asked).await, Ok(Ok(_)))
}

/// Follows a turn another copy runs, from after event `after`; None when no copy answers
/// for the session (no turn in flight), or its turn is over with nothing after `after`.
pub async fn remote_stream(
    app: &Arc<Ingress>,
    session: SessionId,
    after: u64,
) -> Option<impl Stream<Item = StreamEvent> + Send + 'static> {
    let client = app.bus.client.clone();
    let live = client.subscribe(app.bus.names.live_subject(session)).await.ok()?;
    let (snapshot, over) = snapshot(app, session, after).await?;
    if over && snapshot.is_empty() {
        return None;
    }
    let app = Arc::clone(app);
    let state = Follow { app, session, live, queue: snapshot.into(), last: after, ended: false };
    Some(futures::stream::unfold(state, |mut s| async move {
        let e = s.next().await?;
        Some((e, s))
    }))
}

/// The turn's events after `after`, and whether it is over.
async fn snapshot(app: &Ingress, session: SessionId, after: u64) -> Option<(Vec<StreamEvent>, bool)> {
    let client = &app.bus.client;
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.ok()?;
    let body = serde_json::to_vec(&SnapshotRequest { after }).ok()?;
    client.publish_with_reply(app.bus.names.turn_subject(session), inbox, body.into()).await.ok()?;
    let mut events = Vec::new();
    loop {
        let msg = tokio::time::timeout(ASK_TIMEOUT, replies.next()).await.ok()??;
        let piece: SnapshotPiece = serde_json::from_slice(&msg.payload).ok()?;
        events.extend(piece.events);
        if piece.last {
            return Some((events, piece.over));
        }
    }
}

struct Follow {
    app: Arc<Ingress>,
    session: SessionId,
    live: async_nats::Subscriber,
    queue: std::collections::VecDeque<StreamEvent>,
    last: u64,
    ended: bool,
}

impl Follow {
    async fn next(&mut self) -> Option<StreamEvent> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(e) = self.queue.pop_front() {
                if e.id <= self.last {
                    // An `end` not past `last`: the follower started beyond the turn's end.
                    if e.is_end() {
                        return None;
                    }
                    continue;
                }
                if e.id > self.last + 1 {
                    // Missed some on the live subject: fetch them from the snapshot.
                    let (missed, _) = snapshot(&self.app, self.session, self.last).await?;
                    self.queue = missed.into_iter().chain(std::iter::once(e)).collect();
                    continue;
                }
                self.last = e.id;
                self.ended = e.is_end();
                return Some(e);
            }
            match tokio::time::timeout(QUIET_CHECK, self.live.next()).await {
                Ok(Some(msg)) => {
                    if let Ok(e) = serde_json::from_slice::<StreamEvent>(&msg.payload) {
                        self.queue.push_back(e);
                    }
                }
                Ok(None) => return None,
                // Quiet: is the turn still running anywhere?
                Err(_) => {
                    if !self.app.leases.is_held(self.session).await.unwrap_or(true) {
                        return None;
                    }
                }
            }
        }
    }
}
