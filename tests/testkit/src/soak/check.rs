//! The soak's checker, run once the load is over and the workers caught up: everything the
//! clients saw acknowledged is compared with the log. Nothing lost, nothing stored twice,
//! seqs gapless, each completed turn an assistant_turn holding the text the client read,
//! each cut turn kept up to its last checkpoint, each turn's worker output exactly once,
//! no poison stored, and every event on the committed-event feed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::Value;
use uuid::Uuid;

use super::client::{Purpose, TurnRecord};
use super::cluster::Cluster;
use super::report::ViolationKind;
use super::{lock, rel, Shared};
use crate::checker::scan_feed;
use turnlog_runtime::bus::{feed_token, on_feed};

/// One stored event, as the checker reads it.
struct Row {
    seq: i64,
    event_id: Uuid,
    kind: String,
    payload: Value,
    /// The writer's timestamp (the APPEND message's), Unix seconds.
    at: f64,
}

/// What the report needs from the check besides the violations.
#[derive(Debug, Default)]
pub(crate) struct Checked {
    /// Every acknowledgement a client or probe saw: (session, seq) and when.
    pub acked: Vec<(Uuid, i64, f64)>,
    pub events: usize,
    pub sessions: usize,
    /// For each cut turn that kept a checkpoint: seconds of streamed text lost at the kill
    /// (from when the client first had more than was kept until the kill).
    pub checkpoint_ages: Vec<f64>,
    /// Cut turns whose partial was checked, and what each kept.
    pub cuts_checked: usize,
    pub cuts: Vec<String>,
    /// Completed turns whose answer could not be confirmed stored in time (no seq), and
    /// how many of those answers are in the log after all.
    pub unconfirmed: usize,
    pub unconfirmed_stored: usize,
    /// Messages on TURNLOG_DEAD (the poison, and anything else dead-lettered).
    pub dead_letters: u64,
    pub feed_duplicates: usize,
    /// Stored answers without a `turn_memory` (`session:seq`): the distiller appends none
    /// for an empty residue, so these are reported for a look rather than failed.
    pub turns_without_residue: Vec<String>,
    pub compactions: usize,
    pub memories: usize,
    pub settled_in: f64,
    /// Model-fault turns that completed because a worker note committed after the user's
    /// message became the request's last user-role message (the mock reads that one).
    pub directives_masked: usize,
}

pub(crate) async fn check(cluster: &Cluster, shared: &Shared) -> Checked {
    let settled_in = settle(cluster, shared).await;
    let pool = &cluster.env.pool;
    let mut checked = Checked { settled_in, ..Default::default() };

    let rows: Vec<(Uuid, i64, Uuid, String, Value, f64)> = match sqlx::query_as(
        "SELECT session_id, seq, event_id, kind, payload, extract(epoch from created_at)::float8 \
         FROM session_events ORDER BY session_id, seq",
    )
    .fetch_all(pool)
    .await
    {
        Ok(rows) => rows,
        Err(e) => {
            shared.violation(ViolationKind::Other, format!("checker cannot read the log: {e}"));
            return checked;
        }
    };
    checked.events = rows.len();
    let mut by_session: HashMap<Uuid, Vec<Row>> = HashMap::new();
    for (session, seq, event_id, kind, payload, at) in rows {
        by_session.entry(session).or_default().push(Row { seq, event_id, kind, payload, at });
    }
    checked.sessions = by_session.len();
    check_log_shape(cluster, shared, &by_session).await;

    let records = lock(&shared.records).clone();
    check_records(shared, &records, &by_session, &mut checked);
    check_probe_acks(shared, &by_session, &mut checked);
    check_workers(shared, &by_session, &mut checked);
    check_poison(shared, &by_session);
    check_feed(cluster, shared, &by_session, &mut checked).await;
    if let Ok(mut dead) = cluster.bus.js.get_stream(cluster.bus.names.dead_stream()).await {
        if let Ok(info) = dead.info().await {
            checked.dead_letters = info.state.messages;
        }
    }
    checked
}

