//! What an upload is, from its bytes alone (DESIGN §12): its type is sniffed, never taken
//! from the client; an image is measured and, when larger than the model is sent, scaled
//! once; a document becomes markdown once.
//!
//! PDFs go through Debian's `pdftotext` (poppler-utils): poppler is the reference-quality
//! extractor (fonts, encodings, columns) that most PDF tooling on Linux is built on, and as
//! a separate process with a deadline a hostile or broken PDF cannot take the ingress down
//! with it. The pure-Rust crates we looked at (`pdf-extract` over `lopdf`) lose text of
//! common fonts and are known to panic on malformed files.

use std::io::Cursor;
use std::process::Stdio;
use std::time::Duration;

use image::{DynamicImage, ImageFormat, ImageReader, Limits};
use tokio::io::AsyncReadExt as _;
use turnlog_core::tokens::MAX_IMAGE_EDGE;
use turnlog_runtime::files::FileKind;

use crate::error::ApiError;

/// A document's markdown is refused above this (DESIGN §12): it is sent with every request
/// of the session until a compaction summarizes it.
pub const MAX_MARKDOWN_BYTES: usize = 512 * 1024;
/// Pixels decoded at most, either side and in all: a small file can claim a huge canvas.
const MAX_IMAGE_SIDE: u32 = 16_384;
const MAX_IMAGE_PIXELS: u64 = 40_000_000;
const MAX_DECODE_BYTES: u64 = 256 * 1024 * 1024;
/// An image not larger than the model is sent but heavier than this is re-encoded once
/// (metadata dropped), so no turn carries more than a few MiB of it.
const MAX_SENT_IMAGE_BYTES: usize = 4 * 1024 * 1024;
/// Deepest HTML nesting converted (the converter recurses once a level).
const MAX_HTML_DEPTH: usize = 2_000;
/// The converter's thread stack: room for [`MAX_HTML_DEPTH`] levels many times over.
const HTML_STACK_BYTES: usize = 64 * 1024 * 1024;
/// Longest an HTML conversion may take.
const HTML_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a PDF's text extraction may take.
const PDF_TIMEOUT: Duration = Duration::from_secs(30);
/// The JPEG quality a scaled JPEG is written with.
const JPEG_QUALITY: u8 = 85;

/// The sniffed type of an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed {
    Png,
    Jpeg,
    Gif,
    Webp,
    Pdf,
    Html,
    Markdown,
    Text,
}

impl Sniffed {
    pub fn mime(self) -> &'static str {
        match self {
            Sniffed::Png => "image/png",
            Sniffed::Jpeg => "image/jpeg",
            Sniffed::Gif => "image/gif",
            Sniffed::Webp => "image/webp",
            Sniffed::Pdf => "application/pdf",
            Sniffed::Html => "text/html",
            Sniffed::Markdown => "text/markdown",
            Sniffed::Text => "text/plain",
        }
    }

    pub fn kind(self) -> FileKind {
        match self {
            Sniffed::Png | Sniffed::Jpeg | Sniffed::Gif | Sniffed::Webp => FileKind::Image,
            _ => FileKind::Document,
        }
    }

    fn image_format(self) -> Option<ImageFormat> {
        match self {
            Sniffed::Png => Some(ImageFormat::Png),
            Sniffed::Jpeg => Some(ImageFormat::Jpeg),
            Sniffed::Gif => Some(ImageFormat::Gif),
            Sniffed::Webp => Some(ImageFormat::WebP),
            _ => None,
        }
    }
}

const SUPPORTED: &str = "PNG, JPEG, GIF and WebP images; PDF, HTML, markdown and plain-text documents";

