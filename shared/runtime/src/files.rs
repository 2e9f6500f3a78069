//! Uploaded files' metadata (DESIGN §12): what a `file_put` op carries, the `files` row the
//! writer makes of it, and the owner-scoped reads. The bytes live in the blob store.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use turnlog_core::ids::Owner;
use uuid::Uuid;

/// Longest file name kept (longer ones are cut at upload).
pub const MAX_FILE_NAME_CHARS: usize = 255;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    Image,
    Document,
}

impl FileKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::Image => "image",
            FileKind::Document => "document",
        }
    }
}

/// A `file_put` op's payload: everything about a file but its id, owner and times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    pub name: String,
    /// Sniffed from the bytes at upload, never taken from the client.
    pub mime: String,
    pub kind: FileKind,
    pub bytes: u64,
    /// Of the uploaded bytes, lowercase hex.
    pub sha256: String,
    /// An image's size as the model is sent it (after scaling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    /// A document's markdown length, in characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub markdown_chars: Option<u64>,
    /// What the conversion could not do (a PDF without a text layer, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// An image sent as a re-encoded copy (scaled, or lightened): that copy's type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_mime: Option<String>,
}

impl FileMeta {
    /// Why the writer cannot store this, if it cannot.
    pub fn invalid(&self) -> Option<&'static str> {
        let texts = [
            Some(&self.name),
            Some(&self.mime),
            Some(&self.sha256),
            self.note.as_ref(),
            self.sent_mime.as_ref(),
        ];
        if texts.into_iter().flatten().any(|t| t.contains('\0')) {
            return Some("file metadata contains a NUL character");
        }
        let long_mime = self.mime.len() > 200 || self.sent_mime.as_ref().is_some_and(|m| m.len() > 200);
        if self.name.chars().count() > MAX_FILE_NAME_CHARS || long_mime || self.sha256.len() != 64 {
            return Some("file name, mime type or sha256 out of range");
        }
        if self.note.as_ref().is_some_and(|n| n.len() > 1000) {
            return Some("file note over 1000 bytes");
        }
        None
    }
}

/// A `files` row.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct FileRow {
    pub id: Uuid,
    #[sqlx(try_from = "String")]
    pub owner: Owner,
    pub name: String,
    pub mime: String,
    pub kind: String,
    pub bytes: i64,
    pub sha256: String,
    pub width: Option<i32>,
    pub height: Option<i32>,
    pub markdown_chars: Option<i64>,
    pub note: Option<String>,
    pub sent_mime: Option<String>,
    pub created_at: DateTime<Utc>,
    pub deleted_at: Option<DateTime<Utc>>,
    pub swept_at: Option<DateTime<Utc>>,
}

impl FileRow {
    pub fn new(id: Uuid, owner: &Owner, meta: &FileMeta, at: DateTime<Utc>) -> Self {
        Self {
            id,
            owner: owner.clone(),
            name: meta.name.clone(),
            mime: meta.mime.clone(),
            kind: meta.kind.as_str().to_owned(),
            bytes: i64::try_from(meta.bytes).unwrap_or(i64::MAX),
            sha256: meta.sha256.clone(),
            width: meta.width.and_then(|w| i32::try_from(w).ok()),
            height: meta.height.and_then(|h| i32::try_from(h).ok()),
            markdown_chars: meta.markdown_chars.and_then(|c| i64::try_from(c).ok()),
            note: meta.note.clone(),
            sent_mime: meta.sent_mime.clone(),
            created_at: at,
            deleted_at: None,
            swept_at: None,
        }
    }

    pub fn is_image(&self) -> bool {
        self.kind == FileKind::Image.as_str()
    }
}

pub const FILE_COLUMNS: &str =
    "id, owner, name, mime, kind, bytes, sha256, width, height, markdown_chars, note, \
                                sent_mime, created_at, deleted_at, swept_at";

/// The owner's file `id`, deleted or not; None when it is another owner's or unknown.
pub async fn owned_file(pool: &PgPool, owner: &Owner, id: Uuid) -> Result<Option<FileRow>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {FILE_COLUMNS} FROM files WHERE id = $1 AND owner = $2"))
        .bind(id)
        .bind(owner.as_str())
        .fetch_optional(pool)
        .await
}

/// Those of `ids` that are the owner's live (not deleted) files.
pub async fn live_files(pool: &PgPool, owner: &Owner, ids: &[Uuid]) -> Result<Vec<FileRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {FILE_COLUMNS} FROM files WHERE id = ANY($1) AND owner = $2 AND deleted_at IS NULL"
    ))
    .bind(ids)
    .bind(owner.as_str())
    .fetch_all(pool)
    .await
}

/// The owner's live file of these bytes, if any (the newest).
pub async fn live_by_sha256(
    pool: &PgPool,
    owner: &Owner,
    sha256: &str,
) -> Result<Option<FileRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {FILE_COLUMNS} FROM files WHERE owner = $1 AND sha256 = $2 AND deleted_at IS NULL
          ORDER BY created_at DESC LIMIT 1"
    ))
    .bind(owner.as_str())
    .bind(sha256)
    .fetch_optional(pool)
    .await
}

/// The owner's live files, newest first; `before` pages on (created_at, id).
pub async fn list_files(
    pool: &PgPool,
    owner: &Owner,
    before: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<FileRow>, sqlx::Error> {
    let (at, id) = before.unzip();
    sqlx::query_as(&format!(
        "SELECT {FILE_COLUMNS} FROM files
          WHERE owner = $1 AND deleted_at IS NULL
            AND ($2::timestamptz IS NULL OR (created_at, id) < ($2, $3))
          ORDER BY created_at DESC, id DESC LIMIT $4"
    ))
    .bind(owner.as_str())
    .bind(at)
    .bind(id)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Files deleted before `before`, not swept yet, that no stored user message refers to:
/// those whose blobs may go. A message keeps its attachments' bytes for as long as it
/// exists (an audited request is rebuilt with them, and the transcript shows them). Pages
/// on (deleted_at, id) after `after`.
pub async fn sweepable(
    pool: &PgPool,
    before: DateTime<Utc>,
    after: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<FileRow>, sqlx::Error> {
    let (after_at, after_id) = after.unzip();
    sqlx::query_as(&format!(
        "SELECT {FILE_COLUMNS} FROM files f
          WHERE f.deleted_at < $1 AND f.swept_at IS NULL
            AND ($3::timestamptz IS NULL OR (f.deleted_at, f.id) > ($3, $4))
            AND NOT EXISTS (
                SELECT 1 FROM sessions s JOIN session_events e ON e.session_id = s.id
                 WHERE s.owner = f.owner AND e.kind = 'user_message'
                   AND (e.payload -> 'images' @> jsonb_build_array(jsonb_build_object('id', f.id::text))
                        OR e.payload -> 'documents' @> jsonb_build_array(jsonb_build_object('id', f.id::text))))
          ORDER BY f.deleted_at, f.id LIMIT $2"
    ))
    .bind(before)
    .bind(limit)
    .bind(after_at)
    .bind(after_id)
    .fetch_all(pool)
    .await
}
