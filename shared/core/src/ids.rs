//! Validated identifiers. Raw strings are parsed into these at the edge (HTTP, bus) so
//! nothing inside the services handles an unchecked id.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new time-ordered (v7) id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Uuid::parse_str(s).map(Self).map_err(|_| IdError {
                    what: stringify!($name),
                    value: s.chars().take(64).collect(),
                })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }
    };
}

/// A newtype over a `String` reads as its text: `Deref` to `str`, and `Display`.
macro_rules! text_newtype {
    ($name:ident) => {
        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

uuid_newtype!(
    /// A chat session.
    SessionId
);
uuid_newtype!(
    /// One event, chosen by its producer; the writer deduplicates on it.
    EventId
);

impl EventId {
    /// A deterministic id for an event derived from another one (a worker's output for a
    /// given turn), so a redelivered input produces the same id and the writer drops it.
    pub fn derived(session: SessionId, seq: i64, purpose: &str) -> Self {
        let name = format!("{session}:{seq}:{purpose}");
        Self(Uuid::new_v5(&DERIVED_NAMESPACE, name.as_bytes()))
    }
}

const DERIVED_NAMESPACE: Uuid = Uuid::from_u128(0x6f1c_2a4e_8d3b_4c57_9e21_0b7a_5d4c_3f10);

/// One attempt at a turn: what its checkpoints and its outcome carry (`attempt_id`), the
/// subject the copy running it answers on, and on the OpenAI-compatible routes a response's
/// id. This build makes them from a time-ordered UUID, hyphenated; a log may hold any other
/// text (an import's, an older producer's), which is kept as it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AttemptId(String);

impl AttemptId {
    /// A new attempt's id.
    pub fn new() -> Self {
        Self::from(Uuid::now_v7())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The UUID it spells, when it is one (every id this build makes is).
    pub fn as_uuid(&self) -> Option<Uuid> {
        Uuid::parse_str(&self.0).ok()
    }
}

impl Default for AttemptId {
    fn default() -> Self {
        Self::new()
    }
}

impl From<Uuid> for AttemptId {
    fn from(u: Uuid) -> Self {
        Self(u.hyphenated().to_string())
    }
}

/// An id as a log or a request spells it.
impl From<String> for AttemptId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for AttemptId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// Equal to its text.
impl PartialEq<String> for AttemptId {
    fn eq(&self, other: &String) -> bool {
        self.0 == *other
    }
}

text_newtype!(AttemptId);

#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid {what}: {value:?} is not a UUID")]
pub struct IdError {
    pub what: &'static str,
    pub value: String,
}

/// The owner a session belongs to (an API token maps to one). Non-empty, at most 128
/// bytes, printable ASCII without whitespace so it can travel in subjects and logs.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Owner(String);

/// As its text (`"alice"`), the way logs and `turnlog verify` showed owners before they
/// were typed.
impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Owner {
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<Self, OwnerError> {
        if s.is_empty() || s.len() > Self::MAX_LEN || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(OwnerError(s.chars().take(64).collect()));
        }
        Ok(Self(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid owner {0:?}: 1-128 printable ASCII characters without spaces")]
pub struct OwnerError(String);

impl TryFrom<String> for Owner {
    type Error = OwnerError;
    fn try_from(s: String) -> Result<Self, OwnerError> {
        Self::parse(&s)
    }
}

impl From<Owner> for String {
    fn from(o: Owner) -> String {
        o.0
    }
}

text_newtype!(Owner);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_id_rejects_garbage_and_names_it() {
        let err = "not-a-uuid".parse::<SessionId>().unwrap_err();
        assert!(err.to_string().contains("SessionId"), "{err}");
        assert!("0190a0e4-3b1c-7cc1-9a2b-5f0e3d2c1b0a".parse::<SessionId>().is_ok());
    }

    #[test]
    fn derived_event_ids_are_deterministic_and_distinct() {
        let s = SessionId::new();
        assert_eq!(EventId::derived(s, 7, "turn_memory"), EventId::derived(s, 7, "turn_memory"));
        assert_ne!(EventId::derived(s, 7, "turn_memory"), EventId::derived(s, 7, "memory_extracted"));
        assert_ne!(EventId::derived(s, 7, "turn_memory"), EventId::derived(s, 8, "turn_memory"));
    }

    #[test]
    fn attempt_ids_are_their_text() {
        let made = AttemptId::new();
        assert_eq!(made.as_uuid().map(|u| u.hyphenated().to_string()).as_deref(), Some(made.as_str()));
        assert_eq!(serde_json::to_value(&made).unwrap(), serde_json::json!(made.as_str()));
        let odd: AttemptId = serde_json::from_str("\"att-3\"").unwrap();
        assert_eq!((odd.as_str(), odd.as_uuid()), ("att-3", None));
    }

    #[test]
    fn owner_validation() {
        assert!(Owner::parse("alice").is_ok());
        assert!(Owner::parse("").is_err());
        assert!(Owner::parse("has space").is_err());
        assert!(Owner::parse(&"x".repeat(129)).is_err());
        assert!(serde_json::from_str::<Owner>("\"bad owner\"").is_err());
    }
}
