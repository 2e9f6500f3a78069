//! Files (DESIGN §12): the blob store their bytes live in, resolving a send's file ids to
//! what its `user_message` keeps, the data URLs a request is built with, and the delayed
//! sweep of deleted files' blobs.

pub mod convert;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt as _;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore, PutOptions, PutPayload};
use tokio_util::sync::CancellationToken;
use turnlog_core::events::{Document, Event, EventBody, ImageRef};
use turnlog_core::ids::Owner;
use turnlog_core::request_body::sha256_hex;
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::files::{self as meta, FileKind, FileMeta, FileRow};
use uuid::Uuid;

use crate::error::ApiError;
use crate::writes::submit;
use crate::Ingress;

/// The parts of a file kept in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The bytes as uploaded.
    Original,
    /// An image as the model is sent it, when scaling changed it.
    Scaled,
    /// A document's markdown.
    Markdown,
}

impl Part {
    const ALL: [Part; 3] = [Part::Original, Part::Scaled, Part::Markdown];
    fn name(self) -> &'static str {
        match self {
            Part::Original => "original",
            Part::Scaled => "scaled",
            Part::Markdown => "markdown.md",
        }
    }
}

/// The blob store (`TURNLOG_FILES_URL`): a local directory or S3-compatible storage.
#[derive(Debug, Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    /// For logs: where the blobs are, without credentials.
    pub location: String,
}

impl Blobs {
    /// `file:///dir` (created when missing) or `s3://bucket/prefix`, configured by the usual
    /// `AWS_*` variables (`AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP=true` for an S3-compatible
    /// server of your own).
    pub fn open(url: &str) -> anyhow::Result<Self> {
        if let Some(dir) = url.strip_prefix("file://") {
            std::fs::create_dir_all(dir).with_context(|| format!("creating the files directory {dir}"))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .with_context(|| format!("opening the files directory {dir}"))?;
            return Ok(Self { store: Arc::new(store), prefix: Path::default(), location: url.to_owned() });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                anyhow::bail!("TURNLOG_FILES_URL {url:?} names no bucket");
            }
            let store = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .build()
                .with_context(|| format!("configuring S3 for {url} (AWS_* variables)"))?;
            let prefix = Path::parse(prefix.trim_matches('/')).context("the S3 prefix")?;
            return Ok(Self { store: Arc::new(store), prefix, location: url.to_owned() });
        }
        anyhow::bail!("TURNLOG_FILES_URL must be file:///dir or s3://bucket/prefix, not {url:?}")
    }

    /// `<prefix>/<owner's hash>/<file id>/<part>`: keys prefixed by owner (an owner name may
    /// hold any character, so its SHA-256 stands for it).
    fn key(&self, owner: &Owner, id: Uuid, part: Part) -> Path {
        let owner = &sha256_hex(owner.as_bytes())[..32];
        self.prefix.clone().join(owner).join(id.to_string().as_str()).join(part.name())
    }

    pub async fn put(&self, owner: &Owner, id: Uuid, part: Part, bytes: Bytes) -> Result<(), ApiError> {
        let key = self.key(owner, id, part);
        self.store
            .put_opts(&key, PutPayload::from_bytes(bytes), PutOptions::default())
            .await
            .map_err(|e| unavailable("storing a file", &e))?;
        Ok(())
    }

    /// A part's bytes; None when it is not stored.
    pub async fn get(&self, owner: &Owner, id: Uuid, part: Part) -> Result<Option<Bytes>, ApiError> {
        let key = self.key(owner, id, part);
        match self.store.get_opts(&key, GetOptions::default()).await {
            Ok(got) => Ok(Some(got.bytes().await.map_err(|e| unavailable("reading a file", &e))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(unavailable("reading a file", &e)),
        }
    }

    /// Removes every part of a file (parts never stored are no error).
    pub async fn delete(&self, owner: &Owner, id: Uuid) -> anyhow::Result<()> {
        let keys: Vec<object_store::Result<Path>> =
            Part::ALL.iter().map(|p| Ok(self.key(owner, id, *p))).collect();
        let mut results = self.store.delete_stream(futures::stream::iter(keys).boxed());
        while let Some(result) = results.next().await {
            match result {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e).context("deleting a file's blobs"),
            }
        }
        Ok(())
    }
}

