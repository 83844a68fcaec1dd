//! `shoal run`, `shoal demo` and `shoal inspect`: one process, the model split into
//! in-process stages on the canonical schedule.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use shoal_engine::{
    load_split, open_model, Chain, DraftModel, Observer, Sampler, SamplingParams, ShardCache, StageConfig, Utf8Stream,
    Vocab,
};
use shoal_types::{LayerRange, SessionId, SpecSettings, Stage, StageMemory, TokenId};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// What to generate and how to show it: shared by `run`, `demo` and `generate`.
#[derive(Args, Clone, Debug)]
pub struct TextArgs {
    /// Text to answer (wrapped in the model's chat template unless --raw).
    #[arg(long, short)]
    pub prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy (the same answer every time).
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: i32,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the top token's probability (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtracted from a token's logit per time it occurred in the last 64 tokens
    /// (OpenAI's frequency_penalty; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtracted from the logit of each token that occurred in the last 64 tokens
    /// (OpenAI's presence_penalty; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Use the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Keep going after an end-of-generation token (for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Keep the answer within a GBNF grammar (llama.cpp's format, start rule `root`),
    /// read from this file: the API's JSON modes use the same mechanism.
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// Speculative decoding: verify up to K tokens drafted by prompt lookup in each
    /// decode step (0: off). Split and unsplit runs with the same K answer alike.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub draft: u32,
    /// With --draft: choose each step's k from the acceptance so far and these costs, in
    /// thousandths of a one-position pass: what each drafted position adds, what a
    /// step costs besides (hops), and with a draft model what it spends per drafted
    /// token (default 0). "0,0" drafts up to K every step. Default: "450,100", what a
    /// CPU pass costs on a small model (each extra position ~0.45 of a pass).
    #[arg(long, value_name = "POSITION,STEP[,MODEL]", value_parser = parse_costs)]
    pub draft_cost: Option<(u32, u32, u32)>,
}

/// `--draft-cost`: two or three numbers separated by commas.
fn parse_costs(s: &str) -> Result<(u32, u32, u32), String> {
    let parts: Vec<&str> = s.split(',').collect();
    if !(2..=3).contains(&parts.len()) {
        return Err(format!("{s:?}: expected POSITION,STEP or POSITION,STEP,MODEL (e.g. 450,100)"));
    }
    let n = |x: &str| x.trim().parse::<u32>().map_err(|e| format!("{x:?}: {e}"));
    Ok((n(parts[0])?, n(parts[1])?, parts.get(2).map_or(Ok(0), |x| n(x))?))
}

impl TextArgs {
    /// The prompt as token ids, through the chat template unless `--raw`.
    pub fn prompt_tokens(&self, vocab: &Vocab) -> Result<Vec<TokenId>> {
        let text = self.prompt.clone().context("--prompt is required")?;
        if self.max_tokens == 0 {
            bail!("-n must be at least 1");
        }
        Ok(if self.raw || !vocab.has_chat_template() {
            vocab.tokenize(&text, false)
        } else {
            vocab.tokenize(&vocab.chat_prompt(&text)?, true)
        })
    }

    /// The speculation settings the flags describe (`None`: off).
    pub fn speculation(&self) -> Result<Option<SpecSettings>> {
        if self.draft == 0 {
            return Ok(None);
        }
        let d = SpecSettings::default();
        let (position_cost, step_cost, model_cost) = self.draft_cost.unwrap_or((d.position_cost, d.step_cost, 0));
        let s = SpecSettings { max_draft: self.draft, position_cost, step_cost, model_cost, ..d };
        s.validate()?;
        Ok(Some(s))
    }

    /// The tokens that end a generation, unless --ignore-eos.
    pub fn stop_tokens(&self, vocab: &Vocab) -> Vec<TokenId> {
        if self.ignore_eos {
            Vec::new()
        } else {
            vocab.eog_tokens()
        }
    }

