//! Which branch a Chat Completions request continues (DESIGN §13). A session header names a
//! family of branches (a session and its forks); the request's messages are compared with
//! each branch's conversation — its user messages and answers with text, a stopped or
//! interrupted answer's partial included (what the client holds a copy of), as the
//! transcript shows them — through a hash chain: a message's link hashes the link before
//! it, its role and its text, so one comparison of two links compares the whole
//! conversations up to them.
//!
//! The chains live here, in each ingress copy's memory, and are kept from the log: a
//! request reads only what a branch's log gained since the copy last looked (the previous
//! turn, in a conversation that goes on) — never a branch's whole history, except once
//! when a copy first meets a branch. A branch's links before its last user message are
//! settled (nothing later changes whether they show); the links from it on are read again
//! while the log grows (a checkpoint there may still be replaced by its answer).

use std::collections::HashMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use sha2::{Digest as _, Sha256};
use turnlog_core::events::EventBody;
use turnlog_core::ids::{Owner, SessionId};
use turnlog_core::ui_transcript::{ui_transcript, ItemKind};
use turnlog_runtime::read::{self, SessionRow, StoredEvent};

use crate::error::ApiError;

/// A SHA-256: of a message's text, or a link of a chain (the previous link, the role and
/// the text's hash).
pub type Hash = [u8; 32];

/// Links the chains of one copy keep at most (about 64 bytes each); past it the branches
/// used longest ago are dropped (and read again when they are next used).
const MAX_LINKS: usize = 1_000_000;

/// The most line starts of a stored user message whose rest is remembered (see
/// [`Link::ends_with`]).
const MAX_SUFFIXES: usize = 64;

/// A message of a conversation: where it is in the branch log, and its link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub seq: i64,
    pub user: bool,
    pub hash: Hash,
    /// For a user message of several lines: the first 8 bytes of the text hash of what
    /// follows each of its last line breaks.
    pub suffixes: Option<std::sync::Arc<[u64]>>,
}

impl Link {
    fn new(prev: &Hash, seq: i64, user: bool, text: &str) -> Self {
        let suffixes = (user && text.contains('\n')).then(|| {
            let starts = text.match_indices('\n').map(|(i, _)| i + 1).collect::<Vec<_>>();
            let from = starts.len().saturating_sub(MAX_SUFFIXES);
            starts[from..].iter().map(|&i| short(&text_hash(&text[i..]))).collect()
        });
        Self { seq, user, hash: link(prev, user, &text_hash(text)), suffixes }
    }

    /// Whether this stored user message ends, after one of its line breaks, with a message
    /// of text hash `text`: what a front end resends of a message it sent with retrieved
    /// context put before it (Open WebUI's retrieval: `RAG_TEMPLATE`, a line break, the
    /// user's own text), keeping the user's own text in its history.
    fn ends_with(&self, text: &Hash) -> bool {
        self.suffixes.as_ref().is_some_and(|s| s.contains(&short(text)))
    }
}

fn short(h: &Hash) -> u64 {
    u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

/// A message's text hash. Surrounding whitespace does not count: front ends trim what
/// they resend.
pub fn text_hash(text: &str) -> Hash {
    Sha256::digest(text.trim().as_bytes()).into()
}

/// The link after `prev` for a message whose text hashes to `text`.
pub fn link(prev: &Hash, user: bool, text: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update(prev);
    h.update([u8::from(user)]);
    h.update(text);
    h.finalize().into()
}

/// A request's message as [`plan`] compares it: its role and its text hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    pub user: bool,
    pub text: Hash,
}

/// The request's messages (`(is_user, text)`, in order) as [`Message`]s.
pub fn request_messages<'a>(messages: impl IntoIterator<Item = (bool, &'a str)>) -> Vec<Message> {
    messages.into_iter().map(|(user, text)| Message { user, text: text_hash(text) }).collect()
}

/// A branch of the family as [`plan`] weighs it.
#[derive(Debug, Clone)]
pub struct Branch {
    pub row: SessionRow,
    pub links: Vec<Link>,
    /// The session the header named itself (it wins a tie).
    pub named: bool,
}

