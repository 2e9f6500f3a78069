//! Per-test isolation: a fresh Postgres database with the migrations applied and a unique
//! bus prefix, on the servers named by DATABASE_URL / NATS_URL or, where unset, on the
//! shared private ones this testkit starts once per run.

use std::sync::Mutex;

use anyhow::Context;
use futures::TryStreamExt;

use crate::servers;
use crate::sweep;
use crate::util::random_alnum;

/// Connections in each test's pool: enough for a test's concurrent queries while dozens of
/// test processes and their services share one server.
const POOL_SIZE: u32 = 5;

/// One test's world: its own database (migrated) and bus prefix on shared servers.
///
/// ```ignore
/// let env = turnlog_testkit::test_env().await;
/// sqlx::query("SELECT 1").execute(&env.pool).await?;
/// let nats = env.nats().await;
/// let writer = TurnlogProcess::start(bin, &env, &["writer"], &[]);
/// env.cleanup().await; // optional
/// ```
#[derive(Debug)]
pub struct TestEnv {
    /// The test's own database.
    pub database_url: String,
    /// The `postgres` database of the same server, for creating and dropping databases.
    pub admin_url: String,
    pub nats_url: String,
    /// `t` + 10 random `[a-z0-9]`: the value of TURNLOG_BUS_PREFIX for this test.
    pub bus_prefix: String,
    /// A pool on `database_url`.
    pub pool: sqlx::PgPool,
    /// TURNLOG_PARTITIONS of every service the test builds from [`TestEnv::backbone`]
    /// (1 unless the test sets it; fork tests run on 4).
    pub partitions: u32,
    database: String,
}

/// A fresh environment on the default servers: DATABASE_URL (any database on the server
/// to use; fresh ones are made through its `postgres` database) and NATS_URL when set,
/// each independently, else the shared private servers. Panics with a clear message when
/// the servers cannot be reached or started.
pub async fn test_env() -> TestEnv {
    test_env_on(None, None).await
}

/// Like [`test_env`], on given servers where `Some`: `postgres_admin_url` is a database on
/// the server to use (its name is swapped for `postgres`), e.g.
/// [`PrivatePostgres::url`](crate::PrivatePostgres::url); `nats_url` e.g.
/// [`PrivateNats::url`](crate::PrivateNats::url).
pub async fn test_env_on(postgres_admin_url: Option<&str>, nats_url: Option<&str>) -> TestEnv {
    match try_test_env_on(postgres_admin_url, nats_url).await {
        Ok(env) => env,
        Err(e) => panic!("turnlog-testkit: cannot set up a test environment: {e:#}"),
    }
}

/// [`test_env_on`] returning the error instead of panicking.
pub async fn try_test_env_on(
    postgres_admin_url: Option<&str>,
    nats_url: Option<&str>,
) -> anyhow::Result<TestEnv> {
    let suffix = random_alnum(10);
    let bus_prefix = format!("t{suffix}");
    let database = format!("turnlog_t_{suffix}");

    let mut servers = Servers::resolve(postgres_admin_url, nats_url, false).await?;
    if let Err(e) = create_database(&servers.admin_url, &database).await {
        // The shared private server may have died since this process looked (someone ran
        // turnlog-testkit-stop); look again, restarting it, and retry once.
        if !servers.private_postgres {
            return Err(e);
        }
        servers = Servers::resolve(postgres_admin_url, nats_url, true).await?;
        create_database(&servers.admin_url, &database).await?;
    }
    let nats_url_arg = nats_url;
    let Servers { admin_url, nats_url, .. } = servers;
    // Only parts on the default servers are swept later; servers passed in belong to the test.
    sweep::record(
        postgres_admin_url.is_none().then_some(admin_url.as_str()),
        nats_url_arg.is_none().then_some(nats_url.as_str()),
        &database,
        &bus_prefix,
    );

    let database_url = with_database(&admin_url, &database);
    let pool = turnlog_runtime::db::connect(&database_url, POOL_SIZE)
        .await
        .with_context(|| format!("cannot connect to {database_url}"))?;
    turnlog_runtime::db::migrate(&pool).await.with_context(|| format!("migrating {database}"))?;
    // Shown by nextest only for a failing test: where to look.
    eprintln!("turnlog-testkit: database {database_url}, NATS {nats_url}, bus prefix {bus_prefix}");

    if postgres_admin_url.is_none() && nats_url_arg.is_none() {
        sweep::maybe_sweep(&admin_url, &nats_url).await;
    }
    Ok(TestEnv { database_url, admin_url, nats_url, bus_prefix, pool, partitions: 1, database })
}

