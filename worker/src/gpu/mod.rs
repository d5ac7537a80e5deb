//! The GPU path (feature `cuda`): the model's forward on an NVIDIA GPU, with the paged KV pool
//! in device memory and attention reading it in place.
//!
//! It runs on our cudarc configuration (the driver API, `dynamic-loading`): the build needs no
//! CUDA toolkit, and a machine needs only the CUDA driver. The kernels (`kernels.cu`, f32) ship
//! as PTX compiled by NVRTC (`kernels.ptx`, checked in; a test compiles the source again and
//! compares, see [`compile_kernels`]); the driver JIT-compiles the PTX for the GPU it finds.
//! candle's own CUDA backend is not used: it compiles its kernels with nvcc at build time and
//! links cudarc dynamically, which clashes with the `dynamic-loading` the server's HBM tier and
//! the transfer library use in the same build.
//!
//! What the GPU path covers: the forward (prefill and decode), the KV pool on the device,
//! prefix blocks loaded from the sidecar into it and new blocks read back from it for storing
//! (copies through host memory, [`DevicePool`]). Disaggregation needs a host pool (the
//! transfer backends write host memory) and refuses a GPU model.
//!
//! Every device operation goes through [`Gpu`], which has two backends: the CUDA driver, and an
//! **emulator** ([`Gpu::emulated`]): a shared library built from the same `kernels.cu` with a
//! CPU emulation of CUDA (`tests/emu/`), where "device memory" is host memory and a launch runs
//! every CUDA thread as a fiber with its own stack, switching at barriers. The host code here (allocation, copies, launch shapes
//! and arguments, synchronisation) is the same for both, so the tests run the whole GPU forward
//! on the CPU and compare it with candle's. Every launch is also checked against the kernel's
//! parameter list, which a test checks against the PTX.
//!
//! **Verification:** no GPU was available where this was written; see `docs/worker.md`.

use std::ffi::{CString, c_char, c_int, c_void};
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};

/// The kernels' CUDA source.
pub const KERNELS_CU: &str = include_str!("kernels.cu");
/// The kernels compiled by NVRTC ([`compile_kernels`]), as loaded at run time.
pub const KERNELS_PTX: &str = include_str!("kernels.ptx");
/// The virtual architecture the PTX targets: Volta and every later GPU can JIT it.
pub const PTX_ARCH: &str = "compute_70";

/// Largest head dimension the attention kernel takes (one thread per dimension).
const MAX_HEAD_DIM: usize = 1024;
/// Keys per attention tile (`ATT_KEYS` in the kernel).
const ATT_KEYS: usize = 64;

fn gpu_err(what: &str, e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Gpu {
        reason: format!("{what}: {e}"),
    }
}

/// The NVRTC that made [`KERNELS_PTX`]: 11.8 writes PTX ISA 7.8, which drivers from R520
/// (CUDA 11.8) on load; NVRTC 12.x would write an ISA that R535 drivers, common in clusters,
/// refuse.
pub const NVRTC_VERSION: (i32, i32) = (11, 8);

/// The version of the NVRTC on the library path, `None` when there is none.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: only checks whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; nvrtcVersion writes the two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// Compiles [`KERNELS_CU`] with the NVRTC on the library path (`libnvrtc.so.11` or `.12`,
/// loaded at run time) and returns the PTX text. `Ok(None)` when there is none.
pub fn compile_kernels() -> Result<Option<String>> {
    if nvrtc_version().is_none() {
        return Ok(None);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(PTX_ARCH),
        name: Some("kernels.cu".to_owned()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS_CU, opts)
        .map_err(|e| gpu_err("NVRTC compiling kernels.cu", e))?;
    Ok(Some(ptx.to_src()))
}

/// Number of CUDA devices, or why the GPU path cannot run here.
pub fn probe() -> Result<usize> {
    // SAFETY: only checks whether the driver library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(WorkerError::Gpu {
            reason: "no GPU: the CUDA driver (libcuda) is not installed".to_owned(),
        });
    }
    result::init().map_err(|e| gpu_err("CUDA driver init", e))?;
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err(WorkerError::Gpu {
            reason: "no GPU: the driver reports no CUDA device".to_owned(),
        }),
        Err(e) => Err(gpu_err("counting CUDA devices", e)),
    }
}

/// The kernels, in the order of [`SIGNATURES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Embed,
    RmsNorm,
    MatmulNt,
    GemvNt,
    Rope,
    KvWrite,
    Attention,
    SiluMul,
}

const ALL_KERNELS: [Kernel; 8] = [
    Kernel::Embed,
    Kernel::RmsNorm,
    Kernel::MatmulNt,
    Kernel::GemvNt,
    Kernel::Rope,
    Kernel::KvWrite,
    Kernel::Attention,
    Kernel::SiluMul,
];

