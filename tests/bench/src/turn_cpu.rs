//! The CPU a chat turn costs: `turnlog ingress`, `writer`, `distiller`, `compactor` and
//! `memory` as processes of their own, on a private nats-server and Postgres, against the
//! mock model (in the bench's process, like the clients: neither is counted). Measured from
//! the first request until every worker has handled every turn and the search index has
//! every event, so a turn is charged with all the work it causes. A warm-up round on other
//! sessions comes first, unmetered: it opens the services' pooled connections and lets
//! Postgres cache their catalogs and plans, which a long-running deployment pays once.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::json;
use turnlog_mock_llm::MockConfig;
use turnlog_runtime::bus::Bus;
use turnlog_testkit::{
    free_port, private_nats, private_postgres, test_env_on, PrivateNats, PrivatePostgres, TurnlogProcess,
};

use crate::cpu::{Meter, Part, Spent};

/// Sessions talking at once, and turns each.
const SESSIONS: usize = 8;
const TURNS_EACH: usize = 25;
/// Turns each of the warm-up round's sessions takes (as many sessions, at once).
const WARM_UP_TURNS: usize = 10;
/// A window whose compaction budget (60%) a session of the rich scenario passes about
/// every ten turns.
const RICH_WINDOW: &str = "mock=12000";
const WORKERS: [&str; 3] = ["distiller", "compactor", "memory"];

/// What a scenario's turns say.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Scenario {
    /// A short question and a 40-word answer, nothing to remember, never compacted.
    Plain,
    /// A question with names, places and numbers (memories extracted, then recalled by the
    /// later turns) and a 250-word answer, in a window that compacts about one turn in ten.
    Rich,
}

impl Scenario {
    fn text(self, session: usize, turn: usize) -> String {
        // The plain question has no name or number: nothing for the memory worker to keep.
        match self {
            Scenario::Plain => "what should we do next about the plan? [mock words=40]".to_owned(),
            Scenario::Rich => format!(
                "Turn {turn}: Maria Lopez from the Lisbon office asked about order {} for Porto \
                 and the visit of Jonas Berg on 2026-0{}-1{}; we went through the plan once more \
                 and agreed on the next small steps. What about Maria's order? [mock words=250]",
                4000 + session * 100 + turn,
                1 + turn % 9,
                turn % 10
            ),
        }
    }
}

pub(crate) struct TurnCost {
    pub(crate) turns: usize,
    pub(crate) spent: Spent,
    pub(crate) compactions: i64,
    pub(crate) memories: i64,
    pub(crate) seconds: f64,
}

impl TurnCost {
    pub(crate) fn ms_per_turn(&self) -> f64 {
        self.spent.total() * 1e3 / self.turns as f64
    }
}

/// Runs the scenario's turns on fresh servers and returns what they cost.
pub(crate) async fn measure(scenario: Scenario) -> anyhow::Result<TurnCost> {
    let bin = crate::soak::turnlog_binary()?;
    let (pg, nats) = (private_postgres(free_port()).await, private_nats(free_port()).await);
    let result = run(&bin, &pg, &nats, scenario).await;
    drop((pg, nats));
    result
}

async fn run(
    bin: &std::path::Path,
    pg: &PrivatePostgres,
    nats: &PrivateNats,
    scenario: Scenario,
) -> anyhow::Result<TurnCost> {
    let env = test_env_on(Some(&pg.url()), Some(&nats.url())).await;
    let bus = Bus::connect(&env.nats_url, &env.bus_prefix, 1).await?;
    bus.ensure_topology(None).await?;
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await?;
    let llm = mock.base_url();
    let window = if scenario == Scenario::Rich { RICH_WINDOW } else { "mock=128000" };
    let model_env =
        [("TURNLOG_LLM_URL", llm.as_str()), ("TURNLOG_MODEL", "mock"), ("TURNLOG_MODEL_WINDOWS", window)];
    let writer = TurnlogProcess::start(bin, &env, &["writer"], &[]);
    let workers: Vec<TurnlogProcess> =
        WORKERS.iter().map(|w| TurnlogProcess::start(bin, &env, &[w], &model_env)).collect();
    let listen = format!("127.0.0.1:{}", free_port());
    let ingress_env = [&model_env[..], &[("TURNLOG_LISTEN", listen.as_str())]].concat();
    let ingress = TurnlogProcess::start(bin, &env, &["ingress"], &ingress_env);
    let base = format!("http://{listen}");
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    ready(&http, &base).await?;

    let new_sessions = || async {
        let mut sessions = Vec::new();
        for _ in 0..SESSIONS {
            let r: serde_json::Value =
                http.post(format!("{base}/v1/sessions")).json(&json!({})).send().await?.json().await?;
            sessions.push(r["id"].as_str().ok_or_else(|| anyhow::anyhow!("no session id: {r}"))?.to_owned());
        }
        anyhow::Ok(sessions)
    };
    let talk = |sessions, turns| {
        Talk { http: &http, base: &base, bus: &bus, env: &env, scenario }.run(sessions, turns)
    };
    talk(new_sessions().await?, WARM_UP_TURNS).await?;
    // The statistics autovacuum keeps of a store that has run a while (recall's common
    // words come from them); its first pass would come only after a minute.
    sqlx::query("ANALYZE memories").execute(&env.pool).await?;
    let warm_up = counts(&env.pool).await?;
    let sessions = new_sessions().await?;
    let meter = Meter::new(vec![
        ("ingress", Part::turnlog(&[&ingress])),
        ("writer", Part::turnlog(&[&writer])),
        ("workers", Part::turnlog(&workers.iter().collect::<Vec<_>>())),
        ("postgres", Part::postgres(pg)),
        ("nats", Part::nats(nats)),
    ]);
    crate::cpu::statements_reset(&env.pool).await;
    // (A profiler started now sees only the metered turns.)
    eprintln!("metering {} turns", SESSIONS * TURNS_EACH);
    let started = Instant::now();
    let (turns, spent) = meter.measure(talk(sessions, TURNS_EACH)).await;
    let seconds = started.elapsed().as_secs_f64();
    let (compactions, memories) = counts(&env.pool).await?;
    let (compactions, memories) = (compactions - warm_up.0, memories - warm_up.1);
    crate::cpu::statements_top(&env.pool, 25, (SESSIONS * TURNS_EACH) as f64, "/turn").await;
    for mut p in workers.into_iter().chain([writer, ingress]) {
        p.terminate();
        p.wait_exit(Duration::from_secs(20)).await;
    }
    drop(bus);
    env.cleanup().await;
    Ok(TurnCost { turns: turns?, spent, compactions, memories, seconds })
}

