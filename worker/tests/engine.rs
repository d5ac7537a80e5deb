//! The worker's central properties: the paged-cache forward equals an independent contiguous
//! forward, and a prefix whose KV bytes are copied out of one cache into another gives the same
//! output as recomputing it (what kvtier's prefix reuse relies on).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{D, DType, Device, IndexOp, Tensor};
use kvtier_testkit::prompt::{byte_prompt, max_abs_diff};
use kvtier_worker::engine::FinishReason;
use kvtier_worker::model::{argmax, random_weights};
use kvtier_worker::{BlockId, BlockTable, Engine, Model, ModelConfig, Sampling, WorkerError};

/// Logits of the paged forward and of the reference agree to this (max absolute difference).
/// Logits of the default random model are O(1); the two forwards differ only in summation
/// order (matmul shapes, softmax and norm kernels), which costs ~1e-6 relative in f32.
const REF_TOL: f32 = 1e-4;
/// Prefix reuse vs full recomputation: only the prefill split differs. The same kernels,
/// except where every position is cached and the last one is recomputed alone: a decode step's
/// f32 attention against the prefill kernel's, which rounds to 13-14 bits where the CPU has
/// AVX-512 VNNI (docs/worker.md; up to about 2e-4 on this model, 1e-6 with the f32 kernel). The
/// control runs below check that a wrong prefix moves the logits by over 100 times this.
const REUSE_TOL: f32 = 2e-3;

fn cfg() -> ModelConfig {
    ModelConfig::default()
}

/// A plain contiguous Llama forward over the whole sequence, written without the worker's
/// model code or candle_nn layers. Returns `[tokens][vocab]` logits.
fn reference_logits(
    cfg: &ModelConfig,
    w: &HashMap<String, Tensor>,
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>> {
    let dev = Device::Cpu;
    let t = tokens.len();
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let get = |n: &str| w[n].clone();
    let rms = |x: &Tensor, weight: &Tensor| -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (ms + cfg.rms_norm_eps)?.sqrt()?.recip()?;
        Ok(x.broadcast_mul(&inv)?.broadcast_mul(weight)?)
    };
    // Rotary angles [t][hd/2], then rotate-half on [heads][t][hd].
    let half = hd / 2;
    let mut ang = Vec::new();
    for p in 0..t {
        for i in 0..half {
            ang.push(p as f64 * (cfg.rope_theta as f64).powf(-2.0 * i as f64 / hd as f64));
        }
    }
    let ang = Tensor::from_vec(ang, (t, half), &dev)?.to_dtype(DType::F32)?;
    let cos = Tensor::cat(&[&ang.cos()?, &ang.cos()?], 1)?;
    let sin = Tensor::cat(&[&ang.sin()?, &ang.sin()?], 1)?;
    let rope = |x: &Tensor| -> Result<Tensor> {
        let x1 = x.narrow(2, 0, half)?;
        let x2 = x.narrow(2, half, half)?;
        let rot = Tensor::cat(&[&x2.neg()?, &x1], 2)?;
        Ok((x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?)?)
    };
    let mut mask = vec![0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            mask[i * t + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (t, t), &dev)?;
    // Query head h uses KV head h / (nh / nkv).
    let kv_index: Vec<u32> = (0..nh).map(|h| (h / (nh / nkv)) as u32).collect();
    let kv_index = Tensor::from_vec(kv_index, nh, &dev)?;

    let ids = Tensor::from_slice(tokens, t, &dev)?;
    let mut x = get("model.embed_tokens.weight").index_select(&ids, 0)?;
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let lin = |x: &Tensor, n: &str| -> Result<Tensor> {
            Ok(x.matmul(&get(&format!("{p}.{n}.weight")).t()?)?)
        };
        let h = rms(&x, &get(&format!("{p}.input_layernorm.weight")))?;
        let split = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous()?)
        };
        let q = rope(&split(lin(&h, "self_attn.q_proj")?, nh)?)?;
        let k = rope(&split(lin(&h, "self_attn.k_proj")?, nkv)?)?.index_select(&kv_index, 0)?;
        let v = split(lin(&h, "self_attn.v_proj")?, nkv)?.index_select(&kv_index, 0)?;
        let scores = (q.matmul(&k.transpose(1, 2)?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
        let m = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&m)?.exp()?;
        let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let att = probs.matmul(&v)?.transpose(0, 1)?.reshape((t, nh * hd))?;
        x = (x + lin(&att, "self_attn.o_proj")?)?;
        let h = rms(&x, &get(&format!("{p}.post_attention_layernorm.weight")))?;
        let g = lin(&h, "mlp.gate_proj")?;
        let silu = (&g / (g.neg()?.exp()? + 1.0)?)?;
        let mlp = lin(&(silu * lin(&h, "mlp.up_proj")?)?, "mlp.down_proj")?;
        x = (x + mlp)?;
    }
    let x = rms(&x, &get("model.norm.weight"))?;
    let logits = x.matmul(&get("lm_head.weight").t()?)?;
    Ok((0..t)
        .map(|i| logits.i(i)?.to_vec1())
        .collect::<candle_core::Result<_>>()?)
}

