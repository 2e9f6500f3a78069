//! One batch's commit: load the state it needs, apply it, send its dead letters, commit it
//! with the new position; and what a failed commit calls for (split, once more, or step down).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use sqlx::{PgConnection, PgPool};
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{AppendOp, Bus, Outcome};
use uuid::Uuid;

use crate::apply::{apply_batch, EventRow, Incoming, LoadedState, SessionRow};
use crate::publisher::patiently;
use crate::purger::Purge;
use crate::{metrics, store};

/// Sessions the writer keeps in memory (it is the only one changing them); the cache is
/// dropped whole past this size.
const SESSION_CACHE: usize = 100_000;

/// What a commit leaves to do: replies, feed, position, purge.
pub(crate) struct Committed {
    pub(crate) events: Vec<EventRow>,
    /// Sent as soon as the commit returns; a delete's only after its purge.
    pub(crate) replies: Vec<(String, Outcome)>,
    pub(crate) last_stream_seq: i64,
    /// The removals a committed delete calls for; its replies wait until they are done.
    pub(crate) purges: Vec<Purge>,
}

/// Applies a batch (a delete alone) and commits it with the new position. Earlier outcomes
/// are looked up for the requests that can have one (with a zero `duplicate_window`, all).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn apply_and_commit(
    pool: &PgPool,
    conn: &mut PgConnection,
    bus: &Bus,
    partition: i32,
    applied: i64,
    batch: &[Incoming],
    cache: &mut HashMap<SessionId, SessionRow>,
    duplicate_window: Duration,
) -> anyhow::Result<(usize, Committed)> {
    let mut to_load: Vec<Uuid> = Vec::new();
    let mut requests: Vec<Uuid> = Vec::new();
    let mut state = LoadedState::default();
    // Sessions come from the cache where it has them; earlier outcomes from the database,
    // for requests that can have one.
    for m in batch {
        if let Some(s) = m.subject_session {
            match cache.get(&s) {
                Some(row) => {
                    state.sessions.insert(s, row.clone());
                }
                None => to_load.push(s.0),
            }
        }
        match m.request_id() {
            Some(id) if !m.skips_lookup(duplicate_window) => requests.push(id),
            _ => {}
        }
    }
    to_load.sort_unstable();
    to_load.dedup();
    let t0 = Instant::now();
    let loaded = store::load_state(pool, &to_load, &requests).await?;
    let t_load = t0.elapsed();
    state.sessions.extend(loaded.sessions);
    state.outcomes = loaded.outcomes;
    state.partitions = bus.partitions;
    let (parents, deleted) = fork_parents_and_delete(batch);
    if !parents.is_empty() || deleted.is_some() {
        store::load_family(pool, &mut state, &parents, deleted).await?;
    }
    let fx = apply_batch(batch, &mut state);
    let t_apply = t0.elapsed();

    // Dead letters go out before the commit (deduplicated by stream sequence), so a crash
    // in between cannot lose one.
    for (session, letter) in &fx.dead {
        tracing::warn!(stream_seq = ?letter.stream_seq, reason = %letter.reason, detail = %letter.detail,
            "request dead-lettered");
        metrics::metrics().dead_letter(&letter.reason);
        let subject = bus.names.dead_subject(&letter.reason, *session);
        let msg_id = format!("dead:{}", letter.stream_seq.unwrap_or_default());
        let payload: bytes::Bytes = serde_json::to_vec(letter)?.into();
        patiently("publishing a dead letter", || async {
            let msg = PublishMessage::build().payload(payload.clone()).message_id(msg_id.as_str());
            bus.js.send_publish(subject.clone(), msg).await?.await?;
            Ok(())
        })
        .await?;
    }
    store::commit(conn, partition, applied, &fx).await?;

    tracing::debug!(
        partition,
        requests = fx.consumed,
        load_us = t_load.as_micros() as u64,
        apply_us = (t_apply - t_load).as_micros() as u64,
        write_us = (t0.elapsed() - t_apply).as_micros() as u64,
        "batch committed"
    );
    if cache.len() > SESSION_CACHE {
        cache.clear();
    }
    for row in fx.created.iter().chain(&fx.updated) {
        cache.insert(row.id, row.clone());
    }
    for removal in &fx.removals {
        match &removal.kept {
            Some(row) => cache.insert(removal.session, row.clone()),
            None => cache.remove(&removal.session),
        };
    }
    let committed = Committed {
        events: fx.events,
        replies: fx.replies,
        last_stream_seq: i64::try_from(fx.last_stream_seq)?,
        purges: fx
            .removals
            .iter()
            .map(|r| Purge { session: r.session, through: fx.last_stream_seq })
            .collect(),
    };
    Ok((fx.consumed, committed))
}

/// The parents of the batch's forks, and the session a delete in it names (a delete is
/// the first request of its batch when it is applied).
fn fork_parents_and_delete(batch: &[Incoming]) -> (Vec<Uuid>, Option<SessionId>) {
    let mut parents: Vec<Uuid> = batch
        .iter()
        .filter_map(|m| match m.request()?.op {
            AppendOp::Create { forked_from, .. } => forked_from,
            _ => None,
        })
        .map(|f| f.session_id.0)
        .collect();
    parents.sort_unstable();
    parents.dedup();
    let deleted =
        batch.first().and_then(Incoming::request).filter(|r| r.op == AppendOp::Delete).map(|r| r.session_id);
    (parents, deleted)
}

/// What a failed commit calls for.
#[derive(Debug, PartialEq)]
pub(crate) enum CommitFault {
    /// The batch's data: split it (the database's message).
    Data(String),
    /// Not known yet: the same batch once more.
    Again,
    /// A lost connection, a conflict, a timeout, another writer: step down, try later.
    Transient,
}

/// Data errors ([`data_error`]) and values the driver cannot encode are the data's at
/// once. Connection, resource, conflict, lock, cancellation and system errors (SQLSTATE
/// classes 08, 40, 53, 55, 57, 58) are transient. Any other database error is the data's
/// once the same batch gave it twice in a row (`reproduced` remembers the first).
pub(crate) fn commit_fault(e: &anyhow::Error, reproduced: &mut Option<String>) -> CommitFault {
    let Some(store::StoreError::Sql(sql)) = e.downcast_ref() else { return CommitFault::Transient };
    if let sqlx::Error::Encode(why) = sql {
        return CommitFault::Data(format!("the value cannot be stored: {why}"));
    }
    if let Some(why) = data_error(sql) {
        return CommitFault::Data(why);
    }
    let sqlx::Error::Database(db) = sql else { return CommitFault::Transient };
    let code = db.code().unwrap_or_default().into_owned();
    let why = format!("{} (SQLSTATE {code})", db.message());
    match code.get(..2).unwrap_or_default() {
        "08" | "40" | "53" | "55" | "57" | "58" | "" => CommitFault::Transient,
        _ if reproduced.as_deref() == Some(why.as_str()) => {
            *reproduced = None;
            CommitFault::Data(why)
        }
        _ => {
            *reproduced = Some(why);
            CommitFault::Again
        }
    }
}

/// The database's message when `e` is a data error (SQLSTATE class 22, 23 or 54: a value out
/// of range, a constraint, a program limit such as an index row or a tsvector too long).
pub(crate) fn data_error(e: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = e else { return None };
    let code = db.code().unwrap_or_default();
    matches!(code.get(..2), Some("22" | "23" | "54")).then(|| format!("{} (SQLSTATE {code})", db.message()))
}

pub(crate) fn is_unique_violation(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(store::StoreError::Sql(sqlx::Error::Database(d))) if d.is_unique_violation())
}
