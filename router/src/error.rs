/// Everything the router can fail with at startup (requests fail as HTTP answers).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    #[error("configuration `{field}`: {reason}")]
    Config { field: String, reason: String },
    /// The model's configuration or tokenizer cannot be loaded.
    #[error("model: {0}")]
    Model(#[from] kvtier_worker::WorkerError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}
