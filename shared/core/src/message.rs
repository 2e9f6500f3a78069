//! A chat message as the model is sent it. The projections produce these; the upstream
//! client turns them into the provider's wire format (resolving image references to bytes
//! only then, so the log and the projections never carry image data).

use serde::{Deserialize, Serialize};

pub use crate::events::ToolCall;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's result, answering the assistant message's call `tool_call_id` (DESIGN §14).
    Tool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    /// An image stored elsewhere, by id; never its bytes.
    ImageRef {
        id: String,
        mime: String,
        /// The pixels sent, when known: what the image costs (by the tile rule in `tokens`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        width: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        height: Option<u32>,
    },
}

/// Content is a plain string unless the message carries images or several blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl Content {
    /// An empty string or no parts.
    pub fn is_empty(&self) -> bool {
        match self {
            Content::Text(t) => t.is_empty(),
            Content::Parts(p) => p.is_empty(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: Content,
    /// An assistant message's tool calls (a step that asks for tools).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Self::new(role, Content::Text(text.into()))
    }

    pub fn new(role: Role, content: Content) -> Self {
        Self { role, content, tool_calls: Vec::new(), tool_call_id: None }
    }

    /// Every text the message carries, in order (what the tokenizer counts): its content's
    /// texts, then each tool call's name and arguments.
    pub fn texts(&self) -> impl Iterator<Item = &str> {
        let content: Vec<&str> = match &self.content {
            Content::Text(s) => vec![s.as_str()],
            Content::Parts(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    ContentPart::Text { text } => Some(text.as_str()),
                    ContentPart::ImageRef { .. } => None,
                })
                .collect(),
        };
        let calls = self.tool_calls.iter().flat_map(|c| [c.name.as_str(), c.arguments.as_str()]);
        content.into_iter().chain(calls).collect::<Vec<_>>().into_iter()
    }

    /// The message's exact bytes, as compared by the prefix-stability rule.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}
