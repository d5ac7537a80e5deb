//! GPU memory (feature `cuda`): device allocations and pinned host memory that regions own,
//! over the CUDA driver loaded at run time (cudarc `dynamic-loading`), so this builds and runs
//! on machines without CUDA: [`probe`] then reports "no GPU" and every GPU call returns
//! `BackendUnavailable`, never a panic (cudarc's context constructor panics without a driver,
//! so the probe runs first). The CUDA backend (`backend/cuda.rs`) copies between them.
//!
//! **Not verified on hardware**: no GPU was available where this was written.

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::error::{Result, TransferError};

pub(crate) fn unavailable(reason: impl Into<String>) -> TransferError {
    TransferError::BackendUnavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

/// Number of CUDA devices, or why CUDA cannot be used here ("no GPU").
pub fn probe() -> Result<usize> {
    // SAFETY: only checks whether the driver library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "no GPU: the CUDA driver (libcuda) is not installed",
        ));
    }
    result::init().map_err(|e| unavailable(format!("CUDA driver init failed: {e}")))?;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(unavailable("no GPU: the driver reports no CUDA device")),
        Err(e) => Err(unavailable(format!("cannot count CUDA devices: {e}"))),
    }
}

pub(crate) fn context(device: usize) -> Result<Arc<CudaContext>> {
    let n = probe()?;
    if device >= n {
        return Err(unavailable(format!(
            "device {device} requested, {n} present"
        )));
    }
    CudaContext::new(device).map_err(|e| unavailable(format!("CUDA context: {e}")))
}

/// Device memory owned by a region.
pub(crate) struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: u64,
}

impl DeviceBuffer {
    pub(crate) fn alloc(device: usize, len: u64) -> Result<Self> {
        let ctx = context(device)?;
        let bytes = usize::try_from(len).map_err(|_| unavailable("length too large"))?;
        if bytes == 0 {
            return Err(TransferError::InvalidDescriptor {
                index: 0,
                reason: "cannot register a zero-length region".into(),
            });
        }
        // SAFETY: `CudaContext::new` made the context current on this thread; the
        // allocation is freed exactly once, in Drop.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| unavailable(format!("cannot allocate {len} bytes on the GPU: {e}")))?;
        Ok(Self { ctx, ptr, len })
    }

    pub(crate) fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync in this context and is freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Pinned (page-locked) host memory owned by a region.
pub(crate) struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
}

// SAFETY: the pointer is an address of memory this value owns; access goes through the
// region's contract.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn alloc(len: u64) -> Result<Self> {
        let ctx = context(0)?;
        let bytes = usize::try_from(len).map_err(|_| unavailable("length too large"))?;
        // SAFETY: the context is current on this thread; the memory is zeroed below before
        // anyone reads it and freed once, in Drop.
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| unavailable(format!("cannot pin {len} bytes of host memory: {e}")))?
            as *mut u8;
        // SAFETY: `ptr` is valid for `bytes` writable bytes (just allocated).
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(Self { ctx, ptr })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_host and is freed only here.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}
