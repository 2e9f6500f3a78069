//! The rules of DESIGN.md §4 (planning and budgeting), and convergence over a long
//! conversation with a summarizer that keeps names and numbers.

use proptest::prelude::*;
use turnlog_core::budget::{budget_for, history_tokens, request_size, CountedEvent};
use turnlog_core::compaction::{plan_compaction, plan_compaction_shrunk};
use turnlog_core::events::*;
use turnlog_core::llm_context::{llm_context, llm_messages, Source};
use turnlog_core::log_builder::LogBuilder;
use turnlog_core::request::{assemble, reserve_tokens, Extras};
use turnlog_core::tokens::{request_tokens, REQUEST_OVERHEAD};

fn conversation(turns: usize) -> LogBuilder {
    let mut log = LogBuilder::new();
    for i in 0..turns {
        log.user(&format!("question {i}"));
        log.assistant(&format!("answer {i}"));
    }
    log
}

#[test]
fn fewer_than_four_live_messages_is_no_plan() {
    let mut log = conversation(1);
    log.user("q");
    assert_eq!(llm_context(&log.events).len(), 3);
    assert_eq!(plan_compaction(&log.events), None);
}

#[test]
fn plan_takes_the_oldest_half_of_live_messages() {
    let log = conversation(4); // 8 messages, seqs 2..=9
    let plan = plan_compaction(&log.events).unwrap();
    assert_eq!(plan.span.len(), 4);
    assert_eq!(plan.through_seq, 5); // the 4th live message: answer 1
    assert_eq!(plan.turn_seqs, [3, 5]);
    assert_eq!(plan.expect_compacted_through, None);
}

#[test]
fn plan_never_ends_on_an_unanswered_user_message() {
    let mut log = LogBuilder::new();
    log.user("q0");
    log.assistant("a0");
    log.user("q1"); // half of 6 ends here
    log.assistant("a1");
    log.user("q2");
    log.assistant("a2");
    let plan = plan_compaction(&log.events).unwrap();
    assert_eq!(plan.span.last().unwrap().source, Source::Assistant);
    assert_eq!(plan.span.len(), 4);
}

#[test]
fn plan_keeps_at_least_one_turn_live() {
    let mut log = LogBuilder::new();
    log.user("q0");
    log.assistant("a0");
    log.user("q1");
    log.pending("partial", Some(PendingReason::Interrupted));
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: 3,
        key_findings: vec!["x".into()],
        ..Default::default()
    }));
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: 3,
        key_findings: vec!["y".into()],
        ..Default::default()
    }));
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: 3,
        key_findings: vec!["z".into()],
        ..Default::default()
    }));
    // 7 live messages; half (3) would end on q1, extending would leave no user message live.
    let plan = plan_compaction(&log.events).unwrap();
    let live_after: Vec<_> =
        llm_context(&log.events).into_iter().filter(|m| m.seq > plan.through_seq).collect();
    assert!(live_after.iter().any(|m| m.source == Source::User), "{plan:?}");
    assert_eq!(plan.through_seq, 3);
}

#[test]
fn no_user_message_live_means_no_plan() {
    let mut log = LogBuilder::new();
    for _ in 0..5 {
        log.assistant("unprompted");
    }
    assert_eq!(plan_compaction(&log.events), None);
}

#[test]
fn live_pending_and_nonempty_turn_memories_count_as_messages() {
    let mut log = LogBuilder::new();
    log.user("q0");
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: 2,
        key_findings: vec!["k".into()],
        ..Default::default()
    }));
    log.push(EventBody::TurnMemory(TurnMemory { turn_seq: 2, ..Default::default() })); // empty: not a message
    log.pending("part", None);
    // user, memory, pending = 3 live messages: below the minimum
    assert_eq!(plan_compaction(&log.events), None);
    log.user("q1");
    assert!(plan_compaction(&log.events).is_some(), "4 live messages, counting the pending");
    log.push(EventBody::TurnFailed(TurnFailed {
        code: "c".into(),
        message: "m".into(),
        attempt_id: None,
        request: None,
    }));
    log.push(EventBody::TurnMemory(TurnMemory {
        turn_seq: 2,
        key_findings: vec!["k2".into()],
        ..Default::default()
    }));
    let plan = plan_compaction(&log.events).unwrap();
    assert_eq!(plan.span.len(), 3, "user, memory note and live pending: {plan:?}");
    assert!(plan.span.iter().any(|m| m.source == Source::LivePending));
}

