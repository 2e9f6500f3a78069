//! The requests of `/v1/responses` (DESIGN §13): the fields of OpenAI's
//! `ResponseCreateParams` turnlog reads, and what a request becomes — a stored turn's
//! message, options and echo, or with `store: false` the gateway request of the whole
//! history it sends — and `GET /v1/responses/{id}`'s query.

use serde::Deserialize;
use serde_json::{json, Value};
use turnlog_core::audit::MAX_SYSTEM_PROMPT_BYTES;
use turnlog_core::request_body::{request_body, RequestBody, RequestParams, ResponseFormat, StreamOptions};
use turnlog_core::{ChatMessage, Role};
use utoipa::{IntoParams, ToSchema};

use super::translate::Echo;
use crate::config::IngressConfig;
use crate::openai::params::{self, TextParam};
use crate::openai::OaiError;
use crate::turn::{
    call_id_fits, NamedServer, NewMessage, ServerTools, ToolOffer, ToolResult, TurnOptions, MAX_CALL_ID,
};
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
    /// Function tools the client runs (DESIGN §14): a response whose step calls them is
    /// `completed` with `function_call` items; `function_call_output` items continue it.
    /// Hosted tools (web search, file search, …) are refused.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// The answer's format (structured outputs): sent to the model and recorded with the
    /// request.
    #[serde(default)]
    pub text: Option<TextParam>,
    #[serde(default)]
    pub reasoning: Option<Reasoning>,
    /// `none`, `auto`, `required` or `{type: "function", name}` naming an offered tool.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Refused: turnlog keeps no prompt templates.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub prompt: Option<Value>,
}

/// `reasoning`: its effort reaches the model (its summary setting is ignored).
#[derive(Debug, Deserialize, ToSchema)]
pub struct Reasoning {
    #[serde(default)]
    pub effort: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// An input item: a message (`type` absent or `message`), an `item_reference` to one of
/// turnlog's items, a `reasoning` item (skipped: turnlog keeps its own), or a step's
/// `function_call` and a client tool's `function_call_output` (DESIGN §14).
#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// A message's or a reference's id: `msg_<32 hex>` names one of turnlog's items; a
    /// `function_call`'s `fc_<32 hex>…` names the response that made it.
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub call_id: Option<String>,
    /// A `function_call_output`'s output: a string, or input parts (their text counts).
    #[serde(default)]
    pub output: Option<Content>,
    /// An `mcp_approval_response`'s answer to the approval request it names (DESIGN §14).
    #[serde(default)]
    pub approval_request_id: Option<String>,
    #[serde(default)]
    pub approve: Option<bool>,
}

impl InputItem {
    fn is_system(&self) -> bool {
        self.is_message() && matches!(self.role.as_deref(), Some("system" | "developer"))
    }

    fn is_message(&self) -> bool {
        matches!(self.kind.as_deref(), None | Some("message"))
    }

    fn is_reference(&self) -> bool {
        self.kind.as_deref() == Some("item_reference")
    }

    fn is_call(&self) -> bool {
        self.kind.as_deref() == Some("function_call")
    }

    fn is_output(&self) -> bool {
        self.kind.as_deref() == Some("function_call_output")
    }

    fn is_approval(&self) -> bool {
        self.kind.as_deref() == Some("mcp_approval_response")
    }

    /// An `mcp_approval_response` as the permission answer it gives.
    fn approval(&self) -> Result<Approval, OaiError> {
        match (self.approval_request_id.as_deref(), self.approve) {
            (Some(id), Some(approve)) if !id.is_empty() && id.len() <= 64 => {
                Ok(Approval { request_id: id.to_owned(), approve })
            }
            _ => Err(OaiError::bad_request(
                "an mcp_approval_response names its request by approval_request_id and says approve: true or false",
            )),
        }
    }

    /// A `function_call_output` as the result it sends.
    fn tool_result(&self) -> Result<ToolResult, OaiError> {
        let call_id = self.call_id.as_deref().unwrap_or_default();
        if !call_id_fits(call_id) {
            return Err(OaiError::bad_request(format!(
                "a function_call_output names its call by call_id (1-{MAX_CALL_ID} characters)"
            )));
        }
        Ok(ToolResult {
            call_id: call_id.to_owned(),
            output: content_text(self.output.as_ref())?,
            is_error: false,
        })
    }

