//! Small pieces the rest of the testkit leans on: random names, free ports, polling until a
//! condition holds, the age of a file. Ports, processes and users in general are
//! turnlog-local-servers'.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

/// How often [`eventually`] asks again.
const POLL: Duration = Duration::from_millis(50);

/// A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it for a listener we
/// closed at once). Another process could take it before it is used; in practice the
/// kernel hands out ephemeral ports in rotation, so that does not happen within a test.
pub fn free_port() -> u16 {
    turnlog_local_servers::free_port().unwrap_or_else(|e| panic!("turnlog-testkit: {e:#}"))
}

/// Polls `f` every 50 ms until it returns `Some(value)`, and returns that value; panics
/// naming the caller's line when `timeout` passes first. A call of `f` that hangs is cut
/// off at the deadline too.
///
/// ```ignore
/// let seq = eventually(Duration::from_secs(5), || async { last_seq(&env.pool).await }).await;
/// ```
#[track_caller]
pub fn eventually<F, Fut, T>(timeout: Duration, mut f: F) -> impl Future<Output = T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    // Taken here, outside the async block, so the panic names the test's line.
    let caller = std::panic::Location::caller();
    async move {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            // A zero timeout still polls `f` once, so the last attempt at the deadline counts.
            if let Ok(Some(value)) = tokio::time::timeout(remaining, f()).await {
                return value;
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                break;
            }
            tokio::time::sleep(POLL.min(remaining)).await;
        }
        panic!("eventually: condition not met within {timeout:?} ({attempts} attempts), at {caller}");
    }
}

/// `n` random characters from `[a-z0-9]`, valid in database names, NATS subjects and
/// stream names. Drawn from v4 UUIDs so the workspace needs no `rand`.
pub(crate) fn random_alnum(n: usize) -> String {
    const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(n);
    while out.len() < n {
        let uuid = uuid::Uuid::new_v4();
        for (i, byte) in uuid.as_bytes().iter().enumerate() {
            // Bytes 6 and 8 carry the UUID's fixed version and variant bits; bytes at or
            // above 252 (= 7 * 36) are rejected so every character is equally likely.
            if i == 6 || i == 8 || *byte >= 252 || out.len() == n {
                continue;
            }
            out.push(char::from(ALPHABET[usize::from(*byte) % ALPHABET.len()]));
        }
    }
    out
}

/// Age of a file by its modification time; `None` when it cannot be read.
pub(crate) fn file_age(path: &Path) -> Option<Duration> {
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    Some(std::time::SystemTime::now().duration_since(modified).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_alnum_has_the_requested_length_and_alphabet() {
        for n in [0, 1, 10, 40] {
            let s = random_alnum(n);
            assert_eq!(s.len(), n);
            assert!(s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{s}");
        }
        assert_ne!(random_alnum(10), random_alnum(10));
    }
}
