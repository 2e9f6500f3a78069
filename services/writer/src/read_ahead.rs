//! The APPEND reader: reads a partition's requests in stream order and decodes them ahead
//! of the commit, within a byte budget, keeping its own consumer alive.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures::StreamExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use turnlog_core::ids::SessionId;
use turnlog_runtime::bus::{Bus, REPLY_HEADER};
use turnlog_runtime::trace;

use crate::apply::Incoming;
use crate::{metrics, REDRIVE_HEADER};

/// Most bytes of request bodies read ahead of the commit (a larger request waits alone).
pub(crate) const READ_AHEAD_BYTES: usize = 4 << 20;

/// A message decoded ahead of its batch, holding its share of the read-ahead budget.
pub(crate) type ReadAhead = (Incoming, OwnedSemaphorePermit);

/// How often a reader that has received nothing checks that its consumer still exists and
/// is not holding messages back, and how long it waits for the answer (a consumer on a
/// dead node does not answer at all).
const CONSUMER_CHECK: Duration = Duration::from_secs(1);
/// The expiry of the ordered consumer's pulls, which sets its idle heartbeat to half of it:
/// async-nats's default (30 s) leaves a lost consumer unnoticed for a minute.
const PULL_EXPIRES: Duration = Duration::from_secs(2);
/// How long creating a consumer may take before it is asked again.
const CONSUMER_CREATE: Duration = Duration::from_secs(2);
/// A pause before creating a consumer again (a leader election takes seconds).
pub(crate) const RECREATE_PAUSE: Duration = Duration::from_millis(250);

/// Reads the partition's messages in order from `next` and decodes each (tokenizing
/// included) while the writer applies and commits the batch before; at most
/// [`READ_AHEAD_BYTES`] of bodies wait, read but not yet committed.
///
/// The reader keeps its own consumer alive rather than trusting the library's: an ordered
/// consumer is an R1 ephemeral one on one nats-server, gone with that server (a restart,
/// or a stream leader dying on a cluster). When the client reconnects, when the consumer
/// is no longer there or holds back messages the server has for it, or when the library's
/// own recreation starts over from the stream's beginning, a new consumer is made from the
/// first sequence not yet handed on, as often as it takes. Nothing is handed on twice or
/// skipped: the writer commits in this order.
pub(crate) async fn read_ahead(
    bus: Bus,
    stream: async_nats::jetstream::stream::Stream,
    partition: u32,
    mut next: u64,
    budget: Arc<Semaphore>,
    to_writer: tokio::sync::mpsc::Sender<ReadAhead>,
) {
    let mut reconnects = bus.reconnects();
    let mut failures = 0u32;
    loop {
        reconnects.borrow_and_update();
        let open = async {
            let consumer = stream
                .create_consumer(OrderedConfig {
                    filter_subject: bus.names.append_partition_filter(partition),
                    deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: next },
                    max_expires: PULL_EXPIRES,
                    ..Default::default()
                })
                .await?;
            let name = consumer.cached_info().name.clone();
            anyhow::Ok((name, consumer.messages().await?))
        };
        // A stream without a leader leaves the request unanswered until the client's
        // request timeout; asking again sooner finds the new leader sooner.
        let opened = tokio::time::timeout(CONSUMER_CREATE, open)
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {CONSUMER_CREATE:?}")));
        let (name, mut messages) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                if failures == 0 {
                    tracing::warn!(
                        partition,
                        next,
                        error = format!("{e:#}"),
                        "cannot read the APPEND stream; trying again"
                    );
                }
                failures += 1;
                tokio::time::sleep(RECREATE_PAUSE).await;
                continue;
            }
        };
        if failures > 0 {
            tracing::info!(partition, next, attempts = failures + 1, "reading the APPEND stream again");
            failures = 0;
        }
        // A full period without a message between checks, even after the reader waited on
        // the writer: missed ticks are not made up in a burst.
        let mut check = tokio::time::interval(CONSUMER_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        check.reset();
        let mut received = false;
        let lost = loop {
            let m = tokio::select! {
                _ = reconnects.changed() => break "reconnected to NATS".to_owned(),
                _ = check.tick() => {
                    if !std::mem::take(&mut received) {
                        if let Err(lost) = check_consumer(&stream, &name, next).await {
                            break lost;
                        }
                    }
                    continue;
                }
                m = messages.next() => m,
            };
            let m = match m {
                Some(Ok(m)) => m,
                Some(Err(e)) => break format!("{e:#}"),
                None => break "the consumer's messages ended".to_owned(),
            };
            received = true;
            if let Ok(info) = m.info() {
                metrics::metrics().unread(partition, info.pending);
            }
            let item = match incoming(m) {
                Ok(item) => item,
                Err(e) => break format!("{e:#}"),
            };
            if item.stream_seq < next {
                break format!("the library's consumer started over at {}", item.stream_seq);
            }
            let cost = item.body.len().clamp(1, READ_AHEAD_BYTES) as u32;
            let Ok(permit) = budget.clone().acquire_many_owned(cost).await else { return };
            next = item.stream_seq + 1;
            if to_writer.send((item, permit)).await.is_err() {
                return;
            }
        };
        tracing::warn!(partition, next, reason = lost, "APPEND consumer lost; creating it again");
        tokio::time::sleep(RECREATE_PAUSE).await;
    }
}

