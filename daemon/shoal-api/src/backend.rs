//! What the HTTP layer needs from the node it runs in: the models clients may name, a
//! model's text side (tokenizer and chat template, without weights), and generation
//! wherever the model's coordinator runs. The node implements [`Backend`]; tests
//! implement it with a fake.

pub use crate::thinking::ThinkingSyntax;
use shoal_pipeline::{GenerateRequest, Report};
use shoal_types::{CatalogEntry, TokenId};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc;

/// How long a request waits by default for a model that does not answer yet: longer
/// than a re-placement after a lost node takes (fetching a shard and loading it), and
/// than a WiFi drop, so that a client never sees either.
pub const MODEL_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The node as the API sees it.
pub trait Backend: Send + Sync + 'static {
    /// Every model a client may name, with its state.
    fn models(&self) -> impl Future<Output = Vec<ModelInfo>> + Send;

    /// Load `model` (a catalog name) with its default context: the first request for a
    /// model that is not loaded does this, as Ollama does.
    fn load(&self, model: &str) -> impl Future<Output = Result<(), Failure>> + Send;

    /// Stop running `model` (a catalog name): every stage frees its memory. The
    /// model stays in the catalog.
    fn unload(&self, model: &str) -> impl Future<Output = Result<(), Failure>> + Send;

    /// Take `model` out of the catalog, unloading it first if it runs. The file stays
    /// where it is on disk (Shoal uses models in place; it never deletes them).
    fn remove(&self, model: &str) -> impl Future<Output = Result<(), Failure>> + Send;

    /// Download the GGUF at `source` (an http(s) URL or `hf://org/repo/file.gguf`) to
    /// this node, resuming a cut download, and add it to the catalog; progress goes to
    /// `progress` as bytes arrive. The catalog name on success.
    fn pull(
        &self,
        source: &str,
        progress: mpsc::UnboundedSender<PullProgress>,
    ) -> impl Future<Output = Result<String, Failure>> + Send;

    /// The text side of the model named `model` (a catalog name or a hash prefix).
    fn text(&self, model: &str) -> impl Future<Output = Result<Arc<dyn TextModel>, Failure>> + Send;

    /// The API's counters (the backend owns them, so that they live as long as it).
    fn metrics(&self) -> &crate::Metrics;

    /// The node's own lines for `/metrics` (Prometheus text): its stages, its models.
    fn node_metrics(&self) -> impl Future<Output = String> + Send {
        async { String::new() }
    }

    /// What `key` (as a client presented it) may do, if it is one of the cluster's API
    /// keys. Constant time in the key.
    fn key_scope(&self, key: &str) -> Option<shoal_types::KeyScope>;

    /// Whether the cluster's owner let every machine in without a key (a setting that
    /// can change while the node runs; `Access::open` is the node's own flag).
    fn open(&self) -> bool {
        false
    }

    /// How long a request waits for its model to answer (being placed, starting, or
    /// unreachable for a moment) before it is refused with a 503
    /// ([`MODEL_WAIT`] unless the node says otherwise).
    fn model_wait(&self) -> std::time::Duration {
        MODEL_WAIT
    }

    /// How generations speculate when a request does not say (`None`: they do not).
    fn speculation(&self) -> Option<shoal_types::SpecSettings> {
        None
    }

    /// Speculation `settings` fitted to where `model` runs: a node sets the step cost
    /// from its placement's predicted hops and compute
    /// ([`shoal_types::speculative::step_cost_for`]). Chosen once per request, so a
    /// generation resumed elsewhere keeps its schedule (with a draft model, where the
    /// new coordinator drafts with the same file: the coordinator prices and runs it).
    /// As given by default.
    fn fit_speculation(&self, model: &str, settings: shoal_types::SpecSettings) -> shoal_types::SpecSettings {
        let _ = model;
        settings
    }

    /// Run `request` on `model` wherever its stages run, sending each token to
    /// `tokens` as it comes (with its log-probabilities when the request's sampling
    /// asked for them); the report at the end. Dropping the future cancels the
    /// generation (its session is freed on every stage).
    fn generate(
        &self,
        model: &str,
        request: GenerateRequest,
        tokens: mpsc::UnboundedSender<Sampled>,
    ) -> impl Future<Output = Result<Report, Failure>> + Send;
}

/// A generated token, with its log-probabilities when they were asked for.
pub type Sampled = (TokenId, Option<shoal_types::TokenLogprobs>);

