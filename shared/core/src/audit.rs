//! Audited requests (DESIGN.md §11): what every attempt of a stored turn records of the
//! request it sent, and the pure functions that build that request from the log — the
//! ingress calls them to send, `GET /requests/{seq}` to rebuild the same bytes later.
//! Everything works on a branch log as the projections take it (the whole log or its live
//! tail), so a fork needs nothing of its own here.

use crate::events::{Event, Extras};
use crate::llm_context::{current_turn_start, llm_context_with, newest_compaction, Source, ToolHistory};
use crate::request::assemble_at;
use crate::request_body::{request_body, sha256_hex, RequestBody, RequestParams, ResolveImage};

// The record lives with the events that carry it; its old path stays.
pub use crate::events::{RecordedRequest, SystemPrompt};

/// Longest system prompt, in bytes: it may ride along with an outcome event, which must
/// stay under the writer's 768 KiB limit with the answer it carries.
pub const MAX_SYSTEM_PROMPT_BYTES: usize = 32 * 1024;

/// Why a body cannot be rebuilt from the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RebuildError {
    #[error("no recorded request at or before seq {through_seq} carries the system prompt {sha256}")]
    SystemPromptNotFound { sha256: String, through_seq: i64 },
    #[error("no recorded request at or before seq {through_seq} carries the tools {sha256}")]
    ToolsNotFound { sha256: String, through_seq: i64 },
}

/// The part of `events` the model's context depends on: the newest compaction and every
/// event after its boundary. Lookups of recorded prompts read only this, so they find the
/// same whether given the whole log or a live tail.
fn live_part(events: &[Event]) -> &[Event] {
    let boundary = newest_compaction(events).map_or(0, |(_, c)| c.replaces_through_seq);
    &events[events.partition_point(|e| e.seq <= boundary)..]
}

/// The text of the system prompt whose hash is `sha256`: from the newest recorded request
/// in the live part of `events` that has that hash and carries its text.
pub fn system_prompt_text<'a>(events: &'a [Event], sha256: &str) -> Option<&'a str> {
    live_part(events).iter().rev().find_map(|e| {
        let system = &e.body.recorded_request()?.system;
        (system.sha256 == sha256).then_some(system.text.as_deref()).flatten()
    })
}

/// How a request sent after `events` records `system_prompt`: its text is left out only
/// when the previous recorded request had the same prompt and the log still gives its
/// text back ([`system_prompt_text`]), so the first request of a branch, a changed prompt
/// and the first request after a compaction swallowed the text all carry it.
pub fn system_prompt_record(events: &[Event], system_prompt: &str) -> SystemPrompt {
    let sha256 = sha256_hex(system_prompt.as_bytes());
    let previous = live_part(events).iter().rev().find_map(|e| e.body.recorded_request());
    let known =
        previous.is_some_and(|r| r.system.sha256 == sha256) && system_prompt_text(events, &sha256).is_some();
    SystemPrompt { text: (!known).then(|| system_prompt.to_owned()), sha256 }
}

/// The tools' JSON text whose hash is `sha256`: from the newest recorded request in the
/// live part of `events` that has that hash and carries its text.
pub fn tools_text<'a>(events: &'a [Event], sha256: &str) -> Option<&'a str> {
    live_part(events).iter().rev().find_map(|e| {
        let r = e.body.recorded_request()?;
        (r.tools_sha256.as_deref() == Some(sha256)).then_some(r.params.tools.as_deref()).flatten()
    })
}

/// How a request sent after `events` records the tools it offered (`tools`, JSON text):
/// their hash, and their text (`params.tools`) only when the previous recorded request did
/// not offer the same tools or the log no longer gives their text back — a tool turn's
/// steps offer the same definitions, up to 64 KiB, each time (DESIGN §14).
pub fn tools_record(events: &[Event], tools: Option<&str>) -> (Option<String>, Option<String>) {
    let Some(tools) = tools else { return (None, None) };
    let sha256 = sha256_hex(tools.as_bytes());
    let previous = live_part(events).iter().rev().find_map(|e| e.body.recorded_request());
    let known = previous.is_some_and(|r| r.tools_sha256.as_deref() == Some(sha256.as_str()))
        && tools_text(events, &sha256).is_some();
    ((!known).then(|| tools.to_owned()), Some(sha256))
}

