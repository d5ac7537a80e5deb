//! `Client`: kvtier-client's SDK on a small runtime owned by the object. Every call releases
//! the GIL while it waits; one `Client` may be used from many Python threads at once (its
//! requests pipeline on one connection).

use std::time::Duration;

use kvtier_client::{
    BlockKey, ClientConfig, ClientError, ErrorCode, Fetch as SdkFetch, Miss, PutEntry, RetainStatus,
};
use pyo3::exceptions::{
    PyConnectionError, PyPermissionError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffer::{Access, HeldBuffer, check_disjoint};
use crate::events::EventStream;
use crate::hashing::{key_from_py, keys_from_py};
use crate::pages::KvPages;
use crate::results::{Fetch, Lookup, Stored, miss_parts, tier_names};

/// Worker threads of each client's runtime: they read responses and events; the calls
/// themselves run on the calling Python thread.
const RUNTIME_THREADS: usize = 1;
fn client_err(e: ClientError) -> PyErr {
    match e {
        ClientError::BadUrl(_) | ClientError::Buffer(_) => PyValueError::new_err(e.to_string()),
        ClientError::Timeout => PyTimeoutError::new_err(e.to_string()),
        ClientError::Server {
            code: Some(ErrorCode::Unauthorized | ErrorCode::Forbidden),
            ..
        } => PyPermissionError::new_err(e.to_string()),
        ClientError::Server {
            code: Some(ErrorCode::LayoutMismatch),
            ..
        } => PyValueError::new_err(e.to_string()),
        ClientError::Connect(_) | ClientError::Disconnected | ClientError::Io(_) => {
            PyConnectionError::new_err(e.to_string())
        }
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

pub fn secs(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!("{what}: {s} is not a positive number of seconds"))
        })
}

/// A connection to a kvtier server, reopened when it fails. See the module docs.
#[pyclass(frozen, module = "kvtier")]
pub struct Client {
    rt: std::sync::Arc<tokio::runtime::Runtime>,
    client: kvtier_client::Client,
    #[pyo3(get)]
    url: String,
    lease: Duration,
}

impl Client {
    /// Runs `f` on this client's runtime with the GIL released.
    fn run<T: Send, F: Future<Output = T> + Send>(&self, py: Python<'_>, f: F) -> T {
        py.detach(|| self.rt.block_on(f))
    }

    fn check_pages(&self, keys: usize, page_ids: &[usize], pages: &KvPages) -> PyResult<()> {
        if keys != page_ids.len() {
            return Err(PyValueError::new_err(format!(
                "{keys} keys but {} page ids",
                page_ids.len()
            )));
        }
        if pages.block_bytes != self.client.block_bytes() {
            return Err(PyValueError::new_err(format!(
                "the pages' regions add up to {} bytes; blocks on this server are {} bytes",
                pages.block_bytes,
                self.client.block_bytes()
            )));
        }
        Ok(())
    }

    /// The longest cached prefix of `keys`, for a copy into an engine's pages: pinned in the
    /// server's arena on a local connection (no copy yet), else received into a scratch
    /// buffer of the fetched blocks. A failure is a miss in the fetch.
    fn fetch_source(&self, keys: &[BlockKey]) -> (Source, SdkFetch) {
        if !self.client.is_local() {
            let block = self.client.block_bytes();
            let mut scratch = vec![0u8; keys.len() * block];
            let mut dst: Vec<&mut [u8]> = scratch.chunks_mut(block.max(1)).collect();
            let f = self.rt.block_on(self.client.get_into(keys, &mut dst));
            scratch.truncate(f.blocks.min(keys.len()) * block);
            return (Source::Scratch(scratch), f);
        }
        match self.rt.block_on(self.client.get_pinned(keys, self.lease)) {
            Ok(p) => {
                let f = SdkFetch {
                    blocks: p.len(),
                    tiers: p.tiers().to_vec(),
                    miss: p.miss().cloned(),
                };
                (Source::Pinned(p), f)
            }
            Err(e) => (
                Source::Scratch(Vec::new()),
                SdkFetch {
                    blocks: 0,
                    tiers: vec![],
                    miss: Some(Miss::from_error(&e)),
                },
            ),
        }
    }

    /// Drops a fetched source inside the runtime, so the pins' release goes out at once.
    fn release_source(&self, src: Source) {
        let _rt = self.rt.enter();
        drop(src);
    }

