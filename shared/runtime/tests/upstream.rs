//! The upstream client against streams recorded in the shapes real servers send (OpenAI,
//! vLLM, Ollama, OpenRouter), replayed byte for byte by a tiny HTTP server in small chunks so
//! lines, CRLF pairs and UTF-8 characters arrive split.

// A failed unwrap in a test is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use turnlog_core::message::{ChatMessage, Role};
use turnlog_runtime::upstream::{
    ChatRequest, StreamItem, TimeoutPhase, UpstreamClient, UpstreamConfig, UpstreamError, Usage,
};

/// Bytes per HTTP chunk: small and odd so every boundary falls somewhere awkward.
const CHUNK: usize = 37;

enum Piece {
    Bytes(Vec<u8>),
    Pause(Duration),
}

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streams").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn split(bytes: &[u8]) -> Vec<Piece> {
    bytes.chunks(CHUNK).map(|c| Piece::Bytes(c.to_vec())).collect()
}

/// A one-purpose server answering every request with `status` and `pieces` as a chunked
/// body; it records each request's head and body.
struct Replay {
    base_url: String,
    requests: Arc<Mutex<Vec<String>>>,
}

async fn replay(status: u16, pieces: Vec<Piece>) -> Replay {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests = Arc::new(Mutex::new(Vec::new()));
    let recorded = requests.clone();
    let pieces = Arc::new(pieces);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve(socket, status, pieces.clone(), recorded.clone()));
        }
    });
    Replay { base_url, requests }
}

async fn serve(
    mut socket: TcpStream,
    status: u16,
    pieces: Arc<Vec<Piece>>,
    requests: Arc<Mutex<Vec<String>>>,
) {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await.unwrap();
        if n == 0 {
            return;
        }
        request.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&request).to_string();
        if let Some(head_end) = text.find("\r\n\r\n") {
            let length = text[..head_end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned())
                })
                .map_or(0, |v| v.parse::<usize>().unwrap());
            if request.len() >= head_end + 4 + length {
                requests.lock().unwrap().push(text);
                break;
            }
        }
    }
    let content_type = if status == 200 { "text/event-stream" } else { "application/json" };
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    for piece in pieces.iter() {
        match piece {
            Piece::Bytes(bytes) => {
                let chunk = [format!("{:x}\r\n", bytes.len()).as_bytes(), bytes, b"\r\n"].concat();
                if socket.write_all(&chunk).await.is_err() {
                    return;
                }
                socket.flush().await.unwrap();
            }
            Piece::Pause(pause) => tokio::time::sleep(*pause).await,
        }
    }
    let _ = socket.write_all(b"0\r\n\r\n").await;
}

fn client(base_url: &str, timeout: Duration) -> UpstreamClient {
    UpstreamClient::new(UpstreamConfig {
        base_url: base_url.into(),
        api_key: Some("sk-fixture".into()),
        timeout,
        windows_override: HashMap::new(),
    })
    .unwrap()
}

fn request() -> ChatRequest {
    ChatRequest {
        model: "any".into(),
        messages: vec![ChatMessage::text(Role::User, "hi")],
        max_tokens: Some(64),
        temperature: Some(0.2),
        ..ChatRequest::default()
    }
}

/// Every item until the end, and the error if the stream did not end with `[DONE]`.
async fn read_all(client: &UpstreamClient) -> (Vec<StreamItem>, Option<UpstreamError>) {
    let mut stream = client.stream(&request()).await.unwrap();
    let mut items = Vec::new();
    loop {
        match stream.next().await {
            Ok(Some(item)) => items.push(item),
            Ok(None) => return (items, None),
            Err(e) => return (items, Some(e)),
        }
    }
}

fn texts(items: &[StreamItem]) -> (String, String) {
    let mut text = String::new();
    let mut reasoning = String::new();
    for item in items {
        match item {
            StreamItem::Text(t) => text.push_str(t),
            StreamItem::Reasoning(r) => reasoning.push_str(r),
            _ => {}
        }
    }
    (text, reasoning)
}

fn usage(items: &[StreamItem]) -> Option<Usage> {
    items.iter().find_map(|i| match i {
        StreamItem::Usage(u) => Some(*u),
        _ => None,
    })
}

fn finish(items: &[StreamItem]) -> Option<&str> {
    items.iter().find_map(|i| match i {
        StreamItem::Finish(f) => Some(f.as_str()),
        _ => None,
    })
}

#[tokio::test]
async fn openai_stream_with_a_usage_chunk_without_choices() {
    let server = replay(200, split(&fixture("openai.sse"))).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(end, None);
    assert_eq!(texts(&items), ("The café opens at 9\u{a0}am — daily.".to_owned(), String::new()));
    assert_eq!(finish(&items), Some("stop"));
    assert_eq!(
        usage(&items),
        Some(Usage { prompt_tokens: 1843, completion_tokens: 9, cached_tokens: Some(1664) })
    );

    let sent = server.requests.lock().unwrap()[0].clone();
    assert!(sent.starts_with("POST /v1/chat/completions HTTP/1.1"));
    assert!(sent.to_ascii_lowercase().contains("authorization: bearer sk-fixture"));
    let body: serde_json::Value = serde_json::from_str(&sent[sent.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], serde_json::json!({"include_usage": true}));
    assert_eq!(body["messages"], serde_json::json!([{"role": "user", "content": "hi"}]));
    assert_eq!(body["max_tokens"], 64);
    assert!(body.get("response_format").is_none() && body.get("reasoning_effort").is_none());
}

