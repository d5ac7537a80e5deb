#![allow(dead_code)]
//! Helpers shared by the store tests.

pub mod device;

use std::path::Path;
use std::time::Duration;

use kvtier_core::{BlockKey, Dtype, KvLayout};
use kvtier_server::{GetOutcome, NvmeSettings, StoreConfig};
use kvtier_testkit::block::fill_block;

/// 4 KiB blocks: 1 layer x 2 x 16 tokens x 4 heads x 16 dim x f16.
pub fn layout() -> KvLayout {
    KvLayout::new(1, 4, 16, Dtype::F16, 16).unwrap()
}

pub const BLOCK: usize = 4096;

pub fn config(dram_blocks: u64, nvme: Option<(&Path, u64)>) -> StoreConfig {
    let mut c = StoreConfig::new(layout(), dram_blocks * BLOCK as u64);
    c.dram_prefault = false;
    c.io_threads = 2;
    c.shards = 4;
    c.max_lease = Duration::from_secs(5);
    if let Some((dir, blocks)) = nvme {
        c.nvme = Some(NvmeSettings::new(dir, blocks * (BLOCK as u64 + 4096)));
    }
    c
}

/// The tier lists every store test runs over, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiers {
    Dram,
    DramNvme,
    /// HBM is the real device on a GPU machine, else the [`device::HeapDevice`] double.
    HbmDramNvme,
}

impl Tiers {
    pub const ALL: [Tiers; 3] = [Tiers::Dram, Tiers::DramNvme, Tiers::HbmDramNvme];

    pub fn has_nvme(self) -> bool {
        self != Tiers::Dram
    }

    pub fn has_hbm(self) -> bool {
        self == Tiers::HbmDramNvme
    }
}

/// [`config`] over the tier list `tiers` (`nvme` is used only when the list has NVMe), with
/// `hbm_blocks` HBM slots when it has HBM.
pub fn config_tiers(
    tiers: Tiers,
    dram_blocks: u64,
    nvme: (&Path, u64),
    hbm_blocks: u64,
) -> StoreConfig {
    let mut c = config(dram_blocks, tiers.has_nvme().then_some(nvme));
    if tiers.has_hbm() {
        c.hbm = Some(device::hbm(hbm_blocks));
    }
    c
}

pub fn key(i: u64) -> BlockKey {
    BlockKey::from_u128(u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1)
}

pub fn data(k: BlockKey) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    fill_block(k, &mut v);
    v
}

/// Gets `k`; on a hit, asserts the bytes are exactly `data(k)`.
pub fn get(store: &kvtier_server::TieredStore, k: BlockKey) -> GetOutcome {
    let mut buf = vec![0u8; BLOCK];
    let o = store.get(&k, &mut buf).unwrap();
    if let GetOutcome::Hit(_) = o {
        assert!(buf == data(k), "wrong bytes served for {k}");
    }
    o
}