/// Sessions talking at once through one ingress.
struct Talk<'a> {
    http: &'a reqwest::Client,
    base: &'a str,
    bus: &'a Bus,
    env: &'a turnlog_testkit::TestEnv,
    scenario: Scenario,
}

impl Talk<'_> {
    /// `turns` turns in each of `sessions`, at once; then waits until every worker has
    /// handled them and the search index has them. Returns the turns taken.
    async fn run(self, sessions: Vec<String>, turns: usize) -> anyhow::Result<usize> {
        let talks = sessions.iter().enumerate().map(|(s, session)| async move {
            for t in 0..turns {
                turn(self.http, self.base, session, &self.scenario.text(s, t)).await?;
            }
            anyhow::Ok(turns)
        });
        let taken: anyhow::Result<Vec<usize>> = futures::future::join_all(talks).await.into_iter().collect();
        turnlog_e2e::rig::settle(self.env, self.bus, &WORKERS).await;
        self.env.search_caught_up().await;
        taken.map(|t| t.iter().sum())
    }
}

/// Compactions applied and memories kept so far.
async fn counts(pool: &sqlx::PgPool) -> anyhow::Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM session_events WHERE kind = 'compaction_applied'),
                (SELECT count(*) FROM memories)",
    )
    .fetch_one(pool)
    .await?)
}

/// One streamed turn, read to its end; an error unless it completed.
async fn turn(http: &reqwest::Client, base: &str, session: &str, text: &str) -> anyhow::Result<()> {
    let resp = http
        .post(format!("{base}/v1/sessions/{session}/messages"))
        .json(&json!({ "text": text }))
        .send()
        .await?;
    anyhow::ensure!(resp.status().is_success(), "turn refused: {}", resp.status());
    let mut events = resp.bytes_stream().eventsource();
    while let Some(e) = events.next().await {
        let e = e?;
        if e.event == "end" {
            let data: serde_json::Value = serde_json::from_str(&e.data)?;
            anyhow::ensure!(data["status"] == "completed", "turn did not complete: {data}");
            return Ok(());
        }
    }
    anyhow::bail!("the stream ended without its end event")
}

async fn ready(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !http.get(format!("{base}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) {
        anyhow::ensure!(Instant::now() < deadline, "ingress {base} not ready within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Both scenarios, printed; the RESULT line's part of them.
pub(crate) async fn figures() -> anyhow::Result<String> {
    let mut out = Vec::new();
    for (scenario, name, key) in [
        (Scenario::Plain, "plain turn", "cpu_ms_per_turn"),
        (Scenario::Rich, "turn with recall, compaction", "cpu_ms_per_turn_rich"),
    ] {
        let cost = measure(scenario).await?;
        println!(
            "CPU per {name}: {:.2} ms ({}); {} turns in {:.1} s, {SESSIONS} sessions at once, {} compactions, {} memories",
            cost.ms_per_turn(),
            cost.spent.describe(1e3, cost.turns as f64, "ms"),
            cost.turns,
            cost.seconds,
            cost.compactions,
            cost.memories,
        );
        out.push(format!(
            "{key}={:.2} {}",
            cost.ms_per_turn(),
            cost.spent.split(key, 1e3, cost.turns as f64)
        ));
        if scenario == Scenario::Rich {
            out.push(format!("compactions_per_turn_rich={:.3}", cost.compactions as f64 / cost.turns as f64));
        }
    }
    Ok(out.join(" "))
}