/// Checks, after a [`CONSUMER_CHECK`] in which nothing arrived, that consumer `name` still
/// exists and answers, and that it is not holding back messages: the server has messages
/// for it, none is on its way (nothing delivered at or past `next`), and a moment later
/// still none is. Its pulls are lost or left unserved; async-nats would notice only once
/// the server's idle heartbeats stop too, after two missed ones and a recreation, about
/// 4.5 s in all (CI saw writer stalls of that length; the error says whether the server
/// held a pull request).
async fn check_consumer(
    stream: &async_nats::jetstream::stream::Stream,
    name: &str,
    next: u64,
) -> Result<(), String> {
    let info = || async {
        match tokio::time::timeout(CONSUMER_CHECK, stream.consumer_info(name)).await {
            Ok(Ok(info)) => Ok(info),
            Ok(Err(e)) => Err(format!("consumer {name}: {e}")),
            Err(_) => Err(format!("consumer {name} did not answer within {CONSUMER_CHECK:?}")),
        }
    };
    if !holds_back(&info().await?, next) {
        return Ok(());
    }
    tokio::time::sleep(STALL_CONFIRM).await;
    let info = info().await?;
    if !holds_back(&info, next) {
        return Ok(());
    }
    Err(format!(
        "consumer {name} delivered nothing for {CONSUMER_CHECK:?} with {} messages for it \
         (the server holds {} pull requests of it; delivered through {})",
        info.num_pending, info.num_waiting, info.delivered.stream_sequence
    ))
}

/// How long a consumer that seems to hold messages back is given before it counts as
/// stalled (a message stored just before the check is delivered within a millisecond).
const STALL_CONFIRM: Duration = Duration::from_millis(100);

/// Whether the server has messages for the consumer and none of them has been delivered:
/// the last it delivered is before `next`, the first not yet handed on.
fn holds_back(info: &async_nats::jetstream::consumer::Info, next: u64) -> bool {
    info.num_pending > 0 && info.delivered.stream_sequence < next
}

pub(crate) fn incoming(m: async_nats::jetstream::Message) -> anyhow::Result<Incoming> {
    let info = m.info().map_err(|e| anyhow::anyhow!("message without JetStream info: {e}"))?;
    let (stream_seq, published) = (info.stream_sequence, info.published);
    let subject_session = m.subject.rsplit('.').next().and_then(|s| s.parse::<SessionId>().ok());
    let reply_to = m.headers.as_ref().and_then(|h| h.get(REPLY_HEADER)).map(|v| v.to_string());
    let redrive = m.headers.as_ref().is_some_and(|h| h.get(REDRIVE_HEADER).is_some());
    let traceparent = trace::from_headers(m.headers.as_ref());
    Ok(Incoming::new(
        stream_seq,
        published,
        subject_session,
        reply_to,
        traceparent,
        redrive,
        m.message.payload,
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use async_nats::jetstream::{self, consumer::pull};

    use super::*;

    /// A consumer the server has messages for, with no pull request open, is found holding
    /// them back; not while one is on its way or once they are delivered; one that is gone
    /// is lost.
    #[tokio::test]
    async fn a_consumer_holding_back_messages_is_found() {
        let env = turnlog_testkit::test_env().await;
        let js = jetstream::new(async_nats::connect(&env.nats_url).await.unwrap());
        let subject = format!("{}.held", env.bus_prefix);
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: format!("{}_HELD", env.bus_prefix.to_uppercase()),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        let consumer = stream
            .create_consumer(pull::Config { name: Some("reader".into()), ..Default::default() })
            .await
            .unwrap();
        assert_eq!(check_consumer(&stream, "reader", 1).await, Ok(()), "nothing stored yet");

        for n in 0..3 {
            js.publish(subject.clone(), format!("{n}").into()).await.unwrap().await.unwrap();
        }
        let held = check_consumer(&stream, "reader", 1).await.unwrap_err();
        assert!(held.contains("with 3 messages for it"), "{held}");

        let mut batch = consumer.fetch().max_messages(3).messages().await.unwrap();
        let mut delivered = 0;
        while let Some(m) = batch.next().await {
            m.unwrap().ack().await.unwrap();
            delivered += 1;
        }
        assert_eq!(delivered, 3);
        assert_eq!(check_consumer(&stream, "reader", 4).await, Ok(()), "all delivered");

        // Two more held, one delivered but not yet handed on: on its way, not held back.
        for n in 3..6 {
            js.publish(subject.clone(), format!("{n}").into()).await.unwrap().await.unwrap();
        }
        let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
        batch.next().await.unwrap().unwrap().ack().await.unwrap();
        assert_eq!(check_consumer(&stream, "reader", 4).await, Ok(()), "one on its way");
        let held = check_consumer(&stream, "reader", 5).await.unwrap_err();
        assert!(held.contains("with 2 messages for it"), "{held}");

        stream.delete_consumer("reader").await.unwrap();
        let gone = check_consumer(&stream, "reader", 4).await.unwrap_err();
        assert!(gone.starts_with("consumer reader:"), "{gone}");
        js.delete_stream(stream.cached_info().config.name.clone()).await.unwrap();
    }
}
