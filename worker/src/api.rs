//! The OpenAI-compatible request and response bodies: parsing and validation (every bad
//! field gets a 4xx with an OpenAI-style error body), the chat template, and the JSON the
//! worker answers with.
//!
//! Chat template: the model's own when its directory has one ([`crate::chat`]); else the
//! worker's (documented in `docs/worker.md`): for each message `<|{role}|>\n{content}\n`,
//! then `<|assistant|>\n`, encoded as a plain-text prompt is (with the special tokens the
//! tokenizer's configuration asks for: the byte tokenizer's BOS in front).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{FinishReason, Sampling};
use crate::scheduler::Usage;
use crate::tokenizer::Tokenizer;
#[cfg(test)]
use crate::tokenizer::{ByteTokenizer, Utf8Stream};

/// `max_tokens` when the request gives none.
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Highest accepted `temperature` (as OpenAI).
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Longest `kvtier_retain_s` accepted: a day (the protocol's limit on a retention hint).
pub const MAX_RETAIN_S: f64 = 86_400.0;
/// Longest accepted `cache_salt`.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;
/// Longest accepted `user`.
pub const MAX_USER_BYTES: usize = 1024;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn server(status: StatusCode, message: impl Into<String>, code: &'static str) -> Self {
        Self {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// The `requests_total` label of this outcome.
    pub fn status_label(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::PAYLOAD_TOO_LARGE => "too_large",
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => "busy",
            s if s.is_client_error() => "bad_request",
            _ => "error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Which endpoint a request came in on (shapes the response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A validated request.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_salt: Option<String>,
    /// OpenAI's `user`: who the request is for. The worker ignores it; a router may keep a
    /// session on one worker by it.
    pub user: Option<String>,
    /// `kvtier_retain_s` (a kvtier extension): the client expects to send the conversation's
    /// next request in about this long (an agent running a tool); after the response the
    /// worker asks the kvtier server to keep this request's prefix (prompt and answer) until
    /// then ([`kvtier_client::Client::retain`]).
    pub retain: Option<std::time::Duration>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct RawRequest {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<RawMessage>>,
    /// Tool definitions, handed to the model's chat template as they are.
    tools: Option<Value>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    cache_salt: Option<String>,
    user: Option<String>,
    n: Option<i64>,
    kvtier_retain_s: Option<f64>,
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    /// Absent or null for an assistant message that only calls tools.
    #[serde(default)]
    content: Value,
    /// An assistant's tool calls (OpenAI form), for the template.
    tool_calls: Option<Value>,
    /// A `tool` message's answer to this call id, for the template.
    tool_call_id: Option<String>,
    name: Option<String>,
}

/// What the server checks a request against.
pub struct Limits<'a> {
    pub model_name: &'a str,
    pub max_context_tokens: usize,
    pub vocab_size: usize,
    /// Encodes text prompts and chat templates.
    pub tokenizer: &'a Tokenizer,
    /// Seed for sampled requests that give none.
    pub fallback_seed: u64,
}

/// Parses and validates a request body for `endpoint`.
pub fn parse(body: &[u8], endpoint: Endpoint, lim: &Limits) -> Result<ParsedRequest, ApiError> {
    let raw: RawRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}"), None))?;
    if let Some(m) = &raw.model
        && m != lim.model_name
    {
        return Err(ApiError::invalid(
            format!(
                "the model `{m}` does not exist; this worker serves `{}`",
                lim.model_name
            ),
            Some("model"),
        )
        .with_code("model_not_found")
        .with_status(StatusCode::NOT_FOUND));
    }
    if let Some(n) = raw.n
        && n != 1
    {
        return Err(ApiError::invalid(
            format!("n = {n} is not supported; only n = 1"),
            Some("n"),
        ));
    }
    let (max_tokens, explicit) = match (endpoint, raw.max_tokens, raw.max_completion_tokens) {
        (_, Some(m), _) => ((m, "max_tokens"), true),
        (Endpoint::Chat, None, Some(m)) => ((m, "max_completion_tokens"), true),
        _ => ((DEFAULT_MAX_TOKENS as i64, "max_tokens"), false),
    };
    if max_tokens.0 < 1 {
        return Err(ApiError::invalid(
            format!("{} must be at least 1, got {}", max_tokens.1, max_tokens.0),
            Some(max_tokens.1),
        ));
    }
    let max_tokens = usize::try_from(max_tokens.0).unwrap_or(usize::MAX);
    let temperature = raw.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("temperature must be between 0 and {MAX_TEMPERATURE}, got {temperature}"),
            Some("temperature"),
        ));
    }
    if let Some(s) = &raw.user
        && s.len() > MAX_USER_BYTES
    {
        return Err(ApiError::invalid(
            format!("user is longer than {MAX_USER_BYTES} bytes"),
            Some("user"),
        ));
    }
    let retain = match raw.kvtier_retain_s {
        None => None,
        Some(s) if s.is_finite() && (0.0..=MAX_RETAIN_S).contains(&s) => {
            Some(std::time::Duration::from_secs_f64(s))
        }
        Some(s) => {
            return Err(ApiError::invalid(
                format!("kvtier_retain_s must be between 0 and {MAX_RETAIN_S} seconds, got {s}"),
                Some("kvtier_retain_s"),
            ));
        }
    };
    if let Some(s) = &raw.cache_salt
        && s.len() > MAX_CACHE_SALT_BYTES
    {
        return Err(ApiError::invalid(
            format!("cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes"),
            Some("cache_salt"),
        ));
    }
    let tokens = match endpoint {
        Endpoint::Completions => {
            if raw.messages.is_some() {
                return Err(ApiError::invalid(
                    "`messages` belongs to /v1/chat/completions; use `prompt` here",
                    Some("messages"),
                ));
            }
            prompt_tokens(raw.prompt.as_ref(), lim)?
        }
        Endpoint::Chat => {
            if raw.prompt.is_some() {
                return Err(ApiError::invalid(
                    "`prompt` belongs to /v1/completions; use `messages` here",
                    Some("prompt"),
                ));
            }
            let msgs = raw
                .messages
                .ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
            let texts = chat_messages(&msgs)?;
            match lim.tokenizer.chat_template() {
                // The model's own template writes its special tokens, BOS included.
                Some(t) => {
                    let full: Vec<Value> = msgs
                        .iter()
                        .zip(&texts)
                        .map(|(m, (role, content))| {
                            let mut o = serde_json::Map::new();
                            o.insert("role".into(), json!(role));
                            o.insert("content".into(), json!(content));
                            if let Some(c) = &m.tool_calls {
                                o.insert("tool_calls".into(), c.clone());
                            }
                            if let Some(id) = &m.tool_call_id {
                                o.insert("tool_call_id".into(), json!(id));
                            }
                            if let Some(n) = &m.name {
                                o.insert("name".into(), json!(n));
                            }
                            Value::Object(o)
                        })
                        .collect();
                    let text = t
                        .render_with_tools(&full, raw.tools.as_ref())
                        .map_err(|e| {
                            ApiError::invalid(
                                format!("the model's chat template: {e}"),
                                Some("messages"),
                            )
                        })?;
                    lim.tokenizer.encode(&text, false).map_err(|e| {
                        ApiError::invalid(
                            format!("cannot tokenize the prompt: {e}"),
                            Some("messages"),
                        )
                    })?
                }
                None => encode(lim.tokenizer, &builtin_template(&texts), "messages")?,
            }
        }
    };
    let max_tokens = fit_context(
        tokens.len(),
        max_tokens,
        explicit || endpoint == Endpoint::Completions,
        lim.max_context_tokens,
    )
    .map_err(|message| {
        ApiError::invalid(
            message,
            Some(match endpoint {
                Endpoint::Completions => "prompt",
                Endpoint::Chat => "messages",
            }),
        )
        .with_code("context_length_exceeded")
    })?;
    Ok(ParsedRequest {
        endpoint,
        model: lim.model_name.to_owned(),
        tokens,
        max_tokens,
        sampling: Sampling {
            temperature: temperature as f32,
            seed: raw.seed.unwrap_or(lim.fallback_seed),
        },
        stream: raw.stream,
        include_usage: raw.stream_options.is_some_and(|o| o.include_usage),
        cache_salt: raw.cache_salt,
        user: raw.user,
        retain,
    })
}

