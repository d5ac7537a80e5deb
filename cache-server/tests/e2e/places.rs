//! Startup refuses unsafe places (the socket-squatting attack): a runtime or data directory
//! that another user owns or that group or others can write, and a token file that others
//! may read, stop the server with a message naming the setting, the path, its mode and the
//! fix. Directories the server creates are 0700; the socket is 0600 and appears atomically.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use kvtier_client::{Client, ClientConfig};

use crate::common::*;

fn chmod(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// The server in `dir` must refuse to start, saying each of `says`.
fn check_refused(dir: &Path, extra: &[&str], says: &[&str]) {
    let (status, err) = ServerProc::refused_in(dir, extra);
    assert!(!status.success(), "it started: {err}");
    for s in says {
        assert!(err.contains(s), "{s:?} missing from: {err}");
    }
}

#[test]
fn a_runtime_dir_others_can_write_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    fs::create_dir(&run).unwrap();
    chmod(&run, 0o777);
    let path = run.display().to_string();
    check_refused(
        tmp.path(),
        &[],
        &["server.runtime_dir", &path, "0777", "chmod 0700"],
    );
    // No socket, no token was left there for a client to trust.
    assert_eq!(fs::read_dir(&run).unwrap().count(), 0);
    // Group-writable too.
    chmod(&run, 0o770);
    check_refused(tmp.path(), &[], &["server.runtime_dir", "0770"]);
}

#[test]
fn a_data_dir_others_can_write_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let nvme = tmp.path().join("nvme");
    fs::create_dir(&nvme).unwrap();
    chmod(&nvme, 0o777);
    check_refused(
        tmp.path(),
        &[],
        &["store.nvme_dir", &nvme.display().to_string(), "0777"],
    );
}

#[test]
fn another_users_runtime_dir_is_refused() {
    // Needs a directory that belongs to another user: root can make one.
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let tmp = tempfile::tempdir().unwrap();
    let run = if root {
        let run = tmp.path().join("run");
        fs::create_dir(&run).unwrap();
        chmod(&run, 0o700);
        std::os::unix::fs::chown(&run, Some(4242), Some(4242)).unwrap();
        run
    } else {
        // As any other user, "/" is root's: point the runtime dir there.
        Path::new("/").to_path_buf()
    };
    let set = format!("server.runtime_dir={:?}", run.display().to_string());
    check_refused(tmp.path(), &[&set], &["server.runtime_dir", "owned by uid"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_others_can_read_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    fs::write(&token, "file-token-1\n").unwrap();
    chmod(&token, 0o640);
    let sets = [
        "server.token=\"\"".to_string(),
        format!("server.token_file={:?}", token.display().to_string()),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    check_refused(
        tmp.path(),
        &sets,
        &["server.token_file", "0640", "chmod 0600"],
    );
    // Made private, it is taken, and it is the token.
    chmod(&token, 0o600);
    let srv = ServerProc::start_in(tmp.path(), &sets);
    bounded(30, async {
        let c = Client::connect(
            &srv.tcp_url(),
            ClientConfig::default().token("file-token-1"),
        )
        .await
        .unwrap();
        c.ping().await.unwrap();
        assert!(
            Client::connect(&srv.tcp_url(), ClientConfig::default().token(TOKEN))
                .await
                .is_err()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_server_creates_is_private() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let srv = ServerProc::start_in(tmp.path(), &["server.token=\"\""]);
    assert_eq!(mode(&run), 0o700, "runtime dir");
    assert_eq!(mode(&tmp.path().join("nvme")), 0o700, "nvme dir");
    assert_eq!(mode(&srv.unix) & 0o777, 0o600, "socket");
    assert_eq!(mode(&run.join("token")), 0o600, "generated token");
    let mut names: Vec<String> = fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // No temporary socket name is left behind.
    assert_eq!(names, ["kvtier.sock", "quic-cert.der", "token"]);
    let token = fs::read_to_string(run.join("token")).unwrap();
    bounded(30, async {
        srv.client("unix").await.ping().await.unwrap();
        let c = Client::connect(&srv.tcp_url(), ClientConfig::default().token(token.trim()))
            .await
            .unwrap();
        c.ping().await.unwrap();
    })
    .await;
    // A stale socket file (a dead server's, or a planted one) is replaced atomically:
    // restarted over the socket file the first one left (killed, so not removed).
    let unix = srv.unix.clone();
    drop(srv);
    assert!(unix.exists(), "a killed server leaves its socket file");
    let srv = ServerProc::start_in(tmp.path(), &["server.token=\"\""]);
    assert_eq!(mode(&srv.unix) & 0o777, 0o600, "socket");
    bounded(30, async { srv.client("unix").await.ping().await.unwrap() }).await;
}
