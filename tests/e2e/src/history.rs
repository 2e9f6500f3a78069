//! A synthetic history of append requests, published straight to TURNLOG_APPEND for the
//! live writer to apply: many sessions in interleaved turns of every event kind, with
//! compactions and, on request, the awkward parts (updates, a deleted session, poison,
//! resent request ids, a failed `expect`). The ops suite's and the rebuild bench's.

use std::collections::HashMap;
use std::future::IntoFuture as _;

use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::json;
use turnlog_core::events::*;
use turnlog_core::ids::{EventId, SessionId};
use turnlog_runtime::bus::{AppendRequest, Bus, Expect};
use uuid::Uuid;

use crate::rig::{owner, OWNER};

/// How big a history to make.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub sessions: usize,
    pub turns: usize,
    /// Updates, a deleted session, poison, resent ids and a failed `expect` among them.
    pub awkward: bool,
}

/// One APPEND message to publish.
pub struct Outgoing {
    /// The session whose subject it goes to (not always the one its body names).
    pub subject_session: SessionId,
    pub msg_id: String,
    pub body: Bytes,
}

pub struct History {
    /// In publish order.
    pub messages: Vec<Outgoing>,
    /// Sessions that stay, with the seq of their last event once applied.
    pub last_seqs: HashMap<SessionId, i64>,
    /// The session created, filled and deleted early on (when awkward).
    pub deleted: Option<SessionId>,
    /// Requests the writer refuses but whose outcome it records (owner mismatch, a failed
    /// `expect`, ...), by request id.
    pub rejected: Vec<Uuid>,
}

impl History {
    /// Events the database holds once everything is applied.
    pub fn events(&self) -> i64 {
        self.last_seqs.values().sum()
    }
}

/// Builds a history of `shape`. Every valid request is one the writer commits, so each
/// session's seqs are known here.
pub fn history(shape: Shape) -> History {
    let sessions: Vec<SessionId> = (0..shape.sessions).map(|_| SessionId::new()).collect();
    let mut h =
        History { messages: Vec::new(), last_seqs: HashMap::new(), deleted: None, rejected: Vec::new() };
    let mut compacted: HashMap<SessionId, Option<i64>> = HashMap::new();
    for (i, s) in sessions.iter().enumerate() {
        let title = (i % 3 == 0).then(|| format!("Session {i} about the Lisbon office"));
        h.push(*s, &AppendRequest::create(*s, &owner(OWNER), title));
        h.last_seqs.insert(*s, 1);
        compacted.insert(*s, None);
    }
    for turn in 0..shape.turns {
        for (i, s) in sessions.iter().enumerate() {
            h.turn(*s, i, turn, &mut compacted);
        }
        if turn == 0 && shape.awkward {
            h.awkward(&sessions);
        }
    }
    h
}

impl History {
    fn push(&mut self, subject_session: SessionId, req: &AppendRequest) {
        let body = serde_json::to_vec(req).expect("request encodes");
        self.push_raw(subject_session, body);
    }

    fn push_raw(&mut self, subject_session: SessionId, body: Vec<u8>) {
        self.messages.push(Outgoing {
            subject_session,
            msg_id: Uuid::now_v7().to_string(),
            body: body.into(),
        });
    }

    /// Appends `body` with `id` as its event id; returns its seq.
    fn append(&mut self, s: SessionId, id: Uuid, body: &EventBody) -> i64 {
        self.push(s, &AppendRequest::append(s, &owner(OWNER), id, body));
        let seq = self.last_seqs.get_mut(&s).expect("known session");
        *seq += 1;
        *seq
    }