/// Each kernel's name and parameter types as the PTX declares them (pointers and `long long`
/// are `.u64`, `int` is `.u32`, `float` is `.f32`). Every launch is checked against this, and a
/// test checks this against `kernels.ptx`.
const SIGNATURES: [(&str, &[&str]); 8] = [
    ("embed", &[".u64", ".u64", ".u64", ".u32"]),
    ("rms_norm", &[".u64", ".u64", ".u64", ".u32", ".f32"]),
    (
        "matmul_nt",
        &[".u64", ".u64", ".u64", ".u32", ".u32", ".u32", ".u32"],
    ),
    ("gemv_nt", &[".u64", ".u64", ".u64", ".u32", ".u32", ".u32"]),
    ("rope", &[".u64", ".u64", ".u64", ".u32", ".u32", ".u32"]),
    (
        "kv_write",
        &[
            ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32", ".u32", ".u32", ".u64",
        ],
    ),
    (
        "attention",
        &[
            ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32", ".u32", ".u32", ".u32", ".u64",
            ".f32",
        ],
    ),
    ("silu_mul", &[".u64", ".u64", ".u64"]),
];

impl Kernel {
    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        SIGNATURES[self.index()].0
    }
}

/// A kernel argument, by value.
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// A device address.
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn ptx_type(self) -> &'static str {
        match self {
            Arg::Ptr(_) | Arg::I64(_) => ".u64",
            Arg::I32(_) => ".u32",
            Arg::F32(_) => ".f32",
        }
    }

    /// The value's bytes in the low end of a u64 slot (little-endian: a pointer to the slot
    /// is a pointer to the value, as a launch's parameter array needs).
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => u64::from(v as u32),
            Arg::I64(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!("kernel arguments are passed in little-endian u64 slots");

/// `kvtier_emu_launch(name, grid[3], block[3], shared_bytes, params) -> 0 on success`.
type EmuLaunch =
    unsafe extern "C" fn(*const c_char, *const u32, *const u32, u32, *mut *mut c_void) -> c_int;

enum Backend {
    Cuda {
        ctx: Arc<CudaContext>,
        module: sys::CUmodule,
        functions: Vec<sys::CUfunction>,
    },
    Emulated {
        launch: EmuLaunch,
        _lib: libloading::Library,
    },
}

/// One GPU (or the emulator): every allocation, copy and launch of the GPU path.
pub struct Gpu {
    label: String,
    backend: Backend,
    /// A sticky CUDA error (a kernel fault): the context is unusable for the rest of the
    /// process, so every later operation fails at once with this, and `/health` reports it.
    fault: std::sync::Mutex<Option<String>>,
}

/// Driver errors after which a CUDA context cannot be used again (a kernel fault).
const STICKY_ERRORS: [sys::CUresult; 8] = [
    sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
    sys::CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
    sys::CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
    sys::CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR,
    sys::CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE,
    sys::CUresult::CUDA_ERROR_INVALID_PC,
    sys::CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
];

/// The driver version the PTX needs: CUDA 11.8 (R520), for PTX ISA 7.8.
const MIN_DRIVER_VERSION: i32 = 11080;

// SAFETY: the CUDA handles (module, functions) are plain driver handles, valid in the
// context on any thread once it is bound (every operation binds it first); the emulator's
// entry point serialises launches itself.
unsafe impl Send for Gpu {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.label)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Backend::Cuda { ctx, module, .. } = &self.backend
            && ctx.bind_to_thread().is_ok()
        {
            // SAFETY: the module was loaded in this context and is unloaded only here; the
            // buffers that used it hold an Arc to this Gpu, so no launch is pending.
            let _ = unsafe { result::module::unload(*module) };
        }
    }
}

