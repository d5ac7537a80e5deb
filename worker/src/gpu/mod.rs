//! The GPU path (feature `cuda`): the model's forward on an NVIDIA GPU, with the paged KV pool
//! in device memory and attention reading it in place.
//!
//! It runs on our cudarc configuration (driver API, `dynamic-loading`): the build needs no CUDA
//! toolkit, and a machine needs only the CUDA driver. The kernels (`kernels.cu`, f32) ship as
//! PTX compiled by NVRTC (`kernels.ptx`, checked in; a test compiles the source again and
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
//! **Verification:** no GPU was available where this was written. The kernels compile with
//! NVRTC in CI (`cargo test -p kvtier-worker --features cuda`); the tests that run them and
//! compare with the CPU forward (`tests/gpu.rs`) run where a GPU exists and say they were
//! skipped elsewhere. See `docs/worker.md`.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg, result, sys,
};
use cudarc::nvrtc::Ptx;

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use crate::kv_cache::{BlockTable, PagedKvCache};
use crate::model::{LayerHook, Model};

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

/// Compiles [`KERNELS_CU`] with NVRTC (loaded at run time: `libnvrtc.so.12` must be on the
/// library path) and returns the PTX text. `Ok(None)` when NVRTC is not installed.
pub fn compile_kernels() -> Result<Option<String>> {
    // SAFETY: only checks whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
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

struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    matmul_nt: CudaFunction,
    gemv_nt: CudaFunction,
    rope: CudaFunction,
    kv_write: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
}

