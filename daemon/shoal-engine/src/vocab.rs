//! The coordinator's text side: tokenizer, chat template and a streaming detokenizer,
//! from the GGUF's vocabulary (loaded alone, without weights) through `llama-cpp-2`.

use crate::backend::backend;
use crate::template::{Turn, Vars};
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaChatTemplate, LlamaModel};
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

/// The name of the chat template a GGUF keeps for requests that offer tools
/// (`tokenizer.chat_template.tool_use`): Cohere's Command R, R+ and R7B, Hermes 2 Pro
/// and 3, whose default template has no tool syntax (or a different one).
const TOOL_USE: &str = "tool_use";

/// A model's vocabulary.
pub struct Vocab {
    /// A vocab-only llama.cpp model: the tokenizer without any weights.
    model: LlamaModel,
    /// The file it came from, for messages.
    path: PathBuf,
    /// The model's [`TOOL_USE`] template, read once at load; `None` where it has none,
    /// or one Shoal cannot use (then requests with tools use the default one).
    tool_use: Option<String>,
}

impl Vocab {
    /// Load the vocabulary of the GGUF at `path` (validated by Shoal's reader first).
    pub fn load(path: &Path) -> Result<Vocab, VocabError> {
        let (gguf, _) = shoal_gguf::open_model(path)?;
        let tool_use = tool_use_template(&gguf, path);
        let params = LlamaModelParams::default().with_vocab_only(true);
        let model =
            LlamaModel::load_from_file(backend(), path, &params).map_err(|_| VocabError::Load(path.to_owned()))?;
        Ok(Vocab { model, path: path.to_owned(), tool_use })
    }