#[test]
fn paged_forward_matches_contiguous_reference_with_two_interleaved_sequences() -> Result<()> {
    let cfg = cfg();
    let weights = random_weights(&cfg, 11)?;
    let mut engine = Engine::new(Model::random(cfg.clone(), 11)?, 64)?;
    // Two sequences share the pool and interleave their steps, so neither's blocks are
    // contiguous or in id order.
    let mut seqs = [
        (byte_prompt(1, 37), BlockTable::new()),
        (byte_prompt(2, 20), BlockTable::new()),
    ];
    let mut logits = Vec::new();
    for (tokens, table) in &mut seqs {
        logits.push(vec![engine.prefill(tokens, 0, table)?]);
    }
    for _ in 0..14 {
        for (i, (tokens, table)) in seqs.iter_mut().enumerate() {
            let next = argmax(&logits[i][logits[i].len() - 1]);
            tokens.push(next);
            logits[i].push(engine.decode_step(next, tokens.len() - 1, table)?);
        }
    }
    let gaps = |t: &BlockTable| t.blocks().windows(2).any(|w| w[1].0 != w[0].0 + 1);
    assert!(
        gaps(&seqs[0].1) && gaps(&seqs[1].1),
        "tables interleave in the pool"
    );
    for (i, (tokens, _)) in seqs.iter().enumerate() {
        let reference = reference_logits(&cfg, &weights, tokens)?;
        let prompt_len = tokens.len() - 14;
        let mut worst = 0f32;
        for (step, got) in logits[i].iter().enumerate() {
            let want = &reference[prompt_len - 1 + step];
            let d = max_abs_diff(got, want);
            assert!(d <= REF_TOL, "sequence {i} step {step}: max |diff| {d}");
            worst = worst.max(d);
        }
        eprintln!("sequence {i}: paged vs reference max |diff| {worst:e}");
        // The reference is not trivially flat: logits spread over more than the tolerance.
        let spread = reference[prompt_len - 1]
            .iter()
            .fold(0f32, |m, x| m.max(x.abs()));
        assert!(spread > 100.0 * REF_TOL, "spread {spread}");
    }
    Ok(())
}

/// Prefills `tokens[..prefix_blocks * block_tokens]` in its own engine and returns those
/// blocks' bytes as plain vectors, as kvtier would store them.
fn export_prefix(seed: u64, tokens: &[u32], prefix_blocks: usize) -> Result<Vec<Vec<u8>>> {
    let mut e = Engine::new(Model::random(cfg(), seed)?, 32)?;
    let mut table = BlockTable::new();
    e.prefill(&tokens[..prefix_blocks * cfg().block_tokens], 0, &mut table)?;
    assert_eq!(table.len(), prefix_blocks);
    Ok(table
        .blocks()
        .iter()
        .map(|&b| Ok(e.cache().block_bytes(b)?.to_vec()))
        .collect::<Result<_, WorkerError>>()?)
}

