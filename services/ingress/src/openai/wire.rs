//! OpenAI's wire formats as the OpenAPI document states them (DESIGN §13): the objects the
//! OpenAI-compatible routes answer with and the bodies of conversations' writes. The
//! handlers build and read these as JSON (`serde_json::Value`) and their bytes are as
//! before; these types only describe them, and schemathesis (`tests/schemathesis`) checks
//! every answer against them. The requests of Responses and Chat Completions are described
//! by the structs they are parsed into (`responses::request`, `chat::request`).

use std::collections::HashMap;

use serde::Serialize;
use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type};
use utoipa::ToSchema;

use crate::openapi::NON_BLANK;

// --- Bodies of conversations' writes. ---

/// `POST /v1/conversations`: a conversation, with starting messages if given.
#[derive(ToSchema)]
pub struct ConversationCreate {
    #[schema(schema_with = crate::openapi::metadata_to_start)]
    pub metadata: Option<HashMap<String, String>>,
    /// Messages to start with, added without calling the model: at most 20.
    #[schema(max_items = 20)]
    pub items: Option<Vec<NewMessage>>,
}

/// `POST /v1/conversations/{id}`: its metadata, replaced whole.
#[derive(ToSchema)]
pub struct ConversationUpdate {
    #[schema(schema_with = crate::openapi::metadata_to_set)]
    pub metadata: HashMap<String, String>,
}

/// `POST /v1/conversations/{id}/items`: messages added without calling the model.
#[derive(ToSchema)]
pub struct ItemsCreate {
    /// 1 to 20 messages, appended in order.
    #[schema(min_items = 1, max_items = 20)]
    pub items: Vec<NewMessage>,
}

/// A message to add: a user message or an answer, as text.
#[derive(ToSchema)]
pub struct NewMessage {
    /// `message`, the only kind of item that can be added.
    #[schema(rename = "type", inline, nullable = false)]
    pub kind: Option<MessageType>,
    #[schema(inline)]
    pub role: Role,
    /// A string, or text parts (`input_text`, `output_text` or `text`) joined; not blank.
    #[schema(schema_with = new_message_content)]
    pub content: String,
}

fn non_blank() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String).min_length(Some(1)).pattern(Some(NON_BLANK))
}

fn new_message_content() -> Schema {
    let part = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "type",
            ObjectBuilder::new().schema_type(Type::String).enum_values(Some([
                "input_text",
                "output_text",
                "text",
            ])),
        )
        .property("text", non_blank())
        .required("type")
        .required("text");
    let parts = ArrayBuilder::new().items(part).min_items(Some(1));
    Schema::AnyOf(AnyOfBuilder::new().item(non_blank()).item(parts).build())
}

/// A response's `tool_choice`: a mode, or the function it must call.
fn tool_choice() -> Schema {
    let mode = ObjectBuilder::new().schema_type(Type::String).enum_values(Some(["none", "auto", "required"]));
    let function = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("type", ObjectBuilder::new().schema_type(Type::String).enum_values(Some(["function"])))
        .property("name", ObjectBuilder::new().schema_type(Type::String))
        .required("type");
    Schema::AnyOf(AnyOfBuilder::new().item(mode).item(function).build())
}

/// `input` of `POST /v1/responses`: the user's text, or input items (a stored response
/// takes user messages only; `store: false` the whole history).
pub fn response_input() -> Schema {
    let content = AnyOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(Type::String))
        .item(ArrayBuilder::new().items(ObjectBuilder::new().schema_type(Type::Object)));
    let item = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("role", ObjectBuilder::new().schema_type(Type::String))
        .property("content", content);
    Schema::AnyOf(
        AnyOfBuilder::new()
            .description(Some("The user's text (not blank), or input items: OpenAI's `ResponseInputItem`s."))
            .item(non_blank())
            .item(ArrayBuilder::new().items(item))
            .build(),
    )
}

/// `content` of a Chat Completions message: a string, parts, or null.
pub fn chat_content() -> Schema {
    Schema::AnyOf(
        AnyOfBuilder::new()
            .description(Some("A string, or OpenAI's content parts (`text`, `image_url` with a data URL)."))
            .item(ObjectBuilder::new().schema_type(Type::String))
            .item(ArrayBuilder::new().items(ObjectBuilder::new().schema_type(Type::Object)))
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .build(),
    )
}

// --- Objects the routes answer with. ---

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageType {
    Message,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
}

/// A conversation: a session (`conv_<32 hex>`).
#[derive(ToSchema)]
pub struct Conversation {
    pub id: String,
    #[schema(inline)]
    pub object: ConversationObject,
    /// Unix seconds.
    pub created_at: i64,
    pub metadata: HashMap<String, String>,
}

#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ConversationObject {
    Conversation,
}