/// Waits (bounded) until every assistant_turn has its memory_extracted and the log stops
/// growing: the workers' redeliveries after the last faults take a while.
async fn settle(cluster: &Cluster, shared: &Shared) -> f64 {
    let started = Instant::now();
    let deadline = started + shared.config.settle;
    let mut last_count = -1_i64;
    let mut stable_since = Instant::now();
    while Instant::now() < deadline {
        let missing: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM session_events a WHERE a.kind = 'assistant_turn' AND NOT EXISTS \
             (SELECT 1 FROM session_events m WHERE m.session_id = a.session_id \
              AND m.kind = 'memory_extracted' AND (m.payload->>'turn_seq')::bigint = a.seq)",
        )
        .fetch_one(&cluster.env.pool)
        .await;
        let count: Result<i64, _> =
            sqlx::query_scalar("SELECT count(*) FROM session_events").fetch_one(&cluster.env.pool).await;
        if let (Ok(missing), Ok(count)) = (missing, count) {
            if count != last_count {
                last_count = count;
                stable_since = Instant::now();
            }
            if missing == 0 && stable_since.elapsed() > Duration::from_secs(3) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    started.elapsed().as_secs_f64()
}

/// Event ids once each, seqs gapless from the branch's first seq (1 unless a fork),
/// `last_seq` matching, no user message twice.
async fn check_log_shape(cluster: &Cluster, shared: &Shared, by_session: &HashMap<Uuid, Vec<Row>>) {
    let sessions: Result<Vec<(Uuid, i64, i64)>, _> = sqlx::query_as(
        "SELECT id, last_seq, coalesce(lineage_through[cardinality(lineage_through)], 0) + 1 FROM sessions",
    )
    .fetch_all(&cluster.env.pool)
    .await;
    let sessions = sessions.unwrap_or_default();
    let first: HashMap<Uuid, i64> = sessions.iter().map(|(id, _, first)| (*id, *first)).collect();
    let mut ids: HashSet<Uuid> = HashSet::new();
    for (session, rows) in by_session {
        let first = first.get(session).copied().unwrap_or(1);
        for (i, row) in rows.iter().enumerate() {
            if !ids.insert(row.event_id) {
                shared.violation_at(
                    ViolationKind::Duplicated,
                    format!("event {} stored twice (again at {session}:{})", row.event_id, row.seq),
                    row.at,
                );
            }
            if row.seq != i as i64 + first {
                shared.violation_at(
                    ViolationKind::Gap,
                    format!("session {session}: seq {} where {} was due", row.seq, i as i64 + first),
                    row.at,
                );
                break;
            }
        }
        let mut texts: HashMap<&str, usize> = HashMap::new();
        for row in rows.iter().filter(|r| r.kind == "user_message") {
            let text = row.payload.get("text").and_then(Value::as_str).unwrap_or_default();
            let n = texts.entry(text).or_default();
            *n += 1;
            if *n > 1 {
                shared.violation_at(
                    ViolationKind::Duplicated,
                    format!("session {session}: user message stored twice (seq {}): {}", row.seq, clip(text)),
                    row.at,
                );
            }
        }
    }
    for (session, last_seq, _) in sessions {
        let max = by_session.get(&session).and_then(|r| r.last()).map_or(0, |r| r.seq);
        if max != last_seq {
            shared.violation(
                ViolationKind::Gap,
                format!("session {session}: last_seq {last_seq} but the newest event is seq {max}"),
            );
        }
    }
}

fn row_at(by_session: &HashMap<Uuid, Vec<Row>>, session: Uuid, seq: i64) -> Option<&Row> {
    let rows = by_session.get(&session)?;
    let row = rows.get(usize::try_from(seq - 1).ok()?)?;
    (row.seq == seq).then_some(row).or_else(|| rows.iter().find(|r| r.seq == seq))
}

/// The answer text of an assistant_turn.
fn answer_text(payload: &Value) -> String {
    if let Some(s) = payload.pointer("/llm/message/content").and_then(Value::as_str) {
        return s.to_owned();
    }
    let blocks = payload.pointer("/ui/blocks").and_then(Value::as_array).cloned().unwrap_or_default();
    blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect()
}

fn partial(payload: &Value) -> &str {
    payload.get("partial").and_then(Value::as_str).unwrap_or_default()
}

fn end_seq(end: &Value) -> Option<(&'static str, i64)> {
    for (field, kind) in
        [("assistant_seq", "assistant_turn"), ("pending_seq", "pending_state"), ("failed_seq", "turn_failed")]
    {
        if let Some(seq) = end.get(field).and_then(Value::as_i64) {
            return Some((kind, seq));
        }
    }
    None
}

fn check_records(
    shared: &Shared,
    records: &[TurnRecord],
    by_session: &HashMap<Uuid, Vec<Row>>,
    checked: &mut Checked,
) {
    // Seqs that a turn's own `end` named: a cut turn's stored events are the others.
    let mut claimed: HashMap<(Uuid, i64), usize> = HashMap::new();
    for (i, rec) in records.iter().enumerate() {
        if let (Some(session), Some(end), false) = (rec.session, &rec.end, rec.end_from_log) {
            if let Some((_, seq)) = end_seq(end) {
                claimed.insert((session, seq), i);
            }
        }
    }
    let mut acked: HashMap<(Uuid, i64), f64> = HashMap::new();
    for (i, rec) in records.iter().enumerate() {
        let Some(session) = rec.session else { continue };
        let who = format!("client {} ({:?}) session {session}", client_name(rec.client), rec.purpose);
        if let Some(user_seq) = rec.user_seq {
            acked.entry((session, user_seq)).or_insert(rec.acked_at);
            match row_at(by_session, session, user_seq) {
                Some(row) if row.kind == "user_message" => {
                    let stored = row.payload.get("text").and_then(Value::as_str).unwrap_or_default();
                    if !rec.text.is_empty() && stored != rec.text {
                        shared.violation_at(
                            ViolationKind::Lost,
                            format!("{who}: seq {user_seq} holds another message than the one acknowledged"),
                            rec.acked_at,
                        );
                    }
                }
                other => shared.violation_at(
                    ViolationKind::Lost,
                    format!(
                        "{who}: acknowledged user message seq {user_seq} is {}",
                        other.map_or("missing".to_owned(), |r| format!("a {}", r.kind))
                    ),
                    rec.acked_at,
                ),
            }
        }
        if rec.id_gap {
            shared.violation_at(
                ViolationKind::Mismatch,
                format!("{who}: the turn stream skipped event ids"),
                rec.end_at,
            );
        }
        if !rec.after_end.is_empty() || rec.open_after_end {
            let ends = rec.after_end.iter().filter(|e| *e == "end").count();
            shared.violation_at(
                if ends > 0 { ViolationKind::Duplicated } else { ViolationKind::Mismatch },
                format!(
                    "{who}: after its `end` the stream sent {:?}{}",
                    rec.after_end,
                    if rec.open_after_end { " and stayed open" } else { "" }
                ),
                rec.end_at,
            );
        }
        if let Some(end) = &rec.end {
            check_end(shared, rec, end, &who, by_session, &mut acked, checked);
        }
        if let Some(cut) = rec.cut_at {
            check_cut(shared, rec, i, cut, &who, by_session, &claimed, checked);
        }
    }
    checked.acked.extend(acked.into_iter().map(|((s, q), t)| (s, q, t)));
}

fn check_end(
    shared: &Shared,
    rec: &TurnRecord,
    end: &Value,
    who: &str,
    by_session: &HashMap<Uuid, Vec<Row>>,
    acked: &mut HashMap<(Uuid, i64), f64>,
    checked: &mut Checked,
) {
    let Some(session) = rec.session else { return };
    let status = rec.status().unwrap_or_default();
    if rec.purpose == Purpose::ModelFault && status == "completed" && !rec.end_from_log {
        // The mock reads its directive from the last user-role message of the request. A
        // late worker note (the previous turn's turn_memory, or a turn_failed) committed
        // after this message projects as a user-role note after it and hides the
        // directive; only without one is a completed turn wrong.
        let answer = end.get("assistant_seq").and_then(Value::as_i64).unwrap_or(i64::MAX);
        let user = rec.user_seq.unwrap_or(i64::MAX);
        let masked = by_session.get(&session).is_some_and(|rows| {
            rows.iter().any(|r| {
                r.seq > user && r.seq < answer && matches!(r.kind.as_str(), "turn_memory" | "turn_failed")
            })
        });
        if masked {
            checked.directives_masked += 1;
        } else {
            shared.violation_at(
                ViolationKind::Mismatch,
                format!("{who}: a model failure was reported as a completed turn: {}", clip(&rec.text)),
                rec.end_at,
            );
        }
    }
    let Some((kind, seq)) = end_seq(end) else {
        if status == "completed" && !rec.end_from_log {
            // The ingress could not confirm the answer stored within its deadline (the
            // writer was away) and said so; it was published, so it must be stored now.
            checked.unconfirmed += 1;
            let user = rec.user_seq.unwrap_or(i64::MAX);
            let stored = by_session.get(&session).is_some_and(|rows| {
                rows.iter()
                    .filter(|r| r.seq > user && r.kind == "assistant_turn")
                    .any(|r| answer_text(&r.payload) == rec.received)
            });
            if stored {
                checked.unconfirmed_stored += 1;
            } else {
                shared.violation_at(
                    ViolationKind::Lost,
                    format!(
                        "{who}: `end` said completed without an assistant_seq, and the answer is not stored"
                    ),
                    rec.end_at,
                );
            }
        }
        return;
    };
    acked.entry((session, seq)).or_insert(rec.end_at);
    let Some(row) = row_at(by_session, session, seq).filter(|r| r.kind == kind) else {
        shared.violation_at(
            ViolationKind::Lost,
            format!("{who}: `end` {status} named seq {seq} as a {kind}, which is not stored"),
            rec.end_at,
        );
        return;
    };
    // Only a turn followed from its first event to its `end` has the whole text.
    if rec.end_from_log || rec.id_gap || rec.cut_at.is_some() {
        if kind == "assistant_turn" && !answer_text(&row.payload).starts_with(&rec.received) {
            shared.violation_at(
                ViolationKind::Mismatch,
                format!("{who}: the stored answer (seq {seq}) does not begin with what the client read"),
                rec.end_at,
            );
        }
        return;
    }
    let stored = match kind {
        "assistant_turn" => answer_text(&row.payload),
        "pending_state" => partial(&row.payload).to_owned(),
        _ => return,
    };
    if stored != rec.received {
        shared.violation_at(
            ViolationKind::Mismatch,
            format!(
                "{who}: {kind} seq {seq} holds {} bytes, the client read {} bytes, and they differ",
                stored.len(),
                rec.received.len()
            ),
            rec.end_at,
        );
    }
    if status == "stopped" && kind == "pending_state" {
        let reason = row.payload.get("reason").and_then(Value::as_str);
        if reason != Some("stopped") {
            shared.violation_at(
                ViolationKind::Mismatch,
                format!("{who}: a stopped turn's pending_state has reason {reason:?}"),
                rec.end_at,
            );
        }
    }
}

/// A turn whose stream broke with the turn gone (its ingress copy was killed): what is
/// stored of it must agree with what the client read, and hold at least the text the
/// client had a checkpoint interval (plus slack) before the break.
#[allow(clippy::too_many_arguments)]
fn check_cut(
    shared: &Shared,
    rec: &TurnRecord,
    index: usize,
    cut: f64,
    who: &str,
    by_session: &HashMap<Uuid, Vec<Row>>,
    claimed: &HashMap<(Uuid, i64), usize>,
    checked: &mut Checked,
) {
    let (Some(session), Some(user_seq)) = (rec.session, rec.user_seq) else { return };
    let Some(rows) = by_session.get(&session) else { return };
    let config = &shared.config;
    // The turn died when its copy was killed, which the client may notice much later (a
    // follower on the other copy gives up after its quiet check): the reference is the
    // first kill after the last delta the client got (a delta read just after the kill was
    // sent before it).
    let detected = rec.broke_at.unwrap_or(cut);
    let last_delta = rec.marks.last().map_or(rec.started, |(t, _)| *t);
    let kill = lock(&shared.ingress_kills)
        .iter()
        .copied()
        .filter(|k| *k >= last_delta.max(rec.started) - 0.5 && *k <= detected + 0.1)
        .reduce(f64::min);
    let cut = kill.map_or(detected, |k| k.max(last_delta).min(detected));
    let before = cut - (config.checkpoint_interval + config.checkpoint_slack).as_secs_f64();
    let had_before = rec.marks.iter().rev().find(|(t, _)| *t <= before).map_or(0, |(_, len)| *len);

    // The message's attempts, in order: the original turn and any retries.
    let mut groups: Vec<(Option<&str>, Vec<&Row>)> = Vec::new();
    let turn_kinds = ["pending_state", "assistant_turn", "turn_failed"];
    let after = rows.iter().filter(|r| r.seq > user_seq).take_while(|r| r.kind != "user_message");
    // Workers' events (a previous turn's residue, a compaction) interleave; they are no attempt.
    for row in after.filter(|r| turn_kinds.contains(&r.kind.as_str())) {
        let attempt = row.payload.get("attempt_id").and_then(Value::as_str);
        match groups.iter_mut().find(|(a, _)| *a == attempt) {
            Some((_, g)) => g.push(row),
            None => groups.push((attempt, vec![row])),
        }
    }
    let describe = || {
        let attempts: Vec<String> = groups
            .iter()
            .map(|(_, g)| {
                let last = g[g.len() - 1];
                format!(
                    "{} events {:.1}s..{:.1}s ending {} seq {}",
                    g.len(),
                    rel(g[0].at),
                    rel(last.at),
                    last.kind,
                    last.seq
                )
            })
            .collect();
        format!(
            " [started {:.1}s, meta {:.1}s, last delta {:.1}s, cut {:.1}s, read {} bytes; {}; stored attempts: {}]",
            rel(rec.started),
            rel(rec.acked_at),
            rec.marks.last().map_or(0.0, |(t, _)| rel(*t)),
            rel(cut),
            rec.received.len(),
            rec.cut_reason,
            if attempts.is_empty() { "none".to_owned() } else { attempts.join(" | ") }
        )
    };
    // This turn's attempt began while the client followed it and is no other turn's. A
    // killed copy's turn stored nothing after the kill; a turn that was not killed (the
    // client lost it for another reason, e.g. re-attaching while NATS was frozen) may have
    // stored everything after the client gave up on it.
    let latest_start = if kill.is_some() { cut + 0.5 } else { f64::INFINITY };
    let mine = groups.iter().find(|(_, g)| {
        let first = g[0].at;
        first >= rec.started - 1.0
            && first <= latest_start
            && g.iter().all(|r| claimed.get(&(session, r.seq)).is_none_or(|c| *c == index))
    });
    let Some((_, group)) = mine else {
        if had_before > 0 {
            shared.violation_at(
                ViolationKind::Lost,
                format!(
                    "{who}: turn after seq {user_seq} cut with nothing stored, though the client had \
                     {had_before} bytes {:.1} s before the cut{}",
                    (config.checkpoint_interval + config.checkpoint_slack).as_secs_f64(),
                    describe()
                ),
                cut,
            );
        }
        return;
    };
    checked.cuts_checked += 1;
    let Some(last) = group.last() else { return };
    checked.cuts.push(format!(
        "{who}: kept {} {} of the {} bytes read{}",
        last.kind,
        match last.kind.as_str() {
            "pending_state" => format!("({} bytes)", partial(&last.payload).len()),
            "assistant_turn" => format!("({} bytes)", answer_text(&last.payload).len()),
            _ => String::new(),
        },
        rec.received.len(),
        describe()
    ));
    match last.kind.as_str() {
        "assistant_turn" if !answer_text(&last.payload).starts_with(&rec.received) => {
            shared.violation_at(
                ViolationKind::Mismatch,
                format!("{who}: the completed answer (seq {}) differs from what the client read", last.seq),
                cut,
            );
        }
        "pending_state" => {
            let stored = partial(&last.payload);
            if !(rec.received.starts_with(stored) || stored.starts_with(&rec.received)) {
                shared.violation_at(
                    ViolationKind::Mismatch,
                    format!(
                        "{who}: the stored partial (seq {}) is not the text the client read{}",
                        last.seq,
                        describe()
                    ),
                    cut,
                );
            }
            if stored.len() < had_before {
                shared.violation_at(
                    ViolationKind::Lost,
                    format!(
                        "{who}: the stored partial (seq {}) has {} bytes; the client had {had_before} \
                         bytes {:.1} s before the cut{}",
                        last.seq,
                        stored.len(),
                        (config.checkpoint_interval + config.checkpoint_slack).as_secs_f64(),
                        describe()
                    ),
                    cut,
                );
            }
            // How much of the stream the kill cost: from the moment the client first had
            // more than what was kept (only for a client that read all along; one that left
            // got its text late and in a burst).
            if rec.purpose != Purpose::Leave {
                let first_more = rec.marks.iter().find(|(_, len)| *len > stored.len()).map(|(t, _)| *t);
                checked.checkpoint_ages.push(first_more.map_or(0.0, |t| (cut - t).max(0.0)));
            }
        }
        "turn_failed" if had_before > 0 => shared.violation_at(
            ViolationKind::Lost,
            format!("{who}: the turn was stored as failed, though the client had {had_before} bytes"),
            cut,
        ),
        _ => {}
    }
}

fn check_probe_acks(shared: &Shared, by_session: &HashMap<Uuid, Vec<Row>>, checked: &mut Checked) {
    for (event_id, session, seq, at) in lock(&shared.probe_acks).iter().copied() {
        checked.acked.push((session, seq, at));
        if row_at(by_session, session, seq).map(|r| r.event_id) != Some(event_id) {
            shared.violation_at(
                ViolationKind::Lost,
                format!("writer probe append {event_id} acknowledged at {session}:{seq} is not stored there"),
                at,
            );
        }
    }
}

/// Exactly one memory_extracted per assistant_turn, at most one turn_memory, and each
/// compaction moving the boundary forward (none applied twice).
fn check_workers(shared: &Shared, by_session: &HashMap<Uuid, Vec<Row>>, checked: &mut Checked) {
    for (session, rows) in by_session {
        let mut extracted: HashMap<i64, usize> = HashMap::new();
        let mut residues: HashMap<i64, usize> = HashMap::new();
        let mut boundary = 0;
        for row in rows {
            let turn = row.payload.get("turn_seq").and_then(Value::as_i64).unwrap_or(-1);
            match row.kind.as_str() {
                "memory_extracted" => {
                    *extracted.entry(turn).or_default() += 1;
                    checked.memories +=
                        row.payload.get("memories").and_then(Value::as_array).map_or(0, Vec::len);
                }
                "turn_memory" => *residues.entry(turn).or_default() += 1,
                "compaction_applied" => {
                    checked.compactions += 1;
                    let through =
                        row.payload.get("replaces_through_seq").and_then(Value::as_i64).unwrap_or(0);
                    if through <= boundary {
                        shared.violation_at(
                            ViolationKind::Duplicated,
                            format!("session {session}: compaction seq {} does not move the boundary ({through} <= {boundary})", row.seq),
                            row.at,
                        );
                    }
                    boundary = boundary.max(through);
                }
                _ => {}
            }
        }
        for row in rows.iter().filter(|r| r.kind == "assistant_turn") {
            match extracted.get(&row.seq).copied().unwrap_or(0) {
                1 => {}
                0 => shared.violation_at(
                    ViolationKind::Worker,
                    format!("session {session}: assistant_turn seq {} has no memory_extracted", row.seq),
                    row.at,
                ),
                n => shared.violation_at(
                    ViolationKind::Duplicated,
                    format!("session {session}: assistant_turn seq {} has {n} memory_extracted", row.seq),
                    row.at,
                ),
            }
            match residues.get(&row.seq).copied().unwrap_or(0) {
                0 => checked.turns_without_residue.push(format!("{session}:{}", row.seq)),
                1 => {}
                n => shared.violation_at(
                    ViolationKind::Duplicated,
                    format!("session {session}: assistant_turn seq {} has {n} turn_memory", row.seq),
                    row.at,
                ),
            }
        }
    }
}

fn check_poison(shared: &Shared, by_session: &HashMap<Uuid, Vec<Row>>) {
    let poison: HashSet<Uuid> = lock(&shared.poison).iter().copied().collect();
    for (session, rows) in by_session {
        for row in rows.iter().filter(|r| poison.contains(&r.event_id)) {
            shared.violation_at(
                ViolationKind::Other,
                format!("poison request {} was stored at {session}:{}", row.event_id, row.seq),
                row.at,
            );
        }
    }
}

/// Every stored event of a kind the feed stores reached TURNLOG_EVENTS with its own event id
/// (waiting a while for the publisher); identical repeats are counted, not failed (the feed is at-least-once), but a
/// repeat with other content is a violation.
async fn check_feed(
    cluster: &Cluster,
    shared: &Shared,
    by_session: &HashMap<Uuid, Vec<Row>>,
    checked: &mut Checked,
) {
    let fed = |row: &&Row| on_feed(&feed_token(&row.kind, row.payload.get("imported").is_some()));
    let total: usize = by_session.values().map(|rows| rows.iter().filter(fed).count()).sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    let scan = loop {
        let scan = scan_feed(&cluster.env, &cluster.bus).await;
        if scan.events.len() >= total || Instant::now() > deadline {
            break scan;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    checked.feed_duplicates = scan.repeats;
    for (first, later) in scan.conflicts.iter().take(10) {
        shared.violation(
            ViolationKind::Duplicated,
            format!(
                "the feed carries {}:{} twice with different content ({} {} / {} {})",
                first.session_id, first.seq, first.kind, first.event_id, later.kind, later.event_id
            ),
        );
    }
    let feed = scan.events;
    let mut missing = 0;
    for (session, rows) in by_session {
        for row in rows.iter().filter(fed) {
            let found = feed.get(&format!("{session}:{}", row.seq)).map(|e| e.event_id.0);
            if found != Some(row.event_id) {
                missing += 1;
                if missing <= 10 {
                    shared.violation_at(
                        ViolationKind::Feed,
                        format!(
                            "event {session}:{} ({}) is not on the committed-event feed",
                            row.seq, row.kind
                        ),
                        row.at,
                    );
                }
            }
        }
    }
    if missing > 10 {
        shared.violation(ViolationKind::Feed, format!("{} more events missing from the feed", missing - 10));
    }
}

fn client_name(client: usize) -> String {
    if client == usize::MAX {
        "probe".to_owned()
    } else {
        client.to_string()
    }
}

fn clip(s: &str) -> String {
    s.chars().take(120).collect()
}