    /// The turnlog item the id names, when it is one of turnlog's ids.
    fn message_id(&self) -> Option<uuid::Uuid> {
        self.id
            .as_deref()
            .and_then(|id| id.strip_prefix("msg_"))
            .and_then(|hex| (hex.len() == 32).then(|| uuid::Uuid::parse_str(hex).ok()).flatten())
    }
}

/// A message of a resent history (Responses `input` with earlier turns in it, DESIGN §13):
/// its role and text, or for an `item_reference` only the id whose item gives them; or a
/// step's tool traffic (`tool`), which the log holds and only a turn's continuation reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryItem {
    pub tool: Option<ToolItem>,
    pub user: bool,
    /// None for a reference.
    pub text: Option<String>,
    /// The turnlog item it names (a reference's, or a message's own id).
    pub id: Option<uuid::Uuid>,
    pub reference: bool,
    /// A user message's images and documents, by file id.
    pub images: Vec<String>,
    pub documents: Vec<String>,
}

/// A history item's tool traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolItem {
    /// A step's call (its `id` names the response that made it).
    Call,
    /// A client tool's result.
    Output(ToolResult),
}

/// The answer to a server tool's approval request (an `mcp_approval_request` item's id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approval {
    pub request_id: String,
    pub approve: bool,
}

/// What a stored response's input is.
#[derive(Debug)]
pub enum StoredInput {
    /// The results of the tool calls the named conversation's turn waits for (only
    /// `function_call_output` items, with `previous_response_id` or `conversation`).
    ToolResults(Vec<ToolResult>),
    /// Answers to the approval requests the named conversation's turn waits for (only
    /// `mcp_approval_response` items, with `previous_response_id` or `conversation`).
    Approvals(Vec<Approval>),
    /// This turn's user text and files: a string, or user items (joined).
    Turn(NewMessage),
    /// A history: earlier turns (assistant messages, references to turnlog's items, or
    /// messages with turnlog's ids) and the user message to answer last.
    History(Vec<HistoryItem>),
}

