//! The operator subcommands as an operator runs them: `turnlog dead`, `rebuild`, `verify`
//! and `replay` as processes against a live writer (in-process), checking what they print
//! and their exit codes.

use std::process::Output;

use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_e2e::rig::{self, filler, Rig, OWNER};
use turnlog_runtime::bus::{append_and_wait, AppendRequest};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_turnlog");

/// Runs `turnlog <args>` on the rig's environment to completion.
async fn turnlog(rig: &Rig, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(BIN);
    command.args(args).envs(rig.env.env_vars()).env("RUST_LOG", "warn").kill_on_drop(true);
    let output = tokio::time::timeout(rig::WAIT, command.output()).await.expect("in time").expect("runs");
    eprintln!(
        "$ turnlog {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_rebuild_verify_and_replay_from_the_command_line() {
    let rig = Rig::start().await;
    let s = rig.create_session().await;
    rig.turn(s, "Book the venue for Ada on May 3.", &filler(10, 1)).await;
    let early = SessionId::new();
    let body = EventBody::UserMessage(UserMessage { text: "too early".into(), ..Default::default() });
    let request = AppendRequest::append(early, OWNER, Uuid::now_v7(), &body);
    append_and_wait(&rig.bus, &rig.env.pool, &request, rig::WAIT).await.unwrap();

    let listed = turnlog(&rig, &["dead", "list"]).await;
    assert!(listed.status.success());
    let line = stdout(&listed).lines().find(|l| l.contains("unknown_session")).expect("listed").to_owned();
    assert!(stdout(&listed).contains("1 dead letter\n"), "{}", stdout(&listed));
    let seq = line.split_whitespace().next().unwrap().to_owned();
    let shown = turnlog(&rig, &["dead", "show", &seq]).await;
    assert!(stdout(&shown).contains(&format!("turnlog dead redrive {seq}")), "{}", stdout(&shown));
    let refused = turnlog(&rig, &["dead", "redrive", &seq, "--timeout", "5s"]).await;
    assert!(!refused.status.success(), "the session still does not exist");
    rig.send(&AppendRequest::create(early, OWNER, None)).await;
    let redriven = turnlog(&rig, &["dead", "redrive", &seq]).await;
    assert!(redriven.status.success());
    assert!(stdout(&redriven).contains("committed at seq 2"), "{}", stdout(&redriven));

    let target = rig.env.extra_database().await;
    let rebuilt = turnlog(&rig, &["rebuild", "--database-url", &target]).await;
    assert!(rebuilt.status.success());
    assert!(stdout(&rebuilt).contains("rebuilt 5 events"), "{}", stdout(&rebuilt));
    let again = turnlog(&rig, &["rebuild", "--database-url", &target]).await;
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("not empty"));

    rig.env.search_caught_up().await;
    let same = turnlog(&rig, &["verify", &rig.env.database_url, &target]).await;
    assert_eq!(same.status.code(), Some(0));
    assert_eq!(stdout(&same).trim(), "identical: 2 sessions, 5 events, 0 memories, 3 search rows, 0 files");
    let pool = turnlog_runtime::db::connect(&target, 1).await.unwrap();
    sqlx::query("UPDATE sessions SET title = 'edited' WHERE id = $1").bind(s.0).execute(&pool).await.unwrap();
    pool.close().await;
    let differs = turnlog(&rig, &["verify", &rig.env.database_url, &target]).await;
    assert_eq!(differs.status.code(), Some(1));
    assert!(stdout(&differs).contains(&format!("session {s}: title differs: A None / B Some(\"edited\")")));
    let nowhere = target.replace("turnlog_t_", "turnlog_missing_");
    let broken = turnlog(&rig, &["verify", &rig.env.database_url, &nowhere]).await;
    assert_eq!(broken.status.code(), Some(2));

    let model = rig.mock.base_url();
    let replay =
        ["replay", "--worker", "distiller", "--from-seq", "1", "--llm-url", &model, "--model", "mock"];
    let replayed = turnlog(&rig, &replay).await;
    assert!(replayed.status.success());
    assert!(
        stdout(&replayed).contains("replayed distiller over the feed from sequence 1"),
        "{}",
        stdout(&replayed)
    );
    assert_eq!(rig.events_of(s, "turn_memory").await.len(), 1, "the turn was distilled by the replay");
    let replayed = turnlog(
        &rig,
        &["replay", "--worker", "distiller", "--since", "1h", "--llm-url", &model, "--model", "mock"],
    )
    .await;
    assert!(replayed.status.success());
    assert_eq!(rig.events_of(s, "turn_memory").await.len(), 1, "and only once");
    rig.stop().await;
}
