//! A turn as Chat Completions (DESIGN §13): a pure fold of its native events into
//! `chat.completion.chunk`s and the `chat.completion`, streamed or answered whole.

use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::BoxStream;
use futures::StreamExt as _;
use serde_json::{json, Value};
use turnlog_core::ids::{AttemptId, SessionId};
use turnlog_core::stream::{StreamEvent, TurnEnd, TurnEvent, TurnStatus};

use crate::error::ApiError;
use crate::openai::OaiError;
use crate::sse;

/// What a turn's native events add up to: a pure fold of its [`TurnEvent`]s into Chat
/// Completions chunks and the completion.
#[derive(Default)]
pub struct Answer {
    id: String,
    created: i64,
    model: String,
    text: String,
    reasoning: String,
    /// The calls of a step that asks for tools, as streamed.
    tool_calls: Vec<Value>,
    error: Option<String>,
    end: Option<TurnEnd>,
}

impl Answer {
    /// Takes in a native event; the chunk it streams as, if any.
    fn on(&mut self, e: &TurnEvent) -> Option<Value> {
        match e {
            TurnEvent::Meta(m) => {
                let attempt = m.attempt_id.as_ref().and_then(AttemptId::as_uuid).unwrap_or_default();
                self.id = format!("chatcmpl-{}", attempt.simple());
                self.created = attempt.get_timestamp().map_or(0, |t| t.to_unix().0 as i64);
                self.model = m.model.clone().unwrap_or_default();
                Some(self.chunk(json!({"role": "assistant", "content": ""}), None))
            }
            TurnEvent::Delta(t) => {
                self.text.push_str(&t.text);
                Some(self.chunk(json!({"content": t.text}), None))
            }
            TurnEvent::Reasoning(t) => {
                self.reasoning.push_str(&t.text);
                Some(self.chunk(json!({"reasoning_content": t.text}), None))
            }
            TurnEvent::Error(e) => {
                self.error = Some(e.message.clone());
                None
            }
            TurnEvent::End(end) => {
                self.end = Some(end.clone());
                None
            }
            // The server's tools run within the turn (DESIGN §14): the client sees their
            // effect in the answer, never a call it must make.
            TurnEvent::ToolCall(c) if c.source != "client" => None,
            TurnEvent::Permission(_) => None,
            // A call streams whole: its id, name and all its arguments in one chunk.
            TurnEvent::ToolCall(c) => {
                let call = json!({
                    "index": self.tool_calls.len(), "id": c.call_id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                self.tool_calls.push(call.clone());
                Some(self.chunk(json!({"tool_calls": [call]}), None))
            }
            // The results the client sent: nothing to stream back.
            TurnEvent::ToolResult(_) => None,
        }
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    /// `stop` or `length` when the turn ended with an answer (stopped ones included),
    /// `tool_calls` when it waits for the client's tools; else the failure's message.
    fn finish_reason(&self) -> Result<&'static str, NoAnswer> {
        let failed =
            || Err(NoAnswer::Failed(self.error.clone().unwrap_or_else(|| "the answer failed".into())));
        let Some(end) = &self.end else { return failed() };
        match end.status {
            TurnStatus::Completed if end.hit_length() => Ok("length"),
            // Waiting for the client's tools; a turn paused only on a server tool's prompt
            // (answered in the web client or the native API) has nothing for the client to run.
            TurnStatus::RequiresAction if end.required.iter().any(|r| r.kind == "tool") => Ok("tool_calls"),
            TurnStatus::RequiresAction => Ok("stop"),
            TurnStatus::Completed | TurnStatus::Stopped => Ok("stop"),
            TurnStatus::Interrupted => Err(NoAnswer::Interrupted(end.session_id)),
            TurnStatus::Failed => failed(),
        }
    }

    /// OpenAI's usage object, with the cached share of the prompt.
    fn usage(&self) -> Value {
        let Some(u) = self.end.as_ref().and_then(|e| e.usage) else { return Value::Null };
        let (input, output) = (u.input_tokens, u.output_tokens);
        json!({
            "prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output,
            "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens.unwrap_or(0)},
        })
    }
}

/// A streamed completion: `chat.completion.chunk`s, the finish (or an error object, as
/// OpenAI streams one), the usage chunk when asked for, then `data: [DONE]`.
pub fn chunks(events: BoxStream<'static, StreamEvent>, include_usage: bool) -> Response {
    let chunks = futures::stream::unfold(
        (events, Answer::default(), false),
        move |(mut events, mut a, done)| async move {
            if done {
                return None;
            }
            loop {
                let Some(e) = events.next().await else {
                    return Some((end_chunks(&a, include_usage), (events, a, true)));
                };
                if let Some(chunk) = a.on(&e.event) {
                    return Some((vec![chunk], (events, a, false)));
                }
                if e.is_end() {
                    return Some((end_chunks(&a, include_usage), (events, a, true)));
                }
            }
        },
    )
    .flat_map(futures::stream::iter)
    .map(|chunk| (None, chunk));
    sse::openai(chunks)
}

/// Why a turn gives no completion: its failure's message (or that it failed, when none
/// came), or that it was interrupted, its partial text kept in its session.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
enum NoAnswer {
    #[error("{0}")]
    Failed(String),
    #[error(
        "the answer was interrupted; its partial text is kept in session {}",
        .0.map(|s| s.to_string()).unwrap_or_default()
    )]
    Interrupted(Option<SessionId>),
}

