//! What running servers of our own needs from the operating system: finding executables,
//! the user to run a server as, free ports, and signalling and watching processes we did
//! not necessarily start (a server left by an earlier run). Signals and users go through
//! `nix`; liveness is read from `/proc`.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{Gid, Pid, Uid, User};

/// How often the waits below look again.
const POLL: Duration = Duration::from_millis(50);

pub fn is_root() -> bool {
    Uid::effective().is_root()
}

/// The effective uid of this process, to name per-user directories.
pub fn current_uid() -> u32 {
    Uid::effective().as_raw()
}

/// Another user for a server to run as (only root may switch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    pub uid: Uid,
    pub gid: Gid,
}

impl RunAs {
    /// The local user `name` (looked up through NSS, so directory users count too), or
    /// `None` when there is none.
    pub fn user(name: &str) -> anyhow::Result<Option<RunAs>> {
        let user = User::from_name(name).with_context(|| format!("cannot look up the user {name}"))?;
        Ok(user.map(|u| RunAs { uid: u.uid, gid: u.gid }))
    }

    /// Makes `command` run as this user; std drops root's supplementary groups before
    /// switching, and signals reach the program itself (unlike `runuser`, which forks).
    pub fn apply(&self, command: &mut Command) {
        use std::os::unix::process::CommandExt;
        command.uid(self.uid.as_raw()).gid(self.gid.as_raw());
    }

    /// Hands `path` to this user.
    pub fn chown(&self, path: &Path) -> anyhow::Result<()> {
        std::os::unix::fs::chown(path, Some(self.uid.as_raw()), Some(self.gid.as_raw()))
            .with_context(|| format!("cannot hand {} to uid {}", path.display(), self.uid))
    }
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

pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// A TCP port on 127.0.0.1 that the OS just handed out for a listener we closed at once.
/// Another process could take it before it is used; in practice the kernel hands out
/// ephemeral ports in rotation, so that does not happen within moments.
pub fn free_port() -> anyhow::Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("cannot bind a free port on 127.0.0.1")?;
    Ok(listener.local_addr()?.port())
}

/// Whether `port` can be bound on 127.0.0.1 right now.
pub fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Whether a TCP connection to 127.0.0.1:`port` is accepted within `timeout`.
pub fn accepts(port: u16, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), timeout).is_ok()
}

/// Waits up to `timeout` for 127.0.0.1:`port` to accept connections, giving up early when
/// `gave_up` says the server will not come (it exited).
pub fn wait_accepting(port: u16, timeout: Duration, mut gave_up: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if accepts(port, Duration::from_millis(250)) {
            return true;
        }
        if gave_up() || Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Whether `pid` is a live (not zombie) process named `comm`; checking the name keeps a
/// recycled pid from passing for a server that died long ago.
pub fn process_alive(pid: u32, comm: &str) -> bool {
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

pub fn signal(pid: u32, signal: Signal) -> anyhow::Result<()> {
    let raw = i32::try_from(pid).context("pid out of range")?;
    kill(Pid::from_raw(raw), signal).with_context(|| format!("cannot send {signal} to pid {pid}"))
}

/// Waits up to `timeout` for process `pid` (named `comm`) to be gone.
pub fn wait_gone(pid: u32, comm: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while process_alive(pid, comm) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// The last `n` lines of a log file (lossy UTF-8), for error messages; a note when it
/// cannot be read.
pub fn tail_lines(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Opens `path` for appending, creating it and its directory.
pub fn append_log(path: &Path) -> anyhow::Result<std::fs::File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
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

    #[test]
    fn a_signal_reaches_a_child_and_a_dead_one_is_gone() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        assert!(process_alive(child.id(), "sleep"));
        signal(child.id(), Signal::SIGKILL).expect("kill");
        let _ = child.wait();
        assert!(wait_gone(child.id(), "sleep", Duration::from_secs(5)));
    }
}
