//! The routing decision: for each worker, the expected time to first token of a request, and
//! the order to try the workers in. Free of I/O: tested on constructed states.
//!
//! `total_s = prefill_s + load_s + queue_s`, where
//! * `prefill_s = uncached_tokens / prefill_tokens_per_s` (the worker computes what it cannot
//!   load; it always recomputes the prompt's last token, so at most `(prompt - 1) /
//!   block_tokens` leading blocks count as cached). The rate is the worker's measured one
//!   (`load.rs`) once it has samples, else the configured one;
//! * `load_s` = the cached blocks' bytes over each tier's bandwidth (HBM, DRAM, NVMe: the
//!   worker's measured one, `load.rs`, once it has samples, else the configured one), and,
//!   when the workers' servers form one kvtier cluster, the blocks after the worker's own
//!   prefix that another server holds, over the cluster's configured bandwidth (its server
//!   fetches them from their owner: `docs/cluster.md`);
//! * `queue_s = queue_prefill_s + queue_decode_s + outstanding_requests x per_request_s`:
//!   `queue_prefill_s = outstanding_prefill_tokens / prefill_tokens_per_s`, the prompts the
//!   router sent the worker that have not started answering; `queue_decode_s =
//!   decoding_requests x rounds x decode_step_s`, the requests answering there, each of which
//!   takes one decode step per round of the new prompt's prefill (the worker runs its
//!   sequences a step in turn, a step being one token or one `prefill_chunk_tokens` chunk:
//!   `rounds = ceil(uncached_tokens / prefill_chunk_tokens)`, at least 1).
//!
//! Workers within `tie_s` of the best are a tie: the one with the fewest outstanding requests
//! goes first, then the order rotates (`rotation`) so cold prompts spread.
//!
//! Under the `kv` policy a request's session adds affinity ([`kv_order`]): a session stays on
//! its home (the worker that answered its last request) while that worker holds the longest
//! prefix of the prompt (and some of it), unless another is expected to answer in less than `1 /
//! affinity_ratio` of the home's time and at least `affinity_min_s` sooner; a session the
//! router has not seen goes to the worker fewest active sessions call home, then by load
//! (`queue_s`), so a prefix every session shares (an agent harness) does not draw every new
//! session to the first worker that held it; unless the best worker by expected TTFT (its
//! cache holds more of this prompt: a conversation resumed under a new session, a subagent's
//! inherited context) is expected in less than `1 / affinity_ratio` of that worker's time, at
//! least `affinity_min_s` sooner, and is home to at most one active session more.

use kvtier_core::protocol::TierCode;
use serde::Serialize;

/// The cost model's rates. Each field's doc ends with its default.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Costs {
    /// Prompt tokens a worker prefills per second (a worker's own setting overrides it).
    /// Default: 3000 (the default random-weight model on 2 CPU cores, docs/worker.md).
    pub prefill_tokens_per_s: f64,
    /// Bytes per second loaded from a block in the server's HBM tier. Default: 20e9.
    pub hbm_bytes_per_s: f64,
    /// Bytes per second loaded from DRAM. Default: 2e9.
    pub dram_bytes_per_s: f64,
    /// Bytes per second loaded from NVMe. Default: 1e9.
    pub nvme_bytes_per_s: f64,
    /// Bytes per second a worker's server fetches a block from another member of its kvtier
    /// cluster (`cluster = true`), until the worker's loads of such blocks measure it.
    /// Default: 0.5e9.
    pub cluster_bytes_per_s: f64,
    /// Fixed cost of each request the worker is still answering. Default: 0.005.
    pub per_request_s: f64,
    /// Seconds of one decode step of one sequence until a worker's own is measured.
    /// Default: 0.01.
    pub decode_step_s: f64,
    /// Prompt tokens a worker computes in one step (kvtier-worker's
    /// `scheduler::PREFILL_CHUNK_TOKENS`). Default: 512.
    pub prefill_chunk_tokens: f64,
    /// Use the rates measured from the workers' answers (`load.rs`) once they have samples:
    /// the prefill rate, the decode step and the load bandwidth per tier. Default: true.
    pub measured: bool,
    /// A session leaves its home only for a worker expected to answer in less than the
    /// home's time divided by this (at least 1). Default: 2.
    pub affinity_ratio: f64,
    /// ... and at least this much sooner. Default: 0.1.
    pub affinity_min_s: f64,
    /// Scores this close to the best are a tie. Default: 0.001.
    pub tie_s: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 3000.0,
            hbm_bytes_per_s: 20e9,
            dram_bytes_per_s: 2e9,
            nvme_bytes_per_s: 1e9,
            cluster_bytes_per_s: 0.5e9,
            per_request_s: 0.005,
            decode_step_s: 0.01,
            prefill_chunk_tokens: 512.0,
            measured: true,
            affinity_ratio: 2.0,
            affinity_min_s: 0.1,
            tie_s: 0.001,
        }
    }
}

