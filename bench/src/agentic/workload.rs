//! The agentic session model and its seeded generator.
//!
//! A workload is a list of sessions. A session is a *chain* of steps: turns (one request each),
//! subagent spawns and joins. Every turn appends new tokens to the chain's context and sends the
//! whole context, so turn n's prompt extends turn n-1's. The content is a pure function of the
//! seed: a [`Segment`] is `len` tokens drawn from its own seed, so every configuration of a
//! comparison sees byte-identical prompts.
//!
//! The model's previous output is represented by seeded tokens of the requested output length
//! (not the text the endpoint returned), which keeps the prompts identical across engines and
//! configurations.
//!
//! Content comes in two kinds ([`Content`]): lower-case letters and spaces, one byte per token
//! (for the byte-level tokenizer of the random-weight model), or English words drawn from an
//! agentic transcript's sentences, one word per workload token (for a real tokenizer).

use serde::Serialize;

use kvtier_core::SplitMix64;

/// Token ids of generated content: lower-case letters and spaces (printable ASCII, so a prompt
/// sent as token ids and the same prompt sent as text are the same bytes for a byte-level
/// tokenizer, and every id is below 256 for any vocabulary).
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz     ";

/// Tokens kept free under `--max-context` for a BOS the engine may put before the prompt.
pub const BOS_MARGIN: usize = 1;

/// What generated content is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Content {
    /// Lower-case letters and spaces, one byte per token.
    Letters,
    /// English words, one per token, each after a space: sentences of a coding agent's
    /// transcript, drawn from the seed (the harness from a system prompt's sentences). With a
    /// byte-pair tokenizer a word is about one token. Each segment starts with a space, so
    /// a real tokenizer splits the prompt at the segment boundaries the same way every turn
    /// and a turn's tokens extend the previous turn's.
    English,
}

/// The harness prefix in English: a coding agent's system prompt and tool descriptions.
const HARNESS_SENTENCES: &[&str] = &[
    "You are a coding agent working in a Rust repository on behalf of the user.",
    "You can call the tools read_file, edit_file, search and run_tests.",
    "The tool read_file takes a path and returns the contents of that file.",
    "The tool edit_file replaces one exact piece of text in a file with another.",
    "The tool search finds lines that match a pattern in every file of the repository.",
    "The tool run_tests runs the test suite and returns the names of the tests that failed.",
    "Read the relevant code before you change it, and keep every change small.",
    "Explain what you are going to do in one or two sentences before each tool call.",
    "Never invent the output of a tool; wait for the result and read it carefully.",
    "When the tests pass, summarize what you changed and why in a short answer.",
    "Follow the style of the surrounding code and keep the documentation true.",
    "Ask the user a question only when the task cannot be done without an answer.",
];

/// Everything else in English: tasks, tool results and the agent's notes.
const TRANSCRIPT_SENTENCES: &[&str] = &[
    "The user asks you to fix the failing test in the cache server.",
    "Please add a timeout to the client so that a request never hangs forever.",
    "The function returns an error when the block is missing from the index.",
    "I will read the file that defines the configuration loader first.",
    "The test expected five blocks in the result but found only three.",
    "Running the tests again after the change shows that all of them pass.",
    "The error says that the value was moved before it was used again.",
    "Let me search for every place where the lock is taken in this module.",
    "The file has two hundred lines and most of them handle the wire format.",
    "This change keeps the old behaviour for clients that send no token.",
    "The build failed because a type in the public interface was renamed.",
    "I found the bug: the counter is read before the write has finished.",
    "The next step is to update the documentation of the new setting.",
    "Three tests failed with a timeout while waiting for the server to start.",
    "The server logs a warning when the disk tier is almost full.",
    "Now I will edit the function so that it checks the length first.",
    "The benchmark shows that the new path is twice as fast as before.",
    "The cache keeps the most recent blocks in memory and the rest on disk.",
    "The review asks for a clearer name and a test for the empty case.",
    "After the edit the code compiles and the linter reports no warnings.",
];

/// `len` tokens drawn from `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Segment {
    pub seed: u64,
    pub len: usize,
}

impl Segment {
    /// Appends the segment's tokens to `out`.
    pub fn extend(&self, content: Content, out: &mut Vec<u8>) {
        match content {
            Content::Letters => self.letters(out),
            Content::English => english(self.seed, self.len, TRANSCRIPT_SENTENCES, false, out),
        }
    }

