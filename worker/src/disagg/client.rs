//! The decode side's end of the control channel: one JSON `POST` per request over the
//! workspace's HTTP client ([`kvtier_client::http`]), with the decode role's connect timeout,
//! request deadline and answer size bound.

use std::time::Duration;

use kvtier_client::ClientError;
use kvtier_client::http::{HttpClient, HttpConfig, HttpRequest};

use super::wire::MAX_RESPONSE_BYTES;

/// Why a control call failed. `NotSent`: the connection was never made, so the prefill
/// worker cannot have acted on the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ControlError {
    NotSent(String),
    Failed(String),
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlError::NotSent(r) => write!(f, "prefill worker unreachable: {r}"),
            ControlError::Failed(r) => write!(f, "remote prefill failed: {r}"),
        }
    }
}

/// `host:port` of an `http://host:port[/...]` URL.
pub(crate) fn authority(url: &str) -> Result<&str, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("prefill URL `{url}` does not start with http://"))?;
    let auth = rest.split('/').next().unwrap_or_default();
    if auth.is_empty() || !auth.contains(':') {
        return Err(format!("prefill URL `{url}` has no host:port"));
    }
    Ok(auth)
}

/// Posts `body` as JSON to `path` at `url` and returns the status and body of the answer
/// (at most [`MAX_RESPONSE_BYTES`]).
pub(crate) async fn post_json(
    url: &str,
    path: &str,
    body: &[u8],
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ControlError> {
    let auth = authority(url).map_err(ControlError::NotSent)?;
    let client = HttpClient::new(HttpConfig {
        connect_timeout,
        timeout,
        max_body_bytes: MAX_RESPONSE_BYTES,
        keep_alive: false,
    });
    let req = HttpRequest::post_json(format!("http://{auth}{path}"), body.to_vec());
    match client.send(req).await {
        Ok(r) => Ok((r.status, r.body.to_vec())),
        Err(e @ (ClientError::Connect(_) | ClientError::HttpUrl(_))) => {
            Err(ControlError::NotSent(e.to_string()))
        }
        Err(ClientError::Timeout) => Err(ControlError::Failed(format!(
            "no answer from {auth} within {timeout:?}"
        ))),
        Err(e) => Err(ControlError::Failed(format!("exchange with {auth}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_not() {
        assert_eq!(authority("http://127.0.0.1:80").unwrap(), "127.0.0.1:80");
        assert_eq!(authority("http://h:1/x").unwrap(), "h:1");
        assert!(authority("https://h:1").is_err());
        assert!(authority("http://h").is_err());
        assert!(authority("http://").is_err());
    }

    #[tokio::test]
    async fn an_unreachable_prefill_worker_is_not_sent_and_a_silent_one_fails() {
        let t = Duration::from_millis(300);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let e = post_json(&url, "/p", b"{}", t, t).await.unwrap_err();
        assert!(matches!(e, ControlError::NotSent(_)), "{e}");
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let e = post_json(&url, "/p", b"{}", t, t).await.unwrap_err();
        assert!(
            matches!(&e, ControlError::Failed(m) if m.contains("no answer")),
            "{e}"
        );
    }
}