impl Gpu {
    /// Opens CUDA device `ordinal` and loads the kernels' PTX.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        let n = probe()?;
        if ordinal >= n {
            return Err(WorkerError::Gpu {
                reason: format!("cuda:{ordinal} requested, {n} device(s) present"),
            });
        }
        let mut version = 0;
        // SAFETY: the driver is loaded and initialised (probe); writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| gpu_err("reading the CUDA driver version", e))?;
        if version < MIN_DRIVER_VERSION {
            return Err(WorkerError::Gpu {
                reason: format!(
                    "the CUDA driver supports CUDA {}.{}; the kernels' PTX (ISA 7.8) needs 11.8 or \
                     later (driver R520+)",
                    version / 1000,
                    version % 1000 / 10
                ),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| gpu_err("CUDA context", e))?;
        ctx.bind_to_thread()
            .map_err(|e| gpu_err("binding the CUDA context", e))?;
        let module = load_ptx(KERNELS_PTX)?;
        let mut functions = Vec::with_capacity(ALL_KERNELS.len());
        for k in ALL_KERNELS {
            let name = CString::new(k.name()).expect("kernel names have no NUL");
            // SAFETY: `module` is loaded in the current context.
            let f = unsafe { result::module::get_function(module, name) }
                .map_err(|e| gpu_err(&format!("kernel {}", k.name()), e))?;
            functions.push(f);
        }
        Ok(Arc::new(Self {
            label: format!("cuda:{ordinal}"),
            backend: Backend::Cuda {
                ctx,
                module,
                functions,
            },
            fault: std::sync::Mutex::new(None),
        }))
    }

    /// The emulator: `library` is a shared library built from `kernels.cu` and the CPU
    /// emulation of CUDA in `worker/tests/emu/` (see `tests/gpu.rs`), exporting
    /// `kvtier_emu_launch`. For tests: it runs the GPU path's host code unchanged on the CPU.
    ///
    /// # Safety
    /// `library` must be that library: loading runs its initialisers, and its
    /// `kvtier_emu_launch` is called with the signature above.
    pub unsafe fn emulated(library: &Path) -> Result<Arc<Self>> {
        // SAFETY: the caller vouches for the library (above).
        let lib = unsafe { libloading::Library::new(library) }
            .map_err(|e| gpu_err(&format!("loading {}", library.display()), e))?;
        // SAFETY: the symbol has the EmuLaunch signature (the caller's promise); the function
        // pointer is used only while `lib`, stored beside it, is loaded.
        let launch = unsafe { lib.get::<EmuLaunch>(b"kvtier_emu_launch\0") }
            .map(|s| *s)
            .map_err(|e| gpu_err(&format!("{}: kvtier_emu_launch", library.display()), e))?;
        Ok(Arc::new(Self {
            label: "emulated".to_owned(),
            backend: Backend::Emulated { launch, _lib: lib },
            fault: std::sync::Mutex::new(None),
        }))
    }

    /// `cuda:N`, or `emulated`.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The CUDA ordinal (`None` for the emulator).
    pub fn ordinal(&self) -> Option<usize> {
        self.label.strip_prefix("cuda:")?.parse().ok()
    }

    /// The sticky error that made this GPU unusable, if one happened.
    pub fn fault(&self) -> Option<String> {
        self.fault.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn bind(&self) -> Result<()> {
        if let Some(f) = self.fault() {
            return Err(WorkerError::Gpu {
                reason: format!(
                    "{} faulted earlier ({f}); its CUDA context stays unusable until the worker \
                     restarts",
                    self.label
                ),
            });
        }
        if let Backend::Cuda { ctx, .. } = &self.backend {
            let r = ctx.bind_to_thread();
            self.cuda("binding the CUDA context", r)?;
        }
        Ok(())
    }

    /// `r` as a worker result; a sticky error also marks the GPU faulted. (A kernel fault is
    /// reported by whichever call comes next; run with CUDA_LAUNCH_BLOCKING=1 to see which
    /// kernel it was.)
    fn cuda<T>(&self, what: &str, r: std::result::Result<T, result::DriverError>) -> Result<T> {
        r.map_err(|e| {
            // The error's code name (its Display asks the driver for a description).
            let code = format!("{:?}", e.0);
            if STICKY_ERRORS.contains(&e.0) {
                let mut f = self.fault.lock().unwrap_or_else(|p| p.into_inner());
                f.get_or_insert_with(|| format!("{what}: {code}"));
                tracing::error!(gpu = %self.label, error = %code, "{what}: the GPU faulted");
            }
            gpu_err(what, code)
        })
    }

    /// `bytes` zeroed bytes of device memory.
    fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuf> {
        let bytes = bytes.max(4);
        let ptr = match &self.backend {
            Backend::Cuda { .. } => {
                self.bind()?;
                // SAFETY: the context is current; the allocation is freed once, in Drop.
                let r = unsafe { result::malloc_sync(bytes) };
                let ptr = self.cuda(&format!("allocating {bytes} bytes on the GPU"), r)?;
                // SAFETY: `ptr` holds `bytes` bytes.
                let r = unsafe { result::memset_d8_sync(ptr, 0, bytes) };
                if let Err(e) = self.cuda("zeroing GPU memory", r) {
                    // SAFETY: allocated just above, not shared.
                    let _ = unsafe { result::free_sync(ptr) };
                    return Err(e);
                }
                ptr
            }
            Backend::Emulated { .. } => {
                let layout = host_layout(bytes)?;
                // SAFETY: the layout has a non-zero size; freed once, in Drop, with it.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(WorkerError::Gpu {
                        reason: format!("emulator: cannot allocate {bytes} bytes"),
                    });
                }
                p as u64
            }
        };
        Ok(DeviceBuf {
            gpu: self.clone(),
            ptr,
            bytes,
        })
    }

    /// Device memory holding `data`.
    fn upload<T: Copy>(self: &Arc<Self>, data: &[T]) -> Result<DeviceBuf> {
        let mut buf = self.alloc(std::mem::size_of_val(data))?;
        // SAFETY: `T: Copy` values are plain bytes to copy (we upload f32 and u32).
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        buf.write(0, bytes)?;
        Ok(buf)
    }

    /// Runs `kernel` over `grid` blocks of `block` threads. The arguments must match the
    /// kernel's parameters ([`SIGNATURES`]); a mismatch is an error, never a launch.
    fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        let want = SIGNATURES[kernel.index()].1;
        let got: Vec<&str> = args.iter().map(|a| a.ptx_type()).collect();
        if got != want {
            return Err(WorkerError::Gpu {
                reason: format!(
                    "kernel {}: launched with parameters {got:?}, it takes {want:?}",
                    kernel.name()
                ),
            });
        }
        let threads = u64::from(block.0) * u64::from(block.1) * u64::from(block.2);
        if grid.0 == 0
            || grid.0 > i32::MAX as u32
            || !(1..=65_535).contains(&grid.1)
            || !(1..=65_535).contains(&grid.2)
            || !(1..=1024).contains(&threads)
        {
            return Err(WorkerError::Gpu {
                reason: format!(
                    "kernel {}: grid {grid:?} of {block:?} is outside CUDA's limits (the shapes are \
                     too large for this model or prompt)",
                    kernel.name()
                ),
            });
        }
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut u64).cast::<c_void>())
            .collect();
        match &self.backend {
            Backend::Cuda { functions, .. } => {
                self.bind()?;
                // SAFETY: the parameter array matches the kernel's PTX parameters in number
                // and width (checked above, and SIGNATURES against the PTX by a test); each
                // pointer argument is a live device allocation of this context with the
                // extent the kernel reads (the callers below size them); the default stream.
                let r = unsafe {
                    result::launch_kernel(
                        functions[kernel.index()],
                        grid,
                        block,
                        shared,
                        std::ptr::null_mut(),
                        &mut params,
                    )
                };
                self.cuda(&format!("launching {}", kernel.name()), r)
            }
            Backend::Emulated { launch, .. } => {
                let name = CString::new(kernel.name()).expect("kernel names have no NUL");
                let (g, b) = ([grid.0, grid.1, grid.2], [block.0, block.1, block.2]);
                // SAFETY: as for CUDA; the emulator reads each argument through its pointer,
                // and "device" addresses are host allocations of this backend.
                let rc = unsafe {
                    launch(
                        name.as_ptr(),
                        g.as_ptr(),
                        b.as_ptr(),
                        shared,
                        params.as_mut_ptr(),
                    )
                };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(WorkerError::Gpu {
                        reason: format!("emulator: launching {} failed ({rc})", kernel.name()),
                    })
                }
            }
        }
    }

    /// Waits for every queued launch and copy.
    fn synchronize(&self) -> Result<()> {
        if let Backend::Cuda { .. } = &self.backend {
            self.bind()?;
            let r = result::ctx::synchronize();
            self.cuda("GPU synchronize", r)?;
        }
        Ok(())
    }
}

