//! The router's configuration: a TOML file (`--config`), flags over it. Every field's doc
//! ends with its default.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::RouterError;
use crate::score::{Costs, Policy};

/// One inference worker behind the router.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The worker's OpenAI-compatible HTTP API, `http://host:port`.
    pub url: String,
    /// The kvtier server the worker loads blocks from (`tcp://`, `quic://` or `unix://`), whose
    /// events tell the router what the worker can load. Workers sharing one server name the
    /// same URL (one subscription). Default: none (no cache knowledge: routed by load).
    #[serde(default)]
    pub kvtier: Option<String>,
    /// Token for that server over TCP/QUIC. Default: the router's `kvtier_token`.
    #[serde(default)]
    pub kvtier_token: Option<String>,
    /// This worker's prefill rate, tokens/s. Default: `costs.prefill_tokens_per_s`.
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
}

/// What serves behind the router: how requests become block keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// `kvtier-worker serve`: keys over the worker's f32 KV layout; requests the workers would
    /// refuse are refused by the router with the same 4xx.
    #[default]
    Kvtier,
    /// vLLM with kvtier's KV connector (`python/kvtier/vllm.py`): keys in the connector's
    /// namespace (`kv_model_id`, `kv_dtype`, `block_tokens` = vLLM's block size,
    /// `tensor_parallel_size`: tensor-parallel rank 0's keys, which vLLM's scheduler looks
    /// up); a request the router cannot analyse is still forwarded (vLLM answers it), routed by
    /// load alone.
    Vllm,
}

impl Engine {
    const ALL: [Engine; 2] = [Engine::Kvtier, Engine::Vllm];

    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Kvtier => "kvtier",
            Engine::Vllm => "vllm",
        }
    }

    /// The engine named as in the config file (`--engine`).
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| format!("unknown engine {s:?} (kvtier, vllm)"))
    }
}

