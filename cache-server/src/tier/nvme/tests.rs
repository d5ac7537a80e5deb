use super::*;
use kvtier_testkit::block::block_bytes;

fn cfg(dir: &Path) -> NvmeTierConfig {
    // 8 slots of 16 KiB payload, 3 slots a file: several files, one partly filled.
    NvmeTierConfig::new(dir, 8 * (16384 + 4096), 16384, 0xfeed).file_bytes(3 * (16384 + 4096))
}

#[test]
fn bad_settings_name_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let check = |c: NvmeTierConfig, setting: &str| {
        let e = c.open().err().expect("must fail").to_string();
        assert!(e.contains(setting), "{e}");
    };
    check(
        NvmeTierConfig::new(dir.path(), 1 << 20, 5000, 1),
        "nvme.slot_bytes",
    );
    check(
        NvmeTierConfig::new(dir.path(), 1 << 20, 0, 1),
        "nvme.slot_bytes",
    );
    check(
        NvmeTierConfig::new(dir.path(), 0, 4096, 1),
        "nvme.capacity_bytes",
    );
    check(
        NvmeTierConfig::new(dir.path(), 4096, 4096, 1),
        "nvme.capacity_bytes",
    );
    check(
        NvmeTierConfig::new(dir.path(), 1 << 62, 4096, 1),
        "nvme.capacity_bytes",
    );
    check(
        NvmeTierConfig::new("/proc/kvtier-cannot-exist", 1 << 20, 4096, 1),
        "nvme.dir",
    );
    let file = dir.path().join("plain-file");
    fs::write(&file, b"x").unwrap();
    check(
        NvmeTierConfig::new(file.join("sub"), 1 << 20, 4096, 1),
        "nvme.dir",
    );
}

#[test]
fn a_second_process_cannot_open_the_same_dir() {
    let dir = tempfile::tempdir().unwrap();
    let _first = cfg(dir.path()).open().unwrap();
    let e = cfg(dir.path()).open().err().unwrap().to_string();
    assert!(e.contains("in use"), "{e}");
}

#[test]
fn restart_keeps_blocks_and_mismatches_start_cold() {
    let dir = tempfile::tempdir().unwrap();
    let key = BlockKey::from_u128(1);
    {
        let (t, r) = cfg(dir.path()).open().unwrap();
        assert_eq!(r.recovered, 0);
        t.write(SlotId(4), key, &block_bytes(key, 16384)).unwrap();
    }
    let (t, r) = cfg(dir.path()).open().unwrap();
    assert_eq!((r.recovered, r.cold_start.clone()), (1, None));
    drop(t);
    // Another layout: cold, with the reason naming it.
    let other = NvmeTierConfig::new(dir.path(), 8 * (16384 + 4096), 16384, 0xbeef)
        .file_bytes(3 * (16384 + 4096));
    let (t, r) = other.open().unwrap();
    assert!(r.cold_start.unwrap().contains("layout_fingerprint"));
    assert!(t.recover().is_empty());
    drop(t);
    // Another format version in the manifest: cold, naming it.
    let m = fs::read_to_string(dir.path().join(MANIFEST_FILE)).unwrap();
    let mut parsed = Manifest::decode(&m).unwrap();
    parsed.format_version = 99;
    fs::write(dir.path().join(MANIFEST_FILE), parsed.encode()).unwrap();
    let (_t, r) = other.open().unwrap();
    assert!(r.cold_start.unwrap().contains("format_version 99"));
}

#[test]
fn a_damaged_manifest_starts_cold() {
    let dir = tempfile::tempdir().unwrap();
    let key = BlockKey::from_u128(1);
    {
        let (t, _) = cfg(dir.path()).open().unwrap();
        t.write(SlotId(0), key, &block_bytes(key, 100)).unwrap();
    }
    fs::write(
        dir.path().join(MANIFEST_FILE),
        b"kvtier-nvme-manifest\nformat_vers",
    )
    .unwrap();
    let (t, r) = cfg(dir.path()).open().unwrap();
    assert!(r.cold_start.unwrap().contains("manifest unreadable"));
    assert!(
        t.read(SlotId(0), key, &mut [0u8; 100])
            .unwrap_err()
            .is_miss()
    );
}

#[test]
fn capacity_change_keeps_what_still_fits() {
    let dir = tempfile::tempdir().unwrap();
    let stride = 16384 + 4096;
    {
        let (t, _) = cfg(dir.path()).open().unwrap();
        for i in 0..8u32 {
            let k = BlockKey::from_u128(u128::from(i) + 1);
            t.write(SlotId(i), k, &block_bytes(k, 4096)).unwrap();
        }
    }
    let small = NvmeTierConfig::new(dir.path(), 4 * stride, 16384, 0xfeed).file_bytes(3 * stride);
    let (t, r) = small.open().unwrap();
    assert_eq!((r.recovered, t.slot_count()), (4, 4));
    assert!(!dir.path().join(slot_file_name(2)).exists());
}

