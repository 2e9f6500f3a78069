//! `turnlog verify`: compares two databases — every session (all columns), every event
//! (seq, event_id, kind, payload, tokens, created_at), every memory, every search row and
//! every file's metadata — streaming both in
//! key order, so a large log is never held in memory, and names the first difference.
//! Each side is read in one snapshot, so a live database can be compared while it grows.

use std::fmt;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use futures::TryStreamExt as _;
use sqlx::postgres::PgRow;
use sqlx::{Connection as _, PgConnection};
use turnlog_runtime::files::FileRow;
use turnlog_runtime::read::SessionRow;
use uuid::Uuid;

/// What a comparison found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Identical {
        sessions: u64,
        events: u64,
        memories: u64,
        /// Rows of the search index (DESIGN §2).
        search: u64,
        /// Uploaded files' metadata (DESIGN §12).
        files: u64,
    },
    /// The first difference, in words.
    Different(String),
}

impl Verdict {
    pub fn is_identical(&self) -> bool {
        matches!(self, Verdict::Identical { .. })
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Identical { sessions, events, memories, search, files } => {
                write!(
                    f,
                    "identical: {sessions} sessions, {events} events, {memories} memories, {search} search rows, {files} files"
                )
            }
            Verdict::Different(what) => write!(f, "different: {what}"),
        }
    }
}

/// Compares the databases at `url_a` and `url_b`; prints and returns the verdict. An error
/// means the comparison could not be made (unreachable, not a turnlog database).
pub async fn verify(url_a: &str, url_b: &str) -> anyhow::Result<Verdict> {
    let mut a = snapshot(url_a).await.context("database A")?;
    let mut b = snapshot(url_b).await.context("database B")?;
    let verdict = async {
        let sessions = match compare::<SessionRow>(&mut a, &mut b).await? {
            Ok(n) => n,
            Err(d) => return anyhow::Ok(Verdict::Different(d.to_string())),
        };
        let events = match compare::<EventRow>(&mut a, &mut b).await? {
            Ok(n) => n,
            Err(d) => return Ok(Verdict::Different(d.to_string())),
        };
        let memories = match compare::<MemoryRow>(&mut a, &mut b).await? {
            Ok(n) => n,
            Err(d) => return Ok(Verdict::Different(d.to_string())),
        };
        let search = match compare::<SearchRow>(&mut a, &mut b).await? {
            Ok(n) => n,
            Err(d) => return Ok(Verdict::Different(d.to_string())),
        };
        let files = match compare::<FileRow>(&mut a, &mut b).await? {
            Ok(n) => n,
            Err(d) => return Ok(Verdict::Different(d.to_string())),
        };
        Ok(Verdict::Identical { sessions, events, memories, search, files })
    }
    .await?;
    println!("{verdict}");
    Ok(verdict)
}

/// A connection inside a read-only snapshot of the database.
async fn snapshot(url: &str) -> anyhow::Result<PgConnection> {
    let mut conn = PgConnection::connect(url).await.with_context(|| format!("connecting to {url}"))?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").execute(&mut conn).await?;
    Ok(conn)
}

/// A kind of row compared between the two databases.
trait Compared: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin + 'static {
    /// Both sides in key order.
    const QUERY: &'static str;
    type Key: Ord + fmt::Display;
    fn key(&self) -> Self::Key;
    /// The first column in which `self` (from A) differs from `other` (from B).
    fn first_difference(&self, other: &Self) -> Option<String>;
}

/// The first difference between the two sides' rows of a kind, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Difference {
    #[error("{0} only in A")]
    OnlyInA(String),
    #[error("{0} only in B")]
    OnlyInB(String),
    #[error("{key}: {what}")]
    Differs { key: String, what: String },
}

/// Ok(rows compared) when identical, else the first difference.
async fn compare<R: Compared>(
    a: &mut PgConnection,
    b: &mut PgConnection,
) -> anyhow::Result<Result<u64, Difference>> {
    let mut rows_a = sqlx::query_as::<_, R>(R::QUERY).fetch(a);
    let mut rows_b = sqlx::query_as::<_, R>(R::QUERY).fetch(b);
    let mut count = 0u64;
    loop {
        let (x, y) = tokio::try_join!(rows_a.try_next(), rows_b.try_next())?;
        let (x, y) = match (x, y) {
            (None, None) => return Ok(Ok(count)),
            (Some(x), None) => return Ok(Err(Difference::OnlyInA(x.key().to_string()))),
            (None, Some(y)) => return Ok(Err(Difference::OnlyInB(y.key().to_string()))),
            (Some(x), Some(y)) => (x, y),
        };
        let (kx, ky) = (x.key(), y.key());
        // Both sides come in key order: the smaller key is the one the other side lacks.
        if kx < ky {
            return Ok(Err(Difference::OnlyInA(kx.to_string())));
        }
        if ky < kx {
            return Ok(Err(Difference::OnlyInB(ky.to_string())));
        }
        if let Some(what) = x.first_difference(&y) {
            return Ok(Err(Difference::Differs { key: kx.to_string(), what }));
        }
        count += 1;
    }
}

