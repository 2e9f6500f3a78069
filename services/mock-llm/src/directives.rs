//! The knobs that shape one mock answer: server defaults from [`crate::MockConfig`],
//! overridden per request by `[mock key=value flag ...]` directives in the last user
//! message.

/// How the mock answers a request. Every field is also a directive key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Knobs {
    /// `words=N`: words in a chat reply.
    pub words: usize,
    /// `breaks=N`: line breaks between the words of a chat reply instead of a space (an
    /// escape-heavy answer: each takes two bytes as JSON). At most `MAX_BREAKS`.
    pub breaks: usize,
    /// `delay_ms=N`: pause before every delta.
    pub delay_ms: u64,
    /// `reasoning=N`: `reasoning_content` deltas before the text.
    pub reasoning: usize,
    /// `fail_after=N`: drop the connection after N deltas.
    pub fail_after: Option<usize>,
    /// `stall_after=N`: after N deltas send nothing more, keeping the connection open.
    pub stall_after: Option<usize>,
    /// `no_done`: end the stream without `data: [DONE]`.
    pub no_done: bool,
    /// `status=N`: answer HTTP N (400–599) with an OpenAI-style error body.
    pub status: Option<u16>,
    /// `hang`: accept the request and never answer it.
    pub hang: bool,
    /// `stamp`: every text delta is the moment it was sent, in microseconds since the
    /// Unix epoch (for relay-latency benchmarks).
    pub stamp: bool,
    /// `tool=NAME:ARGS` (repeatable; ARGS is JSON without spaces or `]`): the model asks
    /// for these tools, in one step, instead of answering (DESIGN §14), until the request
    /// carries `steps` steps' worth of results after its user message; then it answers.
    pub tools: Vec<(String, String)>,
    /// `steps=N`: how many steps ask for the tools (default 1).
    pub steps: usize,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            words: 24,
            breaks: 0,
            delay_ms: 0,
            reasoning: 0,
            fail_after: None,
            stall_after: None,
            no_done: false,
            status: None,
            hang: false,
            stamp: false,
            tools: Vec::new(),
            steps: 1,
        }
    }
}

const OPEN: &str = "[mock";
/// Most line breaks between two words.
pub(crate) const MAX_BREAKS: usize = 64;
/// The most `words=N` may ask for (~65,000 tokens, twice what a turnlog turn lets an
/// answer have): the reply is built in memory before it is streamed.
pub(crate) const MAX_WORDS: usize = 50_000;
/// The most `reasoning=N` may ask for (each step is about eight tokens).
pub(crate) const MAX_REASONING: usize = 10_000;
/// The most `steps=N` may ask for.
pub(crate) const MAX_STEPS: usize = 1_000;

impl Knobs {
    /// These knobs with every directive in `text` applied; an unknown key or bad value is
    /// an error, so a typo in a test fails loudly instead of being ignored.
    pub fn with_directives(mut self, text: &str) -> Result<Self, String> {
        for directive in directives(text) {
            for setting in directive.split_whitespace() {
                self.apply(setting)?;
            }
        }
        Ok(self)
    }

    /// These knobs with no more words and reasoning steps than `max_tokens` lets through:
    /// each costs at least one token, so one past the budget is enough for the answer to
    /// end with `length`, and building more would only spend memory.
    pub fn within(mut self, max_tokens: Option<u32>) -> Self {
        if let Some(most) = max_tokens.map(|m| m as usize + 1) {
            self.words = self.words.min(most);
            self.reasoning = self.reasoning.min(most);
        }
        self
    }

