//! A member's record in etcd: who it is, where it is reached, what it holds; and its
//! authentication with the cluster secret. No I/O.
//!
//! Stored under `/kvtier/<cluster>/members/<node id>` as JSON:
//! `{"record": "<the record's JSON text>", "mac": "<hex HMAC-SHA256>"}`. The MAC covers the
//! etcd key, a zero byte and the record's exact bytes (so a record cannot be moved to
//! another member's key), keyed with `HMAC-SHA256(secret, "kvtier cluster member record v1
//! " + cluster name)`. Without a secret, `mac` is empty and the view accepts unsigned
//! records only (a member with a secret refuses them, and a member without one refuses
//! signed ones: the two cannot mix silently).

use ring::hmac;
use serde::{Deserialize, Serialize};

/// The record format's version (field `v`).
pub const RECORD_VERSION: u32 = 1;

/// One tier of a member and its capacity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCapacity {
    /// "hbm", "dram" or "nvme".
    pub kind: String,
    pub capacity_bytes: u64,
}

/// How a member places blocks: `cluster.replicas`, `run_blocks` and `head_blocks`. Members
/// whose rules differ name different owners for the same block, so their lookups miss what
/// the others stored (never wrong data: fetched blocks are verified).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRule {
    pub replicas: usize,
    pub run_blocks: usize,
    pub head_blocks: usize,
}

/// What a member says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub v: u32,
    pub node_id: String,
    /// kvtier-server's version.
    pub version: String,
    /// Where clients and peers reach its protocol (`tls://HOST:PORT` or `tcp://HOST:PORT`),
    /// "" if not advertised.
    pub data_endpoint: String,
    /// Hex of the certificate (DER) its TLS and QUIC listeners present: peers pin exactly
    /// this one on a `tls://` or `quic://` data endpoint (the record's MAC vouches for it).
    /// "" when neither listener is on.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub data_cert_der: String,
    /// The name peers check that certificate against (`localhost` for the generated one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub data_cert_name: String,
    /// Its kvtier-transfer endpoint (`tcp://IP:PORT` or `quic://IP:PORT`: where peers read
    /// its DRAM one-sided), "" if it serves none. Informational: peers connect with
    /// `transfer_meta`.
    pub transfer_endpoint: String,
    /// Hex of its kvtier-transfer agent's metadata blob **without the token** (peers derive
    /// it from the cluster secret: [`transfer_token`]), listing its DRAM arena, read-only to
    /// peers; "" when it serves none (and absent in records of servers older than the field).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub transfer_meta: String,
    /// Its admin port (`http://HOST:PORT`), "" if not advertised.
    pub admin_endpoint: String,
    /// The inference worker beside it (`http://HOST:PORT`, `cluster.worker_url`), for routers
    /// that take their worker list from the membership; "" if none (and absent in records of
    /// servers older than the field).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub worker_endpoint: String,
    pub tiers: Vec<TierCapacity>,
    /// When its process started (its own clock), in every registration of that process:
    /// with replicas, a member that started within `cluster.warmup_s` is asked for a run
    /// only when no owner that started before is usable (`chain::owner_to_ask`). 0 (records
    /// of servers older than that use): taken as long started.
    pub registered_unix_ms: u64,
    /// Its placement rule; absent in records of servers older than the field (their rule
    /// is then unknown, not assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementRule>,
    /// The blocks after which this member saw many chains diverge (a shared prompt's last
    /// block), which every member's placement starts a run after (`placement::Splits`; the
    /// union of all members' lists counts). Empty (and absent in records of servers older
    /// than the field) when it found none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub splits: Vec<SplitRecord>,
}

/// A split as a record states it: the block's position in its chain and its key (the
/// 32-character hex of `BlockKey`'s `Display`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitRecord {
    pub position: u64,
    pub key: String,
}

impl SplitRecord {
    pub fn new(position: usize, key: &kvtier_core::BlockKey) -> Self {
        Self {
            position: position as u64,
            key: key.to_string(),
        }
    }

    /// The split, if the key parses and the position is in range (a record is checked by
    /// its MAC, but a bad entry is skipped, not trusted).
    pub fn parse(&self) -> Option<(usize, kvtier_core::BlockKey)> {
        let position = usize::try_from(self.position).ok()?;
        Some((position, kvtier_core::BlockKey::from_hex(&self.key)?))
    }
}

impl MemberRecord {
    /// The placement weight: the sum of its tiers' capacities, in GiB.
    pub fn weight(&self) -> f64 {
        let bytes: u64 = self
            .tiers
            .iter()
            .map(|t| t.capacity_bytes)
            .fold(0, u64::saturating_add);
        bytes as f64 / (1u64 << 30) as f64
    }
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    record: String,
    mac: String,
}

