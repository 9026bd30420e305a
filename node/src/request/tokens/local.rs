//! The `local` token backend: the model's Hugging Face tokenizer and chat template run in-process,
//! as the engine runs them, so the precise producer gets the engine's token ids without a network
//! call per request.
//!
//! A model's tokenizer is a directory holding `tokenizer.json` and the chat template
//! (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json` — a string, or a list of
//! named templates of which `default` is used), found through `modelTokenizerMap` (model → directory
//! or `tokenizer.json` path, loaded at start: a broken entry is a configuration error) or under
//! `tokenizersDir/<model>` (loaded once, by the model's first request, off the runtime's threads;
//! one that does not load stays missing until a restart). Chat
//! requests are rendered with vLLM's variables (`messages` with text parts joined by newlines,
//! `tools`, `add_generation_prompt` (true), `continue_final_message`, `documents`,
//! `chat_template_kwargs`, `bos_token`, `eos_token`) and encoded without the post-processor's
//! special tokens unless `add_special_tokens` says so; completions prompts with them. Token ids
//! in the request are used as they are.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

use crate::request::parse::ApiKind;

/// Largest `tokenizer.json` or `tokenizer_config.json` read (real ones are 2–20 MB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// One model's tokenizer and chat template.
pub struct LocalTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer").finish_non_exhaustive()
    }
}

/// Why a request got no tokens (the metric's outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// No tokenizer for the model.
    NoTokenizer,
    /// The chat template refused the request, or the tokenizer failed.
    Template,
    /// Not one prompt (several completions prompts, another API, a malformed body).
    Unsupported,
}

impl Miss {
    pub fn outcome(self) -> &'static str {
        match self {
            Miss::NoTokenizer => "no-tokenizer",
            Miss::Template => "template-error",
            Miss::Unsupported => "unsupported",
        }
    }
}

fn read_limited(path: &Path) -> Result<Vec<u8>, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than {MAX_FILE_BYTES}",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special(config: &Value, key: &str) -> String {
    match &config[key] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// The chat template of `tokenizer_config.json`: a string, or named templates (`default`).
fn config_template(config: &Value) -> Option<String> {
    match &config["chat_template"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    }
}

