//! ChatGPT's data export (`conversations.json`): an array of conversations, each a tree of
//! message nodes (`mapping`: id → `{message, parent, children}`) and the node last shown
//! (`current_node`). The path from the root to `current_node` becomes the session; every
//! other branch a fork at the node it branches off (DESIGN §10).
//!
//! Along a path, a user node is a user message; the nodes after it up to the next user
//! message (answers, tool calls and their output, reasoning) one answer — cut where a
//! branch starts, so a fork inherits nothing past its branch point. What is not text (an
//! image, a tool's output) becomes a short visible note in its message, and is counted as
//! skipped.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Datelike as _, Utc};
use serde_json::Value;

use super::{
    answer_payload, title_from, user_payload, Conversation, PlannedEvent, PlannedFork, PlannedSession,
    Rejected, Skipped, MAX_SESSIONS,
};
use crate::branch::MAX_FORK_DEPTH;
use crate::events::{EventKind, Imported};
use crate::storable::YEARS;

const SOURCE: &str = "chatgpt";

/// Most nodes a conversation may have.
const MAX_NODES: usize = 100_000;

struct Node<'a> {
    parent: Option<&'a str>,
    children: Vec<&'a str>,
    message: Option<&'a Value>,
}

/// One conversation of the export as the sessions it makes.
pub fn conversation(v: &Value) -> Result<Conversation, Rejected> {
    let title = v.get("title").and_then(Value::as_str).map(str::to_owned);
    let id = v
        .get("conversation_id")
        .or_else(|| v.get("id"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| content_id(v));
    let reject = |reason: String| Rejected::new(title.as_deref(), &id, reason);
    let Some(mapping) = v.get("mapping").and_then(Value::as_object) else {
        return Err(reject("it has no `mapping` of message nodes".into()));
    };
    if mapping.len() > MAX_NODES {
        return Err(reject(format!("it has more than {MAX_NODES} nodes")));
    }
    let mut nodes: HashMap<&str, Node<'_>> = mapping
        .iter()
        .map(|(key, n)| {
            let parent = n.get("parent").and_then(Value::as_str).filter(|p| mapping.contains_key(*p));
            let message = n.get("message").filter(|m| m.is_object());
            (key.as_str(), Node { parent, children: Vec::new(), message })
        })
        .collect();
    // Each leaf is a branch: a session to create. Counted before anything else is done
    // with them.
    let parents: HashSet<&str> = nodes.values().filter_map(|n| n.parent).collect();
    let leaves = nodes.len() - parents.len();
    if leaves > MAX_SESSIONS {
        return Err(reject(format!("it has more than {MAX_SESSIONS} branches ({leaves})")));
    }
    // Children from the parents (the one link each node has): first in the order the parent
    // lists them, then those it does not list by time. Linear in the nodes and the lists.
    let mut unlisted: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, n) in &nodes {
        if let Some(p) = n.parent {
            unlisted.entry(p).or_default().push(id);
        }
    }
    let mut children: HashMap<&str, Vec<&str>> = HashMap::with_capacity(unlisted.len());
    for (parent, mut rest) in unlisted {
        let mut listed: HashSet<&str> = HashSet::new();
        let mut ordered: Vec<&str> = Vec::with_capacity(rest.len());
        let list =
            mapping[parent].get("children").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        for c in list.iter().filter_map(Value::as_str) {
            let Some((key, node)) = nodes.get_key_value(c) else { continue };
            if node.parent == Some(parent) && listed.insert(key) {
                ordered.push(key);
            }
        }
        rest.retain(|c| !listed.contains(c));
        rest.sort_by_cached_key(|c| {
            (time_of(nodes[c].message).map(|t| t.timestamp_micros()).unwrap_or(i64::MAX), *c)
        });
        ordered.extend(rest);
        children.insert(parent, ordered);
    }
    for (parent, ordered) in children {
        if let Some(n) = nodes.get_mut(parent) {
            n.children = ordered;
        }
    }
    // Every node must reach a root by its parents: one that does not is on a cycle.
    let mut reaches_root: HashSet<&str> = HashSet::new();
    for start in nodes.keys() {
        let mut path = Vec::new();
        let mut at = *start;
        loop {
            if reaches_root.contains(at) {
                break;
            }
            if path.len() > nodes.len() {
                return Err(reject(format!("its nodes form a cycle (through node {at:?})")));
            }
            path.push(at);
            match nodes[at].parent {
                Some(p) => at = p,
                None => break,
            }
        }
        reaches_root.extend(path);
    }
    let roots: Vec<&str> = {
        let mut r: Vec<&str> = nodes.iter().filter(|(_, n)| n.parent.is_none()).map(|(id, _)| *id).collect();
        r.sort();
        r
    };
    if roots.len() != 1 {
        return Err(reject(format!("its nodes form {} trees; one was expected", roots.len())));
    }
    let current = match v.get("current_node").and_then(Value::as_str).filter(|c| nodes.contains_key(c)) {
        Some(c) => c,
        // The newest leaf.
        None => nodes
            .iter()
            .filter(|(_, n)| n.children.is_empty())
            .max_by_key(|(id, n)| (time_of(n.message).map(|t| t.timestamp_micros()), id.to_string()))
            .map(|(id, _)| *id)
            .unwrap_or(roots[0]),
    };
    let fallback_time = epoch(v.get("update_time")).or_else(|| epoch(v.get("create_time")));

    let mut plan = Planner {
        nodes: &nodes,
        fallback_time,
        sessions: Vec::new(),
        owner_of: HashMap::new(),
        seq_of: HashMap::new(),
        depth: Vec::new(),
        skipped: Vec::new(),
        skipped_unlisted: 0,
    };
    let mut main_path = vec![current];
    while let Some(p) = nodes[main_path[main_path.len() - 1]].parent {
        main_path.push(p);
    }
    main_path.reverse();
    plan.session(current.to_owned(), None, &main_path);
    // Every other leaf, depth first, forks off the nearest node already placed.
    let mut stack = vec![roots[0]];
    while let Some(at) = stack.pop() {
        let node = &nodes[at];
        stack.extend(node.children.iter().rev());
        if !node.children.is_empty() || plan.owner_of.contains_key(at) {
            continue;
        }
        let mut path = vec![at];
        let mut branch = at;
        while let Some(p) = nodes[branch].parent {
            branch = p;
            if plan.owner_of.contains_key(branch) {
                break;
            }
            path.push(branch);
        }
        path.reverse();
        let parent = plan.owner_of[branch];
        if plan.depth[parent] + 1 > MAX_FORK_DEPTH {
            return Err(reject(format!("its branches nest more than {MAX_FORK_DEPTH} deep")));
        }
        let through_seq = plan.seq_of[branch];
        plan.session(at.to_owned(), Some(PlannedFork { parent, through_seq }), &path);
    }
    let title = title.or_else(|| {
        let first = plan.sessions.first().and_then(|s| s.events.first())?.payload.value();
        first.get("text").and_then(Value::as_str).and_then(title_from)
    });
    let mut sessions = plan.sessions;
    for s in &mut sessions {
        s.title.clone_from(&title);
    }
    // A branch that added nothing visible is no fork (unless another forks off it).
    let parents: HashSet<usize> = sessions.iter().filter_map(|s| s.fork.map(|f| f.parent)).collect();
    let kept: Vec<usize> = (0..sessions.len())
        .filter(|i| *i == 0 || !sessions[*i].events.is_empty() || parents.contains(i))
        .collect();
    let renumber: HashMap<usize, usize> = kept.iter().enumerate().map(|(new, old)| (*old, new)).collect();
    let sessions: Vec<PlannedSession> = sessions
        .into_iter()
        .enumerate()
        .filter(|(i, _)| renumber.contains_key(i))
        .map(|(_, mut s)| {
            if let Some(f) = &mut s.fork {
                f.parent = renumber[&f.parent];
            }
            s
        })
        .collect();
    Ok(Conversation {
        format: super::Format::ChatGpt,
        source_id: id,
        title,
        sessions,
        skipped: plan.skipped,
        skipped_unlisted: plan.skipped_unlisted,
    })
}

