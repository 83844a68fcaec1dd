//! The node process's engine: llama.cpp stages ([`LlamaStage`]) on shard files, with
//! the samplers the tail uses. The node crate never links llama.cpp; it gets this.

use shoal_api::{ChatMessage, PromptOptions, TextModel, ThinkingSyntax, ToolSyntax};
use shoal_engine::{DraftError, DraftModel, GpuLayers, LlamaStage, Sampler, SamplingParams, StageConfig, Vocab};
use shoal_node::runtime::{Engine, LoadedDraft, StageSizing};
use shoal_pipeline::SamplerFactory;
use shoal_types::{GpuShare, LayerRange, Stage, TokenId, TokenSampler};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// llama.cpp on this machine's CPU (and GPU layers where built with one).
pub struct LlamaEngine {
    /// CPU threads per stage.
    pub threads: u32,
    /// Draft models this node was given (`--draft-model`), tried in order.
    pub draft_models: Vec<PathBuf>,
}

impl LlamaEngine {
    /// A context sized as the placement says, on this node's threads, all on the CPU.
    fn config(&self, s: StageSizing) -> StageConfig {
        StageConfig {
            n_ctx_per_session: s.context,
            max_sessions: s.sessions,
            chunk: s.chunk,
            threads: self.threads,
            gpu_layers: 0,
            gpus: Vec::new(),
        }
    }
}

impl Engine for LlamaEngine {
    fn load(
        &self,
        shard: &Path,
        layers: LayerRange,
        n_layer: u32,
        s: StageSizing,
        gpus: &[GpuShare],
    ) -> Result<Box<dyn Stage>, String> {
        let config = StageConfig {
            // The placement's offload: its last layers on these GPUs.
            gpus: gpus.iter().map(|g| GpuLayers { device: g.device.clone(), layers: g.layers, head: g.head }).collect(),
            ..self.config(s)
        };
        let stage = LlamaStage::load(shard, layers, n_layer, &config).map_err(|e| e.to_string())?;
        Ok(Box::new(stage))
    }

    fn drafts(&self, shard: &Path, model_bytes: u64, s: StageSizing, room: u64) -> Result<Option<LoadedDraft>, String> {
        let config = self.config(s);
        // The first that shares the vocabulary is the one: a file that cannot be read
        // is passed over (the next may be the one), and named if none loads.
        let mut unread = None;
        for path in &self.draft_models {
            match shoal_engine::check_vocabularies(path, shard) {
                Ok(_) => {}
                // Another family's: the next may fit.
                Err(e @ DraftError::Vocabulary { .. }) => {
                    tracing::debug!("{e}");
                    continue;
                }
                Err(e) => {
                    tracing::warn!("draft model {}: {e}", path.display());
                    unread.get_or_insert_with(|| format!("{}: {e}", path.display()));
                    continue;
                }
            }
            let need = draft_memory(path, s)?;
            if need > room {
                return Err(format!(
                    "{} needs {} MiB at this load's context and sessions, {} MiB are left of this node's memory \
                     (raise --max-memory, or load with a smaller context)",
                    path.display(),
                    need >> 20,
                    room >> 20
                ));
            }
            let d = DraftModel::load(path, shard, model_bytes, &config).map_err(|e| e.to_string())?;
            tracing::info!(draft = %path.display(), cost = d.cost(), "drafting with a draft model");
            let file =
                path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
            let bytes = d.memory().total();
            return Ok(Some(LoadedDraft { source: Arc::new(d), file, bytes }));
        }
        match unread {
            Some(why) => Err(why),
            None => Ok(None),
        }
    }

    fn draft_reserve(&self, s: StageSizing) -> u64 {
        self.draft_models
            .iter()
            .filter_map(|p| match draft_memory(p, s) {
                Ok(b) => Some(b),
                // It will not load either; the load says why.
                Err(e) => {
                    tracing::warn!("draft model {}: {e}", p.display());
                    None
                }
            })
            .max()
            .unwrap_or(0)
    }

    fn samplers(&self, shard: &Path) -> SamplerFactory {
        sampler_factory(shard.to_owned())
    }

    fn fingerprint(&self) -> String {
        // What a stage's speed depends on besides the machine: a node restarted with
        // other threads, or another build (version, GPU backends), is measured again.
        let backends = if cfg!(feature = "cuda") {
            "cuda"
        } else if cfg!(feature = "vulkan") {
            "vulkan"
        } else if cfg!(feature = "metal") {
            "metal"
        } else {
            "cpu"
        };
        // (Measurements run on the CPU: GPU layers are the plan's, estimated.)
        format!("shoal {} {backends} threads={}", env!("CARGO_PKG_VERSION"), self.threads)
    }