/// A fresh engine with `blocks` written into newly allocated blocks (after one spare, so the
/// ids differ from the exporter's).
fn import_prefix(seed: u64, blocks: &[Vec<u8>]) -> Result<(Engine, BlockTable)> {
    let mut e = Engine::new(Model::random(cfg(), seed)?, 32)?;
    let _spare: BlockId = e.cache_mut().allocate()?;
    let mut ids = Vec::new();
    for bytes in blocks {
        let id = e.cache_mut().allocate()?;
        e.cache_mut().write_block(id, bytes)?;
        ids.push(id);
    }
    Ok((e, BlockTable::from_blocks(ids)))
}

#[test]
fn prefix_blocks_copied_as_bytes_give_the_same_output_as_recomputing() -> Result<()> {
    let seed = 5;
    let bt = cfg().block_tokens;
    let tokens = byte_prompt(3, 2 * bt + 13);
    let mut full = Engine::new(Model::random(cfg(), seed)?, 32)?;
    let mut full_table = BlockTable::new();
    let want = full.prefill(&tokens, 0, &mut full_table)?;
    let (want_tokens, _) = full.decode(
        &mut full_table,
        tokens.len(),
        want.clone(),
        20,
        Sampling::GREEDY,
    )?;

    for k in 1..=2 {
        let blocks = export_prefix(seed, &tokens, k)?;
        let (mut e, mut table) = import_prefix(seed, &blocks)?;
        let got = e.prefill(&tokens, k * bt, &mut table)?;
        let d = max_abs_diff(&got, &want);
        assert!(d <= REUSE_TOL, "{k} blocks reused: max |diff| {d}");
        eprintln!("{k} blocks reused: max |diff| {d:e}");
        let (got_tokens, _) = e.decode(&mut table, tokens.len(), got, 20, Sampling::GREEDY)?;
        assert_eq!(got_tokens, want_tokens, "{k} blocks reused");
        // The loaded blocks were read, not rewritten.
        for (id, bytes) in table.blocks().iter().zip(&blocks) {
            assert_eq!(e.cache().block_bytes(*id)?, bytes.as_slice());
        }
    }

    // Control: the same call over blocks that do NOT hold the prefix (zeros) differs, so the
    // comparison above depends on the copied bytes.
    let zeros = vec![vec![0u8; cfg().kv_layout()?.block_bytes() as usize]; 2];
    let (mut e, mut table) = import_prefix(seed, &zeros)?;
    let got = e.prefill(&tokens, 2 * bt, &mut table)?;
    assert!(max_abs_diff(&got, &want) > 100.0 * REUSE_TOL);
    Ok(())
}

