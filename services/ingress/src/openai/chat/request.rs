//! The requests of `POST /v1/chat/completions` (DESIGN §13): the fields of OpenAI's
//! `ChatCompletionCreateParams` turnlog reads, the session header, and what a stored
//! request becomes — its conversation (system text, messages, images) and its turn options.

use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::Value;
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use utoipa::ToSchema;

use crate::openai::params::{self, ChatResponseFormat};
use crate::openai::OaiError;
use crate::turn::{call_id_fits, ToolResult, TurnOptions, MAX_CALL_ID};
use crate::{validate, Ingress};

/// Longest session header value.
const MAX_SESSION_HEADER: usize = 200;

/// The fields of OpenAI's `ChatCompletionCreateParams` turnlog reads; the rest are ignored
/// (and forwarded untouched by the pass-through).
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<WireMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 4_294_967_295_u64)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 4_294_967_295_u64)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// 1: a session stores one answer per turn.
    #[serde(default)]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 4_294_967_295_u64)]
    pub n: Option<u32>,
    /// Function tools the client runs (DESIGN §14): a step that calls them ends the
    /// completion with `finish_reason: tool_calls`; the next request, with the `tool`
    /// messages, continues the turn.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Refused unless empty (deprecated): send `tools`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Vec<Value>>,
    /// Structured outputs: sent to the model and recorded with the request.
    #[serde(default)]
    pub response_format: Option<ChatResponseFormat>,
    /// `none`, `auto`, `required` or a function the request offers.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// `none` or `auto` (deprecated): send `tool_choice`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<Value>,
    /// `medium` (the default) only.
    #[serde(default)]
    pub verbosity: Option<String>,
    /// Refused unless empty: the gateway request is turnlog's, not the client's.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<Value>,
    /// Refused: a session stores text answers.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub audio: Option<Value>,
    /// `["text"]` only.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>)]
    pub modalities: Option<Value>,
    /// Refused: turnlog does not search the web.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub web_search_options: Option<Value>,
}

/// `stop`: one sequence or up to four.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Most stop sequences, and the longest reasoning effort name, a request may give.
const MAX_STOP: usize = 4;
const MAX_PARAM_CHARS: usize = 64;

#[derive(Debug, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A message: `system`, `developer`, `user`, `assistant` (with the `tool_calls` of a step
/// that asked for tools) or `tool` (a call's result, naming it by `tool_call_id`).
#[derive(Debug, Deserialize, ToSchema)]
pub struct WireMessage {
    pub role: String,
    #[serde(default)]
    #[schema(schema_with = crate::openai::wire::chat_content)]
    pub content: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Value>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A request's conversation: its system text, and its other messages as (is_user, text).
pub struct Conversation {
    pub system: Option<String>,
    pub messages: Vec<(bool, String)>,
    /// Each message's images (aligned with `messages`).
    pub images: Vec<Vec<Image>>,
    /// The last message's documents, by file id (Responses' `input_file` parts).
    pub documents: Vec<String>,
    /// The results of the tool calls the turn in progress waits for (DESIGN §14): the
    /// request continues that turn rather than starting one.
    pub tool_results: Vec<ToolResult>,
}

/// An image of a message: a `data:` URL a Chat Completions client sent (stored as a file
/// when the message is), or a Responses client's uploaded file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    DataUrl(String),
    File(String),
}

impl CompletionRequest {
    /// The request, or a 400; the body must be a JSON object.
    pub fn parse(body: &[u8]) -> Result<Self, OaiError> {
        crate::extract::json_object(body)?;
        serde_json::from_slice(body).map_err(|e| {
            OaiError::bad_request(format!("the request body is not a valid chat completion request: {e}"))
        })
    }