    fn check_count(&self, keys: usize, bufs: usize) -> PyResult<()> {
        if keys != bufs {
            return Err(PyValueError::new_err(format!(
                "{keys} keys but {bufs} buffers"
            )));
        }
        Ok(())
    }

    /// Holds the caller's buffers: a list (one block each), or one buffer of `n` blocks.
    fn hold(&self, bufs: &Bound<'_, PyAny>, n: usize, access: Access) -> PyResult<Vec<HeldBuffer>> {
        let block = self.client.block_bytes();
        let is_list =
            bufs.is_instance_of::<PyList>() || bufs.is_instance_of::<pyo3::types::PyTuple>();
        let held: Vec<HeldBuffer> = if is_list {
            let mut out = Vec::new();
            for (i, b) in bufs.try_iter()?.enumerate() {
                let h = HeldBuffer::new(&b?, access, &format!("buffer {i}"))?;
                if h.len() != block {
                    return Err(PyValueError::new_err(format!(
                        "buffer {i} has {} bytes; blocks on this server are {block} bytes",
                        h.len()
                    )));
                }
                out.push(h);
            }
            self.check_count(n, out.len())?;
            out
        } else {
            let h = HeldBuffer::new(bufs, access, "buffer")?;
            if h.len() != n * block {
                return Err(PyValueError::new_err(format!(
                    "buffer has {} bytes; {n} blocks of {block} bytes need {}",
                    h.len(),
                    n * block
                )));
            }
            vec![h]
        };
        if access == Access::Write {
            check_disjoint(&held)?;
        }
        Ok(held)
    }
}

fn split_blocks(held: &[HeldBuffer], block: usize) -> Vec<&[u8]> {
    held.iter()
        .flat_map(|h| h.as_slice().chunks(block.max(1)))
        .collect()
}