#[test]
fn duplicate_keys_keep_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let key = BlockKey::from_u128(9);
    {
        let (t, _) = cfg(dir.path()).open().unwrap();
        t.write(SlotId(1), key, &block_bytes(key, 500)).unwrap();
        t.write(SlotId(6), key, &block_bytes(key, 500)).unwrap();
    }
    let (t, r) = cfg(dir.path()).open().unwrap();
    assert_eq!(r.duplicates_erased, 1);
    let rec = t.recover();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].slot, SlotId(6));
}

#[test]
fn flipped_bits_and_truncation_are_misses_never_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let stride = 16384 + 4096u64;
    let keys: Vec<BlockKey> = (0..8).map(|i| BlockKey::from_u128(100 + i)).collect();
    {
        let (t, _) = cfg(dir.path()).open().unwrap();
        for (i, k) in keys.iter().enumerate() {
            t.write(SlotId(i as u32), *k, &block_bytes(*k, 16384))
                .unwrap();
        }
    }
    let file0 = dir.path().join(slot_file_name(0));
    let mut bytes = fs::read(&file0).unwrap();
    bytes[5000] ^= 0x10; // slot 0 payload
    bytes[(stride + 20) as usize] ^= 0x01; // slot 1 header (key field)
    fs::write(&file0, &bytes).unwrap();
    let (t, r) = cfg(dir.path()).open().unwrap();
    assert_eq!(r.invalid_headers, 1);
    let mut buf = vec![0u8; 16384];
    let e = t.read(SlotId(0), keys[0], &mut buf).unwrap_err();
    assert!(matches!(e, TierError::Corrupt { .. }), "{e}");
    assert!(t.read(SlotId(1), keys[1], &mut buf).unwrap_err().is_miss());
    t.read(SlotId(2), keys[2], &mut buf).unwrap();
    assert_eq!(buf, block_bytes(keys[2], 16384));
    // Truncate the second file under the open tier: its slots read as corrupt.
    let file1 = OpenOptions::new()
        .write(true)
        .open(dir.path().join(slot_file_name(1)))
        .unwrap();
    file1.set_len(stride + 50).unwrap(); // cuts slot 4 inside its header
    let e = t.read(SlotId(4), keys[4], &mut buf).unwrap_err();
    assert!(matches!(e, TierError::Corrupt { .. }), "{e}");
    drop(t);
    // Reopened, the truncated file is re-extended with zeros: its lost slots are absent.
    let (t, _) = cfg(dir.path()).open().unwrap();
    let present: Vec<SlotId> = t.recover().iter().map(|r| r.slot).collect();
    assert!(
        present.contains(&SlotId(3)) && !present.contains(&SlotId(4)),
        "{present:?}"
    );
}

/// Mode bits (permissions only) of `p`.
fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_directory_and_files_are_private_and_looser_ones_are_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nvme");
    let key = BlockKey::from_u128(7);
    let files = |dir: &Path| -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    {
        let (t, _) = cfg(&dir).open().unwrap();
        t.write(SlotId(4), key, &block_bytes(key, 100)).unwrap();
    }
    let made = files(&dir);
    // Slot files, the manifest and the lock file.
    assert!(made.len() >= 4, "{made:?}");
    assert_eq!(mode(&dir), 0o700);
    for f in &made {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    // Loosened by someone else: the next open tightens them and still serves the block.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    for f in &made {
        fs::set_permissions(f, fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (t, r) = cfg(&dir).open().unwrap();
    assert_eq!(r.cold_start, None);
    assert_eq!(mode(&dir), 0o700);
    for f in &files(&dir) {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    let mut b = vec![0u8; 100];
    t.read(SlotId(4), key, &mut b).unwrap();
    assert_eq!(b, block_bytes(key, 100));
}

#[test]
fn a_warm_restart_that_cannot_write_the_manifest_serves_what_is_there() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let key = BlockKey::from_u128(9);
    {
        let (t, _) = cfg(dir.path()).open().unwrap();
        t.write(SlotId(2), key, &block_bytes(key, 100)).unwrap();
    }
    let inode = fs::metadata(dir.path().join(MANIFEST_FILE)).unwrap().ino();
    // As on a full disk: the manifest's temporary file cannot be created (a directory is in
    // its way; root ignores modes, so a read-only directory would not do).
    fs::create_dir(dir.path().join(format!("{MANIFEST_FILE}.tmp"))).unwrap();
    let (t, r) = cfg(dir.path()).open().unwrap();
    assert_eq!(r.cold_start, None);
    assert_eq!(
        fs::metadata(dir.path().join(MANIFEST_FILE)).unwrap().ino(),
        inode,
        "an unchanged manifest is not rewritten"
    );
    let mut b = vec![0u8; 100];
    t.read(SlotId(2), key, &mut b).unwrap();
    assert_eq!(b, block_bytes(key, 100));
}
