//! The coordinator's text side: tokenizer, chat template and a streaming detokenizer,
//! from the GGUF's vocabulary (loaded alone, without weights) through `llama-cpp-2`.

use crate::backend::backend;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaModel};
use llama_cpp_2::token::LlamaToken;
use shoal_types::TokenId;
use std::path::{Path, PathBuf};

/// Why the vocabulary or a chat template could not be used.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    /// The file was refused by Shoal's GGUF reader.
    #[error(transparent)]
    Gguf(#[from] shoal_gguf::GgufError),
    /// llama.cpp could not load the vocabulary.
    #[error("{0}: llama.cpp could not load the vocabulary")]
    Load(PathBuf),
    /// The model has no usable chat template.
    #[error("{path}: cannot apply the chat template: {why}")]
    Template { path: PathBuf, why: String },
}

/// A model's vocabulary.
pub struct Vocab {
    /// A vocab-only llama.cpp model: the tokenizer without any weights.
    model: LlamaModel,
    /// The file it came from, for messages.
    path: PathBuf,
}

impl Vocab {
    /// Load the vocabulary of the GGUF at `path` (validated by Shoal's reader first).
    pub fn load(path: &Path) -> Result<Vocab, VocabError> {
        shoal_gguf::open_model(path)?;
        let params = LlamaModelParams::default().with_vocab_only(true);
        let model =
            LlamaModel::load_from_file(backend(), path, &params).map_err(|_| VocabError::Load(path.to_owned()))?;
        Ok(Vocab { model, path: path.to_owned() })
    }

    /// Number of tokens.
    pub fn n_vocab(&self) -> u32 {
        self.model.vocab().n_tokens().max(0) as u32
    }

    /// Token ids of `text`, with the model's BOS when it wants one. Special-token text
    /// (`<|im_start|>`) becomes the special token when `parse_special` is set, which a
    /// chat-templated prompt needs and raw user text must not get.
    pub fn tokenize(&self, text: &str, parse_special: bool) -> Vec<TokenId> {
        self.model.vocab().tokenize(text.as_bytes(), true, parse_special).into_iter().map(|t| t.0).collect()
    }

    /// `prompt` as a single user turn in the model's chat template, ready for the
    /// assistant's answer.
    pub fn chat_prompt(&self, prompt: &str) -> Result<String, VocabError> {
        let err = |why: String| VocabError::Template { path: self.path.clone(), why };
        let tmpl = self.model.chat_template(None).map_err(|e| err(e.to_string()))?;
        let msg = LlamaChatMessage::new("user".into(), prompt.into()).map_err(|e| err(e.to_string()))?;
        self.model.apply_chat_template(&tmpl, &[msg], true).map_err(|e| err(e.to_string()))
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.model.chat_template(None).is_ok()
    }

    /// The bytes a token stands for (may be part of a UTF-8 character). Control
    /// tokens render as nothing.
    pub fn piece(&self, token: TokenId) -> Vec<u8> {
        self.model.vocab().token_to_piece(LlamaToken(token), false, None)
    }

    /// End of generation (EOS, EOT, `<end_of_turn>` …)?
    pub fn is_eog(&self, token: TokenId) -> bool {
        self.model.vocab().is_eog(LlamaToken(token))
    }

    /// Every end-of-generation token id.
    pub fn eog_tokens(&self) -> Vec<TokenId> {
        (0..self.n_vocab() as TokenId).filter(|&t| self.is_eog(t)).collect()
    }

    /// The whole text of `tokens`.
    pub fn detokenize(&self, tokens: &[TokenId]) -> String {
        let mut s = Utf8Stream::default();
        let mut out: String = tokens.iter().map(|&t| s.push(&self.piece(t))).collect();
        out.push_str(&s.finish());
        out
    }
}

/// Turns a stream of byte pieces into text without splitting a UTF-8 character across
/// two outputs: a piece ending in the middle of a character holds those bytes back
/// until the rest arrives. Invalid bytes become U+FFFD.
#[derive(Default, Debug)]
pub struct Utf8Stream {
    /// Bytes of an incomplete character at the end of the input so far.
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; return the text they complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Invariant: from_utf8 said the first `valid` bytes are UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// End of stream: whatever is held back, replaced if incomplete.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::Utf8Stream;

    #[test]
    fn split_characters_are_held_back() {
        let text = "héllo → 🐟 fish";
        let bytes = text.as_bytes();
        // Every way of cutting the bytes in two gives the same text, never a U+FFFD.
        for cut in 0..=bytes.len() {
            let mut s = Utf8Stream::default();
            let mut out = s.push(&bytes[..cut]);
            assert!(!out.contains('\u{FFFD}'));
            out += &s.push(&bytes[cut..]);
            out += &s.finish();
            assert_eq!(out, text);
        }
        // One byte at a time.
        let mut s = Utf8Stream::default();
        let out: String = bytes.iter().map(|b| s.push(&[*b])).collect();
        assert_eq!(out, text);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(s.push(b"\xf0\x9f"), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}
