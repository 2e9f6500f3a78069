//! The `sessions` row and the lookups of sessions by id: one session, its forks, the
//! family of a fork tree.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use turnlog_core::branch::Segment;
use turnlog_core::events::ForkPoint;
use turnlog_core::ids::{Owner, SessionId};

/// A `sessions` row: the one declaration every service reads it through (the ingress's
/// session views, the writer's batch state, `verify`'s comparison).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SessionRow {
    #[sqlx(try_from = "Uuid")]
    pub id: SessionId,
    #[sqlx(try_from = "String")]
    pub owner: Owner,
    pub title: Option<String>,
    pub archived: bool,
    /// Category of the newest user message that named one.
    pub last_category: Option<String>,
    pub last_seq: i64,
    pub compacted_through: Option<i64>,
    pub compaction_seq: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// When the session was last active, what the list sorts by: the stream time of its
    /// newest message (`user_message` or `assistant_turn`; of its creation before one), or,
    /// for a message brought in by an import, that message's original time (derived from the
    /// payload, so a rebuild reproduces it). Other events leave it.
    pub active_at: DateTime<Utc>,
    /// The parent and fork point a fork was created from (DESIGN §10).
    pub forked_from: Option<Uuid>,
    pub forked_through: Option<i64>,
    /// The ancestors the branch log reads, root first, and the last seq read from each
    /// (`turnlog_core::branch`); empty for a session that is not a fork.
    pub lineage: Vec<Uuid>,
    pub lineage_through: Vec<i64>,
    /// Set when the session was deleted while forks inherit its prefix: the APPEND
    /// sequence of that delete. A hidden session is not found by any route.
    pub hidden_seq: Option<i64>,
    /// String pairs a client keeps with the session (at most
    /// [`turnlog_core::limits::MAX_METADATA_PAIRS`]).
    pub metadata: serde_json::Value,
}

impl SessionRow {
    /// A new session's row (a fork's lineage and fork point set by the caller).
    pub fn new(id: SessionId, owner: Owner, title: Option<String>, now: DateTime<Utc>) -> Self {
        Self {
            id,
            owner,
            title,
            archived: false,
            last_category: None,
            last_seq: 0,
            compacted_through: None,
            compaction_seq: None,
            created_at: now,
            updated_at: now,
            active_at: now,
            forked_from: None,
            forked_through: None,
            lineage: Vec::new(),
            lineage_through: Vec::new(),
            hidden_seq: None,
            metadata: serde_json::Value::Object(Default::default()),
        }
    }

    /// The ancestor segments of the session's branch log, root first.
    pub fn lineage(&self) -> Vec<Segment> {
        self.lineage
            .iter()
            .zip(&self.lineage_through)
            .map(|(id, through)| Segment { session: SessionId(*id), through: *through })
            .collect()
    }

    pub fn set_lineage(&mut self, lineage: &[Segment]) {
        self.lineage = lineage.iter().map(|s| s.session.0).collect();
        self.lineage_through = lineage.iter().map(|s| s.through).collect();
    }

    /// Where this fork branched off, or None for a session that is not a fork.
    pub fn fork_point(&self) -> Option<ForkPoint> {
        Some(ForkPoint { session_id: SessionId(self.forked_from?), through_seq: self.forked_through? })
    }

    /// The first seq of the session's own events (1 unless it is a fork).
    pub fn first_own_seq(&self) -> i64 {
        self.lineage_through.last().map_or(1, |t| t + 1)
    }
}

pub const SESSION_COLUMNS: &str = session_columns!();

/// The owner's session `id`; None when it does not exist, is another owner's or hidden.
pub async fn get_session(
    pool: &PgPool,
    owner: &Owner,
    id: SessionId,
) -> Result<Option<SessionRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1 AND owner = $2 AND hidden_seq IS NULL"
    ))
    .bind(id.0)
    .bind(owner.as_str())
    .fetch_optional(pool)
    .await
}

/// The owner's live session most recently active within the last `within` seconds (by
/// its newest message's stream time), if any.
pub async fn latest_active(
    pool: &PgPool,
    owner: &Owner,
    within: f64,
) -> Result<Option<SessionRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions
          WHERE owner = $1 AND archived = false AND hidden_seq IS NULL
            AND active_at >= now() - make_interval(secs => $2)
          ORDER BY active_at DESC, id DESC LIMIT 1"
    ))
    .bind(owner.as_str())
    .bind(within)
    .fetch_optional(pool)
    .await
}

/// A session's forks as its detail lists them: the live sessions created from it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ForkSummary {
    pub id: Uuid,
    pub title: Option<String>,
    pub through_seq: i64,
    pub created_at: DateTime<Utc>,
}

/// The owner's live forks of session `id`, oldest first.
pub async fn forks_of(pool: &PgPool, owner: &Owner, id: SessionId) -> Result<Vec<ForkSummary>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, title, forked_through AS through_seq, created_at FROM sessions
          WHERE forked_from = $1 AND owner = $2 AND hidden_seq IS NULL
          ORDER BY created_at, id LIMIT 1000",
    )
    .bind(id.0)
    .bind(owner.as_str())
    .fetch_all(pool)
    .await
}

/// The owner's visible sessions of the fork tree rooted at `root` (the root itself and every
/// session whose lineage names it): the 1,000 used last, oldest first (a parent before its
/// forks).
pub async fn family(pool: &PgPool, owner: &Owner, root: SessionId) -> Result<Vec<SessionRow>, sqlx::Error> {
    let mut rows: Vec<SessionRow> = sqlx::query_as(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions
          WHERE owner = $2 AND hidden_seq IS NULL AND (id = $1 OR lineage && ARRAY[$1]::uuid[])
          ORDER BY active_at DESC LIMIT 1000"
    ))
    .bind(root.0)
    .bind(owner.as_str())
    .fetch_all(pool)
    .await?;
    rows.sort_by_key(|r| (r.created_at, r.id.0));
    Ok(rows)
}