/// How far a pull has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullProgress {
    /// Bytes on disk so far.
    pub completed: u64,
    /// The file's size, when the server said.
    pub total: Option<u64>,
}

/// A model as clients see it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    /// The catalog entry.
    pub entry: CatalogEntry,
    /// Whether it runs.
    pub state: ModelState,
    /// Positions per session where it is placed (the placement's context).
    pub context: Option<u32>,
}

/// Where a model stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelState {
    /// In the catalog, not loaded.
    Available,
    /// Placed; its stages are fetching shards or loading.
    Starting,
    /// Every stage runs: requests are answered.
    Ready,
    /// Loaded, but it cannot be placed now (why).
    Unplaced(String),
}

/// A model's vocabulary and chat template (the node loads them without weights).
pub trait TextModel: Send + Sync {
    /// `messages` in the model's chat template, ready for the assistant's answer.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String>;
    /// Token ids of `text` (with BOS where the model wants one); special-token text
    /// becomes special tokens only with `parse_special` (templated prompts need it,
    /// raw user text must not get it).
    fn tokenize(&self, text: &str, parse_special: bool) -> Vec<TokenId>;
    /// The bytes a token stands for (maybe part of a UTF-8 character; control tokens
    /// are empty).
    fn piece(&self, token: TokenId) -> Vec<u8>;
    /// The end-of-generation tokens.
    fn eog_tokens(&self) -> Vec<TokenId>;
    /// The prompt asking the model to write what goes between `prefix` and `suffix`
    /// (its fill-in-the-middle tokens), or `None` when it has none: Ollama's `suffix`.
    fn fill_in_middle(&self, prefix: &str, suffix: &str) -> Option<Vec<TokenId>> {
        let _ = (prefix, suffix);
        None
    }
    /// The tool-call syntax ([`ToolSyntax::of`]) of the template that renders requests
    /// with tools ([`TextModel::chat_prompt_with_tools`]: a GGUF's `tool_use` template
    /// where it has one, its default one otherwise); the generic one where it has none
    /// Shoal reads back.
    fn tool_syntax(&self) -> ToolSyntax {
        ToolSyntax::Generic
    }
    /// `messages` (OpenAI's shape: an assistant's `tool_calls`, a tool's `tool_call_id`
    /// and `name`) with `tools` offered (`[{"type": "function", "function": {…}}]`),
    /// through the model's own template for tools, ready for the answer: for models
    /// whose [`TextModel::tool_syntax`] is not the generic one.
    fn chat_prompt_with_tools(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
    ) -> Result<String, String> {
        let _ = (messages, tools);
        Err("the model's chat template has no tool syntax of its own".into())
    }
    /// [`TextModel::chat_prompt`] with the template's own variables set as `options`
    /// says (`enable_thinking`, `reasoning_effort`); as `chat_prompt` by default.
    fn chat_prompt_as(&self, messages: &[ChatMessage], options: &PromptOptions) -> Result<String, String> {
        let _ = options;
        self.chat_prompt(messages)
    }
    /// [`TextModel::chat_prompt_with_tools`] with the template's own variables set as
    /// `options` says; as `chat_prompt_with_tools` by default.
    fn chat_prompt_with_tools_as(
        &self,
        messages: &serde_json::Value,
        tools: &serde_json::Value,
        options: &PromptOptions,
    ) -> Result<String, String> {
        let _ = options;
        self.chat_prompt_with_tools(messages, tools)
    }
    /// How its chat template writes the model's thinking ([`ThinkingSyntax::of`] the
    /// template: its default one, or its `tool_use` one where only that one has it);
    /// none by default.
    fn thinking(&self) -> ThinkingSyntax {
        ThinkingSyntax::None
    }
}

/// Variables a chat template reads besides the conversation (Hugging Face's
/// `apply_chat_template` keyword arguments; llama.cpp's `chat_template_kwargs`). Left
/// undefined unless a request gives them, as Hugging Face leaves them: each template
/// then chooses (Qwen 3's thinks, DeepSeek V3.1's does not).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptOptions {
    /// `enable_thinking` (Qwen 3's, SmolLM3's, DeepSeek V3.1's …): false asks a hybrid
    /// model to answer without thinking, true to think.
    pub enable_thinking: Option<bool>,
    /// `reasoning_effort` (gpt-oss's: `low`, `medium`, `high`).
    pub reasoning_effort: Option<String>,
}