/// What a request does to its family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Continue branch `branch`: append the request's messages from `from` on, the last one
    /// running the turn; `from` = the request's length runs the branch's last message again
    /// (it has no answer: DESIGN §5.7).
    Continue { branch: usize, from: usize },
    /// Fork branch `branch` through seq `through` and continue the fork from message
    /// `from`; `from` = the request's length regenerates the answer to the fork's last
    /// message.
    Fork { branch: usize, through: i64, from: usize },
    /// A request unlike every branch from its first message, not streamed: a front end's
    /// task prompt (a title, tags) sent with the chat's id. Passed through, nothing stored.
    PassThrough,
}

/// How many leading messages `links` and `request` share: equal ones, and user messages
/// the branch stored with context before the request's copy ([`Link::ends_with`]) — not
/// the request's last message, which is what an edit replaces.
fn shared(links: &[Link], request: &[Message]) -> usize {
    let mut prev = [0u8; 32];
    for (i, (l, m)) in links.iter().zip(request).enumerate() {
        let answered = i + 1 < request.len();
        let same =
            link(&prev, m.user, &m.text) == l.hash || (answered && m.user && l.user && l.ends_with(&m.text));
        if !same {
            return i;
        }
        prev = l.hash;
    }
    links.len().min(request.len())
}

/// The branch a request continues, or where it forks (DESIGN §13): the branch whose whole
/// conversation is the longest prefix of the request's; else the one sharing the longest
/// prefix with it, forked where they part. Ties go to the branch the header named, then to
/// the one used last. `request` is not empty and ends with a user message.
pub fn plan(branches: &[Branch], request: &[Message], streamed: bool) -> Plan {
    let n = request.len();
    let rank = |i: usize| {
        let b = &branches[i];
        (b.named, b.row.updated_at, b.row.last_seq)
    };
    let best = |candidates: Vec<(usize, usize)>| {
        candidates.into_iter().max_by(|(i, a), (j, b)| a.cmp(b).then_with(|| rank(*i).cmp(&rank(*j))))
    };
    let shares: Vec<(usize, usize)> =
        branches.iter().enumerate().map(|(i, b)| (i, shared(&b.links, request))).collect();
    let whole = shares.iter().copied().filter(|(i, k)| *k == branches[*i].links.len()).collect();
    if let Some((branch, from)) = best(whole) {
        return Plan::Continue { branch, from };
    }
    let Some((branch, k)) = best(shares) else {
        return Plan::PassThrough;
    };
    if k == 0 && !streamed {
        return Plan::PassThrough;
    }
    let c = &branches[branch].links;
    if k == n {
        // The request is a prefix of the branch ending at one of its user messages: its
        // answer again, in a fork after that message.
        return Plan::Fork { branch, through: c[n - 1].seq, from: n };
    }
    // They part at c[k]: a user message is replaced after everything before it (the turn
    // before it has ended); an answer right after the message before it — its question, or
    // a final partial — so that no checkpoint of the answer's attempt comes along.
    let through = match (c[k].user, k.checked_sub(1)) {
        (false, Some(before)) => c[before].seq,
        _ => c[k].seq - 1,
    };
    Plan::Fork { branch, through, from: k }
}

/// A branch's chain as this copy holds it.
#[derive(Debug)]
struct Cached {
    /// The session's creation: an id used again after a delete is another session.
    created_at: DateTime<Utc>,
    /// Links through `settled_through`, which nothing later changes.
    settled: Vec<Link>,
    settled_through: i64,
    /// Links after it, as of `read_to`, the last seq read.
    tail: Vec<Link>,
    read_to: i64,
    used: u64,
}

impl Cached {
    /// What the entry counts against the cap: its links, and one for the entry itself.
    fn cost(&self) -> usize {
        1 + self.settled.len() + self.tail.len()
    }
}

/// The chains of the branches this copy has met.
#[derive(Debug, Default)]
pub struct Chains {
    inner: Mutex<Store>,
}

#[derive(Debug)]
struct Store {
    map: HashMap<SessionId, Cached>,
    links: usize,
    clock: u64,
    /// At most this many links ([`MAX_LINKS`]).
    cap: usize,
}