    /// The vocab-only llama.cpp model (for samplers that read the vocabulary).
    pub fn model(&self) -> &LlamaModel {
        &self.model
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

    /// The prompt that asks the model to write what goes between `prefix` and `suffix`:
    /// its fill-in-the-middle tokens in prefix-suffix-middle order (BOS where the model
    /// wants one, as llama.cpp's infill builds it); `None` when the model has no such
    /// tokens (it was not trained to fill in).
    pub fn fill_in_middle(&self, prefix: &str, suffix: &str) -> Option<Vec<TokenId>> {
        let v = self.model.vocab();
        let (pre, suf, mid) = (v.fim_pre().0, v.fim_suf().0, v.fim_mid().0);
        if pre < 0 || suf < 0 || mid < 0 {
            return None;
        }
        let text = |t: &str| v.tokenize(t.as_bytes(), false, false).into_iter().map(|t| t.0).collect::<Vec<_>>();
        let mut out = self.tokenize("", false);
        out.push(pre);
        out.extend(text(prefix));
        out.push(suf);
        out.extend(text(suffix));
        out.push(mid);
        Some(out)
    }

    /// `prompt` as a single user turn in the model's chat template, ready for the
    /// assistant's answer.
    pub fn chat_prompt(&self, prompt: &str) -> Result<String, VocabError> {
        self.chat(&[("user", prompt)])
    }

    /// A conversation of `(role, content)` turns in the model's chat template (its
    /// default one, see [`Vocab::template_source`]), ready for the assistant's answer:
    /// the template itself, rendered as Jinja (see `template.rs`); llama.cpp's built-in
    /// version of its format where the Jinja cannot be rendered. Without the BOS text
    /// where the tokenizer adds the BOS.
    pub fn chat(&self, turns: &[(&str, &str)]) -> Result<String, VocabError> {
        self.chat_as(turns, Vars::default())
    }

    /// [`Vocab::chat`] with the template's variables `vars` set (`enable_thinking` …;
    /// llama.cpp's built-in formats, the fallback, know none).
    pub fn chat_as(&self, turns: &[(&str, &str)], vars: Vars<'_>) -> Result<String, VocabError> {
        let err = |why: String| VocabError::Template { path: self.path.clone(), why };
        let tmpl = match (self.model.chat_template(None), &self.tool_use) {
            (Ok(t), _) => t,
            (Err(_), Some(t)) => LlamaChatTemplate::new(t).map_err(|e| err(e.to_string()))?,
            (Err(e), None) => return Err(err(e.to_string())),
        };
        let source = tmpl.to_str().map_err(|e| err(e.to_string()))?;
        let jinja: Vec<Turn<'_>> = turns.iter().map(|&(role, content)| Turn { role, content }).collect();
        match self.render(|bos, eos| crate::template::render_as(source, &jinja, bos, eos, vars)) {
            Ok(text) => return Ok(text),
            // A template that parses but runs past its budget is refused, not
            // replaced: it is what the file says, and the file may be hostile.
            Err(why) if why.starts_with(crate::template::OVER_BUDGET) => return Err(err(why)),
            Err(why) => tracing::warn!(
                path = %self.path.display(),
                "the chat template does not render as Jinja ({why}); using llama.cpp's built-in version of its format"
            ),
        }
        let msgs = turns
            .iter()
            .map(|(role, content)| LlamaChatMessage::new(role.to_string(), content.to_string()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(e.to_string()))?;
        self.model.apply_chat_template(&tmpl, &msgs, true).map_err(|e| err(e.to_string()))
    }

    /// A conversation in OpenAI's shape (assistant turns with `tool_calls`, `tool`
    /// turns with `tool_call_id`) with `tools` offered, through the model's Jinja
    /// template for tools ([`Vocab::tool_template_source`]): the model's own tool
    /// syntax. No fallback: llama.cpp's built-in formats know no tools. Without the BOS
    /// text where the tokenizer adds the BOS.
    pub fn chat_with_tools(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
    ) -> Result<String, VocabError> {
        self.chat_with_tools_as(messages, tools, Vars::default())
    }

    /// [`Vocab::chat_with_tools`] with the template's variables `vars` set.
    pub fn chat_with_tools_as(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
        vars: Vars<'_>,
    ) -> Result<String, VocabError> {
        let err = |why: String| VocabError::Template { path: self.path.clone(), why };
        let source = self.tool_template_source().ok_or_else(|| err("the model has no chat template".into()))?;
        self.render(|bos, eos| crate::template::render_json_as(&source, messages, tools, bos, eos, vars)).map_err(err)
    }

    /// What `render` (given the model's BOS and EOS texts) writes, without the BOS text
    /// at its start where the tokenizer adds the BOS itself.
    fn render(&self, render: impl FnOnce(&str, &str) -> Result<String, String>) -> Result<String, String> {
        let (bos, eos) = (self.special_text(self.model.vocab().bos()), self.special_text(self.model.vocab().eos()));
        let mut text = render(&bos, &eos)?;
        if !bos.is_empty() && text.starts_with(&bos) && !self.tokenize("", false).is_empty() {
            text.drain(..bos.len());
        }
        Ok(text)
    }

    /// The model's chat template (Jinja) for requests without tools, if it has one: its
    /// default one (`tokenizer.chat_template`); its `tool_use` one where it has no
    /// default, as llama.cpp's server does.
    pub fn template_source(&self) -> Option<String> {
        self.model.chat_template(None).ok().and_then(|t| t.to_string().ok()).or_else(|| self.tool_use.clone())
    }

    /// The model's chat template (Jinja) for requests that offer tools, if it has one:
    /// its `tool_use` one (`tokenizer.chat_template.tool_use`) where it has one Shoal
    /// can use, its default one otherwise, as llama.cpp's server chooses. The tool
    /// syntax a model speaks is read off this one.
    pub fn tool_template_source(&self) -> Option<String> {
        self.tool_use.clone().or_else(|| self.template_source())
    }

    /// The text of special token `t` (the BOS's `<|begin_of_text|>`), or nothing when
    /// the model has no such token.
    fn special_text(&self, t: LlamaToken) -> String {
        if !(0..self.n_vocab() as TokenId).contains(&t.0) {
            return String::new();
        }
        String::from_utf8_lossy(&self.model.vocab().token_to_piece(t, true, None)).into_owned()
    }

    /// Whether the model has a chat template (a default one, or a `tool_use` one).
    pub fn has_chat_template(&self) -> bool {
        self.model.chat_template(None).is_ok() || self.tool_use.is_some()
    }

    /// The bytes a token stands for (may be part of a UTF-8 character). Control
    /// tokens, and ids outside the vocabulary, render as nothing.
    pub fn piece(&self, token: TokenId) -> Vec<u8> {
        // llama.cpp indexes its table with `at()`: an id from another node that is
        // outside the vocabulary would throw through the FFI and abort the process.
        if !(0..self.n_vocab() as TokenId).contains(&token) {
            return Vec::new();
        }
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

/// The [`TOOL_USE`] template of `gguf` (the file at `path`), where it has one Shoal can
/// use. One that is not a UTF-8 string, is empty or does not parse as Jinja is left out
/// with a warning, not refused: the model still answers, requests with tools through
/// its default template (as llama.cpp's server ignores a tool template it cannot parse).
fn tool_use_template(gguf: &shoal_gguf::Gguf, path: &Path) -> Option<String> {
    // Read by Shoal's reader, not `LlamaModel::chat_template(Some(name))`: llama-cpp-2
    // 0.1.160 frees the name's C string before llama.cpp reads it. The key is the one
    // llama.cpp's `llama_model_chat_template(model, name)` looks up.
    // Missing is the common case (most models keep one template): nothing to say.
    let value = gguf.get(&format!("tokenizer.chat_template.{TOOL_USE}"))?;
    let checked = match value.as_str() {
        None => Err("it is not a UTF-8 string".to_string()),
        Some(s) if s.trim().is_empty() => Err("it is empty".to_string()),
        Some(s) => crate::template::check(s)
            .map(|()| s.to_string())
            .map_err(|why| format!("it does not parse as Jinja: {why}")),
    };
    match checked {
        Ok(source) => {
            tracing::debug!(path = %path.display(), "requests with tools use the model's {TOOL_USE} chat template");
            Some(source)
        }
        Err(why) => {
            tracing::warn!(
                path = %path.display(),
                "the model's {TOOL_USE} chat template is left out ({why}): requests with tools use its default template"
            );
            None
        }
    }
}

pub use shoal_types::text::Utf8Stream;
