//! turnlog in one process for the benchmarks: the in-process stack `turnlog dev` runs
//! (writer, compactor, ingress; configs from turnlog-e2e) over the testkit's fresh database
//! and bus prefix, against the mock model.

use std::time::Duration;

use turnlog_dev::Stack;
use turnlog_e2e::config;
use turnlog_ingress::turn::TurnLimits;
use turnlog_mock_llm::{MockConfig, MockHandle};
use turnlog_runtime::upstream::UpstreamConfig;
use turnlog_runtime::worker::ConsumerSettings;
use turnlog_testkit::{test_env, TestEnv};

pub(crate) struct System {
    pub env: TestEnv,
    pub mock: MockHandle,
    pub base: String,
    pub http: reqwest::Client,
    /// The ingress's blob store of uploaded files (`file://` under the temp directory).
    pub files_dir: std::path::PathBuf,
    stack: Stack,
}

pub(crate) struct Settings {
    pub model: &'static str,
    /// `TURNLOG_MODEL_WINDOWS` entries, applied to every service.
    pub windows: Vec<(&'static str, u32)>,
    pub system_prompt: &'static str,
    /// `TURNLOG_MAX_TURNS_PER_OWNER` and `TURNLOG_MAX_TURNS`: every bench client is one
    /// owner, so a bench running more turns at once than the default 8 raises the cap.
    pub turn_limits: TurnLimits,
}

impl System {
    pub(crate) async fn start(settings: Settings) -> anyhow::Result<Self> {
        Self::start_with_tools(settings, None).await
    }

    /// [`System::start`] with the tools worker on the servers file `mcp_servers` (TOML).
    pub(crate) async fn start_with_tools(
        settings: Settings,
        mcp_servers: Option<&str>,
    ) -> anyhow::Result<Self> {
        let env = test_env().await;
        let mock = turnlog_mock_llm::spawn(MockConfig::default()).await?;
        let upstream = UpstreamConfig {
            timeout: Duration::from_secs(30),
            windows_override: settings.windows.iter().map(|(m, w)| (m.to_string(), *w)).collect(),
            ..config::upstream_at(&mock.base_url())
        };
        let mut configs = config::chat_stack(&env, upstream, settings.model);
        configs.tools = mcp_servers
            .map(|text| turnlog_tools::ToolsConfig::parse(config::backbone(&env), text))
            .transpose()?;
        configs.ingress.system_prompt = settings.system_prompt.into();
        configs.ingress.turn_limits = settings.turn_limits;
        let files_dir = std::env::temp_dir().join("turnlog-bench-files").join(&env.bus_prefix);
        configs.ingress.files_url = Some(format!("file://{}", files_dir.display()));
        if let Some(compactor) = configs.compactor_mut() {
            compactor.consumer = ConsumerSettings::default();
            compactor.facts_wait = Duration::from_millis(200);
            compactor.summary_deadline = Duration::from_secs(30);
        }
        let stack = turnlog_e2e::serve(configs, Duration::from_secs(30)).await?;
        let base = stack.base_url().to_owned();
        let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
        Ok(Self { env, mock, base, http, files_dir, stack })
    }

    pub(crate) async fn create_session(&self) -> anyhow::Result<String> {
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

    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.stack.stop().await?;
        self.env.cleanup().await;
        let _ = std::fs::remove_dir_all(&self.files_dir);
        Ok(())
    }
}