/// The `max_tokens` a prompt of `prompt` tokens runs with in a context of `max_ctx`, or why it
/// cannot run, as vLLM decides: a `max_tokens` the client chose (and the completions
/// endpoint's default of 16, which the OpenAI API defines) must fit beside the prompt; chat's
/// default is cut to the room left, and only a prompt that fills the context is refused.
fn fit_context(
    prompt: usize,
    max_tokens: usize,
    must_fit: bool,
    max_ctx: usize,
) -> Result<usize, String> {
    let total = prompt.saturating_add(max_tokens);
    if must_fit && total > max_ctx {
        return Err(format!(
            "this model's maximum context length is {max_ctx} tokens, but {total} tokens were \
             requested ({prompt} in the prompt, {max_tokens} in the completion); shorten the \
             prompt or lower max_tokens"
        ));
    }
    if prompt >= max_ctx {
        return Err(format!(
            "this model's maximum context length is {max_ctx} tokens, but the prompt has \
             {prompt} tokens"
        ));
    }
    Ok(max_tokens.min(max_ctx - prompt))
}

fn encode(tok: &Tokenizer, text: &str, param: &'static str) -> Result<Vec<u32>, ApiError> {
    tok.encode(text, true)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some(param)))
}

fn prompt_tokens(prompt: Option<&Value>, lim: &Limits) -> Result<Vec<u32>, ApiError> {
    let vocab_size = lim.vocab_size;
    let bad = |m: String| ApiError::invalid(m, Some("prompt"));
    match prompt {
        None => Err(bad("`prompt` is required".into())),
        Some(Value::String(s)) => encode(lim.tokenizer, s, "prompt"),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(bad("`prompt` is an empty token list".into()));
            }
            items
                .iter()
                .map(|v| match v.as_u64() {
                    Some(id) if (id as usize) < vocab_size => Ok(id as u32),
                    Some(id) => Err(bad(format!(
                        "token id {id} is outside the vocabulary of {vocab_size}"
                    ))),
                    None => Err(bad(format!(
                        "`prompt` must be a string or an array of token ids; found {v} in the array (batched prompts are not supported)"
                    ))),
                })
                .collect()
        }
        Some(other) => Err(bad(format!(
            "`prompt` must be a string or an array of token ids, not {other}"
        ))),
    }
}

