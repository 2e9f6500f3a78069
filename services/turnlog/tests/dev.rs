//! `turnlog dev` end to end on the private Postgres and nats-server it starts itself (no
//! DATABASE_URL or NATS_URL): start, the banner's curl examples as printed, chat, Ctrl-C,
//! start again and find the history; an HTML upload converted; a second copy on the same data
//! directory refused; a bad setting refused by name before anything starts; and
//! `convert-html`, the process each HTML upload is converted in.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_testkit::{free_port, ExternalProcess};

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");
/// First start includes initdb; both starts are a few seconds on a small machine.
const READY_WITHIN: Duration = Duration::from_secs(60);
const EXIT_WITHIN: Duration = Duration::from_secs(40);

/// A fresh TURNLOG_DATA_DIR. Dropped after the process: it stops whatever servers a
/// failed run left (they run in their own process groups, so they outlive a killed
/// `turnlog dev`) and removes the data, including a cluster kept outside the directory.
struct DataDir {
    path: PathBuf,
}

impl DataDir {
    fn new() -> DataDir {
        let path = std::env::temp_dir().join(format!("turnlog-dev-test-{}", uuid::Uuid::new_v4().simple()));
        DataDir { path }
    }

    /// `servers.json`: the recorded ports and where the cluster lives.
    fn servers(&self) -> Value {
        let bytes = std::fs::read(self.path.join("servers.json")).expect("servers.json written");
        serde_json::from_slice(&bytes).expect("servers.json is JSON")
    }

    fn postgres_data(&self) -> Option<PathBuf> {
        let bytes = std::fs::read(self.path.join("servers.json")).ok()?;
        let state: Value = serde_json::from_slice(&bytes).ok()?;
        state["postgres"]["data_dir"].as_str().map(PathBuf::from)
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let postgres_data = self.postgres_data();
        if let Ok(bytes) = std::fs::read(self.path.join("servers.json")) {
            let state: Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if let Some(pid) = state["nats"]["pid"].as_u64() {
                kill_if(pid, "nats-server", "KILL");
            }
        }
        if let Some(data) = &postgres_data {
            let pid = std::fs::read_to_string(data.join("postmaster.pid"))
                .ok()
                .and_then(|t| t.lines().next()?.trim().parse::<u64>().ok());
            if let Some(pid) = pid {
                // Immediate shutdown: the postmaster takes its backends with it.
                kill_if(pid, "postgres", "QUIT");
                std::thread::sleep(Duration::from_secs(1));
            }
            if let Some(base) = data.parent().filter(|b| !b.starts_with(&self.path)) {
                let _ = std::fs::remove_dir_all(base);
            }
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn kill_if(pid: u64, comm: &str, signal: &str) {
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if name.trim() == comm {
        let _ = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status();
    }
}

/// `turnlog dev` on `dir`, serving on `port`, with none of the caller's servers or settings.
fn turnlog_dev(dir: &Path, port: u16) -> ExternalProcess {
    let mut process = ExternalProcess::new("turnlog-dev", BIN).arg("dev");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TURNLOG_") {
            process = process.env_remove(key);
        }
    }
    process
        .env_remove("DATABASE_URL")
        .env_remove("NATS_URL")
        .env("TURNLOG_DATA_DIR", dir)
        .env("TURNLOG_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "info")
}

/// `turnlog dev` run to completion, for the cases that must not get far.
fn turnlog_dev_output(dir: &Path, extra_env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(BIN);
    command.arg("dev").env_remove("DATABASE_URL").env_remove("NATS_URL").env("TURNLOG_DATA_DIR", dir);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TURNLOG_") && key != "TURNLOG_DATA_DIR" {
            command.env_remove(key);
        }
    }
    command.envs(extra_env.iter().copied());
    command.output().expect("run turnlog dev")
}