    fn apply(&mut self, setting: &str) -> Result<(), String> {
        let (key, value) = match setting.split_once('=') {
            Some((key, value)) => (key, Some(value)),
            None => (setting, None),
        };
        let number = |value: Option<&str>| -> Result<u64, String> {
            value
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("mock directive `{setting}` needs a number"))
        };
        let at_most = |most: usize| -> Result<usize, String> {
            let n = number(value)?;
            usize::try_from(n)
                .ok()
                .filter(|n| *n <= most)
                .ok_or_else(|| format!("mock directive `{setting}`: at most {most}"))
        };
        match key {
            "words" => self.words = at_most(MAX_WORDS)?,
            "breaks" => self.breaks = at_most(MAX_BREAKS)?,
            "delay_ms" => self.delay_ms = number(value)?,
            "reasoning" => self.reasoning = at_most(MAX_REASONING)?,
            "fail_after" => self.fail_after = Some(number(value)? as usize),
            "stall_after" => self.stall_after = Some(number(value)? as usize),
            "status" => {
                let status = number(value)?;
                if !(400..=599).contains(&status) {
                    return Err(format!("mock directive `{setting}`: status must be 400–599"));
                }
                self.status = Some(status as u16);
            }
            "tool" => {
                let (name, args) = value.and_then(|v| v.split_once(':')).ok_or_else(|| {
                    format!("mock directive `{setting}` needs tool=NAME:ARGS (ARGS a JSON object)")
                })?;
                if name.is_empty()
                    || !serde_json::from_str::<serde_json::Value>(args).is_ok_and(|a| a.is_object())
                {
                    return Err(format!(
                        "mock directive `{setting}`: NAME must be set and ARGS a JSON object"
                    ));
                }
                self.tools.push((name.to_owned(), args.to_owned()));
            }
            "steps" => self.steps = at_most(MAX_STEPS)?,
            "no_done" if value.is_none() => self.no_done = true,
            "hang" if value.is_none() => self.hang = true,
            "stamp" if value.is_none() => self.stamp = true,
            _ => return Err(format!("unknown mock directive `{setting}`")),
        }
        Ok(())
    }
}

/// The insides of every `[mock ...]` in `text`.
fn directives(text: &str) -> impl Iterator<Item = &str> {
    text.match_indices(OPEN).filter_map(move |(start, _)| {
        let rest = &text[start + OPEN.len()..];
        let end = rest.find(']')?;
        let inside = &rest[..end];
        // `[mockery]` is not a directive.
        (inside.is_empty() || inside.starts_with(char::is_whitespace)).then_some(inside)
    })
}

/// `text` without its directives, so they never leak into replies, titles or summaries.
pub(crate) fn strip_directives(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        match after.find(']') {
            Some(end) if after[..end].is_empty() || after.starts_with(char::is_whitespace) => {
                out.push_str(&rest[..start]);
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str(&rest[..start + OPEN.len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_override_defaults() {
        let knobs = Knobs::default()
            .with_directives("hi [mock words=3 breaks=2 delay_ms=5 reasoning=2 fail_after=1 no_done]")
            .unwrap();
        assert_eq!(knobs.words, 3);
        assert_eq!(knobs.breaks, 2);
        assert_eq!(knobs.delay_ms, 5);
        assert_eq!(knobs.reasoning, 2);
        assert_eq!(knobs.fail_after, Some(1));
        assert!(knobs.no_done);
        assert!(!knobs.hang);
        let knobs = Knobs::default().with_directives("[mock status=503] [mock hang]").unwrap();
        assert_eq!(knobs.status, Some(503));
        assert!(knobs.hang);
    }

    #[test]
    fn bad_directives_are_refused() {
        for bad in
            ["[mock wrds=3]", "[mock words=many]", "[mock status=200]", "[mock hang=1]", "[mock breaks=65]"]
        {
            assert!(Knobs::default().with_directives(bad).is_err(), "{bad}");
        }
        for huge in ["[mock words=50001]", "[mock reasoning=10001]", "[mock words=18446744073709551615]"] {
            let err = Knobs::default().with_directives(huge).unwrap_err();
            assert!(err.contains("at most"), "{huge}: {err}");
        }
        let most = Knobs::default().with_directives("[mock words=50000 reasoning=10000]").unwrap();
        assert_eq!((most.words, most.reasoning), (MAX_WORDS, MAX_REASONING));
        assert_eq!(Knobs::default().with_directives("a [mockery] b").unwrap(), Knobs::default());
    }

    #[test]
    fn max_tokens_bounds_what_is_built() {
        let asked = Knobs { words: MAX_WORDS, reasoning: MAX_REASONING, ..Knobs::default() };
        let built = asked.clone().within(Some(5));
        assert_eq!((built.words, built.reasoning), (6, 6));
        assert_eq!(asked.clone().within(None), asked);
        let few = Knobs { words: 3, reasoning: 0, ..Knobs::default() };
        assert_eq!(few.clone().within(Some(100)), few);
    }

    #[test]
    fn stripping_removes_only_directives() {
        assert_eq!(strip_directives("Hi [mock words=2] there [mockery]"), "Hi  there [mockery]");
        assert_eq!(strip_directives("[mock] x [mock"), " x [mock");
    }
}
