//! Deterministic stand-in tokenizer.
//!
//! Real tokenizers are large and model-specific; routing only needs a function that maps equal text to
//! equal token sequences and longer text to more tokens. Text is split on whitespace and every word
//! becomes `ceil(len / 4)` tokens, one per 4-byte piece, whose id is the xxh3 hash of the piece
//! truncated to `u32`.

use std::collections::HashMap;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per token piece.
pub const PIECE_BYTES: usize = 4;

/// Token id of one piece of text.
pub fn piece_token(piece: &[u8]) -> u32 {
    // Truncation is the documented id scheme.
    xxh3_64(piece) as u32
}

/// Appends the tokens of `text` to `out`.
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    for word in text.split_whitespace() {
        for piece in word.as_bytes().chunks(PIECE_BYTES) {
            out.push(piece_token(piece));
        }
    }
}

/// Tokens of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / PIECE_BYTES + 1);
    tokenize_into(text, &mut out);
    out
}

/// The single token that introduces a chat message of `role`.
pub fn role_token(role: &str) -> u32 {
    let marker = format!("<|{role}|>");
    piece_token(marker.as_bytes())
}

/// Chat message content: a plain string or a list of typed parts (only `text` parts carry tokens).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of an array-form chat content.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// A chat message as far as the tokenizer cares.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// Prompt tokens of a chat conversation: per message, a role token then the content tokens.
pub fn chat_tokens(messages: &[ChatMessage]) -> Vec<u32> {
    let mut out = Vec::new();
    for m in messages {
        out.push(role_token(&m.role));
        match &m.content {
            Some(Content::Text(t)) => tokenize_into(t, &mut out),
            Some(Content::Parts(parts)) => {
                for p in parts {
                    if let Some(t) = &p.text {
                        tokenize_into(t, &mut out);
                    }
                }
            }
            None => {}
        }
    }
    out
}

/// The pods' tokenizer: the built-in hashing one, or a Hugging Face tokenizer directory
/// (`--tokenizer`, see [`crate::hftok`]).
#[derive(Clone, Debug, Default)]
pub enum Tokenizer {
    #[default]
    Builtin,
    Hf(std::sync::Arc<crate::hftok::HfTokenizer>),
}

impl Tokenizer {
    /// Prompt ids of a chat conversation (an error when the chat template refuses it).
    pub fn chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Builtin => Ok(chat_tokens(messages)),
            Tokenizer::Hf(t) => Ok(t.encode(&t.render(messages)?, false).0),
        }
    }

    /// Prompt ids and token texts of a chat conversation.
    pub fn chat_strs(&self, messages: &[ChatMessage]) -> Result<(Vec<u32>, Vec<String>), String> {
        match self {
            Tokenizer::Builtin => Ok((chat_tokens(messages), chat_token_strs(messages))),
            Tokenizer::Hf(t) => Ok(t.encode(&t.render(messages)?, false)),
        }
    }

    /// Ids and token texts of a completions prompt (with the tokenizer's special tokens).
    pub fn text_strs(&self, text: &str) -> (Vec<u32>, Vec<String>) {
        match self {
            Tokenizer::Builtin => {
                let mut strs = Vec::new();
                token_strs_into(text, &mut strs);
                (tokenize(text), strs)
            }
            Tokenizer::Hf(t) => t.encode(text, true),
        }
    }

    fn text(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Builtin => tokenize(text),
            Tokenizer::Hf(t) => t.encode(text, true).0,
        }
    }

    /// Every prompt of a completions request (a batch of strings or of token-id lists is several).
    pub fn prompt_list(&self, prompt: &Prompt) -> Vec<Vec<u32>> {
        match prompt {
            Prompt::Text(t) => vec![self.text(t)],
            Prompt::Texts(ts) => ts.iter().map(|t| self.text(t)).collect(),
            Prompt::Ids(ids) => vec![ids.clone()],
            Prompt::IdLists(lists) => lists.clone(),
        }
    }

    /// The text of `ids` for `/detokenize`; the built-in tokenizer asks `vocab` (what it learned).
    pub fn detokenize(&self, ids: &[u32], vocab: &std::sync::Mutex<Vocab>) -> String {
        match self {
            Tokenizer::Builtin => vocab
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .detokenize(ids),
            Tokenizer::Hf(t) => t.decode(ids),
        }
    }
}

