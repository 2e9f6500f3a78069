//! A request the database refuses to store (DESIGN §6): the writer splits the batch that
//! holds it until it is alone, dead-letters it as `unstorable` with the database's message,
//! and commits the requests around it; the partition keeps applying; a rebuild refuses the
//! same request again and agrees with the live database. Each trigger was a wedge before:
//! the partition's writer stepped down and retried the same batch forever. (An imported
//! time Postgres cannot hold is no longer one: the writer leaves it out of `active_at`.)

use bytes::Bytes;
use turnlog_core::events::{
    AssistantTurn, EventBody, ExtractedMemory, Imported, MemoryExtracted, UserMessage,
};
use turnlog_core::ids::SessionId;
use turnlog_e2e::rig::{owner, Rig, OWNER};
use turnlog_runtime::bus::{AppendRequest, OutcomeStatus};
use turnlog_runtime::read::recorded_outcome;
use uuid::Uuid;

use super::dead_letters;

fn message(session: SessionId, text: &str) -> AppendRequest {
    let body = EventBody::UserMessage(UserMessage { text: text.into(), ..Default::default() });
    AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &body)
}

/// About `bytes` of distinct words: a text whose tsvector is larger than the text.
fn distinct_words(bytes: usize) -> String {
    let mut text = String::with_capacity(bytes + 16);
    let mut n = 0u64;
    while text.len() < bytes {
        text.push_str(&format!("w{n:x}q "));
        n += 1;
    }
    text
}

/// Hex noise: a value no compression makes small.
fn noise(bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 32);
    while out.len() < bytes {
        out.push_str(&Uuid::new_v4().simple().to_string());
    }
    out.truncate(bytes);
    out
}

/// Publishes `bad` among ten good messages of the same session, all at once (so that they
/// share a batch), then one more with a wait; checks the outcomes and the dead letter.
async fn refused_among_others(rig: &Rig, session: SessionId, bad: AppendRequest, database_says: &str) {
    let mut requests: Vec<AppendRequest> = (0..5).map(|i| message(session, &format!("before {i}"))).collect();
    requests.push(bad.clone());
    requests.extend((0..5).map(|i| message(session, &format!("after {i}"))));
    for r in &requests {
        let body = Bytes::from(serde_json::to_vec(r).expect("json"));
        rig.bus.publish_append_raw(session, &r.request_id.to_string(), body, None).await.expect("published");
    }
    // The partition keeps applying: a request sent after them commits.
    let last = rig.send(&message(session, "behind the unstorable request")).await;
    assert_eq!(last.status, OutcomeStatus::Committed);
    for r in &requests {
        let o = recorded_outcome(&rig.env.pool, r.request_id).await.expect("read").expect("an outcome");
        if r.request_id == bad.request_id {
            assert_eq!((o.status, o.reason.as_deref()), (OutcomeStatus::Rejected, Some("unstorable")));
        } else {
            assert_eq!(o.status, OutcomeStatus::Committed, "a good request around it was refused");
        }
    }
    let letters = dead_letters(rig).await;
    let letter = letters
        .iter()
        .find(|l| l.letter.request.contains(&bad.request_id.to_string()))
        .expect("the unstorable request's dead letter");
    assert_eq!(letter.letter.reason, "unstorable");
    assert!(letter.letter.detail.contains(database_says), "{}", letter.letter.detail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_database_refuses_are_dead_lettered_and_never_stop_the_partition() {
    let rig = Rig::start().await;
    let session = rig.create_session().await;

    // A message imported with a time Postgres cannot hold (it set the session's active_at,
    // and failed the commit when no later message of its batch moved that on): stored,
    // active from its stream time, whatever the batching.
    let ancient =
        chrono::NaiveDate::from_ymd_opt(-20000, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap().and_utc();
    let imported = EventBody::UserMessage(UserMessage {
        text: "from long ago".into(),
        imported: Some(Imported { source: "chatgpt".into(), id: "m1".into(), created_at: Some(ancient) }),
        ..Default::default()
    });
    let old = AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &imported);
    assert!(serde_json::to_string(&old).unwrap().contains("-20000-01-01T00:00:00Z"));
    let o = rig.send(&old).await;
    assert_eq!(o.status, OutcomeStatus::Committed);
    let active: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT active_at FROM sessions WHERE id = $1")
            .bind(session.0)
            .fetch_one(&rig.env.pool)
            .await
            .unwrap();
    assert!(active > chrono::Utc::now() - chrono::Duration::minutes(5), "{active}");

    // An answer whose attempt id is too large for the attempt index.
    let answer = EventBody::AssistantTurn(AssistantTurn {
        attempt_id: Some(noise(8 * 1024).into()),
        ..Default::default()
    });
    let bad = AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &answer);
    refused_among_others(&rig, session, bad, "index row").await;

    // A memory too long for the memories' full-text index.
    let memory = EventBody::MemoryExtracted(MemoryExtracted {
        turn_seq: 2,
        memories: vec![ExtractedMemory { id: Uuid::new_v4(), text: distinct_words(740 * 1024) }],
        error: None,
    });
    let bad = AppendRequest::append(session, &owner(OWNER), Uuid::now_v7(), &memory);
    refused_among_others(&rig, session, bad, "tsvector").await;

    // A message of the same size is stored (the log takes it) and found by search by its
    // first 65,536 characters; the messages after it are indexed too.
    let long = rig.send(&message(session, &distinct_words(740 * 1024))).await;
    assert_eq!(long.status, OutcomeStatus::Committed);
    let after = rig.send(&message(session, "findable afterwards")).await;
    rig.env.search_caught_up().await;
    let indexed: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT seq, length(body) FROM search_entries WHERE session_id = $1 AND seq = ANY($2) ORDER BY seq",
    )
    .bind(session.0)
    .bind(vec![long.seq.unwrap(), after.seq.unwrap()])
    .fetch_all(&rig.env.pool)
    .await
    .unwrap();
    assert_eq!(indexed, [(long.seq.unwrap(), 65_536), (after.seq.unwrap(), 19)]);

    // The database is still a function of the APPEND stream: a rebuild refuses the same
    // requests and agrees with the live one.
    let target = rig.env.extra_database().await;
    let summary = turnlog_ops::rebuild(&target, &rig.bus, false).await.expect("rebuild");
    assert_eq!(summary.dead_lettered, 2, "{summary:?}");
    let verdict = turnlog_ops::verify(&rig.env.database_url, &target).await.expect("verify");
    assert!(verdict.is_identical(), "{verdict}");
    rig.stop().await;
}