#[test]
fn previous_summary_is_folded_into_the_next_span() {
    let mut log = conversation(4);
    log.compaction("first summary", 5);
    for i in 4..8 {
        log.user(&format!("question {i}"));
        log.assistant(&format!("answer {i}"));
    }
    let plan = plan_compaction(&log.events).unwrap();
    assert_eq!(plan.span[0].source, Source::Summary);
    assert_eq!(plan.expect_compacted_through, Some(5));
    assert!(plan.through_seq > 5);
}

#[test]
fn halving_shrinks_the_span() {
    let log = conversation(16);
    let full = plan_compaction(&log.events).unwrap();
    let half = plan_compaction_shrunk(&log.events, 1).unwrap();
    assert_eq!((full.span.len(), half.span.len()), (16, 8));
}

#[test]
fn history_tokens_from_cached_counts_equal_the_projection() {
    let mut log = conversation(3);
    log.pending("cut off", Some(PendingReason::Interrupted));
    log.user("next");
    log.compaction("sum", 4);
    log.push(EventBody::TurnFailed(TurnFailed {
        code: "c".into(),
        message: "m".into(),
        attempt_id: None,
        request: None,
    }));
    let counted: Vec<_> = log.events.iter().map(CountedEvent::of).collect();
    let projected = request_tokens(&llm_messages(&log.events)) - REQUEST_OVERHEAD;
    assert_eq!(history_tokens(&counted), projected);
}

#[test]
fn request_assembly_puts_extras_after_the_whole_history() {
    let log = conversation(2);
    let extras = Extras { date: Some("2026-11-29".into()), memories: vec!["likes tea".into()] };
    let msgs = assemble("You are helpful.", llm_messages(&log.events), &extras);
    assert_eq!(msgs[0].role, turnlog_core::Role::System);
    assert_eq!(&msgs[1..5], &llm_messages(&log.events)[..]);
    let last: String = msgs[5].texts().collect();
    assert!(last.contains("2026-11-29") && last.contains("likes tea"));
    // what request_size predicts from cached counts is what the assembled request costs
    let counted: Vec<_> = log.events.iter().map(CountedEvent::of).collect();
    let predicted = request_size(history_tokens(&counted), reserve_tokens("You are helpful.", &extras));
    assert_eq!(predicted, request_tokens(&msgs));
}