/// The `prompt` of a completions request in any of its accepted shapes.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// The text of each token of `text` (`return_token_strs` of `/tokenize`).
pub fn token_strs_into(text: &str, out: &mut Vec<String>) {
    for word in text.split_whitespace() {
        for piece in word.as_bytes().chunks(PIECE_BYTES) {
            out.push(String::from_utf8_lossy(piece).into_owned());
        }
    }
}

/// Token texts of a chat conversation, aligned with [`chat_tokens`].
pub fn chat_token_strs(messages: &[ChatMessage]) -> Vec<String> {
    let mut out = Vec::new();
    for m in messages {
        out.push(format!("<|{}|>", m.role));
        match &m.content {
            Some(Content::Text(t)) => token_strs_into(t, &mut out),
            Some(Content::Parts(parts)) => {
                for p in parts {
                    if let Some(t) = &p.text {
                        token_strs_into(t, &mut out);
                    }
                }
            }
            None => {}
        }
    }
    out
}

/// The words generated text is made of (each one token).
const OUTPUT_WORDS: [&str; 16] = [
    "the", "sim", "says", "ok", "data", "flow", "cat", "sun", "blue", "road", "hill", "tree", "kv",
    "page", "fast", "node",
];

/// A short word (at most one token) for deterministic output text.
pub fn output_word(seed: u64, index: u32) -> &'static str {
    let h = xxh3_64(&[seed.to_le_bytes(), u64::from(index).to_le_bytes()].concat());
    OUTPUT_WORDS[(h % OUTPUT_WORDS.len() as u64) as usize]
}

/// The reverse of the hashing tokenizer, for `/detokenize`: ids cannot be inverted, so the
/// vocabulary is learned from the text the pods tokenize on request (`/tokenize`, the render
/// endpoints) plus every output word. Each id keeps the bytes of the piece it was first seen as and
/// whether that piece began a word, which is where detokenized text gets its spaces back. Ids never
/// seen come out as `<|tok:ID|>` — every u32 is a valid id of this tokenizer, so none is an error.
#[derive(Debug)]
pub struct Vocab {
    pieces: HashMap<u32, (Box<[u8]>, bool)>,
}

/// Ids a [`Vocab`] remembers at most; past that it stops learning (memory stays bounded).
pub const VOCAB_CAPACITY: usize = 1 << 20;

impl Default for Vocab {
    fn default() -> Self {
        let mut v = Vocab {
            pieces: HashMap::new(),
        };
        for w in OUTPUT_WORDS {
            v.learn_text(w);
        }
        v
    }
}

impl Vocab {
    fn learn_piece(&mut self, piece: &[u8], word_start: bool) {
        if self.pieces.len() < VOCAB_CAPACITY {
            self.pieces
                .entry(piece_token(piece))
                .or_insert_with(|| (piece.into(), word_start));
        }
    }

    /// Remembers the pieces of `text`.
    pub fn learn_text(&mut self, text: &str) {
        for word in text.split_whitespace() {
            for (i, piece) in word.as_bytes().chunks(PIECE_BYTES).enumerate() {
                self.learn_piece(piece, i == 0);
            }
        }
    }

