//! The conformance suite every kvtier-server [`Tier`] passes: the DRAM arena, the NVMe slot
//! files, the HBM tier on a GPU host, and the store tests' device-memory double all run the same
//! checks (cache-server/tests/tiers.rs). Each check panics with a description on failure.

use std::collections::HashMap;

use kvtier_core::{BlockKey, SplitMix64};

use kvtier_server::tier::{SlotId, Tier, TierError};

use crate::block::block_bytes;

fn lens(slot_bytes: usize) -> [usize; 5] {
    [1, 4096, slot_bytes / 2 + 3, slot_bytes - 1, slot_bytes]
}

fn read_back(t: &dyn Tier, slot: SlotId, key: BlockKey, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    t.read(slot, key, &mut buf)
        .unwrap_or_else(|e| panic!("{} read of slot {slot} failed: {e}", t.kind()));
    buf
}

/// Writes blocks of several sizes into random slots and reads exactly them back.
pub fn round_trip(t: &dyn Tier) {
    let mut rng = SplitMix64::new(1);
    let mut model: HashMap<SlotId, (BlockKey, usize)> = HashMap::new();
    for i in 0..64u64 {
        let slot = SlotId(rng.below(u64::from(t.slot_count())) as u32);
        let len = lens(t.slot_bytes())[(i % 5) as usize].max(1);
        let key = BlockKey::from_u128(u128::from(rng.next_u64()) << 1 | 1);
        t.write(slot, key, &block_bytes(key, len)).unwrap();
        model.insert(slot, (key, len));
    }
    for (slot, (key, len)) in &model {
        assert!(
            read_back(t, *slot, *key, *len) == block_bytes(*key, *len),
            "{}: slot {slot} returned other bytes",
            t.kind()
        );
    }
}

/// A read with the wrong key or length is a miss, never bytes; so is an empty slot.
pub fn wrong_key_or_length_is_a_miss(t: &dyn Tier) {
    let (slot, key) = (SlotId(0), BlockKey::from_u128(42));
    let miss = |r: Result<(), TierError>, what: &str| match r {
        Err(e) if e.is_miss() => {}
        other => panic!("{}: {what} gave {other:?}, want a miss", t.kind()),
    };
    miss(t.read(SlotId(1), key, &mut [0u8; 8]), "empty slot");
    t.write(slot, key, &block_bytes(key, 100)).unwrap();
    miss(
        t.read(slot, BlockKey::from_u128(43), &mut [0u8; 100]),
        "wrong key",
    );
    miss(t.read(slot, key, &mut [0u8; 99]), "wrong length");
    assert_eq!(read_back(t, slot, key, 100), block_bytes(key, 100));
}

/// Out-of-range slots and oversized blocks are errors that leave the tier intact.
pub fn geometry_is_enforced(t: &dyn Tier) {
    let key = BlockKey::from_u128(7);
    let past = SlotId(t.slot_count());
    assert!(t.write(past, key, &[1, 2, 3]).is_err());
    assert!(t.read(past, key, &mut [0u8; 3]).is_err());
    assert!(t.erase(past).is_err());
    let big = vec![0u8; t.slot_bytes() + 1];
    assert!(t.write(SlotId(0), key, &big).is_err());
    t.write(SlotId(0), key, &[9; 16]).unwrap();
    assert_eq!(read_back(t, SlotId(0), key, 16), vec![9; 16]);
}

/// A new block replaces the old one in its slot; the old key misses afterwards.
pub fn overwrite_replaces(t: &dyn Tier) {
    let (a, b) = (BlockKey::from_u128(100), BlockKey::from_u128(200));
    let slot = SlotId(t.slot_count() - 1);
    t.write(slot, a, &block_bytes(a, 5000)).unwrap();
    t.write(slot, b, &block_bytes(b, 300)).unwrap();
    assert!(t.read(slot, a, &mut vec![0u8; 5000]).unwrap_err().is_miss());
    assert_eq!(read_back(t, slot, b, 300), block_bytes(b, 300));
}

/// An erased slot misses.
pub fn erase_forgets(t: &dyn Tier) {
    let key = BlockKey::from_u128(300);
    t.write(SlotId(2), key, &block_bytes(key, 64)).unwrap();
    t.erase(SlotId(2)).unwrap();
    assert!(
        t.read(SlotId(2), key, &mut [0u8; 64])
            .unwrap_err()
            .is_miss()
    );
}