    /// What a stored turn cannot do: more than one answer, or the deprecated functions.
    pub fn check_stored(&self) -> Result<(), OaiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(OaiError::bad_request("n must be 1: a session stores one answer per turn"));
        }
        if self.functions.as_ref().is_some_and(|f| !f.is_empty()) {
            return Err(OaiError::bad_request("functions are not supported (deprecated): send tools"));
        }
        // Every other field that changes the answer reaches the model or is refused.
        params::tools(&[], self.function_call.as_ref(), None)?;
        params::verbosity(self.verbosity.as_deref())?;
        params::unsupported("logit_bias", self.logit_bias.as_ref(), "a session's request is turnlog's")?;
        params::unsupported("audio", self.audio.as_ref(), "a session stores text answers")?;
        params::unsupported(
            "web_search_options",
            self.web_search_options.as_ref(),
            "turnlog does not search the web",
        )?;
        if self.modalities.as_ref().is_some_and(|m| !m.is_null() && *m != serde_json::json!(["text"])) {
            return Err(OaiError::bad_request("modalities other than [\"text\"] are not supported"));
        }
        Ok(())
    }
}

/// The value of the first session header the request carries, if any.
pub fn session_header(app: &Ingress, headers: &HeaderMap) -> Result<Option<String>, OaiError> {
    for name in &app.config.compat_session_headers {
        let Some(v) = headers.get(name.as_str()) else { continue };
        let value =
            v.to_str().map_err(|_| OaiError::bad_request(format!("{name} must be visible ASCII")))?.trim();
        if value.is_empty() {
            continue;
        }
        if value.len() > MAX_SESSION_HEADER {
            return Err(OaiError::bad_request(format!("{name} is at most {MAX_SESSION_HEADER} characters")));
        }
        return Ok(Some(value.to_owned()));
    }
    Ok(None)
}

/// Most image parts a request may carry in all (the history's included), so a body of tiny
/// images is refused before anything else is done with it.
const MAX_IMAGE_PARTS: usize = 1_000;

/// Checks a request's messages and reads them as a [`Conversation`]. Tool traffic (DESIGN
/// §14) is the log's: an assistant message's `tool_calls` and the `tool` messages are not
/// compared or stored again — except the `tool` messages after the last step that asked
/// for tools, when that step follows the last user message: they are the results the turn
/// waits for, and the request continues it.
pub fn conversation(messages: &[WireMessage]) -> Result<Conversation, OaiError> {
    let last_user = messages.iter().rposition(|m| m.role == "user");
    let last_step = messages.iter().rposition(|m| asks_for_tools(m.tool_calls.as_ref()));
    let results_from = match (last_user, last_step) {
        (Some(u), Some(s)) if s > u => Some(s + 1),
        _ => None,
    };
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut images = Vec::new();
    let mut tool_results = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
            if m.role != "assistant" || !calls.is_array() {
                return Err(OaiError::bad_request("tool_calls is an array on an assistant message"));
            }
        }
        let user = match m.role.as_str() {
            "system" | "developer" => {
                let (text, urls) = content(m.content.as_ref())?;
                if !urls.is_empty() {
                    return Err(OaiError::bad_request("a system message cannot carry images"));
                }
                system.push(text);
                continue;
            }
            "user" => true,
            "assistant" => false,
            "tool" => {
                let call_id = m.tool_call_id.as_deref().unwrap_or_default();
                if !call_id_fits(call_id) {
                    return Err(OaiError::bad_request(format!(
                        "a tool message names its call by tool_call_id (1-{MAX_CALL_ID} characters)"
                    )));
                }
                let (output, urls) = content(m.content.as_ref())?;
                if !urls.is_empty() {
                    return Err(OaiError::bad_request("a tool message cannot carry images"));
                }
                if results_from.is_some_and(|from| i >= from) {
                    tool_results.push(ToolResult { call_id: call_id.to_owned(), output, is_error: false });
                }
                continue;
            }
            "function" => {
                return Err(OaiError::bad_request(
                    "function messages are not supported (deprecated): send tool messages",
                ))
            }
            other => return Err(OaiError::bad_request(format!("unknown message role {other:?}"))),
        };
        let (text, urls) = content(m.content.as_ref())?;
        if !user && !urls.is_empty() {
            return Err(OaiError::bad_request("an assistant message cannot carry images"));
        }
        // A branch's conversation has no empty messages either (a failed answer, say).
        if !text.trim().is_empty() {
            rest.push((user, text));
            images.push(urls.into_iter().map(Image::DataUrl).collect());
        } else if !urls.is_empty() {
            return Err(OaiError::bad_request("a message with images needs text too"));
        }
    }
    match rest.last() {
        None => return Err(OaiError::bad_request("messages need a user message with text")),
        // A step's text may come after the user message of the turn its results continue.
        Some((false, _)) if tool_results.is_empty() => {
            return Err(OaiError::bad_request(
                "the last message must be a user message (continuing an answer is not supported)",
            ))
        }
        Some(_) => {}
    }
    if results_from.is_some() && tool_results.is_empty() {
        return Err(OaiError::bad_request(
            "the last assistant message asks for tools: send their results as tool messages after it",
        ));
    }
    let system = system.join("\n\n");
    if system.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(OaiError::bad_request(format!(
            "the system messages take more than {MAX_SYSTEM_PROMPT_BYTES} bytes"
        )));
    }
    if images.iter().map(Vec::len).sum::<usize>() > MAX_IMAGE_PARTS {
        return Err(OaiError::bad_request(format!("a request carries at most {MAX_IMAGE_PARTS} images")));
    }
    Ok(Conversation {
        system: (!system.is_empty()).then_some(system),
        messages: rest,
        images,
        documents: Vec::new(),
        tool_results,
    })
}

