//! A Hugging Face tokenizer directory, as a vLLM pod loads its model's: `tokenizer.json` (the
//! `tokenizers` crate) and the chat template (`chat_template` of `tokenizer_config.json`, or
//! `chat_template.jinja`), rendered with `messages` and `add_generation_prompt` as vLLM does.
//! Chat prompts are encoded without the post-processor's special tokens (the template writes
//! them), completions prompts with them (vLLM's `add_special_tokens` defaults).
//!
//! [`export`] writes a directory of this shape for the simulator's own vocabulary, so tests can run
//! the pods and the EPP's `local` token producer on one tokenizer without a model hub.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};

use crate::tokenizer::{ChatMessage, Content};

/// A loaded tokenizer directory.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer").finish_non_exhaustive()
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
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

impl HfTokenizer {
    /// Loads `dir` (or the directory of a `tokenizer.json` path).
    pub fn load(path: &Path) -> Result<Self, String> {
        let dir = if path.is_dir() {
            path
        } else {
            path.parent().unwrap_or(Path::new("."))
        };
        let file = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        let config: Value = match std::fs::read(dir.join("tokenizer_config.json")) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| format!("{}: {e}", dir.join("tokenizer_config.json").display()))?,
            Err(_) => Value::Null,
        };
        let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => t,
            Err(_) => config["chat_template"]
                .as_str()
                .ok_or_else(|| format!("{}: no chat template", dir.display()))?
                .to_owned(),
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
        Ok(HfTokenizer {
            tokenizer,
            env,
            bos: special(&config, "bos_token"),
            eos: special(&config, "eos_token"),
        })
    }

    /// The rendered chat prompt (vLLM's string content format: text parts joined by newlines).
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    Some(Content::Text(t)) => Value::from(t.as_str()),
                    Some(Content::Parts(parts)) => Value::from(
                        parts
                            .iter()
                            .filter_map(|p| p.text.as_deref())
                            .collect::<Vec<_>>()
                            .join("\n"),
                    ),
                    None => Value::Null,
                };
                json!({"role": m.role, "content": content})
            })
            .collect();
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| format!("chat template: {e}"))
    }

    /// The ids and token texts of `text`.
    pub fn encode(&self, text: &str, special_tokens: bool) -> (Vec<u32>, Vec<String>) {
        match self.tokenizer.encode(text, special_tokens) {
            Ok(e) => (e.get_ids().to_vec(), e.get_tokens().to_vec()),
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer failed: the prompt counts as empty");
                (Vec::new(), Vec::new())
            }
        }
    }

    /// The text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }
}

/// Special tokens of the exported tokenizer, with their ids.
const SPECIAL: [&str; 5] = [
    "[UNK]",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
];
const EOT: &str = "<|eot_id|>";

/// The exported chat template (Llama 3's shape).
pub const CHAT_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}\
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] or '') | trim + '<|eot_id|>' }}\
{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

/// Writes `tokenizer.json` and `tokenizer_config.json` to `dir`: a WordPiece tokenizer over
/// whitespace-split words whose vocabulary holds every printable ASCII character and every one-
/// to three-letter lowercase piece, at a word's start and as a continuation (`##`), so any ASCII
/// word tokenizes (the load generator's words into pieces of up to three letters); Llama 3's
/// special tokens and chat template; BOS added to completions prompts.
pub fn export(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut vocab = serde_json::Map::new();
    let mut add = |piece: String| {
        let id = vocab.len();
        vocab.entry(piece).or_insert(Value::from(id));
    };
    for s in SPECIAL.iter().chain([&EOT]) {
        add((*s).to_owned());
    }
    let letters = b'a'..=b'z';
    let mut pieces: Vec<String> = (0x21u8..0x7f).map(|c| char::from(c).to_string()).collect();
    for a in letters.clone() {
        for b in letters.clone() {
            pieces.push([a, b].iter().map(|&c| char::from(c)).collect());
            for c in letters.clone() {
                pieces.push([a, b, c].iter().map(|&c| char::from(c)).collect());
            }
        }
    }
    for p in &pieces {
        add(p.clone());
        let mut cont = String::with_capacity(p.len() + 2);
        let _ = write!(cont, "##{p}");
        add(cont);
    }
    let added: Vec<Value> = SPECIAL
        .iter()
        .chain([&EOT])
        .enumerate()
        .map(|(id, s)| {
            json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bos = SPECIAL[1];
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {
            "type": "WordPiece",
            "unk_token": "[UNK]",
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": vocab,
        },
    });
    let config = json!({
        "bos_token": bos,
        "eos_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let write = |name: &str, v: &Value| -> std::io::Result<()> {
        let bytes = serde_json::to_vec(v).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(name), bytes)
    };
    write("tokenizer.json", &tokenizer)?;
    write("tokenizer_config.json", &config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(Content::Text(text.into())),
        }
    }

    #[test]
    fn the_exported_tokenizer_loads_and_renders_llama_3s_shape() {
        let dir = tempfile::tempdir().unwrap();
        export(dir.path()).unwrap();
        let t = HfTokenizer::load(dir.path()).unwrap();
        let text = t
            .render(&[msg("system", " be brief "), msg("user", "hello world")])
            .unwrap();
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nhello world<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let (ids, strs) = t.encode(&text, false);
        assert_eq!(ids.len(), strs.len());
        // BOS, header, "sys" "##tem", header end, "be", "bri" "##ef", eot, ...
        assert_eq!(
            &strs[..8],
            &[
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "sys",
                "##tem",
                "<|end_header_id|>",
                "be",
                "bri",
                "##ef"
            ]
        );
        assert_eq!(ids[0], 1);
        // Completions get BOS from the post-processor; chat does not get a second one.
        let (ids, strs) = t.encode("abcdefg xy!", true);
        assert_eq!(
            strs,
            ["<|begin_of_text|>", "abc", "##def", "##g", "xy", "##!"]
        );
        assert_eq!(t.decode(&ids), "abcdefg xy!");
        // A non-ASCII word is one unknown token.
        assert_eq!(t.encode("héllo", false).1, ["[UNK]"]);
    }
}
