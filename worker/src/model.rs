//! A Llama-architecture transformer written with candle ops, reading and writing its KV
//! through the paged cache: token embedding, per layer RMSNorm -> GQA attention with rotary
//! position embeddings -> residual -> RMSNorm -> SwiGLU MLP -> residual, then a final RMSNorm
//! and `lm_head`. Weights use Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...),
//! so one loader serves both seeded random weights and a Hugging Face safetensors directory.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, Linear, Module, RmsNorm, VarBuilder};

use crate::config::ModelConfig;
use crate::error::{Result, WorkerError};
use crate::kv_cache::{BlockTable, PagedKvCache};
use kvtier_core::SplitMix64;

struct Layer {
    input_norm: RmsNorm,
    q_proj: Proj,
    k_proj: Proj,
    v_proj: Proj,
    o_proj: Proj,
    post_norm: RmsNorm,
    gate_proj: Proj,
    up_proj: Proj,
    down_proj: Proj,
}

/// A bias-free linear layer: f32 weights (safetensors, random) or weights kept quantized
/// (GGUF: candle's `QMatMul`, which quantizes the activations to Q8 for its dot products).
enum Proj {
    F32(Linear),
    Quant(QMatMul),
    /// Q4_1 or Q8_0 on the worker's kernel ([`crate::quant`]).
    Kernel(kvtier_kernels::quant::QuantMatrix),
}

impl Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Proj::F32(l) => l.forward(x)?,
            Proj::Quant(q) => q.forward(x)?,
            Proj::Kernel(q) => q.forward(x)?,
        })
    }

    /// The f32 weight (`None` when quantized).
    #[cfg(feature = "cuda")]
    fn weight(&self) -> Option<&Tensor> {
        match self {
            Proj::F32(l) => Some(l.weight()),
            Proj::Quant(_) | Proj::Kernel(_) => None,
        }
    }

    /// Bytes of weight read per use.
    fn weight_bytes(&self) -> usize {
        match self {
            Proj::F32(l) => l.weight().elem_count() * 4,
            Proj::Quant(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Proj::Kernel(q) => q.size_bytes(),
            Proj::Quant(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }
}

/// The token embedding: an f32 matrix, or a quantized one whose rows are dequantized as they
/// are looked up.
enum Embed {
    F32(Embedding),
    Quant(Arc<QTensor>),
}

impl Embed {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embed::F32(e) => e.forward(ids)?,
            Embed::Quant(q) => q.embedding(ids)?,
        })
    }
}

/// Called by [`Model::forward_hooked`] around each layer, on the thread running the forward.
/// An error aborts the forward and is returned by it. Disaggregated prefill uses it to ship
/// each layer's KV as soon as it is in the cache, and the decode side to wait for each layer's
/// KV to land before the layer reads it.
pub trait LayerHook {
    /// Before layer `layer` reads or writes the cache.
    fn before_layer(&mut self, _layer: usize, _cache: &PagedKvCache) -> Result<()> {
        Ok(())
    }

    /// After layer `layer` has written the new positions' K and V into the cache (before its
    /// attention runs); the cache is not written at that layer again during this forward.
    fn after_kv_write(&mut self, _layer: usize, _cache: &PagedKvCache) -> Result<()> {
        Ok(())
    }

    /// Whether [`after_kv_write`](Self::after_kv_write) reads the cache's bytes (on a GPU the
    /// forward then waits for each layer's KV write before calling it).
    fn reads_kv(&self) -> bool {
        true
    }
}

/// The hook that does nothing ([`Model::forward`]).
pub struct NoHook;

impl LayerHook for NoHook {
    fn reads_kv(&self) -> bool {
        false
    }
}

