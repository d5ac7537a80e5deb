//! The decode side's end of the control channel: one HTTP/1.1 `POST` per request on a fresh
//! loopback or LAN connection (`Connection: close`), enough for one JSON exchange. The
//! workspace has no HTTP client, and this one needs none of a client's generality.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

/// Posts `body` as JSON to `path` at `url` and returns the status and body of the answer.
pub(crate) async fn post_json(
    url: &str,
    path: &str,
    body: &[u8],
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ControlError> {
    let auth = authority(url).map_err(ControlError::NotSent)?;
    let mut sock = match tokio::time::timeout(connect_timeout, TcpStream::connect(auth)).await {
        Err(_) => {
            return Err(ControlError::NotSent(format!(
                "connecting to {auth} timed out after {connect_timeout:?}"
            )));
        }
        Ok(Err(e)) => return Err(ControlError::NotSent(format!("connecting to {auth}: {e}"))),
        Ok(Ok(s)) => s,
    };
    let exchange = async {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {auth}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        sock.write_all(head.as_bytes()).await?;
        sock.write_all(body).await?;
        sock.flush().await?;
        let mut answer = Vec::new();
        (&mut sock)
            .take(MAX_RESPONSE_BYTES as u64 + 1)
            .read_to_end(&mut answer)
            .await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| ControlError::Failed(format!("no answer from {auth} within {timeout:?}")))?
        .map_err(|e| ControlError::Failed(format!("exchange with {auth}: {e}")))?;
    if answer.len() > MAX_RESPONSE_BYTES {
        return Err(ControlError::Failed(format!(
            "answer over {MAX_RESPONSE_BYTES} bytes"
        )));
    }
    parse_response(&answer).map_err(ControlError::Failed)
}

/// Status and body of a complete HTTP/1.1 answer read to EOF.
pub(crate) fn parse_response(answer: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("answer without a complete header")?;
    let head = std::str::from_utf8(&answer[..split]).map_err(|_| "answer header is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line `{status_line}`"))?;
    let mut body = answer[split + 4..].to_vec();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("transfer-encoding") && !value.eq_ignore_ascii_case("identity")
        {
            return Err(format!("unsupported transfer-encoding `{value}`"));
        }
        if name.eq_ignore_ascii_case("content-length") {
            let len: usize = value
                .parse()
                .map_err(|_| format!("bad content-length `{value}`"))?;
            if body.len() < len {
                return Err(format!("answer cut short: {} of {len} bytes", body.len()));
            }
            body.truncate(len);
        }
    }
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_answers_parse_or_say_why_not() {
        assert_eq!(authority("http://127.0.0.1:80").unwrap(), "127.0.0.1:80");
        assert_eq!(authority("http://h:1/x").unwrap(), "h:1");
        assert!(authority("https://h:1").is_err());
        assert!(authority("http://h").is_err());
        assert!(authority("http://").is_err());

        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(ok).unwrap(), (200, b"{}".to_vec()));
        let extra = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 1\r\n\r\nxy";
        assert_eq!(parse_response(extra).unwrap(), (400, b"x".to_vec()));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse_response(b"FTP 200\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
        assert!(parse_response(chunked).unwrap_err().contains("chunked"));
    }
}