/// Loads PTX text as a module of the current context, with the JIT's error log in the error.
fn load_ptx(ptx: &str) -> Result<sys::CUmodule> {
    let image = CString::new(ptx).map_err(|e| gpu_err("kernels.ptx", e))?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module = std::ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated PTX image; the options array and the values array
    // have the same length, the log buffer outlives the call and its size is given; the
    // context is current (the caller bound it).
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    r.result().map_err(|e| {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        let log = String::from_utf8_lossy(&log[..end]);
        gpu_err(
            "loading the kernels' PTX",
            format!("{e}; JIT log: {}", log.trim()),
        )
    })?;
    Ok(module)
}

fn host_layout(bytes: usize) -> Result<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(bytes, 64).map_err(|e| gpu_err("emulator allocation", e))
}

/// Device memory: freed when dropped.
struct DeviceBuf {
    gpu: Arc<Gpu>,
    ptr: u64,
    bytes: usize,
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        match &self.gpu.backend {
            Backend::Cuda { .. } => {
                if self.gpu.bind().is_ok() {
                    // Launches using the buffer may still be queued: let them finish.
                    let _ = self.gpu.synchronize();
                    // SAFETY: allocated by malloc_sync in this context, freed only here.
                    let _ = unsafe { result::free_sync(self.ptr) };
                }
            }
            Backend::Emulated { .. } => {
                if let Ok(layout) = host_layout(self.bytes) {
                    // SAFETY: allocated by alloc_zeroed with this layout, freed only here;
                    // emulated launches are synchronous, so none still uses it.
                    unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout) };
                }
            }
        }
    }
}

impl DeviceBuf {
    fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }

    /// The address `offset` floats in (for a row of an activation).
    fn arg_at_f32(&self, offset: usize) -> Arg {
        debug_assert!((offset + 1) * 4 <= self.bytes);
        Arg::Ptr(self.ptr + 4 * offset as u64)
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(WorkerError::Gpu {
                reason: format!(
                    "copy of {len} bytes at {offset} outside a {}-byte buffer",
                    self.bytes
                ),
            }),
        }
    }

    /// Copies `out.len()` bytes at `offset` to the host, after every queued launch.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        match &self.gpu.backend {
            Backend::Cuda { .. } => {
                self.gpu.bind()?;
                // SAFETY: the range is inside this allocation (checked); the context is bound.
                // A synchronous copy on the legacy stream runs after every kernel launched
                // before it and returns when the bytes are in `out`.
                let r = unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) };
                self.gpu.cuda("copying from the GPU", r)
            }
            Backend::Emulated { .. } => {
                // SAFETY: the range is inside this live allocation (checked); emulated
                // launches are synchronous, so nothing writes it now.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (self.ptr as *const u8).add(offset),
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
                Ok(())
            }
        }
    }

    /// Copies `src` to `offset`, after every queued launch.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        match &self.gpu.backend {
            Backend::Cuda { .. } => {
                self.gpu.bind()?;
                // SAFETY: as in `read`; the copy is ordered before every later launch, and
                // returns once `src` has been staged, so the caller may reuse it.
                let r = unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) };
                self.gpu.cuda("copying to the GPU", r)
            }
            Backend::Emulated { .. } => {
                // SAFETY: as in `read`; `&mut self` makes this the only writer here.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        (self.ptr as *mut u8).add(offset),
                        src.len(),
                    )
                };
                Ok(())
            }
        }
    }

    fn read_f32(&self) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; self.bytes];
        self.read(0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// The KV pool's device memory: copies in and out go through host memory.
pub struct DevicePool {
    buf: DeviceBuf,
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevicePool({} bytes on {:?})",
            self.buf.bytes, self.buf.gpu
        )
    }
}

