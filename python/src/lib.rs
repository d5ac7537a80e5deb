//! The `kvtier._kvtier` extension module: Python bindings of kvtier-client (the SDK) and of
//! kvtier-core's block hasher and KV layout. The `kvtier` package re-exports it
//! (`python/kvtier/__init__.py`); `docs/python.md` is the user's guide.

mod buffer;
mod client;
mod events;
mod hashing;
mod pages;
mod results;

use pyo3::prelude::*;

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<hashing::HashSecret>()?;
    m.add_class::<hashing::KvLayout>()?;
    m.add_class::<hashing::NamespaceBuilder>()?;
    m.add_class::<hashing::PrefixHasher>()?;
    m.add_class::<pages::KvPages>()?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::PagesLoad>()?;
    m.add_class::<results::Lookup>()?;
    m.add_class::<results::Fetch>()?;
    m.add_class::<results::Stored>()?;
    m.add_class::<events::BlockEvent>()?;
    m.add_class::<events::EventGap>()?;
    m.add_class::<events::EventStream>()?;
    m.add("HASH_SCHEME_VERSION", kvtier_core::key::HASH_SCHEME_VERSION)?;
    m.add("KEY_BYTES", kvtier_core::BlockKey::BYTES)?;
    Ok(())
}
