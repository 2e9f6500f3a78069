//! The MCP servers the tool suites run (DESIGN §14): the reference servers from npm and the
//! suites' own server on the official SDK, pinned in `tests/mcp` and installed outside the
//! clone by `tests/mcp/setup` (once per lockfile; `TURNLOG_TEST_MCP` names an installed
//! directory instead). Real servers over real transports: nothing of the protocol is faked.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use turnlog_runtime::bus::Bus;
use turnlog_runtime::tools::{ServerCatalog, ToolsBus};

/// The directory holding `node_modules/.bin/mcp-server-*` and the suites' server scripts.
pub fn servers_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("TURNLOG_TEST_MCP").filter(|d| !d.is_empty()) {
            return dir.into();
        }
        let setup = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mcp/setup");
        let out = std::process::Command::new("bash").arg(&setup).output().unwrap_or_else(|e| {
            panic!("running {}: {e} (the MCP tests need Node.js and npm)", setup.display())
        });
        assert!(
            out.status.success(),
            "{} failed (the MCP tests need Node.js and npm): {}",
            setup.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// The command line of a reference server's binary.
pub fn bin(name: &str) -> String {
    servers_dir().join("node_modules/.bin").join(name).display().to_string()
}

/// The path of one of the suites' own server scripts (run with `node`).
pub fn script(name: &str) -> String {
    servers_dir().join(name).display().to_string()
}

/// Waits until the catalogue lists every server of `labels` as up (the bus's topology
/// made by a service that may still be starting), and returns it.
pub async fn catalog_ready(bus: &Bus, labels: &[&str]) -> Vec<ServerCatalog> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let tools = loop {
        match ToolsBus::open(bus).await {
            Ok(tools) => break tools,
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the tools' buckets never came: {e}"),
        }
    };
    loop {
        let catalog = tools.catalog().await.unwrap();
        if labels.iter().all(|l| catalog.iter().any(|s| s.label == *l && s.up)) {
            return catalog;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the MCP servers {labels:?} never came up: {catalog:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