    fn letters(&self, out: &mut Vec<u8>) {
        let mut r = SplitMix64::new(self.seed);
        out.reserve(self.len);
        let mut left = self.len;
        while left > 0 {
            let mut x = r.next_u64();
            for _ in 0..8.min(left) {
                out.push(ALPHABET[(x & 0xff) as usize % ALPHABET.len()]);
                x >>= 8;
                left -= 1;
            }
        }
    }
}

/// Appends `len` words, each after a space, of sentences drawn from `bank` by `seed` (with
/// `in_order`, the bank's sentences in order first).
fn english(seed: u64, len: usize, bank: &[&str], in_order: bool, out: &mut Vec<u8>) {
    let mut r = SplitMix64::new(seed);
    let mut left = len;
    let mut i = 0;
    while left > 0 {
        let sentence = if in_order && i < bank.len() {
            bank[i]
        } else {
            bank[(r.next_u64() % bank.len() as u64) as usize]
        };
        i += 1;
        for w in sentence.split(' ').take(left) {
            out.push(b' ');
            out.extend_from_slice(w.as_bytes());
            left -= 1;
        }
    }
}

/// Where a chain's context starts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Base {
    /// The first `n` tokens of the harness prefix shared by every session.
    Harness(usize),
    /// The parent's context at the spawn (a subagent branching off its parent).
    Parent,
}

/// One step of a chain.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Step {
    /// Wait `gap_s` (workload seconds, before `--time-scale`), append `append`, send the context
    /// and ask for `max_tokens`.
    Turn {
        gap_s: f64,
        append: Segment,
        max_tokens: u32,
    },
    /// Start these subagents now; they run beside the chain until the next `Join`.
    Spawn(Vec<Chain>),
    /// Wait for every subagent spawned so far, then append their results.
    Join { append: Segment },
}

/// A sequence of steps on one growing context.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Chain {
    pub base: Base,
    pub steps: Vec<Step>,
}

impl Chain {
    /// Turns in this chain and its subagents.
    pub fn turns(&self) -> usize {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Turn { .. } => 1,
                Step::Spawn(subs) => subs.iter().map(Chain::turns).sum(),
                Step::Join { .. } => 0,
            })
            .sum()
    }

    /// Subagent chains spawned (recursively).
    pub fn subagents(&self) -> usize {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Spawn(subs) => subs.len() + subs.iter().map(Chain::subagents).sum::<usize>(),
                _ => 0,
            })
            .sum()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Session {
    pub id: usize,
    pub main: Chain,
}

/// What the driver runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    /// `synthetic` or the trace files it came from.
    pub source: String,
    /// Seed of the harness prefix shared by every session.
    pub harness_seed: u64,
    pub sessions: Vec<Session>,
    /// Gaps at or above this (workload seconds) make the next turn an "after long idle" turn.
    pub long_idle_s: f64,
    /// Turns the generator dropped to keep prompt + output within the context limit.
    pub truncated_turns: usize,
}

impl Workload {
    pub fn turns(&self) -> usize {
        self.sessions.iter().map(|s| s.main.turns()).sum()
    }

    /// The harness prefix's first `n` tokens.
    pub fn harness(&self, n: usize, content: Content) -> Vec<u8> {
        let mut v = Vec::with_capacity(n);
        match content {
            Content::Letters => Segment {
                seed: self.harness_seed,
                len: n,
            }
            .letters(&mut v),
            Content::English => {
                english(self.harness_seed, n, HARNESS_SENTENCES, true, &mut v);
                // The prompt starts with the system prompt's first word, not a space.
                if !v.is_empty() {
                    v.remove(0);
                }
            }
        }
        v
    }
}

/// Parameters of the synthetic generator (all in tokens and workload seconds).
#[derive(Clone, Debug, Serialize)]
pub struct GenParams {
    pub sessions: usize,
    pub turns_min: usize,
    pub turns_max: usize,
    pub harness_tokens: usize,
    pub task_tokens: usize,
    pub tool_tokens: usize,
    pub output_tokens: usize,
    pub tool_gap_median_s: f64,
    pub tool_gap_sigma: f64,
    pub human_prob: f64,
    pub human_gap_min_s: f64,
    pub human_gap_alpha: f64,
    pub gap_cap_s: f64,
    pub long_idle_s: f64,
    pub subagent_prob: f64,
    pub subagents_max: usize,
    pub subagent_turns_max: usize,
    pub subagent_result_tokens: usize,
    pub max_context: usize,
    /// The first this many sessions are hot: a task of `hot_task_tokens` and twice
    /// `turns_max` turns.
    pub hot_sessions: usize,
    pub hot_task_tokens: usize,
}

