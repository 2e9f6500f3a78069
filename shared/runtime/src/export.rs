//! Taking sessions out (issue 25), for `GET /v1/sessions/{id}/export` and `turnlog export`:
//! `turnlog` (lossless JSON lines of a whole session family, what `turnlog import` reads
//! back), `markdown` (to read), `openai` (the messages array) and `sharegpt`.

use std::io::Write;

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use sqlx::PgPool;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::import::turnlog::VERSION;
use turnlog_core::ui_transcript::{ui_transcript, ItemKind, TranscriptItem};
use uuid::Uuid;

use crate::read::{self, ReadError, SessionRow, SESSION_COLUMNS};

/// The formats a session is exported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    Turnlog,
    Markdown,
    OpenAi,
    ShareGpt,
}

impl ExportFormat {
    /// Its media type and file extension.
    pub fn media(self) -> (&'static str, &'static str) {
        match self {
            Self::Turnlog => ("application/x-ndjson", "jsonl"),
            Self::Markdown => ("text/markdown; charset=utf-8", "md"),
            Self::OpenAi | Self::ShareGpt => ("application/json", "json"),
        }
    }
}

/// A format name that is none of [`ExportFormat`]'s, shown up to 40 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("format must be turnlog, markdown, openai or sharegpt, not {0:?}")]
pub struct UnknownExportFormat(String);

impl std::str::FromStr for ExportFormat {
    type Err = UnknownExportFormat;
    fn from_str(s: &str) -> Result<Self, UnknownExportFormat> {
        match s {
            "turnlog" => Ok(Self::Turnlog),
            "markdown" => Ok(Self::Markdown),
            "openai" => Ok(Self::OpenAi),
            "sharegpt" => Ok(Self::ShareGpt),
            other => Err(UnknownExportFormat(other.chars().take(40).collect())),
        }
    }
}

/// The owner's session `id` exported, or None when it is not theirs. `turnlog` holds its
/// whole family (the root of its lineage and every fork of it, as a ChatGPT conversation
/// holds every branch); the others its branch log, as the user sees it.
pub async fn session(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
    format: ExportFormat,
) -> Result<Option<Vec<u8>>, ReadError> {
    let Some(session) = read::get_session(pool, owner, id).await? else { return Ok(None) };
    let mut out = Vec::new();
    if format == ExportFormat::Turnlog {
        let root = session.lineage.first().map_or(id, |r| SessionId(*r));
        family(pool, owner, root, &mut out).await?;
        return Ok(Some(out));
    }
    let Some(events) = read::all_events(pool, owner, id).await? else { return Ok(None) };
    let items = ui_transcript(&events);
    let text = match format {
        ExportFormat::Markdown => markdown(&session, &items),
        ExportFormat::OpenAi => pretty(&Value::Array(messages(&items))),
        _ => pretty(&sharegpt(&session, &items)),
    };
    Ok(Some(text.into_bytes()))
}

/// Every session of `owner` exported to `out`: in `turnlog`, every family; in `markdown`
/// every session's transcript one after the other; in `openai` one JSON line
/// `{"messages": […]}` a session (the fine-tuning shape); in `sharegpt` a JSON array.
/// Returns how many sessions it wrote.
pub async fn owner(
    pool: &PgPool,
    owner: &Owner,
    format: ExportFormat,
    out: &mut impl Write,
) -> Result<usize, ReadError> {
    let mut written = 0;
    if format == ExportFormat::Turnlog {
        let roots: Vec<(Uuid,)> = sqlx::query_as(
            "SELECT id FROM sessions WHERE owner = $1 AND forked_from IS NULL ORDER BY created_at, id",
        )
        .bind(owner.as_str())
        .fetch_all(pool)
        .await?;
        for (root,) in roots {
            let mut family_out = Vec::new();
            written += family(pool, owner, SessionId(root), &mut family_out).await?;
            out.write_all(&family_out).map_err(io)?;
        }
        return Ok(written);
    }
    let ids: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT id FROM sessions WHERE owner = $1 AND hidden_seq IS NULL ORDER BY created_at, id",
    )
    .bind(owner.as_str())
    .fetch_all(pool)
    .await?;
    if format == ExportFormat::ShareGpt {
        out.write_all(b"[").map_err(io)?;
    }
    for (id,) in ids {
        let id = SessionId(id);
        let (Some(session), Some(events)) =
            (read::get_session(pool, owner, id).await?, read::all_events(pool, owner, id).await?)
        else {
            continue; // deleted meanwhile
        };
        let items = ui_transcript(&events);
        let text = match format {
            ExportFormat::Markdown => markdown(&session, &items) + "\n",
            ExportFormat::OpenAi => json!({"messages": messages(&items)}).to_string() + "\n",
            _ => format!("{}{}", if written > 0 { ",\n" } else { "\n" }, sharegpt(&session, &items)),
        };
        out.write_all(text.as_bytes()).map_err(io)?;
        written += 1;
    }
    if format == ExportFormat::ShareGpt {
        out.write_all(b"\n]\n").map_err(io)?;
    }
    Ok(written)
}

