//! A blocking wrapper for engines without an async runtime: each call runs on a small
//! runtime owned by the wrapper (one worker thread, which also reads responses and events
//! between calls).

use std::time::Duration;

use crate::{
    BlockKey, Client, ClientConfig, ClientError, Fetch, Lookup, PutEntry, Retained, Stored,
    TierCode,
};

pub struct BlockingClient {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl BlockingClient {
    pub fn connect(url: &str, config: ClientConfig) -> Result<Self, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvtier-client")
            .enable_all()
            .build()
            .map_err(ClientError::Io)?;
        let client = rt.block_on(Client::connect(url, config))?;
        Ok(Self { rt, client })
    }

    /// The async client underneath (for use from the wrapper's own runtime).
    pub fn client(&self) -> &Client {
        &self.client
    }
    pub fn block_bytes(&self) -> usize {
        self.client.block_bytes()
    }
    pub fn is_local(&self) -> bool {
        self.client.is_local()
    }
    pub fn ping(&self) -> Result<Duration, ClientError> {
        self.rt.block_on(self.client.ping())
    }
    pub fn lookup(&self, keys: &[BlockKey]) -> Lookup {
        self.rt.block_on(self.client.lookup(keys))
    }
    pub fn get_into(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Fetch {
        self.rt.block_on(self.client.get_into(keys, bufs))
    }
    pub fn put(&self, entries: &[PutEntry], bufs: &[&[u8]]) -> Stored {
        self.rt.block_on(self.client.put(entries, bufs))
    }
    pub fn put_chain(&self, keys: &[BlockKey], parent: Option<BlockKey>, bufs: &[&[u8]]) -> Stored {
        self.rt.block_on(self.client.put_chain(keys, parent, bufs))
    }
    pub fn prefetch(&self, keys: &[BlockKey]) -> Result<u64, ClientError> {
        self.rt.block_on(self.client.prefetch(keys))
    }
    pub fn pin(
        &self,
        keys: &[BlockKey],
        lease: Duration,
    ) -> Result<(u64, Vec<TierCode>), ClientError> {
        self.rt.block_on(self.client.pin(keys, lease))
    }
    pub fn release(&self, lease_id: u64) -> Result<(), ClientError> {
        self.rt.block_on(self.client.release(lease_id))
    }
    pub fn retain(
        &self,
        session: u64,
        keys: &[BlockKey],
        expected_return: Duration,
        priority: u8,
    ) -> Result<Retained, ClientError> {
        self.rt
            .block_on(self.client.retain(session, keys, expected_return, priority))
    }
    pub fn remove(&self, keys: &[BlockKey]) -> Result<u64, ClientError> {
        self.rt.block_on(self.client.remove(keys))
    }
    pub fn stats(&self) -> Result<String, ClientError> {
        self.rt.block_on(self.client.stats())
    }
}
