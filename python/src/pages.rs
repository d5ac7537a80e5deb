//! `KvPages`: where blocks live in an engine's paged KV cache, so a get scatters each kvtier
//! block straight into the engine's pages and a put gathers it from them, by page (block) id.
//!
//! A kvtier block is one byte string (layer-major: `[layer][K|V][...]`). An engine such as vLLM
//! keeps one tensor per layer whose page `p` holds that layer's K and V for one block. A
//! `KvPages` lists *regions* in the order of the block's bytes: region `j` is `(buffer,
//! offset, stride, length)`, and for page `p` the block's next `length` bytes live at
//! `buffer[offset + p * stride ..][..length]`.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::{Access, HeldBuffer};

#[derive(Clone, Copy)]
struct Region {
    /// Index of the held buffer, its first byte's address and its length.
    buf: usize,
    base: usize,
    buf_len: usize,
    offset: usize,
    stride: usize,
    length: usize,
}

/// The regions of a paged KV cache, in block-byte order. Holds the buffers (they cannot be
/// resized or freed while held) until it is dropped.
#[pyclass(frozen, module = "kvtier")]
pub struct KvPages {
    regions: Vec<Region>,
    /// Where each region starts in a block's bytes (`starts[j]` = the lengths of regions
    /// before `j`), for copies of part of a block (`copy_in_range`).
    starts: Vec<usize>,
    held: Mutex<Vec<HeldBuffer>>,
    #[pyo3(get)]
    pub(crate) block_bytes: usize,
    /// Pages every region can address (the smallest count).
    #[pyo3(get)]
    num_pages: usize,
    /// Two different pages never share a byte (checked once, in `new`), so a page list writes
    /// no byte twice as soon as its ids are distinct.
    pages_disjoint: bool,
}

impl KvPages {
    /// Address ranges of the given pages, region by region and page by page, in block-byte
    /// order.
    fn ranges(&self, pages: &[usize]) -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(pages.len() * self.regions.len());
        for &p in pages {
            for r in &self.regions {
                out.push((r.base + r.offset + p * r.stride, r.length));
            }
        }
        out
    }

    /// Refuses page ids out of range and, for pages about to be written (`write`), lists that
    /// would write one byte twice (the same page twice): the ids' distinctness where `new`
    /// proved pages disjoint, else every range against every other.
    pub fn check_pages(&self, pages: &[usize], write: bool) -> PyResult<()> {
        if let Some((i, p)) = pages
            .iter()
            .enumerate()
            .find(|(_, p)| **p >= self.num_pages)
        {
            return Err(PyValueError::new_err(format!(
                "page id {p} (block {i}) out of range: these pages hold {}",
                self.num_pages
            )));
        }
        if !write {
            return Ok(());
        }
        if !self.pages_disjoint {
            return check_disjoint(&self.ranges(pages));
        }
        let mut ids = pages.to_vec();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(PyValueError::new_err(
                "these page ids write overlapping memory (a page id given twice?)",
            ));
        }
        Ok(())
    }

    /// Copies `src` (whole blocks, back to back, in kvtier's byte order) into `pages`.
    ///
    /// # Safety
    /// The caller holds [`KvPages::lock`] for the call, `pages` passed
    /// [`KvPages::check_pages`] with `write`, `src` holds at least `pages.len()` blocks and
    /// does not overlap the held buffers.
    pub unsafe fn copy_in(&self, src: &[u8], pages: &[usize]) {
        assert!(src.len() >= pages.len() * self.block_bytes);
        let mut at = src.as_ptr();
        for &p in pages {
            for r in &self.regions {
                // SAFETY: `p < num_pages`, so the range lies inside the held, writable buffer
                // (see `new`); the checked page ids make it written once; `at` stays inside
                // `src` (asserted above), which overlaps no held buffer.
                unsafe {
                    copy_run(at, (r.base + r.offset + p * r.stride) as *mut u8, r.length);
                    at = at.add(r.length);
                }
            }
        }
    }

    /// Copies bytes `lo..hi` of one block, `src` (the whole block in kvtier's byte order),
    /// into page `page`: the parts of the regions that fall in that range. A layer of a
    /// layer-major block is such a range, so a load can fill the pages layer by layer.
    ///
    /// # Safety
    /// The caller holds [`KvPages::lock`] for the call, `page` passed
    /// [`KvPages::check_pages`] with `write` (with the other pages being written), `src` is a
    /// whole block and does not overlap the held buffers.
    pub unsafe fn copy_in_range(&self, src: &[u8], page: usize, lo: usize, hi: usize) {
        assert!(src.len() >= self.block_bytes && lo <= hi && hi <= self.block_bytes);
        // The first region that ends after `lo`.
        let first = self
            .starts
            .partition_point(|&st| st <= lo)
            .saturating_sub(1);
        for (r, &start) in self.regions[first..].iter().zip(&self.starts[first..]) {
            if start >= hi {
                break;
            }
            let (a, b) = (lo.max(start), hi.min(start + r.length));
            if a >= b {
                continue;
            }
            // SAFETY: `page < num_pages`, so the region's range for the page lies inside its
            // held, writable buffer (see `new`), and `a - start .. b - start` lies inside the
            // region; `a..b` lies inside `src` (asserted above), which overlaps no held buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr().add(a),
                    (r.base + r.offset + page * r.stride + (a - start)) as *mut u8,
                    b - a,
                );
            }
        }
    }

    /// Copies `pages` into `dst` (whole blocks, back to back, in kvtier's byte order).
    ///
    /// # Safety
    /// The caller holds [`KvPages::lock`] for the call, `pages` passed
    /// [`KvPages::check_pages`], and `dst` does not overlap the held buffers.
    pub unsafe fn copy_out(&self, pages: &[usize], dst: &mut [u8]) {
        assert!(dst.len() >= pages.len() * self.block_bytes);
        let mut at = dst.as_mut_ptr();
        for &p in pages {
            for r in &self.regions {
                // SAFETY: as in `copy_in`, with the roles swapped: the page range is readable
                // held memory, `at` stays inside `dst`, which overlaps no held buffer.
                unsafe {
                    copy_run(
                        (r.base + r.offset + p * r.stride) as *const u8,
                        at,
                        r.length,
                    );
                    at = at.add(r.length);
                }
            }
        }
    }

    /// Held while copying, so the buffers stay held (they are released only when the
    /// `KvPages` is dropped, which needs no lock).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeldBuffer>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Refuses a caller buffer that shares memory with the pages' buffers.
    fn check_apart(&self, held: &[HeldBuffer], other: &HeldBuffer, what: &str) -> PyResult<()> {
        let (s, e) = other.range();
        if held.iter().any(|h| {
            let (hs, he) = h.range();
            s < he && hs < e
        }) {
            return Err(PyValueError::new_err(format!(
                "{what} shares memory with the pages' buffers"
            )));
        }
        Ok(())
    }
}

