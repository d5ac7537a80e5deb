//! A local connection's staging region: the only memory its client can write.
//!
//! The DRAM arena is read-only for clients (`tier/dram.rs`), so a local put lands here
//! first: at hello the server creates one memfd per connection that asked for the arena, cut
//! into block-sized places, and passes it read-write with the arena's read-only fd. A
//! `reserve` hands out places (their offsets here) next to the DRAM slots it reserves; the
//! client writes the blocks into its places and `commit` copies each place into its slot.
//! So a client can write only what it is putting, and a committed block is never written by
//! anyone but the server.
//!
//! **Invariant:** reading a staging place never faults, whatever the client does with its
//! descriptor: the memfd is sealed against shrinking and growing (and further seals) before
//! it is passed, so its size is fixed; a hole the client punches reads as zeros. The client
//! may write a place while the server copies it: the copy is a raw byte copy out of the
//! mapping (never a Rust reference), and the block committed is then whatever bytes the
//! client left, which only its own put is made of.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::sync::Mutex;

use memmap2::MmapRaw;

/// Most bytes one connection's staging region holds (a quarter of the arena if smaller).
pub(crate) const MAX_STAGING_BYTES: u64 = 64 << 20;

pub(crate) struct Staging {
    file: File,
    map: MmapRaw,
    block_bytes: usize,
    /// Places not lent to a reservation.
    free: Mutex<Vec<u32>>,
    places: u32,
}

impl Staging {
    /// How many places a connection gets: a quarter of the arena's blocks (what the SDK
    /// puts at once), at most [`MAX_STAGING_BYTES`], at least one.
    pub(crate) fn places_for(arena_blocks: u64, block_bytes: usize) -> u32 {
        let cap = (MAX_STAGING_BYTES / block_bytes.max(1) as u64).max(1);
        (arena_blocks / 4).clamp(1, cap).min(u64::from(u32::MAX)) as u32
    }

    /// A new region of `places` blocks of `block_bytes`, sealed against resizing.
    pub(crate) fn create(places: u32, block_bytes: usize) -> std::io::Result<Staging> {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"kvtier-staging".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let bytes = u64::from(places) * block_bytes as u64;
        file.set_len(bytes)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own, with an integer argument.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The server only reads its clients' places.
        let map = memmap2::MmapOptions::new()
            .len(bytes as usize)
            .map_raw_read_only(&file)?;
        Ok(Staging {
            file,
            map,
            block_bytes,
            free: Mutex::new((0..places).rev().collect()),
            places,
        })
    }

    /// The read-write descriptor passed to the client.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub(crate) fn bytes(&self) -> u64 {
        u64::from(self.places) * self.block_bytes as u64
    }

    pub(crate) fn places(&self) -> u32 {
        self.places
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lends `n` places, all or none (`None` when fewer are free).
    pub(crate) fn take(&self, n: usize) -> Option<Vec<u32>> {
        let mut free = self.free();
        let keep = free.len().checked_sub(n)?;
        Some(free.split_off(keep))
    }

    /// Gives a place back.
    pub(crate) fn give_back(&self, place: u32) {
        let mut free = self.free();
        debug_assert!(place < self.places && !free.contains(&place));
        free.push(place);
    }

    /// Byte offset of `place` in the region.
    pub(crate) fn offset(&self, place: u32) -> u64 {
        u64::from(place) * self.block_bytes as u64
    }

    /// Copies the first `dst.len()` bytes of `place` into `dst`.
    ///
    /// # Panics
    /// If `place` is out of range or `dst` is longer than a block.
    pub(crate) fn copy_out(&self, place: u32, dst: &mut [u8]) {
        assert!(
            place < self.places && dst.len() <= self.block_bytes,
            "staging range"
        );
        // SAFETY: [offset, offset + len) lies inside the mapping (asserted above), which
        // lives as long as `self`; the memfd's size is sealed, so every page of the range
        // stays backed (no SIGBUS). The client may write the range concurrently: this is a
        // raw byte copy, no reference into shared memory is formed, and `dst` is ours alone.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(self.offset(place) as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_for_is_a_quarter_of_the_arena_within_bounds() {
        assert_eq!(Staging::places_for(0, 4096), 1);
        assert_eq!(Staging::places_for(100, 4096), 25);
        assert_eq!(Staging::places_for(1 << 20, 2 << 20), 32);
    }

    /// A client that shrinks, grows or re-seals its staging region is refused; one that
    /// punches holes in it makes the server read zeros, never fault.
    #[test]
    fn a_client_cannot_resize_its_staging_region() {
        let s = Staging::create(4, 8192).unwrap();
        assert_eq!((s.bytes(), s.places()), (32768, 4));
        let client = File::from(s.fd().try_clone_to_owned().unwrap());
        let map = MmapRaw::map_raw(&client).unwrap();
        assert!(s.take(5).is_none(), "more places than there are");
        let p = s.take(1).unwrap()[0];
        assert!(s.take(4).is_none(), "one is lent");
        let off = s.offset(p) as usize;
        // SAFETY: [off, off + 8192) is inside the 32 KiB mapping; the server side only
        // reads it after this write.
        unsafe { std::ptr::write_bytes(map.as_mut_ptr().add(off), 3, 8192) };
        let mut got = vec![0u8; 8192];
        s.copy_out(p, &mut got);
        assert_eq!(got, vec![3u8; 8192]);
        assert!(client.set_len(0).is_err(), "shrinking");
        assert!(client.set_len(1 << 20).is_err(), "growing");
        // SAFETY: fcntl with an integer argument; refused (F_SEAL_SEAL).
        let seal =
            unsafe { libc::fcntl(client.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert!(seal < 0, "adding a seal");
        // SAFETY: fallocate on a descriptor we own; a hole within the region is allowed.
        let punch = unsafe {
            libc::fallocate(
                client.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                8192,
            )
        };
        assert_eq!(punch, 0);
        s.copy_out(p, &mut got);
        assert_eq!(got, vec![0u8; 8192], "a hole reads as zeros");
        s.give_back(p);
        assert_eq!(s.take(4).map(|v| v.len()), Some(4), "given back");
    }
}