/// The type of `bytes` (`name` only tells markdown from plain text, which bytes cannot).
pub fn sniff(name: &str, bytes: &[u8]) -> Result<Sniffed, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request("the file is empty"));
    }
    if let Some(t) = infer::get(bytes) {
        return match t.mime_type() {
            "image/png" => Ok(Sniffed::Png),
            "image/jpeg" => Ok(Sniffed::Jpeg),
            "image/gif" => Ok(Sniffed::Gif),
            "image/webp" => Ok(Sniffed::Webp),
            "application/pdf" => Ok(Sniffed::Pdf),
            "text/html" => Ok(Sniffed::Html),
            // Other text types (XML, scripts) are read as plain text.
            _ if t.matcher_type() == infer::MatcherType::Text && text(bytes).is_some() => Ok(Sniffed::Text),
            other => Err(ApiError::UnsupportedMediaType(format!(
                "the file is {other}, which is not supported: send {SUPPORTED}"
            ))),
        };
    }
    let Some(body) = text(bytes) else {
        return Err(ApiError::UnsupportedMediaType(format!(
            "the file's type is not recognized (it is not UTF-8 text either): send {SUPPORTED}"
        )));
    };
    let head: String = body.trim_start().chars().take(512).collect::<String>().to_ascii_lowercase();
    if head.starts_with("<!doctype html") || head.starts_with("<html") {
        return Ok(Sniffed::Html);
    }
    let lower = name.to_ascii_lowercase();
    if lower.ends_with(".md") || lower.ends_with(".markdown") {
        return Ok(Sniffed::Markdown);
    }
    Ok(Sniffed::Text)
}

/// `bytes` as text: UTF-8 (a byte-order mark dropped) without NUL characters.
fn text(bytes: &[u8]) -> Option<&str> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    std::str::from_utf8(bytes).ok().filter(|s| !s.contains('\0'))
}

/// An image as stored: its size, and the bytes the model is sent (with their type) when
/// they are not the upload's own: it was larger than [`MAX_IMAGE_EDGE`], or heavier than
/// [`MAX_SENT_IMAGE_BYTES`].
#[derive(Debug)]
pub struct Image {
    pub width: u32,
    pub height: u32,
    pub scaled: Option<(Vec<u8>, &'static str)>,
}

/// The size the model is sent an image of `width` × `height` at: within [`MAX_IMAGE_EDGE`]
/// on its longest side, proportions kept.
pub fn sent_size(width: u32, height: u32) -> (u32, u32) {
    let longest = width.max(height);
    if longest <= MAX_IMAGE_EDGE {
        return (width, height);
    }
    let scale = |side: u32| {
        ((u64::from(side) * u64::from(MAX_IMAGE_EDGE) + u64::from(longest) / 2) / u64::from(longest)).max(1)
            as u32
    };
    (scale(width), scale(height))
}

/// Decodes the image (bounded), and scales it down when it is larger than the model is
/// sent — deterministically: the same bytes always give the same scaled bytes.
pub fn image(kind: Sniffed, bytes: &[u8]) -> Result<Image, ApiError> {
    let format = kind.image_format().ok_or_else(|| ApiError::bad_request("not an image"))?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(limits_for_decode());
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| ApiError::bad_request(format!("the {} image cannot be read: {e}", kind.mime())))?;
    if width > MAX_IMAGE_SIDE
        || height > MAX_IMAGE_SIDE
        || u64::from(width) * u64::from(height) > MAX_IMAGE_PIXELS
    {
        return Err(ApiError::bad_request(format!(
            "the image is {width} × {height} pixels; at most {MAX_IMAGE_SIDE} on a side and {} million in all \
             are taken",
            MAX_IMAGE_PIXELS / 1_000_000
        )));
    }
    let (w, h) = sent_size(width, height);
    // Decoded even when it is not scaled, so a corrupt image is refused now, not by the model.
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(limits_for_decode());
    let decoded = reader
        .decode()
        .map_err(|e| ApiError::bad_request(format!("the {} image cannot be read: {e}", kind.mime())))?;
    if (w, h) == (width, height) && bytes.len() <= MAX_SENT_IMAGE_BYTES {
        return Ok(Image { width, height, scaled: None });
    }
    let resized = if (w, h) == (width, height) {
        decoded
    } else {
        decoded.resize_exact(w, h, image::imageops::FilterType::Lanczos3)
    };
    // A JPEG stays JPEG; anything else becomes PNG, or JPEG when that PNG is still heavy.
    let png = if kind == Sniffed::Jpeg { None } else { Some(encode(&resized, ImageFormat::Png)?) };
    let scaled = match png {
        Some(png) if png.len() <= MAX_SENT_IMAGE_BYTES => (png, "image/png"),
        _ => (encode(&resized, ImageFormat::Jpeg)?, "image/jpeg"),
    };
    Ok(Image { width, height, scaled: Some(scaled) })
}