/// Where a model runs: the CPU (candle), or an NVIDIA GPU (feature `cuda`, [`crate::gpu`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = WorkerError;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || WorkerError::Config {
            field: "device".to_owned(),
            reason: format!("`{s}`: expected cpu, cuda or cuda:N"),
        };
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse().map(DeviceSpec::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The model: weights plus rotary tables. Holds no KV; the caller's [`PagedKvCache`] does.
pub struct Model {
    cfg: ModelConfig,
    device: Device,
    embed: Embed,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Proj,
    /// `[max_context_tokens][head_dim / 2]`, built here: a VarMap would hand back zeros.
    cos: Tensor,
    sin: Tensor,
    /// The weights on a GPU ([`Model::to_device`]); the forward then runs there.
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::GpuModel>,
}

/// Seeded random weights under Hugging Face names: linear layers uniform in
/// `±1/sqrt(fan_in)`, embeddings uniform in `±1`, norm weights 1. The same seed and config give
/// the same bits on every machine (the PRNG is our own SplitMix64).
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    let dev = Device::Cpu;
    let mut rng = SplitMix64::new(seed);
    let mut ts = HashMap::new();
    let mut uniform = |name: String, rows: usize, cols: usize, scale: f32| -> Result<()> {
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
            .collect();
        ts.insert(name, Tensor::from_vec(data, (rows, cols), &dev)?);
        Ok(())
    };
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let q = cfg.num_heads * cfg.head_dim;
    let kv = cfg.num_kv_heads * cfg.head_dim;
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    uniform("model.embed_tokens.weight".into(), cfg.vocab_size, h, 1.0)?;
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        uniform(format!("{p}.self_attn.q_proj.weight"), q, h, inv(h))?;
        uniform(format!("{p}.self_attn.k_proj.weight"), kv, h, inv(h))?;
        uniform(format!("{p}.self_attn.v_proj.weight"), kv, h, inv(h))?;
        uniform(format!("{p}.self_attn.o_proj.weight"), h, q, inv(q))?;
        uniform(format!("{p}.mlp.gate_proj.weight"), i, h, inv(h))?;
        uniform(format!("{p}.mlp.up_proj.weight"), i, h, inv(h))?;
        uniform(format!("{p}.mlp.down_proj.weight"), h, i, inv(i))?;
    }
    if !cfg.tie_word_embeddings {
        uniform("lm_head.weight".into(), cfg.vocab_size, h, inv(h))?;
    }
    let ones = Tensor::ones(h, DType::F32, &dev)?;
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        ts.insert(format!("{p}.input_layernorm.weight"), ones.clone());
        ts.insert(format!("{p}.post_attention_layernorm.weight"), ones.clone());
    }
    ts.insert("model.norm.weight".into(), ones);
    Ok(ts)
}

