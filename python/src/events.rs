//! Block events: `EventStream`, an iterator of `BlockEvent` and `EventGap` items.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvtier_client::{EventItem, EventKind, TierCode};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::client::secs;
use crate::results::repr_opt;

/// One block event: `kind` is "stored", "removed" or "cleared" (key of zeros, tier None).
#[pyclass(frozen, get_all, module = "kvtier")]
pub struct BlockEvent {
    seq: u64,
    kind: String,
    tier: Option<String>,
    key: Py<PyBytes>,
}

#[pymethods]
impl BlockEvent {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BlockEvent(seq={}, kind='{}', tier={}, key=bytes.fromhex('{}'))",
            self.seq,
            self.kind,
            repr_opt(self.tier.as_deref()),
            hex(self.key.bind(py).as_bytes())
        )
    }
}

/// Events `start..end` were lost (the subscriber fell behind): resync, e.g. with a snapshot.
#[pyclass(frozen, get_all, module = "kvtier")]
pub struct EventGap {
    start: u64,
    end: u64,
}

#[pymethods]
impl EventGap {
    fn __repr__(&self) -> String {
        format!("EventGap(start={}, end={})", self.start, self.end)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub struct EventState {
    stream: kvtier_client::EventStream,
    queued: VecDeque<EventItem>,
    closed: bool,
}

impl EventStream {
    pub fn new(rt: Arc<tokio::runtime::Runtime>, stream: kvtier_client::EventStream) -> Self {
        let start_seq = stream.start_seq;
        EventStream {
            rt,
            state: Mutex::new(EventState {
                stream,
                queued: VecDeque::new(),
                closed: false,
            }),
            start_seq,
        }
    }
}

/// An iterator of `BlockEvent` and `EventGap` items; iteration blocks (GIL released) until
/// the next event and ends when the connection closes. `next(timeout)` waits at most that long.
#[pyclass(frozen, module = "kvtier")]
pub struct EventStream {
    rt: Arc<tokio::runtime::Runtime>,
    state: Mutex<EventState>,
    /// The server's next sequence number when the subscription started.
    #[pyo3(get)]
    start_seq: u64,
}

impl EventStream {
    fn next_item(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Py<PyAny>>> {
        let item = py.detach(|| {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.queued.is_empty() && !st.closed {
                let st = &mut *st;
                let batch = self.rt.block_on(async {
                    match timeout {
                        Some(t) => tokio::time::timeout(t, st.stream.next_batch()).await.ok(),
                        None => Some(st.stream.next_batch().await),
                    }
                });
                match batch {
                    Some(Some(b)) => st.queued.extend(b),
                    Some(None) => st.closed = true,
                    None => {}
                }
            }
            (st.queued.pop_front(), st.closed)
        });
        match item {
            (Some(EventItem::Event(e)), _) => {
                let kind = match EventKind::from_u8(e.kind) {
                    Some(EventKind::Stored) => "stored",
                    Some(EventKind::Removed) => "removed",
                    Some(EventKind::Cleared) => "cleared",
                    None => "unknown",
                };
                let tier = if kind == "cleared" {
                    None
                } else {
                    TierCode::from_u8(e.tier).map(|t| t.name().to_string())
                };
                let ev = BlockEvent {
                    seq: e.seq,
                    kind: kind.into(),
                    tier,
                    key: PyBytes::new(py, e.key.as_bytes()).unbind(),
                };
                Ok(Some(Py::new(py, ev)?.into_any()))
            }
            (Some(EventItem::Gap { from, to }), _) => Ok(Some(
                Py::new(
                    py,
                    EventGap {
                        start: from,
                        end: to,
                    },
                )?
                .into_any(),
            )),
            (None, true) => Err(pyo3::exceptions::PyStopIteration::new_err(())),
            (None, false) => Ok(None),
        }
    }
}

#[pymethods]
impl EventStream {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        loop {
            if let Some(item) = self.next_item(py, Some(Duration::from_millis(200)))? {
                return Ok(item);
            }
            // Let Ctrl-C through while waiting.
            py.check_signals()?;
        }
    }

    /// The next item, or None if none arrives within `timeout` seconds. Raises StopIteration
    /// once the connection has closed.
    #[pyo3(signature = (timeout = None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        match timeout {
            None => self.__next__(py).map(Some),
            Some(t) => self.next_item(py, Some(secs("timeout", t)?)),
        }
    }
}