impl Costs {
    /// Every rate positive and finite, every cost non-negative.
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
            ("dram_bytes_per_s", self.dram_bytes_per_s),
            ("nvme_bytes_per_s", self.nvme_bytes_per_s),
            ("cluster_bytes_per_s", self.cluster_bytes_per_s),
            ("decode_step_s", self.decode_step_s),
            ("prefill_chunk_tokens", self.prefill_chunk_tokens),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a positive number, got {v}"));
            }
        }
        for (name, v) in [
            ("per_request_s", self.per_request_s),
            ("affinity_min_s", self.affinity_min_s),
            ("tie_s", self.tie_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be zero or more, got {v}"));
            }
        }
        if !(self.affinity_ratio.is_finite() && self.affinity_ratio >= 1.0) {
            return Err(format!(
                "affinity_ratio must be 1 or more, got {}",
                self.affinity_ratio
            ));
        }
        Ok(())
    }

    fn bytes_per_s(&self, t: TierCode) -> f64 {
        match t {
            TierCode::Hbm => self.hbm_bytes_per_s,
            // A remote block was fetched into the server's DRAM.
            TierCode::Dram | TierCode::Remote => self.dram_bytes_per_s,
            TierCode::Nvme => self.nvme_bytes_per_s,
        }
    }
}

/// What the router knows about one worker for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Position in the router's worker list.
    pub worker: usize,
    pub healthy: bool,
    /// The fastest tier of each block of the longest cached prefix of the prompt.
    pub cached: Vec<TierCode>,
    /// How many of `cached` the router counts from its own recent routes to this worker (its
    /// server's events do not show them yet; counted as DRAM).
    pub routed_blocks: usize,
    /// Blocks right after `cached` that other servers of the worker's kvtier cluster hold
    /// (0 without a cluster): its server fetches them.
    pub cluster_blocks: usize,
    /// Bytes of one block on the worker's kvtier server.
    pub block_bytes: u64,
    pub outstanding_requests: u64,
    pub outstanding_prefill_tokens: u64,
    /// Of the outstanding requests, those whose answer has started (decoding).
    pub decoding_requests: u64,
    /// This worker's prefill rate (measured, or configured for it), when known.
    pub prefill_tokens_per_s: Option<f64>,
    /// This worker's measured decode step, when known.
    pub decode_step_s: Option<f64>,
    /// This worker's measured load bandwidth from each tier (index: `TierCode as usize`),
    /// when known.
    pub load_bytes_per_s: [Option<f64>; 3],
    /// This worker's measured rate of blocks its server fetched from the cluster, when known.
    pub cluster_bytes_per_s: Option<f64>,
}

/// One worker's expected time to first token, and its parts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Score {
    pub worker: usize,
    pub healthy: bool,
    pub cached_blocks: usize,
    pub cached_tokens: usize,
    /// Cached blocks by tier: HBM, DRAM, NVMe.
    pub cached_blocks_by_tier: [usize; 3],
    /// Of the cached blocks, those known from the router's own recent routes, not events.
    pub routed_blocks: usize,
    /// Of the cached blocks, those the worker's server would fetch from another member of
    /// its cluster (the last ones of the prefix).
    pub cluster_blocks: usize,
    pub uncached_tokens: usize,
    pub prefill_s: f64,
    pub load_s: f64,
    pub queue_s: f64,
    /// Of `queue_s`: the outstanding prompts' prefill...
    pub queue_prefill_s: f64,
    /// ... and the decoding requests' steps during this prompt's prefill.
    pub queue_decode_s: f64,
    pub total_s: f64,
    pub outstanding_requests: u64,
    pub outstanding_prefill_tokens: u64,
    pub decoding_requests: u64,
    /// The rates used.
    pub prefill_tokens_per_s: f64,
    pub decode_step_s: f64,
    /// Bytes per second from HBM, DRAM, NVMe.
    pub load_bytes_per_s: [f64; 3],
    /// Bytes per second of the blocks fetched from the cluster.
    pub cluster_bytes_per_s: f64,
}

/// Scores every candidate for a prompt of `prompt_tokens` tokens in blocks of `block_tokens`.
pub fn score(prompt_tokens: usize, block_tokens: usize, c: &Candidate, costs: &Costs) -> Score {
    let usable = prompt_tokens.saturating_sub(1) / block_tokens.max(1);
    let cached = &c.cached[..c.cached.len().min(usable)];
    let cluster = c.cluster_blocks.min(usable - cached.len());
    let mut by_tier = [0usize; 3];
    let bandwidth = [TierCode::Hbm, TierCode::Dram, TierCode::Nvme]
        .map(|t| c.load_bytes_per_s[t as usize].unwrap_or(costs.bytes_per_s(t)));
    let cluster_bw = c.cluster_bytes_per_s.unwrap_or(costs.cluster_bytes_per_s);
    let mut load_s = cluster as f64 * c.block_bytes as f64 / cluster_bw;
    for t in cached {
        by_tier[*t as usize] += 1;
    }
    for (blocks, bw) in by_tier.iter().zip(bandwidth) {
        load_s += *blocks as f64 * c.block_bytes as f64 / bw;
    }
    let cached_blocks = cached.len() + cluster;
    let cached_tokens = cached_blocks * block_tokens;
    let uncached = prompt_tokens - cached_tokens;
    let rate = c.prefill_tokens_per_s.unwrap_or(costs.prefill_tokens_per_s);
    let step = c.decode_step_s.unwrap_or(costs.decode_step_s);
    let prefill_s = uncached as f64 / rate;
    let rounds = (uncached as f64 / costs.prefill_chunk_tokens)
        .ceil()
        .max(1.0);
    let queue_prefill_s = c.outstanding_prefill_tokens as f64 / rate;
    let queue_decode_s = c.decoding_requests as f64 * rounds * step;
    let queue_s =
        queue_prefill_s + queue_decode_s + c.outstanding_requests as f64 * costs.per_request_s;
    Score {
        worker: c.worker,
        healthy: c.healthy,
        cached_blocks,
        cached_tokens,
        cached_blocks_by_tier: by_tier,
        // Routed blocks end the worker's own prefix: those cut off above are routed ones
        // first.
        routed_blocks: c
            .routed_blocks
            .saturating_sub(c.cached.len() - cached.len()),
        cluster_blocks: cluster,
        uncached_tokens: uncached,
        prefill_s,
        load_s,
        queue_s,
        queue_prefill_s,
        queue_decode_s,
        total_s: prefill_s + load_s + queue_s,
        outstanding_requests: c.outstanding_requests,
        outstanding_prefill_tokens: c.outstanding_prefill_tokens,
        decoding_requests: c.decoding_requests,
        prefill_tokens_per_s: rate,
        decode_step_s: step,
        load_bytes_per_s: bandwidth,
        cluster_bytes_per_s: cluster_bw,
    }
}

