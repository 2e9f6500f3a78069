//! Puts an answer on the wire the way OpenAI does — a streamed `chat.completion.chunk`
//! sequence or one `chat.completion` body — and applies the transport knobs: delays,
//! dropped connections, stalls, a missing `[DONE]`.

use std::io;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turnlog_core::tokens;

use crate::directives::Knobs;
use crate::prompt_cache::PromptUsage;

/// A fixed `created` time, so identical requests get identical answers.
const CREATED: u64 = 1_700_000_000;
/// Longest piece of text one delta carries.
const MAX_DELTA_CHARS: usize = 16;

/// An answer cut into the deltas it is streamed as.
pub(crate) struct Answer {
    id: String,
    model: String,
    reasoning: Vec<String>,
    content: Vec<String>,
    /// A step that asks for tools: `(call id, name, arguments)`.
    tool_calls: Vec<(String, String, String)>,
    finish_reason: &'static str,
    completion_tokens: u32,
    prompt: PromptUsage,
}

impl Answer {
    /// Cuts `text` into deltas after `reasoning`, stopping with `length` where the next
    /// delta would pass `max_tokens`, as a provider truncates.
    pub(crate) fn new(
        id: String,
        model: String,
        reasoning: Vec<String>,
        text: &str,
        max_tokens: Option<u32>,
        prompt: PromptUsage,
    ) -> Self {
        let budget = max_tokens.unwrap_or(u32::MAX);
        let mut answer = Self {
            id,
            model,
            reasoning: Vec::new(),
            content: Vec::new(),
            tool_calls: Vec::new(),
            finish_reason: "stop",
            completion_tokens: 0,
            prompt,
        };
        let deltas = reasoning.into_iter().map(|r| (true, r)).chain(pieces(text).map(|p| (false, p)));
        for (is_reasoning, delta) in deltas {
            let cost = tokens::count(&delta);
            if answer.completion_tokens.saturating_add(cost) > budget {
                answer.finish_reason = "length";
                break;
            }
            answer.completion_tokens += cost;
            if is_reasoning {
                answer.reasoning.push(delta);
            } else {
                answer.content.push(delta);
            }
        }
        // Pieces cost at least what the whole text does; bill what a tokenizer counts.
        answer.completion_tokens =
            tokens::count(&answer.reasoning.concat()) + tokens::count(&answer.content.concat());
        answer
    }

    /// This answer as a step asking for `calls` (`(id, name, arguments)`): no text, the
    /// calls' names and arguments billed as output.
    pub(crate) fn asking(mut self, calls: Vec<(String, String, String)>) -> Self {
        self.content.clear();
        self.completion_tokens = calls.iter().map(|(_, n, a)| tokens::count(n) + tokens::count(a)).sum();
        self.tool_calls = calls;
        self.finish_reason = "tool_calls";
        self
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt.prompt_tokens.saturating_add(self.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": self.prompt.cached_tokens},
        })
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            "choices": choices,
        })
    }

    fn delta(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        self.chunk(json!([{"index": 0, "delta": delta, "finish_reason": finish_reason}]))
    }

    fn delta_count(&self) -> usize {
        self.reasoning.len() + self.content.len()
    }
}

/// Words with their leading whitespace, as providers stream them, long ones split, so the
/// pieces concatenate back to `text` exactly (JSON answers must survive streaming).
fn pieces(text: &str) -> impl Iterator<Item = String> + '_ {
    let mut starts = vec![0];
    let mut previous_is_space = true;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() && !previous_is_space {
            starts.push(i);
        }
        previous_is_space = c.is_whitespace();
    }
    starts.push(text.len());
    starts.dedup();
    starts.windows(2).map(|w| &text[w[0]..w[1]]).collect::<Vec<_>>().into_iter().flat_map(|word| {
        let chars: Vec<char> = word.chars().collect();
        chars.chunks(MAX_DELTA_CHARS).map(|c| c.iter().collect::<String>()).collect::<Vec<_>>()
    })
}