#[test]
fn a_full_prompt_hit_recomputes_only_the_last_token() -> Result<()> {
    let seed = 6;
    let bt = cfg().block_tokens;
    let tokens = byte_prompt(4, 2 * bt);
    let mut full = Engine::new(Model::random(cfg(), seed)?, 32)?;
    let want = full.prefill(&tokens, 0, &mut BlockTable::new())?;

    let blocks = export_prefix(seed, &tokens, 2)?;
    let (mut e, mut table) = import_prefix(seed, &blocks)?;
    let free_before = e.cache().free_blocks();
    // start_pos == len: every position is cached, yet logits are needed.
    let got = e.prefill(&tokens, tokens.len(), &mut table)?;
    assert!(max_abs_diff(&got, &want) <= REUSE_TOL);
    assert_eq!(e.cache().free_blocks(), free_before, "no block allocated");
    // The recomputed last row matches the loaded one (to float precision with the f32
    // attention; within the integer prefill kernel's rounding with it, as the logits).
    let layout = cfg().kv_layout()?;
    let (a, b) = (e.cache().block_bytes(table.blocks()[1])?, &blocks[1]);
    let floats = |x: &[u8]| -> Vec<f32> {
        x.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    assert!(max_abs_diff(&floats(a), &floats(b)) <= REUSE_TOL);
    assert_eq!(a.len() as u64, layout.block_bytes());
    // Past the end is the same as a full hit.
    let again = e.prefill(&tokens, tokens.len() + 7, &mut table)?;
    assert!(max_abs_diff(&again, &want) <= REUSE_TOL);
    Ok(())
}

#[test]
fn prefill_errors() -> Result<()> {
    let mut e = Engine::new(Model::random(cfg(), 1)?, 4)?;
    let mut t = BlockTable::new();
    assert!(matches!(
        e.prefill(&[], 0, &mut t),
        Err(WorkerError::EmptyPrompt)
    ));
    assert!(matches!(
        e.prefill(&byte_prompt(1, 40), 16, &mut t),
        Err(WorkerError::MissingPrefix {
            start_pos: 16,
            covered_tokens: 0
        })
    ));
    assert!(matches!(
        e.prefill(&[256, 999], 0, &mut t),
        Err(WorkerError::TokenOutOfVocab { id: 999, .. })
    ));
    assert!(matches!(
        e.prefill(&byte_prompt(1, 65), 0, &mut t),
        Err(WorkerError::CacheFull { needed: 5, free: 4 })
    ));
    assert_eq!(e.cache().free_blocks(), 4);
    Ok(())
}

#[test]
fn the_seeded_model_is_deterministic() -> Result<()> {
    let tokens = byte_prompt(9, 23);
    let run = |weight_seed, sampling| -> Result<(Vec<f32>, Vec<u32>)> {
        let mut e = Engine::new(Model::random(cfg(), weight_seed)?, 16)?;
        let logits = e.prefill(&tokens, 0, &mut BlockTable::new())?;
        let g = e.generate(&tokens, 12, sampling)?;
        assert_eq!(
            e.cache().free_blocks(),
            16 - tokens.len().div_ceil(16),
            "generate frees its blocks"
        );
        assert_eq!(g.finish, FinishReason::MaxTokens);
        Ok((logits, g.tokens))
    };
    let warm = Sampling {
        temperature: 0.8,
        seed: 3,
    };
    let a = run(1, warm)?;
    assert_eq!(a, run(1, warm)?, "same seeds, same bits");
    assert_eq!(a.1.len(), 12);
    assert_ne!(a.0, run(2, warm)?.0, "another weight seed, other logits");
    assert_ne!(
        a.1,
        run(
            1,
            Sampling {
                temperature: 0.8,
                seed: 4
            }
        )?
        .1,
        "another sampling seed"
    );
    Ok(())
}

#[test]
fn a_hugging_face_directory_loads_to_the_same_model() -> Result<()> {
    let cfg = cfg();
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("config.json"),
        format!(
            r#"{{"vocab_size": {}, "hidden_size": {}, "intermediate_size": {}, "num_hidden_layers": {},
            "num_attention_heads": {}, "num_key_value_heads": {}, "rope_theta": {:.1},
            "rms_norm_eps": {}, "max_position_embeddings": {}}}"#,
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.rope_theta,
            cfg.rms_norm_eps,
            cfg.max_context_tokens
        ),
    )?;
    let weights = random_weights(&cfg, 8)?;
    candle_core::safetensors::save(&weights, dir.path().join("model.safetensors"))?;
    let loaded = Model::from_hf_dir(dir.path(), cfg.block_tokens)?;
    assert_eq!(loaded.config(), &cfg);
    let tokens = byte_prompt(7, 19);
    let a = Engine::new(loaded, 8)?.prefill(&tokens, 0, &mut BlockTable::new())?;
    let b = Engine::new(Model::random(cfg.clone(), 8)?, 8)?.prefill(
        &tokens,
        0,
        &mut BlockTable::new(),
    )?;
    assert_eq!(a, b);

    std::fs::remove_file(dir.path().join("model.safetensors"))?;
    assert!(matches!(
        Model::from_hf_dir(dir.path(), 16),
        Err(WorkerError::Io { .. })
    ));
    assert!(matches!(
        Model::from_hf_dir(&dir.path().join("absent"), 16),
        Err(WorkerError::Io { .. })
    ));
    Ok(())
}

