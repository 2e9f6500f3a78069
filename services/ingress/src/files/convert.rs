//! What an upload is, from its bytes alone (DESIGN §12): its type is sniffed, never taken
//! from the client; an image is measured and, when larger than the model is sent, scaled
//! once; a document becomes markdown once.
//!
//! PDFs go through Debian's `pdftotext` (poppler-utils): poppler is the reference-quality
//! extractor (fonts, encodings, columns) that most PDF tooling on Linux is built on, and as
//! a separate process with a deadline a hostile or broken PDF cannot take the ingress down
//! with it. The pure-Rust crates we looked at (`pdf-extract` over `lopdf`) lose text of
//! common fonts and are known to panic on malformed files.
//!
//! HTML goes through `htmd` the same way, in a process of its own (`turnlog convert-html`,
//! [`html_child`]): its converter recurses once a nesting level, its parser's time grows
//! with the square of the nesting, and a document of tiny elements parses into a tree of
//! tens of times its size. In a process with a deadline and a memory limit, none of
//! that can abort the ingress or keep running after its upload is answered.

use std::collections::HashMap;
use std::io::{Cursor, Write as _};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use image::{DynamicImage, ImageFormat, ImageReader, Limits};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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
/// `MAX_SENT_IMAGE_BYTES`.
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

/// How documents are converted.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The program whose `convert-html` converts HTML ([`html_child`]); None refuses HTML.
    pub html_program: Option<PathBuf>,
    /// The longest one conversion may take: its process is killed then.
    pub timeout: Duration,
}

/// Converts a document to markdown, refusing one whose markdown is over [`MAX_MARKDOWN_BYTES`].
pub async fn document(kind: Sniffed, bytes: &[u8], conversion: &Conversion) -> Result<Markdown, ApiError> {
    let converted = match kind {
        Sniffed::Text | Sniffed::Markdown => {
            Markdown { markdown: text(bytes).unwrap_or_default().to_owned(), note: None }
        }
        Sniffed::Html => Markdown { markdown: html(bytes, conversion).await?, note: None },
        Sniffed::Pdf => pdf(bytes, conversion.timeout).await?,
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

/// The 413 of a converter whose output ran past twice [`MAX_MARKDOWN_BYTES`] (and was stopped).
fn markdown_over_the_limit() -> ApiError {
    ApiError::PayloadTooLarge(format!(
        "the document's text is over the limit of {} KiB as markdown: send a shorter document, or split it",
        MAX_MARKDOWN_BYTES / 1024
    ))
}

/// `d` in seconds, as a person writes them (`30`, `0.5`).
fn seconds(d: Duration) -> String {
    d.as_secs_f64().to_string()
}

/// HTML as markdown, by `<program> convert-html` ([`html_child`]) in a process of its own:
/// whatever a document does to the converter (its recursion, its memory, its time) ends that
/// process, never the ingress; and the deadline kills it, so a conversion past its deadline
/// stops instead of running on beside the next (the cap on uploads converted at once bounds
/// the work actually running). A document plainly nested deeper than is read is refused
/// before a process starts.
async fn html(bytes: &[u8], conversion: &Conversion) -> Result<String, ApiError> {
    if nesting_depth(&String::from_utf8_lossy(bytes), MAX_HTML_DEPTH) > MAX_HTML_DEPTH {
        return Err(ApiError::bad_request(format!(
            "the HTML document nests more than {MAX_HTML_DEPTH} elements deep; at most {MAX_HTML_DEPTH} are read"
        )));
    }
    let Some(program) = &conversion.html_program else {
        tracing::error!("an HTML document was uploaded but this server has no HTML converter");
        return Err(ApiError::UnsupportedMediaType(
            "this server cannot convert HTML documents: it has no HTML converter".into(),
        ));
    };
    let mut child = tokio::process::Command::new(program)
        .arg("convert-html")
        // Nothing of the ingress's environment (tokens, keys) in a process reading uploads.
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            ApiError::internal(anyhow::anyhow!("starting the HTML converter {}: {e}", program.display()))
        })?;
    let (Some(mut stdin), Some(mut stdout), Some(mut stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(ApiError::internal(anyhow::anyhow!("the HTML converter has no pipes")));
    };
    // Read at most a little over the markdown limit: more is refused anyway.
    let cap = (MAX_MARKDOWN_BYTES * 2) as u64;
    let (mut out, mut why) = (Vec::new(), Vec::new());
    let run = async {
        // A converter that stops reading has failed: its exit status says how, not this write.
        let write = async move {
            let _ = stdin.write_all(bytes).await;
        };
        let read = async {
            (&mut stdout).take(cap).read_to_end(&mut out).await?;
            if out.len() as u64 >= cap {
                // Refused below; a blocked writer would otherwise run until the deadline.
                child.start_kill()?;
            }
            Ok::<_, std::io::Error>(())
        };
        let ((), read, read_why) = tokio::join!(write, read, read_capped(&mut stderr, 4096, &mut why));
        read?;
        read_why?;
        child.wait().await
    };
    let status = match tokio::time::timeout(conversion.timeout, run).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(ApiError::internal(anyhow::anyhow!("running the HTML converter: {e}"))),
        Err(_) => {
            // Gone before the upload's turn at conversion is handed on.
            let _ = child.kill().await;
            return Err(ApiError::bad_request(format!(
                "the HTML document could not be converted within {} s",
                seconds(conversion.timeout)
            )));
        }
    };
    if out.len() as u64 >= cap {
        return Err(markdown_over_the_limit());
    }
    let why = String::from_utf8_lossy(&why).trim().to_owned();
    match status.code() {
        Some(0) => Ok(String::from_utf8_lossy(&out).into_owned()),
        Some(HTML_REFUSED) => Err(ApiError::bad_request(why)),
        _ => {
            tracing::warn!(%status, stderr = %why, "the HTML converter failed");
            Err(ApiError::bad_request(
                "the HTML document could not be converted: the converter failed on it (too large or too \
                 intricate to convert)",
            ))
        }
    }
}

