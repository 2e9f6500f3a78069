//! The rules of DESIGN.md §3, one named test each, and the prefix-stability property.

use proptest::prelude::*;
use serde_json::json;
use turnlog_core::events::*;
use turnlog_core::ids::AttemptId;
use turnlog_core::llm_context::{
    live_pending_seq, llm_context, llm_messages, Source, INTERRUPTED_NOTE, STOPPED_NOTE, SUMMARY_MARKER,
};
use turnlog_core::log_builder::{assistant_turn, LogBuilder};
use turnlog_core::message::{Content, ContentPart, Role};
use turnlog_core::ui_transcript::{ui_transcript, ItemKind};

fn text_of(m: &turnlog_core::ChatMessage) -> String {
    m.texts().collect::<Vec<_>>().join("|")
}

#[test]
fn user_and_assistant_project_in_order() {
    let mut log = LogBuilder::new();
    log.user("hi");
    log.assistant("hello");
    let msgs = llm_messages(&log.events);
    assert_eq!(msgs.len(), 2);
    assert_eq!((msgs[0].role, text_of(&msgs[0]).as_str()), (Role::User, "hi"));
    assert_eq!((msgs[1].role, text_of(&msgs[1]).as_str()), (Role::Assistant, "hello"));
}

#[test]
fn assistant_projects_llm_message_not_ui_blocks() {
    let mut log = LogBuilder::new();
    let mut t = assistant_turn("what the user saw", None);
    t.llm.message.content = Some(MessageContent::Text("what the model said".into()));
    t.ui.blocks.push(Block { kind: BlockType::Reasoning, text: Some("thinking".into()), meta: None });
    log.push(EventBody::AssistantTurn(t));
    let msgs = llm_messages(&log.events);
    assert_eq!(text_of(&msgs[0]), "what the model said");
}

#[test]
fn newest_compaction_replaces_everything_through_its_boundary() {
    let mut log = LogBuilder::new();
    log.user("q1");
    log.assistant("a1");
    let through = log.user("q2");
    log.assistant("a2");
    log.compaction("old summary", 3);
    log.compaction("Summary of q1 and q2.", through);
    let ctx = llm_context(&log.events);
    assert_eq!(ctx[0].source, Source::Summary);
    assert_eq!(ctx[0].message.role, Role::User);
    assert_eq!(text_of(&ctx[0].message), format!("{SUMMARY_MARKER}\nSummary of q1 and q2."));
    let rest: Vec<_> = ctx[1..].iter().map(|m| text_of(&m.message)).collect();
    assert_eq!(rest, ["a2"]);
}

#[test]
fn documents_are_text_for_the_model_and_images_stay_references() {
    let mut log = LogBuilder::new();
    log.push(EventBody::UserMessage(UserMessage {
        text: "see attached".into(),
        images: vec![ImageRef { id: "img1".into(), mime: "image/png".into(), width: None, height: None }],
        documents: vec![Document {
            id: "doc1".into(),
            mime: "application/pdf".into(),
            name: Some("report.pdf".into()),
            bytes: Some(1234),
            markdown: "# Title\nbody".into(),
        }],
        ..Default::default()
    }));
    let msgs = llm_messages(&log.events);
    let Content::Parts(parts) = &msgs[0].content else { panic!("expected parts") };
    assert_eq!(parts[0], ContentPart::Text { text: "see attached".into() });
    assert!(matches!(&parts[1], ContentPart::Text { text } if text.contains("# Title\nbody")));
    assert_eq!(
        parts[2],
        ContentPart::ImageRef { id: "img1".into(), mime: "image/png".into(), width: None, height: None }
    );
    let bytes = String::from_utf8(msgs[0].canonical_bytes()).unwrap();
    assert!(!bytes.contains("base64"), "image bytes never enter the projection");

    let ui = ui_transcript(&log.events);
    let docs = ui[0].documents.as_ref().unwrap();
    assert_eq!((docs[0].id.as_str(), docs[0].mime.as_str()), ("doc1", "application/pdf"));
    let ui_json = serde_json::to_string(&ui[0]).unwrap();
    assert!(!ui_json.contains("# Title"), "the UI gets document refs only: {ui_json}");
}

