//! What `turnlog dev` needs from the operating system to run servers of its own: finding
//! executables, the user to run Postgres as, free ports, and signalling and watching
//! processes it did not necessarily start (a server left by a killed `turnlog dev`).

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{Gid, Pid, Uid, User};

pub(crate) fn is_root() -> bool {
    Uid::effective().is_root()
}

/// uid and gid of a local user (through NSS, so directory users count too).
pub(crate) fn lookup_user(name: &str) -> anyhow::Result<Option<(Uid, Gid)>> {
    let user = User::from_name(name).with_context(|| format!("cannot look up the user {name}"))?;
    Ok(user.map(|u| (u.uid, u.gid)))
}

/// An executable on `PATH`, or in the sbin directories a non-root `PATH` often lacks
/// (Debian installs nats-server in /usr/sbin).
pub fn find_executable(name: &str) -> Option<PathBuf> {
    let path_dirs = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    let extra = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];
    path_dirs
        .unwrap_or_default()
        .into_iter()
        .chain(extra.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

pub(crate) fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// A TCP port on 127.0.0.1 that the OS just handed out for a listener we closed at once.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("cannot bind a free port on 127.0.0.1")?;
    Ok(listener.local_addr()?.port())
}

pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Waits up to `timeout` for 127.0.0.1:`port` to accept connections, giving up early when
/// `gave_up` says the server will not come (it exited).
pub(crate) fn wait_accepting(port: u16, timeout: Duration, mut gave_up: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(250)).is_ok() {
            return true;
        }
        if gave_up() || Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `pid` is a live (not zombie) process named `comm`; checking the name keeps a
/// recycled pid from passing for a server that died long ago.
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

pub(crate) fn signal(pid: u32, signal: Signal) -> anyhow::Result<()> {
    let raw = i32::try_from(pid).context("pid out of range")?;
    kill(Pid::from_raw(raw), signal).with_context(|| format!("cannot send {signal} to pid {pid}"))
}

/// Waits up to `timeout` for process `pid` (named `comm`) to be gone.
pub(crate) fn wait_gone(pid: u32, comm: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while process_alive(pid, comm) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// The last `n` lines of a log file, for error messages; a note when it cannot be read.
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

/// Opens `path` for appending, creating it.
pub(crate) fn append_log(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_under_its_own_name_only() {
        let comm = std::fs::read_to_string("/proc/self/comm").expect("comm");
        assert!(process_alive(std::process::id(), comm.trim()));
        assert!(!process_alive(std::process::id(), "surely-not-this"));
    }

    #[test]
    fn a_port_in_use_is_not_free() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert!(!port_is_free(port));
        assert!(wait_accepting(port, Duration::from_millis(100), || false));
    }
}
