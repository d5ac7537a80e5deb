//! Block identity and layout: `HashSecret`, `KvLayout`, `NamespaceBuilder`, `PrefixHasher`,
//! thin wrappers over kvtier-core's (the same keys, byte for byte).

use std::sync::Mutex;

use kvtier_core::{BlockKey, CoreError, Dtype, HashScheme, KvKind, KvTensor, Namespace};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

pub fn core_err(e: CoreError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A key from Python: exactly 16 bytes (`bytes`, `bytearray` or anything bytes-like).
pub fn key_from_py(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<BlockKey> {
    let raw: Vec<u8> = if let Ok(b) = obj.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what}: a key is 16 bytes, not a str (bytes.fromhex(s) parses the hex form)"
        )));
    } else {
        let held = crate::buffer::HeldBuffer::new(obj, crate::buffer::Access::Read, what)?;
        held.as_slice().to_vec()
    };
    let arr: [u8; 16] = raw.as_slice().try_into().map_err(|_| {
        PyValueError::new_err(format!("{what}: a key is 16 bytes, got {}", raw.len()))
    })?;
    Ok(BlockKey::from_bytes(arr))
}

/// A list of keys from any iterable of 16-byte values.
pub fn keys_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    if obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "keys: expected a list of 16-byte keys, got one bytes object (wrap it in a list)",
        ));
    }
    let mut out = Vec::new();
    for (i, k) in obj.try_iter()?.enumerate() {
        out.push(key_from_py(&k?, &format!("key {i}"))?);
    }
    Ok(out)
}

pub fn keys_to_py<'py>(py: Python<'py>, keys: &[BlockKey]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))
}

/// The deployment secret every key is keyed with. `scheme`: "xxh3" (fast, the default) or
/// "blake3" (a cryptographic MAC, for tenants that do not trust each other).
#[pyclass(frozen, module = "kvtier")]
#[derive(Clone)]
pub struct HashSecret {
    pub inner: kvtier_core::HashSecret,
}

#[pymethods]
impl HashSecret {
    #[new]
    #[pyo3(signature = (secret, scheme = "xxh3"))]
    fn new(secret: &[u8], scheme: &str) -> PyResult<Self> {
        let scheme = HashScheme::parse(scheme).map_err(core_err)?;
        Ok(Self {
            inner: kvtier_core::HashSecret::new(scheme, secret).map_err(core_err)?,
        })
    }

    /// kvtier's fixed, public development secret (the Rust `HashSecret::development()`).
    #[staticmethod]
    fn development() -> Self {
        Self {
            inner: kvtier_core::HashSecret::development(),
        }
    }

    #[getter]
    fn scheme(&self) -> &'static str {
        self.inner.scheme().name()
    }

    fn __repr__(&self) -> String {
        format!("HashSecret(scheme={:?})", self.inner.scheme().name())
    }
}

/// The byte layout of one block's KV (layer-major; see kvtier-core's `KvLayout`).
#[pyclass(frozen, eq, hash, module = "kvtier")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub inner: kvtier_core::KvLayout,
}

fn tensor(name: &str) -> PyResult<KvTensor> {
    match name {
        "k" | "key" => Ok(KvTensor::Key),
        "v" | "value" => Ok(KvTensor::Value),
        "latent" => Ok(KvTensor::Latent),
        _ => Err(PyValueError::new_err(format!(
            "unknown tensor {name:?} (expected \"k\", \"v\" or \"latent\")"
        ))),
    }
}

#[pymethods]
impl KvLayout {
    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, dtype, block_tokens, mla = false))]
    fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: &str,
        block_tokens: u32,
        mla: bool,
    ) -> PyResult<Self> {
        let dtype = Dtype::parse(dtype).map_err(core_err)?;
        let kind = if mla { KvKind::Mla } else { KvKind::KeyValue };
        Ok(Self {
            inner: kvtier_core::KvLayout::with_kind(
                num_layers,
                num_kv_heads,
                head_dim,
                dtype,
                block_tokens,
                kind,
            )
            .map_err(core_err)?,
        })
    }

    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers()
    }
    #[getter]
    fn num_kv_heads(&self) -> u32 {
        self.inner.num_kv_heads()
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }
    #[getter]
    fn block_tokens(&self) -> u32 {
        self.inner.block_tokens()
    }
    #[getter]
    fn mla(&self) -> bool {
        self.inner.kind() == KvKind::Mla
    }
    #[getter]
    fn tensors_per_layer(&self) -> u32 {
        self.inner.tensors_per_layer()
    }
    #[getter]
    fn token_bytes(&self) -> u64 {
        self.inner.token_bytes()
    }
    #[getter]
    fn tensor_bytes(&self) -> u64 {
        self.inner.tensor_bytes()
    }
    #[getter]
    fn layer_bytes(&self) -> u64 {
        self.inner.layer_bytes()
    }
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes()
    }
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.inner.bytes_per_token()
    }

    /// The stable 64-bit identity hashed into every namespace.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    /// `(start, end)` byte offsets of `layer` inside a block.
    fn layer_range(&self, layer: u32) -> PyResult<(u64, u64)> {
        self.inner
            .layer_range(layer)
            .map(|r| (r.start, r.end))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "layer {layer} out of range (the layout has {})",
                    self.inner.num_layers()
                ))
            })
    }

    /// `(start, end)` byte offsets of one tensor ("k", "v" or "latent") of `layer`.
    fn tensor_range(&self, layer: u32, tensor_name: &str) -> PyResult<(u64, u64)> {
        let t = tensor(tensor_name)?;
        self.inner
            .tensor_range(layer, t)
            .map(|r| (r.start, r.end))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "no tensor {tensor_name:?} of layer {layer} in this layout"
                ))
            })
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "KvLayout(num_layers={}, num_kv_heads={}, head_dim={}, dtype={:?}, block_tokens={}, mla={})",
            l.num_layers(),
            l.num_kv_heads(),
            l.head_dim(),
            l.dtype().name(),
            l.block_tokens(),
            if l.kind() == KvKind::Mla {
                "True"
            } else {
                "False"
            }
        )
    }
}