async fn wait_ready(http: &reqwest::Client, base: &str, dev: &mut ExternalProcess) {
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        assert!(dev.is_running(), "turnlog dev exited while starting:\n{}", dev.log_tail(40));
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status().is_success() {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "turnlog dev not ready within {READY_WITHIN:?}:\n{}",
            dev.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Ctrl-C, and the exit status within [`EXIT_WITHIN`].
async fn interrupt(dev: &mut ExternalProcess) -> ExitStatus {
    dev.signal("INT");
    match dev.wait_exit(EXIT_WITHIN).await {
        Some(status) => status,
        None => panic!("turnlog dev still running {EXIT_WITHIN:?} after SIGINT:\n{}", dev.log_tail(40)),
    }
}

/// Sends a message and reads the turn's event stream to its end: the streamed text and
/// the `end` event.
async fn chat(http: &reqwest::Client, base: &str, session: &str, text: &str) -> (String, Value) {
    use eventsource_stream::Eventsource as _;
    let response = http
        .post(format!("{base}/v1/sessions/{session}/messages"))
        .json(&json!({ "text": text }))
        .send()
        .await
        .expect("send a message");
    assert_eq!(response.status(), 200, "sending a message");
    let mut events = response.bytes_stream().eventsource();
    let mut streamed = String::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = events.next().await {
            let event = event.expect("a well-formed event stream");
            let data: Value = serde_json::from_str(&event.data).expect("event data is JSON");
            match event.event.as_str() {
                "delta" => streamed.push_str(data["text"].as_str().unwrap_or_default()),
                "end" => return data,
                _ => {}
            }
        }
        panic!("the event stream closed without an end event");
    });
    let end = read.await.expect("the turn ended within 30 s");
    (streamed, end)
}

