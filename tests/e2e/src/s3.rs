//! An S3-compatible server for the file tests: the one `TURNLOG_TEST_S3_ENDPOINT` names
//! (`.ci/run` starts moto there), or else moto started for this test process by
//! `tests/s3/moto-server` (which installs it into a venv the first time).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use uuid::Uuid;

pub struct S3 {
    pub endpoint: String,
    /// The moto server this process started, stopped on drop.
    child: Option<Child>,
}

impl Drop for S3 {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl S3 {
    /// The server, with the `AWS_*` variables the ingress's S3 client reads set for it.
    pub async fn start() -> S3 {
        let (endpoint, child) = match std::env::var("TURNLOG_TEST_S3_ENDPOINT") {
            Ok(e) if !e.trim().is_empty() => (e.trim_end_matches('/').to_owned(), None),
            _ => {
                let port = turnlog_testkit::free_port();
                let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../s3/moto-server");
                let child = Command::new(script)
                    .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("starting {script}: {e}"));
                (format!("http://127.0.0.1:{port}"), Some(child))
            }
        };
        let s3 = S3 { endpoint, child };
        let http = reqwest::Client::new();
        // The first start installs moto (about a minute).
        for _ in 0..1800 {
            if http.get(format!("{}/", s3.endpoint)).send().await.is_ok() {
                for (k, v) in [
                    ("AWS_ENDPOINT_URL", s3.endpoint.as_str()),
                    ("AWS_ALLOW_HTTP", "true"),
                    ("AWS_ACCESS_KEY_ID", "turnlog-test"),
                    ("AWS_SECRET_ACCESS_KEY", "turnlog-test"),
                    ("AWS_REGION", "us-east-1"),
                ] {
                    std::env::set_var(k, v);
                }
                return s3;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the S3 server at {} did not answer within 180 s", s3.endpoint);
    }

    /// A new bucket; its `s3://` URL with a prefix.
    pub async fn bucket(&self) -> String {
        let name = format!("turnlog-{}", Uuid::new_v4().simple());
        let r = reqwest::Client::new().put(format!("{}/{name}", self.endpoint)).send().await.unwrap();
        assert!(r.status().is_success(), "creating bucket {name}: {}", r.status());
        format!("s3://{name}/files")
    }
}
