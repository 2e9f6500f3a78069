//! The in-process stack `turnlog dev` runs, and the end-to-end suites and the benchmarks
//! with it: migrations and the bus topology first, then each service on its own task with
//! its own token, stopped in order (ingress, workers, writer) with each group's grace.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::Worker;

/// Beyond the ingress's own grace period (open requests finishing), how long its task
/// gets to return.
const INGRESS_STOP_MARGIN: Duration = Duration::from_secs(5);
/// How long the workers get to finish the events in hand; an event cut off is redelivered
/// on the next start.
const WORKERS_GRACE: Duration = Duration::from_secs(20);
const WRITER_GRACE: Duration = Duration::from_secs(15);

/// Every service's config for one set of servers and one model gateway. The ingress always
/// runs (its backbone says where the log and the bus are); the writer runs when set, and
/// each worker listed (`turnlog dev` runs them all; a test may leave out the writer or
/// some workers).
pub struct ServiceConfigs {
    pub writer: Option<turnlog_writer::WriterConfig>,
    pub ingress: turnlog_ingress::IngressConfig,
    pub workers: Vec<Worker>,
    /// The tools worker (DESIGN §14), when MCP servers are configured.
    pub tools: Option<turnlog_tools::ToolsConfig>,
}

impl ServiceConfigs {
    /// The compactor's config, when it is among the workers.
    pub fn compactor_mut(&mut self) -> Option<&mut turnlog_compactor::CompactorConfig> {
        self.workers.iter_mut().find_map(|w| match w {
            Worker::Compactor(c) => Some(c),
            _ => None,
        })
    }
}

/// The services of [`ServiceConfigs`] running in this process. Dropped without
/// [`Stack::stop`], every service is told to stop at once and none is waited for.
pub struct Stack {
    base_url: String,
    probe: reqwest::Client,
    tokens_required: bool,
    ingress: Service,
    ingress_grace: Duration,
    workers: Vec<Service>,
    writer: Option<Service>,
    ended: mpsc::UnboundedReceiver<&'static str>,
    _backstop: DropGuard,
}

impl Stack {
    /// Applies the migrations and creates the bus topology, then starts every configured
    /// service, the ingress serving on `listener`. Returns once they are spawned; see
    /// [`Stack::ready`].
    pub async fn start(configs: ServiceConfigs, listener: TcpListener) -> anyhow::Result<Stack> {
        let backbone = &configs.ingress.backbone;
        let pool = backbone.connect_db(2).await.context("connecting to Postgres")?;
        turnlog_runtime::db::migrate(&pool).await.context("applying migrations")?;
        pool.close().await;
        // The streams too, before any service looks for them (a worker that starts first
        // would otherwise retry until the writer has made them).
        let bus = backbone.connect_bus().await.context("connecting to NATS")?;
        bus.ensure_topology(backbone.append_max_age).await.context("creating the bus topology")?;
        drop(bus);
        let addr = listener.local_addr().context("reading the listen address")?;
        let tokens_required = !configs.ingress.tokens.is_empty();
        let ingress_grace = configs.ingress.shutdown_grace + INGRESS_STOP_MARGIN;
        let probe = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;

        // Each service on its own task and token; the tokens are children of one that is
        // cancelled only when the stack is dropped, and are cancelled in order by `stop`.
        let all = CancellationToken::new();
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let ServiceConfigs { writer, ingress, workers, tools } = configs;
        let writer = writer.map(|c| Service::spawn("writer", &all, &ended_tx, |t| turnlog_writer::run(c, t)));
        let mut workers: Vec<Service> =
            workers.into_iter().map(|w| Service::spawn(w.name(), &all, &ended_tx, |t| w.run(t))).collect();
        workers.extend(tools.map(|c| Service::spawn("tools", &all, &ended_tx, |t| turnlog_tools::run(c, t))));
        let ingress =
            Service::spawn("ingress", &all, &ended_tx, |t| turnlog_ingress::run(ingress, listener, t));
        Ok(Stack {
            base_url: base_url(addr),
            probe,
            tokens_required,
            ingress,
            ingress_grace,
            workers,
            writer,
            ended,
            _backstop: all.drop_guard(),
        })
    }

    /// `http://host:port` of the ingress, as a client on this machine reaches it.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Whether the ingress asks for API tokens.
    pub fn tokens_required(&self) -> bool {
        self.tokens_required
    }