#[test]
fn turn_memory_is_a_user_note_and_empty_residue_projects_nothing() {
    let mut log = LogBuilder::new();
    log.user("fix it");
    let turn = log.assistant("done");
    log.push(EventBody::TurnMemory(TurnMemory { turn_seq: turn, ..Default::default() }));
    assert_eq!(llm_messages(&log.events).len(), 2);
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: turn,
        files_changed: vec!["src/main.rs".into()],
        failures: vec![Failure { what: "cargo test".into(), why: "missing db".into() }],
        key_findings: vec!["the bug is in parse()".into()],
    }));
    let msgs = llm_messages(&log.events);
    assert_eq!(msgs.len(), 3);
    assert_eq!(msgs[2].role, Role::User, "never assistant-role");
    let t = text_of(&msgs[2]);
    assert!(t.contains("src/main.rs") && t.contains("missing db") && t.contains("parse()"), "{t}");
}

#[test]
fn turn_failed_is_a_user_note_saying_why() {
    let mut log = LogBuilder::new();
    log.user("q");
    log.push(EventBody::TurnFailed(TurnFailed {
        code: "upstream_error".into(),
        message: "502 from gateway".into(),
        attempt_id: None,
        request: None,
    }));
    let msgs = llm_messages(&log.events);
    assert_eq!(msgs[1].role, Role::User);
    assert_eq!(text_of(&msgs[1]), "[previous turn failed: upstream_error: 502 from gateway]");
}

#[test]
fn live_pending_projects_with_interrupted_note_and_survives_a_user_message() {
    let mut log = LogBuilder::new();
    log.user("tell me a story");
    log.pending("Once upon", None);
    let p = log.pending("Once upon a time", Some(PendingReason::Interrupted));
    log.user("go on");
    assert_eq!(live_pending_seq(&log.events), Some(p));
    let ctx = llm_context(&log.events);
    let texts: Vec<_> = ctx.iter().map(|m| text_of(&m.message)).collect();
    assert_eq!(texts, ["tell me a story", &format!("Once upon a time\n\n{INTERRUPTED_NOTE}"), "go on"]);
    assert_eq!(ctx[1].message.role, Role::Assistant);
}

#[test]
fn stopped_pending_says_stopped_by_the_user() {
    let mut log = LogBuilder::new();
    log.user("q");
    log.pending("partial", Some(PendingReason::Stopped));
    let msgs = llm_messages(&log.events);
    assert_eq!(text_of(&msgs[1]), format!("partial\n\n{STOPPED_NOTE}"));
}

#[test]
fn later_assistant_turn_supersedes_the_pending() {
    let mut log = LogBuilder::new();
    log.user("q");
    log.pending("par", Some(PendingReason::Interrupted));
    log.assistant("full answer");
    assert_eq!(live_pending_seq(&log.events), None);
    let texts: Vec<_> = llm_messages(&log.events).iter().map(text_of).collect();
    assert_eq!(texts, ["q", "full answer"]);
}

#[test]
fn covering_compaction_supersedes_the_pending() {
    let mut log = LogBuilder::new();
    log.user("q");
    let p = log.pending("par", Some(PendingReason::Interrupted));
    log.user("q2");
    log.compaction("summary", p);
    assert_eq!(live_pending_seq(&log.events), None);
    let texts: Vec<_> = llm_messages(&log.events).iter().map(text_of).collect();
    assert_eq!(texts, [format!("{SUMMARY_MARKER}\nsummary"), "q2".into()]);
}

#[test]
fn only_the_newest_pending_projects() {
    let mut log = LogBuilder::new();
    log.user("q1");
    log.pending("first", Some(PendingReason::Interrupted));
    log.user("q2");
    log.pending("second", Some(PendingReason::Interrupted));
    let texts: Vec<_> = llm_messages(&log.events).iter().map(text_of).collect();
    assert_eq!(texts, ["q1".to_string(), "q2".into(), format!("second\n\n{INTERRUPTED_NOTE}")]);
}

