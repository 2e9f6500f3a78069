//! The owner's long-term memories as recall reads them: by a search text, or the ones most
//! relevant to a turn's text.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use turnlog_core::ids::Owner;
use uuid::Uuid;

/// A word in at least this share of the memories is common: recall does not match on it
/// (it still counts in the ranking).
const COMMON_SHARE: f32 = 0.2;
/// How old the common words may grow before a recall reads them again (in the background).
const COMMON_REFRESH: Duration = Duration::from_secs(1);

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

/// The owner's memories most relevant to `text`, best first: what a turn recalls into its
/// extras. The candidates are the memories that have one of the text's words that are not
/// `common`, or when none has, any of its words; they rank by all its words. So recall's
/// cost follows the memories that share a distinctive word with the turn, not all the
/// owner's memories, which the words nearly every memory has would make candidates; and a
/// memory sharing only common words never outranks one sharing a distinctive word.
pub async fn recall_relevant(
    pool: &PgPool,
    owner: &Owner,
    text: &str,
    limit: i64,
    common: &[String],
) -> Result<Vec<Memory>, sqlx::Error> {
    sqlx::query_as(
        "WITH words AS (
             SELECT w FROM unnest(tsvector_to_array(to_tsvector('simple', $2))) AS w
         ), q AS (
             SELECT to_tsquery('simple', string_agg(quote_literal(w), ' | ')) AS every,
                    to_tsquery('simple', string_agg(quote_literal(w), ' | ') FILTER (WHERE w <> ALL($4))) AS rare
               FROM words
         ), hits AS MATERIALIZED (
             SELECT m.id, m.session_id, m.turn_seq, m.text, m.created_at, ts_rank(m.text_vector, q.every) AS rank
               FROM memories m, q
              WHERE m.owner = $1 AND m.text_vector @@ q.rare
         )
         SELECT id, session_id, turn_seq, text, created_at FROM (
             SELECT * FROM hits
             UNION ALL
             SELECT m.id, m.session_id, m.turn_seq, m.text, m.created_at, ts_rank(m.text_vector, q.every)
               FROM memories m, q
              WHERE NOT EXISTS (SELECT FROM hits) AND m.owner = $1 AND m.text_vector @@ q.every
         ) r
          ORDER BY rank DESC, created_at DESC, id DESC
          LIMIT $3",
    )
    .bind(owner.as_str())
    .bind(text)
    .bind(limit)
    .bind(common)
    .fetch_all(pool)
    .await
}

/// The words (lexemes of the `simple` configuration) in at least [`COMMON_SHARE`] of all
/// memories, from the statistics ANALYZE keeps of `memories.text_vector` (autovacuum
/// renews them as memories are added): none until it has run once.
async fn read_common_words(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT coalesce(array_agg(x.word), '{}')
           FROM pg_stats s, unnest(s.most_common_elems::text::text[], s.most_common_elem_freqs) AS x(word, share)
          WHERE s.schemaname = current_schema() AND s.tablename = 'memories' AND s.attname = 'text_vector'
            AND x.word IS NOT NULL AND x.share >= $1",
    )
    .bind(COMMON_SHARE)
    .fetch_one(pool)
    .await
}

/// The memories' common words as [`recall_relevant`] takes them, read again at most once a
/// second and never on a turn's path: a recall gets the words read last, and a
/// stale list starts a read in the background.
#[derive(Default)]
pub struct CommonWords {
    /// When the words were last read (None: never), and the words.
    words: RwLock<(Option<Instant>, Arc<[String]>)>,
    reading: AtomicBool,
}

impl CommonWords {
    /// The words read last; a read starts in the background when they are stale.
    pub fn current(self: &Arc<Self>, pool: &PgPool) -> Arc<[String]> {
        let (read_at, words) = self.words.read().unwrap_or_else(PoisonError::into_inner).clone();
        let stale = read_at.is_none_or(|at| at.elapsed() >= COMMON_REFRESH);
        if stale && !self.reading.swap(true, Ordering::AcqRel) {
            let (this, pool) = (Arc::clone(self), pool.clone());
            tokio::spawn(async move {
                if let Err(e) = this.refresh(&pool).await {
                    tracing::warn!(error = %e, "reading the memories' common words failed; recall keeps the last");
                }
                this.reading.store(false, Ordering::Release);
            });
        }
        words
    }

    /// Reads the words now; on an error keeps the last ones until the next refresh is due.
    pub async fn refresh(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let read = read_common_words(pool).await;
        let mut slot = self.words.write().unwrap_or_else(PoisonError::into_inner);
        slot.0 = Some(Instant::now());
        slot.1 = read?.into();
        Ok(())
    }
}
