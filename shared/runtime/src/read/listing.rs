//! The session list: the owner's sessions of one archive view, or those matching a search
//! text, newest first, paged by a `(active_at, id)` cursor.

use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::{FromRow as _, PgPool, Row as _};
use turnlog_core::ids::Owner;
use uuid::Uuid;

use super::SessionRow;

/// The composite paging cursor: the `(active_at, id)` of the last row of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub before: DateTime<Utc>,
    pub before_id: Uuid,
}

impl Cursor {
    /// `before` as clients echo it: RFC 3339 with microseconds, the database's precision.
    pub fn before_text(&self) -> String {
        self.before.to_rfc3339_opts(SecondsFormat::Micros, true)
    }
}

#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub limit: i64,
    /// Full-text match on the title or any user message; archived sessions included.
    pub q: Option<String>,
    pub archived: bool,
    pub before: Option<Cursor>,
}

/// The owner's sessions of one archive view, newest first from the cursor (`$2`, the
/// search text, is unused).
const LIST_SESSIONS: &str = concat!(
    "SELECT ",
    session_columns!(),
    " FROM sessions
  WHERE owner = $1 AND archived = $3 AND hidden_seq IS NULL
    AND ($4::timestamptz IS NULL OR (active_at, id) < ($4, $5))
  ORDER BY active_at DESC, id DESC
  LIMIT $6"
);

/// The owner's sessions whose title or any user message matches `$2`, archived or not.
/// Each text is matched by the very expression its GIN index is built on
/// (`sessions_title_fts`, `search_entries_fts`: the search index the writer keeps off its
/// commit path), so Postgres looks the words up instead of computing a tsvector per row;
/// `$3` is unused here.
const SEARCH_SESSIONS: &str = concat!(
    "SELECT ",
    session_columns!(),
    " FROM sessions
  WHERE owner = $1 AND hidden_seq IS NULL
    AND ($4::timestamptz IS NULL OR (active_at, id) < ($4, $5))
    AND id IN (SELECT t.id FROM sessions t
                WHERE t.owner = $1
                  AND to_tsvector('simple', coalesce(t.title, '')) @@ plainto_tsquery('simple', $2)
               UNION
               SELECT e.session_id FROM search_entries e
                WHERE e.owner = $1 AND e.kind = 'user'
                  AND e.body_vector @@ plainto_tsquery('simple', $2))
  ORDER BY active_at DESC, id DESC
  LIMIT $6"
);

/// [`list_sessions`]'s statement for `query`, its parameters bound.
fn list_statement<'q>(
    sql: &'q str,
    owner: &'q Owner,
    query: &'q ListQuery,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(owner.as_str())
        .bind(query.q.as_deref())
        .bind(query.archived)
        .bind(query.before.map(|c| c.before))
        .bind(query.before.map_or(Uuid::max(), |c| c.before_id))
        .bind(query.limit.clamp(1, 1000))
}

fn list_sql(query: &ListQuery) -> &'static str {
    if query.q.is_some() {
        SEARCH_SESSIONS
    } else {
        LIST_SESSIONS
    }
}

/// Newest first by `(active_at, id)`; returns the page and the cursor of the next one.
pub async fn list_sessions(
    pool: &PgPool,
    owner: &Owner,
    query: &ListQuery,
) -> Result<(Vec<SessionRow>, Option<Cursor>), sqlx::Error> {
    let limit = query.limit.clamp(1, 1000);
    let rows: Vec<SessionRow> = list_statement(list_sql(query), owner, query)
        .try_map(|row| SessionRow::from_row(&row))
        .fetch_all(pool)
        .await?;
    let next = (rows.len() as i64 == limit)
        .then(|| rows.last().map(|s| Cursor { before: s.active_at, before_id: s.id.0 }))
        .flatten();
    Ok((rows, next))
}

/// The plan Postgres chooses for [`list_sessions`] with `query` (`EXPLAIN`, as text): how
/// an operator, or a test, sees whether a search is served by the full-text indexes.
pub async fn explain_list_sessions(
    pool: &PgPool,
    owner: &Owner,
    query: &ListQuery,
) -> Result<String, sqlx::Error> {
    let sql = format!("EXPLAIN {}", list_sql(query));
    let lines: Vec<String> = list_statement(&sql, owner, query)
        .try_map(|row: sqlx::postgres::PgRow| row.try_get::<String, _>(0))
        .fetch_all(pool)
        .await?;
    Ok(lines.join("\n"))
}