/// Reads `from` to its end, keeping its first `keep` bytes in `into`.
async fn read_capped(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    keep: usize,
    into: &mut Vec<u8>,
) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let room = keep.saturating_sub(into.len()).min(n);
        into.extend_from_slice(&buf[..room]);
    }
}

/// How deep the elements of `html` nest, about as a parser builds them, counted until past
/// `max`: a document plainly deeper than is read is refused at once, without a parse whose
/// time grows with the square of its nesting (the converter measures the tree it parsed
/// exactly). As a parser does: a start tag opens an element even when written `<span/>` (the
/// slash closes only void elements, and those inside `<svg>` and `<math>`); an end tag
/// closes the nearest open element of its name and those opened inside it, and nothing when
/// none is open; `<a>`, `<button>` and `<nobr>` close an open one of their kind. Void
/// elements and those a parser never nests in themselves (`<p>`, `<li>`, `<td>`, a table's
/// sections, `<body>`, …) are not counted; comments and the text of scripts and styles are
/// not markup.
fn nesting_depth(html: &str, max: usize) -> usize {
    const FLAT: [&str; 37] = [
        "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
        "track", "wbr", "keygen", "frame", "p", "li", "dt", "dd", "tr", "td", "th", "option", "optgroup",
        "rb", "rt", "rp", "rtc", "html", "head", "body", "tbody", "thead", "tfoot", "colgroup", "caption",
    ];
    const RAW_TEXT: [&str; 9] =
        ["script", "style", "textarea", "title", "xmp", "iframe", "noembed", "noframes", "noscript"];
    const ONE_AT_A_TIME: [&str; 3] = ["a", "button", "nobr"];
    let bytes = html.as_bytes();
    let mut open: Vec<String> = Vec::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    let close = |name: &str, open: &mut Vec<String>, counts: &mut HashMap<String, usize>| {
        if counts.get(name).copied().unwrap_or(0) == 0 {
            return;
        }
        while let Some(top) = open.pop() {
            match counts.get_mut(&top) {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    counts.remove(&top);
                }
            }
            if top == name {
                break;
            }
        }
    };
    let (mut deepest, mut i) = (0, 0);
    while deepest <= max {
        let Some(at) = bytes[i..].iter().position(|&b| b == b'<') else { break };
        i += at + 1;
        if bytes[i..].starts_with(b"!--") {
            i = find(bytes, i + 3, b"-->").map_or(bytes.len(), |end| end + 3);
            continue;
        }
        let closing = bytes.get(i) == Some(&b'/');
        let start = i + usize::from(closing);
        if !bytes.get(start).is_some_and(u8::is_ascii_alphabetic) {
            // `<!doctype …>`, `<?xml …?>`, or a `<` in text.
            continue;
        }
        let name_len = bytes[start..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b':' | b'_'))
            .count();
        let name = html[start..start + name_len].to_ascii_lowercase();
        let end = tag_end(bytes, start + name_len);
        i = end;
        if closing {
            close(&name, &mut open, &mut counts);
            continue;
        }
        let self_closing = end < bytes.len() && bytes[end - 1] == b'/';
        let foreign = ["svg", "math"].iter().any(|f| counts.get(*f).copied().unwrap_or(0) > 0 || name == *f);
        if FLAT.contains(&name.as_str()) || (self_closing && foreign) {
            continue;
        }
        if name == "plaintext" {
            // The rest is text.
            return deepest.max(open.len() + 1);
        }
        if ONE_AT_A_TIME.contains(&name.as_str()) {
            close(&name, &mut open, &mut counts);
        }
        if RAW_TEXT.contains(&name.as_str()) {
            i = raw_text_end(bytes, i, &name);
        }
        *counts.entry(name.clone()).or_default() += 1;
        open.push(name);
        deepest = deepest.max(open.len());
    }
    deepest
}