impl Default for GenParams {
    fn default() -> Self {
        Self {
            sessions: 16,
            turns_min: 4,
            turns_max: 12,
            harness_tokens: 1024,
            task_tokens: 256,
            tool_tokens: 192,
            output_tokens: 32,
            tool_gap_median_s: 2.0,
            tool_gap_sigma: 1.0,
            human_prob: 0.15,
            human_gap_min_s: 20.0,
            human_gap_alpha: 1.3,
            gap_cap_s: 900.0,
            long_idle_s: 20.0,
            subagent_prob: 0.1,
            subagents_max: 2,
            subagent_turns_max: 3,
            subagent_result_tokens: 96,
            max_context: 8192,
            hot_sessions: 0,
            hot_task_tokens: 4096,
        }
    }
}

impl GenParams {
    pub fn validate(&self) -> Result<(), String> {
        let pos = |name: &str, v: usize| {
            if v == 0 {
                Err(format!("--{name} must be at least 1"))
            } else {
                Ok(())
            }
        };
        pos("sessions", self.sessions)?;
        pos("turns-min", self.turns_min)?;
        pos("output-tokens", self.output_tokens)?;
        pos("tool-tokens", self.tool_tokens)?;
        if self.turns_max < self.turns_min {
            return Err(format!(
                "--turns-max ({}) is below --turns-min ({})",
                self.turns_max, self.turns_min
            ));
        }
        for (name, p) in [
            ("human-prob", self.human_prob),
            ("subagent-prob", self.subagent_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("--{name} must be within 0..=1, not {p}"));
            }
        }
        for (name, v) in [
            ("tool-gap-median-s", self.tool_gap_median_s),
            ("tool-gap-sigma", self.tool_gap_sigma),
            ("human-gap-min-s", self.human_gap_min_s),
            ("gap-cap-s", self.gap_cap_s),
            ("long-idle-s", self.long_idle_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("--{name} must be a finite number >= 0, not {v}"));
            }
        }
        if !(self.human_gap_alpha.is_finite() && self.human_gap_alpha > 0.0) {
            return Err(format!(
                "--human-gap-alpha must be > 0, not {}",
                self.human_gap_alpha
            ));
        }
        if self.hot_sessions > self.sessions {
            return Err(format!(
                "--hot-sessions ({}) is more than --sessions ({})",
                self.hot_sessions, self.sessions
            ));
        }
        if self.hot_sessions > 0
            && self.harness_tokens + self.hot_task_tokens + 2 * self.output_tokens
                >= self.max_context
        {
            return Err(format!(
                "--max-context {} leaves no room for a hot session: the harness ({}), its task \
                 ({}) and an output already fill it",
                self.max_context, self.harness_tokens, self.hot_task_tokens
            ));
        }
        let first = self.harness_tokens + self.task_tokens * 3 / 2 + 2 * self.output_tokens;
        if first >= self.max_context {
            return Err(format!(
                "--max-context {} leaves no room: the harness ({}), a task context (up to {}) and \
                 an output already take {first} tokens",
                self.max_context,
                self.harness_tokens,
                self.task_tokens * 3 / 2
            ));
        }
        Ok(())
    }
}

/// A seeded source of the distributions the generator draws from.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }
    pub fn u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        self.0.next_f64()
    }
    /// Uniform in [lo, hi].
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.u64() % (hi - lo + 1) as u64) as usize
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64(); // (0, 1]
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Lognormal with this median and shape.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }
    /// Pareto with this minimum and tail index.
    pub fn pareto(&mut self, min: f64, alpha: f64) -> f64 {
        min / (1.0 - self.f64()).powf(1.0 / alpha)
    }
    /// A token count around `mean` (lognormal, shape 0.6), at least 1.
    pub fn tokens(&mut self, mean: usize) -> usize {
        // The median of a lognormal with shape s is mean / exp(s^2 / 2).
        let s = 0.6f64;
        let median = mean as f64 / (s * s / 2.0).exp();
        (self.lognormal(median, s).round() as usize).max(1)
    }
    pub fn segment(&mut self, len: usize) -> Segment {
        Segment {
            seed: self.u64(),
            len,
        }
    }
}