/// How the workers are ordered for a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// By expected time to first token ([`rank`]). The default.
    #[default]
    Kv,
    /// In turn, ignoring caches and load (a baseline).
    RoundRobin,
    /// Fewest outstanding requests, then in turn, ignoring caches (a baseline).
    LeastLoaded,
    /// A random order for each request, ignoring caches and load (a baseline).
    Random,
    /// Each session to one worker, chosen by rendezvous hashing of its id over the workers (so
    /// a worker that leaves moves only its own sessions); requests without a session go to the
    /// least loaded. Ignores caches and load (a baseline: what session affinity gives).
    SessionSticky,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "kv" => Ok(Policy::Kv),
            "round_robin" | "round-robin" => Ok(Policy::RoundRobin),
            "least_loaded" | "least-loaded" => Ok(Policy::LeastLoaded),
            "random" => Ok(Policy::Random),
            "session_sticky" | "session-sticky" => Ok(Policy::SessionSticky),
            _ => Err(format!(
                "unknown policy {s:?} (kv, round_robin, least_loaded, random, session_sticky)"
            )),
        }
    }
}

/// What a policy may use besides the scores to order the workers of one request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Turn<'a> {
    /// The router's request counter: equal candidates take turns by it.
    pub rotation: usize,
    /// A random number drawn for this request ([`Policy::Random`]).
    pub random: u64,
    /// The request's session ([`Policy::SessionSticky`]).
    pub session: Option<&'a str>,
    /// Where the request's session was last answered ([`Policy::Kv`]).
    pub home: Home,
    /// Per worker (by index; missing: 0), the active sessions at home there
    /// (`SessionHomes::homed`): where a new session goes ([`Policy::Kv`]).
    pub homed: &'a [u32],
}

/// A request's session as the `kv` policy sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Home {
    /// The request names no session.
    #[default]
    None,
    /// A session the router has not answered (or has forgotten).
    New,
    /// The worker that answered the session's last request.
    At(usize),
}

/// Why the `kv` policy put its first worker first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// No session, or the session's home no longer holds the longest prefix: by expected
    /// time to first token.
    ExpectedTtft,
    /// The session stays on its home.
    Home,
    /// The session leaves its home: another worker is expected to answer much sooner.
    LeftHome,
    /// A session not seen before: by load (`queue_s`) alone.
    NewSession,
}

impl Placement {
    /// The name in `/debug/route` and in `kvtier_router_placements_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ExpectedTtft => "expected_ttft",
            Self::Home => "home",
            Self::LeftHome => "left_home",
            Self::NewSession => "new_session",
        }
    }
}

/// SplitMix64's output function: a well-mixed 64-bit value of `x`.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rendezvous weight of `worker` for `session`: the session goes to the highest.
fn affinity(session: &str, worker: usize) -> u64 {
    // FNV-1a of the id, then mixed with the worker's position: stable across processes and
    // releases (a std hasher is not promised to be).
    let h = session.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    mix64(h ^ mix64(worker as u64))
}

/// The order to try the workers in under `policy`: healthy ones first, then the unhealthy
/// ones in the same order.
pub fn order(policy: Policy, scores: &[Score], costs: &Costs, turn: Turn<'_>) -> Vec<usize> {
    let n = scores.len().max(1);
    let rotated = |w: usize| (w + n - turn.rotation % n) % n;
    let mut v: Vec<&Score> = scores.iter().collect();
    match policy {
        Policy::Kv => return kv_order(scores, costs, turn).0,
        Policy::RoundRobin => v.sort_by_key(|s| rotated(s.worker)),
        Policy::LeastLoaded => v.sort_by_key(|s| (s.outstanding_requests, rotated(s.worker))),
        Policy::Random => v.sort_by_key(|s| mix64(turn.random ^ mix64(s.worker as u64))),
        Policy::SessionSticky => match turn.session {
            Some(id) => v.sort_by_key(|s| std::cmp::Reverse(affinity(id, s.worker))),
            None => v.sort_by_key(|s| (s.outstanding_requests, rotated(s.worker))),
        },
    }
    let mut out: Vec<usize> = v.iter().map(|s| s.worker).collect();
    // Stable: healthy first, each group in the policy's order.
    out.sort_by_key(|w| !scores.iter().any(|s| s.worker == *w && s.healthy));
    out
}