/// One SSE event, and whether it counts as a delta for the knobs.
struct Frame {
    data: Value,
    is_delta: bool,
}

pub(crate) fn streamed(
    answer: Answer,
    knobs: Knobs,
    include_usage: bool,
    shutdown: CancellationToken,
) -> Response {
    let mut frames = vec![Frame {
        data: answer.delta(json!({"role": "assistant", "content": ""}), None),
        is_delta: false,
    }];
    frames.extend(
        answer
            .reasoning
            .iter()
            .map(|r| Frame { data: answer.delta(json!({"reasoning_content": r}), None), is_delta: true }),
    );
    frames.extend(
        answer
            .content
            .iter()
            .map(|c| Frame { data: answer.delta(json!({"content": c}), None), is_delta: true }),
    );
    // Each call opens with its id and name, then its arguments in pieces, as OpenAI streams.
    for (i, (id, name, arguments)) in answer.tool_calls.iter().enumerate() {
        let open = json!({"tool_calls": [{"index": i, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""}}]});
        frames.push(Frame { data: answer.delta(open, None), is_delta: false });
        frames.extend(pieces(arguments).map(|piece| Frame {
            data: answer.delta(json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}), None),
            is_delta: true,
        }));
    }
    frames.push(Frame { data: answer.delta(json!({}), Some(answer.finish_reason)), is_delta: false });
    if include_usage {
        let mut usage = answer.chunk(json!([]));
        usage["usage"] = answer.usage();
        frames.push(Frame { data: usage, is_delta: false });
    }

    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(send_frames(tx, frames, knobs, shutdown));
    let body = channel_body(rx);
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

type Sender = mpsc::Sender<Result<Bytes, io::Error>>;

/// What a `stamp`ed answer's words are, replaced by the send time as each delta goes out.
pub(crate) const STAMP: &str = "@stamp@ ";

pub(crate) fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// A response body fed by a task, so the task decides pacing and failures.
fn channel_body(rx: mpsc::Receiver<Result<Bytes, io::Error>>) -> Body {
    Body::from_stream(futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|item| (item, rx)) },
    ))
}

async fn send_frames(tx: Sender, frames: Vec<Frame>, knobs: Knobs, shutdown: CancellationToken) {
    let mut deltas = 0;
    for frame in frames {
        if frame.is_delta {
            if knobs.fail_after == Some(deltas) {
                drop_connection(&tx).await;
                return;
            }
            if knobs.stall_after == Some(deltas) {
                tokio::select! {
                    _ = tx.closed() => {}
                    _ = shutdown.cancelled() => {}
                }
                return;
            }
            if knobs.delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(knobs.delay_ms)).await;
            }
            deltas += 1;
        }
        let event = if knobs.stamp && frame.is_delta {
            format!(
                "data: {}\n\n",
                frame.data.to_string().replacen(STAMP.trim_end(), &unix_us().to_string(), 1)
            )
        } else {
            format!("data: {}\n\n", frame.data)
        };
        if tx.send(Ok(Bytes::from(event))).await.is_err() {
            return; // the client went away
        }
    }
    if !knobs.no_done {
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    }
}

/// A body error makes hyper close the connection without ending the chunked body — what a
/// client sees when a provider dies mid-answer. The frames already queued are written
/// first, or the client could not tell a drop after N deltas from one after fewer.
async fn drop_connection(tx: &Sender) {
    while tx.capacity() < tx.max_capacity() && !tx.is_closed() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let error = io::Error::new(io::ErrorKind::ConnectionAborted, "mock fail_after");
    let _ = tx.send(Err(error)).await;
}

