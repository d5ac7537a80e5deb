//! On-disk formats of the NVMe tier: the slot header and the manifest. Byte tables are in
//! `docs/nvme-format.md`; golden tests below pin them.

use kvtier_core::BlockKey;
use xxhash_rust::xxh3::xxh3_64;

/// Version of the slot header and manifest formats. A manifest of another version starts the
/// tier cold.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes reserved for the header in front of every slot's payload (one 4 KiB sector, so the
/// payload stays aligned for direct I/O).
pub const HEADER_BYTES: usize = 4096;
/// Bytes of the header that carry fields; the rest of the sector is zero.
pub const HEADER_USED_BYTES: usize = 96;
/// Flag: the header names the block's parent (the previous block of its chain).
pub const FLAG_HAS_PARENT: u32 = 1;
const CHECKSUMMED: usize = 88;
pub const SLOT_MAGIC: [u8; 8] = *b"KVTSLOT1";
pub const MANIFEST_MAGIC: &str = "kvtier-nvme-manifest";

/// The header at the start of every slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeader {
    pub key: BlockKey,
    pub payload_len: u64,
    pub payload_checksum: u64,
    pub generation: u64,
    pub epoch: u64,
    pub layout_fingerprint: u64,
    /// The previous block of the chain, when the writer knew it (chain links survive restarts).
    pub parent: Option<BlockKey>,
}

/// Why a header was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// All zero: the slot was never written or was erased.
    Empty,
    BadMagic,
    BadChecksum,
    OtherVersion,
    /// Flag bits this version does not define.
    UnknownFlags,
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl SlotHeader {
    /// Writes the header into the first [`HEADER_USED_BYTES`] of `out` (the caller zeroes the
    /// rest of the sector once).
    pub fn encode(&self, out: &mut [u8]) {
        let b = &mut out[..HEADER_USED_BYTES];
        b[0..8].copy_from_slice(&SLOT_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let flags = if self.parent.is_some() {
            FLAG_HAS_PARENT
        } else {
            0
        };
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        b[16..32].copy_from_slice(self.key.as_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_checksum.to_le_bytes());
        b[48..56].copy_from_slice(&self.generation.to_le_bytes());
        b[56..64].copy_from_slice(&self.epoch.to_le_bytes());
        b[64..72].copy_from_slice(&self.layout_fingerprint.to_le_bytes());
        let parent = self.parent.map_or([0u8; 16], |p| *p.as_bytes());
        b[72..88].copy_from_slice(&parent);
        let sum = xxh3_64(&b[0..CHECKSUMMED]);
        b[88..96].copy_from_slice(&sum.to_le_bytes());
    }

    /// Parses a header; never panics on any input of at least [`HEADER_USED_BYTES`].
    pub fn decode(b: &[u8]) -> Result<Self, HeaderError> {
        let b = &b[..HEADER_USED_BYTES];
        if b.iter().all(|&x| x == 0) {
            return Err(HeaderError::Empty);
        }
        if b[0..8] != SLOT_MAGIC {
            return Err(HeaderError::BadMagic);
        }
        if xxh3_64(&b[0..CHECKSUMMED]) != u64_at(b, CHECKSUMMED) {
            return Err(HeaderError::BadChecksum);
        }
        if b[8..12] != FORMAT_VERSION.to_le_bytes() {
            return Err(HeaderError::OtherVersion);
        }
        let flags = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if flags & !FLAG_HAS_PARENT != 0 {
            return Err(HeaderError::UnknownFlags);
        }
        let mut key = [0u8; 16];
        key.copy_from_slice(&b[16..32]);
        let mut parent = [0u8; 16];
        parent.copy_from_slice(&b[72..88]);
        Ok(Self {
            key: BlockKey::from_bytes(key),
            payload_len: u64_at(b, 32),
            payload_checksum: u64_at(b, 40),
            generation: u64_at(b, 48),
            epoch: u64_at(b, 56),
            layout_fingerprint: u64_at(b, 64),
            parent: (flags & FLAG_HAS_PARENT != 0).then(|| BlockKey::from_bytes(parent)),
        })
    }
}

/// Checksum of a slot's payload.
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// The tier's manifest: what every slot file was written under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub format_version: u32,
    pub layout_fingerprint: u64,
    pub slot_bytes: u64,
    pub slots_per_file: u64,
    pub epoch: u64,
}

impl Manifest {
    /// A text file, one `name = value` a line, closed by a checksum of the lines above it.
    pub fn encode(&self) -> String {
        let body = format!(
            "{MANIFEST_MAGIC}\nformat_version = {}\nlayout_fingerprint = {:#018x}\nslot_bytes = {}\nslots_per_file = {}\nepoch = {}\n",
            self.format_version,
            self.layout_fingerprint,
            self.slot_bytes,
            self.slots_per_file,
            self.epoch
        );
        let sum = xxh3_64(body.as_bytes());
        format!("{body}checksum = {sum:#018x}\n")
    }