impl TestEnv {
    /// Whether the database commits durably (`fsync` and `synchronous_commit` on): a
    /// benchmark's timings mean little for production otherwise, so its RESULT line says
    /// `durable=0`. The testkit's private server runs with both off.
    pub async fn durable(&self) -> anyhow::Result<bool> {
        let mut on = true;
        for setting in ["fsync", "synchronous_commit"] {
            let value: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&self.pool).await?;
            on &= value != "off";
        }
        Ok(on)
    }

    /// Where the test's log and bus are, as every service's config takes it (one partition,
    /// appends kept forever, the default statement timeout).
    pub fn backbone(&self) -> turnlog_runtime::settings::Backbone {
        turnlog_runtime::settings::Backbone {
            partitions: self.partitions,
            ..turnlog_runtime::settings::Backbone::new(
                self.database_url.as_str(),
                self.nats_url.as_str(),
                self.bus_prefix.as_str(),
            )
        }
    }

    /// Waits until the search index has caught up with every partition's applied position
    /// (it trails the log by a fraction of a second): before comparing the database with a
    /// rebuild, which indexes everything.
    pub async fn search_caught_up(&self) {
        crate::eventually(std::time::Duration::from_secs(30), || async {
            let behind: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM writer_positions w
                   LEFT JOIN search_positions s ON s.partition = w.partition
                  WHERE coalesce(s.stream_seq, 0) < w.stream_seq",
            )
            .fetch_one(&self.pool)
            .await
            .ok()?;
            (behind == 0).then_some(())
        })
        .await;
    }

    /// Whether every committed event is on the feed: each writer partition's
    /// `published_seq` has reached its applied `stream_seq` (the writer answers a producer
    /// at its commit, before it publishes the commit's events, and moves `published_seq`
    /// after they are on the feed).
    pub async fn feed_caught_up(&self) -> bool {
        sqlx::query_scalar::<_, bool>(
            "SELECT NOT EXISTS (SELECT 1 FROM writer_positions WHERE published_seq < stream_seq)",
        )
        .fetch_one(&self.pool)
        .await
        .unwrap_or(false)
    }

    /// Waits until [`TestEnv::feed_caught_up`]: before reading the feed for what was just
    /// appended.
    pub async fn feed_published(&self) {
        crate::eventually(std::time::Duration::from_secs(30), || async {
            self.feed_caught_up().await.then_some(())
        })
        .await;
    }

    /// DATABASE_URL, NATS_URL, TURNLOG_BUS_PREFIX and TURNLOG_PARTITIONS for a child process.
    pub fn env_vars(&self) -> Vec<(String, String)> {
        vec![
            ("DATABASE_URL".to_owned(), self.database_url.clone()),
            ("NATS_URL".to_owned(), self.nats_url.clone()),
            ("TURNLOG_BUS_PREFIX".to_owned(), self.bus_prefix.clone()),
            ("TURNLOG_PARTITIONS".to_owned(), self.partitions.to_string()),
        ]
    }

    /// The name of the test's database (`turnlog_t_<random>`).
    pub fn database_name(&self) -> &str {
        &self.database
    }

    /// Another fresh, migrated, empty database on the environment's server (a rebuild's
    /// target, say); returns its URL. Swept like an environment's own database; panics
    /// when the server refuses.
    pub async fn extra_database(&self) -> String {
        let key = format!("{}x{}", self.bus_prefix, random_alnum(6));
        let database = format!("turnlog_t_{}", &key[1..]);
        let made = async {
            create_database(&self.admin_url, &database).await?;
            sweep::record(Some(&self.admin_url), None, &database, &key);
            let url = with_database(&self.admin_url, &database);
            let pool = turnlog_runtime::db::connect(&url, 1)
                .await
                .with_context(|| format!("cannot connect to {url}"))?;
            turnlog_runtime::db::migrate(&pool).await.with_context(|| format!("migrating {database}"))?;
            pool.close().await;
            anyhow::Ok(url)
        };
        match made.await {
            Ok(url) => url,
            Err(e) => panic!("turnlog-testkit: cannot make an extra database: {e:#}"),
        }
    }

    /// A new NATS client on the environment's server; panics when it cannot connect.
    pub async fn nats(&self) -> async_nats::Client {
        match sweep::connect_nats(&self.nats_url).await {
            Ok(client) => client,
            Err(e) => panic!("turnlog-testkit: {e:#}"),
        }
    }

    /// Removes the environment: drops its database (forcibly, even with connections open)
    /// and deletes its JetStream streams (those named after the upper-cased prefix, and the
    /// `KV_`/`OBJ_` streams of its buckets). Optional: abandoned environments are swept
    /// after an hour. Panics when the servers refuse.
    pub async fn cleanup(self) {
        let TestEnv { admin_url, nats_url, bus_prefix, pool, database, .. } = self;
        pool.close().await;
        let result = async {
            sweep::drop_database(&admin_url, &database, true).await?;
            let jetstream = async_nats::jetstream::new(sweep::connect_nats(&nats_url).await?);
            let names: Vec<String> =
                jetstream.stream_names().try_collect().await.context("listing streams")?;
            sweep::delete_streams(&jetstream, &names, &bus_prefix).await?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = result {
            panic!("turnlog-testkit: cleanup of {database} / {bus_prefix} failed: {e:#}");
        }
        sweep::forget(&bus_prefix);
    }
}