/// `recorded` with what it left out for the log to give back — the system prompt's text and
/// the tools' — taken from `events` up to its `through_seq`: the request as it was sent,
/// what a turn's next step continues from and an audit rebuilds.
pub fn resolved(events: &[Event], recorded: &RecordedRequest) -> Result<RecordedRequest, RebuildError> {
    let through = &events[..events.partition_point(|e| e.seq <= recorded.through_seq)];
    let mut r = recorded.clone();
    if r.system.text.is_none() {
        let text = system_prompt_text(through, &r.system.sha256).ok_or_else(|| {
            RebuildError::SystemPromptNotFound { sha256: r.system.sha256.clone(), through_seq: r.through_seq }
        })?;
        r.system.text = Some(text.to_owned());
    }
    if let (None, Some(sha256)) = (&r.params.tools, &r.tools_sha256) {
        let text = tools_text(through, sha256).ok_or_else(|| RebuildError::ToolsNotFound {
            sha256: sha256.clone(),
            through_seq: r.through_seq,
        })?;
        r.params.tools = Some(text.to_owned());
    }
    Ok(r)
}

/// The body of a turn's request: the system prompt, the history projected from `events`,
/// the extras last. The one function that builds what the ingress sends and what an
/// audit rebuilds.
pub fn turn_body(
    events: &[Event],
    system_prompt: &str,
    model: &str,
    params: &RequestParams,
    extras: &Extras,
    images: Option<ResolveImage<'_>>,
) -> RequestBody {
    turn_body_with(events, ToolHistory::Turn, system_prompt, model, params, extras, images)
}

/// [`turn_body`] of the history under tool history policy `history` (DESIGN §14).
pub fn turn_body_with(
    events: &[Event],
    history: ToolHistory,
    system_prompt: &str,
    model: &str,
    params: &RequestParams,
    extras: &Extras,
    images: Option<ResolveImage<'_>>,
) -> RequestBody {
    let projected = llm_context_with(events, history);
    // The current turn's first tool traffic: under `keep` earlier turns' stays before it.
    let start = current_turn_start(events);
    let tools_at = projected
        .iter()
        .position(|m| m.seq > start && (m.source == Source::Tool || !m.message.tool_calls.is_empty()));
    let messages =
        assemble_at(system_prompt, projected.into_iter().map(|p| p.message).collect(), extras, tools_at);
    request_body(model, &messages, params, images)
}

/// The body `recorded` was built from, rebuilt from the log with `system_prompt`. `events`
/// may run past `through_seq` (the whole log); only those up to it are read.
pub fn rebuild(
    events: &[Event],
    system_prompt: &str,
    recorded: &RecordedRequest,
    images: Option<ResolveImage<'_>>,
) -> RequestBody {
    let events = &events[..events.partition_point(|e| e.seq <= recorded.through_seq)];
    let r = recorded;
    turn_body_with(events, r.tool_history, system_prompt, &r.model, &r.params, &r.extras, images)
}

