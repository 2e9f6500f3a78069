//! `GET /v1/sessions/{id}/export`: a session's whole branch log in a format people use
//! (issue 25, the export half): `turnlog` (the lossless event JSONL), `markdown` (to read),
//! `openai` (the messages array) or `sharegpt`.

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::ids::SessionId;
use turnlog_core::ui_transcript::{ui_transcript, ItemKind, TranscriptItem};
use turnlog_runtime::read::{self, SessionRow};
use utoipa::IntoParams;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath, ApiQuery};
use crate::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportParams {
    /// `turnlog` (default), `markdown`, `openai` or `sharegpt`.
    pub format: Option<String>,
}

/// A session in a format people use: `turnlog` is every event of its branch log as JSON
/// lines after a header line (lossless); `markdown` the transcript to read; `openai` the
/// conversation as a chat messages array; `sharegpt` the ShareGPT shape.
#[utoipa::path(
    get, path = "/v1/sessions/{id}/export", tag = "sessions", security(("bearer" = [])),
    params(("id" = uuid::Uuid, Path, description = "Session id"), ExportParams),
    responses(
        (status = 200, description = "The export, as an attachment"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody),
    )
)]
#[tracing::instrument(skip_all, fields(session_id = %id), err(Display, level = "debug"))]
pub async fn export(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<SessionId>,
    ApiQuery(params): ApiQuery<ExportParams>,
) -> Result<Response, ApiError> {
    let format = params.format.as_deref().unwrap_or("turnlog");
    let (content_type, extension) = match format {
        "turnlog" => ("application/x-ndjson", "jsonl"),
        "markdown" => ("text/markdown; charset=utf-8", "md"),
        "openai" | "sharegpt" => ("application/json", "json"),
        other => {
            let shown: String = other.chars().take(40).collect();
            return Err(ApiError::bad_request(format!(
                "format must be turnlog, markdown, openai or sharegpt, not {shown:?}"
            )));
        }
    };
    let owner = caller.as_str();
    let session = read::get_session(&app.pool, owner, id).await?.ok_or_else(ApiError::session_not_found)?;
    let events = read::all_events(&app.pool, owner, id).await?.ok_or_else(ApiError::session_not_found)?;
    let body = match format {
        "turnlog" => turnlog(&session, &events),
        "markdown" => markdown(&session, &ui_transcript(&events)),
        "openai" => json_text(&Value::Array(messages(&ui_transcript(&events)))),
        _ => json_text(&sharegpt(&session, &ui_transcript(&events))),
    };
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let disposition = format!("attachment; filename=\"session-{id}.{extension}\"");
    if let Ok(v) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(response)
}

fn json_text(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// The header line: what the session is, beside its events.
fn header(s: &SessionRow) -> Value {
    json!({
        "format": "turnlog",
        "version": 1,
        "session": {
            "id": s.id,
            "title": s.title,
            "archived": s.archived,
            "metadata": s.metadata,
            "created_at": s.created_at,
            "updated_at": s.updated_at,
            "forked_from": s.forked_from.map(|p| json!({"session_id": p, "through_seq": s.forked_through})),
        },
    })
}

/// One JSON line for the header, then one per event of the branch log, in seq order:
/// `{seq, event_id, kind, payload, created_at}` — the payload exactly as stored.
fn turnlog(session: &SessionRow, events: &[turnlog_core::events::Event]) -> String {
    let mut out = header(session).to_string();
    out.push('\n');
    for e in events {
        let line = json!({
            "seq": e.seq,
            "event_id": e.event_id,
            "kind": e.kind().as_str(),
            "payload": e.body.to_payload(),
            "created_at": e.created_at,
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    out
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

/// The transcript to read: every item, with its time, the model of each answer and what
/// each message attached.
fn markdown(session: &SessionRow, items: &[TranscriptItem]) -> String {
    let mut out =
        format!("# {}\n\n", session.title.as_deref().filter(|t| !t.trim().is_empty()).unwrap_or("Untitled"));
    for i in items {
        let at = i.created_at.format("%Y-%m-%d %H:%M UTC");
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
