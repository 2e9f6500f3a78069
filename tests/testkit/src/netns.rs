//! [`TestHost`]: a second "machine" on this one — a network namespace of the test's own,
//! joined to this machine by a veth pair — so a test can run a process there and then take
//! that machine off the network without the process (or its kernel) closing anything, as a
//! host that loses power or its link does. Needs root (`ip netns`, iproute2), as CI has.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::Context as _;

use crate::util::{file_age, random_alnum};

/// A network namespace with one veth link to this machine: this machine is
/// [`local_addr`](Self::local_addr) on it, the test host [`addr`](Self::addr). Deleted, with
/// its link, when dropped (end the processes in it first).
#[derive(Debug)]
pub struct TestHost {
    name: String,
    local_if: String,
    addr: Ipv4Addr,
    local_addr: Ipv4Addr,
}

/// Makes a test host; panics with a clear message when this machine cannot (not root, no
/// iproute2).
pub fn test_host() -> TestHost {
    sweep();
    let key = random_alnum(6);
    // A random /30 of 10.213.0.0/16 (one in 16,384): Linux would let two test hosts on one
    // machine take the same one, and route one's traffic to the other.
    let random = uuid::Uuid::new_v4();
    let (third, block) = (random.as_bytes()[0], random.as_bytes()[1] & 0xfc);
    let host = TestHost {
        name: format!("tl-{key}"),
        local_if: format!("tlh-{key}"),
        local_addr: Ipv4Addr::new(10, 213, third, block + 1),
        addr: Ipv4Addr::new(10, 213, third, block + 2),
    };
    if let Err(e) = host.set_up() {
        panic!(
            "turnlog-testkit: cannot make a test host (a network namespace; needs root and iproute2): {e:#}"
        );
    }
    host
}

impl TestHost {
    fn peer_if(&self) -> String {
        self.local_if.replacen("tlh-", "tln-", 1)
    }

    fn set_up(&self) -> anyhow::Result<()> {
        let (ns, local, peer) = (self.name.as_str(), self.local_if.as_str(), self.peer_if());
        let local_cidr = format!("{}/30", self.local_addr);
        let peer_cidr = format!("{}/30", self.addr);
        ip(&["netns", "add", ns])?;
        ip(&["link", "add", local, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", ns])?;
        ip(&["addr", "add", &local_cidr, "dev", local])?;
        ip(&["link", "set", local, "up"])?;
        ip(&["-n", ns, "addr", "add", &peer_cidr, "dev", &peer])?;
        ip(&["-n", ns, "link", "set", &peer, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// The test host's address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// This machine's address on the link, where servers the test host should reach listen.
    pub fn local_addr(&self) -> Ipv4Addr {
        self.local_addr
    }

    /// The program and arguments that run `program` on the test host (`ip netns exec`,
    /// which execs it: the process keeps the pid the caller sees).
    pub fn command(&self, program: &str) -> (String, Vec<String>) {
        ("ip".to_owned(), ["netns", "exec", &self.name, program].map(str::to_owned).to_vec())
    }

    /// Takes the test host off the network: its end of the link goes down, so nothing it
    /// sends arrives and nothing sent to it is answered, and no connection is closed.
    pub fn cut(&self) {
        if let Err(e) = ip(&["-n", &self.name, "link", "set", &self.peer_if(), "down"]) {
            panic!("turnlog-testkit: cannot cut test host {}: {e:#}", self.name);
        }
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the link, and so the pair.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.local_if]);
    }
}

/// Deletes test hosts an hour old or more: a test killed before its drop ran leaves its
/// namespace (and link) behind.
fn sweep() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else { return };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("tl-") && file_age(&entry.path()).is_some_and(|age| age > STALE) {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// The age past which a test host is another run's leftover.
const STALE: std::time::Duration = std::time::Duration::from_secs(3600);

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    anyhow::ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}
