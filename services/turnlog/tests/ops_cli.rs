//! The operator subcommands as an operator runs them: `turnlog dead`, `rebuild`, `verify`
//! and `replay` as processes against a live writer (in-process), checking what they print
//! and their exit codes.

use std::process::Output;
use std::time::Duration;

use turnlog_core::events::{EventBody, UserMessage};
use turnlog_core::ids::SessionId;
use turnlog_e2e::rig::{self, filler, owner, Rig, OWNER};
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
    let request = AppendRequest::append(early, &owner(OWNER), Uuid::now_v7(), &body);
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
    rig.send(&AppendRequest::create(early, &owner(OWNER), None)).await;
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

/// `turnlog import` / `turnlog export` (issue 25) with the workers running: the imported
/// answers get their memories on the low-priority consumer and no residue from the
/// distiller; the export writes every family; a repeat adds nothing; a bad file exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_and_export_from_the_command_line() {
    let mut rig = Rig::start().await;
    let (memory, distiller) = (
        turnlog_e2e::config::memory(&rig.env, &rig.mock.base_url()),
        turnlog_e2e::config::distiller(&rig.env, &rig.mock.base_url()),
    );
    rig.spawn(|stop| turnlog_memory::run(memory, stop));
    rig.spawn(|stop| turnlog_distiller::run(distiller, stop));
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/e2e/fixtures/chatgpt/conversations.json");

    let imported = turnlog(&rig, &["import", "--owner", OWNER, "--format", "chatgpt", fixture]).await;
    assert!(imported.status.success());
    assert!(
        stdout(&imported)
            .starts_with("imported 3 conversations (0 already there whole): 5 sessions, 13 messages"),
        "{}",
        stdout(&imported)
    );
    assert!(stdout(&imported).contains("skipped 4 parts"), "{}", stdout(&imported));
    rig.settle(&["memory-imported", "distiller"]).await;
    let counts: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM session_events WHERE kind IN ('assistant_turn', 'memory_extracted', 'turn_memory') \
         GROUP BY kind ORDER BY kind",
    )
    .fetch_all(&rig.env.pool)
    .await
    .unwrap();
    assert_eq!(
        counts,
        [("assistant_turn".into(), 7), ("memory_extracted".into(), 7)],
        "one extraction an answer, no residue"
    );

    let again = turnlog(&rig, &["import", "--owner", OWNER, fixture]).await;
    assert!(again.status.success());
    assert!(
        stdout(&again)
            .starts_with("imported 3 conversations (3 already there whole): 0 sessions, 0 messages"),
        "{}",
        stdout(&again)
    );

    let exported = turnlog(&rig, &["export", "--owner", OWNER]).await;
    assert!(exported.status.success());
    let headers: Vec<serde_json::Value> = stdout(&exported)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["format"] == "turnlog")
        .collect();
    assert_eq!(headers.len(), 5, "every session of the three families");
    let markdown = turnlog(&rig, &["export", "--owner", OWNER, "--format", "markdown"]).await;
    assert!(
        stdout(&markdown).contains("## You · 2023-11-16 22:13 UTC\n\n日本の首都はどこですか？"),
        "{}",
        stdout(&markdown)
    );

    let dir = std::env::temp_dir().join(format!("turnlog-cli-import-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let truncated = dir.join("truncated.json");
    std::fs::write(&truncated, &std::fs::read(fixture).unwrap()[..500]).unwrap();
    let refused = turnlog(&rig, &["import", "--owner", OWNER, truncated.to_str().unwrap()]).await;
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("nothing was imported"));
    std::fs::remove_dir_all(&dir).unwrap();
    rig.stop().await;
}

/// An import cut short by its writer's death (SIGKILL mid-way) completes when run again
/// once a writer is back: every message once, in order, nothing duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_cut_by_a_writer_kill_completes_when_run_again_with_nothing_twice() {
    use turnlog_testkit::{eventually, test_env, TurnlogProcess};
    let env = test_env().await;
    let mut writer = TurnlogProcess::start(BIN, &env, &["writer"], &[]);
    // 200 ShareGPT conversations of 12 messages: long enough to be cut mid-way.
    let (conversations, turns) = (200, 6);
    let mut file = String::new();
    for c in 0..conversations {
        let messages: Vec<serde_json::Value> = (0..turns)
            .flat_map(|t| {
                [
                    serde_json::json!({"from": "human", "value": format!("question {t} of conversation {c}")}),
                    serde_json::json!({"from": "gpt", "value": format!("answer {t} of conversation {c}")}),
                ]
            })
            .collect();
        file.push_str(&serde_json::json!({"id": format!("c{c}"), "conversations": messages}).to_string());
        file.push('\n');
    }
    let dir = std::env::temp_dir().join(format!("turnlog-cli-cut-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sharegpt.jsonl");
    std::fs::write(&path, file).unwrap();
    let path = path.to_str().unwrap().to_owned();
    let import = || {
        let mut command = tokio::process::Command::new(BIN);
        command
            .args(["import", "--owner", OWNER, "--format", "sharegpt", &path])
            .envs(env.env_vars())
            .env("RUST_LOG", "warn")
            .kill_on_drop(true);
        command
    };
    let messages = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM session_events WHERE kind IN ('user_message', 'assistant_turn')",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        n
    };

    let mut first = import().spawn().unwrap();
    let cut_at = eventually(Duration::from_secs(60), || async {
        let n = messages().await;
        (n >= 300).then_some(n)
    })
    .await;
    writer.kill();
    // Within one append timeout (the CLI's is 30 s) and a margin: the conversations under
    // way stop before their next append instead of each waiting out a timeout of its own.
    let status =
        tokio::time::timeout(Duration::from_secs(60), first.wait()).await.expect("the import ends").unwrap();
    let stored = messages().await;
    assert!(
        stored < (conversations * turns * 2) as i64,
        "the import was not cut ({stored} messages, {status})"
    );
    eprintln!("cut after {cut_at} messages; {stored} stored; the first import exited with {status}");

    writer.restart().await;
    let again =
        tokio::time::timeout(Duration::from_secs(300), import().output()).await.expect("in time").unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(messages().await, (conversations * turns * 2) as i64, "every message once");
    // Each conversation is one session holding its messages once, in order, gapless.
    let sessions: Vec<(i64, i64, Vec<String>)> = sqlx::query_as(
        "SELECT count(*), max(seq), array_agg(coalesce(payload->>'text', payload->'llm'->'message'->>'content') ORDER BY seq)
           FILTER (WHERE kind IN ('user_message', 'assistant_turn'))
           FROM session_events GROUP BY session_id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(sessions.len(), conversations);
    for (count, last, texts) in &sessions {
        assert_eq!((*count, *last), ((turns * 2 + 1) as i64, (turns * 2 + 1) as i64), "{texts:?}");
        let c = texts[0].rsplit(' ').next().unwrap();
        let expected: Vec<String> = (0..turns)
            .flat_map(|t| {
                [format!("question {t} of conversation {c}"), format!("answer {t} of conversation {c}")]
            })
            .collect();
        assert_eq!(texts, &expected);
    }
    let _ = std::fs::remove_dir_all(&dir);
    writer.terminate();
}