/// A deleted conversation.
#[derive(ToSchema)]
pub struct ConversationDeleted {
    pub id: String,
    #[schema(inline)]
    pub object: ConversationDeletedObject,
    pub deleted: bool,
}

#[derive(ToSchema)]
pub enum ConversationDeletedObject {
    #[schema(rename = "conversation.deleted")]
    Deleted,
}

/// A page of items, oldest or newest first as asked.
#[derive(ToSchema)]
pub struct ItemList {
    #[schema(inline)]
    pub object: ListObject,
    pub data: Vec<ConversationItem>,
    /// The first item's id; empty when there is none.
    pub first_id: String,
    /// The last item's id; empty when there is none.
    pub last_id: String,
    pub has_more: bool,
}

#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ListObject {
    List,
}

/// A message item: a user message (`msg_` and its event id) or an answer (`msg_` and its
/// attempt id), its text as one part.
#[derive(Serialize, ToSchema)]
pub struct MessageItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: MessageType,
    pub id: String,
    #[schema(inline)]
    pub role: Role,
    /// `completed`; `incomplete` for an interrupted answer (as a stream's events show it,
    /// `in_progress` while it runs).
    #[schema(inline)]
    pub status: ItemStatus,
    pub content: Vec<TextPart>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    InProgress,
    Completed,
    Incomplete,
}

/// A text part: `input_text` (a user's), `output_text` (an answer's, with empty
/// `annotations` and `logprobs`) or `reasoning_text`.
#[derive(Serialize, ToSchema)]
pub struct TextPart {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: PartType,
    pub text: String,
    #[schema(nullable = false, value_type = Option<Vec<Object>>)]
    pub annotations: Option<Vec<serde_json::Value>>,
    #[schema(nullable = false, value_type = Option<Vec<Object>>)]
    pub logprobs: Option<Vec<serde_json::Value>>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartType {
    InputText,
    OutputText,
    ReasoningText,
}

/// A reasoning item (`rs_` and the attempt id): the model's reasoning text.
#[derive(Serialize, ToSchema)]
pub struct ReasoningItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: ReasoningType,
    pub id: String,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub summary: Vec<serde_json::Value>,
    pub content: Vec<TextPart>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningType {
    Reasoning,
}

/// An item of a response's output: its reasoning, the tools of the MCP servers it names,
/// its server calls and prompts, its answer, then the calls of a step that asks for the
/// client's tools (DESIGN §14).
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum OutputItem {
    Reasoning(ReasoningItem),
    McpListTools(McpListToolsItem),
    McpCall(McpCallItem),
    McpApprovalRequest(McpApprovalRequestItem),
    Message(MessageItem),
    FunctionCall(FunctionCallItem),
}

/// An item of a conversation: a message, a step's tool call, or its result; a server
/// tool's call and result as one `mcp_call` (DESIGN §14).
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum ConversationItem {
    Message(MessageItem),
    FunctionCall(FunctionCallItem),
    FunctionCallOutput(FunctionCallOutputItem),
    McpCall(McpCallItem),
}

/// The tools of an MCP server a request names (`mcpl_`, the response's attempt and the
/// server's place, 4 hex digits).
#[derive(Serialize, ToSchema)]
pub struct McpListToolsItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: McpListToolsType,
    pub id: String,
    pub server_label: String,
    /// `{name, description, input_schema, annotations}` each.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    pub error: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpListToolsType {
    McpListTools,
}

/// A server tool's call (`mcp_`): its server, the tool's own name, the model's arguments,
/// and its output, or its error (`{type: "mcp_tool_execution_error", content}`).
#[derive(Serialize, ToSchema)]
pub struct McpCallItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: McpCallType,
    pub id: String,
    pub server_label: String,
    pub name: String,
    pub arguments: String,
    pub output: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub error: Option<serde_json::Value>,
    /// `in_progress`, `completed` or `failed`.
    pub status: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpCallType {
    McpCall,
}

/// A server tool's call waiting for the user's approval: its id is the permission
/// request's, which an `mcp_approval_response` input item answers.
#[derive(Serialize, ToSchema)]
pub struct McpApprovalRequestItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: McpApprovalRequestType,
    pub id: String,
    pub server_label: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpApprovalRequestType {
    McpApprovalRequest,
}

/// A step's call of a client tool (`fc_`, the attempt id of the response that made it and
/// the call's place, 4 hex digits); `call_id` is the model's, `arguments` its JSON text.
#[derive(Serialize, ToSchema)]
pub struct FunctionCallItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: FunctionCallType,
    pub id: String,
    pub call_id: String,
    pub name: String,
    pub arguments: String,
    #[schema(inline)]
    pub status: ItemStatus,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FunctionCallType {
    FunctionCall,
}

