//! Hosts in network namespaces the test makes (iproute2's `ip netns`, veth pairs, a bridge),
//! for what crosses a network: a hub namespace holds a bridge at [`Net::HUB`] and etcd; each
//! host namespace has one veth to that bridge at `10.77.0.(i + 1)`. Nothing else is touched:
//! the addresses exist only inside these namespaces, and dropping a [`Net`] deletes them.
//!
//! A partition takes a host's link to the bridge down ([`Net::cut`]): the host reaches neither
//! its peers nor etcd, while its Unix socket (a path in the shared filesystem) still serves
//! local clients. Loss ([`Net::lose`]) and a cut between one host and one port of the hub
//! ([`Net::cut_from_hub_port`]: etcd unreachable, peers still reachable) are nftables rules in the
//! hub's bridge (`table bridge kvtier`, counted): every frame the bridge forwards to or
//! from a lossy host's port is dropped with that probability, as on a lossy wire (the
//! senders' stacks see nothing; TCP and QUIC find out by their own timers). `tc netem`
//! (delay) is not used: the kernel of our machines has no `sch_netem` ("Specified qdisc kind
//! is unknown"), and no other qdisc or nftables statement delays packets.
//!
//! Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN). A test run by another user
//! runs itself again under `sudo -n` ([`as_root`]); where that is not allowed either, it fails
//! and says so. These tests are never skipped.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Mutex;
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

/// Runs `nft -f -` in namespace `ns` on `script`, panicking with its error.
fn nft(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running nft in {ns}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft in {ns} failed: {} (the netns tests' loss and hub cuts need nftables: \
         .ci/install-deps installs it)\n{script}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// What the hub's bridge does to one host's frames.
#[derive(Clone, Copy, Default)]
struct Rules {
    /// Percent of the frames to or from the host dropped, each frame on its own.
    loss: u32,
    /// Every TCP segment between the host and this port of the hub (etcd's) dropped.
    hub_port_cut: Option<u16>,
}

pub struct Net {
    hub: String,
    hosts: Vec<String>,
    rules: Mutex<Vec<Rules>>,
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
            rules: Mutex::new(vec![Rules::default(); n]),
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

    /// Drops `percent` % of the frames between host `i` and the other hosts (0 ends the
    /// loss); between two lossy hosts a frame meets both losses. Frames between a host and
    /// the hub (etcd, and the test's own probes) are left alone.
    pub fn lose(&self, i: usize, percent: u32) {
        assert!(percent <= 100);
        self.rules.lock().unwrap()[i].loss = percent;
        self.apply();
    }

    /// Cuts host `i` off from TCP port `port` of the hub (etcd's), or (`None`) ends that:
    /// its peers still reach it and it them, and so does the test, which lives in the hub.
    pub fn cut_from_hub_port(&self, i: usize, port: Option<u16>) {
        self.rules.lock().unwrap()[i].hub_port_cut = port;
        self.apply();
    }

    /// Frames the bridge's rules have dropped so far.
    pub fn dropped(&self) -> u64 {
        let listing = nft_list(&self.hub);
        listing
            .split("counter packets ")
            .skip(1)
            .filter_map(|rest| rest.split(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Replaces the hub's `table bridge kvtier` with the rules now wanted, in one
    /// transaction (counters start again from 0).
    fn apply(&self) {
        let rules = self.rules.lock().unwrap();
        let (mut forward, mut input, mut output) = (String::new(), String::new(), String::new());
        for (i, r) in rules.iter().enumerate() {
            let port = format!("\"h{i}\"");
            if r.loss > 0 {
                let drop = format!("numgen random mod 100 < {} counter drop;", r.loss);
                forward += &format!(" iifname {port} {drop} oifname {port} {drop}");
            }
            if let Some(p) = r.hub_port_cut {
                input += &format!(" iifname {port} tcp dport {p} counter drop;");
                output += &format!(" oifname {port} tcp sport {p} counter drop;");
            }
        }
        // The first line makes the table where it is missing, so the delete never fails.
        nft(
            &self.hub,
            &format!(
                "table bridge kvtier\ndelete table bridge kvtier\ntable bridge kvtier {{\n\
                 chain forwarded {{ type filter hook forward priority 0; policy accept;{forward} }}\n\
                 chain arriving {{ type filter hook input priority 0; policy accept;{input} }}\n\
                 chain leaving {{ type filter hook output priority 0; policy accept;{output} }}\n}}\n"
            ),
        );
    }
}

/// `nft list ruleset` in namespace `ns`.
fn nft_list(ns: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "list", "ruleset"])
        .output()
        .unwrap_or_else(|e| panic!("running nft in {ns}: {e}"));
    assert!(out.status.success(), "nft list ruleset in {ns} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace takes its veth ends (and the bridge) with it.
        for ns in self.hosts.iter().chain(std::iter::once(&self.hub)) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
