//! kvtier-bench: micro-benchmarks of kvtier's hot paths.
//!
//! * `hash`: the chained prefix hasher (keys/s) for both hash schemes.
//! * `tiers`: the DRAM tier against memcpy and the NVMe tier against plain O_DIRECT I/O.
//! * `lookup`: in-process longest-prefix lookup through the store's index.
//! * `policy`: eviction policies on block-hash traces against LRU and the offline optimum.
//! * `server`: the sidecar over its transports against memcpy, raw sockets, raw quinn, Redis.
//! * `transfer`: the transfer library (nixlbench-style sweep) against memcpy, raw TCP and quinn.
//!
//! Tables go to stdout (or one JSON document with `--json`); progress goes to stderr.

mod hash;
mod lookup;
mod policy;
mod server;
mod tiers;
mod transfer;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(name = "kvtier-bench", version, about = "kvtier benchmarks")]
struct Cli {
    /// Print one JSON document instead of tables.
    #[arg(long, global = true)]
    json: bool,
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

#[derive(Serialize)]
struct Document<'a, T: Serialize> {
    command_line: &'a str,
    machine: &'a util::Machine,
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
    match &cli.command {
        Command::Hash(a) => {
            let r = hash::run(a)?;
            emit(cli.json, &command_line, &machine, "hash", r, hash::print)
        }
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
        Command::Policy(a) => {
            let r = policy::run(a)?;
            emit(
                cli.json,
                &command_line,
                &machine,
                "policy",
                r,
                policy::print,
            )
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