/// Refuses ranges that overlap.
pub fn check_disjoint(ranges: &[(usize, usize)]) -> PyResult<()> {
    let mut sorted: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|(_, l)| *l > 0)
        .map(|&(s, l)| (s, s + l))
        .collect();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(PyValueError::new_err(
            "these page ids write overlapping memory (a page id given twice?)",
        ));
    }
    Ok(())
}

/// Whether two different pages can never share a byte: the held buffers do not overlap, and
/// on each buffer every region has one stride `S` and the regions' places inside a stride
/// (`offset mod S` .. `+ length`, within `S`) are pairwise disjoint. Page `p` of a region then
/// lies in stride window `offset / S + p` at its own place, so ranges of different pages or
/// different regions cannot meet. A layout this does not prove falls back to comparing every
/// range (`check_disjoint`).
fn pages_disjoint(regions: &[Region], held: &[HeldBuffer]) -> bool {
    let mut bufs: Vec<(usize, usize)> = held.iter().map(|h| h.range()).collect();
    bufs.sort_unstable();
    if bufs.windows(2).any(|w| w[1].0 < w[0].1) {
        return false;
    }
    let mut by_buf: HashMap<usize, Vec<&Region>> = HashMap::new();
    for r in regions {
        by_buf.entry(r.buf).or_default().push(r);
    }
    by_buf.values().all(|rs| {
        let stride = rs[0].stride;
        if rs.iter().any(|r| r.stride != stride) {
            return false;
        }
        let mut places: Vec<(usize, usize)> = rs
            .iter()
            .map(|r| (r.offset % stride, r.offset % stride + r.length))
            .collect();
        places.sort_unstable();
        places.iter().all(|&(_, end)| end <= stride) && places.windows(2).all(|w| w[0].1 <= w[1].0)
    })
}

