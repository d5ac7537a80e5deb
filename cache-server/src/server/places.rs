//! Startup checks on the places the server keeps things (as sshd's `StrictModes` and
//! systemd's `RuntimeDirectory=` do): a directory that another user owns, or that a group or
//! other users can write, would let them replace the socket, the token or the data, so the
//! server refuses to start there and says how to fix it. Directories it creates are 0700.
//! Secret files (the token file, the TLS key) must be the server user's own and private.
//!
//! The rules, for a path the server uses:
//! - the directory itself: owned by the server's effective user, not writable by group or
//!   others;
//! - every directory above it (and every symbolic link on the way): owned by that user or by
//!   root; one writable by group or others only with the sticky bit (as `/tmp`), where no one
//!   can rename or remove what another user owns.

use std::fs::{self, Metadata};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ServerError;

/// Group- or other-writable permission bits.
const WRITABLE_BY_OTHERS: u32 = 0o022;
/// Any group or other permission bit.
const ANY_ACCESS_BY_OTHERS: u32 = 0o077;
const STICKY: u32 = 0o1000;

/// The effective user id of this process.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn unsafe_place(setting: &str, path: &Path, problem: String, fix: String) -> ServerError {
    ServerError::UnsafePlace {
        setting: setting.to_string(),
        path: path.to_path_buf(),
        problem,
        fix,
    }
}

fn absolute(setting: &str, path: &Path) -> Result<PathBuf, ServerError> {
    std::path::absolute(path).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", path.display()),
        source,
    })
}

/// Creates `dir` (and any missing parents) with mode 0700 if it is missing, then checks it
/// as [`check_private_dir`] does.
pub(crate) fn ensure_private_dir(setting: &str, dir: &Path) -> Result<(), ServerError> {
    if fs::symlink_metadata(dir).is_err() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| ServerError::Io {
                what: format!("creating {setting} {}", dir.display()),
                source,
            })?;
    }
    check_private_dir(setting, dir)
}

/// Refuses `dir` unless it is a directory owned by this user, not writable by group or
/// others, under directories that only this user or root can change (sticky ones aside).
pub(crate) fn check_private_dir(setting: &str, dir: &Path) -> Result<(), ServerError> {
    let abs = absolute(setting, dir)?;
    // The path as written (a symbolic link on it must not be another user's)...
    check_ancestors(setting, &abs)?;
    // ...and where it leads.
    let real = fs::canonicalize(&abs).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", dir.display()),
        source,
    })?;
    let m = fs::metadata(&real).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", real.display()),
        source,
    })?;
    if !m.is_dir() {
        return Err(unsafe_place(
            setting,
            dir,
            "is not a directory".into(),
            "point the setting at a directory".into(),
        ));
    }
    let me = euid();
    let mode = m.mode() & 0o7777;
    if m.uid() != me {
        return Err(unsafe_place(
            setting,
            dir,
            format!(
                "is owned by uid {} (mode {mode:04o}), not by this server's uid {me}: its owner \
                 could replace the socket, the token or the data",
                m.uid()
            ),
            format!(
                "use a directory of your own (remove it to have the server create it 0700), or \
                 `chown {me} {p} && chmod 0700 {p}`",
                p = real.display()
            ),
        ));
    }
    if mode & WRITABLE_BY_OTHERS != 0 {
        return Err(unsafe_place(
            setting,
            dir,
            format!(
                "has mode {mode:04o} (owner uid {}): writable by {}, who could replace the \
                 socket, the token or the data",
                m.uid(),
                who(mode)
            ),
            format!("`chmod 0700 {}`", real.display()),
        ));
    }
    check_ancestors(setting, &real)
}

/// Refuses a secret file (a token, a private key) that another user owns or that group or
/// others may read or write, or that lies in a directory others could change.
pub(crate) fn check_secret_file(setting: &str, file: &Path) -> Result<(), ServerError> {
    let abs = absolute(setting, file)?;
    check_ancestors(setting, &abs)?;
    let m = fs::metadata(&abs).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", file.display()),
        source,
    })?;
    let me = euid();
    let mode = m.mode() & 0o7777;
    if m.uid() != me {
        return Err(unsafe_place(
            setting,
            file,
            format!(
                "is owned by uid {} (mode {mode:04o}), not by this server's uid {me}",
                m.uid()
            ),
            format!("`chown {me} {p} && chmod 0600 {p}`", p = abs.display()),
        ));
    }
    if mode & ANY_ACCESS_BY_OTHERS != 0 {
        return Err(unsafe_place(
            setting,
            file,
            format!(
                "has mode {mode:04o}: {} may read or write a secret",
                who(mode & ANY_ACCESS_BY_OTHERS)
            ),
            format!("`chmod 0600 {}`", abs.display()),
        ));
    }
    let real = fs::canonicalize(&abs).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", file.display()),
        source,
    })?;
    check_ancestors(setting, &real)
}

