//! The byte layout of one block's KV: layer-major, `[layer][K|V][token][kv_head][head_dim]`
//! (MLA: `[layer][token][head][dim]`, one latent tensor per layer). Layer-major order lets a
//! transfer stream a block layer by layer.

use std::ops::Range;

use crate::CoreError;

/// Largest `block_tokens` (a power of two).
pub const MAX_BLOCK_TOKENS: u32 = 512;
/// Largest block accepted, in bytes (1 GiB): beyond it a block is a configuration mistake.
pub const MAX_BLOCK_BYTES: u64 = 1 << 30;

/// Element type of the KV tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    Fp8E4m3,
    Fp8E5m2,
}

impl Dtype {
    pub const fn bytes(self) -> u32 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8E4m3 => "fp8e4m3",
            Dtype::Fp8E5m2 => "fp8e5m2",
        }
    }

    pub fn parse(name: &str) -> Result<Self, CoreError> {
        [
            Dtype::F32,
            Dtype::F16,
            Dtype::Bf16,
            Dtype::Fp8E4m3,
            Dtype::Fp8E5m2,
        ]
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| CoreError::UnknownName {
            what: "dtype",
            name: name.to_owned(),
            expected: "f32, f16, bf16, fp8e4m3, fp8e5m2",
        })
    }

    const fn tag(self) -> u8 {
        match self {
            Dtype::F32 => 1,
            Dtype::F16 => 2,
            Dtype::Bf16 => 3,
            Dtype::Fp8E4m3 => 4,
            Dtype::Fp8E5m2 => 5,
        }
    }
}

/// Separate key and value tensors, or one multi-head latent (MLA) tensor per layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvKind {
    KeyValue,
    Mla,
}

/// One tensor of one layer inside a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvTensor {
    Key,
    Value,
    Latent,
}

/// Describes the bytes of one block. Validated at construction; every size fits in `u64` and
/// a block is at most [`MAX_BLOCK_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: Dtype,
    block_tokens: u32,
    kind: KvKind,
}

pub(crate) fn check_block_tokens(block_tokens: u32) -> Result<(), CoreError> {
    if block_tokens == 0 || block_tokens > MAX_BLOCK_TOKENS || !block_tokens.is_power_of_two() {
        return Err(CoreError::InvalidLayout {
            field: "block_tokens",
            value: block_tokens.into(),
            reason: "must be a power of two from 1 to 512",
        });
    }
    Ok(())
}

