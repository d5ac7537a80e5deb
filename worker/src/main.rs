//! `kvtier-worker serve ...` runs the OpenAI-compatible worker (see `docs/worker.md`);
//! `kvtier-worker generate --prompt TEXT --max-tokens N` runs the built-in random-weight model
//! (or a Hugging Face directory) once and prints the text and speed.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvtier_core::HashSecret;
use kvtier_worker::serve::{Role, ServeConfig, WorkerServer};
use kvtier_worker::{DeviceSpec, Engine, Model, ModelConfig, Sampling, Tokenizer, load_pretrained};

#[derive(Parser)]
#[command(
    name = "kvtier-worker",
    version,
    about = "kvtier reference inference worker"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API. Prints `listening http=IP:PORT` when ready.
    Serve {
        /// HTTP listen address (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: String,
        /// kvtier sidecar: unix:///path, tcp://host:port, tls://host:port, quic://host:port, or
        /// off.
        #[arg(long, default_value = "off")]
        sidecar: String,
        /// Token for a tcp/tls/quic sidecar (default: KVTIER_TOKEN).
        #[arg(long)]
        sidecar_token: Option<String>,
        /// The sidecar's certificate in DER (the server writes its generated one to
        /// `<runtime_dir>/quic-cert.der`), pinned for a tls:// or quic:// sidecar.
        #[arg(long)]
        sidecar_cert: Option<PathBuf>,
        /// File holding the deployment's block-key secret (at least 16 bytes; a trailing
        /// newline is ignored). Without it the public development secret is used.
        #[arg(long)]
        hash_secret_file: Option<PathBuf>,
        /// The model: a Llama GGUF file (weights kept quantized; tokenizer and chat template
        /// from its metadata; CPU only), a directory holding one .gguf and no safetensors, or a
        /// Hugging Face Llama directory (config.json + *.safetensors; tokenizer.json when
        /// present, else prompts are byte-tokenized).
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Served model name; requests naming another model get 404.
        #[arg(long, default_value = "kvtier-tiny")]
        model_name: String,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// KV pool size in blocks.
        #[arg(long, default_value_t = 2048)]
        pool_blocks: usize,
        /// Sequences running at once.
        #[arg(long, default_value_t = 8)]
        max_batch: usize,
        /// both | prefill (also serves POST /kvtier/prefill) | decode (needs --prefill-url).
        #[arg(long, default_value = "both")]
        role: String,
        /// The prefill worker's URL, http://host:port (role decode only).
        #[arg(long)]
        prefill_url: Option<String>,
        /// Backend the prefill worker writes KV over: shm (one host), tcp or quic. Give the
        /// prefill and the decode worker the same. The transfer agent listens on the
        /// --listen IP.
        #[arg(long, default_value = "shm")]
        transfer_backend: String,
        /// Where the model and its KV pool run: cpu, cuda or cuda:N (a `cuda` build).
        #[arg(long, default_value = "cpu")]
        device: DeviceSpec,
        /// Keep no prefix cache in the KV pool (finished sequences' blocks are freed at once;
        /// only the sidecar, if any, serves repeated prefixes).
        #[arg(long)]
        no_prefix_cache: bool,
    },
    /// Generate text from a prompt and report prefill and decode speed.
    Generate {
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Seed of the random weights (and of sampling when --temperature > 0).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// A Llama GGUF file (or a directory holding one and no safetensors), or a Hugging
        /// Face Llama directory (config.json + *.safetensors, and tokenizer.json, without which
        /// prompts are byte-tokenized).
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Tokens per KV block.
        #[arg(long, default_value_t = 16)]
        block_tokens: usize,
        /// KV pool size in blocks.
        #[arg(long, default_value_t = 1024)]
        kv_blocks: usize,
        /// Where the model and its KV pool run: cpu, cuda or cuda:N (a `cuda` build).
        #[arg(long, default_value = "cpu")]
        device: DeviceSpec,
    },
}

fn read_secret(path: &std::path::Path) -> anyhow::Result<HashSecret> {
    kvtier_worker::prompt_side::read_hash_secret(path)
        .with_context(|| format!("--hash-secret-file {}", path.display()))
}

