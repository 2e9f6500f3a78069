//! Every stream, bucket and subject name of the bus, derived from `TURNLOG_BUS_PREFIX`
//! (DESIGN §6), and the partition a session's appends go to.

use turnlog_core::ids::{AttemptId, SessionId};

use super::BusError;

/// Every stream, bucket and subject name, derived from the bus prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusNames {
    prefix: String,
    upper: String,
}

impl BusNames {
    pub fn new(prefix: &str) -> Result<Self, BusError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(BusError::BadPrefix(prefix.chars().take(40).collect()));
        }
        Ok(Self { prefix: prefix.to_owned(), upper: prefix.to_ascii_uppercase() })
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn append_stream(&self) -> String {
        format!("{}_APPEND", self.upper)
    }
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.upper)
    }
    pub fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.upper)
    }
    pub fn turns_bucket(&self) -> String {
        format!("{}_TURNS", self.upper)
    }
    /// The server tools' calls (DESIGN §14), a work queue.
    pub fn tool_calls_stream(&self) -> String {
        format!("{}_TOOL_CALLS", self.upper)
    }
    pub fn tool_catalog_bucket(&self) -> String {
        format!("{}_TOOL_CATALOG", self.upper)
    }
    pub fn tool_claims_bucket(&self) -> String {
        format!("{}_TOOL_CLAIMS", self.upper)
    }
    pub fn tool_call_subject(&self, session: SessionId) -> String {
        format!("{}.tools.call.{session}", self.prefix)
    }
    /// Heard by the tools worker's copy running the call appended with `event_id`.
    pub fn tool_cancel_subject(&self, event_id: uuid::Uuid) -> String {
        format!("{}.tools.cancel.{event_id}", self.prefix)
    }
    pub fn append_subject(&self, partition: u32, session: SessionId) -> String {
        format!("{}.append.{partition}.{session}", self.prefix)
    }
    /// Everything a partition's writer reads.
    pub fn append_partition_filter(&self, partition: u32) -> String {
        format!("{}.append.{partition}.*", self.prefix)
    }
    /// A committed event's subject; `token` is its [`feed_token`] (or `*`).
    pub fn events_subject(&self, token: &str, session: SessionId) -> String {
        format!("{}.events.{token}.{session}", self.prefix)
    }
    pub fn events_kind_filter(&self, token: &str) -> String {
        format!("{}.events.{token}.*", self.prefix)
    }
    /// TURNLOG_EVENTS's subjects: the [`FEED_TOKENS`]' (events of other kinds go out as
    /// core NATS messages, not stored).
    pub fn feed_subjects(&self) -> Vec<String> {
        FEED_TOKENS.iter().map(|token| self.events_kind_filter(token)).collect()
    }
    /// TURNLOG_EVENTS's subject as versions before [`FEED_TOKENS`] made it, storing every
    /// kind; still accepted, and published to in the same way (DESIGN §6).
    pub fn every_kind_subject(&self) -> String {
        format!("{}.events.>", self.prefix)
    }
    /// `session` is None when the request named no session the writer could read.
    pub fn dead_subject(&self, reason: &str, session: Option<SessionId>) -> String {
        match session {
            Some(s) => format!("{}.dead.{reason}.{s}", self.prefix),
            None => format!("{}.dead.{reason}.none", self.prefix),
        }
    }
    pub fn compact_subject(&self, session: SessionId) -> String {
        format!("{}.compact.{session}", self.prefix)
    }
    pub fn live_subject(&self, session: SessionId) -> String {
        format!("{}.live.{session}", self.prefix)
    }
    pub fn turn_subject(&self, session: SessionId) -> String {
        format!("{}.turn.{session}", self.prefix)
    }
    pub fn control_subject(&self, session: SessionId) -> String {
        format!("{}.control.{session}", self.prefix)
    }
    /// Answered with its session by the ingress copy running attempt `attempt_id`.
    pub fn attempt_subject(&self, attempt_id: &AttemptId) -> String {
        format!("{}.attempt.{attempt_id}", self.prefix)
    }
    /// Subjects of one session in each stream, for purging a deleted session.
    pub fn session_filters(&self, partition: u32, session: SessionId) -> [(String, String); 3] {
        [
            (self.append_stream(), self.append_subject(partition, session)),
            (self.events_stream(), format!("{}.events.*.{session}", self.prefix)),
            (self.dead_stream(), format!("{}.dead.*.{session}", self.prefix)),
        ]
    }
}

/// The feed tokens TURNLOG_EVENTS stores: those a worker consumes (DESIGN §6). The writer
/// publishes an event of another token as a core NATS message on the same subject grammar,
/// which core subscribers see (a turn waiting for its server tools) and no stream keeps: the
/// store, its PubAck and the wait for it were a quarter of a user message's append's CPU,
/// for messages nothing read. A worker on another token adds it here; until then its
/// consumer is refused at its start ("filter subject is not a valid subset").
pub const FEED_TOKENS: [&str; 3] = ["assistant_turn", "assistant_turn-imported", "turn_memory"];

/// Whether TURNLOG_EVENTS stores events of `token` ([`FEED_TOKENS`]).
pub fn on_feed(token: &str) -> bool {
    FEED_TOKENS.contains(&token)
}

/// The feed subject's token for an event of `kind`: the kind, or `<kind>-imported` for an
/// event an import appended (DESIGN §6), so a worker can take a kind's live events or its
/// imported ones alone.
pub fn feed_token(kind: &str, imported: bool) -> String {
    if imported {
        format!("{kind}-imported")
    } else {
        kind.to_owned()
    }
}

/// The partition a session's appends go to: FNV-1a of its id's bytes, mod the partition
/// count. Stable across versions and processes; the count is fixed for a deployment.
pub fn partition_of(session: SessionId, partitions: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session.0.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prefix() {
        let n = BusNames::new("turnlog").unwrap();
        assert_eq!(n.append_stream(), "TURNLOG_APPEND");
        assert_eq!(n.turns_bucket(), "TURNLOG_TURNS");
        let s: SessionId = "0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a".parse().unwrap();
        assert_eq!(n.append_subject(0, s), format!("turnlog.append.0.{s}"));
        assert_eq!(n.dead_subject("bad_json", None), "turnlog.dead.bad_json.none");
        assert!(BusNames::new("Bad.Prefix").is_err());
        assert!(BusNames::new("").is_err());
    }

    #[test]
    fn the_feed_stores_known_kinds_live_or_imported() {
        for token in FEED_TOKENS {
            let kind = token.strip_suffix("-imported").unwrap_or(token);
            let kind: turnlog_core::events::EventKind = kind.parse().expect(token);
            assert!(on_feed(&feed_token(kind.as_str(), token.ends_with("-imported"))));
        }
        assert!(!on_feed("user_message") && !on_feed("assistant_turn-imported.x"));
        let n = BusNames::new("t").unwrap();
        assert_eq!(n.feed_subjects()[0], "t.events.assistant_turn.*");
    }

    #[test]
    fn partitions_are_stable_and_spread() {
        let ids: Vec<SessionId> = (0..1000).map(|_| SessionId::new()).collect();
        let mut counts = [0u32; 4];
        for id in &ids {
            let p = partition_of(*id, 4);
            assert_eq!(p, partition_of(*id, 4));
            counts[p as usize] += 1;
        }
        assert!(counts.iter().all(|c| *c > 150), "{counts:?}");
        assert_eq!(partition_of(ids[0], 1), 0);
    }
}