impl Default for Store {
    fn default() -> Self {
        Self { map: HashMap::new(), links: 0, clock: 0, cap: MAX_LINKS }
    }
}

impl Store {
    fn touch(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Where a branch's chain stands before reading its log: its own cached chain when it
    /// still describes the session, else its parent's settled links up to the fork point.
    fn start(&mut self, row: &SessionRow) -> Start {
        let now = self.touch();
        if let Some(c) = self.map.get_mut(&row.id).filter(|c| c.created_at == row.created_at) {
            c.used = now;
            if c.read_to >= row.last_seq {
                return Start::Current([c.settled.as_slice(), c.tail.as_slice()].concat());
            }
            return Start::From(c.settled.clone(), c.settled_through);
        }
        // A fork takes its parent's settled links before the last user message at or below
        // its fork point, and reads its own branch from that message on: a checkpoint the
        // fork inherits may show there though its answer (past the fork point) hid it in
        // the parent.
        let seeded = row.forked_from.zip(row.forked_through).and_then(|(parent, through)| {
            let p = self.map.get(&SessionId(parent))?;
            let upto = through.min(p.settled_through);
            let turn = p.settled.iter().rev().find(|l| l.user && l.seq <= upto)?.seq;
            Some((p.settled.iter().filter(|l| l.seq < turn).cloned().collect(), turn - 1))
        });
        let (links, through) = seeded.unwrap_or((Vec::new(), 0));
        Start::From(links, through)
    }

    fn put(&mut self, id: SessionId, cached: Cached) {
        self.links += cached.cost();
        if let Some(old) = self.map.insert(id, cached) {
            self.links -= old.cost();
        }
        if self.links > self.cap {
            let mut by_use: Vec<(u64, SessionId)> = self.map.iter().map(|(id, c)| (c.used, *id)).collect();
            by_use.sort_unstable();
            for (_, id) in by_use {
                if self.links <= self.cap * 3 / 4 {
                    break;
                }
                if let Some(c) = self.map.remove(&id) {
                    self.links -= c.cost();
                }
            }
        }
    }
}

enum Start {
    /// Nothing new in the log: the whole chain.
    Current(Vec<Link>),
    /// The settled links, and the seq after which the log must be read.
    From(Vec<Link>, i64),
}

impl Chains {
    /// The conversation of branch `row` as links, reading only what its log gained since
    /// this copy last looked.
    pub async fn links(
        &self,
        pool: &sqlx::PgPool,
        owner: &Owner,
        row: &SessionRow,
    ) -> Result<Vec<Link>, ApiError> {
        let (settled, through) = match self.lock().start(row) {
            Start::Current(links) => return Ok(links),
            Start::From(settled, through) => (settled, through),
        };
        let events = read::events_page(pool, owner, row.id, through, i64::MAX)
            .await?
            .ok_or_else(ApiError::session_not_found)?;
        let read_to = events.last().map_or(row.last_seq, |e| e.seq.max(row.last_seq));
        let (new_settled, settled_through, tail) = extend(settled, through, &events)?;
        let links = [new_settled.as_slice(), tail.as_slice()].concat();
        let mut store = self.lock();
        let used = store.touch();
        let cached =
            Cached { created_at: row.created_at, settled: new_settled, settled_through, tail, read_to, used };
        store.put(row.id, cached);
        Ok(links)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `settled` (through seq `through`) extended by the branch log's events after it: the new
/// settled links and where they end (before the last user message read), and the links
/// from there on.
fn extend(
    mut settled: Vec<Link>,
    through: i64,
    events: &[StoredEvent],
) -> Result<(Vec<Link>, i64, Vec<Link>), ApiError> {
    let events =
        events.iter().map(StoredEvent::decode).collect::<Result<Vec<_>, _>>().map_err(ApiError::internal)?;
    let last_user = events.iter().rev().find(|e| matches!(e.body, EventBody::UserMessage(_))).map(|e| e.seq);
    // Only a final checkpoint (stopped, interrupted) is an answer a client holds a copy of;
    // a running turn's, a failed or crashed one's is not, so its message stays unanswered.
    let provisional: std::collections::HashSet<i64> = events
        .iter()
        .filter(|e| matches!(&e.body, EventBody::PendingState(p) if p.reason.is_none()))
        .map(|e| e.seq)
        .collect();
    let mut prev = settled.last().map_or([0u8; 32], |l| l.hash);
    let mut tail = Vec::new();
    for item in ui_transcript(&events) {
        let user = match item.kind {
            ItemKind::User => true,
            ItemKind::Assistant => false,
            ItemKind::Interrupted if !provisional.contains(&item.seq) => false,
            _ => continue,
        };
        let text = item.text.as_deref().unwrap_or_default();
        if text.trim().is_empty() {
            continue;
        }
        let l = Link::new(&prev, item.seq, user, text);
        prev = l.hash;
        if last_user.is_some_and(|u| item.seq < u) {
            settled.push(l);
        } else {
            tail.push(l);
        }
    }
    let settled_through = last_user.map_or(through, |u| u - 1);
    Ok((settled, settled_through, tail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnlog_core::ids::Owner;

    fn branch(id: u128, messages: &[(bool, &str, i64)], updated: i64) -> Branch {
        let mut row = SessionRow::new(
            SessionId(uuid::Uuid::from_u128(id)),
            Owner::parse("o").unwrap(),
            None,
            DateTime::from_timestamp(updated, 0).unwrap(),
        );
        row.last_seq = messages.last().map_or(1, |m| m.2);
        let mut prev = [0u8; 32];
        let links = messages
            .iter()
            .map(|(user, text, seq)| {
                let l = Link::new(&prev, *seq, *user, text);
                prev = l.hash;
                l
            })
            .collect();
        Branch { row, links, named: false }
    }

    fn req(messages: &[(bool, &str)]) -> Vec<Message> {
        request_messages(messages.iter().copied())
    }

    /// The chain of a conversation's messages.
    fn chain(messages: &[(bool, &str)]) -> Vec<Hash> {
        let mut prev = [0u8; 32];
        messages
            .iter()
            .map(|(user, text)| {
                prev = link(&prev, *user, &text_hash(text));
                prev
            })
            .collect()
    }

    const U: bool = true;
    const A: bool = false;

    #[test]
    fn a_conversation_that_goes_on_continues_its_branch_with_what_is_new() {
        let root = branch(1, &[(U, "hi", 2), (A, "hello", 5), (U, "how?", 7), (A, "so", 9)], 10);
        let request = req(&[(U, "hi"), (A, " hello\n"), (U, "how?"), (A, "so"), (U, "and then?")]);
        assert_eq!(plan(std::slice::from_ref(&root), &request, true), Plan::Continue { branch: 0, from: 4 });
        // Two new messages (one an answer from elsewhere) are both appended.
        let request = req(&[(U, "hi"), (A, "hello"), (U, "how?"), (A, "so"), (U, "x"), (A, "y"), (U, "z")]);
        assert_eq!(plan(std::slice::from_ref(&root), &request, false), Plan::Continue { branch: 0, from: 4 });
        // The same conversation ending at an unanswered message runs it again.
        let waiting = branch(2, &[(U, "hi", 2)], 10);
        assert_eq!(plan(&[waiting], &req(&[(U, "hi")]), true), Plan::Continue { branch: 0, from: 1 });
        // An empty branch is a prefix of everything.
        let empty = branch(3, &[], 10);
        assert_eq!(plan(&[empty], &req(&[(U, "hi")]), false), Plan::Continue { branch: 0, from: 0 });
    }

    #[test]
    fn an_edit_forks_before_the_edited_message_and_a_regenerate_after_its_question() {
        let root = branch(1, &[(U, "a", 2), (A, "b", 5), (U, "c", 7), (A, "d", 9)], 10);
        let edit = req(&[(U, "a"), (A, "b"), (U, "C!")]);
        assert_eq!(
            plan(std::slice::from_ref(&root), &edit, true),
            Plan::Fork { branch: 0, through: 6, from: 2 }
        );
        let regenerate = req(&[(U, "a"), (A, "b"), (U, "c")]);
        assert_eq!(
            plan(std::slice::from_ref(&root), &regenerate, true),
            Plan::Fork { branch: 0, through: 7, from: 3 }
        );
        // A client's other copy of an answer forks after the question it answered.
        let other = req(&[(U, "a"), (A, "b"), (U, "c"), (A, "d, cut sh"), (U, "e")]);
        assert_eq!(
            plan(std::slice::from_ref(&root), &other, true),
            Plan::Fork { branch: 0, through: 7, from: 3 }
        );
        // Editing the very first message forks before it (streamed)...
        assert_eq!(
            plan(std::slice::from_ref(&root), &req(&[(U, "z")]), true),
            Plan::Fork { branch: 0, through: 1, from: 0 }
        );
        // ...but a one-off prompt that is not streamed (a title task) is passed through.
        assert_eq!(plan(&[root], &req(&[(U, "Generate a title")]), false), Plan::PassThrough);
    }

    #[test]
    fn a_message_stored_with_retrieved_context_before_it_matches_the_clients_own_text() {
        // Open WebUI sent "context…\nquestion" and keeps "question" in its history.
        let sent = "### Task: answer with the context\n<context>Lisbon has trams.</context>\nWhat is there?";
        let root = branch(1, &[(U, sent, 2), (A, "Trams.", 5), (U, "Cost?\nIn euros.", 7), (A, "3", 9)], 10);
        let goes_on =
            req(&[(U, "What is there?"), (A, "Trams."), (U, "Cost?\nIn euros."), (A, "3"), (U, "Ok")]);
        assert_eq!(plan(std::slice::from_ref(&root), &goes_on, true), Plan::Continue { branch: 0, from: 4 });
        // Only what follows a line break counts, and only for user messages.
        let other = req(&[(U, "there?"), (A, "Trams."), (U, "x")]);
        assert_eq!(
            plan(std::slice::from_ref(&root), &other, true),
            Plan::Fork { branch: 0, through: 1, from: 0 }
        );
        // An edit to the last line of a message is an edit (the request's last message).
        let edited = req(&[(U, "What is there?"), (A, "Trams."), (U, "In euros.")]);
        assert_eq!(plan(&[root], &edited, true), Plan::Fork { branch: 0, through: 6, from: 2 });
    }

    #[test]
    fn the_longest_branch_that_is_a_prefix_wins_then_the_named_then_the_latest() {
        let root = branch(1, &[(U, "a", 2), (A, "b", 5), (U, "c", 7), (A, "d", 9)], 10);
        let fork = branch(2, &[(U, "a", 2), (A, "b", 5), (U, "C", 11), (A, "D", 13)], 20);
        let back = req(&[(U, "a"), (A, "b"), (U, "c"), (A, "d"), (U, "e")]);
        let branches = [root.clone(), fork.clone()];
        assert_eq!(plan(&branches, &back, true), Plan::Continue { branch: 0, from: 4 });
        let on = req(&[(U, "a"), (A, "b"), (U, "C"), (A, "D"), (U, "E")]);
        assert_eq!(plan(&branches, &on, true), Plan::Continue { branch: 1, from: 4 });
        // Identical branches: the one used last, unless the header named the other.
        let twin = branch(3, &[(U, "a", 2), (A, "b", 5), (U, "c", 7), (A, "d", 15)], 30);
        let mut twins = [root, twin];
        assert_eq!(plan(&twins, &back, true), Plan::Continue { branch: 1, from: 4 });
        twins[0].named = true;
        assert_eq!(plan(&twins, &back, true), Plan::Continue { branch: 0, from: 4 });
    }

    #[test]
    fn the_store_drops_the_branches_used_longest_ago_past_its_cap() {
        let mut store = Store { cap: 12, ..Store::default() };
        let row = |n: u128| branch(n, &[(U, "a", 2), (A, "b", 3), (U, "c", 4)], 10).row;
        let cached = |row: &SessionRow, links: usize, used: u64| Cached {
            created_at: row.created_at,
            settled: vec![Link { seq: 2, user: true, hash: [0; 32], suffixes: None }; links],
            settled_through: 3,
            tail: Vec::new(),
            read_to: row.last_seq,
            used,
        };
        let (a, b, c) = (row(1), row(2), row(3));
        store.put(a.id, cached(&a, 4, 1));
        store.put(b.id, cached(&b, 4, 2));
        // Replacing an entry counts only its new links.
        store.put(b.id, cached(&b, 5, 3));
        assert_eq!(store.links, 11);
        store.put(c.id, cached(&c, 3, 4));
        // 15 > 12: the least recently used go (a, then b) until at most 3/4 of the cap is left.
        assert!(store.links <= 9, "{}", store.links);
        assert!(!store.map.contains_key(&a.id) && store.map.contains_key(&c.id));
        assert_eq!(store.links, store.map.values().map(Cached::cost).sum::<usize>());
        // A cached branch whose log has not grown is served whole; one re-created after a
        // delete (another created_at) is not.
        assert!(matches!(store.start(&c), Start::Current(links) if links.len() == 3));
        let mut again = c.clone();
        again.created_at += chrono::Duration::seconds(1);
        assert!(matches!(store.start(&again), Start::From(links, 0) if links.is_empty()));
        // A fork through seq 5 (before the answer at 6) reads its branch from "c", the last
        // user message at or below its fork point.
        let mut parent = c.clone();
        parent.id = SessionId(uuid::Uuid::from_u128(9));
        let mut seeded = cached(&parent, 0, 5);
        seeded.settled = branch(9, &[(U, "a", 2), (A, "b", 3), (U, "c", 4), (A, "d", 6)], 10).links;
        seeded.settled_through = 7;
        store.put(parent.id, seeded);
        let mut fork = row(5);
        fork.forked_from = Some(parent.id.0);
        fork.forked_through = Some(5);
        assert!(matches!(store.start(&fork), Start::From(links, 3) if links.len() == 2));
    }

    #[test]
    fn settled_links_end_before_the_last_user_message() {
        use turnlog_core::events::{AssistantTurn, PendingState, UserMessage};
        let ev = |seq: i64, body: EventBody| StoredEvent {
            session_id: uuid::Uuid::nil(),
            seq,
            event_id: uuid::Uuid::now_v7(),
            kind: body.kind().into(),
            payload: body.to_payload(),
            tokens: 0,
            created_at: Utc::now(),
        };
        let user = |t: &str| EventBody::UserMessage(UserMessage { text: t.into(), ..Default::default() });
        let answer = |t: &str| {
            let mut a = AssistantTurn::default();
            a.ui.blocks.push(turnlog_core::events::Block {
                kind: turnlog_core::events::BlockType::Text,
                text: Some(t.into()),
                meta: None,
            });
            EventBody::AssistantTurn(a)
        };
        let checkpoint = EventBody::PendingState(PendingState {
            partial: "par".into(),
            attempt_id: Some("x".into()),
            ..Default::default()
        });
        let stopped = EventBody::PendingState(PendingState {
            partial: "stop".into(),
            attempt_id: Some("y".into()),
            reason: Some(turnlog_core::events::PendingReason::Stopped),
            ..Default::default()
        });
        let events = [ev(2, user("a")), ev(3, answer("b")), ev(4, user("c")), ev(5, checkpoint)];
        let (settled, through, tail) = extend(Vec::new(), 1, &events).unwrap();
        // A running answer's checkpoint is no answer (nor a failed or crashed one's): "c"
        // is still unanswered.
        assert_eq!((settled.len(), through, tail.len()), (2, 3, 1));
        // A stopped answer's partial is, as the client's copy of it.
        let (_, _, tail) = extend(settled.clone(), through, &[ev(4, user("c")), ev(5, stopped)]).unwrap();
        assert_eq!(tail[1].hash, link(&tail[0].hash, false, &text_hash("stop")));
        let more = [ev(4, user("c")), ev(6, answer("partial and more"))];
        let (settled, _, tail) = extend(settled, through, &more).unwrap();
        assert_eq!(settled.len(), 2);
        let links: Vec<Hash> = settled.iter().chain(&tail).map(|l| l.hash).collect();
        assert_eq!(links, chain(&[(U, "a"), (A, "b"), (U, "c"), (A, "partial and more")]));
    }
}
