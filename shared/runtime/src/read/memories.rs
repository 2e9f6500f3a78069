//! The owner's long-term memories as recall reads them: by a search text, or the ones most
//! relevant to a turn's text.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use turnlog_core::ids::Owner;
use uuid::Uuid;

/// A long-term memory as recall returns it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Memory {
    pub id: Uuid,
    pub session_id: Uuid,
    pub turn_seq: i64,
    pub text: String,
    pub created_at: DateTime<Utc>,
}

/// The owner's memories matching `q` (Postgres full text, `simple` configuration, as the
/// `memories.text_vector` is made), newest first; without `q`, the newest.
pub async fn recall_memories(
    pool: &PgPool,
    owner: &Owner,
    q: Option<&str>,
    limit: i64,
) -> Result<Vec<Memory>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, session_id, turn_seq, text, created_at FROM memories
          WHERE owner = $1
            AND ($2::text IS NULL OR text_vector @@ plainto_tsquery('simple', $2))
          ORDER BY created_at DESC, id DESC
          LIMIT $3",
    )
    .bind(owner.as_str())
    .bind(q)
    .bind(limit.max(1))
    .fetch_all(pool)
    .await
}

/// The owner's memories most relevant to `text` (any of its words, best matches first):
/// what a turn recalls into its extras.
pub async fn recall_relevant(
    pool: &PgPool,
    owner: &Owner,
    text: &str,
    limit: i64,
) -> Result<Vec<Memory>, sqlx::Error> {
    sqlx::query_as(
        "WITH q AS (
             SELECT to_tsquery('simple', string_agg(quote_literal(w), ' | ')) AS q
               FROM unnest(tsvector_to_array(to_tsvector('simple', $2))) AS w
         )
         SELECT m.id, m.session_id, m.turn_seq, m.text, m.created_at FROM memories m, q
          WHERE m.owner = $1 AND q.q IS NOT NULL AND m.text_vector @@ q.q
          ORDER BY ts_rank(m.text_vector, q.q) DESC, m.created_at DESC, m.id DESC
          LIMIT $3",
    )
    .bind(owner.as_str())
    .bind(text)
    .bind(limit)
    .fetch_all(pool)
    .await
}