/// The `kv` policy's order and why its first worker is first: [`rank`] by expected TTFT, with
/// the session affinity the module describes.
pub fn kv_order(scores: &[Score], costs: &Costs, turn: Turn<'_>) -> (Vec<usize>, Placement) {
    let by_ttft = rank(scores, costs.tie_s, turn.rotation);
    match turn.home {
        Home::None => (by_ttft, Placement::ExpectedTtft),
        Home::New => {
            // A session stays where it starts, so where it starts sets the load it brings for
            // its life: to the worker the fewest active sessions call home, then by load (the
            // queue), ties as usual. The load of the moment alone misses sessions between
            // turns. The session count dominates: no queue is a million seconds long.
            let homed = |w: usize| turn.homed.get(w).copied().unwrap_or(0);
            let by_load: Vec<Score> = scores
                .iter()
                .map(|s| Score {
                    total_s: f64::from(homed(s.worker)) * 1e6 + s.queue_s,
                    ..s.clone()
                })
                .collect();
            let balanced = rank(&by_load, costs.tie_s, turn.rotation);
            // The prompt's own prefix, cached where the balance would not send it, wins when
            // it saves much and costs the balance at most one session.
            let find = |w: usize| scores.iter().find(|s| s.worker == w && s.healthy);
            if let (Some(b), Some(best)) = (find(balanced[0]), find(by_ttft[0]))
                && best.worker != b.worker
                && best.cached_blocks > b.cached_blocks
                && best.total_s * costs.affinity_ratio < b.total_s
                && b.total_s - best.total_s >= costs.affinity_min_s
                && homed(best.worker) <= homed(b.worker) + 1
            {
                return (by_ttft, Placement::ExpectedTtft);
            }
            (balanced, Placement::NewSession)
        }
        Home::At(h) => {
            let Some(home) = scores.iter().find(|s| s.worker == h && s.healthy) else {
                return (by_ttft, Placement::ExpectedTtft);
            };
            let longest = scores
                .iter()
                .filter(|s| s.healthy)
                .map(|s| s.cached_blocks)
                .max()
                .unwrap_or(0);
            // Affinity is for a prefix the home holds: nothing cached, nothing to keep.
            if home.cached_blocks == 0 || home.cached_blocks < longest {
                return (by_ttft, Placement::ExpectedTtft);
            }
            // The home is healthy, so the best is a healthy worker.
            let Some(best) = scores.iter().find(|s| s.worker == by_ttft[0]) else {
                return (by_ttft, Placement::ExpectedTtft);
            };
            if best.worker != h
                && best.total_s * costs.affinity_ratio < home.total_s
                && home.total_s - best.total_s >= costs.affinity_min_s
            {
                return (by_ttft, Placement::LeftHome);
            }
            let mut out = vec![h];
            out.extend(by_ttft.into_iter().filter(|w| *w != h));
            (out, Placement::Home)
        }
    }
}

