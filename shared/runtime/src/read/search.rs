//! `GET /v1/search`: the owner's user messages, answers and titles matching a text, from
//! the search index the writer keeps and the sessions' titles.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use turnlog_core::ids::Owner;
use uuid::Uuid;

/// One hit of `GET /v1/search`: a user message, an answer or a title that matches.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SearchHit {
    pub session_id: Uuid,
    pub session_title: Option<String>,
    /// The matching event's seq; null for a title.
    pub seq: Option<i64>,
    /// `user`, `assistant` or `title`.
    pub kind: String,
    /// The matching text around the matched words, HTML-escaped, each matched word in
    /// `<mark>…</mark>`.
    pub snippet: String,
    pub created_at: DateTime<Utc>,
}

/// The owner's hits for `q` (Postgres full text, `simple` configuration), best first
/// (`ts_rank`, a title weighing double, then newest), `limit` from `offset`. User messages
/// and answers come from the search index (each hit belongs to the session whose own event
/// it is: a fork shows only its own), titles from the sessions; archived sessions are
/// included, hidden ones are not.
pub async fn search(
    pool: &PgPool,
    owner: &Owner,
    q: &str,
    limit: i64,
    offset: i64,
) -> Result<Vec<SearchHit>, sqlx::Error> {
    sqlx::query_as(
        "WITH q AS (SELECT plainto_tsquery('simple', $2) AS q),
         hits AS (
             SELECT e.session_id, e.seq, e.kind, e.body, e.created_at,
                    ts_rank(e.body_vector, q.q) AS rank
               FROM search_entries e, q
              WHERE e.owner = $1 AND e.body_vector @@ q.q
             UNION ALL
             SELECT t.id, NULL, 'title', t.title, t.updated_at,
                    2 * ts_rank(to_tsvector('simple', coalesce(t.title, '')), q.q)
               FROM sessions t, q
              WHERE t.owner = $1 AND to_tsvector('simple', coalesce(t.title, '')) @@ q.q
         )
         SELECT h.session_id, s.title AS session_title, h.seq, h.kind,
                ts_headline('simple',
                            replace(replace(replace(h.body, '&', '&amp;'), '<', '&lt;'), '>', '&gt;'),
                            q.q,
                            'StartSel=<mark>, StopSel=</mark>, MaxWords=30, MinWords=12, MaxFragments=2, FragmentDelimiter=\" … \"')
                    AS snippet,
                h.created_at
           FROM hits h
           JOIN sessions s ON s.id = h.session_id AND s.hidden_seq IS NULL
          CROSS JOIN q
          ORDER BY h.rank DESC, h.created_at DESC, h.session_id, h.seq NULLS FIRST
          LIMIT $3 OFFSET $4",
    )
    .bind(owner.as_str())
    .bind(q)
    .bind(limit)
    .bind(offset)
    .fetch_all(pool)
    .await
}