    /// The sampling parameters the flags describe.
    pub fn sampling(&self) -> Result<SamplingParams> {
        let grammar = match &self.grammar {
            Some(p) => {
                Some(std::fs::read_to_string(p).with_context(|| format!("reading the grammar {}", p.display()))?)
            }
            None => None,
        };
        Ok(SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            grammar,
            ..SamplingParams::default()
        })
    }
}

/// Options of `run` and `demo`: the text, and how the in-process stages run.
#[derive(Args, Clone, Debug)]
pub struct GenArgs {
    #[command(flatten)]
    pub text: TextArgs,
    /// Prefill chunk size C (every stage's micro-batch); output depends on it.
    #[arg(long, default_value_t = 128)]
    pub chunk: u32,
    /// Context length (prompt + answer).
    #[arg(long, default_value_t = 2048)]
    pub ctx: u32,
    /// CPU threads per stage [default: this machine's physical cores].
    #[arg(long)]
    pub threads: Option<u32>,
    /// Layers per stage to offload to a GPU (needs a GPU build).
    #[arg(long, default_value_t = 0)]
    pub gpu_layers: u32,
    /// Where shard files are cached [default: ~/.cache/shoal/shards].
    #[arg(long)]
    pub cache: Option<PathBuf>,
}

/// `shoal run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    pub model: PathBuf,
    /// Layers at which to split into stages, e.g. `10,20` for three stages.
    #[arg(long, value_delimiter = ',')]
    pub split: Vec<u32>,
    /// With --draft: drafts come from this smaller GGUF (the model's vocabulary, e.g.
    /// the family's smallest member) instead of prompt lookup, so free-form text is
    /// drafted too. A stage 0 started with the same draft model gives the same answer.
    #[arg(long, value_name = "GGUF")]
    pub draft_model: Option<PathBuf>,
    #[command(flatten)]
    pub gen: GenArgs,
}

/// `shoal demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Instead of the local cluster: the model split into three stages in this process.
    #[arg(long)]
    pub in_process: bool,
    /// Stop once the question is answered, instead of serving until Ctrl-C.
    #[arg(long)]
    pub once: bool,
    /// A phase timed before the demo started, `NAME=SECONDS` (scripts/demo.sh passes
    /// its set-up and build), printed first among the phases' times.
    #[arg(long, value_name = "NAME=SECONDS", value_parser = parse_phase, hide = true)]
    pub phase: Vec<(String, f64)>,
    #[command(flatten)]
    pub gen: GenArgs,
}

/// `NAME=SECONDS`, as `--phase` takes it.
fn parse_phase(s: &str) -> Result<(String, f64), String> {
    let (name, secs) = s.split_once('=').ok_or_else(|| format!("{s:?}: use NAME=SECONDS"))?;
    let secs: f64 = secs.trim().parse().map_err(|_| format!("{s:?}: {secs:?} is not a number of seconds"))?;
    if name.trim().is_empty() || !secs.is_finite() || secs < 0.0 {
        return Err(format!("{s:?}: use NAME=SECONDS with a name and seconds >= 0"));
    }
    Ok((name.trim().to_string(), secs))
}

/// `shoal inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    pub model: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `run --json` and `generate --json` print (one shape, so they can be compared).
#[derive(Serialize)]
pub struct RunReport {
    pub tokens: Vec<TokenId>,
    pub text: String,
    pub stages: Vec<LayerRange>,
    pub prompt_tokens: usize,
    pub tok_per_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub logits_digest: String,
    pub chunk: u32,
    /// Per stage (in-process runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Vec<StageMemory>>,
    /// Milliseconds each stage spent, over the whole generation (in-process runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage_ms: Option<Vec<f64>>,
    /// Peak resident memory of the process (in-process runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// Decode steps (passes through the stages after the prompt), and with
    /// speculation the tokens drafted and accepted in them.
    #[serde(default)]
    pub decode_steps: u64,
    #[serde(default)]
    pub drafted: u64,
    #[serde(default)]
    pub accepted: u64,
}

