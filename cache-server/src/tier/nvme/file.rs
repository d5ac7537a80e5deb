//! The files under the NVMe tier: positional vectored I/O behind a trait (so tests can inject
//! faults), aligned buffers for direct I/O, and a small pool of them.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use crossbeam::queue::ArrayQueue;

/// Alignment of every buffer and offset used with O_DIRECT.
pub const ALIGN: usize = 4096;

/// Positional, vectored I/O on one slot file. Implementations may transfer fewer bytes than
/// asked (the tier loops); `Ok(0)` on a read means end of file.
pub trait SlotFile: Send + Sync {
    fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize>;
    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize>;
}

impl SlotFile for File {
    fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        let off = libc::off_t::try_from(offset).map_err(|_| io::Error::other("offset overflow"))?;
        let n =
            libc::c_int::try_from(bufs.len()).map_err(|_| io::Error::other("too many buffers"))?;
        // SAFETY: IoSliceMut is ABI-compatible with `struct iovec` on Unix (std guarantees it);
        // every iovec points at a live, exclusively borrowed buffer for the call's duration.
        let r = unsafe { libc::preadv(self.as_raw_fd(), bufs.as_mut_ptr().cast(), n, off) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }

    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        let off = libc::off_t::try_from(offset).map_err(|_| io::Error::other("offset overflow"))?;
        let n =
            libc::c_int::try_from(bufs.len()).map_err(|_| io::Error::other("too many buffers"))?;
        // SAFETY: as above; the buffers are only read by the kernel.
        let r = unsafe { libc::pwritev(self.as_raw_fd(), bufs.as_ptr().cast(), n, off) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

/// Reads until every buffer is full. A short file is `UnexpectedEof`.
pub fn read_all_at(
    f: &dyn SlotFile,
    mut bufs: &mut [IoSliceMut<'_>],
    mut offset: u64,
) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match f.read_vectored_at(bufs, offset) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                IoSliceMut::advance_slices(&mut bufs, n);
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes every buffer completely. A device that accepts no bytes is `WriteZero`.
pub fn write_all_at(
    f: &dyn SlotFile,
    mut bufs: &mut [IoSlice<'_>],
    mut offset: u64,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match f.write_vectored_at(bufs, offset) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                IoSlice::advance_slices(&mut bufs, n);
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A zeroed heap buffer aligned to [`ALIGN`], whose length is a multiple of it.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` is rounded up to a multiple of [`ALIGN`] (at least one).
    pub fn new(len: usize) -> Self {
        let len = len.max(1).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(len, ALIGN).expect("aligned size fits isize");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of `len` initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

/// Whether `buf` can be handed to O_DIRECT as it is.
pub fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(ALIGN) && buf.len().is_multiple_of(ALIGN)
}

/// A bounded pool of equal-sized aligned buffers. Taking from an empty pool allocates (and is
/// counted by the caller); returning to a full pool frees.
pub struct BufferPool {
    bufs: ArrayQueue<AlignedBuf>,
    buf_bytes: usize,
}

impl BufferPool {
    pub fn new(buf_bytes: usize, count: usize) -> Self {
        let bufs = ArrayQueue::new(count.max(1));
        for _ in 0..count {
            // Cannot fail: the queue has room for `count`.
            let _ = bufs.push(AlignedBuf::new(buf_bytes));
        }
        Self { bufs, buf_bytes }
    }

    /// A buffer and whether it had to be allocated.
    pub fn take(&self) -> (AlignedBuf, bool) {
        match self.bufs.pop() {
            Some(b) => (b, false),
            None => (AlignedBuf::new(self.buf_bytes), true),
        }
    }

    pub fn give(&self, buf: AlignedBuf) {
        let _ = self.bufs.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert!(is_aligned(&b));
        assert!(b.iter().all(|&x| x == 0));
        b[8191] = 7;
        assert_eq!(b[8191], 7);
        let pool = BufferPool::new(4096, 1);
        let (x, fresh) = pool.take();
        assert!(!fresh);
        let (_y, fresh) = pool.take();
        assert!(fresh);
        pool.give(x);
    }

    #[test]
    fn vectored_io_round_trips_through_a_file() {
        let f = tempfile::tempfile().unwrap();
        let (a, b) = ([1u8; 10], [2u8; 20]);
        write_all_at(&f, &mut [IoSlice::new(&a), IoSlice::new(&b)], 100).unwrap();
        let (mut x, mut y) = ([0u8; 10], [0u8; 20]);
        read_all_at(
            &f,
            &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)],
            100,
        )
        .unwrap();
        assert_eq!((x, y), (a, b));
        let mut past = [0u8; 8];
        let e = read_all_at(&f, &mut [IoSliceMut::new(&mut past)], 125).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