impl DevicePool {
    /// `len` zeroed bytes on `gpu`.
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        Ok(Self {
            buf: gpu.alloc(len)?,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.buf.gpu
    }

    /// Copies `out.len()` bytes at `start` to the host (after every kernel queued before).
    pub fn read(&self, start: usize, out: &mut [u8]) -> Result<()> {
        self.buf.read(start, out)
    }

    /// Copies `src` to `start` (before every kernel queued after).
    pub fn write(&mut self, start: usize, src: &[u8]) -> Result<()> {
        self.buf.write(start, src)
    }
}

struct GpuLayer {
    input_norm: DeviceBuf,
    q: DeviceBuf,
    k: DeviceBuf,
    v: DeviceBuf,
    o: DeviceBuf,
    post_norm: DeviceBuf,
    gate: DeviceBuf,
    up: DeviceBuf,
    down: DeviceBuf,
}

/// The model's weights on a GPU (f32) and its forward there.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    cfg: ModelConfig,
    embed: DeviceBuf,
    layers: Vec<GpuLayer>,
    norm: DeviceBuf,
    /// `None`: tied to the embeddings.
    lm_head: Option<DeviceBuf>,
    cos: DeviceBuf,
    sin: DeviceBuf,
    /// Reused between forwards (one forward at a time: the engine is behind a lock).
    scratch: std::sync::Mutex<Option<Scratch>>,
}

/// The paged KV a forward reads and writes: the pool, its geometry and the sequence's
/// blocks in order.
pub(crate) struct PagedKv<'a> {
    pub pool: &'a DevicePool,
    pub block_tokens: usize,
    pub block_bytes: usize,
    pub blocks: &'a [u32],
}

/// What the forward calls around each layer, on the thread running it; an error aborts the
/// forward. The model adapts its `LayerHook` (which sees the whole cache) to this, so this
/// module needs neither the model nor the cache.
pub(crate) trait LayerEvents {
    /// Before layer `layer` reads or writes the pool.
    fn before_layer(&mut self, layer: usize) -> Result<()>;
    /// After layer `layer` wrote the new positions' K and V (before its attention runs).
    fn after_kv_write(&mut self, layer: usize) -> Result<()>;
    /// Whether `after_kv_write` reads the pool's bytes (the forward then waits for each
    /// layer's KV write before calling it).
    fn reads_kv(&self) -> bool;
}

/// Host copies of a model's weights, as [`GpuModel::upload`] takes them (row-major f32).
pub(crate) struct HostWeights<'a> {
    pub embed: &'a candle_core::Tensor,
    /// Per layer: input norm, q, k, v, o, post norm, gate, up, down.
    pub layers: Vec<[&'a candle_core::Tensor; 9]>,
    pub norm: &'a candle_core::Tensor,
    pub lm_head: Option<&'a candle_core::Tensor>,
    pub cos: &'a candle_core::Tensor,
    pub sin: &'a candle_core::Tensor,
}

/// Buffers of a forward of up to `tokens` tokens over a block table of up to `blocks`
/// blocks: kept by the model and grown when a forward needs more, so a decode step allocates
/// nothing.
struct Scratch {
    tokens: usize,
    blocks: usize,
    ids: DeviceBuf,
    table: DeviceBuf,
    x: DeviceBuf,
    h: DeviceBuf,
    q: DeviceBuf,
    k: DeviceBuf,
    v: DeviceBuf,
    att: DeviceBuf,
    gate: DeviceBuf,
    up: DeviceBuf,
    logits: DeviceBuf,
}

fn grid1(x: usize) -> (u32, u32, u32) {
    (x as u32, 1, 1)
}

fn i32_of(n: usize) -> Result<Arg> {
    i32::try_from(n)
        .map(Arg::I32)
        .map_err(|_| WorkerError::Gpu {
            reason: format!("{n} does not fit the kernels' 32-bit sizes"),
        })
}