pub fn run(a: RunArgs) -> Result<()> {
    let g = &a.gen;
    let cache = ShardCache::new(g.cache.clone().unwrap_or_else(default_cache));
    let config = StageConfig {
        n_ctx_per_session: g.ctx,
        max_sessions: 1,
        chunk: g.chunk,
        threads: g.threads.unwrap_or_else(crate::inventory::default_threads),
        gpu_layers: g.gpu_layers,
        gpus: Vec::new(),
    };
    let t = &g.text;
    if a.draft_model.is_some() && t.draft == 0 {
        bail!("--draft-model drafts for speculative decoding: add --draft K (e.g. --draft 8)");
    }
    // One vocabulary for the prompt, the printer and a grammar's sampler.
    let vocab = Arc::new(Vocab::load(&a.model)?);
    let prompt = t.prompt_tokens(&vocab)?;
    let max_new = t.max_tokens.min((g.ctx as usize).saturating_sub(prompt.len()));
    if max_new == 0 {
        bail!(
            "the prompt takes {} tokens, which leaves no room in the context of {} (raise --ctx)",
            prompt.len(),
            g.ctx
        );
    }
    // Refuse out-of-range sampling flags (a NaN or negative --temp, --top-p 2, ...)
    // before llama.cpp loads anything or sees them.
    let sampling = t.sampling()?;
    shoal_types::validate_generation(&sampling, prompt.len(), max_new as u32, g.ctx)?;
    let (_, stages) = load_split(&a.model, &a.split, &cache, &config)?;
    let ranges: Vec<LayerRange> = stages.iter().map(|s| s.info().layers).collect();
    let memory: Vec<StageMemory> = stages.iter().map(|s| s.memory()).collect();
    let mut chain = Chain::new(stages.into_iter().map(|s| Box::new(s) as Box<dyn Stage>).collect())?;
    if !t.json {
        let names: Vec<String> = ranges.iter().map(|r| format!("layers {r}")).collect();
        eprintln!(
            "[shoal] {} stage(s): {}; prompt {} tokens, chunk {}",
            ranges.len(),
            names.join(" | "),
            prompt.len(),
            g.chunk
        );
    }
    let mut out = Printer::new(&vocab, !t.json, !t.ignore_eos);
    let mut sampler = if sampling.grammar.is_some() {
        Sampler::with_vocab(&sampling, Some(vocab.clone()))?
    } else {
        Sampler::new(&sampling)
    };
    let mut spec = t.speculation()?.unwrap_or(SpecSettings::OFF);
    let stop = t.stop_tokens(&vocab);
    let mut proposer = match &a.draft_model {
        Some(path) => {
            let size = std::fs::metadata(&a.model).with_context(|| format!("reading {}", a.model.display()))?.len();
            // On the CPU, as a node loads it (a GPU computes other numbers, so other
            // drafts); --gpu-layers counts the model's layers, not the draft's.
            let draft = DraftModel::load(path, &a.model, size, &StageConfig { gpu_layers: 0, ..config.clone() })?;
            // As a coordinator does: the draft model's price unless --draft-cost gave one.
            spec = spec.priced_for(draft.cost());
            Some(draft.proposer())
        }
        None => None,
    };
    let gen = chain.generate_drafted(
        SessionId(0),
        &prompt,
        max_new,
        &mut sampler,
        &mut out,
        &spec,
        &stop,
        proposer.as_deref_mut(),
    )?;
    let tail = out.finish();
    if t.json {
        let report = RunReport {
            tokens: gen.tokens.clone(),
            text: out.text.clone(),
            stages: ranges,
            prompt_tokens: prompt.len(),
            tok_per_s: gen.decode_tok_per_s(),
            prefill_s: gen.prefill.as_secs_f64(),
            decode_s: gen.decode.as_secs_f64(),
            logits_digest: gen.logits_digest,
            chunk: g.chunk,
            memory: Some(memory),
            stage_ms: Some(gen.timing.per_stage.iter().map(|d| d.as_secs_f64() * 1e3).collect()),
            peak_rss_bytes: peak_rss(),
            decode_steps: gen.decode_steps as u64,
            drafted: gen.drafted as u64,
            accepted: gen.accepted as u64,
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{tail}");
        println!();
        eprintln!(
            "[shoal] {} tokens, {:.1} tok/s decode, prefill {:.2} s",
            gen.tokens.len(),
            gen.decode_tok_per_s(),
            gen.prefill.as_secs_f64()
        );
    }
    Ok(())
}

/// Streams text as tokens arrive, holding back partial UTF-8 characters.
pub struct Printer<'v> {
    vocab: &'v Vocab,
    utf8: Utf8Stream,
    /// Print to stdout as it comes (not with --json).
    stream: bool,
    /// End the generation at an end-of-generation token.
    stop_at_eog: bool,
    /// Everything so far.
    pub text: String,
}