fn end_chunks(a: &Answer, include_usage: bool) -> Vec<Value> {
    let mut out = vec![match a.finish_reason() {
        Ok(reason) => a.chunk(json!({}), Some(reason)),
        Err(e) => {
            json!({"error": {"message": e.to_string(), "type": "server_error", "param": null, "code": null}})
        }
    }];
    if include_usage {
        let mut usage = a.chunk(json!({}), None);
        usage["choices"] = json!([]);
        usage["usage"] = a.usage();
        out.push(usage);
    }
    out
}

/// A completion answered whole: `chat.completion`, or the turn's failure as an error.
pub async fn completion(mut events: BoxStream<'static, StreamEvent>) -> Result<Response, OaiError> {
    let mut a = Answer::default();
    while let Some(e) = events.next().await {
        a.on(&e.event);
    }
    let finish = a.finish_reason().map_err(|e| OaiError(ApiError::BadGateway(e.to_string())))?;
    let content = if a.text.is_empty() && !a.tool_calls.is_empty() { Value::Null } else { json!(a.text) };
    let mut message = json!({"role": "assistant", "content": content, "refusal": null});
    if !a.tool_calls.is_empty() {
        message["tool_calls"] = json!(a.tool_calls);
    }
    if !a.reasoning.is_empty() {
        message["reasoning_content"] = json!(a.reasoning);
    }
    Ok(Json(json!({
        "id": a.id, "object": "chat.completion", "created": a.created, "model": a.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
        "usage": a.usage(),
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use turnlog_core::ids::SessionId;
    use turnlog_core::stream::{Meta, Text};
    use uuid::Uuid;

    use super::*;

    #[test]
    fn a_turn_reads_as_chunks_and_a_completion() {
        let event = |_id: u64, event: &str, data: Value| TurnEvent::from_parts(event, data).unwrap();
        let attempt = Uuid::now_v7();
        let mut a = Answer::default();
        let first =
            a.on(&event(1, "meta", json!({"attempt_id": attempt.to_string(), "model": "m"}))).unwrap();
        assert_eq!(first["id"], format!("chatcmpl-{}", attempt.simple()));
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            a.on(&event(2, "delta", json!({"text": "Hel"}))).unwrap()["choices"][0]["delta"]["content"],
            "Hel"
        );
        a.on(&event(3, "delta", json!({"text": "lo"})));
        let usage = json!({"input_tokens": 10, "output_tokens": 2, "cached_input_tokens": 8});
        assert!(a
            .on(&event(4, "end", json!({"status": "completed", "finish_reason": "length", "usage": usage})))
            .is_none());
        assert_eq!((a.text.as_str(), a.finish_reason()), ("Hello", Ok("length")));
        assert_eq!(a.usage()["prompt_tokens_details"]["cached_tokens"], 8);
        let ends = end_chunks(&a, true);
        assert_eq!(ends[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            (ends[1]["choices"].as_array().map(Vec::len), &ends[1]["usage"]["total_tokens"]),
            (Some(0), &json!(12))
        );
        let mut failed = Answer::default();
        failed.on(&event(
            1,
            "error",
            json!({"code": "upstream_error", "message": "the model gateway answered 500"}),
        ));
        failed.on(&event(2, "end", json!({"status": "failed"})));
        assert_eq!(end_chunks(&failed, false)[0]["error"]["message"], "the model gateway answered 500");
    }

    #[test]
    fn how_a_turn_ended_is_how_its_completion_finishes() {
        let session = SessionId::new();
        let attempt = Uuid::now_v7();
        let meta = Meta { attempt_id: Some(attempt.into()), model: Some("m".into()), ..Default::default() };
        let text = |t: &str| Text { text: t.into() };
        let fold = |ending: Option<TurnStatus>| {
            let mut events = vec![
                TurnEvent::Meta(meta.clone()),
                TurnEvent::Reasoning(text("hm")),
                TurnEvent::Delta(text("Hi")),
            ];
            events.extend(ending.map(|status| TurnEvent::End(TurnEnd::new(Some(session), status))));
            let mut a = Answer::default();
            let chunks: Vec<Value> = events.iter().filter_map(|e| a.on(e)).collect();
            (a, chunks)
        };
        let (stopped, chunks) = fold(Some(TurnStatus::Stopped));
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(
            deltas,
            [
                &json!({"role": "assistant", "content": ""}),
                &json!({"reasoning_content": "hm"}),
                &json!({"content": "Hi"})
            ]
        );
        assert!(chunks
            .iter()
            .all(|c| c["id"] == format!("chatcmpl-{}", attempt.simple()) && c["model"] == "m"));
        // A stopped answer is an answer: it finishes as `stop`, without usage when none came.
        let ends = end_chunks(&stopped, true);
        assert_eq!(ends[0]["choices"][0]["finish_reason"], "stop");
        assert_eq!(ends[1]["usage"], Value::Null);
        let (interrupted, _) = fold(Some(TurnStatus::Interrupted));
        let message = end_chunks(&interrupted, false)[0]["error"]["message"].clone();
        assert_eq!(
            message,
            format!("the answer was interrupted; its partial text is kept in session {session}")
        );
        let (cut, _) = fold(None);
        assert_eq!(end_chunks(&cut, false)[0]["error"]["message"], "the answer failed");
    }

    #[test]
    fn a_step_that_asks_for_tools_streams_its_calls_and_finishes_as_tool_calls() {
        use turnlog_core::stream::{Required, ToolCallEvent};
        let mut a = Answer::default();
        a.on(&TurnEvent::Meta(Meta { model: Some("m".into()), ..Default::default() }));
        let call = ToolCallEvent {
            call_id: "call_1".into(),
            name: "weather".into(),
            arguments: r#"{"city":"Oslo"}"#.into(),
            source: "client".into(),
        };
        let chunk = a.on(&TurnEvent::ToolCall(call)).unwrap();
        assert_eq!(
            chunk["choices"][0]["delta"]["tool_calls"],
            json!([{"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}])
        );
        let mut end = TurnEnd::new(None, TurnStatus::RequiresAction);
        end.required = vec![Required {
            call_id: "call_1".into(),
            name: "weather".into(),
            arguments: "{}".into(),
            kind: "tool".into(),
            permission_id: None,
        }];
        a.on(&TurnEvent::End(end));
        assert_eq!(end_chunks(&a, false)[0]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn server_calls_stream_nothing_and_a_prompt_alone_finishes_as_stop() {
        use turnlog_core::events::ToolCall;
        use turnlog_core::stream::{PermissionEvent, Required, ToolCallEvent};
        let mut a = Answer::default();
        a.on(&TurnEvent::Meta(Meta { model: Some("m".into()), ..Default::default() }));
        let call = ToolCallEvent {
            call_id: "call_1".into(),
            name: "files__write_file".into(),
            arguments: "{}".into(),
            source: "mcp:files".into(),
        };
        assert_eq!(a.on(&TurnEvent::ToolCall(call)), None);
        let prompt = PermissionEvent {
            id: "perm_1".into(),
            call_id: "call_1".into(),
            tool: "files__write_file".into(),
            args: json!({}),
            danger_level: "high".into(),
        };
        assert_eq!(a.on(&TurnEvent::Permission(prompt)), None);
        let mut end = TurnEnd::new(None, TurnStatus::RequiresAction);
        let asked =
            ToolCall { id: "call_1".into(), name: "files__write_file".into(), arguments: "{}".into() };
        end.required = vec![Required::permission(&asked, "perm_1")];
        a.on(&TurnEvent::End(end));
        let last = end_chunks(&a, false);
        assert_eq!(last[0]["choices"][0]["finish_reason"], "stop");
        assert!(a.tool_calls.is_empty());
    }
}