/// Longest value shown in a difference.
const SHOWN_CHARS: usize = 160;

fn shown(value: &dyn fmt::Debug) -> String {
    let text = format!("{value:?}");
    if text.chars().count() <= SHOWN_CHARS {
        return text;
    }
    let head: String = text.chars().take(SHOWN_CHARS).collect();
    format!("{head}…")
}

/// `return Some("<field> differs: A … / B …")` for the first field that differs.
macro_rules! first_difference {
    ($a:expr, $b:expr; $($field:ident),+) => {
        $(
            if $a.$field != $b.$field {
                return Some(format!(
                    "{} differs: A {} / B {}",
                    stringify!($field),
                    shown(&$a.$field),
                    shown(&$b.$field)
                ));
            }
        )+
    };
}

/// A row by id, named by what it is (`session`, `memory`).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct IdKey(&'static str, Uuid);

impl fmt::Display for IdKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.0, self.1)
    }
}

impl Compared for SessionRow {
    const QUERY: &'static str =
        "SELECT id, owner, title, archived, last_category, last_seq, compacted_through, compaction_seq, created_at,
                updated_at, active_at, forked_from, forked_through, lineage, lineage_through, hidden_seq,
                metadata
           FROM sessions ORDER BY id";
    type Key = IdKey;
    fn key(&self) -> IdKey {
        IdKey("session", self.id.0)
    }
    fn first_difference(&self, other: &Self) -> Option<String> {
        first_difference!(self, other; owner, title, archived, last_category, last_seq, compacted_through,
            compaction_seq, created_at, updated_at, active_at, forked_from, forked_through, lineage,
            lineage_through, hidden_seq, metadata);
        None
    }
}

/// A payload as jsonb prints it (keys in jsonb's order), shown without escaping.
#[derive(PartialEq, Eq, sqlx::Type)]
#[sqlx(transparent)]
struct Json(String);

impl fmt::Debug for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(sqlx::FromRow)]
struct EventRow {
    session_id: Uuid,
    seq: i64,
    event_id: Uuid,
    kind: String,
    // jsonb's text form is canonical (key order, spacing), so equal payloads print alike.
    payload: Json,
    tokens: i32,
    created_at: DateTime<Utc>,
}

/// An event by session and seq.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct EventKey(Uuid, i64);

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event (session {}, seq {})", self.0, self.1)
    }
}

impl Compared for EventRow {
    const QUERY: &'static str =
        "SELECT session_id, seq, event_id, kind, payload::text AS payload, tokens, created_at
           FROM session_events ORDER BY session_id, seq";
    type Key = EventKey;
    fn key(&self) -> EventKey {
        EventKey(self.session_id, self.seq)
    }
    fn first_difference(&self, other: &Self) -> Option<String> {
        first_difference!(self, other; event_id, kind, payload, tokens, created_at);
        None
    }
}

#[derive(sqlx::FromRow)]
struct MemoryRow {
    id: Uuid,
    owner: String,
    session_id: Uuid,
    turn_seq: i64,
    text: String,
    created_at: DateTime<Utc>,
}

impl Compared for MemoryRow {
    const QUERY: &'static str =
        "SELECT id, owner, session_id, turn_seq, text, created_at FROM memories ORDER BY id";
    type Key = IdKey;
    fn key(&self) -> IdKey {
        IdKey("memory", self.id)
    }
    fn first_difference(&self, other: &Self) -> Option<String> {
        first_difference!(self, other; owner, session_id, turn_seq, text, created_at);
        None
    }
}

impl Compared for FileRow {
    const QUERY: &'static str =
        "SELECT id, owner, name, mime, kind, bytes, sha256, width, height, markdown_chars, \
                                 note, sent_mime, created_at, deleted_at, swept_at FROM files ORDER BY id";
    type Key = IdKey;
    fn key(&self) -> IdKey {
        IdKey("file", self.id)
    }
    fn first_difference(&self, other: &Self) -> Option<String> {
        first_difference!(self, other; owner, name, mime, kind, bytes, sha256, width, height, markdown_chars,
            note, sent_mime, created_at, deleted_at, swept_at);
        None
    }
}

#[derive(sqlx::FromRow)]
struct SearchRow {
    session_id: Uuid,
    seq: i64,
    owner: String,
    kind: String,
    body: String,
    created_at: DateTime<Utc>,
}

impl Compared for SearchRow {
    const QUERY: &'static str =
        "SELECT session_id, seq, owner, kind, body, created_at FROM search_entries ORDER BY session_id, seq";
    type Key = SearchKey;
    fn key(&self) -> SearchKey {
        SearchKey(self.session_id, self.seq)
    }
    fn first_difference(&self, other: &Self) -> Option<String> {
        first_difference!(self, other; owner, kind, body, created_at);
        None
    }
}

/// A search row by session and seq.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct SearchKey(Uuid, i64);

impl fmt::Display for SearchKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "search row (session {}, seq {})", self.0, self.1)
    }
}