    /// Remembers the role markers and text of `messages`.
    pub fn learn_chat(&mut self, messages: &[ChatMessage]) {
        for m in messages {
            self.learn_piece(format!("<|{}|>", m.role).as_bytes(), true);
            match &m.content {
                Some(Content::Text(t)) => self.learn_text(t),
                Some(Content::Parts(parts)) => {
                    for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                        self.learn_text(t);
                    }
                }
                None => {}
            }
        }
    }

    /// How many ids are known.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The text of `ids`: pieces concatenated, a space before each piece that began a word.
    pub fn detokenize(&self, ids: &[u32]) -> String {
        let mut out: Vec<u8> = Vec::with_capacity(ids.len() * PIECE_BYTES);
        for id in ids {
            let unknown;
            let (bytes, word_start) = match self.pieces.get(id) {
                Some((b, w)) => (&b[..], *w),
                None => {
                    unknown = format!("<|tok:{id}|>");
                    (unknown.as_bytes(), true)
                }
            };
            if word_start && !out.is_empty() {
                out.push(b' ');
            }
            out.extend_from_slice(bytes);
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_split_into_four_byte_pieces() {
        assert_eq!(tokenize("a abcd abcde").len(), 1 + 1 + 2);
        assert_eq!(tokenize("  spaced\n\tout  ").len(), 2 + 1);
        assert_eq!(tokenize(""), Vec::<u32>::new());
        // Same piece, same id; different piece, different id.
        assert_eq!(tokenize("abcd"), tokenize("abcdabcd")[..1].to_vec());
        assert_ne!(tokenize("abcd"), tokenize("abce"));
    }

    #[test]
    fn chat_prompt_has_role_tokens_and_part_text() {
        let msgs: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role":"system","content":"be nice"},
                {"role":"user","content":[{"type":"text","text":"hello there"},{"type":"image_url"}]}]"#,
        )
        .unwrap();
        let t = chat_tokens(&msgs);
        assert_eq!(t.len(), 1 + 2 + 1 + 2 + 2);
        assert_eq!(t[0], role_token("system"));
        assert_eq!(t[3], role_token("user"));
        assert_ne!(role_token("user"), role_token("assistant"));
    }

    #[test]
    fn completion_prompt_shapes() {
        let t = Tokenizer::Builtin;
        let first = |p: &Prompt| t.prompt_list(p).remove(0);
        let p: Prompt = serde_json::from_str(r#""one two""#).unwrap();
        assert_eq!(first(&p).len(), 2);
        let p: Prompt = serde_json::from_str(r#"["one two three","x"]"#).unwrap();
        // "three" is two 4-byte pieces.
        assert_eq!(first(&p).len(), 4);
        let p: Prompt = serde_json::from_str("[5,6,7]").unwrap();
        assert_eq!(first(&p), vec![5, 6, 7]);
        let p: Prompt = serde_json::from_str("[[1,2],[3]]").unwrap();
        assert_eq!(first(&p), vec![1, 2]);
    }

    #[test]
    fn prompt_batches_and_token_strs() {
        let p: Prompt = serde_json::from_str(r#"["a b","c"]"#).unwrap();
        assert_eq!(
            Tokenizer::Builtin.prompt_list(&p),
            vec![tokenize("a b"), tokenize("c")]
        );
        let msgs: Vec<ChatMessage> =
            serde_json::from_str(r#"[{"role":"user","content":"hello w"}]"#).unwrap();
        assert_eq!(chat_token_strs(&msgs), vec!["<|user|>", "hell", "o", "w"]);
        assert_eq!(chat_token_strs(&msgs).len(), chat_tokens(&msgs).len());
    }

    #[test]
    fn vocab_round_trips_learned_text_and_marks_unknown_ids() {
        let mut v = Vocab::default();
        let text = "hello wonderful world ünïcødé";
        v.learn_text(text);
        assert_eq!(v.detokenize(&tokenize(text)), text);
        // Output words are known from the start.
        let out = format!("{} {}", output_word(3, 0), output_word(3, 1));
        assert_eq!(Vocab::default().detokenize(&tokenize(&out)), out);
        let msgs: Vec<ChatMessage> =
            serde_json::from_str(r#"[{"role":"user","content":"hi there"}]"#).unwrap();
        v.learn_chat(&msgs);
        assert_eq!(v.detokenize(&chat_tokens(&msgs)), "<|user|> hi there");
        assert_eq!(v.detokenize(&[7, piece_token(b"hi")]), "<|tok:7|> hi");
        assert_eq!(v.detokenize(&[]), "");
    }

    #[test]
    fn output_words_are_single_tokens() {
        for i in 0..64 {
            assert_eq!(tokenize(output_word(7, i)).len(), 1);
        }
        assert_eq!(output_word(1, 2), output_word(1, 2));
    }
}