#[pymethods]
impl Client {
    /// Connects to `url` ("unix:///path/kvtier.sock", "tcp://host:port", "tls://host:port",
    /// "quic://host:port") and says hello. `server_cert` (DER bytes or a file) is the
    /// certificate `tls://` and `quic://` trust (the server's, or its CA's); `quic_cert` is
    /// its former name, `quic_server_name` that of `server_name`. `client_cert` and
    /// `client_key` (DER bytes or files; both or neither) are this client's certificate and
    /// private key, presented on `tls://` and `quic://` (a server with tenants names the
    /// tenant that pins it). Raises ValueError for a malformed URL or both names given, and
    /// ConnectionError when no server answers.
    #[new]
    #[pyo3(signature = (
        url, *, token = None, server_cert = None, server_name = None, quic_cert = None,
        quic_server_name = None, client_cert = None, client_key = None,
        timeout = 5.0, connect_timeout = 2.0, reconnect_backoff = 1.0, block_bytes = 0,
        zero_copy = true, lease = 10.0, name = "kvtier-python", local_lookups = true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &str,
        token: Option<String>,
        server_cert: Option<&Bound<'_, PyAny>>,
        server_name: Option<&str>,
        quic_cert: Option<&Bound<'_, PyAny>>,
        quic_server_name: Option<&str>,
        client_cert: Option<&Bound<'_, PyAny>>,
        client_key: Option<&Bound<'_, PyAny>>,
        timeout: f64,
        connect_timeout: f64,
        reconnect_backoff: f64,
        block_bytes: u64,
        zero_copy: bool,
        lease: f64,
        name: &str,
        local_lookups: bool,
    ) -> PyResult<Self> {
        let mut cfg = ClientConfig::default();
        if let Some(t) = token {
            cfg.token = Some(t);
        }
        let cert = match (server_cert, quic_cert) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give server_cert or quic_cert (its former name), not both",
                ));
            }
            (c, q) => c.or(q),
        };
        if let Some(c) = cert {
            cfg.server_cert_der = Some(der_bytes("server_cert", c)?);
        }
        match (client_cert, client_key) {
            (Some(c), Some(k)) => {
                cfg.client_cert_der =
                    Some((der_bytes("client_cert", c)?, der_bytes("client_key", k)?));
            }
            (None, None) => {}
            _ => {
                return Err(PyValueError::new_err(
                    "give client_cert and client_key together (the certificate and its key)",
                ));
            }
        }
        match (server_name, quic_server_name) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give server_name or quic_server_name (its former name), not both",
                ));
            }
            (Some(n), None) | (None, Some(n)) => cfg.server_name = n.to_string(),
            (None, None) => {}
        }
        cfg.timeout = secs("timeout", timeout)?;
        cfg.connect_timeout = secs("connect_timeout", connect_timeout)?;
        cfg.reconnect_backoff = Duration::try_from_secs_f64(reconnect_backoff).map_err(|_| {
            PyValueError::new_err(format!(
                "reconnect_backoff: {reconnect_backoff} is not a number of seconds"
            ))
        })?;
        cfg.block_bytes = block_bytes;
        cfg.zero_copy = zero_copy;
        cfg.fast_local_lookups = local_lookups;
        let cfg_lease = secs("lease", lease)?;
        cfg.lease = cfg_lease;
        cfg.name = name.to_string();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("kvtier-python")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("starting the client runtime: {e}")))?;
        let url_owned = url.to_string();
        let client = py
            .detach(|| rt.block_on(kvtier_client::Client::connect(&url_owned, cfg)))
            .map_err(client_err)?;
        Ok(Self {
            rt: std::sync::Arc::new(rt),
            client,
            url: url.to_string(),
            lease: cfg_lease,
        })
    }

    /// Size of every block on this server, in bytes.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.client.block_bytes()
    }

    /// Whether gets read the server's mapped DRAM arena and puts go through this connection's
    /// staging region (unix:// with zero_copy).
    #[getter]
    fn is_local(&self) -> bool {
        self.client.is_local()
    }

    /// Round-trip time of a ping, in seconds. Raises on failure (ConnectionError,
    /// TimeoutError): a health check, not a cache call.
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        let d = self.run(py, self.client.ping()).map_err(client_err)?;
        Ok(d.as_secs_f64())
    }

    /// The longest cached prefix of `keys` (a list of 16-byte keys). A failure is a miss.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Lookup> {
        let keys = keys_from_py(keys)?;
        let l = self.run(py, self.client.lookup(&keys));
        let (miss, miss_detail) = miss_parts(l.miss.as_ref());
        Ok(Lookup {
            tiers: tier_names(&l.tiers),
            sources: l
                .sources
                .into_iter()
                .map(|s| (s.blocks.start, s.blocks.end, s.node))
                .collect(),
            miss,
            miss_detail,
        })
    }

    /// Copies the longest cached prefix of `keys` into `bufs`: a list of writable,
    /// C-contiguous buffers of `block_bytes` each, or one buffer of `len(keys) * block_bytes`.
    /// Returns a `Fetch`; a failure is a miss.
    fn get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
    ) -> PyResult<Fetch> {
        let keys = keys_from_py(keys)?;
        let mut held = self.hold(bufs, keys.len(), Access::Write)?;
        let block = self.client.block_bytes();
        let mut dst: Vec<&mut [u8]> = held
            .iter_mut()
            .flat_map(|h| h.as_mut_slice().chunks_mut(block.max(1)))
            .collect();
        let f = self.run(py, self.client.get_into(&keys, &mut dst));
        Ok(f.into())
    }

    /// Stores a chain: `keys[0]`'s parent is `parent` (None: the chain starts a prompt), each
    /// next key's parent the key before it. `bufs` as in `get_into` (read-only is fine).
    #[pyo3(signature = (keys, bufs, parent = None))]
    fn put_chain(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Stored> {
        let keys = keys_from_py(keys)?;
        let parent = parent.map(|p| key_from_py(p, "parent")).transpose()?;
        let held = self.hold(bufs, keys.len(), Access::Read)?;
        let src = split_blocks(&held, self.client.block_bytes());
        let s = self.run(py, self.client.put_chain(&keys, parent, &src));
        Ok(s.into())
    }

    /// Stores blocks with explicit parents: `parents[i]` is `keys[i]`'s parent key or None.
    /// Parents go before children.
    fn put(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        parents: &Bound<'_, PyAny>,
        bufs: &Bound<'_, PyAny>,
    ) -> PyResult<Stored> {
        let keys = keys_from_py(keys)?;
        let mut entries = Vec::with_capacity(keys.len());
        for (i, p) in parents.try_iter()?.enumerate() {
            let p = p?;
            let parent: Option<BlockKey> = if p.is_none() {
                None
            } else {
                Some(key_from_py(&p, &format!("parent {i}"))?)
            };
            let key = *keys.get(i).ok_or_else(|| {
                PyValueError::new_err(format!("{} keys but more parents", keys.len()))
            })?;
            entries.push(PutEntry { key, parent });
        }
        if entries.len() != keys.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} parents",
                keys.len(),
                entries.len()
            )));
        }
        let held = self.hold(bufs, keys.len(), Access::Read)?;
        let src = split_blocks(&held, self.client.block_bytes());
        let s = self.run(py, self.client.put(&entries, &src));
        Ok(s.into())
    }

    /// Copies the longest cached prefix of `keys` into the engine's pages: block `i` goes to
    /// page `page_ids[i]` of `pages`, region by region. On a local (zero-copy) connection the
    /// bytes are copied once, from the server's mapped arena straight into the pages; remote
    /// connections receive into a scratch buffer first. Returns a `Fetch`; a failure is a miss.
    fn get_pages(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        page_ids: Vec<usize>,
        pages: &KvPages,
    ) -> PyResult<Fetch> {
        let keys = keys_from_py(keys)?;
        self.check_pages(keys.len(), &page_ids, pages)?;
        pages.check_pages(&page_ids, true)?;
        let block = self.client.block_bytes();
        let f = py.detach(|| {
            // A server that will not pin the whole prefix at once (its per-connection pin
            // budget) pins the leading part and says "busy": copy that, release it and ask
            // for the rest, as `get_into` does, until a round makes no progress.
            let mut done = 0;
            let mut tiers = Vec::new();
            let mut stalls = 0;
            loop {
                let (src, f) = self.fetch_source(&keys[done..]);
                let n = f.blocks.min(page_ids.len() - done);
                let ids = &page_ids[done..done + n];
                {
                    let _held = pages.lock();
                    match &src {
                        Source::Pinned(p) => {
                            for (i, id) in ids.iter().enumerate() {
                                // SAFETY: `_held` is the pages' lock, the page ids were
                                // checked for writing, and the server's arena, which Python
                                // code never sees, cannot overlap the pages' buffers; the
                                // pins are held.
                                unsafe { pages.copy_in(p.block(i), std::slice::from_ref(id)) };
                            }
                        }
                        // SAFETY: as above; the scratch buffer is our own allocation.
                        Source::Scratch(buf) => unsafe { pages.copy_in(&buf[..n * block], ids) },
                    }
                }
                self.release_source(src);
                done += n;
                tiers.extend(f.tiers.into_iter().take(n));
                stalls = if n == 0 { stalls + 1 } else { 0 };
                if f.miss != Some(Miss::Busy)
                    || done == keys.len()
                    || stalls > kvtier_client::BUSY_RETRIES
                {
                    break SdkFetch {
                        blocks: done,
                        tiers,
                        miss: f.miss,
                    };
                }
                if n == 0 {
                    // The previous round's release may not have reached the server yet.
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Ok(f.into())
    }

    /// Starts a load of the longest cached prefix of `keys` into pages `page_ids` of `pages`
    /// that the caller finishes part by part (`PagesLoad.copy_range`, one layer at a time): on
    /// a local connection the blocks are pinned in the server's arena (one message) and stay
    /// pinned until `release`; remote connections receive them into a scratch buffer first.
    /// No page is written yet. A failure is a miss (`PagesLoad.fetch`).
    fn load_pages(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        page_ids: Vec<usize>,
        pages: &KvPages,
    ) -> PyResult<PagesLoad> {
        let keys = keys_from_py(keys)?;
        self.check_pages(keys.len(), &page_ids, pages)?;
        pages.check_pages(&page_ids, true)?;
        let block = self.client.block_bytes();
        let (src, fetch) = py.detach(|| self.fetch_source(&keys));
        let blocks = fetch.blocks.min(page_ids.len());
        Ok(PagesLoad {
            rt: self.rt.clone(),
            src: std::sync::Mutex::new(Some(src)),
            page_ids: page_ids[..blocks].to_vec(),
            block,
            fetch: fetch.into(),
        })
    }

    /// Stores the blocks in pages `page_ids` of `pages` under `keys`, as a chain from
    /// `parent` (see `put_chain`). The blocks are gathered into one scratch buffer, then put.
    #[pyo3(signature = (keys, page_ids, pages, parent = None))]
    fn put_pages(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        page_ids: Vec<usize>,
        pages: &KvPages,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Stored> {
        let keys = keys_from_py(keys)?;
        let parent = parent.map(|p| key_from_py(p, "parent")).transpose()?;
        self.check_pages(keys.len(), &page_ids, pages)?;
        pages.check_pages(&page_ids, false)?;
        let block = self.client.block_bytes();
        let s = py.detach(|| {
            let mut scratch = vec![0u8; keys.len() * block];
            {
                let _held = pages.lock();
                // SAFETY: `_held` is the pages' lock, the page ids were checked, and `scratch`
                // is ours.
                unsafe { pages.copy_out(&page_ids, &mut scratch) };
            }
            let bufs: Vec<&[u8]> = scratch.chunks(block.max(1)).collect();
            self.rt
                .block_on(self.client.put_chain(&keys, parent, &bufs))
        });
        Ok(s.into())
    }

    /// Asks the server to copy NVMe-only blocks among `keys` up to DRAM ahead of use;
    /// returns how many copies it queued. Raises on failure (a hint, not a cache call).
    fn prefetch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<u64> {
        let keys = keys_from_py(keys)?;
        self.run(py, self.client.prefetch(&keys))
            .map_err(client_err)
    }

    /// A retention hint: the session's prefix `keys` (chain keys from its first block) will
    /// be looked up again in about `expected_return_s` seconds (0 to 86,400). Returns a dict:
    /// `status` ("accepted", "nothing_cached", "over_namespace_budget", "over_global_budget",
    /// "too_far", "off"), `blocks` protected and `hold_s`. Raises on a bad argument or a
    /// failed call (a hint, not a cache call).
    #[pyo3(signature = (keys, expected_return_s, session=0, priority=0))]
    fn retain<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        expected_return_s: f64,
        session: u64,
        priority: u8,
    ) -> PyResult<Bound<'py, PyDict>> {
        let keys = keys_from_py(keys)?;
        let ret = Duration::try_from_secs_f64(expected_return_s).map_err(|_| {
            PyValueError::new_err(format!(
                "expected_return_s: {expected_return_s} is not a number of seconds >= 0"
            ))
        })?;
        let r = self
            .run(py, self.client.retain(session, &keys, ret, priority))
            .map_err(client_err)?;
        let status = match r.status {
            Some(RetainStatus::Accepted) => "accepted",
            Some(RetainStatus::NothingCached) => "nothing_cached",
            Some(RetainStatus::OverNamespaceBudget) => "over_namespace_budget",
            Some(RetainStatus::OverGlobalBudget) => "over_global_budget",
            Some(RetainStatus::TooFar) => "too_far",
            Some(RetainStatus::Off) => "off",
            None => "unknown",
        };
        let d = PyDict::new(py);
        d.set_item("status", status)?;
        d.set_item("blocks", r.blocks)?;
        d.set_item("hold_s", r.hold.as_secs_f64())?;
        Ok(d)
    }

    /// Removes blocks; returns how many were cached.
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<u64> {
        let keys = keys_from_py(keys)?;
        self.run(py, self.client.remove(&keys)).map_err(client_err)
    }

    /// Removes every block of the server (all tenants).
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, self.client.clear()).map_err(client_err)
    }

    /// The server's statistics, as a dict (the JSON of its admin port's `/stats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = self.run(py, self.client.stats()).map_err(client_err)?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Subscribes to block events from sequence `from_seq` (None: from now). With
    /// `snapshot`, every cached block first arrives as a "stored" event with sequence 0.
    #[pyo3(signature = (from_seq = None, snapshot = false))]
    fn events(
        &self,
        py: Python<'_>,
        from_seq: Option<u64>,
        snapshot: bool,
    ) -> PyResult<EventStream> {
        let stream = self
            .run(py, self.client.events(from_seq, snapshot))
            .map_err(client_err)?;
        Ok(EventStream::new(self.rt.clone(), stream))
    }

    fn __repr__(&self) -> String {
        format!(
            "Client(url={:?}, block_bytes={}, is_local={})",
            self.url,
            self.client.block_bytes(),
            if self.client.is_local() {
                "True"
            } else {
                "False"
            }
        )
    }
}

