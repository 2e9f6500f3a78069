//! Stops the testkit's shared private Postgres and nats-server for this user and deletes
//! their data; the next test run starts fresh ones.

fn main() -> anyhow::Result<()> {
    turnlog_testkit::stop_private_servers()
}