/// Places paths of nodes as sessions, numbering their events as the writer will.
struct Planner<'a, 'n> {
    nodes: &'n HashMap<&'a str, Node<'a>>,
    fallback_time: Option<DateTime<Utc>>,
    sessions: Vec<PlannedSession>,
    /// The session each placed node belongs to, and the seq it ends at in that session's
    /// branch log (a node that adds no event: the seq before it).
    owner_of: HashMap<&'a str, usize>,
    seq_of: HashMap<&'a str, i64>,
    depth: Vec<usize>,
    skipped: Vec<Skipped>,
    skipped_unlisted: usize,
}

/// An answer being gathered from consecutive nodes.
#[derive(Default)]
struct Answer {
    source_id: String,
    text: Vec<String>,
    reasoning: Vec<String>,
    model: Option<String>,
    time: Option<DateTime<Utc>>,
}

impl<'a> Planner<'a, '_> {
    fn session(&mut self, key: String, fork: Option<PlannedFork>, path: &[&'a str]) {
        let index = self.sessions.len();
        let first_seq = fork.map_or(1, |f| f.through_seq + 1);
        self.depth.push(fork.map_or(0, |f| self.depth[f.parent] + 1));
        let mut events: Vec<PlannedEvent> = Vec::new();
        let mut answer: Option<Answer> = None;
        let mut pending: Vec<&'a str> = Vec::new();
        for &id in path {
            let node = &self.nodes[id];
            match self.part(id, node.message) {
                Part::Nothing => {}
                Part::User { text, time } => {
                    close(
                        &mut events,
                        &mut answer,
                        (first_seq, self.fallback_time),
                        &mut pending,
                        &mut self.seq_of,
                    );
                    let imported = imported(id, time.or(self.fallback_time));
                    let seq = first_seq + events.len() as i64 + 1;
                    events.push(PlannedEvent {
                        source_id: id.to_owned(),
                        seq,
                        kind: EventKind::UserMessage,
                        payload: user_payload(text, imported),
                        refers: None,
                    });
                }
                Part::Answer { text, reasoning, model, time } => {
                    let a = answer
                        .get_or_insert_with(|| Answer { source_id: id.to_owned(), ..Answer::default() });
                    a.text.extend(text);
                    a.reasoning.extend(reasoning);
                    a.model = model.or(a.model.take());
                    a.time = time.or(a.time);
                }
            }
            self.owner_of.insert(id, index);
            if answer.is_some() {
                pending.push(id);
            } else {
                self.seq_of.insert(id, first_seq + events.len() as i64);
            }
            // A branch starts after this node: what follows it is another answer.
            if node.children.len() > 1 {
                close(
                    &mut events,
                    &mut answer,
                    (first_seq, self.fallback_time),
                    &mut pending,
                    &mut self.seq_of,
                );
            }
        }
        close(&mut events, &mut answer, (first_seq, self.fallback_time), &mut pending, &mut self.seq_of);
        self.sessions.push(PlannedSession {
            key,
            title: None,
            fork,
            events,
            archived: false,
            metadata: None,
            deleted: false,
        });
    }

    /// What node `id`'s message adds, notes for what is not text included.
    fn part(&mut self, id: &str, message: Option<&Value>) -> Part {
        let Some(m) = message else { return Part::Nothing };
        let role = m.pointer("/author/role").and_then(Value::as_str).unwrap_or("");
        let content = m.get("content").unwrap_or(&Value::Null);
        let kind = content.get("content_type").and_then(Value::as_str).unwrap_or("text");
        let time = time_of(Some(m));
        let hidden = m.pointer("/metadata/is_visually_hidden_from_conversation").and_then(Value::as_bool)
            == Some(true);
        let (texts, notes) = self.texts(id, content);
        let joined = texts.join("\n\n");
        match (role, kind) {
            (_, "user_editable_context") => {
                self.skip(
                    "custom instructions",
                    "the profile and instructions set in ChatGPT are not imported",
                );
                Part::Nothing
            }
            ("system", _) => {
                if !hidden && !joined.trim().is_empty() {
                    self.skip("a system message", "system prompts are not imported");
                }
                Part::Nothing
            }
            ("user", _) => {
                if hidden && joined.trim().is_empty() {
                    return Part::Nothing;
                }
                Part::User { text: with_notes(joined, &notes), time }
            }
            ("assistant", "thoughts" | "reasoning_recap") => Part::Answer {
                text: Vec::new(),
                reasoning: notes.into_iter().chain(texts).filter(|t| !t.trim().is_empty()).collect(),
                model: model_of(m),
                time,
            },
            ("assistant", _) if recipient(m) == "all" => {
                let text = with_notes(joined, &notes);
                Part::Answer {
                    text: (!text.trim().is_empty()).then_some(text).into_iter().collect(),
                    reasoning: Vec::new(),
                    model: model_of(m),
                    time,
                }
            }
            // A tool call (code for the interpreter, a search) or a tool's output.
            (role, _) => {
                let tool = if role == "assistant" {
                    recipient(m).to_owned()
                } else {
                    m.pointer("/author/name").and_then(Value::as_str).unwrap_or("a tool").to_owned()
                };
                let what = if role == "assistant" {
                    format!("a call to {tool}")
                } else {
                    format!("the output of {tool}")
                };
                if hidden && joined.trim().is_empty() {
                    return Part::Nothing;
                }
                self.skip(
                    &what,
                    "tool calls and their output are not imported; a note stands in their place",
                );
                Part::Answer {
                    text: vec![format!("[not imported: {what}]")],
                    reasoning: Vec::new(),
                    model: None,
                    time,
                }
            }
        }
    }

    /// The text parts of a message's content, and a note for each part that is not text.
    fn texts(&mut self, id: &str, content: &Value) -> (Vec<String>, Vec<String>) {
        let mut texts = Vec::new();
        let mut notes = Vec::new();
        let string = |k: &str| content.get(k).and_then(Value::as_str).map(str::to_owned);
        if let Some(parts) = content.get("parts").and_then(Value::as_array) {
            for part in parts {
                match part {
                    Value::String(s) => texts.push(s.clone()),
                    Value::Object(o) => {
                        if let Some(t) = o.get("text").and_then(Value::as_str) {
                            texts.push(t.to_owned());
                            continue;
                        }
                        let kind = o.get("content_type").and_then(Value::as_str).unwrap_or("an attachment");
                        let what = if kind.contains("image") {
                            let size = match (
                                o.get("width").and_then(Value::as_u64),
                                o.get("height").and_then(Value::as_u64),
                            ) {
                                (Some(w), Some(h)) => format!(", {w}×{h}"),
                                _ => String::new(),
                            };
                            format!("an image{size}")
                        } else if kind.contains("audio") {
                            "a voice recording".to_owned()
                        } else {
                            format!("a part of type {kind}")
                        };
                        self.skip(
                            &format!("{what} (node {id})"),
                            "only text is imported; a note stands in its place",
                        );
                        notes.push(format!("[not imported: {what}]"));
                    }
                    Value::Null => {}
                    other => texts.push(other.to_string()),
                }
            }
        }
        for key in ["text", "result"] {
            if let Some(t) = string(key) {
                texts.push(t);
            }
        }
        if let Some(thoughts) = content.get("thoughts").and_then(Value::as_array) {
            for t in thoughts {
                let summary = t.get("summary").and_then(Value::as_str).unwrap_or("");
                let body = t.get("content").and_then(Value::as_str).unwrap_or("");
                texts.push(format!("{summary}\n{body}").trim().to_owned());
            }
        }
        if let Some(recap) = content.get("content").and_then(Value::as_str) {
            texts.push(recap.to_owned());
        }
        (texts, notes)
    }

    fn skip(&mut self, what: &str, reason: &str) {
        super::skip(&mut self.skipped, &mut self.skipped_unlisted, what.to_owned(), reason);
    }
}