    /// Waits until the ingress answers `/readyz` with 200 (Postgres and NATS reachable),
    /// saying so now and then when it takes long. Err names a service that stopped by
    /// itself first.
    pub async fn ready(&mut self) -> Result<(), &'static str> {
        let (probe, base) = (self.probe.clone(), self.base_url.clone());
        tokio::select! {
            name = self.ended() => Err(name),
            () = wait_ready(&probe, &base) => Ok(()),
        }
    }

    /// Waits until a service stops by itself, and names it.
    pub async fn ended(&mut self) -> &'static str {
        // The stack holds a service on every sender's other end: the channel stays open.
        self.ended.recv().await.unwrap_or("unknown")
    }

    /// Stops the services in order: the ingress first, so its last checkpoints still reach
    /// the writer; the workers next (their appends too); the writer last. Each group gets
    /// its grace, then is abandoned. Returns the first failure (every one is logged).
    pub async fn stop(self) -> anyhow::Result<()> {
        let Stack { ingress, ingress_grace, workers, writer, .. } = self;
        let mut errors = Vec::new();
        tracing::info!("stopping the ingress");
        errors.extend(stop_group(vec![ingress], ingress_grace).await);
        if !workers.is_empty() {
            tracing::info!("stopping the workers");
            errors.extend(stop_group(workers, WORKERS_GRACE).await);
        }
        if let Some(writer) = writer {
            tracing::info!("stopping the writer");
            errors.extend(stop_group(vec![writer], WRITER_GRACE).await);
        }
        for e in &errors {
            tracing::error!(error = format!("{e:#}"), "service failed");
        }
        errors.into_iter().next().map_or(Ok(()), Err)
    }
}

/// One service on its own task, with the token that stops it.
struct Service {
    name: &'static str,
    stop: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Service {
    /// Spawns `run` with a child token of `all`; `ended` hears the name when it returns.
    fn spawn<F>(
        name: &'static str,
        all: &CancellationToken,
        ended: &mpsc::UnboundedSender<&'static str>,
        run: impl FnOnce(CancellationToken) -> F,
    ) -> Service
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let stop = all.child_token();
        let service = run(stop.clone());
        let ended = ended.clone();
        let task = tokio::spawn(async move {
            let result = service.await;
            let _ = ended.send(name);
            result
        });
        Service { name, stop, task }
    }
}

/// Stops every service of `group` at once and waits up to `grace` for each; one still
/// running then is aborted.
async fn stop_group(group: Vec<Service>, grace: Duration) -> Vec<anyhow::Error> {
    for service in &group {
        service.stop.cancel();
    }
    let deadline = tokio::time::Instant::now() + grace;
    let mut errors = Vec::new();
    for Service { name, mut task, .. } in group {
        match tokio::time::timeout_at(deadline, &mut task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => errors.push(e.context(format!("the {name} service failed"))),
            Ok(Err(e)) => errors.push(anyhow::anyhow!("the {name} service panicked: {e}")),
            Err(_) => {
                tracing::warn!(service = name, ?grace, "did not stop in time; abandoning it");
                task.abort();
            }
        }
    }
    errors
}

/// Polls `/readyz` until it answers 200 (Postgres and NATS reachable), saying so now and
/// then when it takes long.
async fn wait_ready(probe: &reqwest::Client, base: &str) {
    let url = format!("{base}/readyz");
    let started = tokio::time::Instant::now();
    let mut next_note = Duration::from_secs(15);
    loop {
        match probe.get(&url).send().await {
            Ok(r) if r.status().is_success() => return,
            answer => {
                if started.elapsed() >= next_note {
                    let detail = match answer {
                        Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(%url, detail, "the ingress is not ready yet");
                    next_note += Duration::from_secs(15);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `http://host:port` a client on this machine uses to reach `addr`.
fn base_url(addr: SocketAddr) -> String {
    let host = match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => "127.0.0.1".to_owned(),
        SocketAddr::V4(a) => a.ip().to_string(),
        SocketAddr::V6(a) if a.ip().is_unspecified() => "[::1]".to_owned(),
        SocketAddr::V6(a) => format!("[{}]", a.ip()),
    };
    format!("http://{host}:{}", addr.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_reach_a_wildcard_listener_on_loopback() {
        assert_eq!(base_url("0.0.0.0:8080".parse().unwrap()), "http://127.0.0.1:8080");
        assert_eq!(base_url("127.0.0.1:9".parse().unwrap()), "http://127.0.0.1:9");
        assert_eq!(base_url("[::]:80".parse().unwrap()), "http://[::1]:80");
        assert_eq!(base_url("[::1]:80".parse().unwrap()), "http://[::1]:80");
    }
}