#[test]
fn generation_stops_at_the_context_length() -> Result<()> {
    let cfg = ModelConfig {
        max_context_tokens: 40,
        ..cfg()
    };
    let mut e = Engine::new(Model::random(cfg, 2)?, 8)?;
    let g = e.generate(&byte_prompt(5, 35), 100, Sampling::GREEDY)?;
    // Positions 35..=39 are decoded; the token sampled from position 39's logits is the last.
    assert_eq!(g.finish, FinishReason::ContextFull);
    assert_eq!(g.tokens.len(), 6);
    assert_eq!(e.cache().free_blocks(), 8);
    assert!(matches!(
        e.generate(&byte_prompt(5, 41), 1, Sampling::GREEDY),
        Err(WorkerError::ContextFull {
            tokens: 41,
            max_context_tokens: 40
        })
    ));
    Ok(())
}

/// Continuous batching: one decode step of several sequences in one forward gives each the
/// logits of its own step run alone (sequences of different lengths, one crossing into a new
/// block, several steps in a row).
#[test]
fn a_batched_decode_step_equals_each_sequence_stepped_alone() -> Result<()> {
    let lens = [5usize, 16, 33, 1];
    let mut alone = Engine::new(Model::random(cfg(), 3)?, 64)?;
    let mut batched = Engine::new(Model::random(cfg(), 3)?, 64)?;
    let (mut ta, mut tb): (Vec<BlockTable>, Vec<BlockTable>) =
        (vec![BlockTable::new(); 4], vec![BlockTable::new(); 4]);
    let mut next = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let p = byte_prompt(40 + i as u64, n);
        let a = alone.prefill(&p, 0, &mut ta[i])?;
        batched.prefill(&p, 0, &mut tb[i])?;
        next.push((argmax(&a), n));
    }
    for step in 0..3 {
        let want: Vec<Vec<f32>> = next
            .iter()
            .zip(ta.iter_mut())
            .map(|(&(tok, pos), t)| alone.decode_step(tok, pos, t))
            .collect::<Result<_, _>>()?;
        let mut batch: Vec<(u32, usize, &mut BlockTable)> = next
            .iter()
            .zip(tb.iter_mut())
            .map(|(&(tok, pos), t)| (tok, pos, t))
            .collect();
        let got = batched.decode_batch(&mut batch)?;
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = max_abs_diff(g, w);
            assert!(
                diff <= REUSE_TOL,
                "step {step}, sequence {i}: logits differ by {diff}"
            );
        }
        next = next
            .iter()
            .zip(&want)
            .map(|(&(_, pos), w)| (argmax(w), pos + 1))
            .collect();
    }
    // Same KV in the pools.
    for (a, b) in ta.iter().zip(&tb) {
        for (x, y) in a.blocks().iter().zip(b.blocks()) {
            let (xa, yb) = (
                alone.cache().block_bytes(*x)?,
                batched.cache().block_bytes(*y)?,
            );
            let fa = |v: &[u8]| -> Vec<f32> {
                v.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            assert!(max_abs_diff(&fa(xa), &fa(yb)) <= REUSE_TOL);
        }
    }
    // A token outside the vocabulary fails the batch.
    let (t0, rest) = tb.split_at_mut(1);
    let mut bad: Vec<(u32, usize, &mut BlockTable)> =
        vec![(1, 8, &mut t0[0]), (9999, 19, &mut rest[0])];
    assert!(matches!(
        batched.decode_batch(&mut bad),
        Err(WorkerError::TokenOutOfVocab { id: 9999, .. })
    ));
    Ok(())
}
