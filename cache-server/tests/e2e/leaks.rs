//! A client killed mid-put or mid-get leaks nothing: its reservations and pins go with its
//! connection (and would expire with their leases anyway).

use std::process::{Command, Stdio};
use std::time::Duration;

use kvtier_core::protocol::{Hello, KeyList, PutEntry, Request, Response};
use tokio::io::AsyncBufReadExt;

use crate::common::*;

const CHILD_ENV: &str = "KVTIER_E2E_CHILD";

/// Runs only as the child the tests below start (and kill); otherwise returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_child() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let addr = std::env::var("KVTIER_E2E_ADDR").unwrap();
    let k = keys(b"leak", 512, 0);
    // The connection must outlive the match arms: it is what the server cleans up after.
    let mut _held: Vec<Box<dyn std::any::Any>> = Vec::new();
    match mode.as_str() {
        "put" => {
            let mut r = Raw::new(tokio::net::UnixStream::connect(&addr).await.unwrap());
            let hello = Request::Hello(Hello {
                min_version: kvtier_core::protocol::VERSION,
                max_version: kvtier_core::protocol::VERSION,
                client: "doomed".into(),
                token: String::new(),
                block_bytes: 0,
                want_arena: true,
            });
            r.send(&hello, &[]).await;
            assert!(matches!(r.recv().await.unwrap().1, Response::Hello(_)));
            let fresh = keys(b"leak-put", 8, 0);
            let entries: Vec<PutEntry> = fresh
                .iter()
                .enumerate()
                .map(|(i, key)| PutEntry {
                    key: *key,
                    parent: i.checked_sub(1).map(|p| fresh[p]),
                })
                .collect();
            r.send(
                &Request::Reserve {
                    entries,
                    lease_ms: 60_000,
                },
                &[],
            )
            .await;
            assert!(matches!(r.recv().await.unwrap().1, Response::Reserve(_)));
            // Also a pin, held.
            r.send(
                &Request::Pin {
                    keys: k[..4].to_vec(),
                    lease_ms: 60_000,
                },
                &[],
            )
            .await;
            assert!(matches!(r.recv().await.unwrap().1, Response::Pin(_)));
            _held.push(Box::new(r));
        }
        _ => {
            let mut r = Raw::new(tokio::net::TcpStream::connect(&addr).await.unwrap());
            assert!(matches!(r.hello(TOKEN).await, Response::Hello(_)));
            // Ask for 16 MiB and never read it: more than the socket buffers hold, so the
            // server is stuck mid-send with blocks pinned.
            for _ in 0..8 {
                r.send(&Request::Get(KeyList { keys: k.clone() }), &[])
                    .await;
            }
            _held.push(Box::new(r));
        }
    }
    println!("READY");
    tokio::time::sleep(Duration::from_secs(120)).await;
}

async fn run_and_kill(mode: &str, addr: &str, srv: &ServerProc, held: &str) {
    let mut child = tokio::process::Command::from({
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args([
            "--exact",
            "leaks::misbehaving_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, mode)
        .env("KVTIER_E2E_ADDR", addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        c
    })
    .kill_on_drop(true)
    .spawn()
    .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let l = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("child never got ready")
            .unwrap()
            .expect("child exited early");
        if l.contains("READY") {
            break;
        }
    }
    // It holds something now.
    let mut holding = false;
    for _ in 0..100 {
        let st = srv.stats().await;
        let pins = st["store"]["tiers"][0]["pins_outstanding"]
            .as_u64()
            .unwrap();
        if st[held].as_u64().unwrap_or(0) > 0 || pins > 0 {
            holding = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        holding,
        "the {mode} child should hold pins or reservations before it dies: {}",
        srv.stats().await
    );
    child.kill().await.unwrap();
    let mut st = serde_json::Value::Null;
    for _ in 0..250 {
        st = srv.stats().await;
        let pins = st["store"]["tiers"][0]["pins_outstanding"]
            .as_u64()
            .unwrap();
        if pins == 0 && st["leases_open"] == 0 && st["reservations_open"] == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    panic!("a killed client left state behind: {st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_killed_mid_put_or_mid_get_leaks_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let srv = ServerProc::start(&[]);
    bounded(120, async {
        let c = srv.client("unix").await;
        let k = keys(b"leak", 512, 0);
        for (i, chunk) in k.chunks(64).enumerate() {
            let d: Vec<Vec<u8>> = chunk.iter().map(|x| block_data(*x)).collect();
            let b: Vec<&[u8]> = d.iter().map(|x| x.as_slice()).collect();
            let parent = (i * 64).checked_sub(1).map(|p| k[p]);
            assert_eq!(c.put_chain(chunk, parent, &b).await.cached(), chunk.len());
        }
        drop(c);
        run_and_kill(
            "put",
            &srv.unix.display().to_string(),
            &srv,
            "reservations_open",
        )
        .await;
        run_and_kill("get", &srv.tcp.to_string(), &srv, "leases_open").await;
        // The slots the dead client had reserved are usable again: the store is whole.
        let c = srv.client("unix").await;
        assert_eq!(get_verified(&c, &k[..8]).await, 8);
        put_all(&c, &keys(b"leak-put", 8, 0)).await;
    })
    .await;
}