/// The servers a new environment goes on.
struct Servers {
    admin_url: String,
    nats_url: String,
    /// Whether Postgres is the shared private one (which this testkit can restart).
    private_postgres: bool,
}

/// URLs of the shared private servers, as found by this process: looking them up takes the
/// cross-process lock and a few TCP connects, which every test need not repeat.
static PRIVATE: Mutex<(Option<String>, Option<String>)> = Mutex::new((None, None));

impl Servers {
    async fn resolve(
        postgres_admin_url: Option<&str>,
        nats_url: Option<&str>,
        refresh: bool,
    ) -> anyhow::Result<Servers> {
        let postgres = postgres_admin_url
            .map(|u| with_database(u, "postgres"))
            .or_else(|| non_empty_var("DATABASE_URL").map(|u| with_database(&u, "postgres")));
        let nats = nats_url.map(str::to_owned).or_else(|| non_empty_var("NATS_URL"));
        let need_postgres = postgres.is_none();
        let need_nats = nats.is_none();
        let (private_postgres, private_nats) = if need_postgres || need_nats {
            tokio::task::spawn_blocking(move || private_servers(need_postgres, need_nats, refresh))
                .await
                .context("starting the shared private servers")??
        } else {
            (None, None)
        };
        // `need_*` true means the private one was asked for, and `private_servers` returns
        // `Some` for every server asked for.
        let admin_url = postgres.or(private_postgres).context("no Postgres server")?;
        let nats_url = nats.or(private_nats).context("no NATS server")?;
        Ok(Servers { admin_url, nats_url, private_postgres: need_postgres })
    }
}

fn private_servers(
    need_postgres: bool,
    need_nats: bool,
    refresh: bool,
) -> anyhow::Result<(Option<String>, Option<String>)> {
    // A poisoned lock only means another test panicked while holding it; the cached URLs
    // are still plain strings.
    let mut cache = PRIVATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if refresh {
        *cache = (None, None);
    }
    let missing_postgres = need_postgres && cache.0.is_none();
    let missing_nats = need_nats && cache.1.is_none();
    let (postgres, nats) = servers::ensure(missing_postgres, missing_nats)?;
    if postgres.is_some() {
        cache.0 = postgres;
    }
    if nats.is_some() {
        cache.1 = nats;
    }
    Ok((cache.0.clone().filter(|_| need_postgres), cache.1.clone().filter(|_| need_nats)))
}

fn non_empty_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

async fn create_database(admin_url: &str, database: &str) -> anyhow::Result<()> {
    let mut admin = sweep::admin_connection(admin_url).await?;
    // CREATE DATABASE cannot run in a transaction; raw_sql uses the simple protocol.
    let result = sqlx::raw_sql(&format!("CREATE DATABASE \"{database}\"")).execute(&mut admin).await;
    let _ = sqlx::Connection::close(admin).await;
    result.with_context(|| format!("cannot create database {database} via {admin_url}"))?;
    Ok(())
}

/// `url` with its database (the URL's path) replaced by `database`, keeping user, host,
/// port and query: `postgres://u@h:5432/app?sslmode=disable` → `postgres://u@h:5432/x?sslmode=disable`.
pub(crate) fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    // The authority (user, password, host, port) cannot hold an unescaped '/', '?' or '#'.
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(authority_end);
    let path_end = after.find(['?', '#']).unwrap_or(after.len());
    format!("{scheme}{authority}/{database}{}", &after[path_end..])
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn with_database_swaps_only_the_path() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p%2Fw@db:5433/app?sslmode=disable", "turnlog_t_1"),
            "postgres://u:p%2Fw@db:5433/turnlog_t_1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://db:5432", "postgres"), "postgres://db:5432/postgres");
        assert_eq!(with_database("postgres://db?sslmode=require", "a"), "postgres://db/a?sslmode=require");
        assert_eq!(
            with_database("postgres:///app?host=/run/postgresql", "b"),
            "postgres:///b?host=/run/postgresql"
        );
    }
}