/// Mixes a seed with a label (different streams from one `--seed`).
pub fn mix(seed: u64, label: u64) -> u64 {
    let mut r = SplitMix64::new(seed ^ label.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    r.next_u64()
}

/// Generates the synthetic workload. Deterministic in (`p`, `seed`).
pub fn generate(p: &GenParams, seed: u64) -> Result<Workload, String> {
    p.validate()?;
    let mut truncated = 0;
    let sessions = (0..p.sessions)
        .map(|id| {
            let mut r = Rng::new(mix(seed, 0x5e55_0000 + id as u64));
            let mut task = r.range((p.task_tokens / 2).max(1), p.task_tokens * 3 / 2 + 1);
            let mut turns = r.range(p.turns_min, p.turns_max);
            if id < p.hot_sessions {
                (task, turns) = (p.hot_task_tokens.max(1), 2 * p.turns_max);
            }
            let mut ctx = p.harness_tokens;
            let main = gen_chain(
                p,
                &mut r,
                Base::Harness(p.harness_tokens),
                task,
                turns,
                true,
                &mut ctx,
                &mut truncated,
            );
            Session { id, main }
        })
        .collect();
    Ok(Workload {
        source: "synthetic".into(),
        harness_seed: mix(seed, 0x4a52_4e45_5353),
        sessions,
        long_idle_s: p.long_idle_s,
        truncated_turns: truncated,
    })
}

fn gap(p: &GenParams, r: &mut Rng) -> f64 {
    let g = if r.f64() < p.human_prob {
        r.pareto(p.human_gap_min_s, p.human_gap_alpha)
    } else {
        r.lognormal(p.tool_gap_median_s, p.tool_gap_sigma)
    };
    g.min(p.gap_cap_s)
}

/// One chain of `turns` turns whose first turn appends `first_append` tokens to a context of
/// `*ctx` tokens; `*ctx` tracks the context length (subagents spawn only from the main chain).
#[allow(clippy::too_many_arguments)]
fn gen_chain(
    p: &GenParams,
    r: &mut Rng,
    base: Base,
    first_append: usize,
    turns: usize,
    main: bool,
    ctx: &mut usize,
    truncated: &mut usize,
) -> Chain {
    let mut steps = Vec::new();
    let mut append = first_append;
    let mut pending_join = 0usize;
    for t in 0..turns {
        let out = r.tokens(p.output_tokens).min(p.output_tokens * 4);
        if *ctx + append + out + BOS_MARGIN > p.max_context {
            *truncated += turns - t;
            break;
        }
        let gap_s = if t == 0 && main { 0.0 } else { gap(p, r) };
        steps.push(Step::Turn {
            gap_s,
            append: r.segment(append),
            max_tokens: out as u32,
        });
        *ctx += append;
        // The next turn appends this turn's output and a tool result.
        append = out + r.tokens(p.tool_tokens);
        if pending_join > 0 {
            // Subagents rejoin after one more parent turn: their results join the context.
            let add = pending_join * p.subagent_result_tokens;
            steps.push(Step::Join {
                append: r.segment(add),
            });
            *ctx += add;
            pending_join = 0;
        } else if main && t + 1 < turns && p.subagents_max > 0 && r.f64() < p.subagent_prob {
            let n = r.range(1, p.subagents_max);
            let subs = (0..n)
                .map(|_| {
                    let sub_turns = r.range(1, p.subagent_turns_max.max(1));
                    let task = r.tokens(p.task_tokens / 2 + 1);
                    // A subagent branches off the parent's context as of now (the output of
                    // the turn that spawned it is part of its prompt).
                    let mut sub_ctx = *ctx + out;
                    gen_chain(
                        p,
                        r,
                        Base::Parent,
                        out + task,
                        sub_turns,
                        false,
                        &mut sub_ctx,
                        truncated,
                    )
                })
                .filter(|c| !c.steps.is_empty())
                .collect::<Vec<_>>();
            if !subs.is_empty() {
                pending_join = subs.len();
                steps.push(Step::Spawn(subs));
            }
        }
    }
    if pending_join > 0 {
        steps.push(Step::Join {
            append: Segment { seed: 0, len: 0 },
        });
    }
    Chain { base, steps }
}
