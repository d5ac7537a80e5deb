//! A paged KV cache: a pool of fixed-size blocks, each one kvtier block's bytes.
//!
//! **Invariant:** block `b`'s bytes are exactly a kvtier block in this model's
//! [`KvLayout`]: `[layer][K|V][token][kv_head][head_dim]`, f32 little-endian. A block can be
//! copied to or from kvtier (the sidecar, a transfer) as raw bytes with no reshaping.
//!
//! A sequence owns a [`BlockTable`]: its blocks in position order; position `p` lives in
//! `table[p / block_tokens]` at slot `p % block_tokens`. Several sequences share one pool.
//! Attention reads the cache through [`PagedKvCache::gather`], which copies one layer's K and
//! V of positions `0..n` into contiguous buffers (a gather per layer per step; a fused paged
//! attention kernel that reads blocks in place is later work).

use kvtier_core::{KvLayout, KvTensor};
use kvtier_transfer::RegionHandle;

use crate::error::{Result, WorkerError};

const F32_BYTES: usize = 4;

/// Index of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// One sequence's blocks, in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// A table over blocks that already hold a prefix (for example loaded from kvtier).
    pub fn from_blocks(blocks: Vec<BlockId>) -> Self {
        Self { blocks }
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Where the pool's bytes live.
#[derive(Debug)]
enum PoolMemory {
    /// A plain heap buffer.
    Owned(Vec<u8>),
    /// Host memory registered with a kvtier-transfer agent (block `b` at offset
    /// `b * block_bytes`), so peers can read and write blocks one-sidedly (disaggregation).
    Region(RegionHandle),
    /// GPU memory (feature `cuda`): read and written by the GPU forward's kernels in place;
    /// blocks are copied in and out through host memory.
    #[cfg(feature = "cuda")]
    Device(crate::gpu::DevicePool),
}

#[cfg(feature = "cuda")]
fn on_device() -> WorkerError {
    WorkerError::Config {
        field: "kv cache".to_owned(),
        reason: "the pool is in GPU memory: the CPU forward cannot use it (copy blocks with \
                 read_block / write_block)"
            .to_owned(),
    }
}

impl PoolMemory {
    /// `len` bytes at `start`. Callers pass ranges inside the pool (`check_allocated` bounds
    /// every block, and the constructors check the pool fits the memory). A GPU pool has no
    /// host view: an error.
    fn range(&self, start: usize, len: usize) -> Result<&[u8]> {
        Ok(match self {
            PoolMemory::Owned(v) => &v[start..start + len],
            PoolMemory::Region(r) => {
                assert!(
                    start as u64 + len as u64 <= r.len(),
                    "pool range out of bounds"
                );
                // SAFETY: the region is host memory (checked in `PagedKvCache::in_region`),
                // mapped for as long as its handle lives, and the handle lives in `self`; the
                // range is in bounds (asserted above). Only this range is borrowed, never the
                // whole region: the memory contract of `RegionHandle` lets a peer write other
                // blocks, or other layers of a block, while we read these bytes, and the
                // disaggregation protocol reads a block's layer only after the transfer
                // writing it has completed (its notification arrives after its data).
                unsafe { std::slice::from_raw_parts(r.as_ptr().add(start), len) }
            }
            #[cfg(feature = "cuda")]
            PoolMemory::Device(_) => return Err(on_device()),
        })
    }

    /// As [`range`](Self::range), mutable. `&mut self` rules out other borrows in this
    /// process; peers write only ranges no local reader or writer touches (see above).
    fn range_mut(&mut self, start: usize, len: usize) -> Result<&mut [u8]> {
        Ok(match self {
            PoolMemory::Owned(v) => &mut v[start..start + len],
            PoolMemory::Region(r) => {
                assert!(
                    start as u64 + len as u64 <= r.len(),
                    "pool range out of bounds"
                );
                // SAFETY: as in `range`; `&mut self` makes this the only borrow of these
                // bytes in this process.
                unsafe { std::slice::from_raw_parts_mut(r.as_ptr().add(start), len) }
            }
            #[cfg(feature = "cuda")]
            PoolMemory::Device(_) => return Err(on_device()),
        })
    }
}

/// The block pool.
#[derive(Debug)]
pub struct PagedKvCache {
    layout: KvLayout,
    block_bytes: usize,
    tensor_bytes: usize,
    token_bytes: usize,
    data: PoolMemory,
    allocated: Vec<bool>,
    free: Vec<BlockId>,
}

impl PagedKvCache {
    /// A pool of `num_blocks` zeroed blocks of `layout` (which must be f32).
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self> {
        let (block_bytes, total) = Self::pool_size(&layout, num_blocks)?;
        Ok(Self::with_memory(
            layout,
            block_bytes,
            num_blocks,
            PoolMemory::Owned(vec![0; total]),
        ))
    }

    /// A pool of `num_blocks` blocks of `layout` laid out from offset 0 of `region`, a host
    /// region registered with a kvtier-transfer agent (for example from
    /// `Agent::alloc_dram`, which is zeroed and reachable over every backend). Block `b` is
    /// then at offset `b * block_size_bytes()` of the region, where peers can read or write
    /// it. The region must hold the pool; its bytes are used as they are (not zeroed).
    pub fn in_region(layout: KvLayout, num_blocks: usize, region: RegionHandle) -> Result<Self> {
        let (block_bytes, total) = Self::pool_size(&layout, num_blocks)?;
        if !region.kind().is_host() {
            return Err(WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: format!("region {} is not host memory", region.id()),
            });
        }
        if region.len() < total as u64 {
            return Err(WorkerError::Config {
                field: "kv cache".to_owned(),
                reason: format!(
                    "region {} holds {} bytes, the pool needs {total}",
                    region.id(),
                    region.len()
                ),
            });
        }
        Ok(Self::with_memory(
            layout,
            block_bytes,
            num_blocks,
            PoolMemory::Region(region),
        ))
    }

    /// A pool of `num_blocks` zeroed blocks in `gpu`'s memory (feature `cuda`), read and
    /// written in place by the GPU forward ([`crate::gpu`]).
    #[cfg(feature = "cuda")]
    pub fn on_gpu(
        layout: KvLayout,
        num_blocks: usize,
        gpu: &std::sync::Arc<crate::gpu::Gpu>,
    ) -> Result<Self> {
        let (block_bytes, total) = Self::pool_size(&layout, num_blocks)?;
        let pool = crate::gpu::DevicePool::alloc(gpu, total)?;
        Ok(Self::with_memory(
            layout,
            block_bytes,
            num_blocks,
            PoolMemory::Device(pool),
        ))
    }

    /// The GPU memory the pool lives in ([`on_gpu`](Self::on_gpu)).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_pool(&self) -> Result<&crate::gpu::DevicePool> {
        match &self.data {
            PoolMemory::Device(p) => Ok(p),
            _ => Err(WorkerError::Gpu {
                reason: "the model runs on a GPU but its KV pool is in host memory".to_owned(),
            }),
        }
    }

    /// The GPU the pool is on ([`on_gpu`](Self::on_gpu)).
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&std::sync::Arc<crate::gpu::Gpu>> {
        match &self.data {
            PoolMemory::Device(p) => Some(p.gpu()),
            _ => None,
        }
    }

    /// Whether the pool is in GPU memory.
    pub fn is_on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        if matches!(self.data, PoolMemory::Device(_)) {
            return true;
        }
        false
    }

    /// The registered region the pool lives in ([`in_region`](Self::in_region)), if any.
    pub fn region(&self) -> Option<&RegionHandle> {
        match &self.data {
            PoolMemory::Region(r) => Some(r),
            _ => None,
        }
    }

    /// Bytes of one block (`layout().block_bytes()` as a `usize`).
    pub fn block_size_bytes(&self) -> usize {
        self.block_bytes
    }

    /// `(block_bytes, pool_bytes)`, checked.
    fn pool_size(layout: &KvLayout, num_blocks: usize) -> Result<(usize, usize)> {
        if layout.dtype().bytes() as usize != F32_BYTES {
            return Err(WorkerError::Config {
                field: "kv dtype".to_owned(),
                reason: format!("the CPU cache stores f32, not {}", layout.dtype().name()),
            });
        }
        let too_big = |what: &str| WorkerError::Config {
            field: "kv cache".to_owned(),
            reason: format!("{what} does not fit in memory"),
        };
        let block_bytes = usize::try_from(layout.block_bytes()).map_err(|_| too_big("a block"))?;
        let total = block_bytes
            .checked_mul(num_blocks)
            .ok_or_else(|| too_big("the pool"))?;
        if u32::try_from(num_blocks).is_err() {
            return Err(too_big("a pool of more than 2^32 blocks"));
        }
        Ok((block_bytes, total))
    }

    fn with_memory(
        layout: KvLayout,
        block_bytes: usize,
        num_blocks: usize,
        data: PoolMemory,
    ) -> Self {
        Self {
            layout,
            block_bytes,
            // Both divide block_bytes, so they fit in usize too.
            tensor_bytes: layout.tensor_bytes() as usize,
            token_bytes: layout.token_bytes() as usize,
            data,
            allocated: vec![false; num_blocks],
            // Pop from the end: hand out low ids first.
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.allocated.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn block_tokens(&self) -> usize {
        self.layout.block_tokens() as usize
    }

    /// Takes a free block.
    pub fn allocate(&mut self) -> Result<BlockId> {
        let id = self
            .free
            .pop()
            .ok_or(WorkerError::CacheFull { needed: 1, free: 0 })?;
        self.allocated[id.0 as usize] = true;
        Ok(id)
    }

    /// Returns a block to the pool.
    pub fn release(&mut self, id: BlockId) -> Result<()> {
        self.check_allocated(id)?;
        self.allocated[id.0 as usize] = false;
        self.free.push(id);
        Ok(())
    }

    /// Grows `table` until it covers `tokens` positions. All or nothing: on `CacheFull` the
    /// table is unchanged.
    pub fn reserve(&mut self, table: &mut BlockTable, tokens: usize) -> Result<()> {
        let needed = tokens
            .div_ceil(self.block_tokens())
            .saturating_sub(table.len());
        if needed > self.free.len() {
            return Err(WorkerError::CacheFull {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            let id = self.allocate()?;
            table.blocks.push(id);
        }
        Ok(())
    }

    /// Frees every block of `table` and empties it.
    pub fn release_table(&mut self, table: &mut BlockTable) -> Result<()> {
        for id in table.blocks.drain(..) {
            self.release(id)?;
        }
        Ok(())
    }

    /// Ok when `id` is an allocated block of this pool.
    pub fn check_block(&self, id: BlockId) -> Result<()> {
        self.check_allocated(id).map(|_| ())
    }

    fn check_allocated(&self, id: BlockId) -> Result<usize> {
        let i = id.0 as usize;
        match self.allocated.get(i) {
            None => Err(WorkerError::NoSuchBlock {
                block: id.0,
                num_blocks: self.num_blocks(),
            }),
            Some(false) => Err(WorkerError::BlockNotAllocated { block: id.0 }),
            Some(true) => Ok(i * self.block_bytes),
        }
    }

    /// The raw bytes of an allocated block, in kvtier's layout. Host pools only: a GPU
    /// pool's blocks are copied out with [`read_block`](Self::read_block).
    pub fn block_bytes(&self, id: BlockId) -> Result<&[u8]> {
        let start = self.check_allocated(id)?;
        self.data.range(start, self.block_bytes)
    }

    /// Appends an allocated block's bytes to `out` (from host or GPU memory).
    pub fn read_block(&self, id: BlockId, out: &mut Vec<u8>) -> Result<()> {
        let start = self.check_allocated(id)?;
        #[cfg(feature = "cuda")]
        if let PoolMemory::Device(pool) = &self.data {
            let at = out.len();
            out.resize(at + self.block_bytes, 0);
            return pool.read(start, &mut out[at..]);
        }
        out.extend_from_slice(self.data.range(start, self.block_bytes)?);
        Ok(())
    }

    /// Overwrites an allocated block with `bytes` (one whole block in kvtier's layout).
    pub fn write_block(&mut self, id: BlockId, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.block_bytes {
            return Err(WorkerError::BlockSize {
                got: bytes.len(),
                expected: self.block_bytes,
            });
        }
        let start = self.check_allocated(id)?;
        let block_bytes = self.block_bytes;
        #[cfg(feature = "cuda")]
        if let PoolMemory::Device(pool) = &mut self.data {
            return pool.write(start, bytes);
        }
        self.data
            .range_mut(start, block_bytes)?
            .copy_from_slice(bytes);
        Ok(())
    }

    /// Byte offset in `data` of `[block of pos][layer][tensor][slot of pos][0][0]`.
    fn row_start(
        &self,
        table: &BlockTable,
        layer: usize,
        tensor: KvTensor,
        pos: usize,
    ) -> Result<usize> {
        let bt = self.block_tokens();
        let id = *table
            .blocks
            .get(pos / bt)
            .ok_or(WorkerError::MissingPrefix {
                start_pos: pos,
                covered_tokens: table.len() * bt,
            })?;
        let block_start = self.check_allocated(id)?;
        let tensor_start = self
            .layout
            .tensor_range(layer as u32, tensor)
            .ok_or_else(|| WorkerError::Config {
                field: "layer".to_owned(),
                reason: format!("layer {layer} is outside the KV layout"),
            })?
            .start as usize;
        Ok(block_start + tensor_start + (pos % bt) * self.token_bytes)
    }

    /// Stores one layer's K and V rows for positions `start_pos..start_pos + n`, each slice
    /// laid out `[token][kv_head][head_dim]`.
    pub fn write_kv(
        &mut self,
        table: &BlockTable,
        layer: usize,
        start_pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let row = self.token_bytes / F32_BYTES;
        debug_assert_eq!(k.len(), v.len());
        debug_assert_eq!(k.len() % row, 0);
        for (tensor, src) in [(KvTensor::Key, k), (KvTensor::Value, v)] {
            let mut done = 0;
            while done < src.len() {
                let pos = start_pos + done / row;
                // Rows of consecutive positions in one block are contiguous.
                let run_tokens =
                    (self.block_tokens() - pos % self.block_tokens()).min((src.len() - done) / row);
                let start = self.row_start(table, layer, tensor, pos)?;
                let len = run_tokens * self.token_bytes;
                let dst = self.data.range_mut(start, len)?;
                for (d, s) in dst
                    .chunks_exact_mut(F32_BYTES)
                    .zip(&src[done..done + run_tokens * row])
                {
                    d.copy_from_slice(&s.to_le_bytes());
                }
                done += run_tokens * row;
            }
        }
        Ok(())
    }

    /// One layer's K and V for positions `0..n_tokens`, each `[token][kv_head][head_dim]`.
    pub fn gather(
        &self,
        table: &BlockTable,
        layer: usize,
        n_tokens: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let row = self.token_bytes / F32_BYTES;
        let bt = self.block_tokens();
        let mut out = [
            Vec::with_capacity(n_tokens * row),
            Vec::with_capacity(n_tokens * row),
        ];
        for (tensor, dst) in [KvTensor::Key, KvTensor::Value].into_iter().zip(&mut out) {
            let mut pos = 0;
            while pos < n_tokens {
                let run_tokens = bt.min(n_tokens - pos);
                let start = self.row_start(table, layer, tensor, pos)?;
                debug_assert!(run_tokens * self.token_bytes <= self.tensor_bytes);
                dst.extend(
                    self.data
                        .range(start, run_tokens * self.token_bytes)?
                        .chunks_exact(F32_BYTES)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
                pos += run_tokens;
            }
        }
        let [k, v] = out;
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use kvtier_core::Dtype;

    use super::*;

    fn layout() -> KvLayout {
        // 3 layers, 2 kv heads, head dim 4, 4-token blocks.
        KvLayout::new(3, 2, 4, Dtype::F32, 4).unwrap()
    }

    /// A recognisable value for every element.
    fn val(layer: usize, tensor: usize, pos: usize, head: usize, d: usize) -> f32 {
        (layer * 10_000 + tensor * 1000 + pos * 10 + head * 5 + d) as f32
    }

    #[test]
    fn rows_land_where_kv_layout_says() {
        let l = layout();
        let mut cache = PagedKvCache::new(l, 5).unwrap();
        let mut table = BlockTable::new();
        // Take block 0 first so the table's blocks are not 0, 1 (tests the indirection).
        let spare = cache.allocate().unwrap();
        cache.reserve(&mut table, 6).unwrap();
        assert_eq!(table.len(), 2);
        cache.release(spare).unwrap();
        let n = 6;
        for layer in 0..3 {
            let row = |t| -> Vec<f32> {
                (0..n)
                    .flat_map(|p| {
                        (0..2).flat_map(move |h| (0..4).map(move |d| val(layer, t, p, h, d)))
                    })
                    .collect()
            };
            // Write in two uneven pieces crossing the block boundary.
            let (k, v) = (row(0), row(1));
            cache
                .write_kv(&table, layer, 0, &k[..8 * 3], &v[..8 * 3])
                .unwrap();
            cache
                .write_kv(&table, layer, 3, &k[8 * 3..], &v[8 * 3..])
                .unwrap();
            let (gk, gv) = cache.gather(&table, layer, n).unwrap();
            assert_eq!((gk, gv), (k, v));
        }
        // Each element is at KvLayout::row_offset inside its block's bytes.
        for p in 0..n {
            let bytes = cache.block_bytes(table.blocks()[p / 4]).unwrap();
            for layer in 0..3u32 {
                for (ti, t) in [KvTensor::Key, KvTensor::Value].into_iter().enumerate() {
                    for h in 0..2u32 {
                        let off = l.row_offset(layer, t, (p % 4) as u32, h).unwrap() as usize;
                        for d in 0..4 {
                            let b = &bytes[off + d * 4..off + d * 4 + 4];
                            let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                            assert_eq!(x, val(layer as usize, ti, p, h as usize, d));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn block_bytes_round_trip_into_another_pool() {
        let l = layout();
        let mut a = PagedKvCache::new(l, 2).unwrap();
        let mut table = BlockTable::new();
        a.reserve(&mut table, 8).unwrap();
        let k: Vec<f32> = (0..8 * 8).map(|i| i as f32 * 0.5).collect();
        let v: Vec<f32> = (0..8 * 8).map(|i| -(i as f32)).collect();
        for layer in 0..3 {
            a.write_kv(&table, layer, 0, &k, &v).unwrap();
        }
        let copied: Vec<Vec<u8>> = table
            .blocks()
            .iter()
            .map(|&b| a.block_bytes(b).unwrap().to_vec())
            .collect();
        assert_eq!(copied[0].len() as u64, l.block_bytes());

        let mut b = PagedKvCache::new(l, 4).unwrap();
        let _skip = b.allocate().unwrap();
        let ids: Vec<BlockId> = copied
            .iter()
            .map(|bytes| {
                let id = b.allocate().unwrap();
                b.write_block(id, bytes).unwrap();
                id
            })
            .collect();
        let t2 = BlockTable::from_blocks(ids);
        for layer in 0..3 {
            assert_eq!(b.gather(&t2, layer, 8).unwrap(), (k.clone(), v.clone()));
            assert_eq!(b.gather(&t2, layer, 5).unwrap().0, k[..5 * 8]);
        }
        for (id, bytes) in t2.blocks().iter().zip(&copied) {
            assert_eq!(b.block_bytes(*id).unwrap(), bytes.as_slice());
        }
    }

    /// Exercises the `unsafe` range accessors of a region-backed pool: what `write_kv` puts
    /// there is what the region holds (read back through the transfer library's own copy) and
    /// what `gather` returns; a region too small for the pool is refused.
    #[test]
    fn a_pool_in_a_registered_region_reads_and_writes_the_region() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let agent = rt
            .block_on(kvtier_transfer::Agent::new(
                "kv-cache-test",
                kvtier_transfer::AgentConfig::default(),
            ))
            .unwrap();
        let l = layout();
        let small = agent.alloc_dram(l.block_bytes() * 2).unwrap();
        assert!(matches!(
            PagedKvCache::in_region(l, 3, small),
            Err(WorkerError::Config { .. })
        ));
        let region = agent.alloc_dram(l.block_bytes() * 3).unwrap();
        let mut cache = PagedKvCache::in_region(l, 3, region).unwrap();
        let mut table = BlockTable::new();
        let _skip = cache.allocate().unwrap();
        cache.reserve(&mut table, 7).unwrap();
        let k: Vec<f32> = (0..7 * 8).map(|i| i as f32 + 0.25).collect();
        let v: Vec<f32> = (0..7 * 8).map(|i| -(i as f32)).collect();
        for layer in 0..3 {
            cache.write_kv(&table, layer, 0, &k, &v).unwrap();
            assert_eq!(
                cache.gather(&table, layer, 7).unwrap(),
                (k.clone(), v.clone())
            );
        }
        let bb = cache.block_size_bytes();
        for &id in table.blocks() {
            let mut from_region = vec![0u8; bb];
            let r = cache.region().unwrap();
            r.read_at(id.0 as u64 * bb as u64, &mut from_region)
                .unwrap();
            assert_eq!(cache.block_bytes(id).unwrap(), from_region.as_slice());
            assert!(from_region.iter().any(|&b| b != 0));
        }
        let ones = vec![1u8; bb];
        cache.write_block(table.blocks()[1], &ones).unwrap();
        let mut back = vec![0u8; bb];
        let off = table.blocks()[1].0 as u64 * bb as u64;
        cache.region().unwrap().read_at(off, &mut back).unwrap();
        assert_eq!(back, ones);
    }

    #[test]
    fn allocation_errors() {
        let mut c = PagedKvCache::new(layout(), 2).unwrap();
        let mut t = BlockTable::new();
        assert!(matches!(
            c.reserve(&mut t, 9),
            Err(WorkerError::CacheFull { needed: 3, free: 2 })
        ));
        assert!(t.is_empty(), "a failed reserve allocates nothing");
        c.reserve(&mut t, 8).unwrap();
        assert_eq!(c.free_blocks(), 0);
        assert!(matches!(c.allocate(), Err(WorkerError::CacheFull { .. })));
        assert!(matches!(
            c.block_bytes(BlockId(2)),
            Err(WorkerError::NoSuchBlock {
                block: 2,
                num_blocks: 2
            })
        ));
        assert!(matches!(
            c.write_block(t.blocks()[0], &[0; 3]),
            Err(WorkerError::BlockSize { got: 3, .. })
        ));
        assert!(matches!(
            c.gather(&t, 0, 9),
            Err(WorkerError::MissingPrefix {
                start_pos: 8,
                covered_tokens: 8
            })
        ));
        c.release_table(&mut t).unwrap();
        assert_eq!(c.free_blocks(), 2);
        assert!(matches!(
            c.block_bytes(BlockId(0)),
            Err(WorkerError::BlockNotAllocated { block: 0 })
        ));
        assert!(matches!(
            c.release(BlockId(1)),
            Err(WorkerError::BlockNotAllocated { block: 1 })
        ));
    }
}
