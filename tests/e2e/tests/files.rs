//! Files (DESIGN §12) over HTTP against real Postgres, NATS and blob stores — a local
//! directory and an S3-compatible server (moto) — with the mock model: uploads are sniffed
//! and converted once, sends name file ids, the model gets data URLs built per request
//! while the log keeps references, and owners, deletes, restarts and rebuilds hold.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::Cursor;
use std::time::Duration;

use base64::Engine as _;
use reqwest::Method;
use serde_json::{json, Value};
use turnlog_e2e::api::{Api, Body, Options, ALICE, BOB};
use turnlog_e2e::s3::S3;
use turnlog_mock_llm::{LoggedRequest, MockConfig, MockHandle};
use turnlog_ops::Verdict;

/// A PNG of `w` × `h` pixels (a gradient, so it does not compress to nothing).
fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 128]));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A one-page PDF; with `text`, that text in Helvetica, else an empty page (no text
/// layer, as a scan has none).
fn pdf(text: Option<&str>) -> Vec<u8> {
    let content = text.map_or_else(String::new, |t| format!("BT /F1 18 Tf 72 720 Td ({t}) Tj ET"));
    let objects = [
        "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>".to_owned(),
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>"
            .to_owned(),
        format!("<< /Length {} >>\nstream\n{content}\nendstream", content.len()),
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_owned(),
    ];
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n{body}\nendobj\n", i + 1).as_bytes());
    }
    let xref = out.len();
    out.extend_from_slice(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).as_bytes());
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!("trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n", objects.len() + 1)
            .as_bytes(),
    );
    out
}

/// What `turnlog convert-html` runs, built with these tests.
const CONVERTER: &str = env!("CARGO_BIN_EXE_turnlog-e2e-convert-html");

fn with_converter(config: &mut turnlog_ingress::IngressConfig) {
    config.html_converter = Some(CONVERTER.into());
}

async fn stack(files_url: Option<String>) -> (MockHandle, Api) {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        files_url,
        file_sweep_every: Some(Duration::from_millis(200)),
        ingress: Some(with_converter),
        ..Options::default()
    })
    .await;
    (mock, api)
}

#[track_caller]
fn uploaded(r: &turnlog_e2e::api::Reply) -> String {
    assert_eq!(r.status, 201, "{}", r.text);
    r.json["id"].as_str().unwrap().to_owned()
}

/// The chat requests the mock received.
fn chats(mock: &MockHandle) -> Vec<LoggedRequest> {
    mock.log().entries().into_iter().filter(|r| r.path.ends_with("/chat/completions")).collect()
}

/// Every `image_url` URL and every text of a request's messages.
fn parts(request: &Value) -> (Vec<String>, String) {
    let mut urls = Vec::new();
    let mut text = String::new();
    for m in request["messages"].as_array().unwrap() {
        match &m["content"] {
            Value::String(s) => text.push_str(s),
            Value::Array(parts) => {
                for p in parts {
                    match p["type"].as_str() {
                        Some("image_url") => urls.push(p["image_url"]["url"].as_str().unwrap().to_owned()),
                        _ => text.push_str(p["text"].as_str().unwrap_or_default()),
                    }
                    text.push('\n');
                }
            }
            _ => {}
        }
    }
    (urls, text)
}

