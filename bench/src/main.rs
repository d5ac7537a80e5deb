//! kvtier-bench: micro-benchmarks of kvtier's hot paths.
//!
//! * `hash`: the chained prefix hasher (keys/s) for both hash schemes.
//! * `tiers`: per tier (DRAM, NVMe) and block size, put/get GB/s and latency in-process and
//!   through the sidecar (unix zero-copy, TCP, QUIC) against memcpy, O_DIRECT I/O, raw
//!   loopback TCP, raw quinn and Redis, all in the same run, with the ratios.
//! * `lookup`: in-process longest-prefix lookup through the store's index.
//! * `policy`: eviction policies on block-hash traces against LRU and the offline optimum.
//! * `replay`: a block-hash trace replayed against a real server, with verified payloads.
//! * `server`: `tiers --parts server` (the sidecar over its transports only).
//! * `transfer`: the transfer library (nixlbench-style sweep) against memcpy, raw TCP and quinn.
//! * `demo`: the README's main command (an embedded server and workers, cache off vs on).
//! * `server-demo`: the server's demonstration (an embedded server, a worker over every
//!   transport through the SDK, a restart that finds the cache warm on NVMe).
//! * `agentic`: agentic sessions driven closed-loop against OpenAI-compatible endpoints, side by
//!   side across configurations (cache off, DRAM, DRAM + NVMe, disaggregated).
//!
//! Tables go to stdout (or one JSON document with `--json`, or CSV with `--csv`); plots are
//! written as SVG under `--plots DIR`; progress bars go to stderr. Every run prints its seed.

mod agentic;
mod demo;
mod hash;
mod lookup;
mod policy;
mod replay;
mod report;
mod server_demo;
mod tiers;
mod trace;
mod transfer;
mod util;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(name = "kvtier-bench", version, about = "kvtier benchmarks")]
struct Cli {
    /// Print one JSON document instead of tables.
    #[arg(long, global = true, conflicts_with = "csv")]
    json: bool,
    /// Print the tables as CSV (one block per table, after a `# title` line).
    #[arg(long, global = true)]
    csv: bool,
    /// Write plots (SVG) into this directory (created if missing).
    #[arg(long, global = true, value_name = "DIR")]
    plots: Option<std::path::PathBuf>,
    /// Seed of every pseudo-random choice of the run (workloads, payloads).
    #[arg(long, global = true, default_value_t = DEFAULT_SEED)]
    seed: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prefix hasher throughput (keys/s) for xxh3 and blake3.
    Hash(hash::HashArgs),
    /// Per tier and block size: put/get GB/s and latency in-process and through the sidecar
    /// (unix zero-copy, TCP, QUIC) against memcpy, O_DIRECT I/O, raw loopback TCP, raw
    /// quinn and Redis, measured in the same run, with the ratios.
    Tiers(tiers::TiersArgs),
    /// In-process longest-prefix lookup of a long prompt (keys/s, latency).
    Lookup(lookup::LookupArgs),
    /// Eviction hit rates on block-hash traces against LRU and the offline optimum.
    Policy(policy::PolicyArgs),
    /// Replays a block-hash trace (Mooncake or Claude Code) against a kvtier server:
    /// hit rate per tier, bytes moved, checksums, against LRU and the offline optimum.
    Replay(replay::ReplayArgs),
    /// `tiers` with `--parts server` by default: the sidecar over Unix (zero-copy), TCP and
    /// QUIC against memcpy, raw sockets, raw quinn and Redis; lookup latency over the Unix
    /// socket; server peak RSS.
    Server(tiers::TiersArgs),
    /// (internal) A server child process for `server`.
    #[command(hide = true)]
    ServeChild {
        #[arg(long = "set")]
        set: Vec<String>,
    },
    /// Transfer library: block size x batch x backend x READ/WRITE against raw references.
    Transfer(transfer::TransferArgs),
    /// Agentic sessions against OpenAI-compatible endpoints (TTFT, ITL, e2e, goodput, prefix
    /// hit rate), one or several configurations side by side.
    Agentic(Box<agentic::AgenticArgs>),
    /// The one-command demo: an embedded kvtier server and two reference workers (cache off,
    /// kvtier on) driven with the same agentic workload, side by side.
    Demo(demo::DemoArgs),
    /// The server's demonstration: an embedded kvtier server, a worker over every transport
    /// through the SDK (unix zero-copy, TCP, QUIC), then a restart that finds the cache warm
    /// on NVMe.
    ServerDemo(server_demo::ServerDemoArgs),
}