/// How a model calls tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Shoal's generic format, for any template: the tools described in the system
    /// message, the answer one JSON object held by a grammar.
    Generic,
    /// Hermes' format (Qwen 2.5 and 3, QwQ, Hermes 2 and 3, and the many models
    /// trained on it): the template lists the tools in `<tools></tools>`, the model
    /// answers each call as `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
    /// and reads results in `<tool_response>`.
    Hermes,
    /// Qwen3-Coder's XML (and Qwen 3.5's, Nemotron 3 Nano's, Step 3.5 Flash's): the
    /// template lists the tools in `<tools></tools>` as XML, the model answers each call
    /// as `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…
    /// </function>\n</tool_call>` (several one after another; text may come before the
    /// first, never after the last), a value written raw where the tool's schema makes
    /// it a string and as JSON otherwise, and reads results in `<tool_response>` within
    /// a user turn.
    QwenXml,
    /// Llama 3.1, 3.2 and 3.3's: the template lists the tools as JSON, the model
    /// answers one call as `{"name": …, "parameters": {…}}` and reads results as
    /// `ipython` turns.
    Llama3,
    /// Command R7B's (and Cohere's later templates that keep it): the template lists
    /// the tools, the model answers its calls as one JSON list,
    /// `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": …, "parameters": {…}}]<|END_ACTION|>`,
    /// a reply as `<|START_RESPONSE|>…<|END_RESPONSE|>`, and reads results in
    /// `<|START_TOOL_RESULT|>`.
    CommandR7b,
    /// Command R+'s and Command R's (35B; their `tool_use` templates): the template lists
    /// the tools as Python function signatures with docstrings and asks for
    /// `Action:` then a `` ```json `` fenced list of `{"tool_name": …, "parameters": {…}}`
    /// objects, the tool `directly-answer` standing for a reply without tools (a
    /// "Plan: …" may come first); it writes an earlier call as such a list in the
    /// assistant's turn and reads results in `<results>` within a system turn.
    CommandRPlus,
    /// DeepSeek R1's (and its Qwen and Llama distills'): each call
    /// `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then its arguments in a
    /// `` ```json `` fence and `<｜tool▁call▁end｜>`, one per line, all between
    /// `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`.
    DeepSeekR1 {
        /// Whether the template lists the tools (llama.cpp's fixed template does);
        /// DeepSeek's own does not, and Shoal then describes them in the system
        /// message.
        lists_tools: bool,
    },
    /// DeepSeek V3.1's: as R1's, but each call is
    /// `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>`, chained
    /// without separators.
    DeepSeekV31 {
        /// Whether the template lists the tools (DeepSeek's own does not: Shoal then
        /// describes them in the system message, as the model card says to).
        lists_tools: bool,
    },
    /// Mistral's first (Mistral 7B v0.3's, Nemo's, Small 3.1's): the template lists the
    /// tools in `[AVAILABLE_TOOLS]…[/AVAILABLE_TOOLS]`, the model answers its calls as
    /// one JSON list, `[TOOL_CALLS][{"name": …, "arguments": {…}, "id": "<9 letters or
    /// digits>"}]`, and reads results in `[TOOL_RESULTS]…[/TOOL_RESULTS]` that name the
    /// call's 9-character id.
    MistralNemo,
    /// Mistral's later one (Small 3.2's, Devstral's, Magistral's, Ministral 3's): the
    /// tools listed as Nemo's, each call `[TOOL_CALLS]NAME[ARGS]{…}`, chained without
    /// separators.
    Mistral {
        /// Whether the template writes each earlier call's id, `NAME[CALL_ID]ID[ARGS]{…}`
        /// (Small 3.2's: its ids are 9 letters or digits), which the model may then
        /// write too.
        call_ids: bool,
    },
    /// OpenAI's harmony format (gpt-oss): the template lists the tools in a developer
    /// message as a TypeScript namespace, the model answers a call as a `commentary`
    /// message to the function, `<|channel|>commentary to=functions.NAME
    /// <|constrain|>json<|message|>{…}<|call|>` (one per answer), and reads results as
    /// messages from `functions.NAME`.
    Harmony,
}