impl LocalTokenizer {
    /// Loads a tokenizer directory (or the directory of a `tokenizer.json` path).
    pub fn load(path: &Path) -> Result<Self, String> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (dir, path.to_path_buf())
        };
        let tokenizer = tokenizers::Tokenizer::from_bytes(read_limited(&file)?)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        let config_file = dir.join("tokenizer_config.json");
        let config: Value = if config_file.exists() {
            serde_json::from_slice(&read_limited(&config_file)?)
                .map_err(|e| format!("{}: {e}", config_file.display()))?
        } else {
            Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let template = if jinja.exists() {
            String::from_utf8(read_limited(&jinja)?)
                .map_err(|e| format!("{}: {e}", jinja.display()))?
        } else {
            config_template(&config).ok_or_else(|| {
                format!(
                    "{}: no chat template (chat_template.jinja or chat_template in \
                     tokenizer_config.json)",
                    dir.display()
                )
            })?
        };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", template)
            .map_err(|e| format!("{}: chat template: {e}", dir.display()))?;
        Ok(LocalTokenizer {
            tokenizer,
            env,
            bos: special(&config, "bos_token"),
            eos: special(&config, "eos_token"),
        })
    }

    /// The rendered chat prompt of a chat completions body.
    pub fn render_chat(&self, body: &Value) -> Result<String, Miss> {
        let messages = body["messages"].as_array().ok_or(Miss::Unsupported)?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some(parts) = m["content"].as_array() {
                    // vLLM's "string" content format: the text parts, one per line.
                    let text: Vec<&str> = parts
                        .iter()
                        .filter(|p| p["type"] == "text")
                        .filter_map(|p| p["text"].as_str())
                        .collect();
                    m["content"] = Value::from(text.join("\n"));
                }
                m
            })
            .collect();
        let kwargs = match &body["chat_template_kwargs"] {
            Value::Object(o) => Value::Object(o.clone()),
            _ => Value::Object(serde_json::Map::new()),
        };
        let ctx = minijinja::context! {
            messages => messages,
            tools => body.get("tools"),
            documents => body.get("documents"),
            add_generation_prompt => body["add_generation_prompt"].as_bool().unwrap_or(true),
            continue_final_message => body["continue_final_message"].as_bool().unwrap_or(false),
            bos_token => self.bos,
            eos_token => self.eos,
            ..minijinja::Value::from_serialize(&kwargs)
        };
        let t = self.env.get_template("chat").map_err(|_| Miss::Template)?;
        t.render(ctx).map_err(|e| {
            tracing::debug!(error = %e, "chat template refused a request");
            Miss::Template
        })
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<u32>, Miss> {
        self.tokenizer
            .encode_fast(text, special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|_| Miss::Template)
    }

    /// The engine's prompt ids of a chat or completions body.
    pub fn tokens(&self, kind: ApiKind, body: &Value) -> Result<Vec<u32>, Miss> {
        let special = body["add_special_tokens"].as_bool();
        match kind {
            ApiKind::ChatCompletions => {
                let text = self.render_chat(body)?;
                self.encode(&text, special.unwrap_or(false))
            }
            ApiKind::Completions => {
                let special = special.unwrap_or(true);
                match &body["prompt"] {
                    Value::String(s) => self.encode(s, special),
                    Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                        self.encode(a[0].as_str().unwrap_or_default(), special)
                    }
                    Value::Array(a) if a.len() == 1 && a[0].is_array() => ids(&a[0]),
                    v @ Value::Array(a) if a.first().is_some_and(Value::is_number) => ids(v),
                    _ => Err(Miss::Unsupported),
                }
            }
            _ => Err(Miss::Unsupported),
        }
    }
}

/// A pre-tokenized prompt.
fn ids(v: &Value) -> Result<Vec<u32>, Miss> {
    v.as_array()
        .ok_or(Miss::Unsupported)?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(Miss::Unsupported)
        })
        .collect()
}

/// A tokenizer found under the discovery directory: loaded once, by the first request that needs
/// it (the others wait for that load), `None` when it does not load.
type Discovered = Arc<OnceLock<Option<Arc<LocalTokenizer>>>>;

/// Every model's tokenizer: the configured ones, and those found under the discovery directory.
#[derive(Debug)]
pub struct LocalTokenizers {
    by_model: HashMap<String, Arc<LocalTokenizer>>,
    dir: Option<PathBuf>,
    /// Models whose directory exists under `dir` (so the map is bounded by the filesystem, not by
    /// the model names clients send).
    discovered: Mutex<HashMap<String, Discovered>>,
    /// Tokenizations running at once, at most one per core: a burst of long prompts waits here
    /// instead of filling the blocking pool with CPU-bound threads.
    pub slots: tokio::sync::Semaphore,
}

impl LocalTokenizers {
    /// Loads every mapped tokenizer now (an error names the model and the file).
    pub fn load(map: &HashMap<String, String>, dir: Option<PathBuf>) -> Result<Self, String> {
        let mut by_model = HashMap::new();
        for (model, path) in map {
            let t = LocalTokenizer::load(Path::new(path)).map_err(|e| format!("{model}: {e}"))?;
            by_model.insert(model.clone(), Arc::new(t));
        }
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(LocalTokenizers {
            by_model,
            dir,
            discovered: Mutex::default(),
            slots: tokio::sync::Semaphore::new(cores),
        })
    }

