//! The servers file (`TURNLOG_MCP_SERVERS`, DESIGN §14): `[[servers]]` tables with a label,
//! a transport (`command` + `args` + `env` for stdio, or `url` + `headers` for streamable
//! HTTP, each header's value naming the environment variable that holds it), a tool filter
//! (`include`, `exclude`), the owners it serves, and per tool a policy and a danger level.
//! A file that does not parse or check stops the worker with a message naming its line.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use turnlog_runtime::tools::{DangerLevel, Policy};

/// Longest label: `<label>__<tool>` must stay within the 64 characters a model's tool name has.
const MAX_LABEL: usize = 24;

/// One configured MCP server.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub label: String,
    pub transport: Transport,
    pub include: Option<Vec<String>>,
    pub exclude: Vec<String>,
    pub owners: Option<Vec<String>>,
    pub tools: BTreeMap<String, ToolRule>,
}

/// Never prints header values or environment values (they hold secrets).
impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let transport = match &self.transport {
            Transport::Stdio { command, args, .. } => format!("stdio {command} {args:?}"),
            Transport::Http { url, headers } => {
                format!("http {url} (headers {:?})", headers.keys().collect::<Vec<_>>())
            }
        };
        f.debug_struct("ServerConfig").field("label", &self.label).field("transport", &transport).finish()
    }
}

