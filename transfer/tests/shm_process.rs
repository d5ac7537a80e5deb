//! Shared memory across two processes: this test re-runs its own binary as a child that
//! hosts the target agent (its blob handed over in a file), reaches it through the child's `/proc/<pid>/fd/<n>` paths, writes
//! and reads its region, and notifies it; the child checks the bytes and the notification, and its exit status
//! says so.
//! Then the child exits and the parent sees `Disconnected`. Time is bounded on both sides.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_testkit::process::ChildGuard;
use kvtier_transfer::{Agent, AgentConfig, BackendKind, Descriptor, ErrorKind, Op};

const CHILD_ENV: &str = "KVTIER_TRANSFER_SHM_CHILD";
const LEN: u64 = 4 << 20;
const DEADLINE: Duration = Duration::from_secs(60);

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The child: hosts a region filled with pattern(1), writes the blob to `out`, waits for the
/// parent's notification, checks that the region then holds pattern(2), and waits for stdin
/// to close.
async fn child(out: std::path::PathBuf) {
    let agent = Agent::new("child", AgentConfig::default()).await.unwrap();
    let region = agent.alloc_dram(LEN).unwrap();
    region.write_at(0, &pattern(1)).unwrap();
    let tmp = out.with_extension("tmp");
    std::fs::write(
        &tmp,
        format!("{} {}", hex(&agent.metadata().unwrap()), region.id().0),
    )
    .unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    let n = tokio::time::timeout(DEADLINE, agent.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.message, b"written");
    let mut got = vec![0u8; LEN as usize];
    region.read_at(0, &mut got).unwrap();
    assert!(got == pattern(2), "the parent's write did not land");
    // Stay up until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn shm_across_processes() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if let Some(out) = std::env::var_os(CHILD_ENV) {
        rt.block_on(child(out.into()));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("blob");
    // Killed on drop, also when an assertion below fails.
    let mut guard = ChildGuard::new(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "shm_across_processes", "--test-threads=1"])
            .env(CHILD_ENV, &out)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let proc = guard.child();
    let start = Instant::now();
    let text = loop {
        if let Ok(t) = std::fs::read_to_string(&out) {
            break t;
        }
        if let Some(status) = proc.try_wait().unwrap() {
            panic!("the child ended before writing its blob: {status}");
        }
        assert!(start.elapsed() < DEADLINE, "the child wrote no blob");
        std::thread::sleep(Duration::from_millis(10));
    };
    let (b, id) = text.split_once(' ').unwrap();
    let (blob, remote) = (unhex(b), kvtier_transfer::RegionId(id.parse().unwrap()));
    rt.block_on(async {
        tokio::time::timeout(DEADLINE, async {
            let agent = Agent::new("parent", AgentConfig::default()).await.unwrap();
            let local = agent.alloc_dram(LEN).unwrap();
            let peer = agent.connect(&blob, BackendKind::Shm).await.unwrap();
            let d = Descriptor::new(local.id(), 0, remote, 0, LEN);
            // Read the child's bytes, then overwrite them and notify.
            peer.read(&[d]).unwrap().await.unwrap();
            let mut got = vec![0u8; LEN as usize];
            local.read_at(0, &mut got).unwrap();
            assert!(got == pattern(1), "read the wrong bytes from the child");
            local.write_at(0, &pattern(2)).unwrap();
            peer.post(Op::Write, &[d], Some(b"written".to_vec()))
                .unwrap()
                .await
                .unwrap();
            // Let the child exit (close its stdin), then every transfer is Disconnected.
            drop(proc.stdin.take());
            let start = Instant::now();
            let status = loop {
                if let Some(s) = proc.try_wait().unwrap() {
                    break s;
                }
                assert!(start.elapsed() < DEADLINE, "the child did not exit");
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            assert!(status.success(), "the child failed: {status}");
            let e = peer.write(&[d]).unwrap().await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Disconnected, "{e}");
        })
        .await
        .expect("the test ran past its deadline");
    });
}