impl GpuModel {
    pub(crate) fn upload(gpu: &Arc<Gpu>, cfg: &ModelConfig, w: HostWeights<'_>) -> Result<Self> {
        let up = |t: &candle_core::Tensor| -> Result<DeviceBuf> {
            let data = t
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            gpu.upload(&data)
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for [input_norm, q, k, v, o, post_norm, gate, upw, down] in &w.layers {
            layers.push(GpuLayer {
                input_norm: up(input_norm)?,
                q: up(q)?,
                k: up(k)?,
                v: up(v)?,
                o: up(o)?,
                post_norm: up(post_norm)?,
                gate: up(gate)?,
                up: up(upw)?,
                down: up(down)?,
            });
        }
        Ok(Self {
            gpu: gpu.clone(),
            cfg: cfg.clone(),
            embed: up(w.embed)?,
            layers,
            norm: up(w.norm)?,
            lm_head: w.lm_head.map(up).transpose()?,
            cos: up(w.cos)?,
            sin: up(w.sin)?,
            scratch: std::sync::Mutex::new(None),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `c = a · wᵀ` (or `c += ...`), `a` `[m][k]` (from float `a_row * k`), `w` `[n][k]`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        a: &DeviceBuf,
        a_row: usize,
        w: &DeviceBuf,
        c: &DeviceBuf,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (a, acc) = (a.arg_at_f32(a_row * k), Arg::I32(i32::from(accumulate)));
        if m == 1 {
            let args = [a, w.arg(), c.arg(), i32_of(n)?, i32_of(k)?, acc];
            self.gpu
                .launch(Kernel::GemvNt, grid1(n.div_ceil(8)), (256, 1, 1), 0, &args)
        } else {
            let args = [a, w.arg(), c.arg(), i32_of(m)?, i32_of(n)?, i32_of(k)?, acc];
            let grid = (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1);
            self.gpu
                .launch(Kernel::MatmulNt, grid, (16, 16, 1), 0, &args)
        }
    }

    /// RMSNorm of `rows` rows of `x` from row `row`, into `out`.
    fn rms_norm(
        &self,
        x: &DeviceBuf,
        row: usize,
        rows: usize,
        w: &DeviceBuf,
        out: &DeviceBuf,
    ) -> Result<()> {
        let h = self.cfg.hidden_size;
        let args = [
            x.arg_at_f32(row * h),
            w.arg(),
            out.arg(),
            i32_of(h)?,
            Arg::F32(self.cfg.rms_norm_eps as f32),
        ];
        // blockDim 256: a multiple of 32, as block_sum needs.
        self.gpu
            .launch(Kernel::RmsNorm, grid1(rows), (256, 1, 1), 0, &args)
    }

    fn rope(&self, x: &DeviceBuf, tokens: usize, heads: usize, start_pos: usize) -> Result<()> {
        let args = [
            x.arg(),
            self.cos.arg(),
            self.sin.arg(),
            i32_of(heads)?,
            i32_of(self.cfg.head_dim)?,
            i32_of(start_pos)?,
        ];
        let grid = (tokens as u32, heads as u32, 1);
        self.gpu.launch(Kernel::Rope, grid, (64, 1, 1), 0, &args)
    }

    /// Buffers for `t` tokens over `blocks` blocks: the kept ones when large enough, else
    /// new ones (grown to at least twice the old size, so a growing sequence reallocates
    /// rarely).
    fn scratch(&self, slot: &mut Option<Scratch>, t: usize, blocks: usize) -> Result<()> {
        if slot
            .as_ref()
            .is_some_and(|s| s.tokens >= t && s.blocks >= blocks)
        {
            return Ok(());
        }
        let (old_t, old_b) = slot.as_ref().map_or((0, 0), |s| (s.tokens, s.blocks));
        let t = t.max(old_t);
        let blocks = blocks.max(2 * old_b).max(16);
        // Free the old buffers before allocating the new ones.
        *slot = None;
        let c = &self.cfg;
        let f = |n: usize| self.gpu.alloc(n * 4);
        *slot = Some(Scratch {
            tokens: t,
            blocks,
            ids: f(t)?,
            table: f(blocks)?,
            x: f(t * c.hidden_size)?,
            h: f(t * c.hidden_size)?,
            q: f(t * c.num_heads * c.head_dim)?,
            k: f(t * c.num_kv_heads * c.head_dim)?,
            v: f(t * c.num_kv_heads * c.head_dim)?,
            att: f(t * c.num_heads * c.head_dim)?,
            gate: f(t * c.intermediate_size)?,
            up: f(t * c.intermediate_size)?,
            logits: f(c.vocab_size)?,
        });
        Ok(())
    }

    /// The forward of `tokens` at `start_pos` over the paged KV `kv` (the model's
    /// `forward_hooked` checked the tokens, the context and that every block of `kv.blocks` is
    /// allocated), calling `events` around each layer. `kv.pool` must be on this model's GPU.
    pub(crate) fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        kv: PagedKv<'_>,
        events: &mut dyn LayerEvents,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let t = tokens.len();
        let (h, nh, nkv, hd, inter, vocab) = (
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        );
        if hd > MAX_HEAD_DIM || hd % 2 != 0 {
            return Err(WorkerError::Gpu {
                reason: format!(
                    "head_dim {hd}: the GPU path takes even head dims up to {MAX_HEAD_DIM}"
                ),
            });
        }
        if !Arc::ptr_eq(kv.pool.gpu(), &self.gpu) {
            return Err(WorkerError::Gpu {
                reason: "the KV pool is on another GPU than the model".to_owned(),
            });
        }
        let bt = kv.block_tokens;
        // The kernels index the pool with the table's blocks: never past the ones given.
        let covered = kv.blocks.len() * bt;
        if covered < start_pos + t {
            return Err(WorkerError::MissingPrefix {
                start_pos,
                covered_tokens: covered,
            });
        }
        let block_floats = Arg::I64((kv.block_bytes / 4) as i64);
        let mut slot = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.scratch(&mut slot, t, kv.blocks.len())?;
        let s = slot.as_mut().expect("scratch was just made");
        let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        s.ids.write(0, &ids)?;
        let blocks: Vec<u8> = kv.blocks.iter().flat_map(|b| b.to_le_bytes()).collect();
        s.table.write(0, &blocks)?;
        let (ids, tbl) = (&s.ids, &s.table);
        let s = &*s;
        let g = &self.gpu;

        let args = [ids.arg(), self.embed.arg(), s.x.arg(), i32_of(h)?];
        g.launch(Kernel::Embed, grid1(t), (256, 1, 1), 0, &args)?;

        let scale = Arg::F32(1.0 / (hd as f32).sqrt());
        let att_threads = hd.next_multiple_of(32).max(64) as u32;
        let att_shared = ((hd + ATT_KEYS) * 4) as u32;
        let (pos, bt_a, nkv_a, hd_a, nh_a) = (
            i32_of(start_pos)?,
            i32_of(bt)?,
            i32_of(nkv)?,
            i32_of(hd)?,
            i32_of(nh)?,
        );
        for (li, w) in self.layers.iter().enumerate() {
            events.before_layer(li)?;
            self.rms_norm(&s.x, 0, t, &w.input_norm, &s.h)?;
            self.linear(&s.h, 0, &w.q, &s.q, t, nh * hd, h, false)?;
            self.linear(&s.h, 0, &w.k, &s.k, t, nkv * hd, h, false)?;
            self.linear(&s.h, 0, &w.v, &s.v, t, nkv * hd, h, false)?;
            self.rope(&s.q, t, nh, start_pos)?;
            self.rope(&s.k, t, nkv, start_pos)?;
            let layer = i32_of(li)?;
            let pool = kv.pool.buf.arg();
            let args = [
                s.k.arg(),
                s.v.arg(),
                pool,
                tbl.arg(),
                layer,
                pos,
                bt_a,
                nkv_a,
                hd_a,
                block_floats,
            ];
            g.launch(
                Kernel::KvWrite,
                (t as u32, nkv as u32, 1),
                (64, 1, 1),
                0,
                &args,
            )?;
            // A hook that reads the layer's KV needs the write to have landed.
            if events.reads_kv() {
                g.synchronize()?;
            }
            events.after_kv_write(li)?;
            let pool = kv.pool.buf.arg();
            let args = [
                s.q.arg(),
                pool,
                tbl.arg(),
                s.att.arg(),
                layer,
                pos,
                nh_a,
                nkv_a,
                hd_a,
                bt_a,
                block_floats,
                scale,
            ];
            g.launch(
                Kernel::Attention,
                (t as u32, nh as u32, 1),
                (att_threads, 1, 1),
                att_shared,
                &args,
            )?;
            self.linear(&s.att, 0, &w.o, &s.x, t, h, nh * hd, true)?;
            self.rms_norm(&s.x, 0, t, &w.post_norm, &s.h)?;
            self.linear(&s.h, 0, &w.gate, &s.gate, t, inter, h, false)?;
            self.linear(&s.h, 0, &w.up, &s.up, t, inter, h, false)?;
            let n = t * inter;
            let args = [s.gate.arg(), s.up.arg(), Arg::I64(n as i64)];
            g.launch(
                Kernel::SiluMul,
                grid1(n.div_ceil(256)),
                (256, 1, 1),
                0,
                &args,
            )?;
            self.linear(&s.gate, 0, &w.down, &s.x, t, h, inter, true)?;
        }
        self.rms_norm(&s.x, t - 1, 1, &self.norm, &s.h)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.linear(&s.h, 0, head, &s.logits, 1, vocab, h, false)?;
        let mut logits = s.logits.read_f32()?;
        logits.truncate(vocab);
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in PTX is what NVRTC 11.8 makes of the checked-in source. Needs that
    /// NVRTC on the library path (`.ci/install-deps` installs NVIDIA's PyPI wheel and
    /// `.ci/run` points LD_LIBRARY_PATH at it): without it the test says so, and fails when
    /// `KVTIER_REQUIRE_NVRTC=1` (as in CI). `KVTIER_WRITE_PTX=1` rewrites the file.
    #[test]
    fn kernels_ptx_is_what_nvrtc_makes_of_kernels_cu() {
        let required = std::env::var_os("KVTIER_REQUIRE_NVRTC").is_some();
        if let Some(v) = nvrtc_version()
            && v != NVRTC_VERSION
        {
            let msg = format!(
                "NVRTC {}.{} is on the library path; the PTX is made with {}.{} (.ci/install-deps)",
                v.0, v.1, NVRTC_VERSION.0, NVRTC_VERSION.1
            );
            assert!(!required, "{msg}");
            eprintln!("SKIPPED: {msg}");
            return;
        }
        let ptx = match compile_kernels() {
            Ok(Some(ptx)) => ptx,
            Ok(None) => {
                assert!(
                    !required,
                    "KVTIER_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (run .ci/install-deps \
                     and put its NVRTC directory on LD_LIBRARY_PATH)"
                );
                eprintln!(
                    "SKIPPED: no NVRTC on the library path; the PTX was not checked against \
                     kernels.cu"
                );
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/gpu/kernels.ptx");
        if std::env::var_os("KVTIER_WRITE_PTX").is_some() && ptx != KERNELS_PTX {
            std::fs::write(path, &ptx).unwrap();
            eprintln!("wrote {path}: run the test again (the build includes the file)");
            return;
        }
        assert!(
            ptx == KERNELS_PTX,
            "src/gpu/kernels.ptx is stale: regenerate it with KVTIER_WRITE_PTX=1 cargo test -p \
             kvtier-worker --features cuda --lib gpu::"
        );
    }

    /// `.entry NAME(` followed by `.param .TYPE NAME_param_I,` lines, for every kernel.
    fn ptx_entries(ptx: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        let mut lines = ptx.lines();
        while let Some(line) = lines.next() {
            let Some(rest) = line.trim().strip_prefix(".visible .entry ") else {
                continue;
            };
            let name = rest.trim_end_matches('(').to_owned();
            let mut params = Vec::new();
            for p in lines.by_ref() {
                let p = p.trim();
                if p.starts_with(')') {
                    break;
                }
                let ty = p
                    .strip_prefix(".param ")
                    .and_then(|t| t.split_whitespace().next())
                    .unwrap_or_else(|| panic!("unexpected PTX parameter line {p:?}"));
                params.push(ty.to_owned());
            }
            out.push((name, params));
        }
        out
    }

    /// Every launch is checked against SIGNATURES; SIGNATURES must be what the PTX declares,
    /// kernel by kernel (number, order and width of the parameters).
    #[test]
    fn launch_signatures_match_the_ptx() {
        let entries = ptx_entries(KERNELS_PTX);
        assert_eq!(entries.len(), SIGNATURES.len(), "{entries:?}");
        for (i, k) in ALL_KERNELS.iter().enumerate() {
            assert_eq!(k.index(), i);
            let (name, want) = SIGNATURES[i];
            let (_, got) = entries
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("kernel {name} is not in kernels.ptx"));
            assert_eq!(got, want, "parameters of {name}");
        }
    }

    #[test]
    fn a_launch_with_the_wrong_arguments_is_refused_before_the_backend() {
        // No backend is reached: the check comes first, so this needs no GPU.
        let gpu = check_only_gpu();
        let e = gpu
            .launch(
                Kernel::Embed,
                (1, 1, 1),
                (1, 1, 1),
                0,
                &[Arg::Ptr(0), Arg::I32(1)],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("kernel embed") && e.contains("it takes"), "{e}");
        let e = gpu
            .launch(
                Kernel::SiluMul,
                (1, 1, 1),
                (1, 1, 1),
                0,
                &[Arg::Ptr(0), Arg::Ptr(0), Arg::I32(3)],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("silu_mul"), "{e}");
    }

    #[test]
    fn a_sticky_cuda_error_marks_the_gpu_faulted_and_later_calls_fail_at_once() {
        let gpu = check_only_gpu();
        let err = |c| Err::<(), _>(result::DriverError(c));
        // An ordinary error does not poison the context.
        assert!(
            gpu.cuda("alloc", err(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))
                .is_err()
        );
        assert!(gpu.fault().is_none() && gpu.bind().is_ok());
        // A kernel fault does, and names where it surfaced.
        let e = gpu
            .cuda(
                "GPU synchronize",
                err(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
            )
            .unwrap_err();
        assert!(e.to_string().contains("GPU synchronize"), "{e}");
        assert!(gpu.fault().unwrap().contains("GPU synchronize"));
        let e = gpu.bind().unwrap_err().to_string();
        assert!(
            e.contains("faulted earlier") && e.contains("restarts"),
            "{e}"
        );
        // The first fault is the one kept.
        let _ = gpu.cuda("later", err(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED));
        assert!(gpu.fault().unwrap().starts_with("GPU synchronize"));
    }

    /// A `Gpu` whose backend must never be reached: its launch panics, and its library is
    /// this test binary itself (never called into).
    fn check_only_gpu() -> Gpu {
        unsafe extern "C" fn unreachable_launch(
            _: *const c_char,
            _: *const u32,
            _: *const u32,
            _: u32,
            _: *mut *mut c_void,
        ) -> c_int {
            panic!("the launch reached the backend")
        }
        Gpu {
            label: "check only".into(),
            backend: Backend::Emulated {
                launch: unreachable_launch,
                _lib: libloading::os::unix::Library::this().into(),
            },
            fault: std::sync::Mutex::new(None),
        }
    }

    #[test]
    fn without_a_driver_the_gpu_path_reports_no_gpu_and_does_not_panic() {
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(e.to_string().contains("GPU"), "{e}"),
        }
    }
}
