//! The APPEND stream must always decode (DESIGN §6, for rebuild and replay): append
//! requests of every op, recorded as the flat struct before `AppendOp` wrote them, read
//! into their ops and written back byte for byte.

use serde_json::{json, Value};
use turnlog_core::events::{EventKind, ForkPoint};
use turnlog_core::ids::{Owner, SessionId};
use turnlog_runtime::bus::{AppendOp, AppendRequest, Expect, RequestKind};
use turnlog_runtime::files::{FileKind, FileMeta};
use uuid::Uuid;

/// Recorded by the code before `AppendOp`: each op bare and with every field it uses.
const RECORDED: &str = include_str!("fixtures/append_requests.jsonl");
/// Recorded then too: each op with every field set, those of other ops included.
const EVERY_FIELD: &str = include_str!("fixtures/append_requests_every_field.jsonl");

fn id(n: u128) -> Uuid {
    Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 | n)
}

fn owner() -> Owner {
    Owner::parse("alice").expect("a valid owner")
}

fn session() -> SessionId {
    SessionId(id(1))
}

fn parent(through_seq: i64) -> ForkPoint {
    ForkPoint { session_id: SessionId(id(2)), through_seq }
}

fn meta(every_field: bool) -> FileMeta {
    FileMeta {
        name: "notes.pdf".into(),
        mime: "application/pdf".into(),
        kind: FileKind::Document,
        bytes: 1234,
        sha256: "ab".repeat(32),
        width: every_field.then_some(640),
        height: every_field.then_some(480),
        markdown_chars: every_field.then_some(99),
        note: every_field.then(|| "no text layer".into()),
        sent_mime: every_field.then(|| "image/png".into()),
    }
}

fn greeting() -> Value {
    json!({"text": "hello \u{e9}\u{1F600} \"quoted\"", "category": "greeting"})
}

fn numbered(n: u128, r: AppendRequest) -> AppendRequest {
    AppendRequest { request_id: id(n), ..r }
}

/// The recorded requests as the constructors make them now, in the fixture's order.
fn expected() -> Vec<AppendRequest> {
    let (s, file) = (session(), id(3));
    let append = |kind, payload| AppendRequest::append_payload(s, &owner(), id(0), kind, payload);
    let with_kind = |r: AppendRequest, kind| match r.op {
        AppendOp::Append { payload, expect, .. } => {
            AppendRequest { op: AppendOp::Append { kind, payload, expect }, ..r }
        }
        _ => r,
    };
    let mut no_metadata = AppendRequest::file_put(file, &owner(), &meta(false));
    no_metadata.op = AppendOp::FilePut { payload: Value::Null };
    let compaction = json!({"summary": "so far", "replaces_through_seq": 4});
    let future = append(EventKind::UserMessage, json!({"x": [1, 2.5, null, true]}));
    [
        AppendRequest::create(s, &owner(), None),
        AppendRequest::create(s, &owner(), Some("A title".into()))
            .with_metadata(Some(json!({"topic": "lisbon", "tier": "gold"}))),
        AppendRequest::fork(s, &owner(), Some("Forked".into()), parent(7))
            .with_metadata(Some(json!({"topic": "porto"}))),
        AppendRequest::fork(s, &owner(), None, parent(1)),
        append(EventKind::UserMessage, greeting()),
        append(EventKind::CompactionApplied, compaction)
            .with_expect(Some(Expect { compacted_through: None })),
        append(EventKind::UserMessage, greeting()).with_expect(Some(Expect { compacted_through: Some(5) })),
        with_kind(future, RequestKind::Unknown("a_future_kind".into())),
        AppendRequest::update(s, &owner()),
        AppendRequest::update(s, &owner())
            .with_title(Some("Renamed".into()))
            .with_archived(Some(true))
            .with_title_if_empty(Some("Named by the distiller".into()))
            .with_metadata(Some(json!({}))),
        AppendRequest::update(s, &owner()).with_archived(Some(false)),
        AppendRequest::delete(s, &owner()),
        AppendRequest::file_put(file, &owner(), &meta(true)),
        AppendRequest::file_put(file, &owner(), &meta(false)),
        no_metadata,
        AppendRequest::file_delete(file, &owner()),
        AppendRequest::file_swept(file, &owner()),
    ]
    .into_iter()
    .zip(101..)
    .map(|(r, n)| numbered(n, r))
    .collect()
}

#[test]
fn recorded_requests_of_every_op_decode_into_their_ops_and_encode_the_same_bytes() {
    let lines: Vec<&str> = RECORDED.lines().collect();
    let expected = expected();
    assert_eq!(lines.len(), expected.len());
    for (line, want) in lines.into_iter().zip(expected) {
        let decoded: AppendRequest = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(decoded, want, "{line}");
        assert_eq!(serde_json::from_str::<Value>(line).unwrap()["op"], decoded.op.name());
        assert_eq!(serde_json::to_string(&decoded).unwrap(), line);
        assert_eq!(serde_json::to_string(&want).unwrap(), line, "as the constructors make it");
    }
}

#[test]
fn fields_an_op_does_not_use_are_ignored() {
    let stray = Some("stray title".to_owned());
    let (s, file) = (session(), id(3));
    let expected = [
        AppendRequest::fork(s, &owner(), stray.clone(), parent(2))
            .with_metadata(Some(json!({"stray": "yes"}))),
        AppendRequest::append_payload(s, &owner(), id(0), EventKind::UserMessage, greeting())
            .with_expect(Some(Expect { compacted_through: Some(3) })),
        AppendRequest::update(s, &owner())
            .with_title(stray)
            .with_archived(Some(true))
            .with_title_if_empty(Some("stray title_if_empty".into()))
            .with_metadata(Some(json!({"stray": "yes"}))),
        AppendRequest::delete(s, &owner()),
        AppendRequest::file_put(file, &owner(), &meta(false)),
        AppendRequest::file_delete(file, &owner()),
        AppendRequest::file_swept(file, &owner()),
    ];
    let lines: Vec<&str> = EVERY_FIELD.lines().collect();
    assert_eq!(lines.len(), expected.len());
    for ((line, want), n) in lines.into_iter().zip(expected).zip(200..) {
        let decoded: AppendRequest = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(decoded, numbered(n, want), "{line}");
    }
}

#[test]
fn a_request_missing_what_its_op_needs_does_not_decode() {
    let append = serde_json::to_value(AppendRequest::append_payload(
        session(),
        &owner(),
        id(0),
        EventKind::UserMessage,
        greeting(),
    ))
    .unwrap();
    for field in ["kind", "payload"] {
        for missing in [None, Some(Value::Null)] {
            let mut v = append.clone();
            match missing {
                None => v.as_object_mut().unwrap().remove(field),
                Some(null) => v.as_object_mut().unwrap().insert(field.into(), null),
            };
            let e = serde_json::from_value::<AppendRequest>(v).unwrap_err();
            assert!(e.to_string().contains("append needs kind and payload"), "{field}: {e}");
        }
    }
    for broken in [json!({"op": "frobnicate"}), json!({"owner": 5}), json!({"session_id": "not a uuid"})] {
        let mut v = append.clone();
        v.as_object_mut().unwrap().extend(broken.as_object().unwrap().clone());
        assert!(serde_json::from_value::<AppendRequest>(v).is_err(), "{broken}");
    }
}