/// The seed when `--seed` is not given.
pub const DEFAULT_SEED: u64 = 0x6b76_7469_6572;

/// What every benchmark gets besides its own arguments.
pub struct Ctx {
    pub command_line: String,
    pub machine: util::Machine,
    pub json: bool,
    pub csv: bool,
    pub plots: Option<std::path::PathBuf>,
    pub seed: u64,
}

impl Ctx {
    /// Prints `result` as JSON, CSV or tables, and writes its plots.
    pub fn emit<T: report::Report>(&self, benchmark: &'static str, result: T) -> Result<()> {
        let mut out = String::new();
        if self.json {
            let doc = Document {
                command_line: &self.command_line,
                machine: &self.machine,
                seed: self.seed,
                benchmark,
                result: &result,
            };
            out = serde_json::to_string_pretty(&doc)?;
            out.push('\n');
        } else if self.csv {
            for t in result.tables() {
                out.push_str(&t.csv());
                out.push('\n');
            }
        } else {
            out.push_str(&format!(
                "command: {}\n{}\nseed: {}\n",
                self.command_line, self.machine, self.seed
            ));
            for t in result.tables() {
                out.push('\n');
                out.push_str(&t.render());
            }
        }
        write_stdout(&out)?;
        if let Some(dir) = &self.plots {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create plot directory {}", dir.display()))?;
            for p in result.plots() {
                let path = p.write(dir)?;
                eprintln!("plot: {}", path.display());
            }
        }
        Ok(())
    }
}

/// Writes to stdout; a reader that went away (`| head`) ends the output quietly.
fn write_stdout(s: &str) -> Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(s.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).context("cannot write to stdout")
        }
        _ => Ok(()),
    }
}

#[derive(Serialize)]
struct Document<'a, T: Serialize> {
    command_line: &'a str,
    machine: &'a util::Machine,
    seed: u64,
    benchmark: &'static str,
    result: T,
}

fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./,=:+%@".contains(&b));
    if plain {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let command_line = std::env::args_os()
        .map(|a| shell_quote(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ");
    let cli = Cli::parse();
    let machine = util::Machine::probe();
    let ctx = Ctx {
        command_line: command_line.clone(),
        machine: machine.clone(),
        json: cli.json,
        csv: cli.csv,
        plots: cli.plots.clone(),
        seed: cli.seed,
    };
    match &cli.command {
        Command::Hash(a) => ctx.emit("hash", hash::run(a, ctx.seed)?),
        Command::Demo(a) => {
            let r = demo::run(a, ctx.seed)?;
            let failures = r.failures();
            ctx.emit("demo", r)?;
            failures
        }
        Command::Agentic(a) => {
            let r = agentic::run(a, ctx.seed, true)?;
            let failures = r.failures();
            ctx.emit("agentic", r)?;
            failures
        }
        Command::Tiers(a) => ctx.emit(
            "tiers",
            tiers::run(a, &[tiers::Part::Store, tiers::Part::Server], ctx.seed)?,
        ),
        Command::Lookup(a) if !a.servers.is_empty() => {
            ctx.emit("cluster-lookup", lookup::run_cluster(a, ctx.seed)?)
        }
        Command::Lookup(a) => ctx.emit("lookup", lookup::run(a, ctx.seed)?),
        Command::ServeChild { set } => tiers::server::serve_child(set),
        Command::Server(a) => ctx.emit("server", tiers::run(a, &[tiers::Part::Server], ctx.seed)?),
        Command::Policy(a) => ctx.emit("policy", policy::run(a)?),
        Command::Replay(a) => {
            let r = replay::run(a, ctx.seed)?;
            let corrupt = r.overall.corrupt_blocks;
            ctx.emit("replay", r)?;
            replay::fail_on_corruption(corrupt)
        }
        Command::Transfer(a) => ctx.emit("transfer", transfer::run(a, ctx.seed)?),
        Command::ServerDemo(a) => server_demo::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_only_when_needed() {
        assert_eq!(shell_quote("--sizes"), "--sizes");
        assert_eq!(shell_quote("64k,2m"), "64k,2m");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