impl ToolSyntax {
    /// The syntax a Jinja chat template speaks: DeepSeek's when it writes
    /// `<｜tool▁calls▁begin｜>` and `<｜tool▁sep｜>` (R1's when its call has a
    /// `` ```json `` fence, V3.1's otherwise; whether it lists `tools` noted); and
    /// among templates that list `tools`: the generic one when it writes GLM's
    /// `<arg_key>`/`<arg_value>` pairs (GLM 4.6 and 4.7's, Ling's, Laguna's: their
    /// `<tool_call>` is not Hermes', and Shoal does not run GLM's architecture yet, so
    /// their syntax is not read); Qwen3-Coder's XML when it writes `<tool_call>`,
    /// `<function=` and `<parameter=`; Hermes' when it writes `<tool_call>` otherwise;
    /// Llama 3's when it answers tools in an `ipython` environment with
    /// `"parameters"`; Command R7B's when it writes `<|START_ACTION|>` lists of
    /// `"tool_name"`s; Command R+'s when it writes `Action:` with a `` ```json `` fenced
    /// list of `"tool_name"`s (R7B's template says `Action:` and `` ```json `` too, in
    /// its instructions, so its own markers are looked for first); Mistral's when it
    /// writes `[TOOL_CALLS]` (the later one when its
    /// calls have `[ARGS]`, whether they have `[CALL_ID]`s noted; Nemo's list
    /// otherwise); harmony's when it writes `<|channel|>commentary` messages to
    /// `"functions."` (gpt-oss's). Otherwise the generic one (templates with other
    /// syntaxes get the generic format until Shoal reads theirs).
    pub fn of(template: &str) -> ToolSyntax {
        // A template that never names `tools` cannot list them; DeepSeek's own are
        // such, and are told the tools by Shoal instead.
        let lists_tools = template.contains("tools");
        if template.contains("<|channel|>commentary") && template.contains("\"functions.\"") {
            return ToolSyntax::Harmony;
        }
        if template.contains("<｜tool▁calls▁begin｜>") && template.contains("<｜tool▁sep｜>") {
            if template.contains("```json") {
                ToolSyntax::DeepSeekR1 { lists_tools }
            } else {
                ToolSyntax::DeepSeekV31 { lists_tools }
            }
        } else if !lists_tools {
            ToolSyntax::Generic
        } else if template.contains("<arg_key>") {
            // GLM's calls, `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…`.
            ToolSyntax::Generic
        } else if template.contains("<tool_call>")
            && template.contains("<function=")
            && template.contains("<parameter=")
        {
            // Seed-OSS's `<seed:tool_call>` calls have no `<tool_call>`, and no newline
            // around their values: not these.
            ToolSyntax::QwenXml
        } else if template.contains("<tool_call>") {
            ToolSyntax::Hermes
        } else if template.contains("Environment: ipython") && template.contains("\"parameters\": ") {
            ToolSyntax::Llama3
        } else if template.contains("<|START_ACTION|>") && template.contains("\"tool_name\"") {
            ToolSyntax::CommandR7b
        } else if template.contains("Action:") && template.contains("```json") && template.contains("\"tool_name\"") {
            ToolSyntax::CommandRPlus
        } else if template.contains("[TOOL_CALLS]") {
            if template.contains("[ARGS]") {
                ToolSyntax::Mistral { call_ids: template.contains("[CALL_ID]") }
            } else {
                ToolSyntax::MistralNemo
            }
        } else {
            ToolSyntax::Generic
        }
    }
}

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text.
    pub content: String,
}

/// A request that failed, as the HTTP layer maps it to a status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// For people.
    pub message: String,
}

/// Kinds of failure, each with its HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// Malformed or impossible request (400).
    BadRequest,
    /// No key, or not a key of the cluster's (401).
    Unauthorized,
    /// Not allowed (403).
    Forbidden,
    /// No such model (404).
    NotFound,
    /// The model is starting: try again in the given seconds (503 with Retry-After).
    Loading(u32),
    /// The cluster cannot serve it now: not placed, does not fit, no leader (503).
    Unavailable,
    /// Too many requests queued (429).
    Busy,
    /// Something broke inside (500).
    Internal,
}

impl Failure {
    /// A failure of `kind` saying `message`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Failure {
        Failure { kind, message: message.into() }
    }

    /// 400 with `message`.
    pub fn bad(message: impl Into<String>) -> Failure {
        Failure::new(FailureKind::BadRequest, message)
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        match self.kind {
            FailureKind::BadRequest => 400,
            FailureKind::Unauthorized => 401,
            FailureKind::Forbidden => 403,
            FailureKind::NotFound => 404,
            FailureKind::Busy => 429,
            FailureKind::Internal => 500,
            FailureKind::Loading(_) | FailureKind::Unavailable => 503,
        }
    }
}