fn io(e: std::io::Error) -> ReadError {
    ReadError::Sql(sqlx::Error::Io(e))
}

/// The family of `root` in turnlog lines: each session (a parent before its forks) as a
/// header line and its own events. A session deleted while forks inherit its prefix is
/// written with `deleted: true` and that prefix, so an import rebuilds the same family.
async fn family(
    pool: &PgPool,
    owner: &Owner,
    root: SessionId,
    out: &mut Vec<u8>,
) -> Result<usize, ReadError> {
    let sessions: Vec<SessionRow> = sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions
          WHERE owner = $2 AND (id = $1 OR lineage && ARRAY[$1]::uuid[])
          ORDER BY cardinality(lineage), created_at, id"
    ))
    .bind(root.0)
    .bind(owner.as_str())
    .fetch_all(pool)
    .await?;
    for s in &sessions {
        writeln!(out, "{}", header(s)).map_err(io)?;
        let rows: Vec<(i64, Uuid, String, Value, DateTime<Utc>)> = sqlx::query_as(
            "SELECT seq, event_id, kind, payload, created_at FROM session_events WHERE session_id = $1 ORDER BY seq",
        )
        .bind(s.id.0)
        .fetch_all(pool)
        .await?;
        for (seq, event_id, kind, payload, created_at) in rows {
            let line = json!({"seq": seq, "event_id": event_id, "kind": kind, "payload": payload, "created_at": created_at});
            writeln!(out, "{line}").map_err(io)?;
        }
    }
    Ok(sessions.len())
}

/// A session's header line.
fn header(s: &SessionRow) -> Value {
    let mut session = json!({
        "id": s.id,
        "title": s.title,
        "archived": s.archived,
        "metadata": s.metadata,
        "created_at": s.created_at,
        "updated_at": s.updated_at,
        "forked_from": s.fork_point(),
    });
    if s.hidden_seq.is_some() {
        session["deleted"] = Value::Bool(true);
    }
    json!({"format": "turnlog", "version": VERSION, "session": session})
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// The conversation as chat messages: user messages and answers (an interrupted answer as
/// far as it got).
fn messages(items: &[TranscriptItem]) -> Vec<Value> {
    items
        .iter()
        .filter_map(|i| {
            let role = match i.kind {
                ItemKind::User => "user",
                ItemKind::Assistant | ItemKind::Interrupted => "assistant",
                _ => return None,
            };
            let text = i.text.clone().unwrap_or_default();
            (!text.is_empty()).then(|| json!({"role": role, "content": text}))
        })
        .collect()
}

fn sharegpt(session: &SessionRow, items: &[TranscriptItem]) -> Value {
    let turns: Vec<Value> = messages(items)
        .into_iter()
        .map(|m| {
            let from = if m["role"] == "user" { "human" } else { "gpt" };
            json!({"from": from, "value": m["content"]})
        })
        .collect();
    json!({"id": session.id, "title": session.title, "conversations": turns})
}

/// The transcript to read: every item, with its time (an imported message's original
/// time), the model of each answer and what each message attached.
fn markdown(session: &SessionRow, items: &[TranscriptItem]) -> String {
    let mut out =
        format!("# {}\n\n", session.title.as_deref().filter(|t| !t.trim().is_empty()).unwrap_or("Untitled"));
    for i in items {
        let time = i.imported.as_ref().and_then(|m| m.created_at).unwrap_or(i.created_at);
        let at = time.format("%Y-%m-%d %H:%M UTC");
        let text = i.text.as_deref().unwrap_or_default();
        match i.kind {
            ItemKind::User => out.push_str(&format!("## You · {at}\n\n{text}\n")),
            ItemKind::Assistant => {
                let model = i.model.as_deref().map(|m| format!(" ({m})")).unwrap_or_default();
                out.push_str(&format!("## Assistant{model} · {at}\n\n{text}\n"));
            }
            ItemKind::Interrupted => out.push_str(&format!("## Assistant (interrupted) · {at}\n\n{text}\n")),
            ItemKind::Error => out.push_str(&format!("> **The turn failed** · {at}: {text}\n")),
            ItemKind::Compaction => {
                let through = i.through_seq.unwrap_or_default();
                out.push_str(&format!(
                    "---\n\n*The model sees the turns up to #{through} as a summary from here on.*\n\n---\n"
                ));
            }
            ItemKind::Tool | ItemKind::Permission => {
                let name = i
                    .tool
                    .as_ref()
                    .map(|t| t.name.as_str())
                    .or(i.permission.as_ref().map(|p| p.tool.as_str()));
                out.push_str(&format!("> Tool `{}` · {at}\n", name.unwrap_or("?")));
            }
        }
        for image in i.images.iter().flatten() {
            out.push_str(&format!("\n*Attached: an image ({}), file {}*\n", image.mime, image.id));
        }
        for d in i.documents.iter().flatten() {
            out.push_str(&format!(
                "\n*Attached: {} ({}), file {}*\n",
                d.name.as_deref().unwrap_or("a document"),
                d.mime,
                d.id
            ));
        }
        out.push('\n');
    }
    out
}
