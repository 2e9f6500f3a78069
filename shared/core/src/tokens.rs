//! Token counting with OpenAI's o200k_base encoding, by GitHub's `bpe-openai`: the same
//! ids as OpenAI's tiktoken, about twice as fast as `tiktoken-rs` (`turnlog-bench
//! tokenizer` checks the two against each other and times them). The encoder is loaded
//! once per process; counts of the log's events are computed once (by the writer, stored
//! beside each event) so sizing a request sums the live tail instead of re-encoding history.

use crate::events::EventBody;
use crate::llm_context::project_event;
use crate::message::ChatMessage;

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

/// A message's cost in a request: its texts plus the per-message overhead. Image
/// references are not counted (providers bill images separately).
pub fn message_tokens(m: &ChatMessage) -> u32 {
    m.texts().map(count).fold(MESSAGE_OVERHEAD, u32::saturating_add)
}

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
    fn message_cost_includes_overhead() {
        let m = ChatMessage::text(Role::User, "hello world");
        assert_eq!(message_tokens(&m), MESSAGE_OVERHEAD + 2);
        assert_eq!(request_tokens([&m, &m]), REQUEST_OVERHEAD + 2 * (MESSAGE_OVERHEAD + 2));
    }
}
