//! What cache calls return: `Lookup`, `Fetch`, `Stored`. A miss is one of these, never an
//! exception.

use kvtier_client::{Fetch as SdkFetch, Miss, PutStatus, TierCode};
use pyo3::prelude::*;

/// Python's repr of an optional string: `'x'` or `None`.
pub fn repr_opt(o: Option<&str>) -> String {
    o.map_or_else(|| "None".to_string(), |s| format!("'{s}'"))
}

/// Python's repr of a list of strings.
fn repr_list(v: &[String]) -> String {
    let items: Vec<String> = v.iter().map(|s| format!("'{s}'")).collect();
    format!("[{}]", items.join(", "))
}

pub fn tier_names(tiers: &[TierCode]) -> Vec<String> {
    tiers.iter().map(|t| t.name().to_string()).collect()
}

/// `(kind, detail)` of a miss, as Python sees it.
pub fn miss_parts(m: Option<&Miss>) -> (Option<String>, Option<String>) {
    let Some(m) = m else { return (None, None) };
    let (kind, detail) = match m {
        Miss::NotCached => ("not_cached", None),
        Miss::Corrupt => ("corrupt", None),
        Miss::IoError => ("io_error", None),
        Miss::Busy => ("busy", None),
        Miss::Timeout => ("timeout", None),
        Miss::Disconnected => ("disconnected", None),
        Miss::Unavailable(d) => ("unavailable", Some(d.clone())),
        Miss::Refused(d) => ("refused", Some(d.clone())),
    };
    (Some(kind.to_string()), detail)
}

fn put_status_name(s: &PutStatus) -> &'static str {
    match s {
        PutStatus::Stored => "stored",
        PutStatus::AlreadyPresent => "already_present",
        PutStatus::RejectedBacklog => "rejected_backlog",
        PutStatus::RejectedNoSlot => "rejected_no_slot",
        PutStatus::RejectedOrphan => "rejected_orphan",
        PutStatus::Failed => "failed",
    }
}

/// The longest cached prefix of a key list.
#[pyclass(frozen, get_all, module = "kvtier")]
pub struct Lookup {
    /// Tier ("hbm", "dram", "nvme", "remote") of each leading cached block. "remote": the
    /// server fetched it from another member of its cluster for this lookup (it is in the
    /// server's DRAM now; `sources` names the member).
    pub tiers: Vec<String>,
    /// Where the remote blocks came from: `(start, stop, node)` per run of them, positions
    /// in the looked-up keys, `node` the member's node id.
    pub sources: Vec<(usize, usize, String)>,
    /// Why it stopped: None (every key cached), "not_cached", "corrupt", "io_error", "busy",
    /// "timeout", "disconnected", "unavailable" or "refused".
    pub miss: Option<String>,
    /// More about an "unavailable" or "refused" miss.
    pub miss_detail: Option<String>,
}

#[pymethods]
impl Lookup {
    /// Number of leading cached blocks.
    #[getter]
    fn blocks(&self) -> usize {
        self.tiers.len()
    }
    fn __repr__(&self) -> String {
        let sources: Vec<String> = self
            .sources
            .iter()
            .map(|(a, b, n)| format!("({a}, {b}, '{n}')"))
            .collect();
        format!(
            "Lookup(blocks={}, tiers={}, sources=[{}], miss={})",
            self.tiers.len(),
            repr_list(&self.tiers),
            sources.join(", "),
            repr_opt(self.miss.as_deref())
        )
    }
}

/// The result of a get: the first `blocks` buffers hold blocks.
#[pyclass(frozen, get_all, module = "kvtier")]
#[derive(Clone)]
pub struct Fetch {
    blocks: usize,
    tiers: Vec<String>,
    miss: Option<String>,
    miss_detail: Option<String>,
}

impl From<SdkFetch> for Fetch {
    fn from(f: SdkFetch) -> Self {
        let (miss, miss_detail) = miss_parts(f.miss.as_ref());
        Fetch {
            blocks: f.blocks,
            tiers: tier_names(&f.tiers),
            miss,
            miss_detail,
        }
    }
}

#[pymethods]
impl Fetch {
    fn __repr__(&self) -> String {
        format!(
            "Fetch(blocks={}, tiers={}, miss={})",
            self.blocks,
            repr_list(&self.tiers),
            repr_opt(self.miss.as_deref())
        )
    }
}

/// The result of a put: one status per block sent, and why the rest were not sent.
#[pyclass(frozen, get_all, module = "kvtier")]
pub struct Stored {
    /// Per block: "stored", "already_present", "rejected_backlog", "rejected_no_slot",
    /// "rejected_orphan" or "failed".
    statuses: Vec<String>,
    /// Why blocks were not sent (same values as a miss), or None.
    failure: Option<String>,
    failure_detail: Option<String>,
}

#[pymethods]
impl Stored {
    /// Blocks now cached (stored now or before).
    #[getter]
    fn cached(&self) -> usize {
        self.statuses
            .iter()
            .filter(|s| *s == "stored" || *s == "already_present")
            .count()
    }
    fn __repr__(&self) -> String {
        format!(
            "Stored(cached={}, statuses={}, failure={})",
            self.cached(),
            repr_list(&self.statuses),
            repr_opt(self.failure.as_deref())
        )
    }
}

impl From<kvtier_client::Stored> for Stored {
    fn from(s: kvtier_client::Stored) -> Self {
        let (failure, failure_detail) = miss_parts(s.failure.as_ref());
        Stored {
            statuses: s
                .statuses
                .iter()
                .map(|s| put_status_name(s).to_string())
                .collect(),
            failure,
            failure_detail,
        }
    }
}
