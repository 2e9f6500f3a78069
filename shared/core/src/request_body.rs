//! The chat-completions request body as the bytes sent: compact JSON with a fixed key order
//! (typed structs in field order, never a JSON map, so no serde_json feature such as
//! `preserve_order` can reorder it), built by one pure function that both the sender and
//! the audit's rebuild (§11) call. Image references become data URLs only here.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::message::{ChatMessage, Content, ContentPart, Role};

/// Turns an image reference (`id`, `mime`) into a `data:` URL, or `None` when the image is
/// gone.
pub type ResolveImage<'a> = &'a dyn Fn(&str, &str) -> Option<String>;

/// Every body field that does not come from the log: what a recorded request keeps beside
/// the log so the body can be rebuilt. An absent field is absent from the body, so a
/// parameter added later leaves older records rebuilding as they were sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestParams {
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// The tools offered (DESIGN §14): the JSON text of the `tools` array (Chat
    /// Completions' function tools) as the client sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<String>,
    /// `tool_choice`, as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Whether image references were sent as data URLs (resolved from the file store);
    /// when false, each was sent as a short placeholder text.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub images: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    pub include_usage: bool,
}

/// Chat Completions' `response_format`: `text`, `json_object`, or `json_schema` with its
/// schema (structured outputs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<JsonSchemaFormat>,
}

impl ResponseFormat {
    pub fn json_object() -> Self {
        Self { kind: "json_object".into(), json_schema: None }
    }
}

/// A `json_schema` response format. The schema is kept as the JSON text the client sent:
/// a JSON map would reorder its keys (a jsonb column sorts them), and the order of a
/// schema's properties is the order the model writes them in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The schema's JSON text, exactly as received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A body as sent, and the SHA-256 of exactly those bytes (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestBody {
    pub bytes: Vec<u8>,
    pub sha256: String,
}

/// The body of a chat-completions request. `images` resolves image references when
/// `params.images` is set; otherwise (or when the image is gone) the model is told in a
/// placeholder text that an image was there.
pub fn request_body(
    model: &str,
    messages: &[ChatMessage],
    params: &RequestParams,
    images: Option<ResolveImage<'_>>,
) -> RequestBody {
    let images = if params.images { images } else { None };
    let body = WireBody {
        model,
        messages: messages
            .iter()
            .map(|m| WireMessage {
                role: m.role,
                // A step that asks for tools without a word: `content: null`, as OpenAI's
                // models send it.
                content: (m.tool_calls.is_empty() || !m.content.is_empty())
                    .then(|| content(&m.content, images)),
                tool_calls: (!m.tool_calls.is_empty())
                    .then(|| m.tool_calls.iter().map(WireToolCall::of).collect()),
                tool_call_id: m.tool_call_id.as_deref(),
            })
            .collect(),
        stream: params.stream,
        stream_options: params.stream_options.as_ref(),
        max_tokens: params.max_tokens,
        reasoning_effort: params.reasoning_effort.as_deref(),
        temperature: params.temperature,
        top_p: params.top_p,
        presence_penalty: params.presence_penalty,
        frequency_penalty: params.frequency_penalty,
        seed: params.seed,
        stop: params.stop.as_deref(),
        response_format: params.response_format.as_ref().map(WireFormat::of),
        tools: raw(params.tools.as_deref()),
        tool_choice: raw(params.tool_choice.as_deref()),
        parallel_tool_calls: params.parallel_tool_calls,
    };
    // Structs of strings, numbers and bools always serialize.
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let sha256 = sha256_hex(&bytes);
    RequestBody { bytes, sha256 }
}

/// SHA-256 of `bytes` as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// The wire shape, in the order its keys are written.
#[derive(Serialize)]
struct WireBody<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<&'a StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    frequency_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<WireFormat<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'a serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
}

/// JSON text checked when its request came in, written as the JSON it is (none when a
/// record's text is not JSON, which takes a hand-edited log).
fn raw(text: Option<&str>) -> Option<&serde_json::value::RawValue> {
    text.and_then(|t| serde_json::from_str(t).ok())
}

/// `response_format` on the wire: a `json_schema`'s schema written as the JSON it is.
#[derive(Serialize)]
struct WireFormat<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    json_schema: Option<WireSchema<'a>>,
}