#[pymethods]
impl KvPages {
    /// `regions`: `(buffer, offset, stride, length)` tuples in block-byte order; buffers are
    /// writable, C-contiguous (numpy arrays, CPU torch tensors, ...). Their lengths add up to
    /// a block. A buffer object named by many regions is held once, and a region that starts
    /// where the one before it ends (same buffer and stride) is merged into it.
    #[new]
    fn new(regions: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut held: Vec<HeldBuffer> = Vec::new();
        let mut by_object: HashMap<usize, usize> = HashMap::new();
        let mut out: Vec<Region> = Vec::new();
        for (j, item) in regions.try_iter()?.enumerate() {
            let (buf, offset, stride, length): (Bound<'_, PyAny>, usize, usize, usize) =
                item?.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "region {j}: expected (buffer, offset, stride, length) with \
                         non-negative ints"
                    ))
                })?;
            let idx = match by_object.get(&(buf.as_ptr() as usize)) {
                Some(&i) => i,
                None => {
                    let h = HeldBuffer::new(&buf, Access::Write, &format!("region {j}"))?;
                    held.push(h);
                    by_object.insert(buf.as_ptr() as usize, held.len() - 1);
                    held.len() - 1
                }
            };
            if length == 0 || stride < length {
                return Err(PyValueError::new_err(format!(
                    "region {j}: length {length} must be positive and at most the stride {stride}"
                )));
            }
            let (base, end) = held[idx].range();
            let buf_len = end - base;
            if offset.checked_add(length).is_none_or(|end| end > buf_len) {
                return Err(PyValueError::new_err(format!(
                    "region {j}: offset {offset} + length {length} is past the buffer's {buf_len} bytes"
                )));
            }
            let r = Region {
                buf: idx,
                base,
                buf_len,
                offset,
                stride,
                length,
            };
            match out.last_mut() {
                Some(last)
                    if last.buf == idx
                        && last.stride == stride
                        && last.offset + last.length == offset
                        && last.length + length <= stride =>
                {
                    last.length += length;
                }
                _ => out.push(r),
            }
        }
        if out.is_empty() {
            return Err(PyValueError::new_err("no regions"));
        }
        let num_pages = out
            .iter()
            .map(|r| (r.buf_len - r.offset - r.length) / r.stride + 1)
            .min()
            .unwrap_or(0);
        let block_bytes = out.iter().map(|r| r.length).sum();
        let pages_disjoint = pages_disjoint(&out, &held);
        let starts = out
            .iter()
            .scan(0usize, |at, r| {
                let start = *at;
                *at += r.length;
                Some(start)
            })
            .collect();
        Ok(Self {
            regions: out,
            starts,
            held: Mutex::new(held),
            block_bytes,
            num_pages,
            pages_disjoint,
        })
    }

    #[getter]
    fn num_regions(&self) -> usize {
        self.regions.len()
    }

    /// Copies pages `page_ids` into `out` (a writable buffer of at least `len(page_ids)`
    /// blocks), block after block in kvtier's byte order, with the GIL released: what a put
    /// sends, taken now so the pages can be reused while the put runs.
    fn gather(&self, py: Python<'_>, page_ids: Vec<usize>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check_pages(&page_ids, false)?;
        let mut dst = HeldBuffer::new(out, Access::Write, "out")?;
        let need = page_ids.len() * self.block_bytes;
        if dst.len() < need {
            return Err(PyValueError::new_err(format!(
                "out: {} bytes, {} pages need {need}",
                dst.len(),
                page_ids.len()
            )));
        }
        let held = self.lock();
        self.check_apart(&held, &dst, "out")?;
        let dst = &mut dst.as_mut_slice()[..need];
        py.detach(|| {
            // SAFETY: `held` is the lock; the pages were checked; `dst` is the caller's
            // buffer, checked not to overlap the pages' buffers.
            unsafe { self.copy_out(&page_ids, dst) }
        });
        Ok(())
    }

    /// The inverse of `gather`: blocks from `src` (at least `len(page_ids)` blocks, back to
    /// back, kvtier's byte order) into pages `page_ids`, with the GIL released.
    fn scatter(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        page_ids: Vec<usize>,
    ) -> PyResult<()> {
        self.check_pages(&page_ids, true)?;
        let src = HeldBuffer::new(src, Access::Read, "src")?;
        let need = page_ids.len() * self.block_bytes;
        if src.len() < need {
            return Err(PyValueError::new_err(format!(
                "src: {} bytes, {} pages need {need}",
                src.len(),
                page_ids.len()
            )));
        }
        let held = self.lock();
        self.check_apart(&held, &src, "src")?;
        let bytes = &src.as_slice()[..need];
        py.detach(|| {
            // SAFETY: `held` is the lock; the pages were checked for writing; `src` was
            // checked not to overlap the pages' buffers.
            unsafe { self.copy_in(bytes, &page_ids) }
        });
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "KvPages(regions={}, block_bytes={}, num_pages={})",
            self.regions.len(),
            self.block_bytes,
            self.num_pages
        )
    }
}

/// Copies `len` bytes; the sizes an engine's head rows have (64, 128, 256 bytes) as
/// fixed-size copies the compiler inlines, the rest through `memcpy`.
///
/// # Safety
/// `src..src + len` is readable, `dst..dst + len` writable, and they do not overlap.
#[inline(always)]
unsafe fn copy_run(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: per the function's contract.
    unsafe {
        match len {
            64 => dst
                .cast::<[u8; 64]>()
                .write_unaligned(src.cast::<[u8; 64]>().read_unaligned()),
            128 => dst
                .cast::<[u8; 128]>()
                .write_unaligned(src.cast::<[u8; 128]>().read_unaligned()),
            256 => dst
                .cast::<[u8; 256]>()
                .write_unaligned(src.cast::<[u8; 256]>().read_unaligned()),
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}