/// One GPU: its context, the stream every operation of this worker runs on, and the kernels.
pub struct Gpu {
    ordinal: usize,
    stream: Arc<CudaStream>,
    k: Kernels,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{})", self.ordinal)
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        let n = probe()?;
        if ordinal >= n {
            return Err(WorkerError::Gpu {
                reason: format!("cuda:{ordinal} requested, {n} device(s) present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| gpu_err("CUDA context", e))?;
        let module = ctx
            .load_module(Ptx::from_src(KERNELS_PTX))
            .map_err(|e| gpu_err("loading the kernels' PTX", e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| gpu_err(&format!("kernel {name}"), e))
        };
        let k = Kernels {
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            matmul_nt: f("matmul_nt")?,
            gemv_nt: f("gemv_nt")?,
            rope: f("rope")?,
            kv_write: f("kv_write")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
        };
        Ok(Arc::new(Self {
            ordinal,
            stream: ctx.default_stream(),
            k,
        }))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream
            .clone_htod(data)
            .map_err(|e| gpu_err("copying to the GPU", e))
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(|e| gpu_err(&format!("allocating {n} floats on the GPU"), e))
    }
}

/// The KV pool's device memory: copies in and out go through host memory on the GPU's stream.
pub struct DevicePool {
    gpu: Arc<Gpu>,
    buf: CudaSlice<u8>,
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevicePool({} bytes on {:?})", self.buf.len(), self.gpu)
    }
}

impl DevicePool {
    /// `len` zeroed bytes on `gpu`.
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        let buf = gpu
            .stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| gpu_err(&format!("allocating a {len}-byte KV pool on the GPU"), e))?;
        Ok(Self {
            gpu: gpu.clone(),
            buf,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Copies `out.len()` bytes at `start` to the host (waits for the stream first, so every
    /// kernel queued before has written them).
    pub fn read(&self, start: usize, out: &mut [u8]) -> Result<()> {
        let view = self.buf.slice(start..start + out.len());
        self.gpu
            .stream
            .memcpy_dtoh(&view, out)
            .map_err(|e| gpu_err("copying KV from the GPU", e))?;
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| gpu_err("GPU stream", e))
    }

    /// Copies `src` to `start`, ordered before every kernel queued after it.
    pub fn write(&mut self, start: usize, src: &[u8]) -> Result<()> {
        let mut view = self.buf.slice_mut(start..start + src.len());
        self.gpu
            .stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| gpu_err("copying KV to the GPU", e))
    }
}

struct GpuLayer {
    input_norm: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    o: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    down: CudaSlice<f32>,
}

/// The model's weights on a GPU (f32) and its forward there.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    cfg: ModelConfig,
    embed: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    norm: CudaSlice<f32>,
    /// `None`: tied to the embeddings.
    lm_head: Option<CudaSlice<f32>>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
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

impl GpuModel {
    pub(crate) fn upload(gpu: &Arc<Gpu>, cfg: &ModelConfig, w: HostWeights<'_>) -> Result<Self> {
        let up = |t: &candle_core::Tensor| -> Result<CudaSlice<f32>> {
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
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `c = a · wᵀ` (or `c += ...`), `a` `[m][k]`, `w` `[n][k]`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        a: &CudaSlice<f32>,
        a_offset: usize,
        w: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let a = a.slice(a_offset..a_offset + m * k);
        let (n_i, k_i, acc) = (n as i32, k as i32, i32::from(accumulate));
        if m == 1 {
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(&self.gpu.k.gemv_nt);
            b.arg(&a).arg(w).arg(c).arg(&n_i).arg(&k_i).arg(&acc);
            // SAFETY: gemv_nt(const float*, const float*, float*, int, int, int): the
            // arguments match in number and type; `a` holds k floats, `w` n*k, `c` n.
            unsafe { b.launch(cfg) }.map_err(|e| gpu_err("gemv_nt", e))?;
        } else {
            let m_i = m as i32;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                block_dim: (16, 16, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(&self.gpu.k.matmul_nt);
            b.arg(&a)
                .arg(w)
                .arg(c)
                .arg(&m_i)
                .arg(&n_i)
                .arg(&k_i)
                .arg(&acc);
            // SAFETY: matmul_nt(const float*, const float*, float*, int, int, int, int):
            // the arguments match; `a` holds m*k floats, `w` n*k, `c` m*n.
            unsafe { b.launch(cfg) }.map_err(|e| gpu_err("matmul_nt", e))?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        x_offset: usize,
        rows: usize,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let h = self.cfg.hidden_size;
        let x = x.slice(x_offset..x_offset + rows * h);
        let (h_i, eps) = (h as i32, self.cfg.rms_norm_eps as f32);
        let mut b = self.gpu.stream.launch_builder(&self.gpu.k.rms_norm);
        b.arg(&x).arg(w).arg(out).arg(&h_i).arg(&eps);
        // SAFETY: rms_norm(const float*, const float*, float*, int, float): the arguments
        // match; `x` and `out` hold rows*hidden floats, `w` hidden; blockDim is 256 (a
        // multiple of 32, as block_sum needs).
        unsafe { b.launch(grid(rows as u32, 1, 256)) }.map_err(|e| gpu_err("rms_norm", e))?;
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        tokens: usize,
        heads: usize,
        start_pos: usize,
    ) -> Result<()> {
        let (h_i, d_i, p_i) = (heads as i32, self.cfg.head_dim as i32, start_pos as i32);
        let mut b = self.gpu.stream.launch_builder(&self.gpu.k.rope);
        b.arg(x)
            .arg(&self.cos)
            .arg(&self.sin)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&p_i);
        // SAFETY: rope(float*, const float*, const float*, int, int, int): the arguments
        // match; `x` holds tokens*heads*head_dim floats and the tables cover
        // start_pos + tokens <= max_context_tokens positions (checked by the caller).
        unsafe { b.launch(grid(tokens as u32, heads as u32, 64)) }
            .map_err(|e| gpu_err("rope", e))?;
        Ok(())
    }

    /// The forward of `tokens` at `start_pos` (see [`Model::forward_hooked`], which checked
    /// the tokens and the context). `cache` must be a GPU pool on this model's GPU.
    pub(crate) fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut PagedKvCache,
        table: &BlockTable,
        hook: &mut dyn LayerHook,
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
        let bt = cache.block_tokens();
        let covered = table.len() * bt;
        if covered < start_pos + t {
            return Err(WorkerError::MissingPrefix {
                start_pos,
                covered_tokens: covered,
            });
        }
        // Every block of the table must be allocated: the kernels index the pool with them.
        for id in table.blocks() {
            cache.check_block(*id)?;
        }
        let block_floats = (cache.block_size_bytes() / 4) as i64;
        let s = &self.gpu.stream;
        let ids = s
            .clone_htod(tokens)
            .map_err(|e| gpu_err("copying tokens to the GPU", e))?;
        let tbl: Vec<u32> = table.blocks().iter().map(|b| b.0).collect();
        let tbl = s
            .clone_htod(&tbl)
            .map_err(|e| gpu_err("copying the block table to the GPU", e))?;
        let mut x = self.gpu.zeros(t * h)?;
        let mut hbuf = self.gpu.zeros(t * h)?;
        let mut q = self.gpu.zeros(t * nh * hd)?;
        let mut k = self.gpu.zeros(t * nkv * hd)?;
        let mut v = self.gpu.zeros(t * nkv * hd)?;
        let mut att = self.gpu.zeros(t * nh * hd)?;
        let mut gate = self.gpu.zeros(t * inter)?;
        let mut up = self.gpu.zeros(t * inter)?;

        let h_i = h as i32;
        let mut b = s.launch_builder(&self.gpu.k.embed);
        b.arg(&ids).arg(&self.embed).arg(&mut x).arg(&h_i);
        // SAFETY: embed(const unsigned*, const float*, float*, int): the arguments match;
        // every id is below vocab_size (checked by the caller), `x` holds t*hidden floats.
        unsafe { b.launch(grid(t as u32, 1, 256)) }.map_err(|e| gpu_err("embed", e))?;

        let scale = 1.0 / (hd as f32).sqrt();
        let att_threads = hd.next_multiple_of(32).max(64) as u32;
        let att_shared = ((hd + ATT_KEYS) * 4) as u32;
        for (li, w) in self.layers.iter().enumerate() {
            hook.before_layer(li, cache)?;
            self.rms_norm(&x, 0, t, &w.input_norm, &mut hbuf)?;
            self.linear(&hbuf, 0, &w.q, &mut q, t, nh * hd, h, false)?;
            self.linear(&hbuf, 0, &w.k, &mut k, t, nkv * hd, h, false)?;
            self.linear(&hbuf, 0, &w.v, &mut v, t, nkv * hd, h, false)?;
            self.rope(&mut q, t, nh, start_pos)?;
            self.rope(&mut k, t, nkv, start_pos)?;
            let (layer_i, pos_i, bt_i, nkv_i, hd_i, nh_i) = (
                li as i32,
                start_pos as i32,
                bt as i32,
                nkv as i32,
                hd as i32,
                nh as i32,
            );
            {
                let pool = cache.device_pool_mut()?;
                let mut b = s.launch_builder(&self.gpu.k.kv_write);
                b.arg(&k)
                    .arg(&v)
                    .arg(&mut pool.buf)
                    .arg(&tbl)
                    .arg(&layer_i)
                    .arg(&pos_i)
                    .arg(&bt_i)
                    .arg(&nkv_i)
                    .arg(&hd_i)
                    .arg(&block_floats);
                // SAFETY: kv_write(const float*, const float*, float*, const unsigned*, int,
                // int, int, int, int, long long): the arguments match; the table covers every
                // written position and names allocated blocks of this pool (checked above).
                unsafe { b.launch(grid(t as u32, nkv as u32, 64)) }
                    .map_err(|e| gpu_err("kv_write", e))?;
            }
            // The hook may read the layer's KV: let the write land first.
            s.synchronize().map_err(|e| gpu_err("GPU stream", e))?;
            hook.after_kv_write(li, cache)?;
            {
                let pool = cache.device_pool_mut()?;
                let mut b = s.launch_builder(&self.gpu.k.attention);
                b.arg(&q)
                    .arg(&pool.buf)
                    .arg(&tbl)
                    .arg(&mut att)
                    .arg(&layer_i)
                    .arg(&pos_i)
                    .arg(&nh_i)
                    .arg(&nkv_i)
                    .arg(&hd_i)
                    .arg(&bt_i)
                    .arg(&block_floats)
                    .arg(&scale);
                let cfg = LaunchConfig {
                    grid_dim: (t as u32, nh as u32, 1),
                    block_dim: (att_threads, 1, 1),
                    shared_mem_bytes: att_shared,
                };
                // SAFETY: attention(const float*, const float*, const unsigned*, float*, int,
                // int, int, int, int, int, long long, float): the arguments match; positions
                // 0..start_pos+t are covered by the table; blockDim >= head_dim and the
                // dynamic shared memory holds head_dim + ATT_KEYS floats.
                unsafe { b.launch(cfg) }.map_err(|e| gpu_err("attention", e))?;
            }
            self.linear(&att, 0, &w.o, &mut x, t, h, nh * hd, true)?;
            self.rms_norm(&x, 0, t, &w.post_norm, &mut hbuf)?;
            self.linear(&hbuf, 0, &w.gate, &mut gate, t, inter, h, false)?;
            self.linear(&hbuf, 0, &w.up, &mut up, t, inter, h, false)?;
            let n = (t * inter) as i64;
            let mut b = s.launch_builder(&self.gpu.k.silu_mul);
            b.arg(&mut gate).arg(&up).arg(&n);
            // SAFETY: silu_mul(float*, const float*, long long): the arguments match; both
            // buffers hold n floats.
            unsafe { b.launch(grid((t * inter).div_ceil(256) as u32, 1, 256)) }
                .map_err(|e| gpu_err("silu_mul", e))?;
            self.linear(&gate, 0, &w.down, &mut x, t, h, inter, true)?;
        }
        self.rms_norm(&x, (t - 1) * h, 1, &self.norm, &mut hbuf)?;
        let mut logits = self.gpu.zeros(vocab)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.linear(&hbuf, 0, head, &mut logits, 1, vocab, h, false)?;
        let out = s
            .clone_dtoh(&logits)
            .map_err(|e| gpu_err("copying logits from the GPU", e))?;
        s.synchronize().map_err(|e| gpu_err("GPU stream", e))?;
        Ok(out)
    }
}

fn grid(x: u32, y: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x, y, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Model {
    /// The GPU this model runs on, if it was moved to one ([`Model::to_cuda`]).
    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        self.gpu_model().map(GpuModel::gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in PTX is what NVRTC makes of the checked-in source. Needs NVRTC
    /// (`libnvrtc.so.12` on the library path; `.ci/install-deps` installs NVIDIA's PyPI wheel
    /// and `.ci/run` points LD_LIBRARY_PATH at it): without it the test says so, and fails
    /// when `KVTIER_REQUIRE_NVRTC=1` (as in CI). `KVTIER_WRITE_PTX=1` rewrites the file.
    #[test]
    fn kernels_ptx_is_what_nvrtc_makes_of_kernels_cu() {
        let ptx = match compile_kernels() {
            Ok(Some(ptx)) => ptx,
            Ok(None) => {
                assert!(
                    std::env::var_os("KVTIER_REQUIRE_NVRTC").is_none(),
                    "KVTIER_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (run .ci/install-deps \
                     and put its NVRTC directory on LD_LIBRARY_PATH)"
                );
                eprintln!(
                    "SKIPPED: NVRTC (libnvrtc.so.12) is not on the library path; the PTX was not \
                     checked against kernels.cu"
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
        for name in [
            "embed",
            "rms_norm",
            "matmul_nt",
            "gemv_nt",
            "rope",
            "kv_write",
            "attention",
            "silu_mul",
        ] {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the PTX"
            );
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
