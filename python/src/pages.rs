//! `KvPages`: where blocks live in an engine's paged KV cache, so a get scatters each kvtier
//! block straight into the engine's pages and a put gathers it from them, by page (block) id.
//!
//! A kvtier block is one byte string (layer-major: `[layer][K|V][...]`). An engine such as vLLM
//! keeps one tensor per layer whose page `p` holds that layer's K and V for one block. A
//! `KvPages` lists *regions* in the order of the block's bytes: region `j` is `(buffer,
//! offset, stride, length)`, and for page `p` the block's next `length` bytes live at
//! `buffer[offset + p * stride ..][..length]`.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::{Access, HeldBuffer};

struct Region {
    /// Address of the held buffer's first byte and its length.
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
    held: Mutex<Vec<HeldBuffer>>,
    #[pyo3(get)]
    pub(crate) block_bytes: usize,
    /// Pages every region can address (the smallest count).
    #[pyo3(get)]
    num_pages: usize,
}

impl KvPages {
    /// Destination (or source) address ranges of the given pages, region by region and page by
    /// page, in block-byte order: block `i`'s bytes are `ranges[i * regions ..][..regions]`.
    pub fn ranges(&self, pages: &[usize]) -> PyResult<Vec<(usize, usize)>> {
        let mut out = Vec::with_capacity(pages.len() * self.regions.len());
        for (i, &p) in pages.iter().enumerate() {
            if p >= self.num_pages {
                return Err(PyValueError::new_err(format!(
                    "page id {p} (block {i}) out of range: these pages hold {}",
                    self.num_pages
                )));
            }
            for r in &self.regions {
                // In range by the `num_pages` computation in `new`.
                let start = r.base + r.offset + p * r.stride;
                out.push((start, r.length));
            }
        }
        Ok(out)
    }

    /// Refuses page lists whose destinations overlap (the same page twice).
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

    /// Held while copying, so the buffers stay held (they are released only when the
    /// `KvPages` is dropped, which needs no lock).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeldBuffer>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn region_count(&self) -> usize {
        self.regions.len()
    }
}

#[pymethods]
impl KvPages {
    /// `regions`: `(buffer, offset, stride, length)` tuples in block-byte order; buffers are
    /// writable, C-contiguous (numpy arrays, CPU torch tensors, ...). Their lengths add up to
    /// a block.
    #[new]
    fn new(regions: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut held = Vec::new();
        let mut out = Vec::new();
        for (j, item) in regions.try_iter()?.enumerate() {
            let (buf, offset, stride, length): (Bound<'_, PyAny>, usize, usize, usize) =
                item?.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "region {j}: expected (buffer, offset, stride, length) with \
                         non-negative ints"
                    ))
                })?;
            let mut h = HeldBuffer::new(&buf, Access::Write, &format!("region {j}"))?;
            if length == 0 || stride < length {
                return Err(PyValueError::new_err(format!(
                    "region {j}: length {length} must be positive and at most the stride {stride}"
                )));
            }
            let buf_len = h.len();
            let base = h.as_mut_slice().as_mut_ptr() as usize;
            if offset.checked_add(length).is_none_or(|end| end > buf_len) {
                return Err(PyValueError::new_err(format!(
                    "region {j}: offset {offset} + length {length} is past the buffer's {buf_len} bytes"
                )));
            }
            held.push(h);
            out.push(Region {
                base,
                buf_len,
                offset,
                stride,
                length,
            });
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
        Ok(Self {
            regions: out,
            held: Mutex::new(held),
            block_bytes,
            num_pages,
        })
    }

    #[getter]
    fn num_regions(&self) -> usize {
        self.regions.len()
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

/// Copies `src` (whole blocks, back to back) into the page ranges.
///
/// # Safety
/// Every range is inside a buffer held (writable) for the duration of the call, and the
/// ranges are pairwise disjoint and disjoint from `src`.
pub unsafe fn scatter(src: &[u8], ranges: &[(usize, usize)]) {
    let mut at = 0;
    for &(dst, len) in ranges {
        let chunk = &src[at..at + len];
        // SAFETY: per the function's contract, `dst..dst + len` is writable memory no one
        // else touches during the call, and it does not overlap `chunk`.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst as *mut u8, len) };
        at += len;
    }
}

/// Copies the page ranges into `dst` (whole blocks, back to back).
///
/// # Safety
/// Every range is inside a buffer held for the duration of the call and does not overlap
/// `dst`.
pub unsafe fn gather(ranges: &[(usize, usize)], dst: &mut [u8]) {
    let mut at = 0;
    for &(src, len) in ranges {
        // SAFETY: per the function's contract, `src..src + len` is readable held memory
        // that does not overlap `dst`.
        let chunk = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
        dst[at..at + len].copy_from_slice(chunk);
        at += len;
    }
}