/// After `clear_all` every block misses.
pub fn clear_all_forgets(t: &dyn Tier) {
    let key = BlockKey::from_u128(301);
    t.write(SlotId(1), key, &block_bytes(key, 64)).unwrap();
    t.clear_all().unwrap();
    assert!(
        t.read(SlotId(1), key, &mut [0u8; 64])
            .unwrap_err()
            .is_miss()
    );
    t.write(SlotId(1), key, &block_bytes(key, 64)).unwrap();
    assert_eq!(read_back(t, SlotId(1), key, 64), block_bytes(key, 64));
}

/// Threads writing and reading distinct slots never see each other's bytes.
pub fn concurrent_distinct_slots(t: &dyn Tier) {
    let threads = 4u32.min(t.slot_count());
    std::thread::scope(|s| {
        for th in 0..threads {
            s.spawn(move || {
                let mut rng = SplitMix64::new(u64::from(th) + 10);
                let slots: Vec<SlotId> = (0..t.slot_count())
                    .filter(|i| i % threads == th)
                    .map(SlotId)
                    .collect();
                for _ in 0..50 {
                    let slot = slots[rng.below(slots.len() as u64) as usize];
                    let key = BlockKey::from_u128(u128::from(rng.next_u64()));
                    let len = 1 + rng.below(t.slot_bytes() as u64) as usize;
                    t.write(slot, key, &block_bytes(key, len)).unwrap();
                    assert_eq!(read_back(t, slot, key, len), block_bytes(key, len));
                }
            });
        }
    });
}

/// Runs every check that applies to any tier. `make` returns a fresh, empty tier.
pub fn run_volatile(make: &dyn Fn() -> Box<dyn Tier>) {
    round_trip(&*make());
    wrong_key_or_length_is_a_miss(&*make());
    geometry_is_enforced(&*make());
    overwrite_replaces(&*make());
    erase_forgets(&*make());
    clear_all_forgets(&*make());
    concurrent_distinct_slots(&*make());
}

/// Runs every check plus persistence: blocks written before the tier is dropped are
/// recovered, with their exact bytes, when `reopen` opens it again; erased and overwritten
/// blocks are not. `fresh` returns an empty tier, `reopen` the same store as the last call.
pub fn run_persistent(fresh: &dyn Fn() -> Box<dyn Tier>, reopen: &dyn Fn() -> Box<dyn Tier>) {
    run_volatile(fresh);
    let t = fresh();
    assert!(t.recover().is_empty(), "a fresh tier recovered blocks");
    let mut rng = SplitMix64::new(77);
    let mut model: HashMap<SlotId, (BlockKey, usize)> = HashMap::new();
    for i in 0..(2 * t.slot_count()) {
        let slot = SlotId(rng.below(u64::from(t.slot_count())) as u32);
        let key = BlockKey::from_u128(u128::from(i) + 1000);
        let len = lens(t.slot_bytes())[(i % 5) as usize];
        t.write(slot, key, &block_bytes(key, len)).unwrap();
        model.insert(slot, (key, len));
    }
    let erased = *model.keys().next().expect("wrote at least one slot");
    t.erase(erased).unwrap();
    model.remove(&erased);
    drop(t);
    let t = reopen();
    let mut found: HashMap<SlotId, (BlockKey, usize)> = HashMap::new();
    for r in t.recover() {
        assert!(
            found.insert(r.slot, (r.key, r.len as usize)).is_none(),
            "slot {} recovered twice",
            r.slot
        );
    }
    assert_eq!(found, model, "{}: recovered index differs", t.kind());
    for (slot, (key, len)) in &model {
        assert_eq!(read_back(&*t, *slot, *key, *len), block_bytes(*key, *len));
    }
    // A cleared tier recovers nothing, and blocks written after the clear survive.
    t.clear_all().unwrap();
    let key = BlockKey::from_u128(5);
    t.write(SlotId(0), key, &block_bytes(key, 4096)).unwrap();
    drop(t);
    let t = reopen();
    let found = t.recover();
    assert_eq!(found.len(), 1, "{}: after clear_all: {found:?}", t.kind());
    assert_eq!((found[0].slot, found[0].key), (SlotId(0), key));
}