impl Model {
    /// The model with seeded random weights ([`random_weights`]).
    pub fn random(cfg: ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let ts = random_weights(&cfg, seed)?;
        Self::load(cfg, VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu))
    }

    /// Loads a Hugging Face Llama directory: `config.json` and every `*.safetensors` file in
    /// it (weights converted to f32). Files are read into memory rather than mapped, which
    /// keeps this path free of `unsafe`.
    pub fn from_hf_dir(dir: &Path, block_tokens: usize) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WorkerError::Io { path, source }
        };
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let cfg = ModelConfig::from_hf_json(&text, block_tokens)?;
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(WorkerError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors file"),
            });
        }
        let mut ts = HashMap::new();
        for f in &files {
            ts.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
        }
        Self::load(cfg, VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu))
    }

    /// Builds the model from any `VarBuilder` holding Hugging Face names.
    pub fn load(cfg: ModelConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let device = vb.device().clone();
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        let eps = cfg.rms_norm_eps;
        let m = vb.pp("model");
        let embed = candle_nn::embedding(cfg.vocab_size, h, m.pp("embed_tokens"))?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let lin =
            |i, o, vb| -> Result<Proj> { Ok(Proj::F32(candle_nn::linear_no_bias(i, o, vb)?)) };
        for l in 0..cfg.num_layers {
            let lv = m.pp(format!("layers.{l}"));
            let at = lv.pp("self_attn");
            let mlp = lv.pp("mlp");
            layers.push(Layer {
                input_norm: candle_nn::rms_norm(h, eps, lv.pp("input_layernorm"))?,
                q_proj: lin(h, q, at.pp("q_proj"))?,
                k_proj: lin(h, kv, at.pp("k_proj"))?,
                v_proj: lin(h, kv, at.pp("v_proj"))?,
                o_proj: lin(q, h, at.pp("o_proj"))?,
                post_norm: candle_nn::rms_norm(h, eps, lv.pp("post_attention_layernorm"))?,
                gate_proj: lin(h, i, mlp.pp("gate_proj"))?,
                up_proj: lin(h, i, mlp.pp("up_proj"))?,
                down_proj: lin(i, h, mlp.pp("down_proj"))?,
            });
        }
        let norm = candle_nn::rms_norm(h, eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Proj::F32(Linear::new(embed.embeddings().clone(), None))
        } else {
            lin(h, cfg.vocab_size, vb.pp("lm_head"))?
        };
        let (cos, sin) = rotary_tables(&cfg, &device)?;
        Ok(Self {
            cfg,
            device,
            embed: Embed::F32(embed),
            layers,
            norm,
            lm_head,
            cos,
            sin,
            #[cfg(feature = "cuda")]
            gpu: None,
        })
    }

    /// Loads a Llama GGUF file with its weights kept quantized ([`crate::gguf`]); the
    /// forward is the same as the f32 model's, with candle's quantized matmul for every
    /// projection and the LM head.
    pub fn from_gguf(file: &mut crate::gguf::GgufFile, block_tokens: usize) -> Result<Self> {
        let cfg = file.model_config(block_tokens)?;
        let mut ts = crate::gguf::llama_tensors(file, &cfg)?;
        let mut take = |name: String| {
            ts.remove(&name).ok_or_else(|| WorkerError::Config {
                field: format!("(gguf {})", file.path().display()),
                reason: format!("no tensor for {name}"),
            })
        };
        let eps = cfg.rms_norm_eps;
        let norm = |t: Arc<QTensor>| -> Result<RmsNorm> {
            Ok(RmsNorm::new(t.dequantize(&Device::Cpu)?, eps))
        };
        let quant = |t: Arc<QTensor>| -> Result<Proj> {
            Ok(
                match kvtier_kernels::quant::QuantMatrix::from_qtensor(&t)? {
                    Some(m) => Proj::Kernel(m),
                    None => Proj::Quant(QMatMul::from_arc(t)?),
                },
            )
        };
        let embed = take("model.embed_tokens.weight".into())?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let mut w = |n: &str| take(format!("model.layers.{l}.{n}.weight"));
            layers.push(Layer {
                input_norm: norm(w("input_layernorm")?)?,
                q_proj: quant(w("self_attn.q_proj")?)?,
                k_proj: quant(w("self_attn.k_proj")?)?,
                v_proj: quant(w("self_attn.v_proj")?)?,
                o_proj: quant(w("self_attn.o_proj")?)?,
                post_norm: norm(w("post_attention_layernorm")?)?,
                gate_proj: quant(w("mlp.gate_proj")?)?,
                up_proj: quant(w("mlp.up_proj")?)?,
                down_proj: quant(w("mlp.down_proj")?)?,
            });
        }
        let final_norm = norm(take("model.norm.weight".into())?)?;
        let lm_head = if cfg.tie_word_embeddings {
            quant(embed.clone())?
        } else {
            quant(take("lm_head.weight".into())?)?
        };
        let (cos, sin) = rotary_tables(&cfg, &Device::Cpu)?;
        Ok(Self {
            cfg,
            device: Device::Cpu,
            embed: Embed::Quant(embed),
            layers,
            norm: final_norm,
            lm_head,
            cos,
            sin,
            #[cfg(feature = "cuda")]
            gpu: None,
        })
    }

    /// Whether the weights are kept quantized (a GGUF model).
    pub fn is_quantized(&self) -> bool {
        !matches!(self.lm_head, Proj::F32(_))
    }

    /// Weight bytes a decode step reads: every projection and the LM head (the embedding
    /// reads one row, not counted).
    pub fn weight_bytes_per_token(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ]
                .iter()
                .map(|p| p.weight_bytes())
                .sum::<usize>()
            })
            .sum();
        layers + self.lm_head.weight_bytes()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Whether the forward runs on a GPU (or the GPU emulator).
    pub fn on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return true;
        }
        false
    }

    /// Where the forward runs: `cpu`, `cuda:N` or `emulated`.
    pub fn device_label(&self) -> String {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.gpu().label().to_owned();
        }
        "cpu".to_owned()
    }

    /// The model, running on `device`: for a GPU its weights are copied there (f32) and its
    /// forward runs there; it then needs a pool in that GPU's memory
    /// ([`PagedKvCache::on_gpu`], which [`crate::Engine::new`] builds). The host copy of the
    /// weights is kept. Without the `cuda` feature a GPU is an error.
    pub fn to_device(self, device: DeviceSpec) -> Result<Self> {
        match device {
            DeviceSpec::Cpu => Ok(self),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(n) => self.to_gpu(&crate::gpu::Gpu::open(n)?),
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => Err(WorkerError::Gpu {
                reason: "this kvtier-worker was built without the `cuda` feature (rebuild with \
                         `--features cuda`)"
                    .to_owned(),
            }),
        }
    }

    /// The model on `gpu` (a CUDA device, or the emulator): see [`to_device`](Self::to_device).
    #[cfg(feature = "cuda")]
    pub fn to_gpu(self, gpu: &std::sync::Arc<crate::gpu::Gpu>) -> Result<Self> {
        let quantized = || WorkerError::Gpu {
            reason: "the GPU path runs f32 weights only; a quantized (GGUF) model runs on the \
                     CPU (load the Hugging Face directory for the GPU)"
                .to_owned(),
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok([
                    l.input_norm.weight(),
                    l.q_proj.weight().ok_or_else(quantized)?,
                    l.k_proj.weight().ok_or_else(quantized)?,
                    l.v_proj.weight().ok_or_else(quantized)?,
                    l.o_proj.weight().ok_or_else(quantized)?,
                    l.post_norm.weight(),
                    l.gate_proj.weight().ok_or_else(quantized)?,
                    l.up_proj.weight().ok_or_else(quantized)?,
                    l.down_proj.weight().ok_or_else(quantized)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let Embed::F32(embed) = &self.embed else {
            return Err(quantized());
        };
        let weights = crate::gpu::HostWeights {
            embed: embed.embeddings(),
            layers,
            norm: self.norm.weight(),
            lm_head: if self.cfg.tie_word_embeddings {
                None
            } else {
                Some(self.lm_head.weight().ok_or_else(quantized)?)
            },
            cos: &self.cos,
            sin: &self.sin,
        };
        let g = crate::gpu::GpuModel::upload(gpu, &self.cfg, weights)?;
        Ok(Self {
            gpu: Some(g),
            ..self
        })
    }

    /// The GPU this model runs on, if it was moved to one ([`Model::to_device`],
    /// [`Model::to_gpu`]).
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&std::sync::Arc<crate::gpu::Gpu>> {
        self.gpu_model().map(crate::gpu::GpuModel::gpu)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn gpu_model(&self) -> Option<&crate::gpu::GpuModel> {
        self.gpu.as_ref()
    }

    /// Runs `tokens` at positions `start_pos..start_pos + tokens.len()`. Positions before
    /// `start_pos` are read from `cache` through `table` (they must be there); the new
    /// positions' K and V are written to it. `table` must already cover every position.
    /// Returns the logits of the last position, `[vocab_size]`.
    pub fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut PagedKvCache,
        table: &BlockTable,
    ) -> Result<Vec<f32>> {
        self.forward_hooked(tokens, start_pos, cache, table, &mut NoHook)
    }

    /// [`forward`](Self::forward), calling `hook` around each layer.
    pub fn forward_hooked(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut PagedKvCache,
        table: &BlockTable,
        hook: &mut dyn LayerHook,
    ) -> Result<Vec<f32>> {
        let t = tokens.len();
        if t == 0 {
            return Err(WorkerError::EmptyPrompt);
        }
        let total = start_pos + t;
        self.check_input(tokens, total)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return gpu_forward(g, tokens, start_pos, cache, table, hook);
        }
        let ids = Tensor::from_slice(tokens, t, &self.device)?;
        let mut x = self.embed.forward(&ids)?; // [t, hidden]
        let cos = self.cos.narrow(0, start_pos, t)?;
        let sin = self.sin.narrow(0, start_pos, t)?;
        // Only candle's attention reads the mask ([`Model::attend`]).
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let mask = if kvtier_kernels::attention::runs(nh, nkv, hd) {
            None
        } else {
            causal_mask(t, start_pos, &self.device)?
        };
        for (li, layer) in self.layers.iter().enumerate() {
            hook.before_layer(li, cache)?;
            let (q, k_rows, v_rows) = self.qkv(layer, &x, &cos, &sin)?;
            cache.write_kv(table, li, start_pos, &k_rows, &v_rows)?;
            hook.after_kv_write(li, cache)?;
            let out = self.attend(&q, cache, table, li, total, mask.as_ref())?;
            x = self.finish_layer(layer, x, &out)?;
        }
        let last = self.norm.forward(&x.narrow(0, t - 1, 1)?)?;
        Ok(self.lm_head.forward(&last)?.squeeze(0)?.to_vec1::<f32>()?)
    }

    /// One decode step for each of several sequences in one forward (continuous batching):
    /// `steps[i]` is sequence `i`'s token and its position, `tables[i]` its blocks (covering
    /// the position). The projections and the MLP run on all rows at once; attention runs per
    /// sequence over its own paged KV. Returns each sequence's logits, equal to
    /// [`forward`](Self::forward) of that step alone.
    pub fn decode_batch(
        &self,
        steps: &[(u32, usize)],
        tables: &[&BlockTable],
        cache: &mut PagedKvCache,
    ) -> Result<Vec<Vec<f32>>> {
        let b = steps.len();
        if b != tables.len() {
            return Err(WorkerError::Config {
                field: "decode batch".to_owned(),
                reason: format!("{b} steps but {} block tables", tables.len()),
            });
        }
        #[cfg(feature = "cuda")]
        let one_at_a_time = b <= 1 || self.gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        let one_at_a_time = b <= 1;
        if one_at_a_time {
            return steps
                .iter()
                .zip(tables)
                .map(|(&(token, pos), table)| self.forward(&[token], pos, cache, table))
                .collect();
        }
        for &(id, pos) in steps {
            self.check_input(&[id], pos + 1)?;
        }
        let ids: Vec<u32> = steps.iter().map(|s| s.0).collect();
        let positions: Vec<u32> = steps.iter().map(|s| s.1 as u32).collect();
        let mut x = self
            .embed
            .forward(&Tensor::from_vec(ids, b, &self.device)?)?; // [b, hidden]
        // Row i rotates at its own position.
        let at = Tensor::from_vec(positions, b, &self.device)?;
        let (cos, sin) = (
            self.cos.index_select(&at, 0)?,
            self.sin.index_select(&at, 0)?,
        );
        let row = self.cfg.num_kv_heads * self.cfg.head_dim;
        for (li, layer) in self.layers.iter().enumerate() {
            let (q, k_rows, v_rows) = self.qkv(layer, &x, &cos, &sin)?;
            let mut outs = Vec::with_capacity(b);
            for (i, (&(_, pos), table)) in steps.iter().zip(tables).enumerate() {
                let (k, v) = (
                    &k_rows[i * row..(i + 1) * row],
                    &v_rows[i * row..(i + 1) * row],
                );
                cache.write_kv(table, li, pos, k, v)?;
                let qi = q.narrow(1, i, 1)?.contiguous()?;
                outs.push(self.attend(&qi, cache, table, li, pos + 1, None)?);
            }
            x = self.finish_layer(layer, x, &Tensor::cat(&outs, 0)?)?;
        }
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [b, vocab]
        Ok(logits.to_vec2::<f32>()?)
    }

    /// `tokens` are in the vocabulary and a forward ending at position `total - 1` fits the
    /// context.
    fn check_input(&self, tokens: &[u32], total: usize) -> Result<()> {
        if let Some(&id) = tokens
            .iter()
            .find(|&&id| id as usize >= self.cfg.vocab_size)
        {
            return Err(WorkerError::TokenOutOfVocab {
                id,
                vocab_size: self.cfg.vocab_size,
            });
        }
        if total > self.cfg.max_context_tokens {
            return Err(WorkerError::ContextFull {
                tokens: total,
                max_context_tokens: self.cfg.max_context_tokens,
            });
        }
        Ok(())
    }

    /// The layer's input norm, Q (rotated, `[heads, t, head_dim]`), and the new K (rotated)
    /// and V rows for the cache, each `[t][kv_head][head_dim]`. `cos`/`sin` hold row `i`'s
    /// angles in row `i`.
    fn qkv(
        &self,
        layer: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Vec<f32>, Vec<f32>)> {
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let t = x.dim(0)?;
        let h = layer.input_norm.forward(x)?;
        // [1, heads, t, head_dim] for rope.
        let heads = |proj: &Proj, n: usize| -> Result<Tensor> {
            Ok(proj
                .forward(&h)?
                .reshape((t, n, hd))?
                .transpose(0, 1)?
                .contiguous()?
                .unsqueeze(0)?)
        };
        let q = candle_nn::rotary_emb::rope(&heads(&layer.q_proj, nh)?, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&heads(&layer.k_proj, nkv)?, cos, sin)?;
        let v = layer.v_proj.forward(&h)?; // [t, kv_heads * head_dim] = [token][head][dim]
        let k_rows = k
            .squeeze(0)?
            .transpose(0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let v_rows = v.flatten_all()?.to_vec1::<f32>()?;
        Ok((q.squeeze(0)?, k_rows, v_rows))
    }

    /// Attention of `q` (`[heads, t, head_dim]`) over positions `0..total` of `table` at
    /// `layer`, causal over the last `t` positions when the queries are several
    /// ([`crate::attention`]'s kernel where it runs, else candle ops with `mask`, built here
    /// when not given); `[t, heads * head_dim]`.
    fn attend(
        &self,
        q: &Tensor,
        cache: &PagedKvCache,
        table: &BlockTable,
        layer: usize,
        total: usize,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let rep = nh / nkv;
        let t = q.dim(1)?;
        let (kc, vc) = cache.gather(table, layer, total)?;
        if t > 1 {
            // A prefill chunk: the blocked kernel where the CPU runs it.
            let shape = kvtier_kernels::attention::Shape {
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
                queries: t,
                start_pos: total - t,
            };
            let qs = q.flatten_all()?.to_vec1::<f32>()?;
            if let Some(out) = kvtier_kernels::attention::causal(&qs, &kc, &vc, shape) {
                return Ok(Tensor::from_vec(out, (t, nh * hd), &self.device)?);
            }
        }
        let built;
        let mask = match mask {
            Some(m) => Some(m),
            None if t > 1 => {
                built = causal_mask(t, total - t, &self.device)?;
                built.as_ref()
            }
            None => None,
        };
        let expand = |rows: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(rows, (total, nkv, hd), &self.device)?
                .transpose(0, 1)? // [kv_heads, total, hd]
                .unsqueeze(1)?
                .expand((nkv, rep, total, hd))?
                .reshape((nh, total, hd))?)
        };
        let (kc, vc) = (expand(kc)?, expand(vc)?);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut att = (q.matmul(&kc.t()?)? * scale)?; // [heads, t, total]
        if let Some(mask) = mask {
            att = att.broadcast_add(mask)?;
        }
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        Ok(att
            .matmul(&vc)? // [heads, t, hd]
            .transpose(0, 1)?
            .reshape((t, nh * hd))?)
    }

    /// The rest of a layer after attention: output projection and residual, then the MLP and
    /// its residual.
    ///
    /// The residual adds and the SiLU gate run on rayon's pool, not as candle ops
    /// ([`kvtier_kernels::elementwise`] says why).
    fn finish_layer(&self, layer: &Layer, x: Tensor, att: &Tensor) -> Result<Tensor> {
        use kvtier_kernels::elementwise::{add, silu_mul};
        let x = add(&x, &layer.o_proj.forward(att)?)?;
        let h = layer.post_norm.forward(&x)?;
        let gated = silu_mul(&layer.gate_proj.forward(&h)?, &layer.up_proj.forward(&h)?)?;
        Ok(add(&x, &layer.down_proj.forward(&gated)?)?)
    }
}