    /// The tokenizer of `model`; a model first seen is looked for under the discovery directory
    /// (blocking: call off the runtime's threads).
    pub fn get(&self, model: &str) -> Option<Arc<LocalTokenizer>> {
        if let Some(t) = self.by_model.get(model) {
            return Some(t.clone());
        }
        let dir = self.dir.as_ref()?;
        let cell = {
            let mut d = self.discovered.lock().unwrap_or_else(|e| e.into_inner());
            match d.get(model) {
                Some(cell) => cell.clone(),
                None => {
                    // A model name is a relative path under the directory, never `..` or
                    // absolute; a model without a tokenizer file there is not remembered (it may
                    // be copied in later).
                    let safe = !model.is_empty()
                        && Path::new(model)
                            .components()
                            .all(|c| matches!(c, std::path::Component::Normal(_)));
                    if !safe || !dir.join(model).join("tokenizer.json").is_file() {
                        return None;
                    }
                    d.entry(model.to_owned()).or_default().clone()
                }
            }
        };
        cell.get_or_init(|| match LocalTokenizer::load(&dir.join(model)) {
            Ok(t) => Some(Arc::new(t)),
            Err(e) => {
                tracing::warn!(model, error = %e, "the model's local tokenizer does not load");
                None
            }
        })
        .clone()
    }