fn unavailable(what: &str, e: &object_store::Error) -> ApiError {
    tracing::warn!(error = %e, "{what} failed");
    ApiError::Unavailable("the file store cannot be reached; try again".into())
}

/// Room for the multipart framing around an uploaded file.
pub(crate) const MULTIPART_OVERHEAD: usize = 64 * 1024;

/// The bytes of upload bodies one copy holds at once (a body is held whole until it is
/// stored), of which one owner's uploads hold at most a share: uploads that stall or crawl
/// must not keep every other owner's out. An owner's upload past the share waits for room
/// in it, holding nothing meanwhile.
#[derive(Debug)]
pub struct UploadBudget {
    /// A permit a byte.
    bytes: tokio::sync::Semaphore,
    /// The most one owner's bodies hold at once.
    per_owner: usize,
    /// What each owner's bodies hold now.
    held: std::sync::Mutex<HashMap<Owner, usize>>,
    /// Told when an owner's body gives its room back.
    released: tokio::sync::Notify,
}

/// Room for one body in an [`UploadBudget`], given back when dropped.
#[derive(Debug)]
pub struct UploadRoom<'a> {
    budget: &'a UploadBudget,
    owner: Owner,
    bytes: usize,
    _permit: Option<tokio::sync::SemaphorePermit<'a>>,
}

impl UploadBudget {
    /// `total` bytes, of which one owner holds at most a quarter, or one upload of
    /// `file_max_bytes` when that is more (`total` is at least twice that).
    pub fn new(total: usize, file_max_bytes: usize) -> Self {
        Self {
            bytes: tokio::sync::Semaphore::new(total),
            per_owner: (total / 4).max(file_max_bytes.saturating_add(MULTIPART_OVERHEAD)),
            held: Default::default(),
            released: tokio::sync::Notify::new(),
        }
    }

    /// Room for `bytes` of `owner`'s: first in the owner's share, then in all.
    pub async fn reserve(&self, owner: &Owner, bytes: usize) -> Result<UploadRoom<'_>, ApiError> {
        let bytes = bytes.min(self.per_owner);
        loop {
            // Listening before looking, so a release in between is not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let mine = held.entry(owner.clone()).or_default();
                if *mine + bytes <= self.per_owner {
                    *mine += bytes;
                    break;
                }
            }
            released.await;
        }
        // Given back from here on, even when the wait below is dropped.
        let mut room = UploadRoom { budget: self, owner: owner.clone(), bytes, _permit: None };
        let permits = u32::try_from(bytes).unwrap_or(u32::MAX);
        let permit = self
            .bytes
            .acquire_many(permits)
            .await
            .map_err(|_| ApiError::Unavailable("shutting down".into()))?;
        room._permit = Some(permit);
        Ok(room)
    }
}

impl Drop for UploadRoom<'_> {
    fn drop(&mut self) {
        {
            let mut held = self.budget.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(mine) = held.get_mut(&self.owner) {
                *mine = mine.saturating_sub(self.bytes);
                if *mine == 0 {
                    held.remove(&self.owner);
                }
            }
        }
        self.budget.released.notify_waiters();
    }
}

