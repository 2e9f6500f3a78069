//! The testkit's own tests: isolation between environments, migrations, the private-server
//! path, cleanup, child processes, and fault-test servers keeping their data across
//! restarts.

use std::process::Command;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use turnlog_testkit::{
    eventually, free_port, private_nats, private_nats_cluster, private_postgres, test_env, test_env_on,
    ExternalProcess, TestEnv, TurnlogProcess, STATE_DIR_VAR,
};

async fn table_exists(env: &TestEnv, table: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("public.{table}"))
        .fetch_one(&env.pool)
        .await
        .expect("query")
}

async fn database_exists(env: &TestEnv, name: &str) -> bool {
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&env.admin_url).await.expect("admin");
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&mut admin)
        .await
        .expect("query")
}

fn is_prefix(prefix: &str) -> bool {
    prefix.len() == 11
        && prefix.starts_with('t')
        && prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

async fn stream_names(js: &jetstream::Context) -> Vec<String> {
    use futures::TryStreamExt;
    js.stream_names().try_collect().await.expect("stream names")
}

#[tokio::test]
async fn two_environments_get_different_databases_and_prefixes() {
    let a = test_env().await;
    let b = test_env().await;
    assert_ne!(a.database_url, b.database_url);
    assert_ne!(a.bus_prefix, b.bus_prefix);
    assert!(is_prefix(&a.bus_prefix), "{}", a.bus_prefix);
    assert!(a.database_name().starts_with("turnlog_t_"), "{}", a.database_name());
    assert!(a.database_url.ends_with(&format!("/{}", a.database_name())));
    assert!(a.admin_url.ends_with("/postgres"), "{}", a.admin_url);

    // Each pool is really on its own database: a row in one is not in the other.
    sqlx::query("CREATE TABLE probe (x int)").execute(&a.pool).await.expect("create");
    assert!(table_exists(&a, "probe").await);
    assert!(!table_exists(&b, "probe").await);

    let vars = a.env_vars();
    let get = |k: &str| vars.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    assert_eq!(get("DATABASE_URL"), Some(a.database_url.clone()));
    assert_eq!(get("NATS_URL"), Some(a.nats_url.clone()));
    assert_eq!(get("TURNLOG_BUS_PREFIX"), Some(a.bus_prefix.clone()));
    a.cleanup().await;
    b.cleanup().await;
}

#[tokio::test]
async fn migrations_are_applied() {
    let env = test_env().await;
    for table in ["sessions", "session_events", "writer_positions", "request_outcomes"] {
        assert!(table_exists(&env, table).await, "table {table} missing");
    }
    let current: String =
        sqlx::query_scalar("SELECT current_database()").fetch_one(&env.pool).await.expect("query");
    assert_eq!(current, env.database_name());
}

#[tokio::test]
async fn nats_client_reaches_jetstream_and_cleanup_removes_only_its_own() {
    let env = test_env().await;
    let other = test_env().await;
    let js = jetstream::new(env.nats().await);
    let upper = env.bus_prefix.to_uppercase();
    let other_upper = other.bus_prefix.to_uppercase();
    for (name, subject) in [
        (format!("{upper}_APPEND"), format!("{}.append.>", env.bus_prefix)),
        (format!("KV_{upper}_TURNS"), format!("$KV.{upper}_TURNS.>")),
        (format!("{other_upper}_APPEND"), format!("{}.append.>", other.bus_prefix)),
    ] {
        js.create_stream(stream::Config { name, subjects: vec![subject], ..Default::default() })
            .await
            .expect("create stream");
    }
    js.publish(format!("{}.append.0.x", env.bus_prefix), "hello".into())
        .await
        .expect("publish")
        .await
        .expect("ack");

    let database = env.database_name().to_owned();
    let prefix = env.bus_prefix.clone();
    env.cleanup().await;

    let names = stream_names(&js).await;
    assert!(!names.iter().any(|n| n.contains(&upper)), "streams of {prefix} left: {names:?}");
    assert!(names.contains(&format!("{other_upper}_APPEND")), "another test's stream deleted");
    assert!(!database_exists(&other, &database).await, "database {database} still there");
    assert!(database_exists(&other, other.database_name()).await);
    other.cleanup().await;
}

fn state_dir() -> String {
    if let Some(dir) = std::env::var_os(STATE_DIR_VAR) {
        return dir.to_string_lossy().into_owned();
    }
    let uid = std::fs::read_to_string("/proc/self/status")
        .expect("status")
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .expect("uid");
    format!("/var/tmp/turnlog-testkit-{uid}")
}

fn set_age(path: &str, age: Duration) {
    let file = std::fs::File::options().write(true).open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    file.set_modified(std::time::SystemTime::now() - age).expect("set mtime");
}

/// Set in a child process this suite runs: it runs the inner part of the test it names.
const INNER: &str = "TURNLOG_TESTKIT_INNER";

/// Runs `test` of this binary in a child process, its inner part (`INNER` set), with `env`
/// changed as given (None removes a variable); returns the stdout of a passing run.
fn run_inner(test: &str, env: &[(&str, Option<&str>)]) -> String {
    let mut command = Command::new(std::env::current_exe().expect("current exe"));
    command.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(INNER, "1");
    for (key, value) in env {
        match value {
            Some(v) => command.env(key, v),
            None => command.env_remove(key),
        };
    }
    let out = command.output().expect("run self");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "inner test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// An environment recorded two hours ago and no longer used is swept by the next test
/// process that makes one. The sweep runs in a child process with a state directory of its
/// own, on this run's servers: the environments other runs left on long-lived servers
/// (thousands, on a machine that has run the suite for a while) are not in its records, so
/// none stands before this one in a sweep's 5 s budget.
#[test]
fn abandoned_environments_are_swept_after_an_hour() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    if std::env::var_os(INNER).is_some() {
        return runtime.block_on(sweep_inner());
    }
    let env = runtime.block_on(test_env());
    let dir = std::env::temp_dir().join(format!("turnlog-testkit-sweep-{}", env.bus_prefix));
    run_inner(
        "abandoned_environments_are_swept_after_an_hour",
        &[
            (STATE_DIR_VAR, Some(&dir.to_string_lossy())),
            ("DATABASE_URL", Some(&env.admin_url)),
            ("NATS_URL", Some(&env.nats_url)),
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
    runtime.block_on(env.cleanup());
}

/// Run in a child process by [`abandoned_environments_are_swept_after_an_hour`].
async fn sweep_inner() {
    let old = test_env().await;
    let js = jetstream::new(old.nats().await);
    let stream_name = format!("{}_EVENTS", old.bus_prefix.to_uppercase());
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![format!("{}.events.>", old.bus_prefix)],
        ..Default::default()
    })
    .await
    .expect("create stream");
    // Abandoned: no connections, recorded two hours ago, and the last sweep long ago.
    old.pool.close().await;
    set_age(&format!("{}/envs/{}.json", state_dir(), old.bus_prefix), Duration::from_secs(7200));
    set_age(&format!("{}/last-sweep", state_dir()), Duration::from_secs(3600));

    // The next environment made (here, or by a test running beside this one) sweeps.
    let new = test_env().await;
    let database = old.database_name().to_owned();
    eventually(Duration::from_secs(20), || {
        let (new, database, js, stream_name) = (&new, &database, &js, &stream_name);
        async move {
            let names = stream_names(js).await;
            (!database_exists(new, database).await && !names.contains(stream_name)).then_some(())
        }
    })
    .await;
    assert!(!std::path::Path::new(&format!("{}/envs/{}.json", state_dir(), old.bus_prefix)).exists());
    assert!(database_exists(&new, new.database_name()).await, "a fresh environment was swept");
    new.cleanup().await;
}

/// Runs its inner part in a child process without DATABASE_URL / NATS_URL, twice, so the
/// private path is covered whichever way the suite is run, and the second process must
/// reuse the servers the first one found or started.
#[test]
fn private_servers_are_started_once_and_reused_when_env_is_unset() {
    if std::env::var_os(INNER).is_some() {
        return tokio::runtime::Runtime::new().expect("runtime").block_on(private_servers_inner());
    }
    let run = || {
        let stdout = run_inner(
            "private_servers_are_started_once_and_reused_when_env_is_unset",
            &[("DATABASE_URL", None), ("NATS_URL", None)],
        );
        // libtest prints "test name ... " before the test's own output on the same line.
        let at = stdout.find("SERVERS ").expect("SERVERS line");
        stdout[at..].lines().next().unwrap_or_default().to_owned()
    };
    let first = run();
    let second = run();
    assert_eq!(first, second, "a second test process must reuse the same private servers");
}

async fn private_servers_inner() {
    assert!(std::env::var_os("DATABASE_URL").is_none() && std::env::var_os("NATS_URL").is_none());
    let env = test_env().await;
    let again = test_env().await;
    assert_eq!(env.admin_url, again.admin_url);
    assert_eq!(env.nats_url, again.nats_url);
    assert!(env.admin_url.starts_with("postgres://postgres@127.0.0.1:"), "{}", env.admin_url);
    assert!(env.nats_url.starts_with("nats://127.0.0.1:"), "{}", env.nats_url);

    // The recorded state names the servers this environment uses.
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(format!("{}/servers.json", state_dir())).expect("servers.json"),
    )
    .expect("json");
    let pg_port = state["postgres"]["port"].as_u64().expect("pg port");
    let nats_port = state["nats"]["port"].as_u64().expect("nats port");
    assert!(env.admin_url.contains(&format!(":{pg_port}/")));
    assert!(env.nats_url.ends_with(&format!(":{nats_port}")));

    assert!(table_exists(&env, "sessions").await);
    let js = jetstream::new(env.nats().await);
    let name = format!("{}_APPEND", env.bus_prefix.to_uppercase());
    js.create_stream(stream::Config {
        name,
        subjects: vec![format!("{}.>", env.bus_prefix)],
        ..Default::default()
    })
    .await
    .expect("JetStream on the private nats-server");
    println!("SERVERS {} {}", env.admin_url, env.nats_url);
    env.cleanup().await;
    again.cleanup().await;
}