/// Where `needle` first occurs in `bytes` at or after `from`.
fn find(bytes: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    bytes.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|at| from + at)
}

/// The `>` that ends a tag whose attributes start at `from` (one inside a quoted attribute
/// value does not), or the end of `bytes`.
fn tag_end(bytes: &[u8], from: usize) -> usize {
    let (mut quote, mut after_equals) = (None, false);
    for (k, &b) in bytes[from..].iter().enumerate() {
        match quote {
            Some(q) if b == q => quote = None,
            Some(_) => continue,
            None if b == b'>' => return from + k,
            None if after_equals && (b == b'"' || b == b'\'') => {
                quote = Some(b);
                continue;
            }
            None => {}
        }
        if !b.is_ascii_whitespace() {
            after_equals = b == b'=';
        }
    }
    bytes.len()
}

/// Where the end tag of the raw-text element `name` (a script, a style, …) starts, at or
/// after `from`, or the end of `bytes`.
fn raw_text_end(bytes: &[u8], from: usize, name: &str) -> usize {
    let mut at = from;
    while let Some(tag) = find(bytes, at, b"</") {
        let named = bytes.get(tag + 2..tag + 2 + name.len());
        if named.is_some_and(|n| n.eq_ignore_ascii_case(name.as_bytes())) {
            return tag;
        }
        at = tag + 2;
    }
    bytes.len()
}

/// The exit status of `convert-html` when it refuses a document; why is on its stderr.
pub const HTML_REFUSED: i32 = 3;
/// The address space a conversion process may take: a 20 MiB document of tiny elements
/// parses into about 1 GiB of tree.
const HTML_MEMORY_BYTES: u64 = 2 * 1024 * 1024 * 1024;
/// The tags whose contents are not converted.
const HTML_SKIPPED: [&str; 6] = ["script", "style", "head", "noscript", "template", "iframe"];