/// Least bytes a secret read by [`read_secret_file`] may hold.
pub(crate) const MIN_SECRET_BYTES: usize = 16;

/// The bytes of a secret file (checked as [`check_secret_file`] does), trailing newline
/// dropped; at least [`MIN_SECRET_BYTES`].
pub fn read_secret_file(setting: &str, file: &Path) -> Result<Vec<u8>, ServerError> {
    check_secret_file(setting, file)?;
    let mut b = fs::read(file).map_err(|source| ServerError::Io {
        what: format!("{setting} {}", file.display()),
        source,
    })?;
    while b.last().is_some_and(|x| *x == b'\n' || *x == b'\r') {
        b.pop();
    }
    if b.len() < MIN_SECRET_BYTES {
        return Err(super::ConfigError {
            setting: setting.into(),
            reason: format!(
                "{} holds {} bytes: a secret must be at least {MIN_SECRET_BYTES}",
                file.display(),
                b.len()
            ),
        }
        .into());
    }
    Ok(b)
}

/// The gid of `group`: a number, or a group name looked up as the system does (NSS, through
/// libc's `getgrnam_r`: one call, not worth a new dependency).
pub(crate) fn group_id(setting: &str, group: &str) -> Result<u32, ServerError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let unknown = |why: String| {
        ServerError::Config(super::ConfigError {
            setting: setting.into(),
            reason: why,
        })
    };
    let name = std::ffi::CString::new(group)
        .map_err(|_| unknown(format!("{group:?}: a group name holds no NUL byte")))?;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // SAFETY: `grp` is a plain C struct for getgrnam_r to fill (all-zero is a valid
        // value of it); `name` is NUL-terminated; `buf` is writable for `buf.len()` bytes and
        // outlives the call; `found` is written by the call. Nothing returned is read beyond
        // `gr_gid`, a plain integer copied out before `buf` is reused or dropped.
        let (rc, found, gid) = unsafe {
            let mut grp: libc::group = std::mem::zeroed();
            let mut found: *mut libc::group = std::ptr::null_mut();
            let rc = libc::getgrnam_r(
                name.as_ptr(),
                &mut grp,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            );
            (rc, !found.is_null(), grp.gr_gid)
        };
        match rc {
            0 if found => return Ok(gid),
            0 => return Err(unknown(format!("no group named {group:?}"))),
            libc::ERANGE if buf.len() < 1 << 22 => buf.resize(buf.len() * 4, 0),
            e => {
                return Err(unknown(format!(
                    "looking up group {group:?}: {}",
                    std::io::Error::from_raw_os_error(e)
                )));
            }
        }
    }
}

/// "group", "others" or "group and others", for the bits of `mode` that are set.
fn who(mode: u32) -> &'static str {
    match (mode & 0o070 != 0, mode & 0o007 != 0) {
        (true, true) => "group and others",
        (true, false) => "its group",
        _ => "other users",
    }
}

/// Checks every existing component above `path` (and `path` itself when it is a symbolic
/// link): owned by this user or root; writable by group or others only when sticky.
fn check_ancestors(setting: &str, path: &Path) -> Result<(), ServerError> {
    let me = euid();
    let mut prefixes: Vec<&Path> = path.ancestors().skip(1).collect();
    if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        prefixes.push(path);
    }
    for p in prefixes {
        let Ok(m) = fs::symlink_metadata(p) else {
            continue; // not there yet: it will be created 0700
        };
        check_component(setting, path, p, &m, me)?;
    }
    Ok(())
}