/// A three-replica stream on the private cluster keeps its messages and takes new ones
/// while one node is killed (once JetStream has elected new leaders), and the node comes back
/// on its ports and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_nats_cluster_outlives_one_node_killed_and_restarted() {
    let mut cluster = private_nats_cluster().await;
    let urls = cluster.urls();
    let servers: Vec<&str> = urls.split(',').collect();
    assert_eq!(servers.len(), 3, "{urls}");
    let js = jetstream::new(async_nats::connect(servers).await.expect("connect"));
    let mut info = js
        .create_stream(stream::Config {
            name: "CLUSTERED".to_owned(),
            subjects: vec!["clustered.>".to_owned()],
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("create an R3 stream");
    let peers = info.info().await.expect("info").cluster.as_ref().map(|c| c.replicas.len());
    assert_eq!(peers, Some(2));
    js.publish("clustered.1", "a".into()).await.expect("publish").await.expect("ack");

    cluster.kill(0);
    assert!(!cluster.is_running(0));
    let publish = || {
        let js = js.clone();
        async move { js.publish("clustered.2", "b".into()).await.ok()?.await.ok() }
    };
    eventually(Duration::from_secs(30), publish).await;

    cluster.restart(0).await;
    assert!(cluster.is_running(0));
    cluster.wait_for_jetstream(Duration::from_secs(30)).await;
    let n0 = cluster.server_name(0);
    eventually(Duration::from_secs(20), || async {
        let info = js.get_stream("CLUSTERED").await.ok()?.info().await.ok()?.clone();
        let c = info.cluster?;
        let back =
            c.leader.as_deref() == Some(n0.as_str()) || c.replicas.iter().any(|p| p.name == n0 && p.current);
        (back && info.state.messages == 2).then_some(())
    })
    .await;
}

#[tokio::test]
async fn private_nats_keeps_jetstream_data_across_restarts_on_its_port() {
    let port = free_port();
    let mut nats = private_nats(port).await;
    assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));
    let env = test_env_on(None, Some(&nats.url())).await;
    assert_eq!(env.nats_url, nats.url());
    let js = jetstream::new(env.nats().await);
    js.create_stream(stream::Config {
        name: "FAULT".to_owned(),
        subjects: vec!["fault.>".to_owned()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    let publish = |n: u32| {
        let js = js.clone();
        async move {
            js.publish(format!("fault.{n}"), format!("m{n}").into())
                .await
                .expect("publish")
                .await
                .expect("ack");
        }
    };
    let messages = |js: jetstream::Context| async move {
        let mut s = js.get_stream("FAULT").await.ok()?;
        Some(s.info().await.ok()?.state.messages)
    };
    for n in 0..3 {
        publish(n).await;
    }

    // Graceful restart on the same port: the client reconnects, the data is there.
    let first_pid = nats.pid();
    nats.restart().await;
    assert_ne!(nats.pid(), first_pid);
    let count = eventually(Duration::from_secs(10), || messages(js.clone())).await;
    assert_eq!(count, 3);

    // A crash (SIGKILL) and restart keeps acknowledged messages too.
    publish(3).await;
    nats.kill();
    assert!(!nats.is_running());
    nats.restart().await;
    let count = eventually(Duration::from_secs(10), || messages(js.clone())).await;
    assert_eq!(count, 4);

    // Frozen: requests go unanswered; thawed: they work again.
    nats.stop();
    let frozen = tokio::time::timeout(Duration::from_millis(500), messages(js.clone())).await;
    assert!(frozen.is_err() || frozen.is_ok_and(|c| c.is_none()), "a stopped server answered");
    nats.cont();
    assert_eq!(eventually(Duration::from_secs(10), || messages(js.clone())).await, 4);

    let store = nats.store_dir().to_owned();
    drop(nats);
    assert!(!store.exists(), "store dir left behind");
}

#[tokio::test]
async fn private_postgres_keeps_data_across_restart_and_crash() {
    let port = free_port();
    let mut pg = private_postgres(port).await;
    assert_eq!(pg.url(), format!("postgres://postgres@127.0.0.1:{port}/postgres"));
    let env = test_env_on(Some(&pg.url()), None).await;
    assert!(env.database_url.contains(&format!(":{port}/turnlog_t_")));
    assert!(table_exists(&env, "sessions").await);
    sqlx::raw_sql("CREATE TABLE probe (x int); INSERT INTO probe VALUES (1)")
        .execute(&env.pool)
        .await
        .expect("insert");
    let count = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM probe").fetch_one(&pool).await.ok()
    };

    pg.restart().await;
    assert_eq!(eventually(Duration::from_secs(10), || count(env.pool.clone())).await, 1);

    sqlx::query("INSERT INTO probe VALUES (2)").execute(&env.pool).await.expect("insert");
    pg.kill();
    let answer = tokio::time::timeout(Duration::from_secs(1), count(env.pool.clone())).await;
    assert!(answer.is_err() || answer.is_ok_and(|c| c.is_none()), "a killed server answered");
    pg.start().await;
    assert_eq!(eventually(Duration::from_secs(10), || count(env.pool.clone())).await, 2);

    let data = pg.data_dir().to_owned();
    drop(env);
    drop(pg);
    assert!(!data.exists(), "data dir left behind");
}

fn proc_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')').and_then(|i| stat[i + 1..].trim_start().chars().next()).unwrap_or('?')
}

