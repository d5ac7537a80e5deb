//! The secret that maps tenants' keys to the store's internal keys (`[tenants]`; see
//! [`super::tenants`]). A stable secret keeps tenants' blocks reachable across a restart; one
//! shared by a cluster's members makes them all map a key alike.
//!
//! Where it comes from, first that applies:
//! 1. `server.tenant_key_secret_file`: a private file of at least 16 bytes;
//! 2. `cluster.secret_file`: derived from the cluster secret;
//! 3. the NVMe tier's directory: `tenant-key-secret` (32 random bytes, 0600), created at the
//!    first start and read at every later one;
//! 4. none of these: drawn at each start (tenants' blocks do not outlive a restart).
//!
//! A secret read from a file (1, 2) is the HMAC-SHA256 of a fixed label under the file's
//! bytes, so the same bytes give the same mapping whichever setting names them.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::{ServerConfig, ServerError, membership, places};
use crate::tier::TierKind;

/// Bytes of the secret.
pub(crate) const KEY_SECRET_BYTES: usize = 32;
/// The file kept in the NVMe directory.
pub(crate) const NVME_SECRET_FILE: &str = "tenant-key-secret";
/// Label of the HMAC that turns a configured secret into the key secret.
const LABEL: &[u8] = b"kvtier tenant keys v1";

/// Where the key secret came from (for the start-up log and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeySecretSource {
    /// `server.tenant_key_secret_file`.
    File,
    /// Derived from `cluster.secret_file`.
    Cluster,
    /// `<nvme_dir>/tenant-key-secret`; `created`: written at this start.
    Nvme { path: PathBuf, created: bool },
    /// Drawn now; gone at exit.
    PerStart,
}

/// The key secret of a server configured as `c` (only asked with `[tenants]`).
pub(crate) fn key_secret(
    c: &ServerConfig,
) -> Result<([u8; KEY_SECRET_BYTES], KeySecretSource), ServerError> {
    if !c.server.tenant_key_secret_file.is_empty() {
        let setting = "server.tenant_key_secret_file";
        let b = places::read_secret_file(setting, Path::new(&c.server.tenant_key_secret_file))?;
        return Ok((derive(&b), KeySecretSource::File));
    }
    if let Some(b) = membership::cluster_secret(c)? {
        return Ok((derive(&b), KeySecretSource::Cluster));
    }
    if !c.store.nvme_dir.is_empty() && c.tiers()?.contains(&TierKind::Nvme) {
        let path = Path::new(&c.store.nvme_dir).join(NVME_SECRET_FILE);
        let (secret, created) = nvme_secret(&path)?;
        return Ok((secret, KeySecretSource::Nvme { path, created }));
    }
    Ok((random()?, KeySecretSource::PerStart))
}

fn derive(configured: &[u8]) -> [u8; KEY_SECRET_BYTES] {
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, configured), LABEL);
    let mut out = [0u8; KEY_SECRET_BYTES];
    out.copy_from_slice(tag.as_ref());
    out
}

fn random() -> Result<[u8; KEY_SECRET_BYTES], ServerError> {
    let mut b = [0u8; KEY_SECRET_BYTES];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| ServerError::Io {
            what: "drawing the tenants' key secret".into(),
            source: std::io::Error::other("no randomness from the system"),
        })?;
    Ok(b)
}

const SETTING: &str = "store.nvme_dir (its tenant-key-secret)";

