//! turnlog in one process for the benchmarks: writer, compactor and ingress over the
//! testkit's fresh database and bus prefix, against the mock model.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnlog_ingress::turn::TurnLimits;
use turnlog_ingress::IngressConfig;
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::{test_env, TestEnv};

pub struct System {
    pub env: TestEnv,
    pub mock: MockHandle,
    pub base: String,
    pub http: reqwest::Client,
    stop: CancellationToken,
}

pub struct Settings {
    pub model: &'static str,
    /// `TURNLOG_MODEL_WINDOWS` entries, applied to every service.
    pub windows: Vec<(&'static str, u32)>,
    pub system_prompt: &'static str,
    /// `TURNLOG_MAX_TURNS_PER_OWNER` and `TURNLOG_MAX_TURNS`: every bench client is one
    /// owner, so a bench running more turns at once than the default 8 raises the cap.
    pub turn_limits: TurnLimits,
}

impl System {
    pub async fn start(settings: Settings) -> anyhow::Result<Self> {
        let env = test_env().await;
        let mock = turnlog_mock_llm::spawn(MockConfig::default()).await?;
        let stop = CancellationToken::new();
        let windows: std::collections::HashMap<String, u32> =
            settings.windows.iter().map(|(m, w)| (m.to_string(), *w)).collect();
        let upstream = UpstreamConfig {
            base_url: mock.base_url().into(),
            api_key: None,
            timeout: Duration::from_secs(30),
            windows_override: windows.clone(),
        };
        let backbone = env.backbone();
        let writer = turnlog_writer::WriterConfig { backbone: env.backbone() };
        tokio::spawn(turnlog_writer::run(writer, stop.clone()));
        let compactor = turnlog_compactor::CompactorConfig {
            backbone: env.backbone(),
            upstream: upstream.clone(),
            model: settings.model.into(),
            summary_model: "mock-summary".into(),
            context_budget: turnlog_core::budget::DEFAULT_BUDGET,
            consumer: ConsumerSettings::default(),
            facts_wait: Duration::from_millis(200),
            summary_deadline: Duration::from_secs(30),
            append_timeout: Duration::from_secs(10),
        };
        tokio::spawn(turnlog_compactor::run(compactor, stop.clone()));
        let mut config = IngressConfig::new(backbone);
        config.upstream = Some(upstream);
        config.model = settings.model.into();
        config.model_windows = windows;
        config.system_prompt = settings.system_prompt.into();
        config.turn_limits = settings.turn_limits;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        tokio::spawn(turnlog_ingress::run(config, listener, stop.clone()));
        let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
        for _ in 0..300 {
            if http.get(format!("{base}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Self { env, mock, base, http, stop })
    }

    pub async fn create_session(&self) -> anyhow::Result<String> {
        let r: serde_json::Value = self
            .http
            .post(format!("{}/v1/sessions", self.base))
            .json(&serde_json::json!({}))
            .send()
            .await?
            .json()
            .await?;
        r["id"].as_str().map(str::to_owned).ok_or_else(|| anyhow::anyhow!("no session id: {r}"))
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.env.cleanup().await;
    }
}