    fn text(&self, gguf: &Path) -> Result<Arc<dyn TextModel>, String> {
        let vocab = Vocab::load(gguf).map_err(|e| e.to_string())?;
        // Read off the template that renders requests with tools: a Command R's
        // `tool_use` one, not its default one (which has no tool syntax).
        let tools = vocab.tool_template_source().map_or(ToolSyntax::Generic, |t| ToolSyntax::of(&t));
        // Thinking as the default template writes it, or the tool one where only it
        // does (Command R7B's plans in its `tool_use` template).
        let thinking = [vocab.template_source(), vocab.tool_template_source()]
            .into_iter()
            .flatten()
            .map(|t| ThinkingSyntax::of(&t))
            .find(|s| *s != ThinkingSyntax::None)
            .unwrap_or(ThinkingSyntax::None);
        Ok(Arc::new(LlamaText { eog: vocab.eog_tokens(), vocab, tools, thinking }))
    }
}

/// What the draft model at `path` takes run whole at `s`'s sizing (the planner's
/// prediction: weights, KV cache, compute buffers).
fn draft_memory(path: &Path, s: StageSizing) -> Result<u64, String> {
    let (_, meta) = shoal_gguf::open_model(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let profile = shoal_planner::ModelProfile::from_meta(&meta);
    let sizing = shoal_planner::Sizing { context: s.context, sessions: s.sessions, chunk: s.chunk };
    Ok(profile.stage_memory(LayerRange::new(0, meta.n_layer), &sizing).total())
}

/// The tail's samplers for the model file (or shard) at `gguf`: a request with a
/// grammar gets one read against the file's vocabulary, loaded (without weights) on the
/// first such request and kept.
pub fn sampler_factory(gguf: PathBuf) -> SamplerFactory {
    let vocab: Arc<OnceLock<Result<Arc<Vocab>, String>>> = Arc::new(OnceLock::new());
    Arc::new(move |v: &serde_json::Value| {
        let params: SamplingParams = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        // The coordinator and the tail checked them; this is the last gate before llama.cpp.
        params.validate().map_err(|e| e.to_string())?;
        if params.grammar.is_none() {
            return Ok(Box::new(Sampler::new(&params)) as Box<dyn TokenSampler>);
        }
        let vocab = vocab.get_or_init(|| Vocab::load(&gguf).map(Arc::new).map_err(|e| e.to_string())).clone()?;
        let sampler = Sampler::with_vocab(&params, Some(vocab)).map_err(|e| e.to_string())?;
        Ok(Box::new(sampler) as Box<dyn TokenSampler>)
    })
}

/// A model's vocabulary as the HTTP API uses it.
struct LlamaText {
    vocab: Vocab,
    /// Its end-of-generation tokens (a scan of the whole vocabulary: done once).
    eog: Vec<TokenId>,
    /// The tool syntax of the chat template it renders requests with tools through
    /// (its `tool_use` one where it has one; read once).
    tools: ToolSyntax,
    /// How its templates write the model's thinking (read once).
    thinking: ThinkingSyntax,
}

/// A request's template variables as the engine's renderer takes them.
fn vars(options: &PromptOptions) -> shoal_engine::template::Vars<'_> {
    shoal_engine::template::Vars {
        enable_thinking: options.enable_thinking,
        reasoning_effort: options.reasoning_effort.as_deref(),
    }
}

impl TextModel for LlamaText {
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.chat_prompt_as(messages, &PromptOptions::default())
    }

    fn chat_prompt_as(&self, messages: &[ChatMessage], options: &PromptOptions) -> Result<String, String> {
        if !self.vocab.has_chat_template() {
            // A base model: the turns as plain text, the answer to follow.
            let mut s: String = messages.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect();
            s.push_str("assistant:");
            return Ok(s);
        }
        let turns: Vec<(&str, &str)> = messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        self.vocab.chat_as(&turns, vars(options)).map_err(|e| e.to_string())
    }

    fn tokenize(&self, text: &str, parse_special: bool) -> Vec<TokenId> {
        self.vocab.tokenize(text, parse_special)
    }

    fn piece(&self, token: TokenId) -> Vec<u8> {
        self.vocab.piece(token)
    }

    fn eog_tokens(&self) -> Vec<TokenId> {
        self.eog.clone()
    }

    fn fill_in_middle(&self, prefix: &str, suffix: &str) -> Option<Vec<TokenId>> {
        self.vocab.fill_in_middle(prefix, suffix)
    }

    fn tool_syntax(&self) -> ToolSyntax {
        self.tools
    }

    fn chat_prompt_with_tools(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        self.vocab.chat_with_tools(messages, tools).map_err(|e| e.to_string())
    }

    fn chat_prompt_with_tools_as(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
        options: &PromptOptions,
    ) -> Result<String, String> {
        self.vocab.chat_with_tools_as(messages, tools, vars(options)).map_err(|e| e.to_string())
    }

    fn thinking(&self) -> ThinkingSyntax {
        self.thinking
    }
}