impl<'v> Printer<'v> {
    pub fn new(vocab: &'v Vocab, stream: bool, stop_at_eog: bool) -> Self {
        Self { vocab, utf8: Utf8Stream::default(), stream, stop_at_eog, text: String::new() }
    }

    /// End of stream: returns the held-back tail (already added to `text`).
    pub fn finish(&mut self) -> String {
        let tail = self.utf8.finish();
        self.text.push_str(&tail);
        tail
    }
}

impl Observer for Printer<'_> {
    fn token(&mut self, token: TokenId) -> bool {
        if self.stop_at_eog && self.vocab.is_eog(token) {
            return false;
        }
        let s = self.utf8.push(&self.vocab.piece(token));
        if self.stream {
            print!("{s}");
            let _ = std::io::stdout().flush();
        }
        self.text.push_str(&s);
        true
    }
}

/// The demo: SmolLM2 from the model cache, split into three stages.
pub fn demo(a: DemoArgs) -> Result<()> {
    let model = shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.exists() {
        bail!("{} is missing: run scripts/setup.sh --demo first (scripts/demo.sh does)", model.display());
    }
    let mut gen = a.gen;
    gen.text.prompt.get_or_insert_with(|| "Explain in three sentences why the sky is blue.".into());
    if !a.in_process {
        return crate::local::demo(
            gen.text.prompt.as_deref().unwrap_or_default(),
            gen.text.max_tokens,
            a.once,
            a.phase,
        );
    }
    run(RunArgs { model, split: vec![10, 20], draft_model: None, gen })
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let (g, meta) = open_model(&a.model)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&meta)?);
        return Ok(());
    }
    println!(
        "{}: {} ({}), GGUF v{}",
        a.model.display(),
        meta.name.as_deref().unwrap_or("?"),
        meta.arch.name(),
        g.version
    );
    println!("  layers {}  n_embd {}  vocab {}  context {}", meta.n_layer, meta.n_embd, meta.n_vocab, meta.n_ctx_train);
    println!("  heads {} (kv {})  split period {}", meta.n_head, meta.n_head_kv, meta.layer_period());
    let layers: u64 = meta.layer_bytes.iter().sum();
    println!(
        "  layer bytes {} (avg {} per layer)  embedding {}  LM head {}  other {}",
        layers,
        layers / u64::from(meta.n_layer),
        meta.embd_bytes,
        if meta.tied_embeddings { "tied".to_string() } else { meta.output_bytes.to_string() },
        meta.other_bytes
    );
    println!("  KV cache {} bytes per token per layer (f16)", meta.kv_bytes_per_token_per_layer());
    let types: Vec<String> = meta.tensor_types.iter().map(|(t, n)| format!("{t}×{n}")).collect();
    println!("  tensor types {}", types.join(" "));
    Ok(())
}

pub fn default_cache() -> PathBuf {
    shoal_gguf::cache_root().join("shards")
}

/// Peak resident memory of this process (Linux: VmHWM).
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