/// The banner's `curl` examples (stdout, in the process's log), once it is printed.
async fn banner_examples(dev: &ExternalProcess) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(dev.log_path()).unwrap_or_default();
        let examples: Vec<String> =
            log.lines().map(str::trim).filter(|l| l.starts_with("curl ")).map(str::to_owned).collect();
        if examples.len() >= 2 {
            return examples;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no curl examples in the banner:\n{}",
            dev.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs a shell command line as a user would paste it; its stdout.
fn run_as_pasted(line: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(line).output().expect("run sh (and curl)");
    assert!(out.status.success(), "`{line}` failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn get_json(http: &reqwest::Client, url: String) -> Value {
    let response = http.get(&url).send().await.expect("GET");
    assert_eq!(response.status(), 200, "GET {url}");
    response.json().await.expect("a JSON body")
}

#[tokio::test]
async fn dev_keeps_the_history_across_a_ctrl_c_and_a_restart() {
    let dir = DataDir::new();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    let mut dev = turnlog_dev(&dir.path, port);
    dev.start().expect("start turnlog dev");
    wait_ready(&http, &base, &mut dev).await;
    let recorded = dir.servers();

    // A second copy on the same directory would share (and then stop) the same servers.
    let second_listen = format!("127.0.0.1:{}", free_port());
    let second = turnlog_dev_output(&dir.path, &[("TURNLOG_LISTEN", &second_listen)]);
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("another `turnlog dev`"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );

    // The banner's examples work as printed: create a session, then chat in it.
    let examples = banner_examples(&dev).await;
    let first: Value =
        serde_json::from_str(&run_as_pasted(&examples[0])).expect("a session from the banner's example");
    assert_eq!(first["title"], "first chat", "{first}");
    let first_id = first["id"].as_str().expect("an id");
    let streamed = run_as_pasted(&examples[1].replace("<id>", first_id));
    assert!(streamed.contains("event: end") && streamed.contains(r#""status":"completed""#), "{streamed}");

    let created = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({ "title": "dev test" }))
        .send()
        .await
        .expect("create a session");
    assert_eq!(created.status(), 201);
    let session: Value = created.json().await.expect("a session");
    let id = session["id"].as_str().expect("an id").to_owned();
    let question = "Remember that Petra moves to Oslo on 3 March.";
    let (answer, end) = chat(&http, &base, &id, question).await;
    assert_eq!(end["status"], "completed", "{end}");
    assert!(!answer.is_empty());
    // One /metrics for the whole stack: the HTTP surface's, the writer's and the workers',
    // merged into one well-formed page (each family once, whole).
    let metrics =
        http.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    if let Err(e) = turnlog_testkit::prometheus::check_exposition(&metrics) {
        panic!("dev's /metrics: {e}\n{metrics}");
    }
    for family in [
        "turnlog_turns_total",
        "turnlog_writer_commit_seconds",
        "turnlog_worker_processed_total{worker=\"distiller\"}",
        "turnlog_worker_processed_total{worker=\"compactor\"}",
    ] {
        assert!(metrics.contains(family), "{family} missing from dev's /metrics:\n{metrics}");
    }

    // An HTML upload is converted by this binary's `convert-html`, in a process of its own.
    let page = "<!doctype html><html><body><h2>Plan</h2><p>ship it</p></body></html>";
    let form = format!(
        "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"plan.html\"\r\n\r\n{page}\r\n--b--\r\n"
    );
    let uploaded = http
        .post(format!("{base}/v1/files"))
        .header("content-type", "multipart/form-data; boundary=b")
        .body(form)
        .send()
        .await
        .expect("upload an HTML page");
    assert_eq!(uploaded.status(), 201);
    let file: Value = uploaded.json().await.expect("a file");
    assert_eq!(file["mime"], "text/html", "{file}");
    assert_eq!(file["markdown_chars"], "## Plan\n\nship it".len(), "{file}");

    let status = interrupt(&mut dev).await;
    assert!(status.success(), "turnlog dev exited with {status} on Ctrl-C:\n{}", dev.log_tail(40));
    // It stopped its servers too: nothing holds the cluster or the store any more.
    let pg_data = dir.postgres_data().expect("the cluster is recorded");
    assert!(!pg_data.join("postmaster.pid").exists(), "the private Postgres is still running");
    let nats_pid = recorded["nats"]["pid"].as_u64().expect("the nats-server pid is recorded");
    let nats_comm = std::fs::read_to_string(format!("/proc/{nats_pid}/comm")).unwrap_or_default();
    assert_ne!(nats_comm.trim(), "nats-server", "the private nats-server is still running");

    dev.start().expect("start turnlog dev again");
    wait_ready(&http, &base, &mut dev).await;
    let again = dir.servers();
    assert_eq!(again["postgres"]["port"], recorded["postgres"]["port"], "the recorded port is reused");
    assert_eq!(again["nats"]["port"], recorded["nats"]["port"], "the recorded port is reused");

    let view = get_json(&http, format!("{base}/v1/sessions/{id}")).await;
    assert_eq!(view["session"]["title"], "dev test");
    let items = view["items"].as_array().expect("items");
    let texts: Vec<(&str, &str)> =
        items.iter().map(|i| (i["kind"].as_str().unwrap_or(""), i["text"].as_str().unwrap_or(""))).collect();
    assert_eq!(texts, [("user", question), ("assistant", answer.as_str())], "{view}");
    let page = get_json(&http, format!("{base}/v1/sessions/{id}/events")).await;
    let kinds: Vec<&str> =
        page["events"].as_array().expect("events").iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds[..3], ["session_started", "user_message", "assistant_turn"], "{page}");

    let status = interrupt(&mut dev).await;
    assert!(status.success(), "turnlog dev exited with {status} on the second Ctrl-C:\n{}", dev.log_tail(40));
}

#[test]
fn a_bad_setting_is_refused_by_name_before_anything_starts() {
    let cases = [
        ("TURNLOG_MODEL_WINDOWS", "mock=lots", "TURNLOG_MODEL_WINDOWS"),
        ("TURNLOG_LISTEN", "0.0.0.0:18080", "TURNLOG_API_TOKENS"),
        ("TURNLOG_API_TOKENS", "alice", "TURNLOG_API_TOKENS"),
        ("TURNLOG_PARTITIONS", "0", "TURNLOG_PARTITIONS"),
        ("TURNLOG_WORKER_RETRY_BACKOFF", "2s,0s", "TURNLOG_WORKER_RETRY_BACKOFF"),
        ("TURNLOG_LOG_FORMAT", "xml", "TURNLOG_LOG_FORMAT"),
        ("TURNLOG_UPLOAD_MIN_RATE", "0", "TURNLOG_UPLOAD_MIN_RATE"),
        ("TURNLOG_CONVERT_TIMEOUT", "soon", "TURNLOG_CONVERT_TIMEOUT"),
        ("RUST_LOG", "info,=[", "RUST_LOG"),
    ];
    for (var, value, named) in cases {
        let dir = DataDir::new();
        let out = turnlog_dev_output(&dir.path, &[(var, value)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value} accepted");
        assert!(stderr.contains(named), "{var}={value}: the message does not name {named}:\n{stderr}");
        assert!(!dir.path.exists(), "{var}={value}: the data directory was created before the check");
    }
}

/// `turnlog convert-html`, as the ingress runs it for each HTML upload: the document on
/// stdin, its markdown on stdout; one nested past the limit refused with its depth on
/// stderr and exit status 3.
#[test]
fn convert_html_reads_a_document_and_refuses_one_nested_too_deep() {
    use std::io::Write as _;
    let convert = |html: &str| {
        let mut child = Command::new(BIN)
            .arg("convert-html")
            .env_clear()
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start turnlog convert-html");
        child.stdin.take().expect("stdin").write_all(html.as_bytes()).expect("write the document");
        child.wait_with_output().expect("turnlog convert-html ends")
    };
    let out =
        convert("<html><head><script>x()</script></head><body><h1>Hi</h1><p>a <b>b</b></p></body></html>");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "# Hi\n\na **b**");
    let out = convert(&format!("<html><body>{}</body></html>", "<span/>".repeat(200_000)));
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("nests 200001 elements deep"), "{stderr}");
}