/// Everything the router runs with.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// HTTP listen address. Default: 127.0.0.1:8080.
    pub listen: String,
    pub workers: Vec<WorkerConfig>,
    /// Token for the workers' kvtier servers over TCP/QUIC. Default: `KVTIER_TOKEN`.
    pub kvtier_token: Option<String>,
    /// The model as the workers load it (`kvtier-worker serve --model-dir`): only its
    /// configuration, tokenizer and chat template are read. Default: the built-in
    /// random-weight model (byte tokenizer).
    pub model_dir: Option<PathBuf>,
    /// The served model name, part of every block key (the workers' `--model-name`).
    /// Default: "kvtier-tiny".
    pub model_name: String,
    /// Tokens per KV block, as the workers (vLLM: its `--block-size`). Default: 16.
    pub block_tokens: usize,
    /// What the workers are: "kvtier" (kvtier-worker) or "vllm" (vLLM with kvtier's KV
    /// connector). Default: "kvtier".
    pub engine: Engine,
    /// The model id in the block keys' namespace: the workers' `--model-name` (kvtier), the
    /// connector's `model_id` setting, else vLLM's `--model` argument (vllm). Default:
    /// `model_name`.
    pub kv_model_id: Option<String>,
    /// The workers' KV cache dtype, part of the keys' namespace: "f32" for kvtier-worker;
    /// vLLM's `--dtype` as it resolved it ("bf16", "f16" or "f32"; the connector needs
    /// `kv_cache_dtype` auto). Default: "f32" (kvtier); required with engine "vllm".
    pub kv_dtype: Option<String>,
    /// The workers' tensor-parallel size, part of the keys' namespace (vllm). Default: 1.
    pub tensor_parallel_size: u32,
    /// The deployment's block-key secret, as the workers' `--hash-secret-file`. Default: the
    /// public development secret.
    pub hash_secret_file: Option<PathBuf>,
    pub costs: Costs,
    /// How workers are chosen: "kv" (expected time to first token), or the baselines
    /// "round_robin", "least_loaded", "random" and "session_sticky" (by the request's
    /// `x-session-id` header or OpenAI `user` field), all of which ignore the caches.
    /// Default: "kv".
    pub policy: Policy,
    /// Most blocks tracked per kvtier server (see `index`). Default: 1,048,576.
    pub max_blocks_per_server: usize,
    /// How often each worker's `/health` is asked. Default: 1000 ms.
    pub health_interval_ms: u64,
    /// Deadline of one forwarded request, head and whole body. Default: 600 s.
    pub request_timeout_s: u64,
    /// Connect timeout to a worker. Default: 2000 ms.
    pub connect_timeout_ms: u64,
    /// Disagreements in a row between predicted and reported cached tokens before a key
    /// mismatch is reported. Default: 5.
    pub mismatch_streak: u64,
    /// Cached tokens below which neither side's figure counts as evidence. Default: 32.
    pub mismatch_min_tokens: u64,
    /// How long a block the router sent a worker counts as held by that worker before (or
    /// without) its server's events saying so (`kv` policy; 0 turns it off). Default: 20000 ms.
    pub recent_route_ttl_ms: u64,
    /// Most such blocks remembered per worker (about 60 bytes each). Default: 65,536.
    pub max_recent_blocks_per_worker: usize,
    /// How long the worker that answered a session's last request stays the session's home
    /// (`kv` policy: `score::kv_order`; 0 turns session affinity off). Default: 3,600,000 ms.
    pub session_ttl_ms: u64,
    /// Most sessions remembered (about 100 bytes plus twice the id each; 0 turns session
    /// affinity off). Default: 65,536.
    pub max_sessions: usize,
    /// How long after its last request a session counts as active at its home: a new
    /// session goes to the worker the fewest active sessions call home (`kv` policy; 0: new
    /// sessions by load alone; at most `session_ttl_ms`). Default: 60,000 ms.
    pub session_active_ms: u64,
    /// The workers' kvtier servers are members of one kvtier cluster (`docs/cluster.md`):
    /// a block any of them holds counts, for every worker, as loadable after its own prefix,
    /// at `costs.cluster_bytes_per_s` or the rate measured from the worker's loads of such
    /// blocks (its server fetches it from the owner). Default: false.
    pub cluster: bool,
    /// Workers from a kvtier cluster's membership: the cluster's etcd client URLs
    /// (`http://HOST:PORT`, comma-separated; "" is off). Every member whose record names a
    /// worker (the server's `cluster.worker_url`) is a worker, its kvtier server the member's
    /// data endpoint; a member that joins is added, one that leaves is no candidate until it
    /// is back (`docs/router.md`, "Workers from the cluster"). Beside `workers`, or instead.
    /// Needs the router built with the `cluster` feature. Default: "".
    pub cluster_etcd: String,
    /// The cluster's name, as its servers' `cluster.name` (etcd prefix `/kvtier/<name>/`).
    /// Default: "kvtier".
    pub cluster_name: String,
    /// The cluster secret, as its servers' `cluster.secret_file`: member records not signed
    /// with it are refused. Default: none (only unsigned records are accepted).
    pub cluster_secret_file: Option<PathBuf>,
    /// Most workers the membership may add over the router's life (a worker whose member
    /// left keeps its place). Default: 1024.
    pub max_cluster_workers: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            workers: Vec::new(),
            kvtier_token: std::env::var("KVTIER_TOKEN").ok().filter(|t| !t.is_empty()),
            model_dir: None,
            model_name: "kvtier-tiny".into(),
            block_tokens: 16,
            engine: Engine::Kvtier,
            kv_model_id: None,
            kv_dtype: None,
            tensor_parallel_size: 1,
            hash_secret_file: None,
            costs: Costs::default(),
            policy: Policy::Kv,
            max_blocks_per_server: 1 << 20,
            health_interval_ms: 1000,
            request_timeout_s: 600,
            connect_timeout_ms: 2000,
            mismatch_streak: 5,
            mismatch_min_tokens: 32,
            recent_route_ttl_ms: 20_000,
            max_recent_blocks_per_worker: 1 << 16,
            session_ttl_ms: 3_600_000,
            max_sessions: 1 << 16,
            session_active_ms: 60_000,
            cluster: false,
            cluster_etcd: String::new(),
            cluster_name: "kvtier".into(),
            cluster_secret_file: None,
            max_cluster_workers: 1024,
        }
    }
}

fn bad(field: &str, reason: impl Into<String>) -> RouterError {
    RouterError::Config {
        field: field.into(),
        reason: reason.into(),
    }
}