/// DESIGN §14: within its turn the model sees every step's tool calls and outputs in
/// order (OpenAI's assistant `tool_calls` and `tool` messages); once a later user message
/// exists, the finished turn's tool traffic leaves and its answer stays.
#[test]
fn tool_traffic_projects_within_its_turn_only() {
    let mut log = LogBuilder::new();
    log.user("list and read");
    log.tool_step("Looking.", "call_1", "ls", r#"{"dir": "."}"#);
    log.tool_result("call_1", "ls", "a.txt");
    log.tool_step("", "call_2", "read", r#"{"path":"a.txt"}"#);
    log.tool_result("call_2", "read", "hello");
    log.assistant("a.txt says hello");
    let within = llm_messages(&log.events);
    let roles: Vec<Role> = within.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::Tool, Role::Assistant, Role::Tool, Role::Assistant]
    );
    assert_eq!(within[1].tool_calls[0].arguments, r#"{"dir": "."}"#);
    assert_eq!(
        (within[2].tool_call_id.as_deref(), text_of(&within[2])),
        (Some("call_1"), "a.txt".to_owned())
    );
    assert_eq!(text_of(&within[3]), "|read|{\"path\":\"a.txt\"}", "no content, then the call");
    log.user("thanks");
    let after: Vec<String> = llm_messages(&log.events).iter().map(text_of).collect();
    assert_eq!(after, ["list and read", "a.txt says hello", "thanks"]);
    // The UI transcript keeps every call and result.
    let ui: Vec<ItemKind> = ui_transcript(&log.events).iter().map(|i| i.kind).collect();
    assert_eq!(ui.iter().filter(|k| **k == ItemKind::Tool).count(), 2);
}

#[test]
fn nothing_else_projects() {
    let mut log = LogBuilder::new();
    log.user("q");
    log.push(EventBody::PermissionRequest(PermissionRequest {
        id: "p1".into(),
        call_id: "c1".into(),
        tool: "rm".into(),
        args: json!({}),
        danger_level: "high".into(),
        rationale: "cleanup".into(),
    }));
    log.push(EventBody::PermissionResolved(PermissionResolved { id: "p1".into(), decision: "deny".into() }));
    log.push(EventBody::MemoryExtracted(MemoryExtracted { turn_seq: 2, memories: vec![], error: None }));
    assert_eq!(llm_messages(&log.events).len(), 1);
}

#[test]
fn live_tail_projects_like_the_whole_log() {
    let mut log = LogBuilder::new();
    for i in 0..6 {
        log.user(&format!("q{i}"));
        log.assistant(&format!("a{i}"));
    }
    let c = log.compaction("sum", 7);
    log.user("q6");
    log.pending("p", None);
    let tail: Vec<_> = log.events.iter().filter(|e| e.seq > 7 || e.seq == c).cloned().collect();
    assert_eq!(llm_context(&tail), llm_context(&log.events));
}

// ---- UI transcript ------------------------------------------------------------------

#[test]
fn ui_shows_every_kind_with_its_fields() {
    let mut log = LogBuilder::new();
    log.user("q");
    let mut t = assistant_turn("answer", Some("a1"));
    t.ui.blocks.insert(0, Block { kind: BlockType::Reasoning, text: Some("hmm".into()), meta: None });
    t.model = Some("m1".into());
    t.usage = Some(Usage { input_tokens: 10, output_tokens: 5, cached_input_tokens: Some(0) });
    t.duration_ms = Some(1200);
    t.cost = Some(0.002);
    t.currency = Some("USD".into());
    log.push(EventBody::AssistantTurn(t));
    log.push(EventBody::ToolExecution(ToolExecution {
        call_id: "c".into(),
        name: "grep".into(),
        status: "ok".into(),
        result_digest: Some("3 matches".into()),
        ..Default::default()
    }));
    log.push(EventBody::TurnFailed(TurnFailed {
        code: "upstream_error".into(),
        message: "boom".into(),
        attempt_id: None,
        request: None,
    }));
    log.compaction("the summary", 3);

    let ui = ui_transcript(&log.events);
    let kinds: Vec<_> = ui.iter().map(|i| i.kind).collect();
    assert_eq!(
        kinds,
        [ItemKind::User, ItemKind::Assistant, ItemKind::Tool, ItemKind::Error, ItemKind::Compaction]
    );
    let a = &ui[1];
    assert_eq!(a.text.as_deref(), Some("answer"));
    assert_eq!(a.blocks.as_ref().unwrap().len(), 2);
    assert_eq!(
        (a.model.as_deref(), a.duration_ms, a.currency.as_deref()),
        (Some("m1"), Some(1200), Some("USD"))
    );
    assert_eq!(ui[2].tool.as_ref().unwrap().result_digest.as_deref(), Some("3 matches"));
    assert_eq!((ui[3].code.as_deref(), ui[3].text.as_deref()), (Some("upstream_error"), Some("boom")));
    assert_eq!(ui[4].through_seq, Some(3));
    // session_started, turn_memory and memory_extracted produce no item
    assert!(ui.iter().all(|i| i.seq != 1));
}

#[test]
fn ui_keeps_summarized_turns_visible() {
    let mut log = LogBuilder::new();
    log.user("q1");
    log.assistant("a1");
    log.user("q2");
    log.compaction("sum", 3);
    let ui = ui_transcript(&log.events);
    assert_eq!(ui.iter().filter(|i| i.kind == ItemKind::User).count(), 2);
    assert_eq!(ui.last().unwrap().kind, ItemKind::Compaction);
}

#[test]
fn ui_shows_every_unanswered_attempt_forever_but_only_its_last_checkpoint() {
    let mut log = LogBuilder::new();
    log.user("q");
    let push_pending = |log: &mut LogBuilder, partial: &str, attempt: &str, reason| {
        log.push(EventBody::PendingState(PendingState {
            partial: partial.into(),
            attempt_id: Some(attempt.into()),
            reason,
            request: None,
        }))
    };
    push_pending(&mut log, "Once", "a1", None);
    let last_a1 = push_pending(&mut log, "Once upon", "a1", Some(PendingReason::Interrupted));
    // retry: a new attempt that completes
    push_pending(&mut log, "Long ago", "a2", None);
    log.push(EventBody::AssistantTurn(assistant_turn("Long ago, the end.", Some("a2"))));
    // a later turn, stopped by the user
    log.user("another");
    let stopped = push_pending(&mut log, "Well", "a3", Some(PendingReason::Stopped));
    log.user("and another");

    let ui = ui_transcript(&log.events);
    let interrupted: Vec<_> = ui.iter().filter(|i| i.kind == ItemKind::Interrupted).collect();
    assert_eq!(interrupted.len(), 2, "{ui:#?}");
    assert_eq!((interrupted[0].seq, interrupted[0].text.as_deref()), (last_a1, Some("Once upon")));
    assert_eq!(interrupted[0].reason, Some(PendingReason::Interrupted));
    assert_eq!((interrupted[1].seq, interrupted[1].reason), (stopped, Some(PendingReason::Stopped)));
    assert_eq!(ui.iter().filter(|i| i.kind == ItemKind::Assistant).count(), 1);
}

#[test]
fn ui_interrupted_without_attempt_ids_uses_turn_boundaries() {
    let mut log = LogBuilder::new();
    log.user("q");
    log.pending("a", None);
    let last = log.pending("ab", Some(PendingReason::Interrupted));
    log.pending("retry partial", None);
    log.assistant("retry answer");
    let ui = ui_transcript(&log.events);
    let interrupted: Vec<_> = ui.iter().filter(|i| i.kind == ItemKind::Interrupted).map(|i| i.seq).collect();
    assert_eq!(interrupted, [last]);
}

#[test]
fn ui_hides_answered_permission_requests_only() {
    let mut log = LogBuilder::new();
    for id in ["p1", "p2"] {
        log.push(EventBody::PermissionRequest(PermissionRequest {
            id: id.into(),
            call_id: "c".into(),
            tool: "rm".into(),
            args: json!({"path": "/tmp"}),
            danger_level: "high".into(),
            rationale: "cleanup".into(),
        }));
    }
    log.push(EventBody::PermissionResolved(PermissionResolved { id: "p1".into(), decision: "allow".into() }));
    let ui = ui_transcript(&log.events);
    let perms: Vec<_> = ui.iter().filter_map(|i| i.permission.as_ref()).map(|p| p.id.as_str()).collect();
    assert_eq!(perms, ["p2"]);
}

// ---- prefix stability -----------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    User(String),
    Assistant(String, bool),
    Pending(String, Option<PendingReason>, bool),
    Memory(bool),
    Failed,
    Tool,
    /// A step that asks for a tool.
    Step,
    Permission,
    Extracted,
    /// A compaction through the live message at this fraction of the live list.
    Compaction(u8),
    /// An event of any kind with its default payload, so every kind (a new one too) is in
    /// the property.
    Kind(EventKind),
}

