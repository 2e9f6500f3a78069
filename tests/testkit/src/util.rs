//! Small pieces the rest of the testkit leans on: random names, free ports, polling until a
//! condition holds, and facts about users and processes read from `/proc` and `/etc/passwd`
//! (no libc: the workspace forbids unsafe code).

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How often [`eventually`] asks again.
const POLL: Duration = Duration::from_millis(50);

/// A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it for a listener we
/// closed at once). Another process could take it before it is used; in practice the
/// kernel hands out ephemeral ports in rotation, so that does not happen within a test.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("turnlog-testkit: cannot bind a free port on 127.0.0.1: {e}"))
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

/// Whether a TCP connection to 127.0.0.1:`port` is accepted within `timeout`.
pub(crate) fn accepts(port: u16, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), timeout).is_ok()
}

/// Waits up to `timeout` for 127.0.0.1:`port` to accept connections.
pub(crate) fn wait_accepting(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if accepts(port, Duration::from_millis(250)) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Whether `port` can be bound on 127.0.0.1 right now.
pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// The effective uid of this process, from `/proc/self/status` (`id -u` as a fallback).
pub(crate) fn current_uid() -> u32 {
    let from_proc = std::fs::read_to_string("/proc/self/status").ok().and_then(|status| {
        let line = status.lines().find(|l| l.starts_with("Uid:"))?;
        // "Uid:  real  effective  saved  filesystem"
        line.split_whitespace().nth(2)?.parse().ok()
    });
    from_proc
        .or_else(|| {
            let out = Command::new("id").arg("-u").output().ok()?;
            String::from_utf8_lossy(&out.stdout).trim().parse().ok()
        })
        // Neither source answering means no /proc and no coreutils: treat as unprivileged.
        .unwrap_or(u32::MAX)
}

pub(crate) fn is_root() -> bool {
    current_uid() == 0
}

/// uid and gid of a local user, from `/etc/passwd`.
pub(crate) fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
    })
}

/// Whether `pid` is a live (not zombie) process whose command name is `comm`; checking the
/// name keeps a recycled pid from passing for a server that died long ago.
pub(crate) fn process_alive(pid: u32, comm: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state letter follows the command name in parentheses, which may itself hold
    // spaces or parentheses, so look after the last ')'.
    let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
    if matches!(state, None | Some("Z") | Some("X")) {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim() == comm).unwrap_or(false)
}

/// Sends signal `name` (`TERM`, `STOP`, `CONT`, `KILL`, `QUIT`, `INT`) to `pid` with the
/// `kill` command; the workspace forbids the unsafe code a direct syscall would need.
pub(crate) fn send_signal(pid: u32, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| anyhow::anyhow!("cannot run `kill -{name} {pid}`: {e} (Debian package procps)"))?;
    anyhow::ensure!(status.success(), "`kill -{name} {pid}` failed: {status}");
    Ok(())
}

/// Age of a file by its modification time; `None` when it cannot be read.
pub(crate) fn file_age(path: &Path) -> Option<Duration> {
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    Some(std::time::SystemTime::now().duration_since(modified).unwrap_or_default())
}

/// The last `n` lines of a text file (lossy UTF-8), or a note saying why there are none.
pub(crate) fn tail_lines(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
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

    #[test]
    fn this_process_is_alive_under_its_own_name() {
        let pid = std::process::id();
        let comm = std::fs::read_to_string("/proc/self/comm").expect("comm");
        assert!(process_alive(pid, comm.trim()));
        assert!(!process_alive(pid, "surely-not-this"));
    }
}