    /// The engine's prompt ids of a request for `model` (blocking: tokenizing a long prompt takes
    /// milliseconds).
    pub fn tokens(&self, model: &str, kind: ApiKind, body: &[u8]) -> Result<Vec<u32>, Miss> {
        let tok = self.get(model).ok_or(Miss::NoTokenizer)?;
        let body: Value = serde_json::from_slice(body).map_err(|_| Miss::Unsupported)?;
        tok.tokens(kind, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A word-level tokenizer: `<s>` (1) added to single sequences, `<|user|>` (2) and
    /// `<|assistant|>` (3) as special tokens, words 4.. , unknown words 0.
    fn write_tokenizer(dir: &Path, template: &str) {
        let special = |id: u32, s: &str| {
            json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(1, "<s>"), special(2, "<|user|>"), special(3, "<|assistant|>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
            },
            "decoder": null,
            "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": {
                "[UNK]": 0, "<s>": 1, "<|user|>": 2, "<|assistant|>": 3,
                "hello": 4, "world": 5, "again": 6, "hi": 7}},
        });
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let config = json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                            "chat_template": template});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    }

    const TEMPLATE: &str = "{{ bos_token }}{% if greeting is defined %}{{ greeting }} {% endif %}\
        {% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\
        <|{{ m.role }}|> {{ m.content | trim }} {% endfor %}\
        {% if add_generation_prompt %}<|assistant|>{% endif %}";

    fn tokens(t: &LocalTokenizer, kind: ApiKind, body: Value) -> Result<Vec<u32>, Miss> {
        t.tokens(kind, &body)
    }

    #[test]
    fn chat_is_rendered_then_encoded_as_vllm_does() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), TEMPLATE);
        let t = LocalTokenizer::load(dir.path()).unwrap();
        let chat = ApiKind::ChatCompletions;
        let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
        // "<s><|user|> hello world <|assistant|>": the template's BOS, no second one.
        assert_eq!(
            tokens(&t, chat, user(json!(" hello world"))),
            Ok(vec![1, 2, 4, 5, 3])
        );
        let mut b = user(json!("hello"));
        b["add_generation_prompt"] = json!(false);
        assert_eq!(tokens(&t, chat, b.clone()), Ok(vec![1, 2, 4]));
        b["add_special_tokens"] = json!(true);
        assert_eq!(
            tokens(&t, chat, b),
            Ok(vec![1, 1, 2, 4]),
            "the request asked for them"
        );
        // Text parts one per line, other parts left out; unknown words are the unknown token.
        let parts = json!([{"type": "text", "text": "hello"},
                           {"type": "image_url", "image_url": {"url": "x"}},
                           {"type": "text", "text": "again zebra"}]);
        assert_eq!(tokens(&t, chat, user(parts)), Ok(vec![1, 2, 4, 6, 0, 3]));
        // chat_template_kwargs reach the template.
        let mut b = user(json!("world"));
        b["chat_template_kwargs"] = json!({"greeting": "hi"});
        assert_eq!(tokens(&t, chat, b), Ok(vec![1, 7, 2, 5, 3]));
        // A template's raise_exception, a body without messages.
        let tool = json!({"messages": [{"role": "tool", "content": "x"}]});
        assert_eq!(tokens(&t, chat, tool), Err(Miss::Template));
        assert_eq!(
            tokens(&t, chat, json!({"prompt": "x"})),
            Err(Miss::Unsupported)
        );
    }

    #[test]
    fn completions_get_the_tokenizers_special_tokens_and_ids_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(&dir.path().join("m"), TEMPLATE);
        let t = LocalTokenizer::load(&dir.path().join("m/tokenizer.json")).unwrap();
        let c = ApiKind::Completions;
        assert_eq!(
            tokens(&t, c, json!({"prompt": "hello world"})),
            Ok(vec![1, 4, 5])
        );
        assert_eq!(tokens(&t, c, json!({"prompt": ["hello"]})), Ok(vec![1, 4]));
        let no_bos = json!({"prompt": "hello", "add_special_tokens": false});
        assert_eq!(tokens(&t, c, no_bos), Ok(vec![4]));
        assert_eq!(tokens(&t, c, json!({"prompt": [9, 8]})), Ok(vec![9, 8]));
        assert_eq!(tokens(&t, c, json!({"prompt": [[9, 8]]})), Ok(vec![9, 8]));
        for several in [
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([-1]),
            json!(null),
        ] {
            let body = json!({ "prompt": several });
            assert_eq!(
                tokens(&t, c, body.clone()),
                Err(Miss::Unsupported),
                "{body}"
            );
        }
        let embeddings = tokens(&t, ApiKind::Embeddings, json!({"input": "hello"}));
        assert_eq!(embeddings, Err(Miss::Unsupported));
    }

    #[test]
    fn tokenizers_are_mapped_or_discovered_once_under_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(&dir.path().join("org/model-a"), TEMPLATE);
        write_tokenizer(&dir.path().join("mapped"), TEMPLATE);
        let map = HashMap::from([(
            "alias".to_owned(),
            dir.path().join("mapped").display().to_string(),
        )]);
        let all = LocalTokenizers::load(&map, Some(dir.path().to_path_buf())).unwrap();
        let body = br#"{"prompt": "hello"}"#;
        assert_eq!(
            all.tokens("alias", ApiKind::Completions, body),
            Ok(vec![1, 4])
        );
        assert_eq!(
            all.tokens("org/model-a", ApiKind::Completions, body),
            Ok(vec![1, 4])
        );
        for model in ["org/missing", "../mapped", "/etc", ""] {
            assert_eq!(
                all.tokens(model, ApiKind::Completions, body),
                Err(Miss::NoTokenizer),
                "{model}"
            );
        }
        // A tokenizer copied in later is found; one that does not load is tried once.
        write_tokenizer(&dir.path().join("org/missing"), TEMPLATE);
        assert!(all.get("org/missing").is_some());
        std::fs::create_dir_all(dir.path().join("bad")).unwrap();
        std::fs::write(dir.path().join("bad/tokenizer.json"), "{").unwrap();
        assert!(all.get("bad").is_none());
        write_tokenizer(&dir.path().join("bad"), TEMPLATE);
        assert!(all.get("bad").is_none(), "not reloaded per request");
        assert_eq!(
            all.tokens("alias", ApiKind::Completions, b"not json"),
            Err(Miss::Unsupported)
        );
        // A broken mapped tokenizer is a configuration error naming the model.
        let broken = HashMap::from([("m".to_owned(), "/no/such/dir".to_owned())]);
        let e = LocalTokenizers::load(&broken, None).unwrap_err();
        assert!(e.starts_with("m: "), "{e}");
        std::fs::write(dir.path().join("mapped/tokenizer.json"), "{").unwrap();
        let map = HashMap::from([(
            "m".to_owned(),
            dir.path().join("mapped").display().to_string(),
        )]);
        assert!(LocalTokenizers::load(&map, None).is_err());
    }
}