/// A certificate or key: DER bytes, or a path (str / os.PathLike) to a DER file such as the
/// server's `<runtime_dir>/quic-cert.der`; `what` names the argument in errors.
fn der_bytes(what: &str, c: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = c.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let path: std::path::PathBuf = c.extract().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!("{what}: expected DER bytes or a file path"))
    })?;
    std::fs::read(&path)
        .map_err(|e| PyValueError::new_err(format!("{what}: reading {}: {e}", path.display())))
}

/// Where a started load's blocks are: pinned in the server's arena, or received.
enum Source {
    Pinned(kvtier_client::PinnedBlocks),
    Scratch(Vec<u8>),
}

/// How long before its pins' lease runs out a load stops copying out of the arena (the server
/// may reuse a slot once the lease is over).
const LEASE_MARGIN: Duration = Duration::from_millis(100);

/// A load started by `Client.load_pages`: its blocks are fetched (pinned in the server's
/// arena, or received), and go into the engine's pages a byte range of every block at a time,
/// so an engine can start on layer 0 while later layers are still being copied.
#[pyclass(frozen, module = "kvtier")]
pub struct PagesLoad {
    rt: std::sync::Arc<tokio::runtime::Runtime>,
    src: std::sync::Mutex<Option<Source>>,
    /// The pages of the fetched blocks (the first `fetch.blocks` of those asked for).
    page_ids: Vec<usize>,
    block: usize,
    fetch: Fetch,
}

