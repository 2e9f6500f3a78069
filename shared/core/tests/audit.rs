//! Audited requests (DESIGN.md §11): whatever a log holds — every kind, compactions,
//! checkpoints, retries as new attempts, extras, the system prompt changing between a turn
//! and its retry — every attempt's request rebuilt from the log later hashes to exactly
//! what was recorded when it was sent.

use proptest::prelude::*;
use serde_json::json;
use turnlog_core::audit::{rebuild_from_log, system_prompt_record, turn_body, RecordedRequest};
use turnlog_core::events::*;
use turnlog_core::ids::AttemptId;
use turnlog_core::llm_context::{llm_context, newest_compaction};
use turnlog_core::log_builder::{assistant_turn, permission_request, LogBuilder};
use turnlog_core::request::Extras;
use turnlog_core::request_body::{RequestParams, ResponseFormat, StreamOptions};

/// The system prompts a deployment switches between (an empty one included).
fn prompts() -> Vec<String> {
    vec![
        String::new(),
        "You are careful.".into(),
        "You are terse.\nKeep \"numbers\" exact.".into(),
        "ünïcode ✓ and a long tail ".repeat(80),
    ]
}

fn resolve(id: &str, mime: &str) -> Option<String> {
    (!id.starts_with("gone")).then(|| format!("data:{mime};base64,{id}"))
}

#[derive(Debug, Clone)]
enum Ending {
    Answer,
    /// Cut off with a partial (interrupted or stopped), after `checkpoints` checkpoints.
    Partial(Option<PendingReason>),
    /// The gateway refused it or nothing arrived: a failure that was sent.
    Failed,
    /// Failed before anything was sent (context overflow, an unreadable log): no request.
    FailedUnsent,
}

#[derive(Debug, Clone)]
struct Attempt {
    prompt: usize,
    extras: Extras,
    params: RequestParams,
    checkpoints: usize,
    ending: Ending,
    /// The sender read the whole log rather than the live tail (a compaction committed
    /// between the two reads of the live tail gives the sender more than it needs).
    whole_log: bool,
}

#[derive(Debug, Clone)]
enum Op {
    /// A new question (with images or a document now and then), then an attempt.
    Turn(String, u8, Attempt),
    /// Another attempt of the last question.
    Retry(Attempt),
    Memory(bool),
    Tool,
    Permission(bool),
    Extracted,
    /// An event of an older version: a checkpoint or an answer without a request.
    Unrecorded(bool),
    /// A compaction through the live message at this fraction of the live list.
    Compaction(u8),
    /// An event of any kind with its default payload, so every kind (a new one too) is in
    /// the property.
    Kind(EventKind),
}

fn extras() -> impl Strategy<Value = Extras> {
    (
        proptest::option::of("20[0-9]{2}-0[1-9]-1[0-9] \\((Monday|Friday)\\)"),
        proptest::collection::vec("[a-zA-Z0-9 .\"\\\\]{1,30}", 0..3),
    )
        .prop_map(|(date, memories)| Extras { date, memories })
}