#[tokio::test]
async fn turnlog_process_gets_the_environment_logs_and_obeys_signals() {
    let env = test_env().await;
    // Any program stands in for the turnlog binary: the harness only spawns and signals.
    let script =
        "echo \"db=$DATABASE_URL nats=$NATS_URL prefix=$TURNLOG_BUS_PREFIX extra=$EXTRA\"; exec sleep 60";
    let mut p = TurnlogProcess::start("/bin/sh", &env, &["-c", script], &[("EXTRA", "42")]);
    let expected =
        format!("db={} nats={} prefix={} extra=42", env.database_url, env.nats_url, env.bus_prefix);
    eventually(Duration::from_secs(5), || {
        let tail = p.log_tail(10);
        let expected = expected.clone();
        async move { tail.contains(&expected).then_some(()) }
    })
    .await;
    assert!(p.log_path().starts_with(std::env::temp_dir()));

    let pid = p.pid();
    p.stop();
    eventually(Duration::from_secs(5), || async move { (proc_state(pid) == 'T').then_some(()) }).await;
    p.cont();
    eventually(Duration::from_secs(5), || async move { (proc_state(pid) != 'T').then_some(()) }).await;
    assert!(p.wait_exit(Duration::from_millis(100)).await.is_none(), "exited on its own");

    p.terminate();
    let status = p.wait_exit(Duration::from_secs(5)).await.expect("exits on SIGTERM");
    assert!(!status.success());

    p.restart().await;
    assert!(p.is_running());
    assert_ne!(p.pid(), pid);
    eventually(Duration::from_secs(5), || {
        let log = std::fs::read_to_string(p.log_path()).unwrap_or_default();
        async move { (log.matches("extra=42").count() == 2).then_some(()) }
    })
    .await;

    let second = p.pid();
    p.kill();
    assert!(p.wait_exit(Duration::ZERO).await.is_some());
    assert!(!std::path::Path::new(&format!("/proc/{second}")).exists() || proc_state(second) == 'Z');
}

#[tokio::test]
async fn external_process_is_killed_on_drop() {
    let mut sleeper = ExternalProcess::new("sleeper", "/bin/sleep").arg("60");
    sleeper.start().expect("start");
    let pid = sleeper.pid();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(sleeper);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "sleep {pid} survived drop");
}

#[tokio::test]
async fn eventually_returns_the_first_some() {
    let mut calls = 0;
    let value = eventually(Duration::from_secs(5), || {
        calls += 1;
        let n = calls;
        async move { (n >= 3).then_some(n) }
    })
    .await;
    assert_eq!(value, 3);
}

#[tokio::test]
#[should_panic(expected = "eventually: condition not met within 200ms")]
async fn eventually_panics_on_timeout_naming_the_caller() {
    eventually(Duration::from_millis(200), || async { None::<()> }).await;
}

#[test]
fn free_port_is_bindable() {
    let port = free_port();
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind the free port");
}