/// `turnlog convert-html`: an HTML document on stdin, its markdown on stdout (exit 0), or
/// why it is refused on stderr (exit [`HTML_REFUSED`]). The ingress runs it as a process of
/// its own for each HTML upload, so a document that exhausts the stack, the memory or the
/// deadline ends this process, never the ingress.
pub fn html_child() -> i32 {
    use nix::sys::resource::{setrlimit, Resource};
    // When memory runs out, the kernel stops this process rather than anything else; and a
    // crash leaves no core behind.
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    let limited = setrlimit(Resource::RLIMIT_AS, HTML_MEMORY_BYTES, HTML_MEMORY_BYTES)
        .and_then(|()| setrlimit(Resource::RLIMIT_CORE, 0, 0));
    if let Err(e) = limited {
        eprintln!("limiting the converter's resources: {e}");
        return 1;
    }
    let mut html = Vec::new();
    if let Err(e) = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut html) {
        eprintln!("reading the HTML document: {e}");
        return 1;
    }
    match html_on_a_large_stack(html) {
        Ok(Ok(markdown)) => {
            let mut out = std::io::stdout().lock();
            match out.write_all(markdown.as_bytes()).and_then(|()| out.flush()) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("writing the markdown: {e}");
                    1
                }
            }
        }
        Ok(Err(refused)) => {
            eprint!("{refused}");
            HTML_REFUSED
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// [`html_to_markdown`] on a thread with room for [`MAX_HTML_DEPTH`] levels of recursion;
/// an error when the converter could not run or panicked (its message is on stderr).
fn html_on_a_large_stack(html: Vec<u8>) -> Result<Result<String, HtmlRefused>, ConverterFailed> {
    std::thread::Builder::new()
        .name("html-to-markdown".into())
        .stack_size(HTML_STACK_BYTES)
        .spawn(move || html_to_markdown(&String::from_utf8_lossy(&html)))
        .map_err(ConverterFailed::Thread)?
        .join()
        .map_err(|_| ConverterFailed::Panicked)
}

/// Why the converter did not run to its end (a process error, not a refused document).
#[derive(Debug, thiserror::Error)]
enum ConverterFailed {
    #[error("starting the converter's thread: {0}")]
    Thread(std::io::Error),
    #[error("the converter panicked")]
    Panicked,
}

/// Why an HTML document is refused: what `convert-html` writes on its stderr.
#[derive(Debug, thiserror::Error)]
pub enum HtmlRefused {
    #[error("the HTML document cannot be read: {0}")]
    Unreadable(std::io::Error),
    #[error("the HTML document nests {0} elements deep; at most {MAX_HTML_DEPTH} are read")]
    TooDeep(usize),
}

/// HTML as markdown by `htmd` (scripts, styles and the head dropped), or why not: the tree
/// the parser built is measured before the converter, which recurses once a level, walks it.
pub fn html_to_markdown(html: &str) -> Result<String, HtmlRefused> {
    let converter = htmd::HtmlToMarkdown::builder().skip_tags(HTML_SKIPPED.to_vec()).build();
    let tree = converter.html_to_tree(html).map_err(HtmlRefused::Unreadable)?;
    let depth = tree_depth(&tree);
    if depth > MAX_HTML_DEPTH {
        return Err(HtmlRefused::TooDeep(depth));
    }
    Ok(converter.tree_to_markdown(&tree))
}

/// How deep the nodes that hold others nest below the document: the levels the converter
/// recurses through (a leaf, such as a text, adds none). Measured without recursing.
fn tree_depth(document: &std::rc::Rc<htmd::Node>) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(std::rc::Rc::clone(document), 0usize)];
    while let Some((node, depth)) = pending.pop() {
        let children = node.children.borrow();
        if !children.is_empty() {
            deepest = deepest.max(depth);
            pending.extend(children.iter().map(|c| (std::rc::Rc::clone(c), depth + 1)));
        }
    }
    deepest
}