    fn turn(&mut self, s: SessionId, i: usize, turn: usize, compacted: &mut HashMap<SessionId, Option<i64>>) {
        let n = i + turn;
        let user = UserMessage {
            text: format!(
                "Turn {turn} of session {i}: please check invoice {} for the Lisbon office, due on the {}th, and \
                 tell Marta whether the {} crates left the warehouse.",
                1000 + n,
                1 + n % 28,
                n % 40
            ),
            category: n.is_multiple_of(4).then(|| ["code", "travel", "finance"][n % 3].to_owned()),
            model_hint: n.is_multiple_of(9).then(|| "mock-large".to_owned()),
            images: if n.is_multiple_of(11) {
                vec![ImageRef { id: format!("img-{n}"), mime: "image/png".into(), width: Some(640), height: Some(480) }]
            } else {
                vec![]
            },
            documents: if n.is_multiple_of(13) {
                vec![Document {
                    id: format!("doc-{n}"),
                    mime: "text/markdown".into(),
                    name: Some(format!("notes-{n}.md")),
                    bytes: Some(40),
                    markdown: format!("# Notes {n}\n\n- item one\n- item two\n"),
                }]
            } else {
                vec![]
            },
            imported: None,
        };
        self.append(s, Uuid::now_v7(), &EventBody::UserMessage(user));
        let answer = format!(
            "Invoice {} is settled and Marta knows. The {} crates left on schedule; nothing else is pending for \
             the Lisbon office this week, and the next review is on the {}th. {}",
            1000 + n,
            n % 40,
            1 + (n + 7) % 28,
            "The plan stays as agreed and we keep going with it while waiting for the numbers. ".repeat(1 + n % 3)
        );
        let attempt = format!("attempt-{i}-{turn}");
        if turn.is_multiple_of(3) {
            let partial = PendingState {
                partial: answer[..40].to_owned(),
                attempt_id: Some(attempt.as_str().into()),
                reason: None,
                request: None,
            };
            self.append(s, Uuid::now_v7(), &EventBody::PendingState(partial));
        }
        if turn % 4 == 1 {
            let tool = ToolExecution {
                call_id: format!("call-{n}"),
                name: "read_file".into(),
                args: Some(json!({"path": format!("src/file{n}.rs")})),
                result_digest: Some(format!("{} lines", 10 + n)),
                status: "ok".into(),
                duration_ms: Some(12),
                ..Default::default()
            };
            self.append(s, Uuid::now_v7(), &EventBody::ToolExecution(tool));
        }
        if turn % 5 == 2 {
            let id = format!("perm-{n}");
            let request = PermissionRequest {
                id: id.clone(),
                call_id: format!("call-{n}"),
                tool: "shell".into(),
                args: json!({"cmd": "ls"}),
                danger_level: "low".into(),
                rationale: "list the files".into(),
            };
            self.append(s, Uuid::now_v7(), &EventBody::PermissionRequest(request));
            let resolved = PermissionResolved { id, decision: "allow".into() };
            self.append(s, Uuid::now_v7(), &EventBody::PermissionResolved(resolved));
        }
        if turn % 7 == 3 {
            let failed = TurnFailed {
                code: "upstream_error".into(),
                message: "the model gateway answered 502".into(),
                attempt_id: Some(format!("{attempt}-0").into()),
                request: None,
            };
            self.append(s, Uuid::now_v7(), &EventBody::TurnFailed(failed));
        }
        let text = answer.clone();
        let assistant = AssistantTurn {
            ui: UiPart {
                blocks: vec![
                    Block {
                        kind: BlockType::Reasoning,
                        text: Some("checking the invoice".into()),
                        meta: None,
                    },
                    Block { kind: BlockType::Text, text: Some(text.clone()), meta: None },
                ],
            },
            llm: LlmPart {
                message: LlmMessage { content: Some(MessageContent::Text(text)), ..Default::default() },
            },
            attempt_id: Some(attempt.into()),
            provider: Some("mock".into()),
            model: Some("mock-large".into()),
            usage: Some(Usage {
                input_tokens: 900 + n as u64,
                output_tokens: 120,
                cached_input_tokens: Some(768),
            }),
            duration_ms: Some(1200),
            cost: Some(0.0012),
            currency: Some("USD".into()),
            finish_reason: Some("stop".into()),
            request: None,
            imported: None,
        };
        let turn_seq = self.append(s, Uuid::now_v7(), &EventBody::AssistantTurn(assistant));
        if turn == 0 && !i.is_multiple_of(3) {
            // The distiller's title for an untitled session, under the id it derives.
            let mut title = AppendRequest::update(s, &owner(OWNER))
                .with_title_if_empty(Some(format!("Invoices of session {i}")));
            title.request_id = EventId::derived(s, turn_seq, "title").0;
            self.push(s, &title);
        }
        // The workers' outputs, under the ids they derive (so their replays add nothing).
        let memory = TurnMemory {
            turn_seq,
            files_changed: if turn % 4 == 1 { vec![format!("src/file{n}.rs")] } else { vec![] },
            failures: vec![],
            key_findings: vec![format!("invoice {} is settled", 1000 + n)],
        };
        self.append(s, EventId::derived(s, turn_seq, "turn_memory").0, &EventBody::TurnMemory(memory));
        let extracted_id = EventId::derived(s, turn_seq, "memory_extracted");
        let extracted = if turn % 8 == 7 {
            MemoryExtracted { turn_seq, memories: vec![], error: Some("the model kept failing".into()) }
        } else {
            let id = Uuid::new_v5(&extracted_id.0, b"0");
            MemoryExtracted {
                turn_seq,
                memories: vec![ExtractedMemory {
                    id,
                    text: format!("Invoice {} is due on the {}th.", 1000 + n, 1 + n % 28),
                }],
                error: None,
            }
        };
        self.append(s, extracted_id.0, &EventBody::MemoryExtracted(extracted));
        if turn % 6 == 5 {
            let last = self.last_seqs[&s];
            let previous = compacted.get(&s).copied().flatten();
            let through = last - 2;
            if previous.is_none_or(|p| through > p) {
                let body = EventBody::CompactionApplied(CompactionApplied {
                    summary: format!("Summary through seq {through}: invoices settled, Marta informed."),
                    replaces_through_seq: through,
                    facts_extracted: vec![],
                });
                let req = AppendRequest::append(s, &owner(OWNER), Uuid::now_v7(), &body)
                    .with_expect(Some(Expect { compacted_through: previous }));
                self.push(s, &req);
                *self.last_seqs.get_mut(&s).expect("known session") += 1;
                compacted.insert(s, Some(through));
            }
        }
    }