    /// Parses a manifest. The error says what is wrong, for the cold-start message.
    pub fn decode(text: &str) -> Result<Self, String> {
        let Some(split) = text.rfind("checksum = ") else {
            return Err("no checksum line (truncated?)".into());
        };
        let (body, sum_line) = text.split_at(split);
        let sum = parse_u64(sum_line.trim_start_matches("checksum = ").trim())
            .ok_or("unreadable checksum")?;
        if xxh3_64(body.as_bytes()) != sum {
            return Err("checksum mismatch (damaged or edited)".into());
        }
        let mut lines = body.lines();
        if lines.next() != Some(MANIFEST_MAGIC) {
            return Err("not a kvtier NVMe manifest".into());
        }
        let mut field = |name: &str| -> Result<u64, String> {
            let line = lines.next().ok_or_else(|| format!("missing {name}"))?;
            let v = line
                .strip_prefix(name)
                .and_then(|r| r.strip_prefix(" = "))
                .ok_or_else(|| format!("expected {name}, found {line:?}"))?;
            parse_u64(v).ok_or_else(|| format!("unreadable {name}: {v:?}"))
        };
        let format_version = field("format_version")?;
        let m = Manifest {
            format_version: u32::try_from(format_version)
                .map_err(|_| "format_version out of range")?,
            layout_fingerprint: field("layout_fingerprint")?,
            slot_bytes: field("slot_bytes")?,
            slots_per_file: field("slots_per_file")?,
            epoch: field("epoch")?,
        };
        Ok(m)
    }
}

fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> SlotHeader {
        SlotHeader {
            key: BlockKey::from_u128(0x0f0e_0d0c_0b0a_0908_0706_0504_0302_0100),
            payload_len: 0x1000,
            payload_checksum: 0x1122_3344_5566_7788,
            generation: 5,
            epoch: 2,
            layout_fingerprint: 0xaabb,
            parent: Some(BlockKey::from_u128(
                0x1f1e_1d1c_1b1a_1918_1716_1514_1312_1110,
            )),
        }
    }

    #[test]
    fn golden_header_bytes() {
        let mut b = [0u8; HEADER_USED_BYTES];
        header().encode(&mut b);
        assert_eq!(&b[0..8], b"KVTSLOT1");
        assert_eq!(&b[8..16], &[1, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(
            &b[16..32],
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
        );
        assert_eq!(&b[32..40], &[0, 0x10, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            &b[40..48],
            &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
        );
        assert_eq!(
            &b[48..72],
            &[
                5, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0xbb, 0xaa, 0, 0, 0, 0, 0, 0
            ]
        );
        assert_eq!(
            &b[72..88],
            &[
                16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31
            ]
        );
        assert_eq!(u64_at(&b, 88), xxh3_64(&b[..88]));
        assert_eq!(SlotHeader::decode(&b), Ok(header()));
        // Without a parent: flag clear, parent bytes zero.
        let mut h = header();
        h.parent = None;
        let mut c = [0u8; HEADER_USED_BYTES];
        h.encode(&mut c);
        assert_eq!(&c[12..16], &[0, 0, 0, 0]);
        assert_eq!(&c[72..88], &[0u8; 16]);
        assert_eq!(SlotHeader::decode(&c), Ok(h));
    }

    #[test]
    fn every_flipped_bit_is_rejected() {
        let mut b = [0u8; HEADER_USED_BYTES];
        header().encode(&mut b);
        for bit in 0..HEADER_USED_BYTES * 8 {
            let mut c = b;
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(SlotHeader::decode(&c).is_err(), "bit {bit} flip accepted");
        }
        assert_eq!(
            SlotHeader::decode(&[0u8; HEADER_USED_BYTES]),
            Err(HeaderError::Empty)
        );
    }

    #[test]
    fn manifest_round_trip_and_damage() {
        let m = Manifest {
            format_version: 1,
            layout_fingerprint: 0xdead_beef,
            slot_bytes: 2 << 20,
            slots_per_file: 512,
            epoch: 3,
        };
        let text = m.encode();
        assert_eq!(Manifest::decode(&text), Ok(m));
        assert!(text.starts_with("kvtier-nvme-manifest\nformat_version = 1\n"));
        assert!(Manifest::decode(&text.replace("epoch = 3", "epoch = 4")).is_err());
        assert!(Manifest::decode(&text[..text.len() / 2]).is_err());
        assert!(Manifest::decode("").is_err());
        assert!(Manifest::decode("checksum = zz").is_err());
    }
}