/// Each message's role (checked) and text content (text parts joined).
fn chat_messages(msgs: &[RawMessage]) -> Result<Vec<(String, String)>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for m in msgs {
        if !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        ) {
            return Err(ApiError::invalid(
                format!("unknown message role `{}`", m.role),
                Some("messages"),
            ));
        }
        let content = match &m.content {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            Value::Array(parts) => {
                let mut s = String::new();
                for p in parts {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                "message content parts must be {\"type\": \"text\", \"text\": ...}",
                                Some("messages"),
                            ));
                        }
                    }
                }
                s
            }
            _ => {
                return Err(ApiError::invalid(
                    "message content must be a string or an array of text parts",
                    Some("messages"),
                ));
            }
        };
        out.push((m.role.clone(), content));
    }
    Ok(out)
}

/// The worker's own template, for models without one (documented in `docs/worker.md`).
fn builtin_template(msgs: &[(String, String)]) -> String {
    let mut out = String::new();
    for (role, content) in msgs {
        out.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    out.push_str("<|assistant|>\n");
    out
}

pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eos => "stop",
        FinishReason::MaxTokens | FinishReason::ContextFull => "length",
    }
}

/// The answer's `usage`: OpenAI's fields, and `kvtier` (where the cached tokens came from and
/// the time loading them took, for a router to learn the load bandwidth per tier:
/// `docs/worker.md`).
pub fn usage_json(u: &Usage) -> Value {
    let l = &u.load;
    let by_tier = |v: [u64; 4]| json!({"hbm": v[0], "dram": v[1], "nvme": v[2], "remote": v[3]});
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "kvtier": {
            "local_tokens": l.local_tokens,
            "loaded_tokens": by_tier(l.loaded_tokens.map(|t| t as u64)),
            "loaded_bytes": by_tier(l.loaded_bytes),
            "load_s": l.load_time.as_secs_f64(),
        },
    })
}

/// The non-streaming response body.
pub fn full_response(req: &ParsedRequest, id: &str, created: u64, text: &str, u: &Usage) -> Value {
    let finish = finish_reason(u.finish);
    match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            "usage": usage_json(u),
        }),
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": finish}],
            "usage": usage_json(u),
        }),
    }
}