/// Whether an assistant message's `tool_calls` asks for any.
fn asks_for_tools(calls: Option<&Value>) -> bool {
    calls.and_then(Value::as_array).is_some_and(|a| !a.is_empty())
}

/// A message's text (a string, or its text parts joined) and its images' URLs (`image_url`
/// parts, stored as files when the message is).
fn content(content: Option<&Value>) -> Result<(String, Vec<String>), OaiError> {
    let parts = match content {
        Some(Value::String(t)) => return Ok((t.clone(), Vec::new())),
        Some(Value::Array(parts)) => parts,
        None | Some(Value::Null) => return Ok((String::new(), Vec::new())),
        Some(_) => {
            return Err(OaiError::bad_request("a message's content must be a string or an array of parts"))
        }
    };
    let (mut text, mut urls) = (String::new(), Vec::new());
    for p in parts {
        let url = p.get("image_url").and_then(|i| i.get("url").or(Some(i))).and_then(Value::as_str);
        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str), url) {
            (Some("text"), Some(t), _) => text.push_str(t),
            (Some("image_url"), _, Some(url)) => urls.push(url.to_owned()),
            (kind, _, _) => {
                return Err(OaiError::bad_request(format!(
                    "content parts of type {} cannot be stored; send text and image_url parts (or no \
                     session header)",
                    kind.unwrap_or("(none)")
                )))
            }
        }
    }
    Ok((text, urls))
}