/// [`rebuild`], with what `recorded` left out (the system prompt's text, the tools') taken
/// from the log up to `through_seq` ([`resolved`]).
pub fn rebuild_from_log(
    events: &[Event],
    recorded: &RecordedRequest,
    images: Option<ResolveImage<'_>>,
) -> Result<RequestBody, RebuildError> {
    let r = resolved(events, recorded)?;
    Ok(rebuild(events, r.system.text.as_deref().unwrap_or_default(), &r, images))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{EventBody, PendingState, TurnFailed};
    use crate::log_builder::LogBuilder;

    fn record(log: &LogBuilder, system: &str, extras: Extras) -> RecordedRequest {
        let params = RequestParams { stream: true, max_tokens: Some(10), ..Default::default() };
        let body = turn_body(&log.events, system, "m", &params, &extras, None);
        RecordedRequest {
            through_seq: log.events.last().map_or(0, |e| e.seq),
            model: "m".into(),
            params,
            system: system_prompt_record(&log.events, system),
            tools_sha256: None,
            tool_history: ToolHistory::Turn,
            extras,
            tokens: 0,
            body_sha256: body.sha256,
        }
    }

    fn failed(request: RecordedRequest) -> EventBody {
        EventBody::TurnFailed(TurnFailed {
            code: "x".into(),
            message: "y".into(),
            request: Some(request),
            ..Default::default()
        })
    }

    #[test]
    fn the_prompt_text_is_recorded_when_the_log_cannot_give_it_back() {
        let mut log = LogBuilder::new();
        log.user("q1");
        let first = record(&log, "be kind", Extras::default());
        assert_eq!(first.system.text.as_deref(), Some("be kind"), "the first request carries it");
        log.push(failed(first.clone()));

        let again = record(&log, "be kind", Extras::default());
        assert_eq!(again.system, SystemPrompt { sha256: first.system.sha256.clone(), text: None });
        let changed = record(&log, "be brief", Extras::default());
        assert_eq!(changed.system.text.as_deref(), Some("be brief"));

        // A compaction that swallows the only record with the text brings it back, though
        // the newest record (without it) had the same prompt.
        let with_text = log.events.last().unwrap().seq;
        log.push(failed(again));
        log.compaction("summary", with_text);
        assert_eq!(record(&log, "be kind", Extras::default()).system.text.as_deref(), Some("be kind"));
    }

    #[test]
    fn a_rebuild_from_the_log_gives_the_recorded_hash() {
        let mut log = LogBuilder::new();
        log.user("q1");
        let extras =
            Extras { date: Some("2026-01-01 (Thursday)".into()), memories: vec!["likes tea".into()] };
        let first = record(&log, "be kind", extras.clone());
        let pending =
            PendingState { partial: "half".into(), request: Some(first.clone()), ..Default::default() };
        log.push(EventBody::PendingState(pending));
        let retry = record(&log, "be kind", Extras::default());
        assert!(retry.system.text.is_none());
        log.push(failed(retry.clone()));
        log.user("q2");

        for r in [&first, &retry] {
            assert_eq!(rebuild_from_log(&log.events, r, None).unwrap().sha256, r.body_sha256);
        }
        // Rebuilt with another prompt, or without the record that held the text, it is not.
        assert_ne!(rebuild(&log.events, "be mean", &retry, None).sha256, retry.body_sha256);
        let without_first: Vec<_> = log.events.iter().filter(|e| e.seq != 3).cloned().collect();
        assert!(matches!(
            rebuild_from_log(&without_first, &retry, None),
            Err(RebuildError::SystemPromptNotFound { .. })
        ));
    }

    #[test]
    fn a_steps_tools_ride_by_hash_once_the_log_holds_their_text() {
        let tools = r#"[{"type":"function","function":{"name":"ls"}}]"#;
        let mut log = LogBuilder::new();
        log.user("list");
        let step = |log: &LogBuilder, tools: &str| {
            let params = RequestParams { stream: true, tools: Some(tools.into()), ..Default::default() };
            let body = turn_body(&log.events, "S", "m", &params, &Extras::default(), None);
            let (kept, tools_sha256) = tools_record(&log.events, Some(tools));
            let recorded = RecordedRequest {
                through_seq: log.events.last().map_or(0, |e| e.seq),
                model: "m".into(),
                params: RequestParams { tools: kept, ..params },
                system: system_prompt_record(&log.events, "S"),
                tools_sha256,
                tool_history: ToolHistory::Turn,
                extras: Extras::default(),
                tokens: 0,
                body_sha256: body.sha256.clone(),
            };
            (recorded, body)
        };
        // The first step carries the text; the next, offering the same tools, only the hash.
        let (first, _) = step(&log, tools);
        assert_eq!(first.params.tools.as_deref(), Some(tools));
        log.push(failed(first.clone()));
        let (second, body) = step(&log, tools);
        assert_eq!((second.params.tools.as_deref(), &second.tools_sha256), (None, &first.tools_sha256));
        assert_eq!(second.system.text, None);
        // What the log gives back makes the request as it was sent, byte for byte.
        let sent = resolved(&log.events, &second).unwrap();
        assert_eq!((sent.params.tools.as_deref(), sent.system.text.as_deref()), (Some(tools), Some("S")));
        assert_eq!(rebuild_from_log(&log.events, &second, None).unwrap().sha256, body.sha256);
        // Changed tools carry their text again; a log without the text cannot resolve a hash.
        log.push(failed(second.clone()));
        let (third, _) = step(&log, r#"[{"type":"function","function":{"name":"cat"}}]"#);
        assert!(third.params.tools.is_some());
        let bare = LogBuilder::new();
        assert!(matches!(resolved(&bare.events, &second), Err(RebuildError::SystemPromptNotFound { .. })));
        let mut only_prompt = second.clone();
        only_prompt.system.text = Some("S".into());
        assert!(matches!(resolved(&bare.events, &only_prompt), Err(RebuildError::ToolsNotFound { .. })));
    }
}