/// One streaming chunk: `text` (may be empty), an optional finish reason.
pub fn stream_chunk(
    req: &ParsedRequest,
    id: &str,
    created: u64,
    text: &str,
    first: bool,
    finish: Option<FinishReason>,
) -> Value {
    let finish = finish.map(finish_reason);
    let mut v = match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        }),
        Endpoint::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": req.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        }
    };
    if req.include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// The last chunk when `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk(req: &ParsedRequest, id: &str, created: u64, u: &Usage) -> Value {
    let object = match req.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({"id": id, "object": object, "created": created, "model": req.model,
           "choices": [], "usage": usage_json(u)})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim() -> Limits<'static> {
        Limits {
            model_name: "kvtier-tiny",
            max_context_tokens: 32,
            vocab_size: 258,
            tokenizer: &Tokenizer::Byte,
            fallback_seed: 7,
        }
    }

    fn check(body: &str, endpoint: Endpoint, expected: Result<(), (u16, Option<&str>, &str)>) {
        let got = parse(body.as_bytes(), endpoint, &lim());
        match (got, expected) {
            (Ok(_), Ok(())) => {}
            (Err(e), Err((status, param, needle))) => {
                assert_eq!(e.status.as_u16(), status, "{body}: {e:?}");
                assert_eq!(e.param, param, "{body}: {e:?}");
                assert!(e.message.contains(needle), "{body}: {}", e.message);
            }
            (got, want) => panic!("{body}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn requests_are_validated() {
        use Endpoint::*;
        check(r#"{"prompt":"hi"}"#, Completions, Ok(()));
        check(r#"{"prompt":[1,2,3],"max_tokens":4}"#, Completions, Ok(()));
        check(
            r#"{"messages":[{"role":"user","content":"hi"}]}"#,
            Chat,
            Ok(()),
        );
        check(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            Chat,
            Ok(()),
        );
        check(
            r#"{"prompt":"hi""#,
            Completions,
            Err((400, None, "invalid JSON")),
        );
        check(
            r#"{"prompt":"hi","max_tokens":-1}"#,
            Completions,
            Err((400, Some("max_tokens"), "at least 1")),
        );
        check(
            r#"{"prompt":"hi","max_tokens":0}"#,
            Completions,
            Err((400, Some("max_tokens"), "at least 1")),
        );
        check(
            r#"{"prompt":"hi","temperature":-0.5}"#,
            Completions,
            Err((400, Some("temperature"), "between")),
        );
        check(
            r#"{"prompt":"hi","temperature":2.5}"#,
            Completions,
            Err((400, Some("temperature"), "between")),
        );
        check(
            r#"{"prompt":"hi","model":"gpt-4"}"#,
            Completions,
            Err((404, Some("model"), "does not exist")),
        );
        check(
            r#"{"prompt":"hi","n":2}"#,
            Completions,
            Err((400, Some("n"), "n = 2")),
        );
        check(r#"{}"#, Completions, Err((400, Some("prompt"), "required")));
        check(
            r#"{"prompt":[]}"#,
            Completions,
            Err((400, Some("prompt"), "empty")),
        );
        check(
            r#"{"prompt":[999]}"#,
            Completions,
            Err((400, Some("prompt"), "vocabulary")),
        );
        check(
            r#"{"prompt":["a","b"]}"#,
            Completions,
            Err((400, Some("prompt"), "batched")),
        );
        check(
            r#"{"prompt":7}"#,
            Completions,
            Err((400, Some("prompt"), "string or an array")),
        );
        check(
            &format!(r#"{{"prompt":"{}"}}"#, "x".repeat(40)),
            Completions,
            Err((400, Some("prompt"), "maximum context length is 32")),
        );
        check(
            r#"{"messages":[]}"#,
            Chat,
            Err((400, Some("messages"), "empty")),
        );
        check(
            r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
            Chat,
            Err((400, Some("messages"), "role")),
        );
        check(
            r#"{"prompt":"x"}"#,
            Chat,
            Err((400, Some("prompt"), "belongs to")),
        );
        check(
            r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
            Chat,
            Err((400, Some("max_completion_tokens"), "at least 1")),
        );
        check(
            &format!(r#"{{"prompt":"x","cache_salt":"{}"}}"#, "s".repeat(2000)),
            Completions,
            Err((400, Some("cache_salt"), "longer")),
        );
        check(r#"{"prompt":"x","user":"session-7"}"#, Completions, Ok(()));
        check(
            r#"{"prompt":"x","kvtier_retain_s":30.5}"#,
            Completions,
            Ok(()),
        );
        for bad in ["-1", "86401", "-0.001"] {
            check(
                &format!(r#"{{"prompt":"x","kvtier_retain_s":{bad}}}"#),
                Completions,
                Err((400, Some("kvtier_retain_s"), "between 0 and 86400")),
            );
        }
        check(
            r#"{"prompt":"x","kvtier_retain_s":"soon"}"#,
            Completions,
            Err((400, None, "invalid type")),
        );
        check(
            &format!(r#"{{"prompt":"x","user":"{}"}}"#, "u".repeat(2000)),
            Completions,
            Err((400, Some("user"), "longer")),
        );
        check(
            r#"{"prompt":"x","user":7}"#,
            Completions,
            Err((400, None, "")),
        );
    }

    #[test]
    fn prompt_and_max_tokens_must_fit_the_context() {
        use Endpoint::*;
        // Context 32; "xxxx" is 5 tokens with BOS.
        check(r#"{"prompt":"xxxx","max_tokens":27}"#, Completions, Ok(()));
        check(
            r#"{"prompt":"xxxx","max_tokens":28}"#,
            Completions,
            Err((
                400,
                Some("prompt"),
                "33 tokens were requested (5 in the prompt, 28",
            )),
        );
        // The completions default (16) counts: 17 + 16 > 32.
        check(
            &format!(r#"{{"prompt":"{}"}}"#, "x".repeat(16)),
            Completions,
            Err((400, Some("prompt"), "maximum context length is 32")),
        );
        let e = parse(
            br#"{"prompt":"xxxx","max_tokens":100}"#,
            Completions,
            &lim(),
        )
        .unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        // Chat: an explicit limit must fit, the default is cut to the room left.
        let msg = |n: usize| format!(r#"[{{"role":"user","content":"{}"}}]"#, "x".repeat(n));
        // The built-in template adds 24 bytes + BOS around the content: 25 + n tokens.
        check(
            &format!(r#"{{"messages":{},"max_tokens":6}}"#, msg(1)),
            Chat,
            Ok(()),
        );
        check(
            &format!(r#"{{"messages":{},"max_completion_tokens":7}}"#, msg(1)),
            Chat,
            Err((
                400,
                Some("messages"),
                "(26 in the prompt, 7 in the completion)",
            )),
        );
        let r = parse(
            format!(r#"{{"messages":{}}}"#, msg(1)).as_bytes(),
            Chat,
            &lim(),
        )
        .unwrap();
        assert_eq!((r.tokens.len(), r.max_tokens), (26, 6));
        check(
            &format!(r#"{{"messages":{}}}"#, msg(7)),
            Chat,
            Err((400, Some("messages"), "the prompt has 32 tokens")),
        );
    }

    #[test]
    fn chat_template_is_as_documented() {
        let r = parse(
            br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0}"#,
            Endpoint::Chat,
            &Limits { max_context_tokens: 100, ..lim() },
        )
        .unwrap();
        let text = ByteTokenizer.decode(&r.tokens).unwrap();
        assert_eq!(text, "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
        assert_eq!(r.tokens[0], ByteTokenizer::BOS);
        assert_eq!(
            r.sampling,
            Sampling {
                temperature: 0.0,
                seed: 7
            }
        );
        assert_eq!(r.max_tokens, DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn utf8_stream_holds_back_partial_characters() {
        let mut s = Utf8Stream::default();
        let bytes = "aé🦀".as_bytes();
        let out: Vec<String> = bytes.iter().map(|&b| s.push(b as u32)).collect();
        assert_eq!(out.concat(), "aé🦀");
        assert_eq!(out[0], "a");
        assert_eq!(out[1], "", "first byte of é is held");
        assert_eq!(s.push(0xff), "\u{FFFD}");
        assert_eq!(s.push(0xC3), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn usage_tells_where_the_cached_tokens_came_from() {
        let u = Usage {
            finish: FinishReason::MaxTokens,
            prompt_tokens: 700,
            completion_tokens: 4,
            cached_tokens: 688,
            load: crate::scheduler::LoadReport {
                local_tokens: 160,
                loaded_tokens: [0, 400, 128, 64],
                loaded_bytes: [0, 25 << 15, 8 << 15, 4 << 15],
                load_time: std::time::Duration::from_micros(1500),
            },
        };
        let v = usage_json(&u);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 688);
        assert_eq!(
            v["kvtier"],
            json!({
                "local_tokens": 160,
                "loaded_tokens": {"hbm": 0, "dram": 400, "nvme": 128, "remote": 64},
                "loaded_bytes": {"hbm": 0, "dram": 819200, "nvme": 262144, "remote": 131072},
                "load_s": 0.0015,
            })
        );
    }
}