#[derive(Serialize)]
struct WireSchema<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    schema: Option<&'a serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

impl<'a> WireFormat<'a> {
    /// The format as sent. The schema text was checked to be JSON when the request came
    /// in; a record whose text is not (it cannot be, short of a hand-edited log) sends
    /// none.
    fn of(format: &'a ResponseFormat) -> Self {
        let json_schema = format.json_schema.as_ref().map(|s| WireSchema {
            name: &s.name,
            description: s.description.as_deref(),
            schema: raw(s.schema.as_deref()),
            strict: s.strict,
        });
        Self { kind: &format.kind, json_schema }
    }
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: Role,
    content: Option<WireContent<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<WireToolCall<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

/// A tool call in Chat Completions' shape: `{id, type: "function", function: {name,
/// arguments}}`, the arguments the model's own JSON text.
#[derive(Serialize)]
struct WireToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunction<'a>,
}

#[derive(Serialize)]
struct WireFunction<'a> {
    name: &'a str,
    arguments: &'a str,
}

impl<'a> WireToolCall<'a> {
    fn of(call: &'a crate::events::ToolCall) -> Self {
        Self {
            id: &call.id,
            kind: "function",
            function: WireFunction { name: &call.name, arguments: &call.arguments },
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireContent<'a> {
    Text(&'a str),
    Parts(Vec<WirePart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WirePart<'a> {
    Text { text: std::borrow::Cow<'a, str> },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Serialize)]
struct ImageUrl {
    url: String,
}

fn content<'a>(content: &'a Content, images: Option<ResolveImage<'_>>) -> WireContent<'a> {
    let parts = match content {
        Content::Text(text) => return WireContent::Text(text),
        Content::Parts(parts) => parts,
    };
    let parts = parts
        .iter()
        .map(|part| match part {
            ContentPart::Text { text } => WirePart::Text { text: text.as_str().into() },
            ContentPart::ImageRef { id, mime, .. } => match images.and_then(|r| r(id, mime)) {
                Some(url) => WirePart::ImageUrl { image_url: ImageUrl { url } },
                // The model should know an image was there even when its bytes are not sent.
                None => WirePart::Text { text: format!("[image {id} ({mime}) unavailable]").into() },
            },
        })
        .collect();
    WireContent::Parts(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> RequestParams {
        RequestParams {
            stream: true,
            stream_options: Some(StreamOptions { include_usage: true }),
            max_tokens: Some(100),
            reasoning_effort: Some("low".into()),
            temperature: Some(0.2),
            top_p: Some(0.9),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(-0.5),
            seed: Some(7),
            stop: Some(vec!["END".into()]),
            response_format: Some(ResponseFormat::json_object()),
            images: true,
            ..RequestParams::default()
        }
    }

    /// The exact bytes, key order included: if a dependency turns on
    /// `serde_json/preserve_order` or the structs are reordered, this fails.
    #[test]
    fn body_bytes_are_pinned() {
        let messages = vec![
            ChatMessage::text(Role::System, "be brief"),
            ChatMessage::new(
                Role::User,
                Content::Parts(vec![
                    ContentPart::Text { text: "look \"here\"\n".into() },
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
            ),
            ChatMessage::text(Role::Assistant, "é"),
        ];
        let resolve = |id: &str, mime: &str| (id == "a").then(|| format!("data:{mime};base64,AAAA"));
        let body = request_body("m", &messages, &params(), Some(&resolve));
        let expected = concat!(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},"#,
            r#"{"role":"user","content":[{"type":"text","text":"look \"here\"\n"},"#,
            r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},"#,
            r#"{"type":"text","text":"[image gone (image/jpeg) unavailable]"}]},"#,
            r#"{"role":"assistant","content":"é"}],"stream":true,"stream_options":{"include_usage":true},"#,
            r#""max_tokens":100,"reasoning_effort":"low","temperature":0.2,"top_p":0.9,"#,
            r#""presence_penalty":0.5,"frequency_penalty":-0.5,"seed":7,"stop":["END"],"#,
            r#""response_format":{"type":"json_object"}}"#,
        );
        assert_eq!(String::from_utf8(body.bytes.clone()).unwrap(), expected);
        assert_eq!(body.sha256, sha256_hex(expected.as_bytes()));
        assert_eq!(body.sha256.len(), 64);

        let plain = request_body("m", &messages[..1], &RequestParams::default(), None);
        assert_eq!(
            String::from_utf8(plain.bytes).unwrap(),
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"}],"stream":false}"#
        );
    }

    /// A step's tool traffic on the wire (DESIGN §14): the assistant's `tool_calls` in
    /// Chat Completions' shape with the model's own argument text, `content: null` when it
    /// said nothing, and each result as a `tool` message naming its call.
    #[test]
    fn tool_calls_and_results_have_chat_completions_shape() {
        let call = crate::events::ToolCall {
            id: "call_1".into(),
            name: "ls".into(),
            arguments: r#"{"dir": "."}"#.into(),
        };
        let step = ChatMessage { tool_calls: vec![call], ..ChatMessage::text(Role::Assistant, "") };
        let result =
            ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::text(Role::Tool, "a.txt") };
        let body = request_body(
            "m",
            &[ChatMessage::text(Role::User, "ls"), step, result],
            &RequestParams::default(),
            None,
        );
        let expected = concat!(
            r#"{"model":"m","messages":[{"role":"user","content":"ls"},"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"ls","arguments":"{\"dir\": \".\"}"}}]},"#,
            r#"{"role":"tool","content":"a.txt","tool_call_id":"call_1"}],"stream":false}"#,
        );
        assert_eq!(String::from_utf8(body.bytes).unwrap(), expected);
    }

    /// A structured output's schema reaches the model in the order the client wrote it,
    /// also after its record went through a jsonb column (which sorts object keys).
    #[test]
    fn a_json_schema_keeps_its_key_order_through_the_log() {
        let schema = r#"{"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},"required":["zeta","alpha"]}"#;
        let format = ResponseFormat {
            kind: "json_schema".into(),
            json_schema: Some(JsonSchemaFormat {
                name: "answer".into(),
                description: None,
                schema: Some(schema.into()),
                strict: Some(true),
            }),
        };
        let params = RequestParams { response_format: Some(format), ..RequestParams::default() };
        // Through the log: a JSON map with sorted keys, as jsonb would give it back.
        let stored: serde_json::Value = serde_json::to_value(&params).unwrap();
        let params: RequestParams = serde_json::from_value(stored).unwrap();
        let body = request_body("m", &[ChatMessage::text(Role::User, "hi")], &params, None);
        let expected = concat!(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"#,
            r#""response_format":{"type":"json_schema","json_schema":{"name":"answer","schema":"#,
            r#"{"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},"required":["zeta","alpha"]}"#,
            r#","strict":true}}}"#,
        );
        assert_eq!(String::from_utf8(body.bytes).unwrap(), expected);
    }

    #[test]
    fn images_are_resolved_only_when_the_params_say_so() {
        let messages = vec![ChatMessage::new(
            Role::User,
            Content::Parts(vec![ContentPart::ImageRef {
                id: "a".into(),
                mime: "image/png".into(),
                width: None,
                height: None,
            }]),
        )];
        let resolve = |_: &str, _: &str| Some("data:image/png;base64,AAAA".to_owned());
        let off = RequestParams { images: false, ..params() };
        let text = String::from_utf8(request_body("m", &messages, &off, Some(&resolve)).bytes).unwrap();
        assert!(text.contains("[image a (image/png) unavailable]"), "{text}");
        let on = String::from_utf8(request_body("m", &messages, &params(), Some(&resolve)).bytes).unwrap();
        assert!(on.contains("data:image/png;base64,AAAA"), "{on}");
    }

    #[test]
    fn params_round_trip_through_the_log_without_absent_fields() {
        let p = params();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(serde_json::from_value::<RequestParams>(v).unwrap(), p);
        let minimal = serde_json::to_value(RequestParams { stream: true, ..Default::default() }).unwrap();
        assert_eq!(minimal, serde_json::json!({"stream": true}));
    }

    #[test]
    fn sha256_is_the_standard_digest() {
        assert_eq!(sha256_hex(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