/// Why a stored record was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Not JSON of the envelope or the record, or an unknown record version.
    Malformed,
    /// Signed, but this member has no secret; or unsigned while it has one.
    SecretMismatch,
    /// The MAC does not verify under this member's secret.
    BadMac,
    /// The record's `node_id` is not the id its key names.
    WrongKey,
}

impl Rejection {
    pub fn name(self) -> &'static str {
        match self {
            Rejection::Malformed => "malformed",
            Rejection::SecretMismatch => "secret_mismatch",
            Rejection::BadMac => "bad_mac",
            Rejection::WrongKey => "wrong_key",
        }
    }
}

/// Signs and verifies records with the key derived from the cluster secret (or, without a
/// secret, writes and accepts unsigned records only).
#[derive(Clone)]
pub struct RecordSealer {
    key: Option<hmac::Key>,
}

impl std::fmt::Debug for RecordSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordSealer")
            .field("signed", &self.key.is_some())
            .finish()
    }
}

impl RecordSealer {
    /// `secret` None: unsigned records. The key is bound to `cluster` (its name).
    pub fn new(secret: Option<&[u8]>, cluster: &str) -> Self {
        let key = secret.map(|s| {
            let root = hmac::Key::new(hmac::HMAC_SHA256, s);
            let label = format!("kvtier cluster member record v1 {cluster}");
            let derived = hmac::sign(&root, label.as_bytes());
            hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref())
        });
        Self { key }
    }

    pub fn signs(&self) -> bool {
        self.key.is_some()
    }

    fn message(etcd_key: &[u8], record: &[u8]) -> Vec<u8> {
        let mut m = Vec::with_capacity(etcd_key.len() + 1 + record.len());
        m.extend_from_slice(etcd_key);
        m.push(0);
        m.extend_from_slice(record);
        m
    }

    /// The value stored at `etcd_key` for `record`.
    pub fn seal(&self, etcd_key: &[u8], record: &MemberRecord) -> Vec<u8> {
        // A struct of strings and integers always serializes.
        let text = serde_json::to_string(record).unwrap_or_default();
        let mac = match &self.key {
            Some(k) => hex(hmac::sign(k, &Self::message(etcd_key, text.as_bytes())).as_ref()),
            None => String::new(),
        };
        serde_json::to_vec(&Envelope { record: text, mac }).unwrap_or_default()
    }

    /// The record stored at `etcd_key` naming member `node_id`, if it is acceptable.
    pub fn open(
        &self,
        etcd_key: &[u8],
        node_id: &str,
        value: &[u8],
    ) -> Result<MemberRecord, Rejection> {
        let env: Envelope = serde_json::from_slice(value).map_err(|_| Rejection::Malformed)?;
        match (&self.key, env.mac.is_empty()) {
            (Some(_), true) | (None, false) => return Err(Rejection::SecretMismatch),
            (None, true) => {}
            (Some(k), false) => {
                let tag = unhex(&env.mac).ok_or(Rejection::BadMac)?;
                hmac::verify(k, &Self::message(etcd_key, env.record.as_bytes()), &tag)
                    .map_err(|_| Rejection::BadMac)?;
            }
        }
        let r: MemberRecord =
            serde_json::from_str(&env.record).map_err(|_| Rejection::Malformed)?;
        if r.v != RECORD_VERSION {
            return Err(Rejection::Malformed);
        }
        if r.node_id != node_id {
            return Err(Rejection::WrongKey);
        }
        Ok(r)
    }
}

/// The token a member presents in its hello to a peer's data endpoint: the hex of
/// HMAC-SHA256(secret, "kvtier cluster peer token v1 " + cluster name). Only holders of the
/// secret can compute it; a server takes a hello carrying it as a *peer* (`docs/cluster.md`,
/// "Data path").
pub fn peer_token(secret: &[u8], cluster: &str) -> String {
    let root = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let label = format!("kvtier cluster peer token v1 {cluster}");
    hex(hmac::sign(&root, label.as_bytes()).as_ref())
}