/// Stores an upload: its type sniffed, an image measured (and scaled once when larger than
/// the model is sent), a document converted to markdown, the blobs put and the metadata
/// committed through the writer. Everything that can refuse it runs before anything is
/// stored. With `reuse`, the owner's live file of the same bytes is answered instead.
pub async fn store(
    app: &Ingress,
    owner: &Owner,
    name: String,
    bytes: Bytes,
    reuse: bool,
) -> Result<FileRow, ApiError> {
    let blobs = app.files.as_ref().ok_or_else(not_configured)?;
    // Hashing 20 MiB takes tens of milliseconds: off the async threads.
    let hashed = bytes.clone();
    let sha256 = tokio::task::spawn_blocking(move || sha256_hex(&hashed))
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("hashing a file: {e}")))?;
    if reuse {
        if let Some(f) = meta::live_by_sha256(&app.pool, owner, &sha256).await? {
            return Ok(f);
        }
    }
    let _permit = app.uploads.acquire().await.map_err(|_| ApiError::Unavailable("shutting down".into()))?;
    let kind = convert::sniff(&name, &bytes)?;
    let id = Uuid::now_v7();
    let mut meta = FileMeta {
        name,
        mime: kind.mime().to_owned(),
        kind: kind.kind(),
        bytes: bytes.len() as u64,
        sha256,
        width: None,
        height: None,
        markdown_chars: None,
        note: None,
        sent_mime: None,
    };
    let derived = match kind.kind() {
        FileKind::Image => {
            let original = bytes.clone();
            let image = tokio::task::spawn_blocking(move || convert::image(kind, &original))
                .await
                .map_err(|e| ApiError::internal(anyhow::anyhow!("decoding an image: {e}")))??;
            (meta.width, meta.height) = (Some(image.width), Some(image.height));
            image.scaled.map(|(bytes, mime)| {
                meta.sent_mime = Some(mime.to_owned());
                (Part::Scaled, Bytes::from(bytes))
            })
        }
        FileKind::Document => {
            let conversion = convert::Conversion {
                html_program: app.config.html_converter.clone(),
                timeout: app.config.convert_timeout,
            };
            let md = convert::document(kind, &bytes, &conversion).await?;
            meta.markdown_chars = Some(md.markdown.chars().count() as u64);
            meta.note = md.note;
            Some((Part::Markdown, Bytes::from(md.markdown)))
        }
    };
    blobs.put(owner, id, Part::Original, bytes).await?;
    if let Some((part, derived)) = derived {
        blobs.put(owner, id, part, derived).await?;
    }
    submit(app, &AppendRequest::file_put(id, owner, &meta)).await?;
    let row = meta::owned_file(&app.pool, owner, id)
        .await?
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("file {id} committed but not found")))?;
    tracing::info!(file_id = %id, mime = %row.mime, bytes = row.bytes, "file stored");
    Ok(row)
}

/// Stores the image of a `data:` URL (what chat front ends send) as one of the owner's
/// files, or finds the one already stored with the same bytes; its id.
pub async fn image_from_data_url(app: &Ingress, owner: &Owner, url: &str) -> Result<String, ApiError> {
    let refused = || {
        ApiError::bad_request("an image must be a data URL (data:image/…;base64,…); turnlog fetches no URLs")
    };
    let rest = url.strip_prefix("data:").ok_or_else(refused)?;
    let (header, data) = rest.split_once(',').ok_or_else(refused)?;
    if !header.ends_with(";base64") {
        return Err(refused());
    }
    let limit = app.config.file_max_bytes;
    if data.len() / 4 * 3 > limit + 3 {
        return Err(ApiError::PayloadTooLarge(format!("an image is over the limit of {limit} bytes")));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ApiError::bad_request(format!("an image's data URL is not base64: {e}")))?;
    if convert::sniff("image", &bytes)?.kind() != FileKind::Image {
        return Err(ApiError::bad_request("a data URL in an image part must hold an image"));
    }
    Ok(store(app, owner, "image".into(), Bytes::from(bytes), true).await?.id.to_string())
}

/// The file ids a send names, parsed; a malformed one is a 400.
pub fn parse_ids(ids: &[String]) -> Result<Vec<Uuid>, ApiError> {
    ids.iter().map(|id| id.parse::<Uuid>().map_err(|_| not_yours(id))).collect()
}

fn not_yours(id: &str) -> ApiError {
    let shown: String = id.chars().take(80).collect();
    ApiError::bad_request(format!(
        "{shown:?} is not one of your files (unknown, another owner's, or deleted)"
    ))
}