impl RouterConfig {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, RouterError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
        Self::from_toml(&text).map_err(|e| match e {
            RouterError::Config { field, reason } => {
                bad(&field, format!("{}: {reason}", path.display()))
            }
            e => e,
        })
    }

    pub fn from_toml(text: &str) -> Result<Self, RouterError> {
        toml::from_str(text).map_err(|e| bad("(toml)", e.to_string()))
    }

    /// Parses a `--worker` flag: `HTTP_URL[,kvtier=URL][,token=T][,prefill_tokens_per_s=R]`.
    pub fn parse_worker_flag(s: &str) -> Result<WorkerConfig, RouterError> {
        let mut parts = s.split(',');
        let url = parts.next().unwrap_or_default().trim().to_string();
        let mut w = WorkerConfig {
            url,
            kvtier: None,
            kvtier_token: None,
            prefill_tokens_per_s: None,
        };
        for p in parts {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| bad("--worker", format!("{s:?}: {p:?} is not key=value")))?;
            match k.trim() {
                "kvtier" => w.kvtier = Some(v.trim().to_string()),
                "token" => w.kvtier_token = Some(v.to_string()),
                "prefill_tokens_per_s" => {
                    w.prefill_tokens_per_s = Some(v.trim().parse().map_err(|e| {
                        bad(
                            "--worker",
                            format!("{s:?}: prefill_tokens_per_s {v:?}: {e}"),
                        )
                    })?)
                }
                other => {
                    return Err(bad(
                        "--worker",
                        format!(
                            "{s:?}: unknown key {other:?} (kvtier, token, prefill_tokens_per_s)"
                        ),
                    ));
                }
            }
        }
        Ok(w)
    }

    /// Checks what can be checked before starting.
    pub fn check(&self) -> Result<(), RouterError> {
        if self.workers.is_empty() && self.cluster_etcd.is_empty() {
            return Err(bad(
                "workers",
                "no worker configured (--worker, [[workers]], or the cluster's membership: \
                 --cluster-etcd)",
            ));
        }
        self.check_membership()?;
        for (i, w) in self.workers.iter().enumerate() {
            kvtier_client::http::parse_url(&w.url)
                .map_err(|e| bad(&format!("workers[{i}].url"), e.to_string()))?;
            if let Some(k) = &w.kvtier
                && !["tcp://", "quic://", "unix://"]
                    .iter()
                    .any(|p| k.starts_with(p))
            {
                return Err(bad(
                    &format!("workers[{i}].kvtier"),
                    format!("{k:?} is not tcp://, quic:// or unix://"),
                ));
            }
            if let Some(r) = w.prefill_tokens_per_s
                && !(r.is_finite() && r > 0.0)
            {
                return Err(bad(
                    &format!("workers[{i}].prefill_tokens_per_s"),
                    format!("must be a positive number, got {r}"),
                ));
            }
        }
        for (i, a) in self.workers.iter().enumerate() {
            if self.workers[..i].iter().any(|b| b.url == a.url) {
                return Err(bad("workers", format!("{} is listed twice", a.url)));
            }
        }
        self.costs.check().map_err(|e| bad("costs", e))?;
        self.kv_dtype()?;
        if self.tensor_parallel_size == 0 {
            return Err(bad("tensor_parallel_size", "must be at least 1"));
        }
        if self.engine == Engine::Kvtier && self.tensor_parallel_size != 1 {
            return Err(bad(
                "tensor_parallel_size",
                "kvtier-worker has no tensor parallelism (engine \"vllm\" only)",
            ));
        }
        if self.kv_model_id.as_deref() == Some("") {
            return Err(bad("kv_model_id", "must not be empty"));
        }
        if self.max_blocks_per_server == 0 {
            return Err(bad("max_blocks_per_server", "must be at least 1"));
        }
        for (name, v) in [
            ("health_interval_ms", self.health_interval_ms),
            ("request_timeout_s", self.request_timeout_s),
            ("connect_timeout_ms", self.connect_timeout_ms),
        ] {
            if v == 0 {
                return Err(bad(name, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The etcd client URLs of `cluster_etcd`, blanks dropped.
    pub fn cluster_etcd_endpoints(&self) -> Vec<String> {
        self.cluster_etcd
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    }

    fn check_membership(&self) -> Result<(), RouterError> {
        if self.cluster_etcd.is_empty() {
            return Ok(());
        }
        if !cfg!(feature = "cluster") {
            return Err(bad(
                "cluster_etcd",
                "this kvtier-router was built without the `cluster` feature (cargo build -p \
                 kvtier-router --features cluster; it needs protoc)",
            ));
        }
        let endpoints = self.cluster_etcd_endpoints();
        if endpoints.is_empty() {
            return Err(bad("cluster_etcd", "no etcd URL"));
        }
        for e in &endpoints {
            kvtier_client::http::parse_url(e).map_err(|_| {
                bad(
                    "cluster_etcd",
                    format!("{e:?} is not an etcd URL (http://HOST:PORT)"),
                )
            })?;
        }
        let name_ok = !self.cluster_name.is_empty()
            && self.cluster_name.len() <= 128
            && self
                .cluster_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !name_ok {
            return Err(bad(
                "cluster_name",
                "must be 1-128 letters, digits, '.', '_' or '-' (the servers' cluster.name)",
            ));
        }
        if self.max_cluster_workers == 0 {
            return Err(bad("max_cluster_workers", "must be at least 1"));
        }
        Ok(())
    }

    /// The workers' KV cache dtype (`kv_dtype`, checked against the engine).
    pub fn kv_dtype(&self) -> Result<kvtier_core::Dtype, RouterError> {
        let name = match (self.engine, self.kv_dtype.as_deref()) {
            (Engine::Kvtier, None) => return Ok(kvtier_core::Dtype::F32),
            (Engine::Vllm, None) => {
                return Err(bad(
                    "kv_dtype",
                    "required with engine \"vllm\": vLLM's KV cache dtype (its --dtype as \
                     resolved: bf16, f16 or f32), part of every block key",
                ));
            }
            (_, Some(n)) => n,
        };
        // vLLM's and torch's spellings too.
        let canonical = match name {
            "bfloat16" => "bf16",
            "float16" | "half" => "f16",
            "float32" | "float" => "f32",
            n => n,
        };
        let d = kvtier_core::Dtype::parse(canonical).map_err(|e| bad("kv_dtype", e.to_string()))?;
        match (self.engine, d) {
            (Engine::Kvtier, kvtier_core::Dtype::F32) => Ok(d),
            (Engine::Kvtier, _) => Err(bad(
                "kv_dtype",
                format!("kvtier-worker keeps its KV in f32, not {name}"),
            )),
            (
                Engine::Vllm,
                kvtier_core::Dtype::F32 | kvtier_core::Dtype::F16 | kvtier_core::Dtype::Bf16,
            ) => Ok(d),
            (Engine::Vllm, _) => Err(bad(
                "kv_dtype",
                format!("kvtier's vLLM connector supports bf16, f16 and f32, not {name}"),
            )),
        }
    }

    /// The model id of the keys' namespace.
    pub fn kv_model_id(&self) -> &str {
        self.kv_model_id.as_deref().unwrap_or(&self.model_name)
    }

    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_with_every_section_parses() {
        let c = RouterConfig::from_toml(
            r#"
            listen = "0.0.0.0:9000"
            model_name = "m"
            [costs]
            prefill_tokens_per_s = 500.0
            [[workers]]
            url = "http://10.0.0.1:8000"
            kvtier = "tcp://10.0.0.1:7000"
            kvtier_token = "t"
            [[workers]]
            url = "http://10.0.0.2:8000"
            "#,
        )
        .unwrap();
        assert_eq!(c.listen, "0.0.0.0:9000");
        assert_eq!(c.costs.prefill_tokens_per_s, 500.0);
        assert_eq!(c.costs.dram_bytes_per_s, Costs::default().dram_bytes_per_s);
        assert_eq!(c.workers.len(), 2);
        assert_eq!(c.workers[0].kvtier.as_deref(), Some("tcp://10.0.0.1:7000"));
        assert_eq!(c.workers[1].kvtier, None);
        c.check().unwrap();
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        let e = RouterConfig::from_toml("listen = 1").unwrap_err();
        assert!(e.to_string().contains("listen"), "{e}");
        let e = RouterConfig::from_toml("nope = 1").unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let check = |toml: &str, field: &str| {
            let e = RouterConfig::from_toml(toml).unwrap().check().unwrap_err();
            assert!(e.to_string().contains(field), "{toml}: {e}");
        };
        check("", "no worker");
        check("[[workers]]\nurl = \"ftp://x\"", "workers[0].url");
        check(
            "[[workers]]\nurl = \"http://a:1\"\nkvtier = \"http://b:2\"",
            "workers[0].kvtier",
        );
        check(
            "[[workers]]\nurl = \"http://a:1\"\n[[workers]]\nurl = \"http://a:1\"",
            "twice",
        );
        check(
            "[costs]\ndram_bytes_per_s = 0.0\n[[workers]]\nurl = \"http://a:1\"",
            "dram_bytes_per_s",
        );
        check(
            "max_blocks_per_server = 0\n[[workers]]\nurl = \"http://a:1\"",
            "max_blocks_per_server",
        );
        let w = "[[workers]]\nurl = \"http://a:1\"";
        check(&format!("engine = \"vllm\"\n{w}"), "kv_dtype");
        check(&format!("kv_dtype = \"bf16\"\n{w}"), "kv_dtype");
        check(
            &format!("engine = \"vllm\"\nkv_dtype = \"fp8e4m3\"\n{w}"),
            "kv_dtype",
        );
        check(
            &format!("engine = \"vllm\"\nkv_dtype = \"int4\"\n{w}"),
            "kv_dtype",
        );
        check(
            &format!("tensor_parallel_size = 2\n{w}"),
            "tensor_parallel_size",
        );
        check(
            &format!("engine = \"vllm\"\nkv_dtype = \"f16\"\ntensor_parallel_size = 0\n{w}"),
            "tensor_parallel_size",
        );
        check(&format!("kv_model_id = \"\"\n{w}"), "kv_model_id");
        let e = RouterConfig::from_toml("engine = \"sglang\"").unwrap_err();
        assert!(e.to_string().contains("engine"), "{e}");
        // The flag's names are the file's.
        for e in Engine::ALL {
            let toml = format!("engine = \"{}\"", e.as_str());
            assert_eq!(RouterConfig::from_toml(&toml).unwrap().engine, e);
            assert_eq!(Engine::parse(e.as_str()), Ok(e));
        }
        assert!(Engine::parse("sglang").is_err());
    }

    #[test]
    fn the_engine_sets_the_keys_namespace() {
        let w = "[[workers]]\nurl = \"http://a:1\"";
        let c = RouterConfig::from_toml(w).unwrap();
        assert_eq!(c.kv_dtype().unwrap(), kvtier_core::Dtype::F32);
        assert_eq!(c.kv_model_id(), "kvtier-tiny");
        for (name, want) in [
            ("bfloat16", kvtier_core::Dtype::Bf16),
            ("bf16", kvtier_core::Dtype::Bf16),
            ("float16", kvtier_core::Dtype::F16),
            ("float32", kvtier_core::Dtype::F32),
        ] {
            let c = RouterConfig::from_toml(&format!(
                "engine = \"vllm\"\nkv_dtype = \"{name}\"\nkv_model_id = \"/m\"\n{w}"
            ))
            .unwrap();
            c.check().unwrap();
            assert_eq!(c.kv_dtype().unwrap(), want, "{name}");
            assert_eq!(c.kv_model_id(), "/m");
        }
    }

    #[test]
    fn worker_flags() {
        let w = RouterConfig::parse_worker_flag(
            "http://h:1,kvtier=tcp://h:2,token=abc,prefill_tokens_per_s=10",
        )
        .unwrap();
        assert_eq!(w.url, "http://h:1");
        assert_eq!(w.kvtier.as_deref(), Some("tcp://h:2"));
        assert_eq!(w.kvtier_token.as_deref(), Some("abc"));
        assert_eq!(w.prefill_tokens_per_s, Some(10.0));
        assert_eq!(
            RouterConfig::parse_worker_flag("http://h:1")
                .unwrap()
                .kvtier,
            None
        );
        for bad in [
            "http://h:1,kvtier",
            "http://h:1,x=1",
            "http://h:1,prefill_tokens_per_s=q",
        ] {
            assert!(RouterConfig::parse_worker_flag(bad).is_err(), "{bad}");
        }
    }
}