/// A PDF's text by `pdftotext`, pages separated by a blank line.
async fn pdf(bytes: &[u8], timeout: Duration) -> Result<Markdown, ApiError> {
    let file = TempFile::new("upload", "pdf");
    tokio::fs::write(file.path(), bytes)
        .await
        .map_err(|e| ApiError::internal(anyhow::anyhow!("writing {:?}: {e}", file.path())))?;
    let raw = run_pdftotext(file.path(), timeout).await?;
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

async fn run_pdftotext(path: &std::path::Path, timeout: Duration) -> Result<String, ApiError> {
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
    let status = match tokio::time::timeout(timeout, run).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(ApiError::internal(anyhow::anyhow!("running pdftotext: {e}"))),
        Err(_) => {
            // Gone before the upload's turn at conversion is handed on.
            let _ = child.kill().await;
            return Err(ApiError::bad_request(format!(
                "the PDF's text could not be extracted within {} s",
                seconds(timeout)
            )));
        }
    };
    if out.len() as u64 >= cap {
        return Err(markdown_over_the_limit());
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

    #[test]
    fn nesting_is_counted_as_a_parser_builds_it() {
        let depth = |html: &str| nesting_depth(html, 10_000);
        assert_eq!(depth("<html><body><p>a<p>b<br><img src=x/><div><b>c</b></div></body></html>"), 2);
        assert_eq!(depth("<ul><li>a<li>b<li>c</ul><!-- <x> --><!doctype html>"), 1);
        // A slash closes only void elements: `<span/>` opens a span.
        assert_eq!(depth(&"<span/>".repeat(300)), 300);
        // A stray end tag closes nothing; one closes the elements opened inside its own.
        assert_eq!(depth("<div><div></b></i></span><div>"), 3);
        assert_eq!(depth("<div></div></div></div><div><span><i></div><div>"), 3);
        // Inside SVG and MathML a slash closes.
        assert_eq!(depth(&format!("<svg>{}<g><circle/></g></svg><div>", "<path d='M0 0'/>".repeat(50))), 2);
        // Comments, scripts and quoted attributes are not markup.
        let quiet = "<!-- <div><div> --><script>if (a<b) w('<div><div>')</script><style>a<b{}</style>";
        assert_eq!(depth(quiet), 1);
        assert_eq!(depth(&r#"<div title="/>" data-x='>'>"#.repeat(3)), 3);
        // A link inside a link closes it.
        assert_eq!(depth("<a href=1><a href=2><a>"), 1);
        // Counting stops once past the limit.
        assert_eq!(nesting_depth(&"<i>".repeat(100_000), 100), 101);
    }

    #[test]
    fn the_converter_measures_the_tree_the_parser_built() {
        // A table's implied body, row and cell nest four deep for each `<table><td>`.
        let tables = format!("<html><body>{}x</body></html>", "<table><td>".repeat(600));
        assert!(nesting_depth(&tables, MAX_HTML_DEPTH) <= MAX_HTML_DEPTH, "the quick count passes it");
        let err = html_on_a_large_stack(tables.into_bytes()).unwrap().unwrap_err().to_string();
        assert!(err.contains("nests 240"), "{err}");
        let deep = format!("<html><body>{}</body></html>", "<span/>".repeat(5_000));
        let err = html_on_a_large_stack(deep.into_bytes()).unwrap().unwrap_err().to_string();
        assert!(err.contains("nests 5001"), "{err}");
        // As deep as is taken converts (on the converter's own large stack).
        let ok = format!("<html><body>{}x</body></html>", "<span>".repeat(MAX_HTML_DEPTH - 2));
        assert_eq!(html_on_a_large_stack(ok.into_bytes()).unwrap().unwrap().trim(), "x");
    }

    #[tokio::test]
    async fn html_becomes_markdown_and_long_documents_are_refused() {
        let page = b"<html><head><title>t</title><script>x()</script></head><body><h1>Hi</h1><p>a <b>b</b></p></body></html>";
        let md = html_on_a_large_stack(page.to_vec()).unwrap().unwrap();
        assert_eq!(md.trim(), "# Hi\n\na **b**");
        let conversion = Conversion { html_program: None, timeout: Duration::from_secs(30) };
        let long = "a".repeat(MAX_MARKDOWN_BYTES + 1);
        let err = document(Sniffed::Text, long.as_bytes(), &conversion).await.unwrap_err();
        assert!(err.to_string().contains("512 KiB"), "{err}");
    }
}