enum Part {
    Nothing,
    User { text: String, time: Option<DateTime<Utc>> },
    Answer { text: Vec<String>, reasoning: Vec<String>, model: Option<String>, time: Option<DateTime<Utc>> },
}

/// Ends the answer being gathered (if any) as an event; its nodes end at its seq.
/// `at`: the session's first seq, and the time of an answer whose nodes have none.
fn close<'a>(
    events: &mut Vec<PlannedEvent>,
    answer: &mut Option<Answer>,
    (first_seq, fallback_time): (i64, Option<DateTime<Utc>>),
    pending: &mut Vec<&'a str>,
    seq_of: &mut HashMap<&'a str, i64>,
) {
    let Some(a) = answer.take() else { return };
    let seq = first_seq + events.len() as i64 + 1;
    // Reasoning alone (no text) is still an answer the user saw being thought.
    let text = a.text.join("\n\n");
    let imported = imported(&a.source_id, a.time.or(fallback_time));
    events.push(PlannedEvent {
        seq,
        kind: EventKind::AssistantTurn,
        payload: answer_payload(a.reasoning, text, a.model, imported),
        source_id: a.source_id,
        refers: None,
    });
    for id in pending.drain(..) {
        seq_of.insert(id, seq);
    }
}

fn imported(id: &str, time: Option<DateTime<Utc>>) -> Imported {
    Imported { source: SOURCE.to_owned(), id: id.to_owned(), created_at: time }
}

