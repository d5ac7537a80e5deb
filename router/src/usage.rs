//! What the router reads from the end of a worker's answer (the `usage` object, last in a
//! JSON answer and in the last SSE chunk): the `cached_tokens`, the `completion_tokens` and
//! kvtier-worker's `kvtier` load report. The answer passes through untouched; only its last
//! bytes are kept and searched. All of it is outside input: a value that is missing or is
//! not what it should be reads as `None` (or [`Report::Malformed`]), never a panic.
//!
//! The searches look for `"name":`, quote-colon included: inside a JSON string a quote is
//! escaped (`\"`), so generated text cannot forge one.

use serde::Deserialize;

use crate::load::LoadReport;

/// The last `"cached_tokens":N` in `tail`.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    last_number(tail, b"\"cached_tokens\":")
}

/// The last `"completion_tokens":N` in `tail`.
pub fn completion_tokens(tail: &[u8]) -> Option<u64> {
    last_number(tail, b"\"completion_tokens\":")
}

/// The number after the last `needle` in `tail`.
fn last_number(tail: &[u8], needle: &[u8]) -> Option<u64> {
    let rest = after_last(tail, needle)?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// What follows the last `needle` in `tail`, leading white space skipped.
fn after_last<'a>(tail: &'a [u8], needle: &[u8]) -> Option<&'a [u8]> {
    let at = tail.windows(needle.len()).rposition(|w| w == needle)? + needle.len();
    let rest = &tail[at..];
    Some(&rest[rest.iter().take_while(|b| b.is_ascii_whitespace()).count()..])
}

/// The answer's `usage.kvtier` object.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Report {
    /// None in the answer (a worker that does not send it).
    Absent,
    /// Present but not the object `docs/worker.md` describes.
    Malformed,
    Load(LoadReport),
}

#[derive(Deserialize)]
struct Wire {
    loaded_bytes: Tiers,
    load_s: f64,
}

#[derive(Deserialize)]
struct Tiers {
    #[serde(default)]
    hbm: u64,
    #[serde(default)]
    dram: u64,
    #[serde(default)]
    nvme: u64,
    /// Fetched by the server's cluster from another member (a worker before it reports
    /// none).
    #[serde(default)]
    remote: u64,
}

/// The last `"kvtier":{...}` in `tail`.
pub fn load_report(tail: &[u8]) -> Report {
    let Some(rest) = after_last(tail, b"\"kvtier\":") else {
        return Report::Absent;
    };
    // The object, and whatever follows it (the rest of the answer) left unread.
    match serde_json::Deserializer::from_slice(rest)
        .into_iter::<Wire>()
        .next()
    {
        Some(Ok(w)) => Report::Load(LoadReport {
            loaded_bytes: [
                w.loaded_bytes.hbm,
                w.loaded_bytes.dram,
                w.loaded_bytes.nvme,
                w.loaded_bytes.remote,
            ],
            load_s: w.load_s,
        }),
        _ => Report::Malformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_read_from_either_answer_shape() {
        let json = br#"{"choices":[],"usage":{"completion_tokens":4,"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32},"total_tokens":44}}"#;
        assert_eq!(cached_tokens(json), Some(32));
        assert_eq!(completion_tokens(json), Some(4));
        let sse = b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\": 7}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(sse), Some(7));
        assert_eq!(cached_tokens(b"data: [DONE]\n\n"), None);
        assert_eq!(cached_tokens(b"\"cached_tokens\":x"), None);
    }

    #[test]
    fn the_load_report_is_read_from_either_answer_shape() {
        let json = br#"{"usage":{"completion_tokens":4,"kvtier":{"load_s":0.002,"loaded_bytes":{"dram":2097152,"hbm":0,"nvme":0},"loaded_tokens":{"dram":64,"hbm":0,"nvme":0},"local_tokens":0},"prompt_tokens":70}}"#;
        let want = Report::Load(LoadReport {
            loaded_bytes: [0, 2 << 20, 0, 0],
            load_s: 0.002,
        });
        assert_eq!(load_report(json), want);
        let sse = b"data: {\"choices\":[{\"text\":\"\\\"kvtier\\\":{\"}]}\n\ndata: {\"usage\":{\"kvtier\": {\"loaded_bytes\":{\"nvme\":5},\"load_s\":1}}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            load_report(sse),
            Report::Load(LoadReport {
                loaded_bytes: [0, 0, 5, 0],
                load_s: 1.0
            })
        );
        // A worker behind a cluster member: blocks its server fetched from the cluster.
        let remote = br#"{"usage":{"kvtier":{"load_s":0.5,"loaded_bytes":{"dram":0,"hbm":0,"nvme":0,"remote":9}}}}"#;
        assert_eq!(
            load_report(remote),
            Report::Load(LoadReport {
                loaded_bytes: [0, 0, 0, 9],
                load_s: 0.5
            })
        );
    }

    #[test]
    fn a_missing_or_broken_load_report_is_no_report() {
        for (tail, want) in [
            (&b"{\"usage\":{\"prompt_tokens\":3}}"[..], Report::Absent),
            // Generated text quoting the field is escaped: not a report.
            (&b"{\"text\":\"\\\"kvtier\\\":{}\"}"[..], Report::Absent),
            (&b"\"kvtier\":null"[..], Report::Malformed),
            (&b"\"kvtier\":{\"load_s\":1}"[..], Report::Malformed),
            (
                &b"\"kvtier\":{\"loaded_bytes\":{\"dram\":-1},\"load_s\":1}"[..],
                Report::Malformed,
            ),
            (
                &b"\"kvtier\":{\"loaded_bytes\":{\"dram\":1},\"load_s\":\"1\"}"[..],
                Report::Malformed,
            ),
            (
                &b"\"kvtier\":{\"loaded_bytes\":{\"dram\":1},\"load_s\":1e999}"[..],
                Report::Malformed,
            ),
            // Cut off where the tail was trimmed or the answer broke.
            (
                &b"\"kvtier\":{\"loaded_bytes\":{\"dram\":1"[..],
                Report::Malformed,
            ),
        ] {
            assert_eq!(load_report(tail), want, "{}", String::from_utf8_lossy(tail));
        }
    }
}