    /// The awkward parts, after the first round of turns.
    fn awkward(&mut self, sessions: &[SessionId]) {
        let [a, b, c, d, e, ..] = sessions else { panic!("an awkward history needs five sessions or more") };
        let (a, b, c, d, e) = (*a, *b, *c, *d, *e);
        // Title, archive and a title the user's wins over.
        let update = AppendRequest::update(a, &owner(OWNER)).with_title(Some("Renamed by the user".into()));
        self.push(a, &update);
        let update = AppendRequest::update(b, &owner(OWNER)).with_archived(Some(true));
        self.push(b, &update);
        // Metadata (the OpenAI surface's conversation metadata), set and replaced whole.
        let update = AppendRequest::update(b, &owner(OWNER))
            .with_metadata(Some(serde_json::json!({"topic": "lisbon", "tier": "gold"})));
        self.push(b, &update);
        let update = AppendRequest::update(b, &owner(OWNER))
            .with_metadata(Some(serde_json::json!({"topic": "porto"})));
        self.push(b, &update);
        let update = AppendRequest::update(c, &owner(OWNER))
            .with_title_if_empty(Some("Named by the distiller".into()));
        self.push(c, &update);

        // A session made, used and deleted: its requests are purged from the stream.
        let doomed = SessionId::new();
        self.push(doomed, &AppendRequest::create(doomed, &owner(OWNER), Some("doomed".into())));
        self.last_seqs.insert(doomed, 1);
        let mut none = HashMap::from([(doomed, None)]);
        self.turn(doomed, 99, 0, &mut none);
        self.turn(doomed, 99, 1, &mut none);
        self.push(doomed, &AppendRequest::delete(doomed, &owner(OWNER)));
        self.last_seqs.remove(&doomed);
        self.deleted = Some(doomed);

        // The same request id again under another message id: the writer's dedup answers.
        let first = self.messages.iter().rev().find(|m| m.subject_session == d).map(|m| m.body.clone());
        if let Some(body) = first {
            let req: AppendRequest = serde_json::from_slice(&body).expect("decodes");
            if matches!(req.op, turnlog_runtime::bus::AppendOp::Append { .. }) {
                self.push_raw(d, body.to_vec());
            }
        }

        // Poison: each dead-lettered, none an event.
        self.push_raw(d, b"\x00\xffnot json{".to_vec());
        let plain = |s: SessionId, text: &str| {
            AppendRequest::append(
                s,
                &owner(OWNER),
                Uuid::now_v7(),
                &EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() }),
            )
        };
        let mut unknown_kind = serde_json::to_value(plain(d, "x")).expect("encodes");
        unknown_kind["kind"] = json!("user_msg");
        self.push_raw(d, serde_json::to_vec(&unknown_kind).expect("encodes"));
        let mut not_owner = plain(e, "from someone else");
        not_owner.owner = "mallory".into();
        self.rejected.push(not_owner.request_id);
        self.push(e, &not_owner);
        let nul = plain(e, "nul \u{0} inside");
        self.rejected.push(nul.request_id);
        self.push(e, &nul);
        let stranger = plain(SessionId::new(), "to a session nobody made");
        self.rejected.push(stranger.request_id);
        self.push(stranger.session_id, &stranger);
        let misrouted = plain(a, "published on another session's subject");
        self.rejected.push(misrouted.request_id);
        self.push(b, &misrouted);
        // A compaction whose expectation is stale: rejected, not dead-lettered.
        let stale = EventBody::CompactionApplied(CompactionApplied {
            summary: "too late".into(),
            replaces_through_seq: 2,
            facts_extracted: vec![],
        });
        let stale = AppendRequest::append(e, &owner(OWNER), Uuid::now_v7(), &stale)
            .with_expect(Some(Expect { compacted_through: Some(999) }));
        self.rejected.push(stale.request_id);
        self.push(e, &stale);
    }
}