proptest! {
    #[test]
    fn cached_counts_always_agree_with_projection(
        // An op, and the kind op 7 appends with its default payload (every kind is counted).
        ops in proptest::collection::vec((0u8..8, proptest::sample::select(EventKind::ALL.to_vec())), 1..60),
    ) {
        let mut log = LogBuilder::new();
        for (i, (op, kind)) in ops.iter().enumerate() {
            match op {
                0 => { log.user(&format!("user says {i}")); }
                1 => { log.assistant(&format!("assistant answers {i} at length")); }
                2 => { log.pending(&format!("partial {i}"), None); }
                3 => { log.push(EventBody::TurnMemory(TurnMemory { turn_seq: 1, key_findings: vec![format!("f{i}")], ..Default::default() })); }
                4 => { let t = log.next_seq() / 2; log.compaction(&format!("summary {i}"), t); }
                5 => { log.tool_result(&format!("c{i}"), "n", &format!("output {i} of the tool")); }
                6 => { log.tool_step(&format!("step {i}"), &format!("c{i}"), "n", r#"{"path": "a/b.rs"}"#); }
                _ => { log.push(EventBody::default_of(*kind)); }
            }
            let counted: Vec<_> = log.events.iter().map(CountedEvent::of).collect();
            prop_assert_eq!(history_tokens(&counted), request_tokens(&llm_messages(&log.events)) - REQUEST_OVERHEAD);
        }
    }
}

/// The test summarizer: keeps every sentence that carries a name (a capitalized word
/// after the first) or a number, like the fact-keeping summary instruction demands.
fn keep_facts(span: &[turnlog_core::ProjectedMessage]) -> String {
    let mut kept = Vec::new();
    for m in span {
        for text in m.message.texts() {
            for line in text.lines().filter(|l| !l.starts_with('[')) {
                for sentence in line.split_inclusive('.').map(str::trim).filter(|s| !s.is_empty()) {
                    let has_number = sentence.chars().any(|c| c.is_ascii_digit());
                    let has_name = sentence
                        .split_whitespace()
                        .skip(1)
                        .any(|w| w.starts_with(|c: char| c.is_uppercase()));
                    if (has_number || has_name) && !kept.contains(&sentence.to_owned()) {
                        kept.push(sentence.to_owned());
                    }
                }
            }
        }
    }
    kept.join(" ")
}

#[test]
fn hundred_turns_stay_within_budget_and_keep_turn_one_facts() {
    let budget = budget_for(Some(3_000), 60_000); // 1,800 tokens
    let system = "You are a careful assistant.";
    let extras = Extras { date: Some("2026-11-29".into()), memories: vec![] };
    let reserve = reserve_tokens(system, &extras);
    let filler = "we went over the plan again and agreed that nothing about it should change for now";

    let mut log = LogBuilder::new();
    let mut compactions = 0;
    for turn in 1..=100 {
        if turn == 1 {
            log.user("My name is Zanzibar Quill and my locker code is 48213.");
        } else {
            log.user(&format!("{filler}, so tell me more about the weather over here please"));
        }
        log.assistant(&format!("sure, {filler}; the weather stays mild and calm all week long"));

        let size = |log: &LogBuilder| {
            let counted: Vec<_> = log.events.iter().map(CountedEvent::of).collect();
            request_size(history_tokens(&counted), reserve)
        };
        let mut rounds = 0;
        while size(&log) > budget {
            let plan = plan_compaction(&log.events).expect("over budget must be compactable");
            let before = size(&log);
            log.compaction(&keep_facts(&plan.span), plan.through_seq);
            compactions += 1;
            rounds += 1;
            assert!(size(&log) < before, "a compaction must shrink the request");
            assert!(rounds < 5, "compaction does not converge at turn {turn}");
        }
        let request = assemble(system, llm_messages(&log.events), &extras);
        assert!(request_tokens(&request) <= budget, "turn {turn}: over budget");
    }
    assert!(compactions >= 5, "expected several compactions, got {compactions}");
    let context: String =
        llm_messages(&log.events).iter().flat_map(|m| m.texts().map(str::to_owned)).collect();
    assert!(context.contains("Zanzibar Quill") && context.contains("48213"), "turn-1 facts lost: {context}");
}

/// One step of a random log for the planning property: user messages often several in a
/// row (unanswered), answers, pendings that later answers or pendings supersede, notes, and
/// compactions applied as the compactor would (through a plan's boundary).
#[derive(Debug, Clone)]
enum Step {
    User,
    Assistant,
    Pending(bool),
    Failed,
    Memory,
    /// Apply the plan, shrunk this many times, as a compaction (if there is one).
    Compact(u32),
    /// An event of any kind with its default payload, so every kind (a new one too) is in
    /// the property.
    Kind(EventKind),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::User),
        3 => Just(Step::Assistant),
        2 => any::<bool>().prop_map(Step::Pending),
        1 => Just(Step::Failed),
        1 => Just(Step::Memory),
        1 => (0u32..3).prop_map(Step::Compact),
        1 => proptest::sample::select(EventKind::ALL.to_vec()).prop_map(Step::Kind),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// DESIGN.md §4: whatever the log, a plan's span never ends on an unanswered user
    /// message, at least one turn (the last user message) stays live after it, and it moves
    /// the boundary forward.
    #[test]
    fn plans_never_end_on_a_user_message_and_keep_a_turn_live(
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let mut log = LogBuilder::new();
        for (i, s) in steps.iter().enumerate() {
            match s {
                Step::User => { log.user(&format!("question {i}")); }
                Step::Assistant => { log.assistant(&format!("answer {i}")); }
                Step::Pending(stopped) => {
                    log.pending(&format!("partial {i}"), stopped.then_some(PendingReason::Stopped));
                }
                Step::Failed => {
                    log.push(EventBody::TurnFailed(TurnFailed {
                        code: "upstream_error".into(),
                        message: "x".into(),
                        attempt_id: None,
                        request: None,
                    }));
                }
                Step::Memory => {
                    let turn_seq = log.next_seq() - 1;
                    log.push(EventBody::TurnMemory(TurnMemory {
                        turn_seq,
                        key_findings: vec![format!("finding {i}")],
                        ..Default::default()
                    }));
                }
                Step::Compact(h) => {
                    if let Some(plan) = plan_compaction_shrunk(&log.events, *h) {
                        log.compaction(&format!("summary {i}"), plan.through_seq);
                    }
                }
                Step::Kind(kind) => { log.push(EventBody::default_of(*kind)); }
            }
            let live = llm_context(&log.events);
            for halvings in 0..4 {
                let Some(plan) = plan_compaction_shrunk(&log.events, halvings) else { continue };
                let last = plan.span.last().expect("a plan has a span");
                prop_assert_ne!(last.source, Source::User, "span ends on a user message: {:?}", plan);
                prop_assert!(
                    live.iter().any(|m| m.seq > plan.through_seq && m.source == Source::User),
                    "no turn stays live after {}: {:?}", plan.through_seq, live
                );
                if let Some(b) = plan.expect_compacted_through {
                    prop_assert!(plan.through_seq > b);
                }
            }
        }
    }
}