fn encode(image: &DynamicImage, format: ImageFormat) -> Result<Vec<u8>, ApiError> {
    let mut out = Cursor::new(Vec::new());
    let written = match format {
        ImageFormat::Jpeg => {
            let encoder = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY);
            DynamicImage::ImageRgb8(image.to_rgb8()).write_with_encoder(encoder)
        }
        other => image.write_to(&mut out, other),
    };
    written.map_err(|e| ApiError::internal(anyhow::anyhow!("encoding a scaled image: {e}")))?;
    Ok(out.into_inner())
}

fn limits_for_decode() -> Limits {
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_DECODE_BYTES);
    limits
}

/// A document as markdown, and a note when its text could not be had.
#[derive(Debug)]
pub struct Markdown {
    pub markdown: String,
    pub note: Option<String>,
}

/// The note that stands in for a PDF without a text layer.
pub const NO_TEXT_LAYER: &str =
    "This PDF has no text layer (it is probably a scan or made of images), so no text could be extracted from it.";

/// Converts a document to markdown, refusing one whose markdown is over [`MAX_MARKDOWN_BYTES`].
pub async fn document(kind: Sniffed, bytes: &[u8]) -> Result<Markdown, ApiError> {
    let converted = match kind {
        Sniffed::Text | Sniffed::Markdown => {
            Markdown { markdown: text(bytes).unwrap_or_default().to_owned(), note: None }
        }
        Sniffed::Html => {
            Markdown { markdown: html(String::from_utf8_lossy(bytes).into_owned()).await?, note: None }
        }
        Sniffed::Pdf => pdf(bytes).await?,
        _ => return Err(ApiError::bad_request("not a document")),
    };
    let size = converted.markdown.len();
    if size > MAX_MARKDOWN_BYTES {
        return Err(ApiError::PayloadTooLarge(format!(
            "the document's text takes {} KiB as markdown, over the limit of {} KiB: send a shorter \
             document, or split it",
            size.div_ceil(1024),
            MAX_MARKDOWN_BYTES / 1024
        )));
    }
    Ok(converted)
}