/// Upload, send with an image and a PDF, the model's view on two turns, the log's size,
/// the transcript, the audit, the routes' owners, delete and the sweep — on `files_url`.
async fn round_trip(files_url: Option<String>) {
    let (mock, api) = stack(files_url.clone()).await;
    let big = png(2000, 1000);
    let image = api.upload(ALICE, "screen.png", &big).await;
    let image_id = uploaded(&image);
    assert_eq!(image.json["kind"], "image");
    assert_eq!(image.json["mime"], "image/png");
    assert_eq!((image.json["width"].as_i64(), image.json["height"].as_i64()), (Some(2000), Some(1000)));
    assert_eq!(image.json["bytes"].as_u64(), Some(big.len() as u64));
    let doc = api.upload(ALICE, "report.pdf", &pdf(Some("Quarterly revenue grew 12 percent"))).await;
    let doc_id = uploaded(&doc);
    assert_eq!(
        (doc.json["kind"].as_str(), doc.json["mime"].as_str()),
        (Some("document"), Some("application/pdf"))
    );
    assert!(doc.json["markdown_chars"].as_i64().unwrap() > 20, "{}", doc.text);

    let id = api.create(ALICE, None).await;
    let path = format!("/v1/sessions/{id}/messages");
    let body = json!({"text": "What do these show?", "images": [image_id], "documents": [doc_id]});
    let turn = api.turn(Method::POST, &path, ALICE, Some(body), &[]).await;
    assert_eq!(turn.status, 200, "{:?}", turn.json);
    assert!(turn.end()["error"].is_null(), "{:?}", turn.end());

    let first = chats(&mock).pop().unwrap();
    let (urls, text) = parts(&first.body);
    assert_eq!(urls.len(), 1, "one data URL for the one image");
    let b64 = urls[0].strip_prefix("data:image/png;base64,").expect("a PNG data URL");
    let sent =
        image::load_from_memory(&base64::engine::general_purpose::STANDARD.decode(b64).unwrap()).unwrap();
    assert_eq!((sent.width(), sent.height()), (1536, 768), "scaled to the longest edge");
    assert!(text.contains("Quarterly revenue grew 12 percent"), "the PDF's text reaches the model: {text}");
    assert!(text.contains("[document report.pdf (application/pdf)]"), "{text}");

    // The next turn sends the image again, byte for byte (a stable, cacheable prefix).
    let next = api.message(id, ALICE, "And the trend?").await;
    assert!(next.end()["error"].is_null(), "{:?}", next.end());
    let second = chats(&mock).pop().unwrap();
    assert_eq!(parts(&second.body).0, urls, "the same data URL on the next turn");

    // The log holds references: a few KB, never bytes.
    let payloads: Vec<String> =
        sqlx::query_scalar("SELECT payload::text FROM session_events WHERE session_id = $1")
            .bind(id.0)
            .fetch_all(&api.env.pool)
            .await
            .unwrap();
    let total: usize = payloads.iter().map(String::len).sum();
    assert!(total < 8 * 1024, "the log takes {total} bytes");
    assert!(payloads.iter().all(|p| !p.contains("base64")), "no bytes in the log");
    let user: Value =
        serde_json::from_str(payloads.iter().find(|p| p.contains("What do these show")).unwrap()).unwrap();
    assert_eq!(user["images"], json!([{"id": image_id, "mime": "image/png", "width": 1536, "height": 768}]));
    assert_eq!(user["documents"][0]["name"], "report.pdf");

    // The transcript shows references; the audit rebuilds the request, images included.
    let transcript = api.get(&format!("/v1/sessions/{id}"), ALICE).await;
    let item = &transcript.json["items"][0];
    assert_eq!(item["images"][0]["id"], image_id.as_str(), "{}", transcript.text);
    assert_eq!(item["documents"][0]["name"], "report.pdf");
    assert!(item["documents"][0].get("markdown").is_none(), "the UI gets a reference");
    let answer_seq = transcript.json["items"][1]["seq"].as_i64().unwrap();
    let audit = api.get(&format!("/v1/sessions/{id}/requests/{answer_seq}"), ALICE).await;
    assert_eq!(audit.status, 200, "{}", audit.text);
    assert_eq!(audit.json["verified"], true, "{}", audit.text);

    // The routes: list, metadata, bytes, each owner's own.
    let list = api.get("/v1/files", ALICE).await;
    assert_eq!(list.json["files"].as_array().unwrap().len(), 2, "{}", list.text);
    let content = api.get(&format!("/v1/files/{image_id}/content"), ALICE).await;
    assert_eq!(content.status, 200);
    assert_eq!(content.headers["content-type"], "image/png");
    assert_eq!(content.headers["x-content-type-options"], "nosniff");
    assert!(content.headers.get("content-disposition").is_none(), "an image shows inline");
    let pdf_content = api.get(&format!("/v1/files/{doc_id}/content"), ALICE).await;
    assert!(pdf_content.headers["content-disposition"].to_str().unwrap().starts_with("attachment"));
    for path in [format!("/v1/files/{image_id}"), format!("/v1/files/{image_id}/content")] {
        assert_eq!(api.get(&path, BOB).await.status, 404, "{path}");
    }
    assert!(api.get("/v1/files", BOB).await.json["files"].as_array().unwrap().is_empty());
    let bob_del = api.call(Method::DELETE, &format!("/v1/files/{image_id}"), Some(BOB), Body::None).await;
    assert_eq!(bob_del.status, 404);
    let bobs = api.create(BOB, None).await;
    let stolen = json!({"text": "mine now", "images": [image_id]});
    let r = api.turn(Method::POST, &format!("/v1/sessions/{bobs}/messages"), BOB, Some(stolen), &[]).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"));

    // Deleted: no longer sendable (the same 400), still shown where a message attached it.
    let del = api.call(Method::DELETE, &format!("/v1/files/{doc_id}"), Some(ALICE), Body::None).await;
    assert_eq!(del.status, 204, "{}", del.text);
    let again = json!({"text": "once more", "documents": [doc_id]});
    let r = api.turn(Method::POST, &path, ALICE, Some(again), &[]).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"));
    assert!(r.json["error"]["message"].as_str().unwrap().contains("not one of your files"));
    assert_eq!(api.get("/v1/files", ALICE).await.json["files"].as_array().unwrap().len(), 1);
    assert!(api.get(&format!("/v1/files/{doc_id}"), ALICE).await.json["deleted_at"].is_string());

    // The sweep (every 200 ms here, without the delay) keeps what a stored message refers
    // to and removes the rest, once.
    let loose = uploaded(&api.upload(ALICE, "loose.md", b"# scratch\n").await);
    api.call(Method::DELETE, &format!("/v1/files/{loose}"), Some(ALICE), Body::None).await;
    let swept_at = |id: String| {
        let pool = api.env.pool.clone();
        async move {
            let at: Option<String> =
                sqlx::query_scalar("SELECT swept_at::text FROM files WHERE id = $1::uuid")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            at
        }
    };
    turnlog_testkit::eventually(Duration::from_secs(15), || {
        let swept = swept_at(loose.clone());
        async move { swept.await.is_some().then_some(()) }
    })
    .await;
    assert_eq!(api.get(&format!("/v1/files/{loose}/content"), ALICE).await.status, 404);
    // An image a stored message refers to is kept too, deleted or not: the next turn still
    // sends its bytes.
    let del = api.call(Method::DELETE, &format!("/v1/files/{image_id}"), Some(ALICE), Body::None).await;
    assert_eq!(del.status, 204, "{}", del.text);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for referenced in [&doc_id, &image_id] {
        assert!(swept_at(referenced.clone()).await.is_none(), "a referenced file is not swept");
        assert_eq!(api.get(&format!("/v1/files/{referenced}/content"), ALICE).await.status, 200);
    }
    let later = api.message(id, ALICE, "and the picture again").await;
    assert!(later.end()["error"].is_null(), "{:?}", later.end());
    assert_eq!(parts(&chats(&mock).pop().unwrap().body).0.len(), 1, "the deleted image is still sent");
    api.stop().await;
    mock.stop().await.unwrap();
}

