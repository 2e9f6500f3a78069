//! The settings every service shares: [`Backbone`] (where the log and the bus are, embedded
//! in every service's config), [`Secret`] (the one type a password or key is kept in) and
//! the parsers behind the binary's flags, so a setting means the same thing to each service.

use std::time::Duration;

use sqlx::PgPool;

use crate::bus::{Bus, BusError};
pub use crate::secret::Secret;

/// Where the log and the bus are, and how the services use them: embedded as `backbone` in
/// every service's config.
#[derive(Debug, Clone)]
pub struct Backbone {
    /// `DATABASE_URL`.
    pub database_url: Secret,
    /// `NATS_URL` (it may carry a user and password, or a token).
    pub nats_url: Secret,
    /// `TURNLOG_BUS_PREFIX`: prefix of every stream and subject name.
    pub bus_prefix: String,
    /// `TURNLOG_PARTITIONS`: writer partitions; fixed for a deployment.
    pub partitions: u32,
    /// `TURNLOG_STREAM_REPLICAS` (1, 3 or 5): replicas of the streams and the lease bucket
    /// when they are created ([`Bus::ensure_topology`]) or migrated (`turnlog migrate --bus`).
    pub stream_replicas: usize,
    /// `TURNLOG_APPEND_MAX_AGE`: how long TURNLOG_APPEND keeps requests; None is forever.
    pub append_max_age: Option<Duration>,
    /// `TURNLOG_STATEMENT_TIMEOUT`: how long one read query of a reading service (the
    /// ingress, the workers) may run. The writer's commits are not bounded.
    pub statement_timeout: Duration,
}

impl Backbone {
    /// One partition, one replica, appends kept forever, the default statement timeout.
    pub fn new(
        database_url: impl Into<Secret>,
        nats_url: impl Into<Secret>,
        bus_prefix: impl Into<String>,
    ) -> Self {
        Self {
            database_url: database_url.into(),
            nats_url: nats_url.into(),
            bus_prefix: bus_prefix.into(),
            partitions: 1,
            stream_replicas: 1,
            append_max_age: None,
            statement_timeout: crate::db::DEFAULT_STATEMENT_TIMEOUT,
        }
    }

    pub async fn connect_bus(&self) -> Result<Bus, BusError> {
        Ok(Bus::connect(self.nats_url.expose(), &self.bus_prefix, self.partitions)
            .await?
            .with_replicas(self.stream_replicas))
    }

    /// A read-only pool whose statements stop at the statement timeout
    /// ([`crate::db::connect_reads`]).
    pub async fn connect_reads(&self, max_connections: u32) -> Result<PgPool, sqlx::Error> {
        crate::db::connect_reads(self.database_url.expose(), max_connections, self.statement_timeout).await
    }

    /// A pool whose statements run as long as they need ([`crate::db::connect`]).
    pub async fn connect_db(&self, max_connections: u32) -> Result<PgPool, sqlx::Error> {
        crate::db::connect(self.database_url.expose(), max_connections).await
    }
}

/// A setting's value that does not parse, as the flag parser shows it after the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("{0:?}: stream replicas are 1, 3 or 5")]
    Replicas(String),
    #[error("{0:?} is not a duration like 500ms, 90s, 15m, 12h or 30d")]
    NotADuration(String),
    #[error("{value:?}: unknown unit {unit:?} (use ms, s, m, h or d)")]
    UnknownUnit { value: String, unit: String },
    #[error("{0:?}: a duration here cannot be zero")]
    ZeroDuration(String),
}

/// `TURNLOG_STREAM_REPLICAS`: 1, 3 or 5 ([`crate::bus::STREAM_REPLICAS`]).
pub fn parse_replicas(s: &str) -> Result<usize, SettingError> {
    match s.trim().parse::<usize>() {
        Ok(n) if crate::bus::STREAM_REPLICAS.contains(&n) => Ok(n),
        _ => Err(SettingError::Replicas(s.to_owned())),
    }
}

/// `500ms`, `90s`, `15m`, `12h`, `30d`, or plain seconds; never zero.
pub fn parse_duration(s: &str) -> Result<Duration, SettingError> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| SettingError::NotADuration(s.to_owned()))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        "d" => Duration::from_secs(n.saturating_mul(86_400)),
        _ => return Err(SettingError::UnknownUnit { value: s.to_owned(), unit: unit.to_owned() }),
    };
    if d.is_zero() {
        return Err(SettingError::ZeroDuration(s.to_owned()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert!(
            parse_duration("0s").is_err() && parse_duration("1w").is_err() && parse_duration("x").is_err()
        );
    }

    #[test]
    fn replicas_are_one_three_or_five() {
        assert_eq!(parse_replicas("3"), Ok(3));
        assert_eq!(parse_replicas(" 5 "), Ok(5));
        assert_eq!(parse_replicas("1"), Ok(1));
        for bad in ["0", "2", "4", "7", "x", ""] {
            assert!(parse_replicas(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn secrets_never_show_a_password_or_key() {
        let url = Secret::from("postgres://turnlog:pw-123@db.internal:5432/turnlog");
        for shown in [format!("{url}"), format!("{url:?}")] {
            assert!(!shown.contains("pw-123") && shown.contains("db.internal:5432"), "{shown}");
        }
        let key = Secret::from("sk-live-123");
        assert_eq!(format!("{key}"), "***");
        assert_eq!(format!("{:?}", Some(key.clone())), "Some(Secret(***))");
        assert_eq!(key.expose(), "sk-live-123");
        let backbone = Backbone::new(url, "nats://user:nats-pw@n:4222", "turnlog");
        let shown = format!("{backbone:?}");
        assert!(!shown.contains("pw-123") && !shown.contains("nats-pw"), "{shown}");
    }
}