#[tokio::test]
async fn vllm_stream_with_reasoning_content() {
    let server = replay(200, split(&fixture("vllm.sse"))).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(end, None);
    assert_eq!(texts(&items), ("2 + 2 = 4".to_owned(), "The user asks for a sum.".to_owned()));
    assert_eq!(finish(&items), Some("stop"));
    assert_eq!(usage(&items), Some(Usage { prompt_tokens: 21, completion_tokens: 9, cached_tokens: None }));
}

#[tokio::test]
async fn ollama_stream_with_reasoning_and_a_role_in_every_delta() {
    let server = replay(200, split(&fixture("ollama.sse"))).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(end, None);
    assert_eq!(texts(&items), ("Hello! How can I help?".to_owned(), "Okay, greet back".to_owned()));
    assert_eq!(usage(&items), Some(Usage { prompt_tokens: 12, completion_tokens: 40, cached_tokens: None }));
}

#[tokio::test]
async fn openrouter_stream_with_comments_and_crlf() {
    let server = replay(200, split(&fixture("openrouter.sse"))).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(end, None);
    let reasoning = |t: &str| StreamItem::Reasoning(t.into());
    let text = |t: &str| StreamItem::Text(t.into());
    assert_eq!(
        items,
        [
            reasoning("Short answer"),
            reasoning(" is best."),
            text("Paris"),
            text(" is"),
            text(" the"),
            text(" capital"),
            text("."),
            StreamItem::Finish("stop".into()),
            StreamItem::Usage(Usage { prompt_tokens: 14, completion_tokens: 12, cached_tokens: Some(0) }),
        ]
    );
}

#[tokio::test]
async fn an_error_inside_a_started_stream_is_a_provider_error() {
    let server = replay(200, split(&fixture("openrouter-error.sse"))).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(items, [StreamItem::Text("Partial".into())]);
    assert_eq!(end, Some(UpstreamError::Provider("Provider returned error".into())));
}

#[tokio::test]
async fn a_recorded_stream_cut_before_done_is_incomplete() {
    let whole = String::from_utf8(fixture("openai.sse")).unwrap();
    let cut = whole.replace("data: [DONE]\n\n", "");
    let server = replay(200, split(cut.as_bytes())).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert!(usage(&items).is_some(), "everything before the cut is delivered");
    assert!(matches!(end, Some(UpstreamError::Incomplete(_))), "{end:?}");
}

#[tokio::test]
async fn a_chunk_that_is_not_json_is_malformed() {
    let body =
        b"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\ndata: {\"choices\": [\n\n".to_vec();
    let server = replay(200, split(&body)).await;
    let (items, end) = read_all(&client(&server.base_url, Duration::from_secs(5))).await;
    assert_eq!(items, [StreamItem::Text("ok".into())]);
    assert!(matches!(end, Some(UpstreamError::Malformed(_))), "{end:?}");
}

#[tokio::test]
async fn keep_alive_comments_hold_an_idle_stream_open() {
    let timeout = Duration::from_millis(300);
    let role = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n".to_vec();
    let rest = b"data: {\"choices\":[{\"delta\":{\"content\":\"late\"}}]}\n\ndata: [DONE]\n\n".to_vec();

    let mut pieces = vec![Piece::Bytes(role.clone())];
    for _ in 0..6 {
        pieces.push(Piece::Pause(Duration::from_millis(100)));
        pieces.push(Piece::Bytes(b": keep-alive\n\n".to_vec()));
    }
    pieces.push(Piece::Bytes(rest.clone()));
    let server = replay(200, pieces).await;
    let (items, end) = read_all(&client(&server.base_url, timeout)).await;
    assert_eq!((items, end), (vec![StreamItem::Text("late".into())], None));

    let silent = vec![Piece::Bytes(role), Piece::Pause(Duration::from_millis(700)), Piece::Bytes(rest)];
    let server = replay(200, silent).await;
    let (_, end) = read_all(&client(&server.base_url, timeout)).await;
    assert_eq!(end, Some(UpstreamError::Timeout { phase: TimeoutPhase::Idle, after: timeout }));
}

#[tokio::test]
async fn an_error_status_keeps_the_start_of_a_long_body() {
    let body = format!("{{\"error\":{{\"message\":\"{}\"}}}}", "x".repeat(10_000));
    let server = replay(500, split(body.as_bytes())).await;
    let error =
        client(&server.base_url, Duration::from_secs(5)).stream(&request()).await.map(|_| ()).unwrap_err();
    let UpstreamError::Status { status, body } = error else { panic!("{error:?}") };
    assert_eq!(status, 500);
    assert!(body.starts_with("{\"error\":{\"message\":\"xxx"));
    assert!(body.len() < 2_100, "{} bytes kept", body.len());
}