impl KvLayout {
    /// A layout with separate K and V tensors per layer.
    pub fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
        block_tokens: u32,
    ) -> Result<Self, CoreError> {
        Self::with_kind(
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            block_tokens,
            KvKind::KeyValue,
        )
    }

    /// A multi-head latent attention layout: one `latent_dim`-wide tensor per layer and token.
    pub fn mla(
        num_layers: u32,
        latent_dim: u32,
        dtype: Dtype,
        block_tokens: u32,
    ) -> Result<Self, CoreError> {
        Self::with_kind(num_layers, 1, latent_dim, dtype, block_tokens, KvKind::Mla)
    }

    pub fn with_kind(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
        block_tokens: u32,
        kind: KvKind,
    ) -> Result<Self, CoreError> {
        let nonzero = |field, value: u32, max: u32| {
            if value == 0 || value > max {
                Err(CoreError::InvalidLayout {
                    field,
                    value: value.into(),
                    reason: "must be from 1 to its maximum (layers 1024, kv heads 1024, head dim 65536)",
                })
            } else {
                Ok(())
            }
        };
        nonzero("num_layers", num_layers, 1024)?;
        nonzero("num_kv_heads", num_kv_heads, 1024)?;
        nonzero("head_dim", head_dim, 65536)?;
        check_block_tokens(block_tokens)?;
        let layout = Self {
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            block_tokens,
            kind,
        };
        // Each factor is bounded above, so the product fits in u64 (at most ~2^66 would need
        // every maximum at once; checked_mul guards it anyway).
        let bytes = [
            u64::from(num_layers),
            u64::from(layout.tensors_per_layer()),
            u64::from(block_tokens),
            u64::from(num_kv_heads),
            u64::from(head_dim),
            u64::from(dtype.bytes()),
        ]
        .into_iter()
        .try_fold(1u64, |acc, f| acc.checked_mul(f));
        match bytes {
            Some(b) if b <= MAX_BLOCK_BYTES => Ok(layout),
            _ => Err(CoreError::InvalidLayout {
                field: "block size",
                value: bytes.unwrap_or(u64::MAX),
                reason: "a block may be at most 1 GiB",
            }),
        }
    }

    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    pub fn kind(&self) -> KvKind {
        self.kind
    }

    /// 2 for K+V, 1 for MLA.
    pub fn tensors_per_layer(&self) -> u32 {
        match self.kind {
            KvKind::KeyValue => 2,
            KvKind::Mla => 1,
        }
    }

    /// Bytes of one token's row in one tensor: `kv_heads x head_dim x dtype`.
    pub fn token_bytes(&self) -> u64 {
        u64::from(self.num_kv_heads) * u64::from(self.head_dim) * u64::from(self.dtype.bytes())
    }

    /// Bytes of one tensor (K, V or latent) of one layer.
    pub fn tensor_bytes(&self) -> u64 {
        self.token_bytes() * u64::from(self.block_tokens)
    }

    /// Bytes of one layer (K and V, or the latent).
    pub fn layer_bytes(&self) -> u64 {
        self.tensor_bytes() * u64::from(self.tensors_per_layer())
    }

    /// Bytes of a whole block.
    pub fn block_bytes(&self) -> u64 {
        self.layer_bytes() * u64::from(self.num_layers)
    }

    /// KV bytes per token over all layers.
    pub fn bytes_per_token(&self) -> u64 {
        self.block_bytes() / u64::from(self.block_tokens)
    }

    /// Byte range of `layer` inside a block, or `None` past the last layer.
    pub fn layer_range(&self, layer: u32) -> Option<Range<u64>> {
        (layer < self.num_layers).then(|| {
            let start = u64::from(layer) * self.layer_bytes();
            start..start + self.layer_bytes()
        })
    }

    /// Byte range of one tensor of one layer, or `None` if the layer or tensor does not exist
    /// in this layout (a latent in a K+V layout, or K/V in an MLA layout).
    pub fn tensor_range(&self, layer: u32, tensor: KvTensor) -> Option<Range<u64>> {
        let layer_start = self.layer_range(layer)?.start;
        let index = match (self.kind, tensor) {
            (KvKind::KeyValue, KvTensor::Key) | (KvKind::Mla, KvTensor::Latent) => 0,
            (KvKind::KeyValue, KvTensor::Value) => 1,
            _ => return None,
        };
        let start = layer_start + index * self.tensor_bytes();
        Some(start..start + self.tensor_bytes())
    }

    /// Byte offset of element `[layer][tensor][token][head][0]`.
    pub fn row_offset(&self, layer: u32, tensor: KvTensor, token: u32, head: u32) -> Option<u64> {
        if token >= self.block_tokens || head >= self.num_kv_heads {
            return None;
        }
        let t = self.tensor_range(layer, tensor)?.start;
        let head_bytes = u64::from(self.head_dim) * u64::from(self.dtype.bytes());
        Some(t + u64::from(token) * self.token_bytes() + u64::from(head) * head_bytes)
    }

    /// A stable 64-bit identity of the layout, hashed into every namespace so a block written
    /// under one layout is never served under another. Pinned by a golden test.
    pub fn fingerprint(&self) -> u64 {
        let mut enc = Vec::with_capacity(40);
        enc.extend_from_slice(b"kvtier/layout/v1");
        enc.push(match self.kind {
            KvKind::KeyValue => 1,
            KvKind::Mla => 2,
        });
        enc.push(self.dtype.tag());
        for v in [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_tokens,
        ] {
            enc.extend_from_slice(&v.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&enc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_bf16_block_is_2_mib() {
        let l = KvLayout::new(32, 8, 128, Dtype::Bf16, 16).unwrap();
        assert_eq!(l.block_bytes(), 2 << 20);
        assert_eq!(l.bytes_per_token(), 128 << 10);
        assert_eq!(l.layer_bytes(), 64 << 10);
        assert_eq!(l.tensor_range(0, KvTensor::Value), Some(32768..65536));
        assert_eq!(l.tensor_range(31, KvTensor::Value).unwrap().end, 2 << 20);
        assert_eq!(l.tensor_range(0, KvTensor::Latent), None);
        assert_eq!(l.layer_range(32), None);
        // [layer 1][V][token 2][head 3]
        assert_eq!(
            l.row_offset(1, KvTensor::Value, 2, 3),
            Some(65536 + 32768 + 2 * 2048 + 3 * 256)
        );
        assert_eq!(l.row_offset(1, KvTensor::Value, 16, 0), None);
    }

    #[test]
    fn mla_has_one_tensor_per_layer() {
        let l = KvLayout::mla(61, 576, Dtype::Bf16, 64).unwrap();
        assert_eq!(l.block_bytes(), 61 * 64 * 576 * 2);
        assert_eq!(l.tensor_range(0, KvTensor::Key), None);
        assert_eq!(l.tensor_range(1, KvTensor::Latent), Some(73728..147456));
    }

    #[test]
    fn layers_tile_the_block_exactly() {
        let l = KvLayout::new(5, 3, 7, Dtype::F32, 8).unwrap();
        let mut end = 0;
        for layer in 0..5 {
            let r = l.layer_range(layer).unwrap();
            assert_eq!(r.start, end);
            end = r.end;
        }
        assert_eq!(end, l.block_bytes());
    }

    #[test]
    fn bad_layouts_name_the_field() {
        let check = |r: Result<KvLayout, CoreError>, field: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        };
        check(KvLayout::new(0, 8, 128, Dtype::Bf16, 16), "num_layers");
        check(KvLayout::new(32, 0, 128, Dtype::Bf16, 16), "num_kv_heads");
        check(KvLayout::new(32, 8, 0, Dtype::Bf16, 16), "head_dim");
        check(KvLayout::new(32, 8, 128, Dtype::Bf16, 12), "block_tokens");
        check(KvLayout::new(32, 8, 128, Dtype::Bf16, 1024), "block_tokens");
        check(
            KvLayout::new(1024, 1024, 65536, Dtype::F32, 512),
            "block size",
        );
        assert!(Dtype::parse("int4").is_err());
        assert_eq!(Dtype::parse("bf16"), Ok(Dtype::Bf16));
    }

    #[test]
    fn golden_fingerprint() {
        let l = KvLayout::new(32, 8, 128, Dtype::Bf16, 16).unwrap();
        assert_eq!(
            l.fingerprint(),
            GOLDEN_FINGERPRINT,
            "{:#x}",
            l.fingerprint()
        );
        let other = KvLayout::new(32, 8, 128, Dtype::F16, 16).unwrap();
        assert_ne!(l.fingerprint(), other.fingerprint());
        let mla = KvLayout::with_kind(32, 8, 128, Dtype::Bf16, 16, KvKind::Mla).unwrap();
        assert_ne!(l.fingerprint(), mla.fingerprint());
    }

    const GOLDEN_FINGERPRINT: u64 = 0xb84a_5b8b_8d95_00be;
}
