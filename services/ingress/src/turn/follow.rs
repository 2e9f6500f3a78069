//! Following a turn: one this copy runs, from any event on; one another copy runs (its
//! snapshot, then its live subject); or, for a resent request whose turn is over, its
//! `meta` and its `end` read from the log (DESIGN §5, §7).

use std::collections::VecDeque;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::StreamExt;
use turnlog_core::events::EventKind;
use turnlog_core::ids::SessionId;
use turnlog_core::stream::{turn_end_from_log, Meta, TurnEnd};
use turnlog_runtime::read;

use super::{remote_stream, ActiveTurn, StreamEvent, TurnEvent};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::{AppState, Ingress};

/// Events of a local turn with an id above `after`, live until its `end`.
pub fn follow_local(turn: Arc<ActiveTurn>, after: u64) -> BoxStream<'static, StreamEvent> {
    let watch = turn.watch();
    let state = (turn, after, watch, VecDeque::<Arc<StreamEvent>>::new(), false);
    futures::stream::unfold(state, |(turn, mut last, mut watch, mut queue, ended)| async move {
        loop {
            if let Some(e) = queue.pop_front() {
                last = e.id;
                let is_end = e.is_end();
                return Some(((*e).clone(), (turn, last, watch, queue, is_end)));
            }
            if ended {
                return None;
            }
            // Read before the events: an ended turn with nothing after `last` has nothing
            // more for a follower already past its end (a Last-Event-ID beyond it).
            let over = turn.is_over();
            queue.extend(turn.events_after(last));
            if queue.is_empty() && over {
                return None;
            }
            if queue.is_empty() && watch.changed().await.is_err() {
                queue.extend(turn.events_after(last));
                if queue.is_empty() {
                    return None;
                }
            }
        }
    })
    .boxed()
}

/// Re-attach: the events after `after` of the session's turn in flight, on this copy or
/// another, live until its `end`; None when no turn is in flight (or it is over with
/// nothing after `after`).
pub async fn attach(
    app: &AppState,
    session: SessionId,
    after: u64,
) -> Option<BoxStream<'static, StreamEvent>> {
    if let Some(turn) = app.turns.get(session) {
        if turn.is_over() && turn.events_after(after).is_empty() {
            return None;
        }
        return Some(follow_local(turn, after));
    }
    remote_stream(app, session, after).await.map(StreamExt::boxed)
}

/// A resent request (same `Idempotency-Key`): its turn's events if it still runs, else its
/// outcome from the log.
pub(super) async fn resent_events(
    app: &AppState,
    caller: &Caller,
    session: SessionId,
    user_seq: i64,
) -> Result<BoxStream<'static, StreamEvent>, ApiError> {
    let is_ours = |first: Option<&StreamEvent>| {
        first.is_some_and(|e| matches!(&e.event, TurnEvent::Meta(m) if m.user_seq == Some(user_seq)))
    };
    if let Some(turn) = app.turns.get(session) {
        if is_ours(turn.events_after(0).first().map(|e| e.as_ref())) {
            return Ok(follow_local(turn, 0));
        }
    }
    if let Some(events) = remote_stream(app, session, 0).await {
        let mut events = events.boxed().peekable();
        if is_ours(std::pin::Pin::new(&mut events).peek().await) {
            return Ok(events.boxed());
        }
    }
    let end = outcome_from_log(app, caller, session, user_seq).await?;
    let meta = Meta { session_id: Some(session), user_seq: Some(user_seq), ..Default::default() };
    let events = vec![
        StreamEvent { id: 1, event: TurnEvent::Meta(meta) },
        StreamEvent { id: 2, event: TurnEvent::End(end) },
    ];
    Ok(futures::stream::iter(events).boxed())
}

/// How the turn after `user_seq` ended, read from the log (for a resent request).
async fn outcome_from_log(
    app: &Ingress,
    caller: &Caller,
    session: SessionId,
    user_seq: i64,
) -> Result<TurnEnd, ApiError> {
    let rows = read::events_page(&app.pool, caller.owner(), session, user_seq, 10_000)
        .await?
        .ok_or_else(ApiError::session_not_found)?;
    // The turn's own events (to the next user message), those this build can read.
    let events: Vec<_> = rows
        .iter()
        .take_while(|r| r.kind != EventKind::UserMessage)
        .filter_map(|r| r.decode().ok())
        .collect();
    Ok(turn_end_from_log(session, &events))
}
