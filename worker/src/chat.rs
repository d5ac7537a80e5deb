//! A model's own chat template: `chat_template.jinja` in the model directory, else
//! `chat_template` in its `tokenizer_config.json` (a string, or a list of named templates of
//! which `default` is used), rendered with minijinja the way Hugging Face's `transformers`
//! renders it: `messages` (each `role` and text `content`), `add_generation_prompt = true`,
//! `bos_token` and `eos_token` from `tokenizer_config.json`, the `raise_exception(msg)` and
//! `strftime_now(format)` functions, and Python's string methods (`.strip()`, `.split()`, ...).
//! The rendered text already holds the model's special tokens (BOS included), so it is
//! encoded without adding a BOS. Without a template the worker uses its own documented one
//! (`api.rs`).

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value as JValue, context};
use serde_json::Value;

use crate::error::{Result, WorkerError};

/// Largest template accepted (real ones are a few KiB).
const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// A loaded chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from (for errors and logs).
    source: PathBuf,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

fn err(path: &Path, reason: impl Into<String>) -> WorkerError {
    WorkerError::Tokenizer {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// A special token in `tokenizer_config.json`: a string, `{"content": ...}`, or absent/null.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of model directory `dir`, or `None` when it has none. A template that is
    /// unreadable, malformed or does not compile is an error naming its file.
    pub fn for_model_dir(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read(&cfg_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| err(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => return Err(err(&cfg_path, format!("cannot read: {e}"))),
        };
        let bos = token_text(config.get("bos_token"));
        let eos = token_text(config.get("eos_token"));
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let text = std::fs::read_to_string(&jinja)
                .map_err(|e| err(&jinja, format!("cannot read: {e}")))?;
            return Self::new(text, jinja, bos, eos).map(Some);
        }
        let template = match config.get("chat_template") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    err(
                        &cfg_path,
                        "chat_template is a list without a template named \"default\"",
                    )
                })?
                .to_owned(),
            Some(_) => {
                return Err(err(
                    &cfg_path,
                    "chat_template must be a string or a list of {name, template}",
                ));
            }
        };
        Self::new(template, cfg_path, bos, eos).map(Some)
    }

    /// Compiles `template` (from `source`, named in errors).
    pub fn new(
        template: String,
        source: PathBuf,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self> {
        if template.len() > MAX_TEMPLATE_BYTES {
            return Err(err(
                &source,
                format!("the chat template is over {MAX_TEMPLATE_BYTES} bytes"),
            ));
        }
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<JValue, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned("chat", template)
            .map_err(|e| err(&source, format!("the chat template does not compile: {e}")))?;
        Ok(Self {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The prompt text for `messages` (role, text content), ending with the generation prompt.
    /// A template error (including its own `raise_exception`) is returned as text, for a 400.
    pub fn render(&self, messages: &[(String, String)]) -> std::result::Result<String, String> {
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        self.render_with_tools(&msgs, None)
    }

    /// [`render`](Self::render) for messages as the OpenAI API sends them (JSON objects: `role`,
    /// `content`, and an assistant's `tool_calls`, a tool result's `tool_call_id` / `name`,
    /// passed to the template as they are, as `transformers` does) and the request's `tools`
    /// (the template's `tools` variable; none when absent).
    pub fn render_with_tools(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
    ) -> std::result::Result<String, String> {
        let msgs: Vec<JValue> = messages.iter().map(to_jinja).collect();
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        tmpl.render(context! {
            messages => msgs,
            tools => tools.map(to_jinja),
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| match e.kind() {
            // The template's own message, without minijinja's location noise.
            ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_owned(),
            _ => e.to_string(),
        })
    }
}

/// A JSON value as a template value (minijinja is built without its serde feature).
fn to_jinja(v: &Value) -> JValue {
    match v {
        Value::Null => JValue::from(()),
        Value::Bool(b) => JValue::from(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => JValue::from(i),
            None => JValue::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => JValue::from(s.as_str()),
        Value::Array(a) => JValue::from(a.iter().map(to_jinja).collect::<Vec<_>>()),
        Value::Object(o) => JValue::from(
            o.iter()
                .map(|(k, v)| (k.clone(), to_jinja(v)))
                .collect::<std::collections::BTreeMap<String, JValue>>(),
        ),
    }
}

/// `strftime` of the current UTC time for the directives chat templates use (`%d %b %Y`,
/// `%B`, `%m`, `%y`, `%H:%M:%S`, `%%`); others are an error.
fn strftime_now(format: &str) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(format, secs).map_err(|d| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported directive %{d}"),
        )
    })
}

/// `strftime` of `secs` since the Unix epoch (UTC); `Err(directive)` for one not supported.
fn strftime(format: &str, secs: u64) -> std::result::Result<String, char> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => return Err(other),
            None => out.push('%'),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_of_known_instants() {
        // 2024-07-23 00:00:00 UTC and 2000-02-29 13:05:09 UTC.
        assert_eq!(strftime("%d %b %Y", 1_721_692_800).unwrap(), "23 Jul 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S (%B, %y) %%", 951_829_509).unwrap(),
            "2000-02-29 13:05:09 (February, 00) %"
        );
        assert_eq!(strftime("%j", 0), Err('j'));
    }

    fn template(t: &str) -> ChatTemplate {
        ChatTemplate::new(t.to_owned(), "test".into(), "<s>".into(), "</s>".into()).unwrap()
    }

    #[test]
    fn renders_messages_tokens_python_methods_and_the_generation_prompt() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}[{{ m.role.upper() }}] {{ m.content.strip() }}\
             {% if not loop.last %}{{ eos_token }}{% endif %}{% endfor %}\
             {% if add_generation_prompt %}[ASSISTANT]{% endif %}",
        );
        let msgs = [
            ("system".to_owned(), " be brief ".to_owned()),
            ("user".to_owned(), "hi".to_owned()),
        ];
        assert_eq!(
            t.render(&msgs).unwrap(),
            "<s>[SYSTEM] be brief</s>[USER] hi[ASSISTANT]"
        );
    }

    #[test]
    fn raise_exception_is_an_error_with_the_templates_message() {
        let t = template(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}{% endif %}ok",
        );
        let e = t
            .render(&[("assistant".to_owned(), "x".to_owned())])
            .unwrap_err();
        assert_eq!(e, "Conversations must start with a user turn");
        assert_eq!(t.render(&[("user".into(), "x".into())]).unwrap(), "ok");
    }

    #[test]
    fn model_directory_templates_and_their_errors() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::for_model_dir(dir.path()).unwrap().is_none());
        let cfg = dir.path().join("tokenizer_config.json");
        std::fs::write(&cfg, r#"{"bos_token": {"content": "<B>"}, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}"#).unwrap();
        let t = ChatTemplate::for_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[("user".into(), "x".into())]).unwrap(), "<B>D");
        // chat_template.jinja wins over tokenizer_config.json.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ messages | length }}",
        )
        .unwrap();
        let t = ChatTemplate::for_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[("user".into(), "x".into())]).unwrap(), "J1");
        assert!(t.source().ends_with("chat_template.jinja"));
        // Errors name the file.
        std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").unwrap();
        let e = ChatTemplate::for_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("chat_template.jinja") && e.contains("does not compile"),
            "{e}"
        );
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        std::fs::write(&cfg, "{not json").unwrap();
        let e = ChatTemplate::for_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("not valid JSON"),
            "{e}"
        );
        std::fs::write(&cfg, r#"{"chat_template": 7}"#).unwrap();
        assert!(ChatTemplate::for_model_dir(dir.path()).is_err());
        std::fs::write(
            &cfg,
            r#"{"chat_template": [{"name": "x", "template": "y"}]}"#,
        )
        .unwrap();
        let e = ChatTemplate::for_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("default"), "{e}");
    }

    /// Tools and tool-call messages reach the template as the API sent them (as
    /// `transformers` passes them): the tools' list, an assistant's `tool_calls` with their
    /// arguments, and a tool result's `tool_call_id`.
    #[test]
    fn tools_and_tool_calls_are_rendered() {
        let template = "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}\
            {% for m in messages %}<{{ m.role }}>\
            {% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}\
            ({{ c.function.arguments.city }}){% endfor %}\
            {% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}\
            {% else %}{{ m.content }}{% endif %}\n{% endfor %}<assistant>";
        let t =
            ChatTemplate::new(template.into(), "t".into(), "<s>".into(), "</s>".into()).unwrap();
        let tools = serde_json::json!([{"type": "function", "function": {"name": "weather"}}]);
        let msgs = [
            serde_json::json!({"role": "user", "content": "Paris?"}),
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}),
            serde_json::json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
        ];
        let out = t.render_with_tools(&msgs, Some(&tools)).unwrap();
        assert_eq!(
            out,
            "TOOLS [{\"function\": {\"name\": \"weather\"}, \"type\": \"function\"}]\n\
             <user>Paris?\n<assistant>CALL weather(Paris)\n<tool>[c1] sunny\n<assistant>"
        );
        // Without tools the template sees none.
        let out = t.render_with_tools(&msgs[..1], None).unwrap();
        assert_eq!(out, "<user>Paris?\n<assistant>");
    }
}