fn check_component(
    setting: &str,
    path: &Path,
    p: &Path,
    m: &Metadata,
    me: u32,
) -> Result<(), ServerError> {
    let mode = m.permissions().mode() & 0o7777;
    let kind = if m.file_type().is_symlink() {
        "symbolic link"
    } else {
        "directory"
    };
    if m.uid() != me && m.uid() != 0 {
        return Err(unsafe_place(
            setting,
            path,
            format!(
                "lies under the {kind} {}, owned by uid {} (mode {mode:04o}), who could swap \
                 what it leads to",
                p.display(),
                m.uid()
            ),
            "use a directory whose every parent belongs to root or to this server's user".into(),
        ));
    }
    if m.is_dir() && mode & WRITABLE_BY_OTHERS != 0 && mode & STICKY == 0 {
        return Err(unsafe_place(
            setting,
            path,
            format!(
                "lies under {}, mode {mode:04o}: writable by {} without the sticky bit, so \
                 they could rename it away and put their own in its place",
                p.display(),
                who(mode)
            ),
            format!(
                "`chmod go-w {}` (or `chmod +t` to make it a shared directory like /tmp), or \
                 use another directory",
                p.display()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chmod(p: &Path, mode: u32) {
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn check_dir(mode: u32, ok: bool) {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("run");
        fs::create_dir(&d).unwrap();
        chmod(&d, mode);
        let r = check_private_dir("server.runtime_dir", &d);
        assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
        if let Err(e) = r {
            let msg = e.to_string();
            assert!(msg.contains("server.runtime_dir"), "{msg}");
            assert!(msg.contains(&d.display().to_string()), "{msg}");
            assert!(msg.contains(&format!("{mode:04o}")), "{msg}");
            assert!(msg.contains("chmod 0700"), "{msg}");
        }
    }

    #[test]
    fn directories_writable_by_others_are_refused() {
        check_dir(0o700, true);
        check_dir(0o755, true);
        check_dir(0o750, true);
        check_dir(0o770, false);
        check_dir(0o777, false);
        check_dir(0o1777, false);
        check_dir(0o702, false);
    }

    #[test]
    fn another_users_directory_is_refused() {
        let t = tempfile::tempdir().unwrap();
        // Root may give a directory away; another user has one at hand: "/" is root's.
        let theirs = if euid() == 0 {
            let d = t.path().join("theirs");
            fs::create_dir(&d).unwrap();
            chmod(&d, 0o700);
            std::os::unix::fs::chown(&d, Some(12345), None).unwrap();
            d
        } else {
            PathBuf::from("/")
        };
        let e = check_private_dir("store.nvme_dir", &theirs).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("owned by uid") && msg.contains("chown"),
            "{msg}"
        );
    }

    #[test]
    fn created_directories_are_private() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        ensure_private_dir("store.nvme_dir", &d).unwrap();
        for p in [t.path().join("a"), d] {
            assert_eq!(fs::metadata(&p).unwrap().mode() & 0o777, 0o700, "{p:?}");
        }
    }

    #[test]
    fn a_parent_writable_by_others_is_refused_unless_sticky() {
        let t = tempfile::tempdir().unwrap();
        let parent = t.path().join("shared");
        let d = parent.join("run");
        fs::create_dir_all(&d).unwrap();
        chmod(&d, 0o700);
        chmod(&parent, 0o777);
        let e = check_private_dir("server.runtime_dir", &d).unwrap_err();
        assert!(e.to_string().contains("sticky"), "{e}");
        chmod(&parent, 0o1777);
        check_private_dir("server.runtime_dir", &d).unwrap();
        // Through a symbolic link: the directory it leads to is checked.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&parent, &link).unwrap();
        check_private_dir("server.runtime_dir", &link.join("run")).unwrap();
        chmod(&d, 0o777);
        assert!(check_private_dir("server.runtime_dir", &link.join("run")).is_err());
    }

    #[test]
    fn groups_resolve_by_name_or_number() {
        // Group 0 is "root" on every Linux system.
        assert_eq!(group_id("server.unix_group", "root").unwrap(), 0);
        assert_eq!(group_id("server.unix_group", "4321").unwrap(), 4321);
        let e = group_id("server.unix_group", "no-such-group-kvtier").unwrap_err();
        assert!(e.to_string().contains("server.unix_group"), "{e}");
        assert!(group_id("server.unix_group", "a\0b").is_err());
    }

    #[test]
    fn secret_files_must_be_private() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("token");
        fs::write(&f, "secret\n").unwrap();
        for (mode, ok) in [
            (0o600, true),
            (0o400, true),
            (0o640, false),
            (0o604, false),
            (0o620, false),
        ] {
            chmod(&f, mode);
            let r = check_secret_file("server.token_file", &f);
            assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
            if let Err(e) = r {
                let msg = e.to_string();
                assert!(
                    msg.contains("server.token_file") && msg.contains("chmod 0600"),
                    "{msg}"
                );
            }
        }
    }
}
