//! GGUF files written here with candle's writer: the loader's q/k row un-permutation (the
//! inverse of llama.cpp's `LlamaModel.permute`) on quantized rows, and which file a
//! `--model-dir` path names.

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvtier_worker::gguf::{GgufFile, gguf_in};

/// llama.cpp's permutation of an `[n_head * head_dim, cols]` matrix's rows:
/// `w.reshape(n_head, 2, head_dim / 2, cols).swapaxes(1, 2)`.
fn permute(w: &[f32], n_head: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for a in 0..2 {
            for i in 0..half {
                let src = h * head_dim + a * half + i;
                let dst = h * head_dim + 2 * i + a;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn q_and_k_rows_are_unpermuted_without_requantizing() -> Result<()> {
    let (n_head, head_dim, cols) = (3, 8, 64);
    let rows = n_head * head_dim;
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let permuted = Tensor::from_vec(
        permute(&w, n_head, head_dim, cols),
        (rows, cols),
        &Device::Cpu,
    )?;
    let stored = QTensor::quantize(&permuted, GgmlDType::Q4_1)?;
    let want = QTensor::quantize(
        &Tensor::from_vec(w, (rows, cols), &Device::Cpu)?,
        GgmlDType::Q4_1,
    )?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    let arch = Value::String("llama".into());
    gguf_file::write(
        &mut std::fs::File::create(&path)?,
        &[("general.architecture", &arch)],
        &[("blk.0.attn_q.weight", &stored)],
    )?;
    let mut f = GgufFile::open(&path)?;
    let got = f.unpermuted("blk.0.attn_q.weight", n_head)?;
    assert_eq!(got.dtype(), GgmlDType::Q4_1);
    // Each row's blocks moved as they are: the same bytes as quantizing the unpermuted matrix.
    assert_eq!(got.data()?, want.data()?);
    assert!(
        f.unpermuted("blk.0.attn_q.weight", 5).is_err(),
        "24 rows are not 5 heads"
    );
    assert!(f.tensor("blk.0.attn_k.weight").is_err());

    // Which file a path names: the file itself; a directory's only .gguf; a Hugging Face
    // directory (safetensors present) is not a GGUF; two .gguf files are ambiguous.
    assert_eq!(gguf_in(&path)?, Some(path.clone()));
    assert_eq!(gguf_in(dir.path())?, Some(path.clone()));
    std::fs::write(dir.path().join("other.gguf"), b"")?;
    assert!(gguf_in(dir.path()).is_err());
    std::fs::write(dir.path().join("model.safetensors"), b"")?;
    assert_eq!(gguf_in(dir.path())?, None);
    Ok(())
}