/// The order to try the workers in: healthy ones by expected TTFT (ties as the module says),
/// then the unhealthy ones in the same order (tried only when no healthy one could serve).
pub fn rank(scores: &[Score], tie_s: f64, rotation: usize) -> Vec<usize> {
    let n = scores.len().max(1);
    let by_time = |a: &Score, b: &Score| a.total_s.total_cmp(&b.total_s);
    let mut out = Vec::with_capacity(scores.len());
    for healthy in [true, false] {
        let mut group: Vec<&Score> = scores.iter().filter(|s| s.healthy == healthy).collect();
        group.sort_by(|a, b| by_time(a, b).then(a.worker.cmp(&b.worker)));
        let Some(best) = group.first().map(|s| s.total_s) else {
            continue;
        };
        let ties = group
            .iter()
            .take_while(|s| s.total_s - best <= tie_s)
            .count();
        // Rotated position of a worker, so equal candidates take turns.
        let turn = |w: usize| (w + n - rotation % n) % n;
        group[..ties].sort_by(|a, b| {
            a.outstanding_requests
                .cmp(&b.outstanding_requests)
                .then(turn(a.worker).cmp(&turn(b.worker)))
        });
        out.extend(group.iter().map(|s| s.worker));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use TierCode::*;

    #[test]
    fn a_placements_name_is_its_debug_route_name() {
        for p in [
            Placement::ExpectedTtft,
            Placement::Home,
            Placement::LeftHome,
            Placement::NewSession,
        ] {
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
    }

    fn cand(worker: usize, cached: Vec<TierCode>, reqs: u64, prefill: u64) -> Candidate {
        Candidate {
            worker,
            healthy: true,
            cached,
            routed_blocks: 0,
            cluster_blocks: 0,
            block_bytes: 32 << 10,
            outstanding_requests: reqs,
            outstanding_prefill_tokens: prefill,
            decoding_requests: 0,
            prefill_tokens_per_s: None,
            decode_step_s: None,
            load_bytes_per_s: [None; 3],
            cluster_bytes_per_s: None,
        }
    }

    /// Ranks `cands` for a prompt of `tokens` tokens (16-token blocks, default costs).
    fn check(tokens: usize, cands: &[Candidate], rotation: usize, want: &[usize]) {
        let costs = Costs::default();
        let scores: Vec<Score> = cands.iter().map(|c| score(tokens, 16, c, &costs)).collect();
        assert_eq!(rank(&scores, costs.tie_s, rotation), want, "{scores:#?}");
    }

    #[test]
    fn the_parts_of_a_score() {
        let costs = Costs::default();
        let s = score(1000, 16, &cand(0, vec![Dram; 10], 2, 300), &costs);
        assert_eq!(
            (s.cached_blocks, s.cached_tokens, s.uncached_tokens),
            (10, 160, 840)
        );
        assert!((s.prefill_s - 840.0 / 3000.0).abs() < 1e-12);
        assert!((s.load_s - 10.0 * 32768.0 / 2e9).abs() < 1e-12);
        assert!((s.queue_s - (300.0 / 3000.0 + 2.0 * 0.005)).abs() < 1e-12);
        assert_eq!(s.cached_blocks_by_tier, [0, 10, 0]);
        // A whole-prompt hit still recomputes the last token: 64 tokens, 4 blocks cached,
        // 3 usable.
        let s = score(64, 16, &cand(0, vec![Nvme; 4], 0, 0), &costs);
        assert_eq!((s.cached_blocks, s.uncached_tokens), (3, 16));
    }

    #[test]
    fn blocks_another_cluster_member_holds_are_loaded_at_the_clusters_rate() {
        let costs = Costs::default();
        // 10 blocks in the worker's own DRAM, 20 more elsewhere in the cluster.
        let mut c = cand(0, vec![Dram; 10], 0, 0);
        c.cluster_blocks = 20;
        let s = score(1000, 16, &c, &costs);
        assert_eq!(
            (
                s.cached_blocks,
                s.cluster_blocks,
                s.cached_tokens,
                s.uncached_tokens
            ),
            (30, 20, 480, 520)
        );
        assert_eq!(s.cached_blocks_by_tier, [0, 10, 0]);
        let want = 10.0 * 32768.0 / 2e9 + 20.0 * 32768.0 / 0.5e9;
        assert!((s.load_s - want).abs() < 1e-12, "{}", s.load_s);
        // The last token is always recomputed: cluster blocks are cut first.
        let mut c = cand(0, vec![Dram; 2], 0, 0);
        c.cluster_blocks = 10;
        let s = score(64, 16, &c, &costs);
        assert_eq!((s.cached_blocks, s.cluster_blocks), (3, 1));
        // Fetching from the cluster beats recomputing: the worker holding nothing locally but
        // reaching 40 blocks through the cluster ranks above a cold one, and below one
        // holding them itself.
        let mut remote = cand(1, vec![], 0, 0);
        remote.cluster_blocks = 40;
        check(
            1000,
            &[
                cand(0, vec![], 0, 0),
                remote.clone(),
                cand(2, vec![Dram; 40], 0, 0),
            ],
            0,
            &[2, 1, 0],
        );
        // Measured (the worker's loads of blocks its server fetched): 4 MB/s makes 40 blocks
        // 328 ms, slower than computing their 640 tokens (213 ms): the cold worker wins.
        remote.cluster_bytes_per_s = Some(4e6);
        let s = score(1000, 16, &remote, &costs);
        assert!((s.load_s - 40.0 * 32768.0 / 4e6).abs() < 1e-12, "{s:?}");
        assert_eq!(s.cluster_bytes_per_s, 4e6);
        check(1000, &[cand(0, vec![], 0, 0), remote], 0, &[0, 1]);
    }

    #[test]
    fn the_worker_holding_the_longest_prefix_wins() {
        check(
            1000,
            &[
                cand(0, vec![], 0, 0),
                cand(1, vec![Dram; 40], 0, 0),
                cand(2, vec![Dram; 10], 0, 0),
            ],
            0,
            &[1, 2, 0],
        );
    }

    #[test]
    fn a_slow_tier_can_lose_to_a_shorter_fast_prefix() {
        // On a 10 MB/s disk a 32 KiB block takes 3.3 ms to load, against 5.3 ms to compute its
        // 16 tokens: 60 blocks from that disk (197 ms + 40 tokens, 13 ms) lose to 50 from DRAM
        // (1 ms + 200 tokens, 67 ms).
        let costs = Costs {
            nvme_bytes_per_s: 10e6,
            ..Costs::default()
        };
        let a = score(1000, 16, &cand(0, vec![Nvme; 60], 0, 0), &costs);
        let b = score(1000, 16, &cand(1, vec![Dram; 50], 0, 0), &costs);
        assert!(a.total_s > b.total_s, "{a:?} {b:?}");
        assert_eq!(rank(&[a, b], costs.tie_s, 0), vec![1, 0]);
    }

    #[test]
    fn a_measured_load_bandwidth_replaces_the_configured_one() {
        let costs = Costs::default();
        // 40 DRAM blocks of 32 KiB: 0.66 ms at the configured 2 GB/s; at a measured 4 MB/s,
        // 328 ms, more than computing their 640 tokens (213 ms): the holder now loses to a
        // cold worker.
        let mut slow = cand(0, vec![Dram; 40], 0, 0);
        slow.load_bytes_per_s[Dram as usize] = Some(4e6);
        let s = score(1000, 16, &slow, &costs);
        assert!((s.load_s - 40.0 * 32768.0 / 4e6).abs() < 1e-12, "{s:?}");
        assert_eq!(s.load_bytes_per_s, [20e9, 4e6, 1e9]);
        check(1000, &[slow.clone(), cand(1, vec![], 0, 0)], 0, &[1, 0]);
        check(
            1000,
            &[cand(0, vec![Dram; 40], 0, 0), cand(1, vec![], 0, 0)],
            0,
            &[0, 1],
        );
        // Only the measured tier changes: NVMe blocks still load at the configured rate.
        slow.cached = vec![Nvme; 40];
        let s = score(1000, 16, &slow, &costs);
        assert!((s.load_s - 40.0 * 32768.0 / 1e9).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn load_outweighs_a_cached_prefix_when_the_queue_is_long() {
        // Worker 0 holds 40 blocks (640 tokens, 213 ms of prefill) but has 3000 prefill tokens
        // (1 s) queued in front of it.
        check(
            1000,
            &[cand(0, vec![Dram; 40], 4, 3000), cand(1, vec![], 0, 0)],
            0,
            &[1, 0],
        );
        check(
            1000,
            &[cand(0, vec![Dram; 40], 1, 100), cand(1, vec![], 0, 0)],
            0,
            &[0, 1],
        );
    }

    #[test]
    fn cold_prompts_go_to_the_least_loaded_then_take_turns() {
        let cold = |reqs: [u64; 3]| -> Vec<Candidate> {
            (0..3).map(|w| cand(w, vec![], reqs[w], 0)).collect()
        };
        check(100, &cold([0, 0, 0]), 0, &[0, 1, 2]);
        check(100, &cold([0, 0, 0]), 1, &[1, 2, 0]);
        check(100, &cold([0, 0, 0]), 5, &[2, 0, 1]);
        // Equal scores within the tie margin (1 ms): fewer outstanding requests first, even
        // against the rotation.
        let costs = Costs {
            per_request_s: 0.0001,
            ..Costs::default()
        };
        let scores: Vec<Score> = cold([2, 0, 1])
            .iter()
            .map(|c| score(100, 16, c, &costs))
            .collect();
        assert_eq!(rank(&scores, costs.tie_s, 0), vec![1, 2, 0]);
        // Outside the margin the score alone decides.
        check(100, &cold([2, 0, 1]), 1, &[1, 2, 0]);
    }

    #[test]
    fn unhealthy_workers_come_last_whatever_they_hold() {
        let mut dead = cand(0, vec![Dram; 40], 0, 0);
        dead.healthy = false;
        check(
            1000,
            &[dead, cand(1, vec![], 3, 900), cand(2, vec![], 0, 0)],
            0,
            &[2, 1, 0],
        );
    }

    #[test]
    fn baseline_policies_ignore_the_cache() {
        let costs = Costs::default();
        let mut dead = cand(2, vec![], 0, 0);
        dead.healthy = false;
        let cands = [
            cand(0, vec![Dram; 40], 3, 0),
            cand(1, vec![], 1, 0),
            dead,
            cand(3, vec![], 1, 0),
        ];
        let scores: Vec<Score> = cands.iter().map(|c| score(1000, 16, c, &costs)).collect();
        let check = |p: Policy, rotation: usize, want: &[usize]| {
            let turn = Turn {
                rotation,
                ..Turn::default()
            };
            assert_eq!(order(p, &scores, &costs, turn), want, "{p:?} {rotation}");
        };
        check(Policy::Kv, 0, &[0, 1, 3, 2]);
        check(Policy::RoundRobin, 0, &[0, 1, 3, 2]);
        check(Policy::RoundRobin, 1, &[1, 3, 0, 2]);
        check(Policy::RoundRobin, 3, &[3, 0, 1, 2]);
        check(Policy::LeastLoaded, 0, &[1, 3, 0, 2]);
        check(Policy::LeastLoaded, 2, &[3, 1, 0, 2]);
        assert_eq!(Policy::parse("round-robin"), Ok(Policy::RoundRobin));
        assert_eq!(Policy::parse("random"), Ok(Policy::Random));
        assert_eq!(Policy::parse("session-sticky"), Ok(Policy::SessionSticky));
        assert!(Policy::parse("sticky").is_err());
    }

    fn four(healthy: [bool; 4], reqs: [u64; 4]) -> Vec<Score> {
        let costs = Costs::default();
        (0..4)
            .map(|w| {
                let mut c = cand(w, if w == 0 { vec![Dram; 40] } else { vec![] }, reqs[w], 0);
                c.healthy = healthy[w];
                score(1000, 16, &c, &costs)
            })
            .collect()
    }

    #[test]
    fn random_orders_are_permutations_that_vary_and_spread() {
        let scores = four([true, true, false, true], [0; 4]);
        let mut firsts = [0usize; 4];
        let mut orders = std::collections::HashSet::new();
        for r in 0..4000u64 {
            let turn = Turn {
                random: mix64(r),
                ..Turn::default()
            };
            let o = order(Policy::Random, &scores, &Costs::default(), turn);
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2, 3]);
            assert_eq!(o[3], 2, "the unhealthy worker comes last: {o:?}");
            firsts[o[0]] += 1;
            orders.insert(o);
        }
        // Three healthy workers: each first about a third of the time, all 6 orders seen.
        assert_eq!(orders.len(), 6, "{orders:?}");
        for w in [0, 1, 3] {
            assert!((1100..1570).contains(&firsts[w]), "{firsts:?}");
        }
    }

    #[test]
    fn sticky_sessions_keep_their_worker_and_only_a_lost_workers_sessions_move() {
        let all = four([true; 4], [5, 0, 0, 0]);
        let pick = |scores: &[Score], id: &str| {
            let turn = Turn {
                rotation: 17,
                random: 99,
                session: Some(id),
                home: Home::None,
                homed: &[],
            };
            order(Policy::SessionSticky, scores, &Costs::default(), turn)[0]
        };
        let ids: Vec<String> = (0..400).map(|i| format!("session-{i}")).collect();
        let before: Vec<usize> = ids.iter().map(|id| pick(&all, id)).collect();
        // The same session, the same worker, whatever the load or rotation.
        let busy = four([true; 4], [0, 9, 9, 9]);
        for (id, w) in ids.iter().zip(&before) {
            assert_eq!(pick(&busy, id), *w, "{id}");
        }
        let mut per = [0usize; 4];
        before.iter().for_each(|w| per[*w] += 1);
        assert!(per.iter().all(|n| (60..140).contains(n)), "{per:?}");
        // Worker 2 down: its sessions move, no other session does.
        let less = four([true, true, false, true], [0; 4]);
        for (id, w) in ids.iter().zip(&before) {
            let now = pick(&less, id);
            if *w == 2 {
                assert_ne!(now, 2, "{id}");
            } else {
                assert_eq!(now, *w, "{id}");
            }
        }
        // No session: the least loaded.
        let turn = Turn::default();
        assert_eq!(
            order(Policy::SessionSticky, &all, &Costs::default(), turn)[0],
            1
        );
    }

    #[test]
    fn a_worker_rate_overrides_the_default_and_bad_costs_are_refused() {
        let mut fast = cand(1, vec![], 0, 0);
        fast.prefill_tokens_per_s = Some(30_000.0);
        check(1000, &[cand(0, vec![Dram; 10], 0, 0), fast], 0, &[1, 0]);
        assert!(Costs::default().check().is_ok());
        for bad in [
            Costs {
                prefill_tokens_per_s: 0.0,
                ..Costs::default()
            },
            Costs {
                dram_bytes_per_s: f64::NAN,
                ..Costs::default()
            },
            Costs {
                tie_s: -1.0,
                ..Costs::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn decoding_requests_cost_a_step_per_round_of_the_new_prompts_prefill() {
        let costs = Costs::default();
        // 1200 uncached tokens: 3 chunks of 512, so 3 rounds; 4 requests decoding at 10 ms a
        // step (the default until measured): 120 ms.
        let mut c = cand(0, vec![], 4, 0);
        c.decoding_requests = 4;
        let s = score(1200, 16, &c, &costs);
        assert!((s.queue_decode_s - 0.12).abs() < 1e-12, "{s:?}");
        assert!((s.queue_s - (0.12 + 4.0 * 0.005)).abs() < 1e-12, "{s:?}");
        // A measured step replaces the default; a cached prompt still takes one round.
        c.decode_step_s = Some(0.002);
        c.cached = vec![Dram; 74];
        let s = score(1200, 16, &c, &costs);
        assert_eq!(s.uncached_tokens, 16);
        assert!((s.queue_decode_s - 4.0 * 0.002).abs() < 1e-12, "{s:?}");
        assert_eq!(s.decode_step_s, 0.002);
        // Six decoding requests against two: 4 rounds of a cold 2000-token prompt, 160 ms more
        // (by `per_request_s` alone it would be 20 ms).
        let mut busy = cand(0, vec![], 6, 0);
        busy.decoding_requests = 6;
        let mut light = cand(1, vec![], 2, 0);
        light.decoding_requests = 2;
        let a = score(2000, 16, &busy, &costs);
        let b = score(2000, 16, &light, &costs);
        assert!(a.queue_decode_s - b.queue_decode_s > 0.1, "{a:?} {b:?}");
    }

    /// Three workers for a 2000-token prompt: `cached[w]` DRAM blocks, `reqs[w]` outstanding
    /// requests all decoding, `prefill[w]` prompt tokens queued.
    fn three(cached: [usize; 3], reqs: [u64; 3], prefill: [u64; 3]) -> Vec<Score> {
        let costs = Costs::default();
        (0..3)
            .map(|w| {
                let mut c = cand(w, vec![Dram; cached[w]], reqs[w], prefill[w]);
                c.decoding_requests = reqs[w];
                score(2000, 16, &c, &costs)
            })
            .collect()
    }

    fn kv(scores: &[Score], home: Home) -> (Vec<usize>, Placement) {
        let turn = Turn {
            home,
            ..Turn::default()
        };
        kv_order(scores, &Costs::default(), turn)
    }

    #[test]
    fn a_session_stays_home_unless_another_worker_is_much_sooner() {
        // The home (0) holds 100 of the prompt's 124 blocks and has one more request queued
        // than worker 1, which holds 90: by expected TTFT alone worker 1 is a little sooner
        // (the queue difference outweighs 10 blocks), but not twice as soon: the session
        // stays.
        let s = three([100, 90, 0], [3, 2, 2], [600, 0, 0]);
        assert_eq!(rank(&s, 0.001, 0)[0], 1, "{s:#?}");
        assert_eq!(kv(&s, Home::At(0)), (vec![0, 1, 2], Placement::Home));
        // Without a session the expected TTFT decides.
        assert_eq!(kv(&s, Home::None), (vec![1, 0, 2], Placement::ExpectedTtft));
        // The home buried under 9000 queued tokens (3 s): worker 1 is more than twice as soon
        // and more than 100 ms sooner: the session leaves.
        let s = three([100, 90, 0], [3, 2, 2], [9000, 0, 0]);
        assert_eq!(kv(&s, Home::At(0)).1, Placement::LeftHome);
        assert_eq!(kv(&s, Home::At(0)).0[0], 1);
        // A ratio met but not the minimum: the tiny absolute difference keeps it home.
        let tiny = Costs {
            affinity_min_s: 10.0,
            ..Costs::default()
        };
        let turn = Turn {
            home: Home::At(0),
            ..Turn::default()
        };
        assert_eq!(kv_order(&s, &tiny, turn).1, Placement::Home);
    }

    #[test]
    fn a_home_that_lost_the_prefix_or_its_health_is_no_home() {
        // Worker 2 holds more of the prompt than the home: by expected TTFT.
        let s = three([40, 0, 100], [0, 0, 0], [0, 0, 0]);
        assert_eq!(
            kv(&s, Home::At(0)),
            (vec![2, 0, 1], Placement::ExpectedTtft)
        );
        // The home unhealthy: by expected TTFT, the home last.
        let mut s = three([100, 0, 0], [0, 0, 0], [0, 0, 0]);
        s[0].healthy = false;
        let (o, p) = kv(&s, Home::At(0));
        assert_eq!((o[2], p), (0, Placement::ExpectedTtft));
        // The home holding nothing of the prompt (evicted, or another prompt of the session):
        // by expected TTFT, here the idle workers before the busy home.
        let s = three([0, 0, 0], [2, 0, 0], [0, 0, 0]);
        assert_eq!(
            kv(&s, Home::At(0)),
            (vec![1, 2, 0], Placement::ExpectedTtft)
        );
    }

    #[test]
    fn a_new_session_is_placed_by_load_not_by_a_shared_prefix() {
        // Worker 0 holds the 64-block harness every session starts with and has two requests
        // decoding; the others hold nothing and are idle. By expected TTFT the holder wins
        // (1024 tokens saved, 341 ms, but not half the time once its queue counts); a new
        // session goes by load.
        let s = three([64, 0, 0], [2, 0, 0], [0, 0, 0]);
        assert_eq!(kv(&s, Home::None).0[0], 0, "{s:#?}");
        let (o, p) = kv(&s, Home::New);
        assert_eq!(p, Placement::NewSession);
        assert_eq!(o, vec![1, 2, 0]);
        // Nothing cached, equal load: ties rotate as usual.
        let s = three([0, 0, 0], [0, 0, 0], [0, 0, 0]);
        let turn = |rotation| Turn {
            rotation,
            home: Home::New,
            ..Turn::default()
        };
        let firsts: Vec<usize> = (0..3)
            .map(|r| kv_order(&s, &Costs::default(), turn(r)).0[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2]);
    }

    #[test]
    fn a_new_session_goes_where_its_own_prefix_is_when_that_saves_much() {
        // Worker 0 holds 110 of the prompt's 125 blocks (a conversation resumed under a new
        // session id) and is home to one active session; 1 and 2 hold nothing and are home to
        // none. Expected 0.14 s there against 0.67 s elsewhere: the prefix wins.
        let s = three([110, 0, 0], [0, 0, 0], [0, 0, 0]);
        let turn = |homed| Turn {
            home: Home::New,
            homed,
            ..Turn::default()
        };
        assert_eq!(
            kv_order(&s, &Costs::default(), turn(&[1, 0, 0])),
            (vec![0, 1, 2], Placement::ExpectedTtft)
        );
        // Home to two sessions more than the others: the balance wins.
        assert_eq!(
            kv_order(&s, &Costs::default(), turn(&[2, 0, 0])),
            (vec![1, 2, 0], Placement::NewSession)
        );
        // A prefix that saves less than half the time (the 64-block harness of the test
        // above, with load on its holder): the balance wins even at equal counts.
        let s = three([64, 0, 0], [2, 0, 0], [0, 0, 0]);
        assert_eq!(
            kv_order(&s, &Costs::default(), turn(&[0, 0, 0])).1,
            Placement::NewSession
        );
        // Much sooner for its speed or queue, not for the prompt's prefix: the balance wins.
        let s = three([0, 0, 0], [0, 4, 4], [0, 9000, 9000]);
        assert_eq!(
            kv_order(&s, &Costs::default(), turn(&[1, 0, 0])),
            (vec![1, 2, 0], Placement::NewSession)
        );
        // The saving's floor: twice as soon but less than `affinity_min_s` sooner.
        let s = three([110, 0, 0], [0, 0, 0], [0, 0, 0]);
        let floor = Costs {
            affinity_min_s: 1.0,
            ..Costs::default()
        };
        assert_eq!(
            kv_order(&s, &floor, turn(&[0, 0, 0])).1,
            Placement::NewSession
        );
    }

    #[test]
    fn a_new_session_goes_where_the_fewest_sessions_are_at_home() {
        // Worker 0 is busier right now, but workers 1 and 2 are home to more active sessions
        // (between turns, sending nothing): the new session goes to 0.
        let s = three([0, 0, 0], [2, 0, 0], [900, 0, 0]);
        let turn = |homed| Turn {
            home: Home::New,
            homed,
            ..Turn::default()
        };
        let (o, p) = kv_order(&s, &Costs::default(), turn(&[1, 3, 2]));
        assert_eq!((o, p), (vec![0, 2, 1], Placement::NewSession));
        // As many sessions at home everywhere: by load.
        assert_eq!(
            kv_order(&s, &Costs::default(), turn(&[2, 2, 2])).0,
            vec![1, 2, 0]
        );
        // A worker the counts do not reach yet has none.
        assert_eq!(kv_order(&s, &Costs::default(), turn(&[1, 1])).0[0], 2);
        // Sessions with a home, and requests without a session, ignore the counts.
        let t = Turn {
            home: Home::None,
            homed: &[0, 9, 9],
            ..Turn::default()
        };
        assert_eq!(kv_order(&s, &Costs::default(), t).0[0], 1);
    }

    #[test]
    fn bad_affinity_settings_are_refused() {
        for bad in [
            Costs {
                affinity_ratio: 0.5,
                ..Costs::default()
            },
            Costs {
                affinity_min_s: -1.0,
                ..Costs::default()
            },
            Costs {
                prefill_chunk_tokens: 0.0,
                ..Costs::default()
            },
            Costs {
                decode_step_s: f64::INFINITY,
                ..Costs::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