/// The turn options of a request: its system text and the sampling parameters it sets.
pub fn options(req: &CompletionRequest, system: Option<String>) -> Result<TurnOptions, OaiError> {
    let stop = match &req.stop {
        None => None,
        Some(Stop::One(s)) => Some(vec![s.clone()]),
        Some(Stop::Many(v)) => Some(v.clone()),
    };
    let too_long = |s: &String| s.is_empty() || s.chars().count() > MAX_PARAM_CHARS;
    if stop.as_ref().is_some_and(|s| s.len() > MAX_STOP || s.iter().any(too_long)) {
        return Err(OaiError::bad_request(format!(
            "stop is at most {MAX_STOP} sequences of 1-{MAX_PARAM_CHARS} characters"
        )));
    }
    if req.reasoning_effort.as_ref().is_some_and(too_long) {
        return Err(OaiError::bad_request(format!("reasoning_effort is 1-{MAX_PARAM_CHARS} characters")));
    }
    let options = TurnOptions {
        system,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        seed: req.seed,
        stop,
        reasoning_effort: req.reasoning_effort.clone(),
        response_format: req.response_format.as_ref().and_then(ChatResponseFormat::format),
        tools: params::tools(
            req.tools.as_deref().unwrap_or_default(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls,
        )?,
        ..Default::default()
    };
    // Before the request's earlier messages are added to its session.
    validate::turn_options(&options)?;
    Ok(options)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn messages(v: Value) -> Vec<WireMessage> {
        serde_json::from_value::<Vec<Value>>(v)
            .unwrap()
            .into_iter()
            .map(|m| WireMessage {
                role: m["role"].as_str().unwrap_or_default().to_owned(),
                content: m.get("content").cloned(),
                tool_calls: m.get("tool_calls").cloned(),
                tool_call_id: m.get("tool_call_id").and_then(Value::as_str).map(str::to_owned),
            })
            .collect()
    }

    #[test]
    fn a_conversation_keeps_system_text_apart_and_drops_empty_messages() {
        let c = conversation(&messages(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": ""},
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": "Weather?"},
        ])))
        .unwrap();
        assert_eq!(c.system.as_deref(), Some("Be brief.\n\nUse metric units."));
        assert_eq!(c.messages, vec![(true, "Hi there".to_owned()), (true, "Weather?".to_owned())]);
    }

    #[test]
    fn image_parts_ride_beside_their_message() {
        let c = conversation(&messages(json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}},
            ]},
        ])))
        .unwrap();
        assert_eq!(c.messages.last(), Some(&(true, "What is this?".to_owned())));
        assert_eq!(
            c.images,
            vec![vec![], vec![], vec![Image::DataUrl("data:image/png;base64,AAAA".to_owned())]]
        );
    }

    #[test]
    fn what_a_session_cannot_hold_is_refused() {
        for refused in [
            json!([]),
            json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
            json!([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, {"role": "user", "content": "x"}]),
            json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}, {"type": "text", "text": "x"}]}]),
            json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}]),
            json!([{"role": "tool", "content": "42"}, {"role": "user", "content": "x"}]),
            json!([{"role": "user", "content": "x", "tool_calls": []}]),
            json!([{"role": "function", "name": "f", "content": "42"}, {"role": "user", "content": "x"}]),
            json!([{"role": "narrator", "content": "x"}]),
            json!([{"role": "user", "content": 7}]),
            json!([{"role": "system", "content": "x".repeat(MAX_SYSTEM_PROMPT_BYTES + 1)}, {"role": "user", "content": "x"}]),
        ] {
            assert!(conversation(&messages(refused.clone())).is_err(), "{refused}");
        }
    }

    #[test]
    fn the_results_after_the_last_step_continue_its_turn_and_earlier_tool_traffic_is_the_logs() {
        let call =
            |id: &str| json!([{"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
        let c = conversation(&messages(json!([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": call("c1")},
            {"role": "tool", "tool_call_id": "c1", "content": "-3C"},
            {"role": "assistant", "content": "It is -3C."},
            {"role": "user", "content": "And Rome?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": call("c2")},
            {"role": "tool", "tool_call_id": "c1", "content": "stale"},
            {"role": "assistant", "content": null, "tool_calls": call("c3")},
            {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "14C"}]},
        ])))
        .unwrap();
        assert_eq!(
            c.messages,
            vec![
                (true, "Weather in Oslo?".to_owned()),
                (false, "It is -3C.".to_owned()),
                (true, "And Rome?".to_owned()),
                (false, "Checking.".to_owned()),
            ]
        );
        let results: Vec<(&str, &str)> =
            c.tool_results.iter().map(|r| (r.call_id.as_str(), r.output.as_str())).collect();
        assert_eq!(results, [("c3", "14C")]);
        // A finished turn's traffic continues nothing.
        let done = conversation(&messages(json!([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": call("c1")},
            {"role": "tool", "tool_call_id": "c1", "content": "-3C"},
            {"role": "assistant", "content": "Cold."},
            {"role": "user", "content": "Thanks"},
        ])))
        .unwrap();
        assert!(done.tool_results.is_empty());
        assert_eq!(done.messages.len(), 3);
        // A result without its call id is refused.
        let bad = json!([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": call("c")}, {"role": "tool", "content": "1"}]);
        assert!(conversation(&messages(bad)).is_err());
    }
}
