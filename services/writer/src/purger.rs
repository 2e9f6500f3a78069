//! Removing deleted sessions' messages from the streams (DESIGN §6), one message at a time,
//! before each delete is answered; and on start, the removals a previous writer left undone.

use anyhow::Context as _;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use sqlx::PgPool;
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{partition_of, Bus, CommittedEvent, DeadLetter, Outcome};

use crate::publisher::send_replies;
use crate::store;

/// Deleted sessions waiting for their messages to be removed (a full queue holds the
/// publisher back).
pub(crate) const PURGE_QUEUE: usize = 1024;

/// A deleted session's stream messages to remove: those whose APPEND sequence is at most
/// `through`, the delete's own (later ones belong to a session created again under its id).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Purge {
    pub(crate) session: SessionId,
    pub(crate) through: u64,
}

/// A committed delete's removals and the replies that wait for them.
pub(crate) type DeleteDone = (Vec<Purge>, Vec<(String, Outcome)>);

/// Removes deleted sessions' messages in the order of their deletes, then answers each
/// delete (DESIGN §6: a delete is answered once its session is gone from the streams).
pub(crate) async fn purger(
    pool: PgPool,
    bus: Bus,
    mut purges: tokio::sync::mpsc::Receiver<DeleteDone>,
) -> anyhow::Result<()> {
    while let Some((removals, replies)) = purges.recv().await {
        for purge in removals {
            purge_session(&pool, &bus, purge).await?;
        }
        send_replies(&bus, &replies).await?;
    }
    Ok(())
}

/// The removals a previous writer of `partition` left undone. A record from before deletes
/// named their sequence is bounded by the partition's position: the delete is at or below
/// it, and nothing above it has been applied yet.
pub(crate) async fn finish_purges(
    pool: &PgPool,
    bus: &Bus,
    partition: u32,
    applied: i64,
) -> anyhow::Result<()> {
    for (session, through) in store::pending_purges(pool).await? {
        if partition_of(session, bus.partitions) == partition {
            let through = u64::try_from(through.unwrap_or(applied)).unwrap_or_default();
            purge_session(pool, bus, Purge { session, through }).await?;
        }
    }
    Ok(())
}

/// Removes a deleted session's messages up to its delete from all three streams — APPEND
/// by its own sequence, EVENTS and DEAD by the APPEND sequence their bodies carry — then
/// its purge record. Later messages stay: they belong to a session created again under
/// the same id, whose log a rebuild must find. A session kept hidden for its forks keeps
/// the APPEND messages (and feed messages) of the events it keeps, and the delete that hid
/// it, so a rebuild reproduces it (DESIGN §10).
///
/// One message at a time, never a purge with a subject filter: on nats-server 2.9 such a
/// purge moves every consumer of the stream past messages it has not read yet, with or
/// without a sequence bound (nats-server#3838, #5075), so this writer, a rebuild or a worker
/// would skip other sessions' messages. Deleting single messages leaves consumers be.
async fn purge_session(pool: &PgPool, bus: &Bus, purge: Purge) -> anyhow::Result<()> {
    let Purge { session, through } = purge;
    let kept = store::kept_messages(pool, session).await?;
    let keep = |seq: Option<u64>| seq.is_some_and(|s| kept.contains(&s));
    let [append, events, dead] = bus.names.session_filters(bus.partition_of(session), session);
    // APPEND sequences only grow along the subject: the first one past the delete ends it.
    let mut removed = remove_through(bus, append, through, |m| Some(m.sequence), &keep, true).await?;
    removed += remove_through(bus, events, through, |m| event_append_seq(&m.payload), &keep, false).await?;
    removed +=
        remove_through(bus, dead, through, |m| dead_letter_append_seq(&m.payload), &|_| false, false).await?;
    store::purge_done(pool, session, i64::try_from(through).unwrap_or(i64::MAX)).await?;
    tracing::info!(%session, through, removed, kept = kept.len(), "deleted session removed from the streams");
    Ok(())
}

/// Deletes, one by one, the messages of `stream` on `filter` whose APPEND sequence (per
/// `append_seq`; None counts as old enough) is at most `through`, except those `keep`
/// names; returns how many. With `ordered`, the scan ends at the first message past
/// `through`.
async fn remove_through(
    bus: &Bus,
    (stream, filter): (String, String),
    through: u64,
    append_seq: fn(&StreamMessage) -> Option<u64>,
    keep: &(dyn Fn(Option<u64>) -> bool + Sync),
    ordered: bool,
) -> anyhow::Result<u64> {
    let s = bus.js.get_stream_no_info(&stream).await.with_context(|| format!("opening {stream}"))?;
    let (mut next, mut removed) = (1, 0);
    loop {
        let m = match s.get_first_raw_message_by_subject(&filter, next).await {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(removed),
            Err(e) => return Err(e).with_context(|| format!("finding {filter} in {stream}")),
        };
        next = m.sequence + 1;
        let seq = append_seq(&m);
        if seq.is_some_and(|seq| seq > through) {
            if ordered {
                return Ok(removed);
            }
            continue;
        }
        if keep(seq) {
            continue;
        }
        s.delete_message(m.sequence).await.with_context(|| format!("deleting {stream} {}", m.sequence))?;
        removed += 1;
    }
}

/// The APPEND sequence a committed event's body carries.
fn event_append_seq(payload: &[u8]) -> Option<u64> {
    serde_json::from_slice::<CommittedEvent>(payload).ok().and_then(|e| e.stream_seq)
}

/// The APPEND sequence a dead letter stands for.
fn dead_letter_append_seq(payload: &[u8]) -> Option<u64> {
    serde_json::from_slice::<DeadLetter>(payload).ok().and_then(|l| l.append_seq())
}