fn op() -> impl Strategy<Value = Op> {
    let text = "[a-zA-Z0-9 .]{0,24}";
    prop_oneof![
        4 => text.prop_map(Op::User),
        4 => (text, any::<bool>()).prop_map(|(t, a)| Op::Assistant(t, a)),
        4 => (text, prop_oneof![Just(None), Just(Some(PendingReason::Interrupted)), Just(Some(PendingReason::Stopped))], any::<bool>())
            .prop_map(|(t, r, a)| Op::Pending(t, r, a)),
        1 => any::<bool>().prop_map(Op::Memory),
        1 => Just(Op::Failed),
        1 => Just(Op::Tool),
        1 => Just(Op::Step),
        1 => Just(Op::Permission),
        1 => Just(Op::Extracted),
        1 => any::<u8>().prop_map(Op::Compaction),
        1 => proptest::sample::select(EventKind::ALL.to_vec()).prop_map(Op::Kind),
    ]
}

fn apply(log: &mut LogBuilder, op: &Op) {
    let attempt = |on: bool| on.then(|| AttemptId::from(format!("att{}", log.next_seq() / 3)));
    let body = match op {
        Op::User(t) => EventBody::UserMessage(UserMessage { text: t.clone(), ..Default::default() }),
        Op::Assistant(t, a) => EventBody::AssistantTurn(assistant_turn(t, attempt(*a).as_deref())),
        Op::Pending(t, r, a) => EventBody::PendingState(PendingState {
            partial: t.clone(),
            attempt_id: attempt(*a),
            reason: *r,
            request: None,
        }),
        Op::Memory(empty) => EventBody::TurnMemory(TurnMemory {
            turn_seq: log.next_seq() - 1,
            key_findings: if *empty { vec![] } else { vec!["found it".into()] },
            ..Default::default()
        }),
        Op::Failed => EventBody::TurnFailed(TurnFailed {
            code: "upstream_error".into(),
            message: "x".into(),
            attempt_id: None,
            request: None,
        }),
        Op::Tool => EventBody::ToolExecution(ToolExecution {
            call_id: "c".into(),
            name: "t".into(),
            status: "ok".into(),
            ..Default::default()
        }),
        Op::Step => {
            let id = format!("call_{}", log.next_seq());
            log.tool_step("checking", &id, "t", r#"{"x": 1}"#);
            return;
        }
        Op::Permission => EventBody::PermissionRequest(PermissionRequest {
            id: format!("p{}", log.next_seq()),
            call_id: "c".into(),
            tool: "t".into(),
            args: json!(null),
            danger_level: "low".into(),
            rationale: String::new(),
        }),
        Op::Extracted => {
            EventBody::MemoryExtracted(MemoryExtracted { turn_seq: 1, memories: vec![], error: None })
        }
        Op::Compaction(f) => {
            let live = llm_context(&log.events);
            if live.is_empty() {
                return;
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
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Appending any event never changes an earlier projected message, byte for byte,
    /// except at a new compaction, the live pending (which only disappears when an answer
    /// or a newer pending follows it), and tool traffic (DESIGN §14): a new user message
    /// takes the finished turn's tool calls and results out, and everything else —
    /// through the previous turn's user message, and the answers after it — stays.
    #[test]
    fn prefix_is_stable_as_the_log_grows(ops in proptest::collection::vec(op(), 1..80)) {
        let mut log = LogBuilder::new();
        let mut before = llm_context(&log.events);
        for op in &ops {
            let turn_start = turnlog_core::llm_context::current_turn_start(&log.events);
            apply(&mut log, op);
            let after = llm_context(&log.events);
            let appended = &log.events.last().unwrap().body;
            if !matches!(appended, EventBody::CompactionApplied(_)) {
                let new_turn = matches!(appended, EventBody::UserMessage(_));
                let tool = |m: &turnlog_core::ProjectedMessage| {
                    m.source == Source::Tool || !m.message.tool_calls.is_empty()
                };
                let stable = |ctx: &[turnlog_core::ProjectedMessage]| -> Vec<Vec<u8>> {
                    ctx.iter()
                        .filter(|m| m.source != Source::LivePending && !(new_turn && tool(m)))
                        .map(|m| m.message.canonical_bytes())
                        .collect()
                };
                let (old, new) = (stable(&before), stable(&after));
                prop_assert!(new.len() >= old.len() && new[..old.len()] == old[..], "prefix changed after {op:?}");
                if new_turn {
                    // Byte-stable through the previous turn's user message; no tool traffic
                    // of a finished turn is left.
                    let through: Vec<_> = before.iter().filter(|m| m.seq <= turn_start).collect();
                    prop_assert!(after.len() >= through.len());
                    for (a, b) in after.iter().zip(&through) {
                        prop_assert_eq!(&a.message, &b.message);
                    }
                    prop_assert!(!after.iter().any(tool), "tool traffic of a finished turn after {op:?}");
                }
                if let Some(p) = before.iter().find(|m| m.source == Source::LivePending) {
                    match after.iter().find(|m| m.seq == p.seq) {
                        Some(still) => prop_assert_eq!(&still.message, &p.message),
                        None => prop_assert!(
                            matches!(appended, EventBody::AssistantTurn(_) | EventBody::PendingState(_)),
                            "live pending vanished after {:?}", op
                        ),
                    }
                }
            }
            before = after;
        }
    }

    /// Under `TURNLOG_TOOL_HISTORY=keep` everything is byte-stable as the log grows — tool
    /// traffic included — except at a new compaction and the live pending, and the
    /// budget's count is the projection's.
    #[test]
    fn everything_is_stable_under_keep(ops in proptest::collection::vec(op(), 1..80)) {
        use turnlog_core::budget::{history_tokens_with, CountedEvent};
        use turnlog_core::llm_context::{llm_context_with, ToolHistory};
        let keep = ToolHistory::Keep;
        let mut log = LogBuilder::new();
        let mut before = llm_context_with(&log.events, keep);
        for op in &ops {
            apply(&mut log, op);
            let after = llm_context_with(&log.events, keep);
            let appended = &log.events.last().unwrap().body;
            if !matches!(appended, EventBody::CompactionApplied(_)) {
                let stable = |ctx: &[turnlog_core::ProjectedMessage]| -> Vec<Vec<u8>> {
                    ctx.iter()
                        .filter(|m| m.source != Source::LivePending)
                        .map(|m| m.message.canonical_bytes())
                        .collect()
                };
                let (old, new) = (stable(&before), stable(&after));
                prop_assert!(new.len() >= old.len() && new[..old.len()] == old[..], "prefix changed after {op:?}");
            }
            let counted: Vec<CountedEvent> = log.events.iter().map(CountedEvent::of).collect();
            let messages: Vec<_> = after.iter().map(|m| m.message.clone()).collect();
            let projected = turnlog_core::tokens::request_tokens(&messages) - turnlog_core::tokens::REQUEST_OVERHEAD;
            prop_assert_eq!(history_tokens_with(&counted, keep), projected);
            before = after;
        }
    }
}

#[test]
fn under_keep_a_finished_turns_tool_traffic_stays_until_a_compaction_which_never_splits_a_step() {
    use turnlog_core::compaction::plan_compaction_with;
    use turnlog_core::llm_context::{llm_context_with, llm_messages_with, ToolHistory};
    let mut log = LogBuilder::new();
    log.user("list");
    log.tool_step("", "call_1", "ls", "{}");
    log.tool_result("call_1", "ls", "a.txt");
    log.assistant("a.txt");
    log.user("thanks");
    let kept: Vec<Role> = llm_messages_with(&log.events, ToolHistory::Keep).iter().map(|m| m.role).collect();
    assert_eq!(kept, [Role::User, Role::Assistant, Role::Tool, Role::Assistant, Role::User]);
    assert_eq!(llm_messages(&log.events).len(), 3, "under turn it leaves");
    // Half of five is a cut right after the step: it moves past the step's result.
    let plan = plan_compaction_with(&log.events, 0, ToolHistory::Keep).unwrap();
    let sources: Vec<Source> = plan.span.iter().map(|m| m.source).collect();
    assert_eq!(sources, [Source::User, Source::Assistant, Source::Tool]);
    assert_eq!(plan.tool_results.len(), 1);
    let live = llm_context_with(&log.events, ToolHistory::Keep);
    assert!(live.iter().filter(|m| m.seq > plan.through_seq).all(|m| m.source != Source::Tool));
}