/// HTML as markdown, by `htmd` (scripts, styles and the head dropped). The converter
/// recurses once per nesting level, so deeper documents are refused before it runs, and it
/// runs on a thread of its own with a large stack and a deadline.
async fn html(html: String) -> Result<String, ApiError> {
    let depth = nesting_depth(&html);
    if depth > MAX_HTML_DEPTH {
        return Err(ApiError::bad_request(format!(
            "the HTML document nests {depth} elements deep; at most {MAX_HTML_DEPTH} are read"
        )));
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("html-to-markdown".into())
        .stack_size(HTML_STACK_BYTES)
        .spawn(move || {
            let converted = htmd::HtmlToMarkdown::builder()
                .skip_tags(vec!["script", "style", "head", "noscript", "template", "iframe"])
                .build()
                .convert(&html);
            let _ = tx.send(converted);
        })
        .map_err(|e| ApiError::internal(anyhow::anyhow!("starting the HTML converter: {e}")))?;
    match tokio::time::timeout(HTML_TIMEOUT, rx).await {
        Ok(Ok(Ok(markdown))) => Ok(markdown),
        Ok(Ok(Err(e))) => Err(ApiError::bad_request(format!("the HTML document cannot be read: {e}"))),
        Ok(Err(_)) => Err(ApiError::internal(anyhow::anyhow!("the HTML converter stopped"))),
        Err(_) => Err(ApiError::bad_request(format!(
            "the HTML document could not be converted within {} s",
            HTML_TIMEOUT.as_secs()
        ))),
    }
}

/// How deep the elements of `html` nest, at most, as a parser would build them: start tags
/// open a level and end tags close one, except void elements and those whose end tag is
/// implied by the next sibling (`<p>`, `<li>`, `<td>`, …), which a parser never nests in
/// themselves. Over-counts at worst, for markup a parser would repair.
fn nesting_depth(html: &str) -> usize {
    const FLAT: [&str; 27] = [
        "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
        "track", "wbr", "p", "li", "dt", "dd", "tr", "td", "th", "option", "optgroup", "rb", "rt", "rp", "!",
    ];
    let bytes = html.as_bytes();
    let (mut depth, mut deepest, mut i) = (0usize, 0usize, 0usize);
    while let Some(at) = bytes[i..].iter().position(|&b| b == b'<') {
        i += at + 1;
        let closing = bytes.get(i) == Some(&b'/');
        let start = if closing { i + 1 } else { i };
        let name_len = bytes[start..].iter().take_while(|b| b.is_ascii_alphanumeric() || **b == b'!').count();
        if name_len == 0 {
            continue;
        }
        let name = html[start..start + name_len].to_ascii_lowercase();
        let flat = FLAT.contains(&name.as_str()) || name.starts_with('!');
        let self_closing = bytes[start..]
            .iter()
            .position(|&b| b == b'>')
            .is_some_and(|end| end > 0 && bytes[start + end - 1] == b'/');
        if closing {
            if !flat {
                depth = depth.saturating_sub(1);
            }
        } else if !flat && !self_closing {
            depth += 1;
            deepest = deepest.max(depth);
        }
    }
    deepest
}

/// A PDF's text by `pdftotext`, pages separated by a blank line.
async fn pdf(bytes: &[u8]) -> Result<Markdown, ApiError> {
    let file = TempFile::new("upload", "pdf");
    tokio::fs::write(file.path(), bytes)
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("writing {:?}: {e}", file.path())))?;
    let raw = run_pdftotext(file.path()).await?;
    let pages: Vec<&str> = raw.split('\u{c}').map(str::trim_end).collect();
    let markdown = pages.iter().filter(|p| !p.trim().is_empty()).copied().collect::<Vec<_>>().join("\n\n");
    if markdown.trim().is_empty() {
        return Ok(Markdown { markdown: format!("[{NO_TEXT_LAYER}]"), note: Some(NO_TEXT_LAYER.into()) });
    }
    Ok(Markdown { markdown, note: None })
}

/// A temporary file, removed when dropped (also when the request that made it is dropped).
pub(crate) struct TempFile(std::path::PathBuf);