/// A tool's result as the log holds it (`fco_` and its event id): the output the model
/// was sent.
#[derive(Serialize, ToSchema)]
pub struct FunctionCallOutputItem {
    #[serde(rename = "type")]
    #[schema(inline)]
    pub kind: FunctionCallOutputType,
    pub id: String,
    pub call_id: String,
    pub output: String,
    #[schema(inline)]
    pub status: ItemStatus,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FunctionCallOutputType {
    FunctionCallOutput,
}

/// A response: one turn's attempt (`resp_<32 hex>`), as OpenAI's `Response` object. The
/// fields turnlog does not act on have OpenAI's defaults.
#[derive(ToSchema)]
pub struct ResponseObject {
    pub id: String,
    #[schema(inline)]
    pub object: ResponseType,
    /// Unix seconds.
    pub created_at: i64,
    #[schema(inline)]
    pub status: ResponseStatus,
    pub background: bool,
    /// A failed response's error (`code` `server_error`).
    #[schema(required = true)]
    pub error: Option<ResponseError>,
    /// Why a response is incomplete: `max_output_tokens`, or `interrupted`.
    #[schema(required = true)]
    pub incomplete_details: Option<IncompleteDetails>,
    #[schema(required = true)]
    pub instructions: Option<String>,
    #[schema(required = true, value_type = Option<i64>, minimum = 0)]
    pub max_output_tokens: Option<u32>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    #[schema(required = true)]
    pub previous_response_id: Option<String>,
    /// OpenAI's reasoning settings; always `{effort: null, summary: null}`.
    #[schema(value_type = Object)]
    pub reasoning: serde_json::Value,
    pub store: bool,
    #[schema(required = true)]
    pub temperature: Option<f64>,
    /// OpenAI's text settings; always `{format: {type: text}}`.
    #[schema(value_type = Object)]
    pub text: serde_json::Value,
    /// The request's `tool_choice` (`auto` when it set none): `none`, `auto`, `required`,
    /// or `{type: "function", name}`.
    #[schema(schema_with = tool_choice)]
    pub tool_choice: serde_json::Value,
    /// The function tools the request offered, as it sent them.
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    #[schema(required = true)]
    pub top_p: Option<f64>,
    /// Always `disabled`.
    pub truncation: String,
    /// Once the response is over; null before, or when the gateway gave none.
    #[schema(required = true)]
    pub usage: Option<ResponseUsage>,
    /// Always empty.
    pub metadata: HashMap<String, String>,
    /// A stored response's conversation; null for `store: false`.
    #[schema(required = true)]
    pub conversation: Option<ResponseConversation>,
}

#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ResponseType {
    Response,
}

#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ResponseStatus {
    InProgress,
    Completed,
    Incomplete,
    Cancelled,
    Failed,
}

#[derive(ToSchema)]
pub struct ResponseError {
    pub code: String,
    pub message: String,
}

#[derive(ToSchema)]
pub struct IncompleteDetails {
    pub reason: String,
}

#[derive(ToSchema)]
pub struct ResponseConversation {
    pub id: String,
}

/// Tokens of a response.
#[derive(ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u64,
    /// `cached_tokens` (read from the provider's prompt cache) and `cache_write_tokens`.
    pub input_tokens_details: HashMap<String, u64>,
    pub output_tokens: u64,
    /// `reasoning_tokens`.
    pub output_tokens_details: HashMap<String, u64>,
    pub total_tokens: u64,
}

/// A chat completion answered whole: a stored turn's answer, or without a session header
/// the gateway's own answer, passed through as it came (OpenAI's `ChatCompletion`).
#[derive(ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    /// `prompt_tokens`, `completion_tokens`, `total_tokens` and
    /// `prompt_tokens_details.cached_tokens`; null when the turn reported none.
    #[schema(value_type = Option<Object>)]
    pub usage: Option<serde_json::Value>,
}

#[derive(ToSchema)]
pub struct ChatChoice {
    pub index: i64,
    pub message: ChatAnswer,
    /// `stop` or `length`.
    #[schema(required = true)]
    pub finish_reason: Option<String>,
}

#[derive(ToSchema)]
pub struct ChatAnswer {
    /// `assistant`.
    pub role: String,
    #[schema(required = true)]
    pub content: Option<String>,
    /// The model's reasoning, when it sent any.
    #[schema(nullable = false)]
    pub reasoning_content: Option<String>,
}

/// The models a client may ask for.
#[derive(ToSchema)]
pub struct ModelList {
    #[schema(inline)]
    pub object: ListObject,
    pub data: Vec<Model>,
}

#[derive(ToSchema)]
pub struct Model {
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds (0 when the gateway does not say).
    pub created: i64,
    pub owned_by: String,
}