fn with_notes(text: String, notes: &[String]) -> String {
    if notes.is_empty() {
        return text;
    }
    let notes = notes.join("\n");
    if text.trim().is_empty() {
        notes
    } else {
        format!("{text}\n\n{notes}")
    }
}

fn recipient(m: &Value) -> &str {
    m.get("recipient").and_then(Value::as_str).unwrap_or("all")
}

fn model_of(m: &Value) -> Option<String> {
    m.pointer("/metadata/model_slug").and_then(Value::as_str).map(str::to_owned)
}

fn time_of(m: Option<&Value>) -> Option<DateTime<Utc>> {
    epoch(m?.get("create_time"))
}

/// Seconds since the epoch (ChatGPT writes them as floats), or an RFC 3339 text.
fn epoch(v: Option<&Value>) -> Option<DateTime<Utc>> {
    match v? {
        Value::Number(n) => {
            let secs = n.as_f64()?;
            if !(0.0..1e11).contains(&secs) {
                return None;
            }
            DateTime::from_timestamp_micros((secs * 1e6).round() as i64)
        }
        Value::String(s) => s.parse().ok().filter(|t: &DateTime<Utc>| YEARS.contains(&t.year())),
        _ => None,
    }
}

/// An id for a conversation the export gives none: a hash of its content (as JSON text,
/// hashed as it is written out).
pub(crate) fn content_id(v: &Value) -> String {
    use sha2::{Digest, Sha256};
    struct Hashing(Sha256);
    impl std::io::Write for Hashing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut hashing = Hashing(Sha256::new());
    // Writing a JSON value to a hasher cannot fail.
    let _ = serde_json::to_writer(&mut hashing, v);
    let digest = hashing.0.finalize();
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(
        id: &str,
        parent: Option<&str>,
        children: &[&str],
        role: &str,
        text: &str,
        t: f64,
    ) -> (String, Value) {
        let message = if role.is_empty() {
            Value::Null
        } else {
            json!({"id": id, "author": {"role": role}, "create_time": t,
                   "content": {"content_type": "text", "parts": [text]},
                   "metadata": {"model_slug": "gpt-4o"}})
        };
        (id.to_owned(), json!({"id": id, "parent": parent, "children": children, "message": message}))
    }

    fn conv(nodes: Vec<(String, Value)>, current: &str) -> Value {
        let mapping: serde_json::Map<String, Value> = nodes.into_iter().collect();
        json!({"conversation_id": "c1", "title": "T", "create_time": 1.7e9, "mapping": mapping, "current_node": current})
    }

    fn texts(s: &PlannedSession) -> Vec<(i64, String)> {
        s.events
            .iter()
            .map(|e| {
                let payload = e.payload.value();
                let text = payload.get("text").or_else(|| payload.pointer("/llm/message/content"));
                (e.seq, text.and_then(Value::as_str).unwrap_or("").to_owned())
            })
            .collect()
    }

    #[test]
    fn the_current_path_is_the_session_and_other_branches_fork_at_their_branch_point() {
        // root → u1 → a1 → u2 → {a2 (regenerated), a2b (current)}; a1 → u2x (an edit) → a3.
        let c = conv(
            vec![
                node("root", None, &["u1"], "", "", 0.0),
                node("u1", Some("root"), &["a1"], "user", "hello", 1.7e9),
                node("a1", Some("u1"), &["u2", "u2x"], "assistant", "hi", 1.7e9 + 1.0),
                node("u2", Some("a1"), &["a2", "a2b"], "user", "tell me", 1.7e9 + 2.0),
                node("a2", Some("u2"), &[], "assistant", "first try", 1.7e9 + 3.0),
                node("a2b", Some("u2"), &[], "assistant", "second try", 1.7e9 + 4.0),
                node("u2x", Some("a1"), &["a3"], "user", "edited", 1.7e9 + 5.0),
                node("a3", Some("u2x"), &[], "assistant", "to the edit", 1.7e9 + 6.0),
            ],
            "a2b",
        );
        let c = conversation(&c).unwrap();
        assert_eq!(c.sessions.len(), 3);
        let main = &c.sessions[0];
        assert_eq!(
            texts(main),
            [(2, "hello".into()), (3, "hi".into()), (4, "tell me".into()), (5, "second try".into())]
        );
        let regenerated = &c.sessions[1];
        assert_eq!(regenerated.fork, Some(PlannedFork { parent: 0, through_seq: 4 }));
        assert_eq!(texts(regenerated), [(6, "first try".into())]);
        let edited = &c.sessions[2];
        assert_eq!(edited.fork, Some(PlannedFork { parent: 0, through_seq: 3 }));
        assert_eq!(texts(edited), [(5, "edited".into()), (6, "to the edit".into())]);
        assert_eq!(main.events[1].payload.value()["model"], "gpt-4o");
        assert_eq!(main.events[0].payload.value()["imported"]["created_at"], "2023-11-14T22:13:20Z");
        assert!(c.skipped.is_empty());
    }

    #[test]
    fn children_keep_the_order_their_parent_lists_then_their_time() {
        // u1 lists c3 then c1; c0 and c2 name it as their parent without being listed.
        let c = conv(
            vec![
                node("root", None, &["u1"], "", "", 0.0),
                node("u1", Some("root"), &["c3", "ghost", "c1", "c3"], "user", "q", 1.0),
                node("c0", Some("u1"), &[], "assistant", "zero", 2.0),
                node("c1", Some("u1"), &[], "assistant", "one", 5.0),
                node("c2", Some("u1"), &[], "assistant", "two", 3.0),
                node("c3", Some("u1"), &[], "assistant", "three", 4.0),
            ],
            "c1",
        );
        let c = conversation(&c).unwrap();
        let keys: Vec<&str> = c.sessions.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["c1", "c3", "c0", "c2"]);
    }

    #[test]
    fn a_node_with_more_children_than_a_conversation_may_have_branches_is_refused() {
        // 20,000 regenerated answers of one question (each would be a fork), listed newest
        // first: refused before they are ordered.
        let children: Vec<String> = (0..20_000).rev().map(|i| format!("a{i}")).collect();
        let listed: Vec<&str> = children.iter().map(String::as_str).collect();
        let mut nodes = vec![
            node("root", None, &["u1"], "", "", 0.0),
            node("u1", Some("root"), &listed, "user", "q", 1.0),
        ];
        nodes.extend(children.iter().map(|id| node(id, Some("u1"), &[], "assistant", "a", 2.0)));
        let Err(err) = conversation(&conv(nodes, "a0")) else { panic!("20,000 branches were taken") };
        assert!(err.reason.contains("more than 1000 branches"), "{err:?}");
    }

    #[test]
    fn a_conversation_lists_a_hundred_skipped_parts_and_counts_the_rest() {
        let mut c = conv(
            vec![node("root", None, &["u1"], "", "", 0.0), node("u1", Some("root"), &[], "user", "x", 1.0)],
            "u1",
        );
        let parts: Vec<Value> = (0..150).map(|_| json!({"content_type": "image_asset_pointer"})).collect();
        c["mapping"]["u1"]["message"]["content"] = json!({"content_type": "multimodal_text", "parts": parts});
        let c = conversation(&c).unwrap();
        assert_eq!((c.skipped.len(), c.skipped_unlisted), (super::super::MAX_SKIPPED_LISTED, 50));
    }

    #[test]
    fn cycles_and_forests_are_refused() {
        let c = conv(
            vec![
                node("root", None, &["a"], "", "", 0.0),
                node("a", Some("b"), &["b"], "user", "x", 1.0),
                node("b", Some("a"), &["a"], "assistant", "y", 2.0),
            ],
            "b",
        );
        let err = conversation(&c).unwrap_err();
        assert!(err.reason.contains("cycle"), "{err:?}");
        assert_eq!(err.conversation, "T");
        let c = conv(
            vec![node("r1", None, &[], "user", "x", 1.0), node("r2", None, &[], "user", "y", 1.0)],
            "r1",
        );
        assert!(conversation(&c).unwrap_err().reason.contains("2 trees"));
        assert!(conversation(&json!({"title": "x"})).unwrap_err().reason.contains("mapping"));
    }

    #[test]
    fn what_is_not_text_leaves_a_note() {
        let mut c = conv(
            vec![
                node("root", None, &["u1"], "", "", 0.0),
                node("u1", Some("root"), &["code"], "user", "plot this", 1.0),
                node("code", Some("u1"), &["out"], "assistant", "print(1)", 2.0),
                node("out", Some("code"), &["a1"], "tool", "1", 3.0),
                node("a1", Some("out"), &[], "assistant", "Done.", 4.0),
            ],
            "a1",
        );
        c["mapping"]["code"]["message"]["recipient"] = json!("python");
        c["mapping"]["out"]["message"]["author"]["name"] = json!("python");
        c["mapping"]["u1"]["message"]["content"] = json!({"content_type": "multimodal_text", "parts": [
            {"content_type": "image_asset_pointer", "asset_pointer": "file-service://x", "width": 640, "height": 480},
            "plot this"]});
        let c = conversation(&c).unwrap();
        let main = &c.sessions[0];
        assert_eq!(
            texts(main),
            [
                (2, "plot this\n\n[not imported: an image, 640×480]".into()),
                (
                    3,
                    "[not imported: a call to python]\n\n[not imported: the output of python]\n\nDone."
                        .into()
                )
            ]
        );
        assert_eq!(c.skipped.len(), 3, "{:?}", c.skipped);
    }
}