impl TempFile {
    /// `turnlog-<name>-<a fresh id>.<extension>` in the temporary directory (not created).
    pub(crate) fn new(name: &str, extension: &str) -> Self {
        Self(std::env::temp_dir().join(format!("turnlog-{name}-{}.{extension}", uuid::Uuid::now_v7())))
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn run_pdftotext(path: &std::path::Path) -> Result<String, ApiError> {
    let child = tokio::process::Command::new("pdftotext")
        .args(["-q", "-enc", "UTF-8"])
        .arg(path)
        .arg("-")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::error!("a PDF was uploaded but pdftotext is not installed (Debian: poppler-utils)");
            return Err(ApiError::UnsupportedMediaType(
                "this server cannot read PDFs: its pdftotext (poppler-utils) is not installed".into(),
            ));
        }
        Err(e) => return Err(ApiError::internal(anyhow::anyhow!("starting pdftotext: {e}"))),
    };
    let mut out = Vec::new();
    let mut stdout = child.stdout.take().ok_or_else(|| ApiError::internal(anyhow::anyhow!("no stdout")))?;
    // Read at most a little over the markdown limit: more is refused anyway.
    let cap = (MAX_MARKDOWN_BYTES * 2) as u64;
    let run = async {
        (&mut stdout).take(cap).read_to_end(&mut out).await?;
        if out.len() as u64 >= cap {
            // Refused below; a blocked writer would otherwise run until the deadline.
            child.start_kill()?;
        }
        child.wait().await
    };
    let status = match tokio::time::timeout(PDF_TIMEOUT, run).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(ApiError::internal(anyhow::anyhow!("running pdftotext: {e}"))),
        Err(_) => {
            return Err(ApiError::bad_request(format!(
                "the PDF's text could not be extracted within {} s",
                PDF_TIMEOUT.as_secs()
            )))
        }
    };
    if out.len() as u64 >= cap {
        return Err(ApiError::PayloadTooLarge(format!(
            "the document's text is over the limit of {} KiB as markdown: send a shorter document, or split it",
            MAX_MARKDOWN_BYTES / 1024
        )));
    }
    if !status.success() {
        return Err(ApiError::bad_request(
            "the PDF cannot be read (pdftotext refused it: damaged or encrypted?)",
        ));
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_come_from_the_bytes() {
        let png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";
        assert_eq!(sniff("x.txt", png).unwrap(), Sniffed::Png);
        assert_eq!(sniff("x.png", b"%PDF-1.4\n").unwrap(), Sniffed::Pdf);
        assert_eq!(sniff("a.md", b"# Title\n").unwrap(), Sniffed::Markdown);
        assert_eq!(sniff("a.txt", b"# Title\n").unwrap(), Sniffed::Text);
        assert_eq!(sniff("a.png", b"  <!DOCTYPE html><p>x").unwrap(), Sniffed::Html);
        let zip = sniff("a.png", b"PK\x03\x04\x14\0\0\0\x08\0").unwrap_err();
        assert!(zip.to_string().contains("application/zip"), "{zip}");
        assert!(sniff("a.txt", &[0xff, 0xfe, 0x00, 0x41, 0x9c]).is_err());
        assert!(sniff("a.txt", b"").is_err());
    }

    #[test]
    fn large_images_are_scaled_to_the_longest_edge() {
        assert_eq!(sent_size(800, 600), (800, 600));
        assert_eq!(sent_size(3072, 1000), (1536, 500));
        assert_eq!(sent_size(1000, 4608), (333, 1536));
        let mut png = Cursor::new(Vec::new());
        DynamicImage::new_rgb8(2000, 1000).write_to(&mut png, ImageFormat::Png).unwrap();
        let a = image(Sniffed::Png, png.get_ref()).unwrap();
        let b = image(Sniffed::Png, png.get_ref()).unwrap();
        assert_eq!((a.width, a.height), (2000, 1000));
        let (scaled, mime) = a.scaled.unwrap();
        assert_eq!(mime, "image/png");
        assert_eq!(Some((scaled.clone(), mime)), b.scaled, "scaling is deterministic");
        let back = image::load_from_memory(&scaled).unwrap();
        assert_eq!((back.width(), back.height()), (1536, 768));
        assert!(image(Sniffed::Png, b"\x89PNG\r\n\x1a\nbroken").is_err());
        // A huge canvas in a small file is refused before it is decoded.
        let mut wide = Cursor::new(Vec::new());
        DynamicImage::new_luma8(16_000, 4_000).write_to(&mut wide, ImageFormat::Png).unwrap();
        let err = image(Sniffed::Png, wide.get_ref()).unwrap_err();
        assert!(err.to_string().contains("40 million"), "{err}");
    }

    #[tokio::test]
    async fn deeply_nested_html_is_refused_before_the_converter_recurses() {
        assert_eq!(nesting_depth("<html><body><p>a<p>b<br><img src=x/><div><b>c</b></div></body></html>"), 4);
        assert_eq!(nesting_depth("<ul><li>a<li>b<li>c</ul><!-- <x> --><!doctype html>"), 1);
        let deep = format!("<html><body>{}</body></html>", "<span>".repeat(5_000));
        let err = document(Sniffed::Html, deep.as_bytes()).await.unwrap_err();
        assert!(err.to_string().contains("nests"), "{err}");
        // As deep as is taken converts (on the converter's own large stack).
        let ok = format!("<html><body>{}x</body></html>", "<span>".repeat(MAX_HTML_DEPTH - 2));
        assert_eq!(document(Sniffed::Html, ok.as_bytes()).await.unwrap().markdown.trim(), "x");
    }

    #[tokio::test]
    async fn html_becomes_markdown_and_long_documents_are_refused() {
        let md = document(Sniffed::Html, b"<html><head><title>t</title><script>x()</script></head><body><h1>Hi</h1><p>a <b>b</b></p></body></html>")
            .await
            .unwrap();
        assert_eq!(md.markdown.trim(), "# Hi\n\na **b**");
        let long = "a".repeat(MAX_MARKDOWN_BYTES + 1);
        let err = document(Sniffed::Text, long.as_bytes()).await.unwrap_err();
        assert!(err.to_string().contains("512 KiB"), "{err}");
    }
}
