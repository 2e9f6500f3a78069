//! The OpenAI chat-completions wire format: the request body built from a [`ChatRequest`]
//! and the chunks and bodies servers answer with, read leniently because vLLM, Ollama and
//! routers each add or omit fields.

use serde::Deserialize;
use serde_json::Value;

use super::{ChatRequest, Completion, ImageResolver, StreamItem, ToolCallDelta, UpstreamError};
use turnlog_core::request_body::{RequestBody, ResolveImage};

/// How much of an unparsable chunk an error quotes.
const QUOTE_LIMIT: usize = 300;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the provider's cache; `None` when it does not say.
    pub cached_tokens: Option<u32>,
}

/// The body of `request`, built by the one body builder ([`turnlog_core::request_body`])
/// that also builds turns' requests and their audit.
pub(super) fn request_body(
    request: &ChatRequest,
    stream: bool,
    images: Option<&ImageResolver>,
) -> RequestBody {
    let params = request.params(stream, images.is_some());
    let images = images.map(|r| r.as_ref() as ResolveImage<'_>);
    turnlog_core::request_body::request_body(&request.model, &request.messages, &params, images)
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    /// Streamed chunks carry `delta`, whole answers `message`.
    #[serde(default, alias = "message")]
    delta: Option<Message>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Default, Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<String>,
    /// vLLM and DeepSeek name reasoning `reasoning_content`; Ollama and OpenRouter
    /// `reasoning`. Some routers send both with the same text, so one is taken, not both.
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    /// A step's tool calls: streamed as pieces by `index` (the first with the call's id and
    /// name), whole in an answer body.
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
}

#[derive(Deserialize)]
struct WireToolCall {
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

impl Message {
    fn reasoning(&mut self) -> Option<String> {
        self.reasoning_content.take().filter(|r| !r.is_empty()).or_else(|| self.reasoning.take())
    }
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
    /// DeepSeek reports its cache hits here instead.
    #[serde(default)]
    prompt_cache_hit_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        let cached = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: cached.or(u.prompt_cache_hit_tokens),
        }
    }
}

/// The items one streamed chunk carries, in the order a reader should see them.
pub(super) fn parse_chunk(data: &str) -> Result<Vec<StreamItem>, UpstreamError> {
    let chunk: Chunk = serde_json::from_str(data)
        .map_err(|e| UpstreamError::Malformed(format!("{e} in chunk {}", quote(data))))?;
    if let Some(error) = chunk.error {
        return Err(UpstreamError::Provider(error_message(&error)));
    }
    let mut items = Vec::new();
    if let Some(mut choice) = chunk.choices.into_iter().next() {
        if let Some(mut delta) = choice.delta.take() {
            if let Some(reasoning) = delta.reasoning().filter(|r| !r.is_empty()) {
                items.push(StreamItem::Reasoning(reasoning));
            }
            if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                items.push(StreamItem::Text(text));
            }
            for (i, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                let function = call.function;
                let (name, arguments) = function.map_or((None, None), |f| (f.name, f.arguments));
                items.push(StreamItem::ToolCall(ToolCallDelta {
                    index: call.index.unwrap_or(i),
                    id: call.id.filter(|id| !id.is_empty()),
                    name: name.filter(|n| !n.is_empty()),
                    arguments: arguments.unwrap_or_default(),
                }));
            }
        }
        if let Some(reason) = choice.finish_reason {
            items.push(StreamItem::Finish(reason));
        }
    }
    if let Some(usage) = chunk.usage {
        items.push(StreamItem::Usage(usage.into()));
    }
    Ok(items)
}

pub(super) fn parse_completion(body: &[u8]) -> Result<Completion, UpstreamError> {
    let chunk: Chunk = serde_json::from_slice(body).map_err(|e| {
        UpstreamError::Malformed(format!("{e} in body {}", quote(&String::from_utf8_lossy(body))))
    })?;
    if let Some(error) = chunk.error {
        return Err(UpstreamError::Provider(error_message(&error)));
    }
    let Some(mut choice) = chunk.choices.into_iter().next() else {
        return Err(UpstreamError::Malformed("answer without choices".into()));
    };
    let mut message = choice.delta.take().unwrap_or_default();
    Ok(Completion {
        reasoning: message.reasoning().unwrap_or_default(),
        text: message.content.unwrap_or_default(),
        usage: chunk.usage.map(Usage::from),
        finish_reason: choice.finish_reason,
    })
}

/// `{"message": ...}` as OpenAI and OpenRouter shape errors, else the error as sent.
fn error_message(error: &Value) -> String {
    match error.get("message").and_then(Value::as_str) {
        Some(message) => message.to_owned(),
        None => quote(&error.to_string()),
    }
}

fn quote(text: &str) -> String {
    super::truncate(text, QUOTE_LIMIT)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use serde_json::json;
    use turnlog_core::message::{ChatMessage, Content, ContentPart, Role};

    #[test]
    fn body_resolves_images_and_marks_missing_ones() {
        let resolver: ImageResolver =
            Arc::new(|id, mime| (id == "a").then(|| format!("data:{mime};base64,AAAA")));
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::new(
                Role::User,
                Content::Parts(vec![
                    ContentPart::Text { text: "look".into() },
                    ContentPart::ImageRef {
                        id: "a".into(),
                        mime: "image/png".into(),
                        width: None,
                        height: None,
                    },
                    ContentPart::ImageRef {
                        id: "gone".into(),
                        mime: "image/jpeg".into(),
                        width: None,
                        height: None,
                    },
                ]),
            )],
            max_tokens: Some(100),
            response_format_json: true,
            ..ChatRequest::default()
        };
        let json = |body: RequestBody| serde_json::from_slice::<Value>(&body.bytes).unwrap();
        let body = json(request_body(&request, true, Some(&resolver)));
        let parts = &body["messages"][0]["content"];
        assert_eq!(parts[0], json!({"type": "text", "text": "look"}));
        assert_eq!(parts[1]["image_url"]["url"], "data:image/png;base64,AAAA");
        assert_eq!(parts[2]["type"], "text");
        assert!(parts[2]["text"].as_str().is_some_and(|t| t.contains("unavailable")));
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["response_format"]["type"], "json_object");
        assert_eq!(body["max_tokens"], 100);
        assert!(body.get("temperature").is_none());

        let without_resolver = json(request_body(&request, false, None));
        assert_eq!(without_resolver["messages"][0]["content"][1]["type"], "text");
        assert!(without_resolver.get("stream_options").is_none());
    }

    #[test]
    fn reasoning_content_wins_over_a_duplicate_reasoning_field() {
        let items = parse_chunk(
            r#"{"choices":[{"delta":{"reasoning_content":"a","reasoning":"a"},"finish_reason":null}]}"#,
        );
        assert_eq!(items, Ok(vec![StreamItem::Reasoning("a".into())]));
    }

    #[test]
    fn deepseek_cache_hits_count_as_cached() {
        let items = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_cache_hit_tokens":8}}"#,
        );
        let usage = Usage { prompt_tokens: 9, completion_tokens: 1, cached_tokens: Some(8) };
        assert_eq!(items, Ok(vec![StreamItem::Usage(usage)]));
    }
}