/// The token members' kvtier-transfer agents present to each other: HMAC-SHA256(secret,
/// `"kvtier cluster transfer token v1 " + cluster name`). It never travels: each member
/// derives it, so a record (readable by anyone who reads etcd) lets no one else read a
/// member's DRAM.
pub fn transfer_token(secret: &[u8], cluster: &str) -> [u8; 32] {
    let root = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let label = format!("kvtier cluster transfer token v1 {cluster}");
    let mut t = [0u8; 32];
    t.copy_from_slice(hmac::sign(&root, label.as_bytes()).as_ref());
    t
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of lower- or upper-case hex `s` (`None`: not hex).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn record(id: &str) -> MemberRecord {
        MemberRecord {
            v: RECORD_VERSION,
            node_id: id.into(),
            version: "0.1.0".into(),
            data_endpoint: "tcp://127.0.0.1:1".into(),
            data_cert_der: String::new(),
            data_cert_name: String::new(),
            transfer_endpoint: String::new(),
            transfer_meta: String::new(),
            admin_endpoint: String::new(),
            worker_endpoint: String::new(),
            tiers: vec![TierCapacity {
                kind: "dram".into(),
                capacity_bytes: 1 << 30,
            }],
            registered_unix_ms: 1,
            placement: None,
            splits: Vec::new(),
        }
    }

    /// The worker endpoint travels in the signed record; a record without the field (an
    /// older server's) reads as none.
    #[test]
    fn a_worker_endpoint_is_sealed_and_optional() {
        let key = b"/kvtier/c/members/a";
        let s = RecordSealer::new(Some(b"s3cret"), "c");
        let mut r = record("a");
        r.worker_endpoint = "http://127.0.0.1:8000".into();
        assert_eq!(s.open(key, "a", &s.seal(key, &r)).unwrap(), r);
        let plain = RecordSealer::new(None, "c");
        let without = plain.seal(key, &record("a"));
        assert!(!String::from_utf8_lossy(&without).contains("worker_endpoint"));
        assert_eq!(plain.open(key, "a", &without).unwrap().worker_endpoint, "");
    }

    #[test]
    fn seal_open_and_every_rejection() {
        let key = b"/kvtier/c/members/a";
        let signed = RecordSealer::new(Some(b"s3cret"), "c");
        let other_secret = RecordSealer::new(Some(b"other"), "c");
        let other_cluster = RecordSealer::new(Some(b"s3cret"), "d");
        let unsigned = RecordSealer::new(None, "c");
        let v = signed.seal(key, &record("a"));
        let u = unsigned.seal(key, &record("a"));
        let check =
            |s: &RecordSealer, k: &[u8], id: &str, v: &[u8], want: Result<(), Rejection>| {
                assert_eq!(s.open(k, id, v).map(|_| ()), want, "{s:?} {id}");
            };
        check(&signed, key, "a", &v, Ok(()));
        check(&unsigned, key, "a", &u, Ok(()));
        check(&other_secret, key, "a", &v, Err(Rejection::BadMac));
        check(&other_cluster, key, "a", &v, Err(Rejection::BadMac));
        check(
            &signed,
            b"/kvtier/c/members/b",
            "b",
            &v,
            Err(Rejection::BadMac),
        );
        check(&signed, key, "a", &u, Err(Rejection::SecretMismatch));
        check(&unsigned, key, "a", &v, Err(Rejection::SecretMismatch));
        check(&unsigned, key, "b", &u, Err(Rejection::WrongKey));
        check(&signed, key, "a", b"not json", Err(Rejection::Malformed));
        // A tampered record (its endpoint changed) fails the MAC.
        let tampered = String::from_utf8(v.clone())
            .unwrap()
            .replace("127.0.0.1:1", "10.0.0.9:1");
        check(
            &signed,
            key,
            "a",
            tampered.as_bytes(),
            Err(Rejection::BadMac),
        );
        let mut r = record("a");
        r.v = 99;
        check(
            &unsigned,
            key,
            "a",
            &unsigned.seal(key, &r),
            Err(Rejection::Malformed),
        );
    }

    /// A record without a placement rule (an older server's) is read, with no rule; one
    /// with a rule round-trips it.
    #[test]
    fn the_placement_rule_is_optional() {
        let old = r#"{"v":1,"node_id":"a","version":"0","data_endpoint":"","transfer_endpoint":"",
            "admin_endpoint":"","tiers":[],"registered_unix_ms":0}"#;
        let r: MemberRecord = serde_json::from_str(old).unwrap();
        assert_eq!(r.placement, None);
        let mut r = record("a");
        r.placement = Some(PlacementRule {
            replicas: 2,
            run_blocks: 64,
            head_blocks: 3,
        });
        let back: MemberRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn weight_is_capacity_in_gib() {
        let mut r = record("a");
        r.tiers.push(TierCapacity {
            kind: "nvme".into(),
            capacity_bytes: 3 << 30,
        });
        assert_eq!(r.weight(), 4.0);
    }

    /// The peer token depends on the secret and the cluster's name, and on nothing else;
    /// it is not the record-signing key's label.
    #[test]
    fn transfer_token_is_bound_to_secret_and_cluster_and_is_not_the_peer_token() {
        let t = transfer_token(b"secret of sixteen", "c");
        assert_eq!(t, transfer_token(b"secret of sixteen", "c"));
        assert_ne!(t, transfer_token(b"secret of sixteeN", "c"));
        assert_ne!(t, transfer_token(b"secret of sixteen", "d"));
        assert_ne!(hex(&t), peer_token(b"secret of sixteen", "c"));
    }

    #[test]
    fn peer_token_is_bound_to_secret_and_cluster() {
        let t = peer_token(b"secret of sixteen", "c");
        assert_eq!(t.len(), 64);
        assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(t, peer_token(b"secret of sixteen", "c"));
        assert_ne!(t, peer_token(b"secret of sixteeN", "c"));
        assert_ne!(t, peer_token(b"secret of sixteen", "d"));
    }
}
