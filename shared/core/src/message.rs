//! A chat message as the model is sent it. The projections produce these; the upstream
//! client turns them into the provider's wire format (resolving image references to bytes
//! only then, so the log and the projections never carry image data).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: Content,
}

impl ChatMessage {
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Self { role, content: Content::Text(text.into()) }
    }

    /// Every text the message carries, in order (what the tokenizer counts).
    pub fn texts(&self) -> impl Iterator<Item = &str> {
        let parts: &[ContentPart] = match &self.content {
            Content::Text(s) => return vec![s.as_str()].into_iter(),
            Content::Parts(p) => p,
        };
        parts
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text { text } => Some(text.as_str()),
                ContentPart::ImageRef { .. } => None,
            })
            .collect::<Vec<_>>()
            .into_iter()
    }

    /// The message's exact bytes, as compared by the prefix-stability rule.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}
