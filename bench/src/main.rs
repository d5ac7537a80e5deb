//! kvtier-bench: micro-benchmarks of kvtier's hot paths.
//!
//! * `hash`: the chained prefix hasher (keys/s) for both hash schemes.
//! * `tiers`: the DRAM tier against memcpy and the NVMe tier against plain O_DIRECT I/O.
//! * `lookup`: in-process longest-prefix lookup through the store's index.
//! * `policy`: eviction policies on block-hash traces against LRU and the offline optimum.
//! * `replay`: a block-hash trace replayed against a real server, with verified payloads.
//! * `server`: the sidecar over its transports against memcpy, raw sockets, raw quinn, Redis.
//! * `transfer`: the transfer library (nixlbench-style sweep) against memcpy, raw TCP and quinn.
//!
//! Tables go to stdout (or one JSON document with `--json`, or CSV with `--csv`); plots are
//! written as SVG under `--plots DIR`; progress bars go to stderr. Every run prints its seed.

mod hash;
mod lookup;
mod policy;
mod replay;
mod report;
mod server;
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
    /// DRAM and NVMe tier throughput against memcpy and O_DIRECT pread/pwrite.
    Tiers(tiers::TiersArgs),
    /// In-process longest-prefix lookup of a long prompt (keys/s, latency).
    Lookup(lookup::LookupArgs),
    /// Eviction hit rates on block-hash traces against LRU and the offline optimum.
    Policy(policy::PolicyArgs),
    /// Replays a block-hash trace (Mooncake or Claude Code) against a kvtier server:
    /// hit rate per tier, bytes moved, checksums, against LRU and the offline optimum.
    Replay(replay::ReplayArgs),
    /// The sidecar over Unix (zero-copy), TCP and QUIC against memcpy, raw sockets, raw
    /// quinn and Redis; lookup latency over the Unix socket; server peak RSS.
    Server(server::ServerArgs),
    /// (internal) A server child process for `server`.
    #[command(hide = true)]
    ServeChild {
        #[arg(long = "set")]
        set: Vec<String>,
    },
    /// Transfer library: block size x batch x backend x READ/WRITE against raw references.
    Transfer(transfer::TransferArgs),
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
        if self.json {
            let doc = Document {
                command_line: &self.command_line,
                machine: &self.machine,
                seed: Some(self.seed),
                benchmark,
                result: &result,
            };
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else if self.csv {
            for t in result.tables() {
                println!("{}", t.csv());
            }
        } else {
            println!("command: {}", self.command_line);
            println!("{}", self.machine);
            println!("seed: {}", self.seed);
            for t in result.tables() {
                println!();
                print!("{}", t.render());
            }
        }
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

#[derive(Serialize)]
struct Document<'a, T: Serialize> {
    command_line: &'a str,
    machine: &'a util::Machine,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
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

fn emit<T: Serialize>(
    json: bool,
    command_line: &str,
    machine: &util::Machine,
    benchmark: &'static str,
    result: T,
    table: impl FnOnce(&T),
) -> Result<()> {
    if json {
        let doc = Document {
            command_line,
            machine,
            seed: None,
            benchmark,
            result,
        };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!("command: {command_line}");
        println!("{machine}");
        table(&result);
    }
    Ok(())
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
        Command::Tiers(a) => {
            let r = tiers::run(a)?;
            emit(cli.json, &command_line, &machine, "tiers", r, tiers::print)
        }
        Command::Lookup(a) => {
            let r = lookup::run(a)?;
            emit(
                cli.json,
                &command_line,
                &machine,
                "lookup",
                r,
                lookup::print,
            )
        }
        Command::ServeChild { set } => server::serve_child(set),
        Command::Server(a) => {
            let r = server::run(a)?;
            emit(
                cli.json,
                &command_line,
                &machine,
                "server",
                r,
                server::print,
            )
        }
        Command::Policy(a) => ctx.emit("policy", policy::run(a)?),
        Command::Replay(a) => {
            let r = replay::run(a, ctx.seed)?;
            let corrupt = r.overall.corrupt_blocks;
            ctx.emit("replay", r)?;
            replay::fail_on_corruption(corrupt)
        }
        Command::Transfer(a) => {
            let r = transfer::run(a)?;
            emit(
                cli.json,
                &command_line,
                &machine,
                "transfer",
                r,
                transfer::print,
            )
        }
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