impl PagesLoad {
    fn source(&self) -> std::sync::MutexGuard<'_, Option<Source>> {
        self.src.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PagesLoad {
    /// The fetch: how many of the asked-for blocks arrived (the longest prefix), their tiers,
    /// and why the rest did not.
    #[getter]
    fn fetch(&self) -> Fetch {
        self.fetch.clone()
    }

    /// Copies bytes `lo..hi` of every fetched block into its page, with the GIL released.
    /// Returns False, copying nothing, once released or when the pins' lease is about to run
    /// out: the caller must then treat the blocks as not loaded.
    fn copy_range(&self, py: Python<'_>, pages: &KvPages, lo: usize, hi: usize) -> PyResult<bool> {
        if pages.block_bytes != self.block {
            return Err(PyValueError::new_err(format!(
                "the pages' regions add up to {} bytes; this load's blocks are {} bytes",
                pages.block_bytes, self.block
            )));
        }
        if lo > hi || hi > self.block {
            return Err(PyValueError::new_err(format!(
                "range {lo}..{hi} is not inside a block of {} bytes",
                self.block
            )));
        }
        pages.check_pages(&self.page_ids, true)?;
        Ok(py.detach(|| {
            let src = self.source();
            let _held = pages.lock();
            match src.as_ref() {
                None => false,
                Some(Source::Pinned(p)) => {
                    if std::time::Instant::now() + LEASE_MARGIN >= p.deadline() {
                        return false;
                    }
                    for (i, &page) in self.page_ids.iter().enumerate() {
                        // SAFETY: `_held` is the pages' lock; the page ids passed
                        // `check_pages` for writing; the pinned block lies in the server's
                        // arena, which Python code never sees and no held buffer overlaps, and
                        // its lease has not run out (checked above, with a margin far longer
                        // than this copy).
                        unsafe { pages.copy_in_range(p.block(i), page, lo, hi) };
                    }
                    true
                }
                Some(Source::Scratch(buf)) => {
                    for (i, &page) in self.page_ids.iter().enumerate() {
                        let block = &buf[i * self.block..(i + 1) * self.block];
                        // SAFETY: as above; `buf` is this load's own allocation.
                        unsafe { pages.copy_in_range(block, page, lo, hi) };
                    }
                    true
                }
            }
        }))
    }

    /// Releases the pins (or the scratch buffer). Later `copy_range` calls copy nothing.
    fn release(&self, py: Python<'_>) {
        let src = self.source().take();
        // Dropped inside the runtime: the pins' release goes out at once.
        py.detach(|| {
            let _rt = self.rt.enter();
            drop(src);
        });
    }

    fn __repr__(&self) -> String {
        format!(
            "PagesLoad(blocks={}, released={})",
            self.page_ids.len(),
            self.source().is_none()
        )
    }
}