/// Publishes every message in order (PubAcks awaited in a window); returns the APPEND
/// sequence of the last one.
pub async fn publish(bus: &Bus, messages: &[Outgoing]) -> u64 {
    let mut acks = futures::stream::FuturesUnordered::new();
    let mut last = 0u64;
    for m in messages {
        let subject = bus.names.append_subject(bus.partition_of(m.subject_session), m.subject_session);
        let msg = async_nats::jetstream::message::PublishMessage::build()
            .payload(m.body.clone())
            .message_id(m.msg_id.as_str());
        let ack = bus.js.send_publish(subject, msg).await.expect("publish").into_future();
        acks.push(ack);
        if acks.len() >= 2048 {
            last = last.max(acks.next().await.expect("ack").expect("PubAck").sequence);
        }
    }
    while let Some(ack) = acks.next().await {
        last = last.max(ack.expect("PubAck").sequence);
    }
    last
}

/// Waits until the writer (one partition) applied through `seq` and finished its purges.
pub async fn applied_through(pool: &sqlx::PgPool, seq: u64, wait: std::time::Duration) {
    let seq = i64::try_from(seq).expect("sequence fits");
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let (applied, purges): (i64, i64) = sqlx::query_as(
            "SELECT coalesce(max(stream_seq), 0), (SELECT count(*) FROM pending_purges) FROM writer_positions",
        )
        .fetch_one(pool)
        .await
        .expect("positions");
        let indexed: bool = sqlx::query_scalar(
            "SELECT NOT EXISTS (SELECT 1 FROM writer_positions w
                                  LEFT JOIN search_positions s ON s.partition = w.partition
                                 WHERE coalesce(s.stream_seq, 0) < w.stream_seq)",
        )
        .fetch_one(pool)
        .await
        .expect("search positions");
        if applied >= seq && purges == 0 && indexed {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the writer did not apply (and index) the history within {wait:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