/// `cos`/`sin` of `pos * theta^(-2i/head_dim)`, `[max_context_tokens][head_dim / 2]`, in the
/// non-interleaved ("rotate half") convention of Hugging Face Llama.
fn rotary_tables(cfg: &ModelConfig, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.head_dim as f32))
        .collect();
    let n = cfg.max_context_tokens;
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for pos in 0..n {
        for f in &inv_freq {
            let a = pos as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), dev)?,
        Tensor::from_vec(sin, (n, half), dev)?,
    ))
}

/// `[t][start_pos + t]` with `-inf` where query `i` (position `start_pos + i`) would see a
/// later key; `None` for one query, which sees everything cached.
fn causal_mask(t: usize, start_pos: usize, dev: &Device) -> Result<Option<Tensor>> {
    if t == 1 {
        return Ok(None);
    }
    let total = start_pos + t;
    let data: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j > start_pos + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(data, (t, total), dev)?))
}

/// Index of the largest logit (the first on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The GPU forward of [`Model::forward_hooked`]: checks every block of `table` is allocated
/// (the kernels index the pool with them), then runs the forward over the cache's device pool
/// with `hook` called around each layer.
#[cfg(feature = "cuda")]
fn gpu_forward(
    g: &crate::gpu::GpuModel,
    tokens: &[u32],
    start_pos: usize,
    cache: &PagedKvCache,
    table: &BlockTable,
    hook: &mut dyn LayerHook,
) -> Result<Vec<f32>> {
    let covered = table.len() * cache.block_tokens();
    if covered < start_pos + tokens.len() {
        return Err(WorkerError::MissingPrefix {
            start_pos,
            covered_tokens: covered,
        });
    }
    for id in table.blocks() {
        cache.check_block(*id)?;
    }
    let blocks: Vec<u32> = table.blocks().iter().map(|b| b.0).collect();
    let kv = crate::gpu::PagedKv {
        pool: cache.device_pool()?,
        block_tokens: cache.block_tokens(),
        block_bytes: cache.block_size_bytes(),
        blocks: &blocks,
    };
    g.forward(tokens, start_pos, kv, &mut HookOverCache { hook, cache })
}