/// Reads `path`, or creates it: 32 random bytes, 0600, written under a temporary name, synced,
/// then linked into place (a link never replaces a file: a concurrent creator's wins, and is
/// read). A file that is not this user's and private, or not exactly 32 bytes, is refused.
fn nvme_secret(path: &Path) -> Result<([u8; KEY_SECRET_BYTES], bool), ServerError> {
    let io = |what: &str, source| ServerError::Io {
        what: format!("{what} {}", path.display()),
        source,
    };
    if fs::symlink_metadata(path).is_err() {
        let secret = random()?;
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&secret)?;
            f.sync_all()
        };
        let linked = write().and_then(|()| fs::hard_link(&tmp, path));
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => {
                if let Some(dir) = path.parent() {
                    fs::File::open(dir)
                        .and_then(|d| d.sync_all())
                        .map_err(|e| io("syncing the directory of", e))?;
                }
                return Ok((secret, true));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("creating", e)),
        }
    }
    if fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_file()) {
        return Err(ServerError::UnsafePlace {
            setting: SETTING.into(),
            path: path.to_path_buf(),
            problem: "is not a plain file (a symbolic link?)".into(),
            fix: format!(
                "remove it and restart (tenants' blocks stored under it become unreachable): \
                 `rm {}`",
                path.display()
            ),
        });
    }
    places::check_secret_file(SETTING, path)?;
    let b = fs::read(path).map_err(|e| io("reading", e))?;
    let secret: [u8; KEY_SECRET_BYTES] = b.as_slice().try_into().map_err(|_| {
        ServerError::Config(super::ConfigError {
            setting: SETTING.into(),
            reason: format!(
                "{} holds {} bytes, not the {KEY_SECRET_BYTES} this server wrote: it was \
                 changed. Restore it from a backup, or remove it (tenants' blocks stored under \
                 it become unreachable)",
                path.display(),
                b.len()
            ),
        })
    })?;
    Ok((secret, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn nvme_config(dir: &Path) -> ServerConfig {
        let mut c = ServerConfig::default();
        c.store.nvme_dir = dir.display().to_string();
        c
    }

    #[test]
    fn the_nvme_secret_is_created_private_once_and_read_after() {
        let t = tempfile::tempdir().unwrap();
        let c = nvme_config(t.path());
        let (first, src) = key_secret(&c).unwrap();
        let path = t.path().join(NVME_SECRET_FILE);
        assert_eq!(
            src,
            KeySecretSource::Nvme {
                path: path.clone(),
                created: true
            }
        );
        let m = fs::metadata(&path).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert_eq!(m.len(), KEY_SECRET_BYTES as u64);
        let (again, src) = key_secret(&c).unwrap();
        assert_eq!(again, first);
        assert!(matches!(src, KeySecretSource::Nvme { created: false, .. }));
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_loose_or_changed_nvme_secret_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let c = nvme_config(t.path());
        key_secret(&c).unwrap();
        let path = t.path().join(NVME_SECRET_FILE);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let e = key_secret(&c).unwrap_err().to_string();
        assert!(e.contains("tenant-key-secret") && e.contains("0644"), "{e}");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(&path, b"short").unwrap();
        let e = key_secret(&c).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains("changed"), "{e}");
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/null", &path).unwrap();
        let e = key_secret(&c).unwrap_err().to_string();
        assert!(e.contains("not a plain file"), "{e}");
    }

    #[test]
    fn configured_secrets_win_and_one_file_maps_alike_under_either_setting() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("secret");
        fs::write(&f, b"0123456789abcdef-shared\n").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
        let mut c = nvme_config(&t.path().join("nvme"));
        c.cluster.secret_file = f.display().to_string();
        let (by_cluster, src) = key_secret(&c).unwrap();
        assert_eq!(src, KeySecretSource::Cluster);
        c.server.tenant_key_secret_file = f.display().to_string();
        let (by_file, src) = key_secret(&c).unwrap();
        assert_eq!(src, KeySecretSource::File);
        assert_eq!(by_file, by_cluster);
        assert!(!t.path().join("nvme").join(NVME_SECRET_FILE).exists());
        // Too short, or readable by others: refused, naming the setting.
        fs::write(&f, b"short\n").unwrap();
        let e = key_secret(&c).unwrap_err().to_string();
        assert!(
            e.contains("server.tenant_key_secret_file") && e.contains("16"),
            "{e}"
        );
        fs::write(&f, b"0123456789abcdef-shared\n").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
        let e = key_secret(&c).unwrap_err().to_string();
        assert!(
            e.contains("server.tenant_key_secret_file") && e.contains("chmod 0600"),
            "{e}"
        );
    }

    #[test]
    fn without_a_file_or_nvme_each_start_draws_its_own() {
        let mut c = ServerConfig::default();
        c.store.nvme_dir = String::new();
        let (a, src) = key_secret(&c).unwrap();
        assert_eq!(src, KeySecretSource::PerStart);
        assert_ne!(a, key_secret(&c).unwrap().0);
    }
}