/// What a `user_message` keeps of the files a send names: images by reference (with the
/// size and type the model is sent), documents with their markdown. A name that is not one
/// of the owner's live files, or a file of the other kind, is a 400.
pub async fn attachments(
    pool: &sqlx::PgPool,
    blobs: Option<&Blobs>,
    owner: &Owner,
    images: &[String],
    documents: &[String],
) -> Result<(Vec<ImageRef>, Vec<Document>), ApiError> {
    if images.is_empty() && documents.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let blobs = blobs.ok_or_else(not_configured)?;
    let (image_ids, document_ids) = (parse_ids(images)?, parse_ids(documents)?);
    let all: Vec<Uuid> = image_ids.iter().chain(&document_ids).copied().collect();
    let rows: HashMap<Uuid, FileRow> =
        meta::live_files(pool, owner, &all).await?.into_iter().map(|f| (f.id, f)).collect();
    let row = |id: &Uuid, image: bool| -> Result<&FileRow, ApiError> {
        let f = rows.get(id).ok_or_else(|| not_yours(&id.to_string()))?;
        match (image, f.is_image()) {
            (true, false) => {
                Err(ApiError::bad_request(format!("file {id} is a document: send it in `documents`")))
            }
            (false, true) => {
                Err(ApiError::bad_request(format!("file {id} is an image: send it in `images`")))
            }
            _ => Ok(f),
        }
    };
    let mut image_refs = Vec::with_capacity(image_ids.len());
    for id in &image_ids {
        let f = row(id, true)?;
        let (w, h) = (f.width.unwrap_or(0).max(0) as u32, f.height.unwrap_or(0).max(0) as u32);
        let (sw, sh) = convert::sent_size(w, h);
        image_refs.push(ImageRef {
            id: id.to_string(),
            mime: f.sent_mime.clone().unwrap_or_else(|| f.mime.clone()),
            width: Some(sw),
            height: Some(sh),
        });
    }
    let mut docs = Vec::with_capacity(document_ids.len());
    for id in &document_ids {
        let f = row(id, false)?;
        let markdown = blobs.get(owner, *id, Part::Markdown).await?.ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!("file {id}'s markdown is missing from the store"))
        })?;
        docs.push(Document {
            id: id.to_string(),
            mime: f.mime.clone(),
            name: Some(f.name.clone()),
            bytes: u64::try_from(f.bytes).ok(),
            markdown: String::from_utf8_lossy(&markdown).into_owned(),
        });
    }
    Ok((image_refs, docs))
}

pub fn not_configured() -> ApiError {
    ApiError::Unavailable("file storage is not configured on this server (TURNLOG_FILES_URL)".into())
}

/// The data URLs of the images `events` attach, for building a request: fetched from the
/// store (the re-encoded copy when there is one). An image whose bytes are gone is left out
/// (the request then says so in its place); a store that cannot be read is an error, so a
/// turn never goes out without an image that is only unreachable for a moment.
pub async fn data_urls(
    blobs: &Blobs,
    owner: &Owner,
    events: &[Event],
) -> Result<HashMap<String, String>, ApiError> {
    let mut urls = HashMap::new();
    for e in events {
        let EventBody::UserMessage(m) = &e.body else { continue };
        for image in &m.images {
            if urls.contains_key(&image.id) {
                continue;
            }
            let Ok(id) = image.id.parse::<Uuid>() else { continue };
            let bytes = match blobs.get(owner, id, Part::Scaled).await? {
                Some(b) => Some(b),
                None => blobs.get(owner, id, Part::Original).await?,
            };
            if let Some(bytes) = bytes {
                let mime = image.mime.clone();
                // Megabytes of base64: off the async threads.
                let url = tokio::task::spawn_blocking(move || {
                    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes))
                })
                .await
                .map_err(|e| ApiError::internal(anyhow::anyhow!("encoding an image: {e}")))?;
                urls.insert(image.id.clone(), url);
            }
        }
    }
    Ok(urls)
}

/// Sweeps deleted files' blobs every `every`, once they have been deleted for `delay` and
/// no stored message refers to them, until `shutdown`.
pub fn spawn_sweep(app: crate::AppState, delay: Duration, every: Duration, shutdown: CancellationToken) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            match sweep(&app, delay).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(files = n, "swept deleted files' blobs"),
                Err(e) => tracing::warn!(error = %e, "sweeping deleted files failed; trying again later"),
            }
        }
    });
}

/// One sweep: removes the blobs of every file deleted more than `delay` ago that no stored
/// message refers to, and records each as swept (a `file_swept` op, so no later sweep goes
/// over it again); the number of files swept.
pub async fn sweep(app: &Ingress, delay: Duration) -> anyhow::Result<usize> {
    let blobs = app.files.as_ref().context("no file store")?;
    let before = chrono::Utc::now() - chrono::Duration::from_std(delay).unwrap_or_default();
    let mut after = None;
    let mut swept = 0;
    loop {
        let page = meta::sweepable(&app.pool, before, after, 500).await?;
        let Some(last) = page.last() else { return Ok(swept) };
        after = last.deleted_at.map(|at| (at, last.id));
        for f in &page {
            blobs.delete(&f.owner, f.id).await?;
            let swept_op = AppendRequest::file_swept(f.id, &f.owner);
            submit(app, &swept_op).await.map_err(|e| anyhow::anyhow!("recording a sweep: {e}"))?;
        }
        swept += page.len();
    }
}