/// An upload's type comes from its bytes, whatever its name claims: a PNG named `.txt` is
/// an image, text named `.png` a text document, HTML named `.pdf` HTML, an archive named
/// `.png` a 415.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploads_type_comes_from_its_bytes_not_its_name() {
    let (mock, api) = stack(None).await;
    for (name, bytes, kind, mime) in [
        ("notes.txt", png(8, 8), "image", "image/png"),
        ("photo.png", b"just words, not a picture".to_vec(), "document", "text/plain"),
        ("report.pdf", b"<!doctype html><p>hello</p>".to_vec(), "document", "text/html"),
    ] {
        let r = api.upload(ALICE, name, &bytes).await;
        assert_eq!(r.status, 201, "{name}: {}", r.text);
        assert_eq!((r.json["kind"].as_str(), r.json["mime"].as_str()), (Some(kind), Some(mime)), "{name}");
    }
    let r = api.upload(ALICE, "image.png", b"PK\x03\x04\x14\0\0\0\x08\0rest").await;
    assert_eq!(r.status, 415, "{}", r.text);
    api.stop().await;
    mock.stop().await.unwrap();
}

/// The files URL the harness gave the ingress.
fn blob_url(api: &Api, configured: Option<&str>) -> String {
    configured.map_or_else(
        || {
            let dir = std::env::temp_dir().join("turnlog-test-files").join(&api.env.bus_prefix);
            format!("file://{}", dir.display())
        },
        str::to_owned,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_on_the_filesystem() {
    round_trip(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_on_s3() {
    let s3 = S3::start().await;
    round_trip(Some(s3.bucket().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_and_bad_sends_are_clear_client_errors() {
    let (mock, api) = stack(None).await;
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("a.zip", b"PK\x03\x04\x14\0\0\0\x08\0rest".to_vec(), 415, "application/zip"),
        ("a.bin", vec![0xff, 0xfe, 0x00, 0x9c, 0x01], 415, "not recognized"),
        ("a.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDRbroken".to_vec(), 400, "cannot be read"),
        ("a.txt", Vec::new(), 400, "empty"),
        ("long.md", "word ".repeat(120_000).into_bytes(), 413, "512 KiB"),
        ("huge.png", vec![0; 20 * 1024 * 1024 + 1], 413, "over the limit"),
    ];
    for (name, bytes, status, says) in cases {
        let r = api.upload(ALICE, name, &bytes).await;
        assert_eq!(r.status, status, "{name}: {}", r.text);
        assert!(r.json["error"]["message"].as_str().unwrap().contains(says), "{name}: {}", r.text);
    }
    // Not multipart, or no `file` field.
    let r = api.call(Method::POST, "/v1/files", Some(ALICE), Body::Json(json!({"file": "x"}))).await;
    assert_eq!(r.status, 415, "{}", r.text);
    let empty = api
        .request(Method::POST, "/v1/files")
        .bearer_auth(ALICE)
        .header("content-type", "multipart/form-data; boundary=b")
        .body("--b\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--b--\r\n");
    let r = api.send(empty).await;
    assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{}", r.text);
    assert_eq!(api.call(Method::POST, "/v1/files", None, Body::None).await.status, 401);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM files").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(rows, 0, "no metadata for refused uploads");

    // Conversions: HTML to markdown (scripts dropped), a scan's clear note.
    let html = api
        .upload(ALICE, "page.html", b"<!doctype html><html><head><script>steal()</script></head><body><h2>Plan</h2><ul><li>ship</li></ul></body></html>")
        .await;
    let html_id = uploaded(&html);
    assert_eq!(html.json["mime"], "text/html");
    let scan = api.upload(ALICE, "scan.pdf", &pdf(None)).await;
    let scan_id = uploaded(&scan);
    assert!(scan.json["note"].as_str().unwrap().contains("no text layer"), "{}", scan.text);
    let image_id = uploaded(&api.upload(ALICE, "tiny.png", &png(40, 30)).await);

    let id = api.create(ALICE, None).await;
    let path = format!("/v1/sessions/{id}/messages");
    let bad_sends = [
        json!({"text": "x", "images": ["not-a-uuid"]}),
        json!({"text": "x", "images": [uuid::Uuid::now_v7().to_string()]}),
        json!({"text": "x", "documents": [image_id]}),
        json!({"text": "x", "images": [html_id]}),
    ];
    for body in bad_sends {
        let r = api.turn(Method::POST, &path, ALICE, Some(body.clone()), &[]).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{body}: {:?}", r.json);
    }
    let body = json!({"text": "summarize", "documents": [html_id, scan_id]});
    let turn = api.turn(Method::POST, &path, ALICE, Some(body), &[]).await;
    assert!(turn.end()["error"].is_null(), "{:?}", turn.end());
    let (_, text) = parts(&chats(&mock).pop().unwrap().body);
    assert!(text.contains("## Plan") && text.contains("ship") && !text.contains("steal"), "{text}");
    assert!(text.contains("no text layer"), "{text}");
    api.stop().await;
    mock.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_cannot_see_images_gets_a_note_and_the_budget_counts_tiles() {
    let mock = turnlog_mock_llm::spawn(MockConfig::default()).await.unwrap();
    let api = Api::with(Options {
        llm_url: Some(mock.base_url()),
        vision_models: Some(vec!["mock-vision".into()]),
        ..Options::default()
    })
    .await;
    let image_id = uploaded(&api.upload(ALICE, "photo.png", &png(1024, 1024)).await);
    let id = api.create(ALICE, None).await;
    let body = json!({"text": "what is this?", "images": [image_id]});
    let turn = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    assert!(turn.end()["error"].is_null(), "{:?}", turn.end());
    let (urls, text) = parts(&chats(&mock).pop().unwrap().body);
    assert!(urls.is_empty(), "no image for a model outside TURNLOG_VISION_MODELS");
    assert!(text.contains(&format!("[image {image_id} (image/png) unavailable]")), "{text}");
    // The event's stored cost includes the image by the tile rule: 1024² → 4 tiles, 765.
    let tokens: i32 = sqlx::query_scalar(
        "SELECT tokens FROM session_events WHERE session_id = $1 AND kind = 'user_message'",
    )
    .bind(id.0)
    .fetch_one(&api.env.pool)
    .await
    .unwrap();
    let text_only = turnlog_core::tokens::count("what is this?") + turnlog_core::tokens::MESSAGE_OVERHEAD;
    assert_eq!(tokens as u32, text_only + 765);
    api.stop().await;
    mock.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_survive_a_restart_and_a_rebuild_restores_them() {
    let (mock, api) = stack(None).await;
    let files_url = blob_url(&api, None);
    let image_id = uploaded(&api.upload(ALICE, "a.png", &png(64, 64)).await);
    let doc_id = uploaded(&api.upload(ALICE, "notes.md", b"# Notes\n- keep\n").await);
    let gone = uploaded(&api.upload(ALICE, "gone.txt", b"bye").await);
    api.call(Method::DELETE, &format!("/v1/files/{gone}"), Some(ALICE), Body::None).await;
    let id = api.create(ALICE, None).await;
    let body = json!({"text": "look", "images": [image_id], "documents": [doc_id]});
    let turn = api.turn(Method::POST, &format!("/v1/sessions/{id}/messages"), ALICE, Some(body), &[]).await;
    assert!(turn.end()["error"].is_null(), "{:?}", turn.end());
    let sent = parts(&chats(&mock).pop().unwrap().body).0;
    assert_eq!(sent.len(), 1);
    let bus = api.bus.clone();
    let env = api.stop().await;

    // Restarted on the same database, bus and files.
    let mut configs = turnlog_e2e::config::stack(&env);
    configs.ingress.tokens = turnlog_ingress::ApiTokens::parse(turnlog_e2e::api::TOKENS).unwrap();
    configs.ingress.upstream = Some(turnlog_e2e::config::upstream_at(&mock.base_url()));
    configs.ingress.files_url = Some(files_url);
    let api = Api::on(env, configs).await;
    assert_eq!(api.get("/v1/files", ALICE).await.json["files"].as_array().unwrap().len(), 2);
    assert_eq!(api.get(&format!("/v1/files/{image_id}/content"), ALICE).await.status, 200);
    let next = api.message(id, ALICE, "and again").await;
    assert!(next.end()["error"].is_null(), "{:?}", next.end());
    assert_eq!(parts(&chats(&mock).pop().unwrap().body).0, sent, "the same data URL after the restart");

    // A rebuild from the APPEND stream restores the files table exactly (compared once the
    // live search index, which trails the log, has caught up: a rebuild indexes everything).
    api.env.search_caught_up().await;
    let target = api.env.extra_database().await;
    turnlog_ops::rebuild(&target, &bus, false).await.expect("rebuild");
    let verdict = turnlog_ops::verify(&api.env.database_url, &target).await.expect("verify");
    assert!(matches!(verdict, Verdict::Identical { files: 3, .. }), "{verdict}");
    api.stop().await;
    mock.stop().await.unwrap();
}

/// Chat front ends (Open WebUI) send an image as a data URL inside the message, and resend
/// it with the history on every request: a session family stores it once, as a file, and
/// the log keeps the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_store_a_data_url_image_once_and_keep_a_reference() {
    let (mock, api) = stack(None).await;
    let picture = base64::engine::general_purpose::STANDARD.encode(png(300, 200));
    let url = format!("data:image/png;base64,{picture}");
    let first = json!([{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]);
    let chat_in = |family: &'static str, messages: Value| {
        let req = api
            .request(Method::POST, "/v1/chat/completions")
            .bearer_auth(ALICE)
            .header("X-Session-Id", family)
            .json(&json!({"model": "mock", "messages": messages}));
        api.send(req)
    };
    let chat = |messages: Value| chat_in("owui-chat-1", messages);
    let r = chat(first.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let answer = r.json["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    assert_eq!(parts(&chats(&mock).pop().unwrap().body).0, vec![url.clone()], "the model sees the image");

    // The history comes back whole, the image again, with a new question.
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": answer}));
    second.push(json!({"role": "user", "content": "And the colours?"}));
    let r = chat(Value::Array(second)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(parts(&chats(&mock).pop().unwrap().body).0, vec![url], "resent from the store");

    let files: i64 = sqlx::query_scalar("SELECT count(*) FROM files").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(files, 1, "one file for the image sent twice");
    let payloads: Vec<String> = sqlx::query_scalar("SELECT payload::text FROM session_events")
        .fetch_all(&api.env.pool)
        .await
        .unwrap();
    assert!(payloads.iter().all(|p| !p.contains("base64")), "no bytes in the log");
    let with_images: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM session_events WHERE kind = 'user_message' AND payload ? 'images'",
    )
    .fetch_one(&api.env.pool)
    .await
    .unwrap();
    assert_eq!(with_images, 1, "the first message keeps the reference, the second has none");

    // An image by address, or one in a system message, is a clear 400.
    let remote = json!([{"role": "user", "content": [
        {"type": "text", "text": "and this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]}]);
    let r = chat_in("owui-chat-2", remote).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("data URL"), "{}", r.text);
    api.stop().await;
    mock.stop().await.unwrap();
}

/// HTML no parser would nest as written still cannot take the ingress down: `<span/>` opens
/// an element (the slash closes only void ones), so 200,000 of them nest 200,000 deep,
/// which once overflowed the converter's stack and aborted the whole process; markup whose
/// tree is deeper than it reads (a table's implied body, row and cell) is measured as the
/// parser builds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn html_nested_past_the_limit_is_refused_and_never_takes_the_ingress_down() {
    let (mock, api) = stack(None).await;
    let spans = format!("<!doctype html><html><body>{}</body></html>", "<span/>".repeat(200_000));
    let tables = format!("<!doctype html><html><body>{}x</body></html>", "<table><td>".repeat(600));
    for (name, html) in [("spans.html", spans.as_str()), ("tables.html", tables.as_str())] {
        let r = api.upload(ALICE, name, html.as_bytes()).await;
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{name}: {}", r.text);
        assert!(r.json["error"]["message"].as_str().unwrap().contains("nests"), "{name}: {}", r.text);
    }
    // Still serving, and HTML within the limit converts.
    let page = format!("<!doctype html><html><body>{}deep</body></html>", "<div>".repeat(1_900));
    let r = api.upload(ALICE, "page.html", page.as_bytes()).await;
    assert_eq!(r.status, 201, "{}", r.text);
    api.stop().await;
    mock.stop().await.unwrap();
}

/// The HTML conversions running for this process now: converter threads of its own and
/// converter processes it started (not yet exited).
fn conversions_running() -> usize {
    let threads = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "html-to-markdow")
        })
        .count();
    let me = std::process::id().to_string();
    let children = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| std::fs::read_to_string(p.path().join("stat")).ok())
        .filter(|stat| {
            // pid (comm) state ppid …; the name of the converter cut to 15 bytes.
            let Some((head, rest)) = stat.rsplit_once(") ") else { return false };
            let mut fields = rest.split(' ');
            let (state, ppid) = (fields.next(), fields.next());
            head.contains("(turnlog-e2e-con") && state != Some("Z") && ppid == Some(me.as_str())
        })
        .count();
    threads + children
}

/// A conversion past its deadline stops (its process is killed), so the cap on uploads
/// converted at once (4) bounds the work actually running: 8 slow documents never have more
/// than 4 conversions running, and none is left once they are answered. A converter thread
/// that was only abandoned at the deadline kept burning CPU for minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversions_stop_at_their_deadline_and_the_cap_bounds_those_running() {
    fn short_deadline(config: &mut turnlog_ingress::IngressConfig) {
        with_converter(config);
        config.convert_timeout = Duration::from_secs(1);
    }
    let api = Api::with(Options { ingress: Some(short_deadline), ..Options::default() }).await;
    // Within the nesting limit, but the converter's walk takes time in the nesting times
    // the elements: half a minute and more.
    let slow = format!("{}{}", "<div>".repeat(1_990), "<b>x</b>".repeat(400_000));
    let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let watching = tokio_util::sync::CancellationToken::new();
    let watcher = tokio::spawn({
        let (most, watching) = (most.clone(), watching.clone());
        async move {
            while !watching.is_cancelled() {
                most.fetch_max(conversions_running(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let names: Vec<String> = (0..8).map(|i| format!("slow-{i}.html")).collect();
    let uploads = names.iter().map(|name| api.upload(ALICE, name, slow.as_bytes()));
    for r in futures::future::join_all(uploads).await {
        assert_eq!((r.status, r.error_code()), (400, "bad_request"), "{}", r.text);
        assert!(r.json["error"]["message"].as_str().unwrap().contains("within 1"), "{}", r.text);
    }
    // Answered: nothing of theirs runs on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    watching.cancel();
    watcher.await.unwrap();
    assert_eq!(conversions_running(), 0, "conversions still running after their answers");
    let most = most.load(std::sync::atomic::Ordering::Relaxed);
    assert!((1..=4).contains(&most), "{most} conversions ran at once");
    api.stop().await;
}

/// An upload's request head and the start of its multipart body, declaring 20 MiB (the
/// largest upload), over a connection of its own.
async fn start_upload(api: &Api, token: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt as _;
    let addr = api.base.trim_start_matches("http://").trim_end_matches('/').to_owned();
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 20971520\r\n\r\n\
         --b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.txt\"\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp
}

/// The status and body of the answer on `tcp`, if one comes within `within`.
async fn answer(tcp: &mut tokio::net::TcpStream, within: Duration) -> Option<(u16, String)> {
    use tokio::io::AsyncReadExt as _;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            Ok(_) => break,
            Err(_) if got.is_empty() => return None,
            Err(_) => break,
        }
        let text = String::from_utf8_lossy(&got);
        if text.contains("\r\n\r\n{") && text.trim_end().ends_with('}') {
            break;
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok())?;
    Some((status, text))
}

/// A body that stops arriving is a 408 after TURNLOG_UPLOAD_READ_TIMEOUT, and one that keeps
/// arriving, but slower than TURNLOG_UPLOAD_MIN_RATE, is a 408 too: neither holds its room
/// in the upload budget for as long as its connection stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_body_that_stalls_or_trickles_is_a_408() {
    use tokio::io::AsyncWriteExt as _;
    fn impatient(config: &mut turnlog_ingress::IngressConfig) {
        config.upload_read_timeout = Duration::from_secs(1);
        config.upload_min_rate = 16 * 1024;
    }
    let api = Api::with(Options { ingress: Some(impatient), ..Options::default() }).await;
    let mut stalled = start_upload(&api, ALICE).await;
    let (status, text) =
        answer(&mut stalled, Duration::from_secs(10)).await.expect("an answer to a stalled body");
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("\"request_timeout\"") && text.contains("1 s"), "{text}");

    // 1 KB a second, never idle for a second.
    let mut trickle = start_upload(&api, ALICE).await;
    let started = std::time::Instant::now();
    let got = loop {
        if trickle.write_all(&[b'a'; 100]).await.is_err() {
            break answer(&mut trickle, Duration::from_secs(1)).await;
        }
        if let Some(got) = answer(&mut trickle, Duration::from_millis(100)).await {
            break Some(got);
        }
        assert!(started.elapsed() < Duration::from_secs(10), "a trickle is still read after 10 s");
    };
    let (status, text) = got.expect("an answer to a trickle");
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("bytes a second"), "{text}");
    // Nothing was stored, and uploads go on.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM files").fetch_one(&api.env.pool).await.unwrap();
    assert_eq!(rows, 0);
    assert_eq!(api.upload(ALICE, "a.txt", b"fine").await.status, 201);
    api.stop().await;
}

/// One owner's idle uploads hold at most their share of the upload budget (a quarter of its
/// 160 MiB): 9 connections that declare 20 MiB and send nothing once blocked every other
/// owner's upload for as long as they stayed open. Another owner's upload goes through at
/// once; the owner's own uploads past the share wait for room in it, and get it when those
/// connections go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owner_cannot_hold_the_whole_upload_budget() {
    fn patient(config: &mut turnlog_ingress::IngressConfig) {
        config.upload_read_timeout = Duration::from_secs(120);
    }
    let api = Api::with(Options { ingress: Some(patient), ..Options::default() }).await;
    let mut idle = Vec::new();
    for _ in 0..9 {
        idle.push(start_upload(&api, ALICE).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let bobs = tokio::time::timeout(Duration::from_secs(10), api.upload(BOB, "b.txt", b"mine"))
        .await
        .expect("another owner's upload waits on the idle ones");
    assert_eq!(bobs.status, 201, "{}", bobs.text);
    for tcp in &mut idle {
        assert_eq!(answer(tcp, Duration::from_millis(50)).await, None, "an idle upload is answered");
    }
    {
        let alices = api.upload(ALICE, "a.txt", b"queued");
        tokio::pin!(alices);
        assert!(
            tokio::time::timeout(Duration::from_millis(500), &mut alices).await.is_err(),
            "her upload waits for room in her share"
        );
        drop(idle);
        let alices =
            tokio::time::timeout(Duration::from_secs(10), alices).await.expect("her room comes back");
        assert_eq!(alices.status, 201, "{}", alices.text);
    }
    api.stop().await;
}