fn params() -> impl Strategy<Value = RequestParams> {
    (
        any::<bool>(),
        proptest::option::of(1u32..64_000),
        proptest::option::of(prop_oneof![Just("low".to_owned()), Just("high".to_owned())]),
        proptest::option::of(0u8..=20),
        proptest::option::of(0u8..=10),
        any::<bool>(),
        any::<bool>(),
        (
            proptest::option::of(-20i8..=20),
            proptest::option::of(any::<i64>()),
            proptest::option::of(0usize..=4),
        ),
    )
        .prop_map(
            |(
                stream,
                max_tokens,
                reasoning_effort,
                temperature,
                top_p,
                json,
                images,
                (penalty, seed, stops),
            )| {
                RequestParams {
                    stream,
                    stream_options: stream.then_some(StreamOptions { include_usage: true }),
                    max_tokens,
                    reasoning_effort,
                    temperature: temperature.map(|t| f64::from(t) / 10.0),
                    top_p: top_p.map(|p| f64::from(p) / 10.0),
                    presence_penalty: penalty.map(|p| f64::from(p) / 10.0),
                    frequency_penalty: penalty.map(|p| f64::from(-p) / 10.0),
                    seed,
                    stop: stops.map(|n| (0..n).map(|i| format!("stop {i}")).collect()),
                    response_format: json.then(ResponseFormat::json_object),
                    // Tools with every other request: their text rides in the record.
                    tools: stream.then(|| {
                        r#"[{"type":"function","function":{"name":"ls","parameters":{"type":"object"}}}]"#
                            .to_owned()
                    }),
                    tool_choice: stream.then(|| r#""auto""#.to_owned()),
                    parallel_tool_calls: stream.then_some(false),
                    images,
                }
            },
        )
}

fn attempt() -> impl Strategy<Value = Attempt> {
    let ending = prop_oneof![
        4 => Just(Ending::Answer),
        2 => prop_oneof![Just(None), Just(Some(PendingReason::Interrupted)), Just(Some(PendingReason::Stopped))]
            .prop_map(Ending::Partial),
        1 => Just(Ending::Failed),
        1 => Just(Ending::FailedUnsent),
    ];
    (0..prompts().len(), extras(), params(), 0usize..3, ending, any::<bool>()).prop_map(
        |(prompt, extras, params, checkpoints, ending, whole_log)| Attempt {
            prompt,
            extras,
            params,
            checkpoints,
            ending,
            whole_log,
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => ("[a-zA-Z0-9 .]{0,24}", any::<u8>(), attempt()).prop_map(|(q, a, t)| Op::Turn(q, a, t)),
        3 => attempt().prop_map(Op::Retry),
        1 => any::<bool>().prop_map(Op::Memory),
        1 => Just(Op::Tool),
        1 => any::<bool>().prop_map(Op::Permission),
        1 => Just(Op::Extracted),
        1 => any::<bool>().prop_map(Op::Unrecorded),
        2 => any::<u8>().prop_map(Op::Compaction),
        1 => proptest::sample::select(EventKind::ALL.to_vec()).prop_map(Op::Kind),
    ]
}

/// What `read::tail_through` reads: the newest compaction at or before `through` and every
/// event after its boundary up to `through`.
fn tail_through(events: &[Event], through: i64) -> Vec<Event> {
    let upto: Vec<Event> = events.iter().filter(|e| e.seq <= through).cloned().collect();
    let compaction = newest_compaction(&upto).map(|(seq, c)| (seq, c.replaces_through_seq));
    upto.into_iter()
        .filter(|e| compaction.is_none_or(|(seq, boundary)| e.seq > boundary || e.seq == seq))
        .collect()
}

/// One attempt as the ingress runs it: the request built from what it read of the log and
/// recorded on its first checkpoint and on its outcome. Returns the request it recorded.
fn run_attempt(log: &mut LogBuilder, a: &Attempt) -> Option<RecordedRequest> {
    let prompt = &prompts()[a.prompt];
    let last = log.next_seq() - 1;
    let read = if a.whole_log { log.events.clone() } else { tail_through(&log.events, last) };
    let request = match a.ending {
        Ending::FailedUnsent => None,
        _ => {
            let images = |id: &str, mime: &str| resolve(id, mime);
            let body = turn_body(&read, prompt, "m", &a.params, &a.extras, Some(&images));
            Some(RecordedRequest {
                through_seq: last,
                model: "m".into(),
                params: a.params.clone(),
                system: system_prompt_record(&read, prompt),
                tools_sha256: None,
                tool_history: Default::default(),
                extras: a.extras.clone(),
                tokens: 7,
                body_sha256: body.sha256,
            })
        }
    };
    let attempt_id = Some(AttemptId::from(format!("att{}", log.next_seq())));
    let pending = |partial: String, reason, request| {
        EventBody::PendingState(PendingState { partial, attempt_id: attempt_id.clone(), reason, request })
    };
    // Only an attempt that sent something streams, so only it checkpoints.
    let checkpoints = if request.is_some() { a.checkpoints } else { 0 };
    for i in 0..checkpoints {
        let first = (i == 0).then(|| request.clone()).flatten();
        log.push(pending("x".repeat(i + 1), None, first));
    }
    let outcome = match a.ending {
        Ending::Answer => {
            let mut t = assistant_turn("the answer", attempt_id.as_deref());
            t.request = request.clone();
            EventBody::AssistantTurn(t)
        }
        Ending::Partial(reason) => {
            pending("part".into(), reason.or(Some(PendingReason::Interrupted)), request.clone())
        }
        Ending::Failed | Ending::FailedUnsent => EventBody::TurnFailed(TurnFailed {
            code: "upstream_error".into(),
            message: "the model gateway answered 502".into(),
            attempt_id: attempt_id.clone(),
            request: request.clone(),
        }),
    };
    log.push(outcome);
    request
}

fn apply(log: &mut LogBuilder, op: &Op) -> Option<RecordedRequest> {
    let body = match op {
        Op::Turn(question, attach, attempt) => {
            let mut m = UserMessage { text: question.clone(), ..Default::default() };
            if attach % 4 == 1 {
                let id = if attach % 8 == 1 { "gone1" } else { "img1" };
                m.images.push(ImageRef {
                    id: id.into(),
                    mime: "image/png".into(),
                    width: None,
                    height: None,
                });
            }
            if attach % 4 == 2 {
                m.documents.push(Document {
                    id: "d1".into(),
                    mime: "text/plain".into(),
                    name: None,
                    bytes: None,
                    markdown: "# notes".into(),
                });
            }
            log.push(EventBody::UserMessage(m));
            return run_attempt(log, attempt);
        }
        Op::Retry(attempt) => return run_attempt(log, attempt),
        Op::Memory(empty) => EventBody::TurnMemory(TurnMemory {
            turn_seq: log.next_seq() - 1,
            key_findings: if *empty { vec![] } else { vec!["found it".into()] },
            ..Default::default()
        }),
        Op::Tool => EventBody::ToolExecution(ToolExecution {
            call_id: "c".into(),
            name: "t".into(),
            args: Some(json!({"path": "/tmp"})),
            status: "ok".into(),
            ..Default::default()
        }),
        Op::Permission(resolved) => {
            let id = format!("p{}", log.next_seq());
            log.push(permission_request(&id, "low"));
            if !resolved {
                return None;
            }
            EventBody::PermissionResolved(PermissionResolved { id, decision: "allow".into() })
        }
        Op::Extracted => EventBody::MemoryExtracted(MemoryExtracted {
            turn_seq: log.next_seq() - 1,
            memories: vec![],
            error: None,
        }),
        Op::Unrecorded(answer) => match answer {
            true => EventBody::AssistantTurn(assistant_turn("an old answer", None)),
            false => EventBody::PendingState(PendingState { partial: "old".into(), ..Default::default() }),
        },
        Op::Compaction(f) => {
            let live = llm_context(&log.events);
            if live.is_empty() {
                return None;
            }
            let through = live[(*f as usize * live.len() / 256).min(live.len() - 1)].seq;
            EventBody::CompactionApplied(CompactionApplied {
                summary: format!("summary through {through}"),
                replaces_through_seq: through,
                facts_extracted: vec![],
            })
        }
        Op::Kind(kind) => EventBody::default_of(*kind),
    };
    log.push(body);
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every request an attempt recorded rebuilds, from the final log or from what
    /// `tail_through` reads, to the very bytes that were hashed when it was sent.
    #[test]
    fn every_attempt_rebuilds_to_its_recorded_hash(ops in proptest::collection::vec(op(), 1..60)) {
        let mut log = LogBuilder::new();
        let mut sent = Vec::new();
        for op in &ops {
            sent.extend(apply(&mut log, op));
        }
        let images = |id: &str, mime: &str| resolve(id, mime);
        // The log holds each sent request once or twice (first checkpoint, outcome), and
        // nothing else.
        let in_log: Vec<&RecordedRequest> = log.events.iter().filter_map(|e| e.body.recorded_request()).collect();
        prop_assert!(sent.iter().all(|r| in_log.contains(&r)));
        prop_assert!(in_log.iter().all(|r| sent.contains(*r)));
        for r in in_log {
            let whole = rebuild_from_log(&log.events, r, Some(&images));
            prop_assert_eq!(whole.map(|b| b.sha256), Ok(r.body_sha256.clone()), "whole log, {:?}", r);
            let tail = tail_through(&log.events, r.through_seq);
            let rebuilt = rebuild_from_log(&tail, r, Some(&images));
            prop_assert_eq!(rebuilt.map(|b| b.sha256), Ok(r.body_sha256.clone()), "tail, {:?}", r);
        }
        // The first request of the log always carries its prompt.
        if let Some(first) = sent.first() {
            prop_assert!(first.system.text.is_some());
        }
    }
}

#[test]
fn a_changed_prompt_is_recorded_and_the_old_one_still_rebuilds() {
    let mut log = LogBuilder::new();
    log.user("q");
    let attempt = |prompt| Attempt {
        prompt,
        extras: Extras::default(),
        params: RequestParams::default(),
        checkpoints: 1,
        ending: Ending::Partial(None),
        whole_log: false,
    };
    let first = run_attempt(&mut log, &attempt(1)).unwrap();
    let same = run_attempt(&mut log, &attempt(1)).unwrap();
    let changed = run_attempt(&mut log, &attempt(2)).unwrap();
    let back = run_attempt(&mut log, &attempt(1)).unwrap();
    assert_eq!(first.system.text.as_deref(), Some(prompts()[1].as_str()));
    assert_eq!(same.system.text, None);
    assert_eq!(changed.system.text.as_deref(), Some(prompts()[2].as_str()));
    assert_eq!(back.system.text.as_deref(), Some(prompts()[1].as_str()), "it differs from the previous one");
    for r in [&first, &same, &changed, &back] {
        assert_eq!(rebuild_from_log(&log.events, r, None).unwrap().sha256, r.body_sha256);
    }
}