/// Fields of a namespace: what must match for two blocks to be the same.
#[pyclass(frozen, module = "kvtier")]
pub struct NamespaceBuilder {
    inner: kvtier_core::NamespaceBuilder,
}

#[pymethods]
impl NamespaceBuilder {
    /// `layout`: a `KvLayout` or its 64-bit fingerprint.
    #[new]
    #[pyo3(signature = (model_id, layout, *, tp_rank = 0, tp_size = 1, adapter_id = None, cache_salt = None))]
    fn new(
        model_id: &str,
        layout: &Bound<'_, PyAny>,
        tp_rank: u32,
        tp_size: u32,
        adapter_id: Option<&str>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let fingerprint = if let Ok(l) = layout.cast::<KvLayout>() {
            l.get().inner.fingerprint()
        } else {
            layout.extract::<u64>().map_err(|_| {
                PyTypeError::new_err("layout: expected a KvLayout or its fingerprint (an int)")
            })?
        };
        let mut b = kvtier_core::NamespaceBuilder::new(model_id, fingerprint)
            .tensor_parallel(tp_rank, tp_size);
        if let Some(a) = adapter_id {
            b = b.adapter(a);
        }
        if let Some(s) = cache_salt {
            let salt: Vec<u8> = if let Ok(s) = s.extract::<String>() {
                s.into_bytes()
            } else if let Ok(b) = s.cast::<PyBytes>() {
                b.as_bytes().to_vec()
            } else {
                return Err(PyTypeError::new_err("cache_salt: expected str or bytes"));
            };
            b = b.cache_salt(salt);
        }
        Ok(Self { inner: b })
    }

    /// The exact bytes hashed into the namespace.
    #[pyo3(signature = (scheme = "xxh3"))]
    fn encode<'py>(&self, py: Python<'py>, scheme: &str) -> PyResult<Bound<'py, PyBytes>> {
        let scheme = HashScheme::parse(scheme).map_err(core_err)?;
        let enc = self.inner.encode(scheme).map_err(core_err)?;
        Ok(PyBytes::new(py, &enc))
    }

    /// The namespace key (16 bytes) under `secret`.
    fn build<'py>(&self, py: Python<'py>, secret: &HashSecret) -> PyResult<Bound<'py, PyBytes>> {
        let ns = self.inner.build(&secret.inner).map_err(core_err)?;
        Ok(PyBytes::new(py, ns.key().as_bytes()))
    }
}

/// The chained keys of a prompt's full blocks. Safe to share between threads (calls are
/// serialized on an internal lock; the hash itself runs with the GIL released).
#[pyclass(frozen, module = "kvtier")]
pub struct PrefixHasher {
    inner: Mutex<kvtier_core::PrefixHasher>,
    namespace: Namespace,
    block_tokens: usize,
}

fn tokens_from_py(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let mut out = Vec::new();
    for (i, t) in tokens.try_iter()?.enumerate() {
        let t = t?;
        out.push(t.extract::<u32>().map_err(|_| {
            PyValueError::new_err(format!(
                "token {i}: {} is not a token id (an int from 0 to 2**32 - 1)",
                t.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?);
    }
    Ok(out)
}

#[pymethods]
impl PrefixHasher {
    /// `namespace`: a `NamespaceBuilder`; `block_tokens`: a power of two from 1 to 512.
    #[new]
    fn new(secret: &HashSecret, namespace: &NamespaceBuilder, block_tokens: u32) -> PyResult<Self> {
        let ns = namespace.inner.build(&secret.inner).map_err(core_err)?;
        let h = kvtier_core::PrefixHasher::new(secret.inner.clone(), ns, block_tokens)
            .map_err(core_err)?;
        Ok(Self {
            inner: Mutex::new(h),
            namespace: ns,
            block_tokens: block_tokens as usize,
        })
    }

    #[getter]
    fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    #[getter]
    fn namespace<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.namespace.key().as_bytes())
    }

    /// The keys (16 bytes each) of every full block of `tokens` (an iterable of ints); a
    /// trailing partial block has no key.
    fn prompt_keys<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = tokens_from_py(tokens)?;
        let keys = py.detach(|| {
            let mut out = Vec::with_capacity(tokens.len() / self.block_tokens);
            let mut h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            h.prompt_keys(&tokens, &mut out);
            out
        });
        keys_to_py(py, &keys)
    }

    /// The key of one block of exactly `block_tokens` tokens, given its parent's key (None for
    /// the first block).
    #[pyo3(signature = (parent, tokens))]
    fn block_key<'py>(
        &self,
        py: Python<'py>,
        parent: Option<&Bound<'py, PyAny>>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let parent = parent.map(|p| key_from_py(p, "parent")).transpose()?;
        let tokens = tokens_from_py(tokens)?;
        let mut h = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let k = h.block_key(parent, &tokens).map_err(core_err)?;
        Ok(PyBytes::new(py, k.as_bytes()))
    }
}
