//! What travels between the decode and the prefill worker: the control request and answer
//! (JSON over HTTP, `POST /kvtier/prefill`), the per-layer notification attached to each
//! one-sided write, and which bytes of a block one layer is.

use kvtier_core::KvLayout;
use serde::{Deserialize, Serialize};

/// The prefill worker's endpoint.
pub const PREFILL_PATH: &str = "/kvtier/prefill";

/// Largest control request body accepted (a 1M-token prompt as JSON fits).
pub const MAX_REQUEST_BYTES: usize = 32 << 20;

/// Largest control answer read by the decode side.
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// First bytes of a layer notification.
pub const NOTIFY_MAGIC: [u8; 4] = *b"KVD1";

/// Length of a layer notification: magic, request id (u64 LE), layer (u32 LE).
pub const NOTIFY_BYTES: usize = 16;

/// "Compute the KV of `tokens` (positions `0..tokens.len()`) and write it, layer by layer,
/// into the decode agent's blocks `blocks` of region `region`."
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillRequest {
    /// Chosen by the decode side; echoed in every layer notification and in the answer.
    pub request_id: u64,
    /// The tokens whose KV to compute. The decode side sends all of the prompt but its last
    /// token, which it runs itself to get the logits (as a full prefix hit does).
    pub tokens: Vec<u32>,
    /// [`KvLayout::fingerprint`] of the decode worker's pool: both sides must agree.
    pub layout_fingerprint: u64,
    /// The decode agent's metadata blob (`Agent::metadata`), lower-case hex.
    pub agent_blob: String,
    /// Backend to write over: `shm`, `tcp`, `quic` or `ucx`.
    pub backend: String,
    /// The decode agent's region holding its pool (block `b` at offset `b * block_bytes`).
    pub region: u64,
    /// Destination blocks, in position order: `ceil(tokens.len() / block_tokens)` of them.
    pub blocks: Vec<u32>,
}

/// The prefill worker's answer once every layer's write has completed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillResponse {
    pub request_id: u64,
    /// Layers written (each followed by its notification).
    pub layers: u32,
    /// Bytes written in all.
    pub bytes: u64,
    /// Forward time on the prefill worker.
    pub compute_us: u64,
    /// Time from the end of the forward until the last write completed.
    pub transfer_tail_us: u64,
}

/// The body of every non-200 answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// The notification attached to the write of layer `layer` of request `request_id`.
pub fn encode_notification(request_id: u64, layer: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(NOTIFY_BYTES);
    m.extend_from_slice(&NOTIFY_MAGIC);
    m.extend_from_slice(&request_id.to_le_bytes());
    m.extend_from_slice(&layer.to_le_bytes());
    m
}

/// `(request_id, layer)` of a layer notification; `None` for anything else.
pub fn decode_notification(m: &[u8]) -> Option<(u64, u32)> {
    if m.len() != NOTIFY_BYTES || m[..4] != NOTIFY_MAGIC {
        return None;
    }
    let id = u64::from_le_bytes(m[4..12].try_into().ok()?);
    let layer = u32::from_le_bytes(m[12..16].try_into().ok()?);
    Some((id, layer))
}

/// Lower-case hex.
pub fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Inverse of [`hex_encode`] (either case); an error names the problem.
pub fn hex_decode(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("hex string of odd length {}", s.len()));
    }
    let digit = |c: u8, at: usize| -> Result<u8, String> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("not a hex digit at offset {at}")),
        }
    };
    s.as_bytes()
        .chunks_exact(2)
        .enumerate()
        .map(|(i, p)| Ok((digit(p[0], 2 * i)? << 4) | digit(p[1], 2 * i + 1)?))
        .collect()
}

/// The byte ranges `(offset in block, len)` of layer `layer` in a block holding `filled`
/// tokens: the whole layer (`[K|V][token]...`, one contiguous run) when the block is full,
/// else the filled rows of K and of V (two runs).
pub fn layer_runs(layout: &KvLayout, layer: u32, filled: u32) -> Vec<(u64, u64)> {
    let start = u64::from(layer) * layout.layer_bytes();
    if filled >= layout.block_tokens() {
        return vec![(start, layout.layer_bytes())];
    }
    let rows = u64::from(filled) * layout.token_bytes();
    (0..u64::from(layout.tensors_per_layer()))
        .map(|t| (start + t * layout.tensor_bytes(), rows))
        .collect()
}

#[cfg(test)]
mod tests {
    use kvtier_core::{Dtype, KvTensor};

    use super::*;

    #[test]
    fn notifications_round_trip_and_reject_others() {
        let m = encode_notification(0x0102_0304_0506_0708, 31);
        assert_eq!(m.len(), NOTIFY_BYTES);
        assert_eq!(decode_notification(&m), Some((0x0102_0304_0506_0708, 31)));
        assert_eq!(decode_notification(&m[..15]), None);
        let mut bad = m.clone();
        bad[0] = b'X';
        assert_eq!(decode_notification(&bad), None);
        assert_eq!(decode_notification(b""), None);
    }

    #[test]
    fn hex_round_trips_and_errors_name_the_problem() {
        let bytes: Vec<u8> = (0..=255).collect();
        let s = hex_encode(&bytes);
        assert_eq!(&s[..6], "000102");
        assert_eq!(hex_decode(&s).unwrap(), bytes);
        assert_eq!(hex_decode("ABcd").unwrap(), vec![0xab, 0xcd]);
        assert!(hex_decode("abc").unwrap_err().contains("odd length"));
        assert!(hex_decode("zz").unwrap_err().contains("offset 0"));
        assert!(hex_decode("0g").unwrap_err().contains("offset 1"));
    }

    #[test]
    fn layer_runs_cover_exactly_the_filled_rows_of_one_layer() {
        // 3 layers, 2 kv heads, head dim 4, f32, 4-token blocks: 32 B a token row.
        let l = KvLayout::new(3, 2, 4, Dtype::F32, 4).unwrap();
        assert_eq!(layer_runs(&l, 1, 4), vec![(256, 256)]);
        let k = l.tensor_range(2, KvTensor::Key).unwrap().start;
        let v = l.tensor_range(2, KvTensor::Value).unwrap().start;
        assert_eq!(layer_runs(&l, 2, 3), vec![(k, 96), (v, 96)]);
        assert_eq!(layer_runs(&l, 0, 1), vec![(0, 32), (128, 32)]);
    }
}
