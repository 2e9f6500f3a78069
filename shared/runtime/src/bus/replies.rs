//! One subscription for every outcome a connection waits for. `append_and_wait` used to
//! subscribe to an inbox of its own for each append: a SUB and an UNSUB per append, each
//! a change to nats-server's subscription list (and, on a cluster, sent to every route).
//! Now each connection subscribes to `<inbox>.*` once and hands each reply to the append
//! waiting on its last token.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt as _;
use tokio::sync::mpsc;

/// Replies one waiting append may have queued (a writer answers once; a repeat or a
/// confirming publish can bring one more): more are dropped.
const QUEUED: usize = 4;

type Waiting = Mutex<HashMap<u64, mpsc::Sender<async_nats::Message>>>;

/// The connection's reply inbox and the appends waiting on it. Dropped (with the last
/// clone of its [`Bus`](super::Bus)), it unsubscribes, so the connection can close.
pub(crate) struct Replies {
    prefix: String,
    next: AtomicU64,
    waiting: Arc<Waiting>,
    _stop: tokio_util::sync::DropGuard,
}

impl Replies {
    /// Subscribes to `<a new inbox>.*` and routes what arrives until dropped.
    pub(crate) async fn subscribe(client: &async_nats::Client) -> Result<Self, async_nats::SubscribeError> {
        let prefix = client.new_inbox();
        let mut inbox = client.subscribe(format!("{prefix}.*")).await?;
        let waiting: Arc<Waiting> = Arc::default();
        let stop = tokio_util::sync::CancellationToken::new();
        let (routes, stopped) = (waiting.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = stopped.cancelled() => return,
                    m = inbox.next() => match m {
                        Some(m) => m,
                        None => return,
                    },
                };
                let token = message.subject.rsplit('.').next().and_then(|t| t.parse::<u64>().ok());
                let to = token
                    .and_then(|t| routes.lock().unwrap_or_else(PoisonError::into_inner).get(&t).cloned());
                // Nobody waits any more (an answer after the deadline), or too many came.
                if let Some(to) = to {
                    let _ = to.try_send(message);
                }
            }
        });
        Ok(Self { prefix, next: AtomicU64::new(1), waiting, _stop: stop.drop_guard() })
    }

    /// A subject of this inbox for one append's replies, until the returned value drops.
    pub(crate) fn wait(&self) -> Reply {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(QUEUED);
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).insert(token, tx);
        Reply { subject: format!("{}.{token}", self.prefix), token, rx, waiting: self.waiting.clone() }
    }
}

/// Where one append's replies arrive.
pub(crate) struct Reply {
    pub(crate) subject: String,
    token: u64,
    pub(crate) rx: mpsc::Receiver<async_nats::Message>,
    waiting: Arc<Waiting>,
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.token);
    }
}