/// Most items a resent history may hold.
const MAX_HISTORY_ITEMS: usize = 1_000;

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
        // Every field that changes the answer reaches the model or is refused.
        req.tool_offer()?;
        req.mcp_servers()?;
        params::unsupported("prompt", req.prompt.as_ref(), "turnlog keeps no prompt templates")?;
        req.response_format()?;
        Ok(req)
    }

    /// The function tools the request offers, in the gateway's (Chat Completions') shape:
    /// `{type: "function", name, description?, parameters?, strict?}` becomes
    /// `{type: "function", function: {…}}`, and `tool_choice` `{type: "function", name}`
    /// becomes `{type: "function", function: {name}}`.
    fn tool_offer(&self) -> Result<Option<ToolOffer>, OaiError> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let mut chat = Vec::with_capacity(tools.len());
        for t in tools {
            let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
            if kind == "mcp" {
                continue; // the servers' tools: `mcp_servers`
            }
            let Some(spec) = t.as_object().filter(|_| kind == "function") else {
                return Err(OaiError::bad_request(format!(
                    "tools of type {kind:?} are not supported: turnlog offers function tools, which the client runs, \
                     and mcp tools naming its operator's MCP servers"
                )));
            };
            let function: serde_json::Map<String, Value> = spec
                .iter()
                .filter(|(k, _)| k.as_str() != "type")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            chat.push(json!({"type": "function", "function": function}));
        }
        let choice = match &self.tool_choice {
            Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
                Some(json!({"type": "function", "function": {"name": c.get("name")}}))
            }
            Some(Value::Object(_)) => {
                return Err(OaiError::bad_request(
                    "tool_choice is none, auto, required or {type: \"function\", name}",
                ))
            }
            other => other.clone(),
        };
        params::tools(&chat, choice.as_ref(), self.parallel_tool_calls)
    }

    /// The MCP servers the request names (`{type: "mcp", server_label, allowed_tools?}`,
    /// DESIGN §14): only the operator's, by label; a request never names where to connect.
    pub fn mcp_servers(&self) -> Result<Vec<NamedServer>, OaiError> {
        let mut named: Vec<NamedServer> = Vec::new();
        for t in self.tools.as_deref().unwrap_or_default() {
            if t.get("type").and_then(Value::as_str) != Some("mcp") {
                continue;
            }
            let spec = t.as_object().map(|m| m.iter().collect::<Vec<_>>()).unwrap_or_default();
            let mut label = None;
            let mut allowed_tools = None;
            for (key, value) in spec {
                match key.as_str() {
                    "type" => {}
                    "server_label" => label = value.as_str(),
                    "allowed_tools" if value.is_null() => {}
                    "allowed_tools" => {
                        let names = value.get("tool_names").unwrap_or(value);
                        let list: Option<Vec<String>> = names
                            .as_array()
                            .and_then(|a| a.iter().map(|n| n.as_str().map(str::to_owned)).collect());
                        let read_only = value.get("read_only").is_some_and(|r| !r.is_null());
                        match list {
                            Some(list) if !read_only && list.len() <= 128 => allowed_tools = Some(list),
                            _ => {
                                return Err(OaiError::bad_request(
                                    "allowed_tools is a list of tool names, or {tool_names: [...]}",
                                ))
                            }
                        }
                    }
                    "server_url" | "connector_id" | "tunnel_id" | "authorization" | "headers" => {
                        return Err(OaiError::bad_request(format!(
                            "mcp tools name one of turnlog's configured MCP servers by server_label; {key} \
                             is not accepted: turnlog connects only where its operator configured"
                        )))
                    }
                    "require_approval" if value.is_null() => {}
                    "require_approval" => {
                        return Err(OaiError::bad_request(
                            "require_approval is not accepted: turnlog's operator sets each tool's approval \
                             (allow, ask or deny) in TURNLOG_MCP_SERVERS",
                        ))
                    }
                    other => {
                        return Err(OaiError::bad_request(format!("mcp tools do not take {other}")));
                    }
                }
            }
            let Some(label) = label.filter(|l| !l.is_empty() && l.len() <= 64) else {
                return Err(OaiError::bad_request("an mcp tool names its server by server_label"));
            };
            if named.iter().any(|n| n.label == label) {
                return Err(OaiError::bad_request(format!("the MCP server {label:?} is named twice")));
            }
            named.push(NamedServer { label: label.to_owned(), allowed_tools });
        }
        Ok(named)
    }

    /// The answer's format the request asks for (none for plain text).
    fn response_format(&self) -> Result<Option<ResponseFormat>, OaiError> {
        self.text.as_ref().map_or(Ok(None), TextParam::format)
    }

    /// The request's system text: `instructions`, then its `system` and `developer` input
    /// messages (as OpenAI reads them), joined by blank lines.
    pub fn system(&self) -> Result<Option<String>, OaiError> {
        let mut parts: Vec<String> = self.instructions.iter().cloned().collect();
        if let Input::Items(items) = &self.input {
            for item in items.iter().filter(|i| i.is_system()) {
                if let Some(Content::Parts(p)) = &item.content {
                    if p.iter().any(|p| p.get("type").and_then(Value::as_str) != Some("input_text")) {
                        return Err(OaiError::bad_request("a system or developer message holds text only"));
                    }
                }
                parts.push(content_text(item.content.as_ref())?);
            }
        }
        let system = parts.join("\n\n");
        if system.len() > MAX_SYSTEM_PROMPT_BYTES {
            return Err(OaiError::bad_request(format!(
                "instructions and system messages take more than {MAX_SYSTEM_PROMPT_BYTES} bytes"
            )));
        }
        Ok((!parts.is_empty()).then_some(system))
    }

    /// A stored response's checks: one way to name the conversation, and instructions that
    /// fit a system prompt.
    pub fn check_stored(&self) -> Result<(), OaiError> {
        if self.conversation.is_some() && self.previous_response_id.is_some() {
            return Err(OaiError::bad_request("send conversation or previous_response_id, not both"));
        }
        self.system()?;
        Ok(())
    }

    /// `store: false`'s checks: nothing kept, so nothing to continue or to run in the
    /// background.
    pub fn check_stateless(&self) -> Result<(), OaiError> {
        if self.background {
            return Err(OaiError::bad_request("background responses are stored: send store: true"));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(OaiError::bad_request(
                "tools run in stored responses only (a turn that pauses for them is kept): send store: true",
            ));
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

    /// A stored response's input: this turn's message, or a resent history when it holds
    /// earlier turns (an assistant message, an `item_reference`, a message with one of
    /// turnlog's ids). A history cannot also name a conversation or previous response.
    pub fn stored_input(&self) -> Result<StoredInput, OaiError> {
        let Input::Items(items) = &self.input else {
            return Ok(StoredInput::Turn(self.new_message(user_input(&self.input)?)));
        };
        let mut rest =
            items.iter().filter(|i| !i.is_system() && i.kind.as_deref() != Some("reasoning")).peekable();
        let named = self.conversation.is_some() || self.previous_response_id.is_some();
        if items.iter().any(InputItem::is_approval) {
            if !items.iter().all(|i| i.is_approval() || i.is_system()) || !named {
                return Err(OaiError::bad_request(
                    "mcp_approval_response items continue a response: send them alone, with \
                     previous_response_id or conversation",
                ));
            }
            if items.len() > MAX_HISTORY_ITEMS {
                return Err(OaiError::bad_request(format!("input holds at most {MAX_HISTORY_ITEMS} items")));
            }
            let approvals = items.iter().filter(|i| i.is_approval()).map(InputItem::approval);
            return approvals.collect::<Result<_, _>>().map(StoredInput::Approvals);
        }
        if rest.peek().is_some() && rest.all(InputItem::is_output) {
            if self.conversation.is_none() && self.previous_response_id.is_none() {
                return Err(OaiError::bad_request(
                    "function_call_output items continue a response: send previous_response_id or \
                     conversation with them, or the whole history",
                ));
            }
            if items.len() > MAX_HISTORY_ITEMS {
                return Err(OaiError::bad_request(format!("input holds at most {MAX_HISTORY_ITEMS} items")));
            }
            let results = items.iter().filter(|i| i.is_output()).map(InputItem::tool_result);
            return results.collect::<Result<_, _>>().map(StoredInput::ToolResults);
        }
        let history = items.iter().any(|i| {
            i.is_reference()
                || i.is_call()
                || i.is_output()
                || (i.is_message() && (i.role.as_deref() == Some("assistant") || i.message_id().is_some()))
        });
        if !history {
            return Ok(StoredInput::Turn(self.new_message(user_input(&self.input)?)));
        }
        if self.conversation.is_some() || self.previous_response_id.is_some() {
            return Err(OaiError::bad_request(
                "input holds earlier turns: send the history alone, or conversation or \
                 previous_response_id with only the new messages",
            ));
        }
        if items.len() > MAX_HISTORY_ITEMS {
            return Err(OaiError::bad_request(format!("input holds at most {MAX_HISTORY_ITEMS} items")));
        }
        history_items(items).map(StoredInput::History)
    }

    fn new_message(&self, input: UserInput) -> NewMessage {
        NewMessage {
            text: input.text,
            category: None,
            model: self.model.clone(),
            images: input.images,
            documents: input.documents,
        }
    }

    /// The stored turn's options: its system text, the sampling parameters and the answer's
    /// format it sets.
    pub fn options(&self) -> Result<TurnOptions, OaiError> {
        let effort = self.reasoning.as_ref().and_then(|r| r.effort.clone());
        if effort.as_ref().is_some_and(|e| e.is_empty() || e.chars().count() > 64) {
            return Err(OaiError::bad_request("reasoning.effort is 1-64 characters"));
        }
        let options = TurnOptions {
            system: self.system()?,
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            reasoning_effort: effort,
            response_format: self.response_format()?,
            tools: self.tool_offer()?,
            server_tools: ServerTools::Named(self.mcp_servers()?),
            // A prompt ends the response: the client answers with mcp_approval_response.
            permission_wait: Some(std::time::Duration::ZERO),
            ..Default::default()
        };
        validate::turn_options(&options)?;
        Ok(options)
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
            text: self.text.as_ref().map(TextParam::echo),
            reasoning_effort: self.reasoning.as_ref().and_then(|r| r.effort.clone()),
            tools: self.tools.clone().unwrap_or_default(),
            tool_choice: self.tool_choice.clone().filter(|c| !c.is_null()),
            parallel_tool_calls: self.parallel_tool_calls,
            mcp: Vec::new(),
            approved: Vec::new(),
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
        let options = self.options()?;
        let params = RequestParams {
            stream: true,
            stream_options: Some(StreamOptions { include_usage: true }),
            max_tokens: options.max_tokens,
            temperature: options.temperature,
            top_p: options.top_p,
            reasoning_effort: options.reasoning_effort,
            response_format: options.response_format,
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
    for item in items.iter().filter(|i| !i.is_system() && i.kind.as_deref() != Some("reasoning")) {
        match item.role.as_deref() {
            Some("user") if item.is_message() => texts.push(user_content(item.content.as_ref(), &mut input)?),
            _ => {
                return Err(OaiError::bad_request(
                    "input items must be messages (user, assistant, system or developer), \
                     item_references or reasoning items",
                ))
            }
        }
    }
    input.text = texts.join("\n\n");
    Ok(input)
}

/// A resent history's messages, in order (system messages and reasoning items left out:
/// the first are the request's system text, the second turnlog keeps itself).
fn history_items(items: &[InputItem]) -> Result<Vec<HistoryItem>, OaiError> {
    let mut out = Vec::with_capacity(items.len());
    for item in items.iter().filter(|i| !i.is_system()) {
        if item.is_call() || item.is_output() {
            let tool = if item.is_call() { ToolItem::Call } else { ToolItem::Output(item.tool_result()?) };
            out.push(HistoryItem {
                tool: Some(tool),
                user: false,
                text: None,
                id: item.id.as_deref().and_then(crate::openai::parse_call_item),
                reference: false,
                images: Vec::new(),
                documents: Vec::new(),
            });
            continue;
        }
        if item.is_reference() {
            let id = item.message_id().ok_or_else(|| no_item(item.id.as_deref().unwrap_or_default()))?;
            out.push(HistoryItem {
                tool: None,
                user: false,
                text: None,
                id: Some(id),
                reference: true,
                images: Vec::new(),
                documents: Vec::new(),
            });
            continue;
        }
        match (item.kind.as_deref(), item.role.as_deref()) {
            (Some("reasoning"), _) => continue,
            (None | Some("message"), Some(role @ ("user" | "assistant"))) => {
                let user = role == "user";
                let mut input = UserInput::default();
                let text = if user {
                    user_content(item.content.as_ref(), &mut input)?
                } else {
                    content_text(item.content.as_ref())?
                };
                out.push(HistoryItem {
                    tool: None,
                    user,
                    text: Some(text),
                    id: item.message_id(),
                    reference: false,
                    images: input.images,
                    documents: input.documents,
                });
            }
            (None | Some("message"), _) => {
                return Err(OaiError::bad_request(
                    "a message's role must be user, assistant, system or developer",
                ))
            }
            (Some(kind), _) => {
                return Err(OaiError::bad_request(format!(
                    "input items of type {kind} are not supported: send messages, item_references, \
                     function_call and function_call_output items"
                )))
            }
        }
    }
    Ok(out)
}

/// The 404 of an `item_reference` to no item of the caller's.
pub fn no_item(id: &str) -> OaiError {
    OaiError(crate::error::ApiError::NotFound(format!("item {id:?} not found")))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<CreateResponse, OaiError> {
        CreateResponse::parse(&serde_json::to_vec(&v).unwrap())
    }

    #[test]
    fn system_and_developer_items_follow_the_instructions() {
        let r = req(serde_json::json!({"instructions": "A.", "input": [
            {"role": "system", "content": "B."},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "C."}]},
            {"role": "user", "content": "Hi"},
        ]}))
        .unwrap();
        assert_eq!(r.system().unwrap().as_deref(), Some("A.\n\nB.\n\nC."));
        let StoredInput::Turn(m) = r.stored_input().unwrap() else { panic!("a turn") };
        assert_eq!(m.text, "Hi");
        let none = req(serde_json::json!({"input": "Hi"})).unwrap();
        assert_eq!(none.system().unwrap(), None);
    }

    #[test]
    fn earlier_turns_make_a_history_and_user_items_alone_a_turn() {
        let id = "msg_0123456789abcdef0123456789abcdef";
        let history = |items: Value| match req(serde_json::json!({"input": items})).unwrap().stored_input() {
            Ok(StoredInput::History(h)) => Some(h),
            Ok(StoredInput::Turn(_) | StoredInput::ToolResults(_) | StoredInput::Approvals(_)) => None,
            Err(e) => panic!("{e:?}"),
        };
        let h = history(serde_json::json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "a"},
            {"type": "item_reference", "id": id},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "user", "content": [{"type": "input_text", "text": "b"}]},
        ]))
        .unwrap();
        assert_eq!(h.len(), 3);
        assert!(h[1].reference && h[1].text.is_none());
        assert_eq!(h[1].id.map(|u| u.simple().to_string()), Some(id[4..].to_owned()));
        // An assistant message without an id, or a user message with one of turnlog's ids.
        assert!(history(
            serde_json::json!([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
        )
        .is_some());
        assert!(history(serde_json::json!([{"id": id, "type": "message", "role": "user", "content": "y"}]))
            .is_some());
        // User messages alone are this turn's text.
        assert!(history(
            serde_json::json!([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
        )
        .is_none());
        // A history with a conversation, or items of other types, are refused.
        let both = req(
            serde_json::json!({"conversation": "conv_x", "input": [{"type": "item_reference", "id": id}]}),
        );
        assert!(both.unwrap().stored_input().is_err());
        let other = req(serde_json::json!({"input": [{"type": "web_search_call", "id": "ws_1"},
                                                     {"role": "assistant", "content": "x"}]}));
        assert!(other.unwrap().stored_input().is_err());
    }

    #[test]
    fn function_call_outputs_continue_a_named_response_or_end_a_history() {
        let outputs = serde_json::json!([{"type": "function_call_output", "call_id": "c1", "output": "14C"}]);
        // Alone, they need the response they continue.
        assert!(req(serde_json::json!({"input": outputs})).unwrap().stored_input().is_err());
        let named = req(serde_json::json!({"previous_response_id": "resp_x", "input": outputs})).unwrap();
        match named.stored_input().unwrap() {
            StoredInput::ToolResults(r) => {
                assert_eq!((r[0].call_id.as_str(), r[0].output.as_str()), ("c1", "14C"))
            }
            other => panic!("{other:?}"),
        }
        // In a history, after the step's calls (whose ids name the response that made them).
        let call_id = "fc_0123456789abcdef0123456789abcdef0001";
        let history = req(serde_json::json!({"input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "id": call_id, "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "14C"}]},
        ]}))
        .unwrap();
        let StoredInput::History(items) = history.stored_input().unwrap() else { panic!("a history") };
        assert_eq!(items[1].tool, Some(ToolItem::Call));
        assert_eq!(
            items[1].id.map(|u| u.simple().to_string()).as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert!(matches!(&items[2].tool, Some(ToolItem::Output(r)) if r.output == "14C"));
    }

    #[test]
    fn function_tools_reach_the_model_in_chat_completions_shape_and_hosted_tools_are_refused() {
        let r = req(serde_json::json!({"input": "x", "parallel_tool_calls": false,
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "weather"}}))
        .unwrap();
        let offer = r.options().unwrap().tools.unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&offer.tools).unwrap(),
            serde_json::json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            offer.tool_choice.as_deref(),
            Some(r#"{"function":{"name":"weather"},"type":"function"}"#)
        );
        assert_eq!(offer.parallel_tool_calls, Some(false));
        assert!(req(serde_json::json!({"input": "x", "tools": [{"type": "web_search"}]})).is_err());
        assert!(
            req(serde_json::json!({"input": "x", "tools": [{"type": "function", "name": "a b"}]})).is_err()
        );
        assert!(req(serde_json::json!({"input": "x", "tool_choice": {"type": "function", "name": "nope"},
            "tools": [{"type": "function", "name": "weather"}]}))
        .is_err());
    }

    #[test]
    fn answer_changing_fields_are_read_or_refused() {
        assert!(req(serde_json::json!({"input": "x", "tools": [], "include": [], "text": {}})).is_ok());
        assert!(req(serde_json::json!({"input": "x", "prompt": {"id": "p"}})).is_err());
        assert!(req(serde_json::json!({"input": "x", "tool_choice": "required"})).is_err());
        let r = req(serde_json::json!({"input": "x", "reasoning": {"effort": "high"},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}}))
        .unwrap();
        let options = r.options().unwrap();
        assert_eq!(options.reasoning_effort.as_deref(), Some("high"));
        assert_eq!(options.response_format.unwrap().kind, "json_schema");
        let bad = req(
            serde_json::json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 3}}}),
        );
        assert!(bad.unwrap().options().is_err());
    }
}