#[derive(Clone, PartialEq, Eq)]
pub enum Transport {
    /// A process the worker spawns and supervises, speaking MCP on stdin/stdout.
    Stdio { command: String, args: Vec<String>, env: BTreeMap<String, String> },
    /// Streamable HTTP; the headers' values as read from the environment.
    Http { url: String, headers: BTreeMap<String, String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolRule {
    #[serde(default)]
    pub policy: Policy,
    #[serde(default)]
    pub danger_level: DangerLevel,
}

impl ServerConfig {
    /// Whether the filter lets a tool of the server through.
    pub fn offers(&self, tool: &str) -> bool {
        self.include.as_ref().is_none_or(|i| i.iter().any(|t| t == tool))
            && !self.exclude.iter().any(|t| t == tool)
    }

    pub fn rule(&self, tool: &str) -> ToolRule {
        self.tools.get(tool).copied().unwrap_or_default()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    servers: Vec<toml::Spanned<RawServer>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    label: String,
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    url: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    include: Option<Vec<String>>,
    #[serde(default)]
    exclude: Vec<String>,
    owners: Option<Vec<String>>,
    #[serde(default)]
    tools: BTreeMap<String, ToolRule>,
}

/// Reads and checks the servers file; `env` looks up the variables headers name.
pub fn load(path: &Path, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Vec<ServerConfig>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("TURNLOG_MCP_SERVERS: cannot read {}: {e}", path.display()))?;
    parse(&text, env).map_err(|e| anyhow::anyhow!("TURNLOG_MCP_SERVERS ({}): {e}", path.display()))
}

/// The 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|b| *b == b'\n').count() + 1
}

pub fn parse(text: &str, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Vec<ServerConfig>> {
    // toml's message names the line and column of a syntax or type error.
    let file: File = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut labels = HashSet::new();
    let mut servers = Vec::with_capacity(file.servers.len());
    for spanned in file.servers {
        let line = line_of(text, spanned.span().start);
        let raw = spanned.into_inner();
        let at = |why: String| anyhow::anyhow!("line {line}: server {:?}: {why}", raw.label);
        let label_ok = (1..=MAX_LABEL).contains(&raw.label.len())
            && raw.label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !label_ok {
            return Err(at(format!("a label is 1-{MAX_LABEL} letters, digits or -")));
        }
        if !labels.insert(raw.label.clone()) {
            return Err(at("the label is used twice".into()));
        }
        let transport = match (raw.command, raw.url) {
            (Some(command), None) => {
                if !raw.headers.is_empty() {
                    return Err(at("headers go with url, not command".into()));
                }
                if command.trim().is_empty() {
                    return Err(at("command is empty".into()));
                }
                Transport::Stdio { command, args: raw.args, env: raw.env }
            }
            (None, Some(url)) => {
                if !raw.args.is_empty() || !raw.env.is_empty() {
                    return Err(at("args and env go with command, not url".into()));
                }
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(at("url must be http:// or https://".into()));
                }
                let mut headers = BTreeMap::new();
                for (name, variable) in raw.headers {
                    let value = env(&variable).ok_or_else(|| {
                        at(format!(
                            "header {name} names the environment variable {variable}, which is not set"
                        ))
                    })?;
                    headers.insert(name, value);
                }
                Transport::Http { url, headers }
            }
            _ => return Err(at("give either command (stdio) or url (streamable HTTP)".into())),
        };
        if raw.owners.as_ref().is_some_and(|o| o.is_empty()) {
            return Err(at("owners, when given, names at least one owner".into()));
        }
        servers.push(ServerConfig {
            label: raw.label,
            transport,
            include: raw.include,
            exclude: raw.exclude,
            owners: raw.owners,
            tools: raw.tools,
        });
    }
    Ok(servers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        (name == "SEARCH_TOKEN").then(|| "Bearer s3cret".to_owned())
    }

    #[test]
    fn a_file_with_both_transports_parses() {
        let text = r#"
[[servers]]
label = "fs"
command = "mcp-server-filesystem"
args = ["/srv/files"]
exclude = ["move_file"]
[servers.tools.write_file]
policy = "ask"
danger_level = "high"

[[servers]]
label = "search"
url = "http://127.0.0.1:3001/mcp"
headers = { Authorization = "SEARCH_TOKEN" }
owners = ["alice"]
"#;
        let servers = parse(text, env).unwrap();
        assert_eq!(servers.len(), 2);
        assert_eq!(
            servers[0].rule("write_file"),
            ToolRule { policy: Policy::Ask, danger_level: DangerLevel::High }
        );
        assert_eq!(servers[0].rule("read_file"), ToolRule::default());
        assert!(servers[0].offers("read_file") && !servers[0].offers("move_file"));
        let Transport::Http { headers, .. } = &servers[1].transport else { panic!() };
        assert_eq!(headers["Authorization"], "Bearer s3cret");
        // The secret never reaches a log line.
        assert!(!format!("{:?}", servers[1]).contains("s3cret"));
    }

    #[test]
    fn the_deployed_example_parses() {
        let text = include_str!("../../../deploy/mcp-servers.toml");
        let servers = parse(text, |_| None).unwrap();
        assert_eq!(servers[0].rule("write_file").policy, Policy::Ask);
    }

    #[test]
    fn mistakes_name_their_line() {
        let bad = |text: &str| parse(text, env).unwrap_err().to_string();
        let e = bad(
            "[[servers]]\nlabel = \"a\"\ncommand = \"x\"\n\n[[servers]]\nlabel = \"a\"\ncommand = \"y\"\n",
        );
        assert!(e.contains("line 5") && e.contains("twice"), "{e}");
        let e = bad("[[servers]]\nlabel = \"a\"\n");
        assert!(e.contains("line 1") && e.contains("either command"), "{e}");
        let e = bad("[[servers]]\nlabel = \"a\"\nurl = \"http://x\"\nheaders = { X = \"NOPE\" }\n");
        assert!(e.contains("NOPE") && e.contains("not set"), "{e}");
        let e = bad("[[servers]]\nlabel = \"a\"\ncommand = \"x\"\n[servers.tools.t]\npolicy = \"maybe\"\n");
        assert!(e.contains("line 5"), "{e}");
        let e = bad("[[servers]]\nlabel = \"a__b\"\ncommand = \"x\"\n");
        assert!(e.contains("label"), "{e}");
        let e = bad("[[servers]]\nlabel = \"a\"\ncommand = \"x\"\nsurprise = 1\n");
        assert!(e.contains("line 4") && e.contains("surprise"), "{e}");
    }
}
