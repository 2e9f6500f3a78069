//! What each kind of bus message an append makes costs nats-server, in CPU per message:
//! `turnlog-bench writer bus`. An append is a JetStream publish to TURNLOG_APPEND (stored,
//! PubAck), its read by the writer (a consumer delivering the stored message), the reply
//! to its producer (core NATS) and the committed event's publish: to TURNLOG_EVENTS (stored,
//! PubAck) for a kind a worker consumes, otherwise a core message that, in the writer bench,
//! nobody subscribes to (DESIGN §6). Each kind runs alone, 40,000 messages of 400 bytes, on a private nats-server
//! with a file-storage stream like TURNLOG_APPEND (dedup ids, a 2-minute window); the
//! bench's own CPU is not counted.

use std::future::IntoFuture as _;
use std::time::Duration;

use anyhow::Context as _;

use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::StreamExt as _;
use turnlog_testkit::{free_port, private_nats};

use crate::cpu::{Meter, Part};

const MESSAGES: usize = 40_000;
/// Publishes awaiting their PubAck at once (the writer bench's producers keep 16 × 64).
const WINDOW: usize = 512;

pub(crate) async fn run() -> anyhow::Result<()> {
    let nats = private_nats(free_port()).await;
    let client = async_nats::connect(nats.url()).await?;
    let js = jetstream::new(client.clone());
    let body = Bytes::from(vec![b'x'; 400]);
    let meter = Meter::new(vec![("nats", Part::nats(&nats))]);
    let per_message = |seconds: f64| seconds * 1e6 / MESSAGES as f64;
    let mut figures = Vec::new();

    // A stored message with its PubAck: the append request, the committed event.
    let stored = stream_like_append(&js, "ACKED", "acked").await?;
    let (done, spent) = meter
        .measure(async {
            let mut acks = futures::stream::FuturesUnordered::new();
            for i in 0..MESSAGES {
                let msg = jetstream::message::PublishMessage::build()
                    .payload(body.clone())
                    .message_id(i.to_string());
                acks.push(js.send_publish(format!("acked.{}", i % 16), msg).await?.into_future());
                if acks.len() >= WINDOW {
                    acks.next().await.transpose()?;
                }
            }
            while let Some(ack) = acks.next().await {
                ack?;
            }
            anyhow::Ok(())
        })
        .await;
    done?;
    figures.push(("store_puback", per_message(spent.total())));

    // The same message stored without a PubAck (published with no reply subject).
    let bare = stream_like_append(&js, "BARE", "bare").await?;
    let (done, spent) = meter
        .measure(async {
            publish_with_ids(&client, "bare", &body).await?;
            stored_all(&bare, MESSAGES as u64).await
        })
        .await;
    done?;
    figures.push(("store_no_puback", per_message(spent.total())));

    // The writer's read: a consumer delivering the stored messages in order, unacked.
    let (done, spent) = meter
        .measure(async {
            let reader = stored.create_consumer(consumer::pull::OrderedConfig::default()).await?;
            let mut messages = reader.messages().await?.take(MESSAGES);
            while let Some(m) = messages.next().await {
                m?;
            }
            anyhow::Ok(())
        })
        .await;
    done?;
    figures.push(("read", per_message(spent.total())));

    // A core message to one subscriber: the outcome reply.
    let mut replies = client.subscribe("reply.inbox").await?;
    let (done, spent) = meter
        .measure(async {
            let receive = async {
                for _ in 0..MESSAGES {
                    replies.next().await.context("the subscription ended")?;
                }
                anyhow::Ok(())
            };
            let send = async {
                for _ in 0..MESSAGES {
                    client.publish("reply.inbox", body.clone()).await?;
                }
                anyhow::Ok(())
            };
            tokio::try_join!(receive, send)
        })
        .await;
    done?;
    figures.push(("core_reply", per_message(spent.total())));

    // A core message nobody subscribes to: a committed event of a kind the feed does not
    // store, with its dedup id and no listener.
    let (done, spent) = meter.measure(async { publish_with_ids(&client, "unheard", &body).await }).await;
    done?;
    figures.push(("core_unheard", per_message(spent.total())));

    println!(
        "nats-server CPU per message ({MESSAGES} messages of {} bytes each, one kind at a time):",
        body.len()
    );
    for (name, us) in &figures {
        println!("  {name:>16}: {us:>5.1} µs");
    }
    let get = |n: &str| figures.iter().find(|(k, _)| *k == n).map_or(0.0, |(_, v)| *v);
    // An append: the request stored without a PubAck (append_and_wait asks for one only
    // when the outcome is late), one read, one reply, and the committed event: a user
    // message's a core message nobody hears, an answer's stored with a PubAck.
    let request = get("store_no_puback") + get("read") + get("core_reply");
    let (append, answer) = (request + get("core_unheard"), request + get("store_puback"));
    println!(
        "  an append's messages (1 stored without a PubAck + 1 read + 1 reply + 1 unheard): {append:.1} µs; an answer's (its event stored with a PubAck): {answer:.1} µs; a PubAck is about {:.1} µs of a store",
        get("store_puback") - get("store_no_puback")
    );
    let fields: Vec<String> = figures.iter().map(|(k, v)| format!("nats_us_{k}={v:.1}")).collect();
    println!(
        "RESULT writer_bus {} nats_us_per_append_messages={append:.1} nats_us_per_answer_messages={answer:.1}",
        fields.join(" ")
    );
    Ok(())
}

/// [`MESSAGES`] core publishes on `<subject>.<i % 16>`, each with a dedup id and no reply
/// subject, flushed.
async fn publish_with_ids(client: &async_nats::Client, subject: &str, body: &Bytes) -> anyhow::Result<()> {
    for i in 0..MESSAGES {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", i.to_string().as_str());
        client.publish_with_headers(format!("{subject}.{}", i % 16), headers, body.clone()).await?;
    }
    client.flush().await?;
    Ok(())
}

/// A file-storage stream as TURNLOG_APPEND is made (dedup window 2 min).
async fn stream_like_append(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
) -> anyhow::Result<stream::Stream> {
    Ok(js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{subject}.>")],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?)
}

/// Waits until `stream` holds `n` messages (30 s at most).
async fn stored_all(stream: &stream::Stream, n: u64) -> anyhow::Result<()> {
    let mut stream = stream.clone();
    for _ in 0..600 {
        if stream.info().await?.state.messages >= n {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the stream never held {n} messages")
}