/// A [`LayerHook`] seen by the GPU forward: each call gets the cache.
#[cfg(feature = "cuda")]
struct HookOverCache<'a> {
    hook: &'a mut dyn LayerHook,
    cache: &'a PagedKvCache,
}

#[cfg(feature = "cuda")]
impl crate::gpu::LayerEvents for HookOverCache<'_> {
    fn before_layer(&mut self, layer: usize) -> Result<()> {
        self.hook.before_layer(layer, self.cache)
    }

    fn after_kv_write(&mut self, layer: usize) -> Result<()> {
        self.hook.after_kv_write(layer, self.cache)
    }

    fn reads_kv(&self) -> bool {
        self.hook.reads_kv()
    }
}

/// Loads the model and tokenizer at `path`: a GGUF file, or a directory holding one `.gguf`
/// and no `*.safetensors` ([`Model::from_gguf`], tokenizer and chat template from its
/// metadata), else a Hugging Face directory ([`Model::from_hf_dir`],
/// [`Tokenizer::for_model_dir`](crate::Tokenizer::for_model_dir)).
pub fn load_pretrained(path: &Path, block_tokens: usize) -> Result<(Model, crate::Tokenizer)> {
    match crate::gguf::gguf_in(path)? {
        Some(file) => {
            let mut file = crate::gguf::GgufFile::open(&file)?;
            let model = Model::from_gguf(&mut file, block_tokens)?;
            let tok = file.tokenizer(model.config().vocab_size)?;
            Ok((model, tok))
        }
        None => {
            let model = Model::from_hf_dir(path, block_tokens)?;
            let tok = crate::Tokenizer::for_model_dir(path, model.config().vocab_size)?;
            Ok((model, tok))
        }
    }
}
