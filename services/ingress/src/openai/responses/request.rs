//! The requests of `/v1/responses` (DESIGN §13): the fields of OpenAI's
//! `ResponseCreateParams` turnlog reads, and what a request becomes — a stored turn's
//! message, options and echo, or with `store: false` the gateway request of the whole
//! history it sends — and `GET /v1/responses/{id}`'s query.

use serde::Deserialize;
use serde_json::Value;
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::request_body::{request_body, RequestBody, RequestParams, StreamOptions};
use turnlog_core::{ChatMessage, Role};
use utoipa::{IntoParams, ToSchema};

use super::translate::Echo;
use crate::config::IngressConfig;
use crate::openai::OaiError;
use crate::turn::{NewMessage, TurnOptions};
use crate::validate;

/// The body of `POST /v1/responses`; fields OpenAI defines that turnlog does not act on
/// are refused when they would change the answer (`tools`) and ignored otherwise.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CreateResponse {
    #[serde(default)]
    #[schema(schema_with = crate::openapi::name)]
    pub model: Option<String>,
    #[schema(schema_with = crate::openai::wire::response_input)]
    pub input: Input,
    /// The system prompt of this turn (recorded with its request).
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub conversation: Option<ConversationRef>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub background: bool,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 4_294_967_295_u64)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Refused unless empty: turnlog does not run tools yet.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// A conversation id, or `{id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ConversationRef {
    Id(String),
    Object { id: String },
}

impl CreateResponse {
    /// The request, or a 400; `tools` are refused (turnlog does not run tools yet).
    pub fn parse(body: &[u8]) -> Result<Self, OaiError> {
        let req: Self = serde_json::from_slice(body).map_err(|e| {
            OaiError::bad_request(format!("the request body is not a valid response request: {e}"))
        })?;
        crate::extract::json_object(body)?;
        if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(OaiError::bad_request("tools are not supported: turnlog does not run tools yet"));
        }
        Ok(req)
    }

    /// A stored response's checks: one way to name the conversation, and instructions that
    /// fit a system prompt.
    pub fn check_stored(&self) -> Result<(), OaiError> {
        if self.conversation.is_some() && self.previous_response_id.is_some() {
            return Err(OaiError::bad_request("send conversation or previous_response_id, not both"));
        }
        if self.instructions.as_ref().is_some_and(|i| i.len() > MAX_SYSTEM_PROMPT_BYTES) {
            return Err(OaiError::bad_request(format!(
                "instructions take more than {MAX_SYSTEM_PROMPT_BYTES} bytes"
            )));
        }
        Ok(())
    }

    /// `store: false`'s checks: nothing kept, so nothing to continue or to run in the
    /// background.
    pub fn check_stateless(&self) -> Result<(), OaiError> {
        if self.background {
            return Err(OaiError::bad_request("background responses are stored: send store: true"));
        }
        if self.conversation.is_some() || self.previous_response_id.is_some() {
            return Err(OaiError::bad_request(
                "store: false keeps nothing: it cannot continue a conversation or a previous response",
            ));
        }
        Ok(())
    }

    /// The conversation id the request names, if it names one.
    pub fn conversation_id(&self) -> Option<&str> {
        self.conversation.as_ref().map(|c| match c {
            ConversationRef::Id(id) | ConversationRef::Object { id } => id.as_str(),
        })
    }

    /// The stored turn's message: the user's text of this turn and the files it attaches.
    pub fn message(&self) -> Result<NewMessage, OaiError> {
        let input = user_input(&self.input)?;
        Ok(NewMessage {
            text: input.text,
            category: None,
            model: self.model.clone(),
            images: input.images,
            documents: input.documents,
        })
    }

    /// The stored turn's options: the instructions as its system text, and the sampling
    /// parameters it sets.
    pub fn options(&self) -> TurnOptions {
        TurnOptions {
            system: self.instructions.clone(),
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            ..Default::default()
        }
    }

    /// What the response object repeats of the request.
    pub fn echo(&self) -> Echo {
        Echo {
            instructions: self.instructions.clone(),
            previous_response_id: self.previous_response_id.clone(),
            max_output_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            store: true,
            background: self.background,
        }
    }

    /// `store: false`: the model (the default when the request names none; an allowed one)
    /// and the gateway request of the whole history `input` sends, instructions first.
    pub fn stateless(&self, config: &IngressConfig) -> Result<(String, RequestBody), OaiError> {
        let model = self.model.clone().unwrap_or_else(|| config.model.clone());
        validate::model(config, &model)?;
        let mut messages = Vec::new();
        if let Some(system) = &self.instructions {
            messages.push(ChatMessage::text(Role::System, system.clone()));
        }
        messages.extend(stateless_messages(&self.input)?);
        if messages.iter().all(|m| m.role != Role::User) {
            return Err(OaiError::bad_request("input needs a user message"));
        }
        let params = RequestParams {
            stream: true,
            stream_options: Some(StreamOptions { include_usage: true }),
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            ..Default::default()
        };
        let body = request_body(&model, &messages, &params, None);
        Ok((model, body))
    }
}