/// The whole answer as one body. A stall never answers; `fail_after` breaks the body after
/// the headers; the delay is paid for every delta at once.
pub(crate) async fn whole(answer: Answer, knobs: Knobs, shutdown: CancellationToken) -> Response {
    if knobs.stall_after.is_some() {
        shutdown.cancelled().await;
        return error(503, "mock server shutting down");
    }
    let delay = knobs.delay_ms.saturating_mul(answer.delta_count() as u64);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut message = json!({"role": "assistant", "content": answer.content.concat()});
    if !answer.reasoning.is_empty() {
        message["reasoning_content"] = json!(answer.reasoning.concat());
    }
    if !answer.tool_calls.is_empty() {
        message["content"] = Value::Null;
        message["tool_calls"] = answer
            .tool_calls
            .iter()
            .map(|(id, name, arguments)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
            .collect();
    }
    let body = json!({
        "id": answer.id,
        "object": "chat.completion",
        "created": CREATED,
        "model": answer.model,
        "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason}],
        "usage": answer.usage(),
    });
    if knobs.fail_after.is_none() {
        return Json(body).into_response();
    }
    // Half a body, then the connection drops: the client has its headers but no answer.
    let text = body.to_string();
    let mut half = text.len() / 2;
    while !text.is_char_boundary(half) {
        half -= 1;
    }
    let half = Bytes::from(text[..half].to_owned());
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        if tx.send(Ok(half)).await.is_ok() {
            drop_connection(&tx).await;
        }
    });
    let body = channel_body(rx);
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// An OpenAI-style error body with `status`.
pub(crate) fn error(status: u16, message: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = if status.is_client_error() { "invalid_request_error" } else { "server_error" };
    let body = json!({"error": {
        "message": message,
        "type": kind,
        "param": null,
        "code": format!("mock_{}", status.as_u16()),
    }});
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_concatenate_back_exactly() {
        let text = r#"{"key_findings":["We met Alice at 9."],"a_very_long_identifier_here":1}"#;
        let all: Vec<String> = pieces(text).collect();
        assert_eq!(all.concat(), text);
        assert_eq!(pieces(" a  b\nc").collect::<Vec<_>>(), [" a", "  b", "\nc"]);
        assert!(all.iter().all(|p| p.chars().count() <= MAX_DELTA_CHARS));
    }

    #[test]
    fn answers_stop_with_length_at_max_tokens() {
        let prompt = PromptUsage { prompt_tokens: 1, cached_tokens: 0 };
        let text = "one two three four five six";
        let cut = Answer::new("id".into(), "m".into(), vec![], text, Some(3), prompt);
        assert_eq!(cut.finish_reason, "length");
        assert_eq!(cut.content.concat(), "one two three");
        let whole = Answer::new("id".into(), "m".into(), vec![], text, None, prompt);
        assert_eq!((whole.finish_reason, whole.content.concat().as_str()), ("stop", text));
    }

    #[test]
    fn building_only_what_max_tokens_lets_through_changes_no_answer() {
        use crate::answers::{answer_text, reasoning_steps, Task, WireMessage};
        let prompt = PromptUsage { prompt_tokens: 1, cached_tokens: 0 };
        let messages = [WireMessage { role: "user".into(), content: json!("tell me") }];
        let answer = |knobs: &Knobs, max_tokens| {
            let text = answer_text(Task::Chat, &messages, knobs.words, max_tokens);
            let a = Answer::new(
                "id".into(),
                "m".into(),
                reasoning_steps(knobs.reasoning),
                &text,
                max_tokens,
                prompt,
            );
            (a.reasoning, a.content, a.finish_reason, a.completion_tokens)
        };
        for (words, reasoning, max_tokens) in
            [(2_000, 0, 7), (2_000, 3, 30), (2_000, 500, 40), (9, 2, 9), (5, 0, 500)]
        {
            let asked = Knobs { words, reasoning, ..Knobs::default() };
            let built = asked.clone().within(Some(max_tokens));
            assert_eq!(answer(&built, Some(max_tokens)), answer(&asked, Some(max_tokens)), "{asked:?}");
        }
    }
}
