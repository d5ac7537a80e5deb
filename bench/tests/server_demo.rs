//! End to end: `kvtier-bench server-demo` (the server's demonstration) in small, in bounded
//! time: every transport, the other tenant's miss, the refused token, and the restart that
//! finds the blocks on NVMe.

use std::process::Command;
use std::time::Duration;

use kvtier_testkit::process::run_bounded;

#[test]
fn server_demo_runs_every_transport_and_restarts_warm() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    let f = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
            .args(["server-demo", "--demo-blocks", "4", "--nvme-dir"])
            .arg(&nvme),
        Duration::from_secs(120),
    )
    .unwrap();
    let out = f.output();
    assert!(f.status.success(), "{out}");
    for want in [
        "lookup before: 0 blocks",
        "put 4 new blocks",
        "get 4 blocks, every byte verified",
        "under another cache_salt: 0 cached",
        "worker (tcp , token): get 4 blocks verified",
        "worker (quic, token): get 4 blocks verified",
        "wrong token: refused",
        "restarting the server",
        "lookup after restart: 4 blocks (0 DRAM, 4 NVMe)",
        "get 4 blocks from NVMe, every byte verified",
    ] {
        assert!(out.contains(want), "no {want:?} in\n{out}");
    }
    assert!(nvme.is_dir());
}

#[test]
fn server_demo_refuses_zero_blocks() {
    let f = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_kvtier-bench")).args([
            "server-demo",
            "--demo-blocks",
            "0",
        ]),
        Duration::from_secs(60),
    )
    .unwrap();
    assert!(!f.status.success());
    assert!(
        f.stderr.contains("--demo-blocks must be at least 1"),
        "{}",
        f.stderr
    );
}