async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let server = WorkerServer::start(config).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening http={}", server.addr())?;
        out.flush()?;
    }
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("interrupt: draining"),
    }
    server.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// Reads the sidecar's QUIC certificate (DER).
fn read_cert(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    let bytes = std::fs::read(path)
        .with_context(|| format!("--sidecar-cert {}: cannot read", path.display()))?;
    if bytes.starts_with(b"-----BEGIN") {
        anyhow::bail!(
            "--sidecar-cert {}: a PEM file; give the DER form (the server writes \
             <runtime_dir>/quic-cert.der; or `openssl x509 -outform der`)",
            path.display()
        );
    }
    if bytes.is_empty() {
        anyhow::bail!("--sidecar-cert {}: empty file", path.display());
    }
    Ok(bytes)
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve {
            listen,
            sidecar,
            sidecar_token,
            sidecar_cert,
            hash_secret_file,
            model_dir,
            model_name,
            seed,
            pool_blocks,
            max_batch,
            role,
            prefill_url,
            transfer_backend,
            device,
            no_prefix_cache,
        } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let hash_secret = hash_secret_file.as_deref().map(read_secret).transpose()?;
            let sidecar_quic_cert_der = sidecar_cert.as_deref().map(read_cert).transpose()?;
            let config = ServeConfig {
                listen,
                sidecar: (sidecar != "off").then_some(sidecar),
                sidecar_token,
                sidecar_quic_cert_der,
                hash_secret,
                model_dir,
                model_name,
                seed,
                pool_blocks,
                max_batch,
                role: Role::parse(&role)?,
                prefill_url,
                transfer_backend: kvtier_worker::disagg::parse_backend(&transfer_backend)?,
                device,
                prefix_cache: !no_prefix_cache,
                ..ServeConfig::default()
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("kvtier-worker")
                .build()?;
            rt.block_on(serve(config))
        }
        Command::Generate {
            prompt,
            max_tokens,
            seed,
            temperature,
            model_dir,
            block_tokens,
            kv_blocks,
            device,
        } => {
            let (model, tok) = match &model_dir {
                Some(dir) => load_pretrained(dir, block_tokens)
                    .with_context(|| format!("loading {}", dir.display()))?,
                None => (
                    Model::random(
                        ModelConfig {
                            block_tokens,
                            ..ModelConfig::default()
                        },
                        seed,
                    )?,
                    Tokenizer::Byte,
                ),
            };
            let model = model.to_device(device)?;
            let cfg = model.config().clone();
            let layout = cfg.kv_layout()?;
            println!(
                "model: {} ({} layers, hidden {}, {} heads / {} kv heads x {}, vocab {}), {} parameters, KV {} bytes/token ({} bytes per {}-token block), on {}",
                model_dir
                    .as_ref()
                    .map_or("random weights".to_owned(), |d| d.display().to_string()),
                cfg.num_layers,
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.vocab_size,
                cfg.param_count(),
                layout.bytes_per_token(),
                layout.block_bytes(),
                cfg.block_tokens,
                device,
            );
            let ids = tok.encode(&prompt, true)?;
            let mut engine = Engine::new(model, kv_blocks)?;
            engine.set_eos(tok.eos());
            let g = engine.generate(&ids, max_tokens, Sampling { temperature, seed })?;
            println!("{:?}", tok.decode(&g.tokens)?);
            let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
            println!(
                "prefill: {} tokens in {:.1} ms ({:.0} tokens/s)",
                g.prompt_tokens,
                g.prefill_time.as_secs_f64() * 1e3,
                rate(g.prompt_tokens, g.prefill_time)
            );
            // The first generated token comes from the prefill's logits.
            let steps = g.tokens.len().saturating_sub(1);
            println!(
                "decode: {} steps in {:.1} ms ({:.0} tokens/s), stop: {:?}",
                steps,
                g.decode_time.as_secs_f64() * 1e3,
                rate(steps, g.decode_time),
                g.finish
            );
            Ok(())
        }
    }
}
