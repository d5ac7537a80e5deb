//! Hosts in network namespaces the test makes (iproute2's `ip netns`, veth pairs, a bridge),
//! for what crosses a network: a hub namespace holds a bridge at [`Net::HUB`] and etcd; each
//! host namespace has one veth to that bridge at `10.77.0.(i + 1)`. Nothing else is touched:
//! the addresses exist only inside these namespaces, and dropping a [`Net`] deletes them.
//!
//! A partition takes a host's link to the bridge down ([`Net::cut`]): the host reaches neither
//! its peers nor etcd, while its Unix socket (a path in the shared filesystem) still serves
//! local clients. `tc netem` (delay, loss) is not used: the kernel of our machines has no
//! `sch_netem` ("Specified qdisc kind is unknown").
//!
//! Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN). A test run by another user
//! runs itself again under `sudo -n` ([`as_root`]); where that is not allowed either, it fails
//! and says so. These tests are never skipped.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS`, panicking with its error.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| {
        panic!(
            "running `ip {}`: {e} (the netns tests need iproute2)",
            args.join(" ")
        )
    });
    assert!(
        out.status.success(),
        "`ip {}` failed: {} (the netns tests make network namespaces: they need root, or \
         CAP_SYS_ADMIN and CAP_NET_ADMIN)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Whether the caller may go on here: true as root. Otherwise runs the test binary again
/// under `sudo -n` for exactly the test `name` (its full path, e.g. `partition::it`), and
/// returns false once that run passed; panics with its output if it failed or sudo refused.
pub fn as_root(name: &str) -> bool {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("sudo")
        .arg("-n")
        .arg("--preserve-env=PATH,KVTIER_ETCD,RUST_BACKTRACE")
        .arg(&exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .output()
        .unwrap_or_else(|e| panic!("{name} needs root to make network namespaces: sudo: {e}"));
    assert!(
        out.status.success(),
        "{name} needs root to make network namespaces; under `sudo -n` it failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

pub struct Net {
    hub: String,
    hosts: Vec<String>,
}

impl Net {
    /// The hub's address on the bridge (etcd listens there).
    pub const HUB: &'static str = "10.77.0.254";

    /// A hub and `n` hosts (at most 200), all links up.
    pub fn new(n: usize) -> Net {
        assert!(n <= 200);
        let tag = format!(
            "kvt{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let net = Net {
            hub: format!("{tag}-hub"),
            hosts: (0..n).map(|i| format!("{tag}-h{i}")).collect(),
        };
        // `net` exists before the first namespace does, so a failure below still deletes
        // whatever was made (Drop ignores names that are not there).
        let hub = net.hub.as_str();
        ip(&["netns", "add", hub]);
        ip(&["-n", hub, "link", "set", "lo", "up"]);
        ip(&["-n", hub, "link", "add", "br0", "type", "bridge"]);
        ip(&[
            "-n",
            hub,
            "addr",
            "add",
            &format!("{}/24", Self::HUB),
            "dev",
            "br0",
        ]);
        ip(&["-n", hub, "link", "set", "br0", "up"]);
        for (i, ns) in net.hosts.iter().enumerate() {
            let side = format!("h{i}");
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            // Both ends are made inside their namespaces: nothing appears in ours.
            ip(&[
                "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", &side, "netns",
                hub,
            ]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", net.addr(i)),
                "dev",
                "eth0",
            ]);
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
            ip(&["-n", hub, "link", "set", &side, "master", "br0"]);
            ip(&["-n", hub, "link", "set", &side, "up"]);
        }
        net
    }

    /// Host `i`'s namespace.
    pub fn ns(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Moves the calling thread into the hub namespace; threads it starts afterwards (a
    /// tokio runtime's workers, children's spawners) are born there too. Call it before
    /// building the test's runtime.
    pub fn enter_hub(&self) {
        let f = File::open(format!("/run/netns/{}", self.hub))
            .unwrap_or_else(|e| panic!("opening the hub namespace {}: {e}", self.hub));
        // SAFETY: setns(2) with a namespace fd we just opened and keep open for the call; it
        // changes only this thread's network namespace and touches no memory of ours.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "setns into {}: {}",
            self.hub,
            std::io::Error::last_os_error()
        );
    }

    /// Partitions host `i` from everyone (its link to the bridge down).
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.hub, "link", "set", &format!("h{i}"), "down"]);
    }

    /// Ends host `i`'s partition.
    pub fn heal(&self, i: usize) {
        ip(&["-n", &self.hub, "link", "set", &format!("h{i}"), "up"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace takes its veth ends (and the bridge) with it.
        for ns in self.hosts.iter().chain(std::iter::once(&self.hub)) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
