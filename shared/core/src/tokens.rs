//! Token counting with OpenAI's o200k_base encoding, by GitHub's `bpe-openai`: the same
//! ids as OpenAI's tiktoken, about twice as fast as `tiktoken-rs` (`turnlog-bench
//! tokenizer` checks the two against each other and times them). The encoder is loaded
//! once per process; counts of the log's events are computed once (by the writer, stored
//! beside each event) so sizing a request sums the live tail instead of re-encoding history.

use crate::events::EventBody;
use crate::llm_context::project_event;
use crate::message::{ChatMessage, Content, ContentPart};

/// Tokens every message costs beyond its text (role and framing), as OpenAI counts them.
pub const MESSAGE_OVERHEAD: u32 = 4;
/// Tokens a request costs beyond its messages (the primed assistant reply).
pub const REQUEST_OVERHEAD: u32 = 3;

fn bpe() -> &'static bpe_openai::Tokenizer {
    bpe_openai::o200k_base()
}

/// Loads the encoder now (it takes a moment) instead of on the first request.
pub fn warm_up() {
    let _ = bpe();
}

/// o200k_base token ids of `text`, special-token text counted as ordinary text.
pub fn encode(text: &str) -> Vec<u32> {
    bpe().encode(text)
}

pub fn count(text: &str) -> u32 {
    if text.is_empty() {
        return 0;
    }
    u32::try_from(bpe().count(text)).unwrap_or(u32::MAX)
}

/// A message's cost in a request: its texts, its images and the per-message overhead.
pub fn message_tokens(m: &ChatMessage) -> u32 {
    m.texts().map(count).fold(MESSAGE_OVERHEAD, u32::saturating_add).saturating_add(m.image_tokens())
}

/// What an image costs, by OpenAI's rule for `detail: high` (the default for an image
/// larger than 512 px; <https://platform.openai.com/docs/guides/images-vision#calculating-costs>,
/// "GPT-4o, GPT-4.1, GPT-4o-mini, CUA, and o-series"): scaled to fit within 2048 × 2048,
/// then so that its shortest side is at most 768; then 170 tokens for each 512 px tile
/// it covers, plus 85. An image of unknown size counts 0: only references written before
/// sizes were recorded lack one, and their stored counts (which a rebuild reproduces) were
/// made without images.
pub fn image_tokens(width: Option<u32>, height: Option<u32>) -> u32 {
    let (w, h) = match (width, height) {
        (Some(w), Some(h)) if w > 0 && h > 0 => (f64::from(w), f64::from(h)),
        _ => return 0,
    };
    let fit = (2048.0 / w.max(h)).min(1.0);
    let (w, h) = (w * fit, h * fit);
    let short = (768.0 / w.min(h)).min(1.0);
    let (w, h) = ((w * short).round(), (h * short).round());
    let tiles = (w / 512.0).ceil() * (h / 512.0).ceil();
    85 + 170 * tiles as u32
}

// Here rather than in `message`, so the message types stay a leaf of the module graph.
impl ChatMessage {
    /// What the message's images cost, by the tile rule.
    pub fn image_tokens(&self) -> u32 {
        let Content::Parts(parts) = &self.content else { return 0 };
        parts
            .iter()
            .map(|p| match p {
                ContentPart::ImageRef { width, height, .. } => image_tokens(*width, *height),
                ContentPart::Text { .. } => 0,
            })
            .fold(0, u32::saturating_add)
    }
}

/// The longest edge of an image as the model is sent it: larger ones are scaled down once,
/// at upload (a provider scales anything larger down itself, so more pixels only cost
/// bytes on every request).
pub const MAX_IMAGE_EDGE: u32 = 1536;

/// The whole request: every message plus the request overhead.
pub fn request_tokens<'a>(messages: impl IntoIterator<Item = &'a ChatMessage>) -> u32 {
    messages.into_iter().map(message_tokens).fold(REQUEST_OVERHEAD, u32::saturating_add)
}

/// The per-event count stored beside each event: what the event costs when it projects
/// (a pending as if live), 0 for kinds that never project.
pub fn event_tokens(body: &EventBody) -> u32 {
    project_event(body).map_or(0, |m| message_tokens(&m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    #[test]
    fn images_cost_by_the_tile_rule() {
        // OpenAI's own examples: 1024 × 1024 → 768 × 768, 4 tiles; 2048 × 4096 → 1024 × 2048
        // → 768 × 1536, 6 tiles; a small image is one tile.
        assert_eq!(image_tokens(Some(1024), Some(1024)), 765);
        assert_eq!(image_tokens(Some(2048), Some(4096)), 1105);
        assert_eq!(image_tokens(Some(100), Some(60)), 255);
        assert_eq!(image_tokens(None, None), 0, "an old reference without a size");
        let m = ChatMessage::new(
            Role::User,
            crate::message::Content::Parts(vec![
                crate::message::ContentPart::Text { text: "see".into() },
                crate::message::ContentPart::ImageRef {
                    id: "a".into(),
                    mime: "image/png".into(),
                    width: Some(100),
                    height: Some(60),
                },
            ]),
        );
        assert_eq!(message_tokens(&m), MESSAGE_OVERHEAD + count("see") + 255);
    }

    #[test]
    fn message_cost_includes_overhead() {
        let m = ChatMessage::text(Role::User, "hello world");
        assert_eq!(message_tokens(&m), MESSAGE_OVERHEAD + 2);
        assert_eq!(request_tokens([&m, &m]), REQUEST_OVERHEAD + 2 * (MESSAGE_OVERHEAD + 2));
    }
}