/// The user's text of this turn: a string, or the text of user message items.
fn user_input(input: &Input) -> Result<UserInput, OaiError> {
    let items = match input {
        Input::Text(t) => return Ok(UserInput { text: t.clone(), ..Default::default() }),
        Input::Items(items) => items,
    };
    let mut texts = Vec::new();
    let mut input = UserInput::default();
    for item in items {
        match item.role.as_deref() {
            Some("user") => texts.push(user_content(item.content.as_ref(), &mut input)?),
            Some("system" | "developer") => {
                return Err(OaiError::bad_request("send system text as `instructions`"));
            }
            _ => {
                return Err(OaiError::bad_request(
                    "input items must be user messages; earlier turns belong in the conversation \
                     (POST /v1/conversations/{id}/items), or send store: false with the whole history",
                ))
            }
        }
    }
    input.text = texts.join("\n\n");
    Ok(input)
}

/// A stored turn's input: its text and the uploaded files it attaches (DESIGN §12).
#[derive(Debug, Default)]
struct UserInput {
    text: String,
    images: Vec<String>,
    documents: Vec<String>,
}

/// A user item's text; its `input_image` and `input_file` parts, by `file_id`, go to
/// `input` (bytes inline are refused: upload them once, send the id every time).
fn user_content(content: Option<&Content>, input: &mut UserInput) -> Result<String, OaiError> {
    let Some(Content::Parts(parts)) = content else { return content_text(content) };
    let mut text = String::new();
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str);
        let file_id = part.get("file_id").and_then(Value::as_str);
        match (kind, file_id) {
            (Some("input_image"), Some(id)) => input.images.push(id.to_owned()),
            (Some("input_file"), Some(id)) => input.documents.push(id.to_owned()),
            (Some("input_image" | "input_file"), None) => {
                return Err(OaiError::bad_request(
                    "send an image or a file by file_id: upload it with POST /v1/files first",
                ))
            }
            _ => text.push_str(part_text(part)?),
        }
    }
    Ok(text)
}

/// The messages of a stateless request's `input`: its whole history.
fn stateless_messages(input: &Input) -> Result<Vec<ChatMessage>, OaiError> {
    let items = match input {
        Input::Text(t) => return Ok(vec![ChatMessage::text(Role::User, t.clone())]),
        Input::Items(items) => items,
    };
    items
        .iter()
        .map(|item| {
            let role = match item.role.as_deref() {
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("system" | "developer") => Role::System,
                _ => return Err(OaiError::bad_request("input items must be messages with a role")),
            };
            Ok(ChatMessage::text(role, content_text(item.content.as_ref())?))
        })
        .collect()
}

/// The text of an input item's content: a string, or its text parts joined.
fn content_text(content: Option<&Content>) -> Result<String, OaiError> {
    match content {
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            parts.iter().map(part_text).collect::<Result<Vec<_>, _>>().map(|texts| texts.join(""))
        }
        None => Ok(String::new()),
    }
}

/// A content part's text: `input_text` or `output_text`.
fn part_text(part: &Value) -> Result<&str, OaiError> {
    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
        (Some("input_text" | "output_text"), Some(t)) => Ok(t),
        (kind, _) => Err(OaiError::bad_request(format!(
            "input content of type {} is not supported here; send input_text (and, on a stored \
             response, input_image or input_file by file_id)",
            kind.unwrap_or("(none)")
        ))),
    }
}

/// `GET /v1/responses/{id}`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RetrieveParams {
    /// Re-attach as an event stream.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The last `sequence_number` the client has.
    #[serde(default)]
    #[param(minimum = 0)]
    pub starting_after: Option<i64>,
}

impl RetrieveParams {
    /// `starting_after`, a sequence number: 0 or more.
    pub fn starting_after(&self) -> Result<Option<u64>, OaiError> {
        self.starting_after
            .map(|n| u64::try_from(n).map_err(|_| OaiError::bad_request("starting_after must be 0 or more")))
            .transpose()
    }
}
