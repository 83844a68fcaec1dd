//! [`LlamaStage`]: one shard loaded in llama.cpp, with one context whose sequences are
//! Shoal sessions. Stage 0 takes token ids, later stages take hidden states through
//! `llama_batch.embd`; a non-tail stage stops the graph after its last layer through
//! the `cb_eval` callback and returns that layer's output (`l_out-<n−1>`), the tail
//! returns logits. See DESIGN.md, "Running a layer range with stock llama.cpp".

use crate::backend::{backend, capture_log, reported_mib};
use llama_cpp_sys_2 as sys;
use shoal_gguf::{open_model, ModelMeta, ShardCache, ShardError};
use shoal_types::{LayerRange, SessionId, Stage, StageError, StageInfo, StageInput, StageMemory, StageOutput};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// How a stage is loaded and run. Every stage of a chain, and the unsplit model it is
/// compared with, must use the same `chunk`: results depend on the micro-batch shape.
#[derive(Clone, Debug, PartialEq)]
pub struct StageConfig {
    /// Positions one session may hold.
    pub n_ctx_per_session: u32,
    /// Sessions held at once (llama.cpp sequences).
    pub max_sessions: u32,
    /// Prefill chunk size C: `n_batch = n_ubatch = C`, so a step of up to C tokens is
    /// computed as exactly one micro-batch.
    pub chunk: u32,
    /// CPU threads for this stage.
    pub threads: u32,
    /// Layers to offload to the GPU (0: CPU only). Passed through to llama.cpp, whose
    /// count includes the output layer. Ignored when `gpus` names devices.
    pub gpu_layers: u32,
    /// The stage's last layers on these GPUs, in this order (a leader's placement):
    /// how many on each, and whether the head goes too. Empty: `gpu_layers` decides.
    pub gpus: Vec<GpuLayers>,
}

/// Layers of a stage on one GPU, named by its backend device ("CUDA0", "Vulkan1").
#[derive(Clone, Debug, PartialEq)]
pub struct GpuLayers {
    /// The backend device's name.
    pub device: String,
    /// How many layers.
    pub layers: u32,
    /// Whether the output norm and LM head go there too (the last GPU of a tail).
    pub head: bool,
}

/// llama.cpp's offload parameters for `gpus` (non-empty): its `n_gpu_layers` (which
/// counts the output layer first: n offloads the output and the last n − 1 layers), and
/// the split per device in `gpus`' order (the layers, the output counted on the last
/// device). llama.cpp gives layer `i` of the offloaded ones to the first device whose
/// cumulative share exceeds `i / n`: with integer shares that is exact.
pub fn offload_split(gpus: &[GpuLayers]) -> (u32, Vec<f32>) {
    let layers: u32 = gpus.iter().map(|g| g.layers).sum();
    let mut split: Vec<f32> = gpus.iter().map(|g| g.layers as f32).collect();
    if let Some(last) = split.last_mut() {
        *last += 1.0;
    }
    (layers + 1, split)
}

impl Default for StageConfig {
    fn default() -> Self {
        Self { n_ctx_per_session: 2048, max_sessions: 4, chunk: 128, threads: 1, gpu_layers: 0, gpus: Vec::new() }
    }
}

/// Why a stage could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model or shard was refused or could not be built.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The split points are not valid for the model.
    #[error("{path}: {source}")]
    Split { path: PathBuf, source: shoal_types::SplitError },
    /// A configuration value is out of range.
    #[error("invalid stage configuration: {0}")]
    Config(String),
    /// llama.cpp refused the file or the context.
    #[error("{path}: llama.cpp could not {what} (run with RUST_LOG=llama.cpp=trace for its log)")]
    Llama { path: PathBuf, what: &'static str },
}

/// The arrays llama.cpp's model parameters point at to place a stage's last layers on
/// named GPUs ([`StageConfig::gpus`]); they must live until the model is loaded.
struct Offload {
    /// `n_gpu_layers` (output counted); `None`: no named GPUs, `gpu_layers` applies.
    n_gpu_layers: Option<i32>,
    /// The devices, NUL-terminated.
    devices: Vec<sys::ggml_backend_dev_t>,
    /// Each device's share of the offloaded layers, `llama_max_devices()` long.
    split: Vec<f32>,
    /// The output layer kept in RAM (the pattern, then the terminator), when the head
    /// does not go to a GPU: llama.cpp offloads it first otherwise, and on a middle
    /// stage it would copy a never-read head into VRAM (DESIGN point 7).
    overrides: Vec<sys::llama_model_tensor_buft_override>,
    /// The pattern's text, which `overrides` points at.
    _pattern: CString,
}

impl Offload {
    /// Resolve `gpus`' device names in this build's backend registry (initialised).
    fn new(gpus: &[GpuLayers]) -> Result<Offload, LoadError> {
        // Invariant: a literal without NUL.
        // `token_embd` too: a model with tied embeddings reads its LM head from it, and
        // llama.cpp would copy it to the output layer's GPU (the input embedding is
        // looked up on the CPU whatever the offload).
        let pattern = CString::new("^(output|output_norm|token_embd)\\.").expect("no NUL");
        let mut o = Offload {
            n_gpu_layers: None,
            devices: Vec::new(),
            split: Vec::new(),
            overrides: Vec::new(),
            _pattern: pattern,
        };
        if gpus.iter().all(|g| g.layers == 0 && !g.head) {
            return Ok(o);
        }
        // SAFETY: a plain query of a constant.
        let max = unsafe { sys::llama_max_devices() };
        if gpus.len() > max {
            return Err(LoadError::Config(format!("{} GPUs named; this build takes {max}", gpus.len())));
        }
        for g in gpus {
            let name = CString::new(g.device.as_str())
                .map_err(|_| LoadError::Config(format!("{:?} is not a device name", g.device)))?;
            // SAFETY: the registry is initialised (the caller's `backend()`) and only read;
            // the name outlives the call.
            let dev = unsafe { sys::ggml_backend_dev_by_name(name.as_ptr()) };
            if dev.is_null() {
                let have: Vec<String> = crate::devices::devices().into_iter().map(|d| d.name).collect();
                return Err(LoadError::Config(format!(
                    "the placement offloads to {}, which this build does not have (its devices: {})",
                    g.device,
                    have.join(", ")
                )));
            }
            o.devices.push(dev);
        }
        o.devices.push(std::ptr::null_mut());
        let (n, split) = offload_split(gpus);
        o.n_gpu_layers = Some(n.min(i32::MAX as u32) as i32);
        o.split = split;
        o.split.resize(max, 0.0);
        if !gpus.iter().any(|g| g.head) {
            // SAFETY: a plain query; the CPU buffer type is a static of ggml's.
            let cpu = unsafe { sys::ggml_backend_cpu_buffer_type() };
            o.overrides.push(sys::llama_model_tensor_buft_override { pattern: o._pattern.as_ptr(), buft: cpu });
            o.overrides
                .push(sys::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() });
        }
        Ok(o)
    }

    /// Point `mp` at the arrays (which must outlive the load).
    fn apply(&self, mp: &mut sys::llama_model_params) {
        let Some(n) = self.n_gpu_layers else { return };
        mp.n_gpu_layers = n;
        // llama.cpp reads the list only; its type is not const.
        mp.devices = self.devices.as_ptr().cast_mut();
        mp.split_mode = sys::LLAMA_SPLIT_MODE_LAYER;
        mp.tensor_split = self.split.as_ptr();
        if !self.overrides.is_empty() {
            mp.tensor_buft_overrides = self.overrides.as_ptr();
        }
    }
}

/// Where the captured hidden states land; the `cb_eval` callback's user data. Boxed so
/// its address stays fixed while llama.cpp holds it.
struct Capture {
    /// Name of the tensor to copy out (`l_out-<n_layer−1>`), NUL-terminated.
    target: CString,
    /// The copied values.
    data: Vec<f32>,
    /// Set when the callback copied the tensor during the current decode.
    hit: bool,
}

/// A session's place in the context.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// llama.cpp sequence id.
    seq: i32,
    /// Positions held: `0..n_pos`.
    n_pos: u32,
}

/// One loaded stage. Not `Sync`: one forward at a time.
pub struct LlamaStage {
    /// What it runs.
    info: StageInfo,
    /// The shard file loaded (for messages).
    path: PathBuf,
    model: NonNull<sys::llama_model>,
    ctx: NonNull<sys::llama_context>,
    /// Reused input batch with room for `chunk` tokens (ids, or `n_embd` floats each).
    batch: sys::llama_batch,
    /// Output capture of a non-tail stage (`None` for the tail).
    capture: Option<Box<Capture>>,
    /// Sessions and their sequences.
    sessions: HashMap<SessionId, Slot>,
    /// Sequence ids not in use.
    free_seqs: Vec<i32>,
    /// Memory held, measured at load.
    memory: StageMemory,
}

// SAFETY: the llama.cpp model and context are only used through `&mut self` (one
// thread at a time); llama.cpp allows using a context from any thread, just not from
// two at once. The capture buffer is owned and only touched inside `forward`.
unsafe impl Send for LlamaStage {}

impl LlamaStage {
    /// Load `shard` (a GGUF holding `layers` of a model of `n_layer_total` blocks; the
    /// whole model when `layers` covers it) and create its context.
    pub fn load(
        shard: &Path,
        layers: LayerRange,
        n_layer_total: u32,
        config: &StageConfig,
    ) -> Result<LlamaStage, LoadError> {
        if config.chunk == 0
            || config.max_sessions == 0
            || config.n_ctx_per_session < config.chunk
            || config.threads == 0
        {
            return Err(LoadError::Config(format!(
                "{config:?}: chunk, sessions and threads must be positive, context ≥ chunk"
            )));
        }
        // Our reader first: llama.cpp's may abort the process on a malformed file.
        let (_, meta) = open_model(shard).map_err(ShardError::from)?;
        if meta.n_layer != layers.len() {
            return Err(LoadError::Config(format!(
                "{} holds {} layers, expected {layers}",
                shard.display(),
                meta.n_layer
            )));
        }
        let llama_err = |what| LoadError::Llama { path: shard.to_owned(), what };
        backend();
        let c_path =
            CString::new(shard.as_os_str().as_encoded_bytes()).map_err(|_| llama_err("open a path containing NUL"))?;
        let offload = Offload::new(&config.gpus)?;
        // SAFETY: default params are plain data; the path and `offload`'s arrays (which
        // llama.cpp reads during the call and copies what it keeps) outlive the call.
        let model = unsafe {
            let mut mp = sys::llama_model_default_params();
            mp.n_gpu_layers = config.gpu_layers.min(i32::MAX as u32) as i32;
            offload.apply(&mut mp);
            // Map the shard: a middle stage's unused embedding and LM head stay unread.
            mp.load_mode = sys::LLAMA_LOAD_MODE_MMAP;
            sys::llama_model_load_from_file(c_path.as_ptr(), mp)
        };
        let model = NonNull::new(model).ok_or(llama_err("load the model"))?;

        let is_tail = layers.end == n_layer_total;
        let mut capture = (!is_tail).then(|| {
            Box::new(Capture {
                // Invariant: formatted from digits and ASCII, so it holds no NUL.
                target: CString::new(format!("l_out-{}", meta.n_layer - 1)).expect("no NUL in tensor name"),
                data: Vec::new(),
                hit: false,
            })
        });
        let n_seq = config.max_sessions;
        // SAFETY: plain-data params; `capture` is boxed and outlives the context (it is
        // dropped after the context in `Drop`).
        let (ctx, log) = capture_log(|| unsafe {
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = config.n_ctx_per_session * n_seq;
            cp.n_batch = config.chunk;
            cp.n_ubatch = config.chunk;
            cp.n_seq_max = n_seq;
            cp.n_threads = config.threads as i32;
            cp.n_threads_batch = config.threads as i32;
            // Each session in its own KV stream: a session's numbers must not depend on
            // what other sessions hold (cell positions change reduction order).
            cp.kv_unified = false;
            // Flash attention off: its CPU kernel splits a step's attention over the
            // threads and sums the parts, so the logits depended on the thread count (a
            // 300-token run with 1 and 2 threads differed). Off, they do not, and nodes
            // with different core counts still give the unsplit model's numbers.
            // (No measurable speed change on the test models; memory as predicted.)
            cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
            cp.no_perf = true;
            if let Some(c) = capture.as_mut() {
                cp.cb_eval = Some(eval_callback);
                cp.cb_eval_user_data = (&mut **c as *mut Capture).cast::<c_void>();
            }
            sys::llama_init_from_model(model.as_ptr(), cp)
        });
        let Some(ctx) = NonNull::new(ctx) else {
            // SAFETY: the model was loaded above and nothing else refers to it.
            unsafe { sys::llama_model_free(model.as_ptr()) };
            return Err(llama_err("create a context"));
        };
        // SAFETY: ctx is valid; these are getters.
        let (n_ctx_seq, n_embd, n_vocab) = unsafe {
            let vocab = sys::llama_model_get_vocab(model.as_ptr());
            (
                sys::llama_n_ctx_seq(ctx.as_ptr()),
                sys::llama_model_n_embd(model.as_ptr()),
                sys::llama_vocab_n_tokens(vocab),
            )
        };
        // Output buffer: llama.cpp keeps n_vocab floats per output row. The tail outputs
        // one row per step; a non-tail stage marks every token of a chunk as output, so
        // the buffer grows to C rows at its first prefill chunk (unused, but allocated).
        let out_rows = if is_tail { n_seq } else { config.chunk.max(n_seq) };
        let memory = StageMemory {
            weights: meta.stage_weight_bytes(layers.start == 0, is_tail),
            kv: reported_mib(&log, "KV buffer size") + reported_mib(&log, "RS buffer size"),
            compute: reported_mib(&log, "compute buffer size") + u64::from(out_rows) * n_vocab as u64 * 4,
        };
        // SAFETY: allocates a batch for `chunk` tokens: ids for stage 0, else embeddings.
        let batch =
            unsafe { sys::llama_batch_init(config.chunk as i32, if layers.start == 0 { 0 } else { n_embd }, 1) };
        let info = StageInfo {
            layers,
            n_layer_total,
            n_embd: n_embd as u32,
            n_vocab: n_vocab as u32,
            chunk: config.chunk,
            n_ctx_per_session: n_ctx_seq.min(config.n_ctx_per_session),
            max_sessions: n_seq,
        };
        tracing::debug!(path = %shard.display(), %layers, ?memory, "stage loaded");
        Ok(LlamaStage {
            info,
            path: shard.to_owned(),
            model,
            ctx,
            batch,
            capture,
            sessions: HashMap::new(),
            free_seqs: (0..n_seq as i32).rev().collect(),
            memory,
        })
    }

    /// The shard file this stage runs.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn slot(&mut self, session: SessionId) -> Result<Slot, StageError> {
        if let Some(s) = self.sessions.get(&session) {
            return Ok(*s);
        }
        let seq = self.free_seqs.pop().ok_or(StageError::NoFreeSession { max: self.info.max_sessions })?;
        let slot = Slot { seq, n_pos: 0 };
        self.sessions.insert(session, slot);
        Ok(slot)
    }

    fn check_input(&self, input: &StageInput<'_>) -> Result<usize, StageError> {
        let info = &self.info;
        let n = match (input, info.is_first()) {
            (StageInput::Tokens(t), true) => {
                if let Some(&bad) = t.iter().find(|&&t| t < 0 || t as u32 >= info.n_vocab) {
                    return Err(StageError::BadToken { token: bad, n_vocab: info.n_vocab });
                }
                t.len()
            }
            (StageInput::Hidden(h), false) => {
                if h.is_empty() || h.len() % info.n_embd as usize != 0 {
                    return Err(StageError::BadHiddenLength { len: h.len(), n_embd: info.n_embd });
                }
                h.len() / info.n_embd as usize
            }
            (_, true) => return Err(StageError::WrongInput { layers: info.layers, expected: "token ids" }),
            (_, false) => return Err(StageError::WrongInput { layers: info.layers, expected: "hidden states" }),
        };
        if n == 0 || n > info.chunk as usize {
            return Err(StageError::ChunkTooLarge { n, chunk: info.chunk });
        }
        Ok(n)
    }

    /// Drop positions `from..` of sequence `seq`.
    fn truncate(&mut self, seq: i32, from: u32) -> Result<(), StageError> {
        // SAFETY: ctx is valid; removing a tail of positions from one sequence.
        let ok = unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.ctx.as_ptr()), seq, from as i32, -1) };
        if ok {
            Ok(())
        } else {
            Err(StageError::Engine(format!("llama.cpp cannot roll sequence {seq} back to position {from}")))
        }
    }
}

impl Stage for LlamaStage {
    fn info(&self) -> &StageInfo {
        &self.info
    }

    fn forward_rows(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
        all_rows: bool,
    ) -> Result<StageOutput, StageError> {
        let n = self.check_input(&input)?;
        let known = self.sessions.get(&session).map_or(0, |s| s.n_pos);
        if first_pos > known {
            return Err(StageError::PositionGap { session, first_pos, have: known });
        }
        let end = first_pos + n as u32;
        if end > self.info.n_ctx_per_session {
            return Err(StageError::ContextFull { session, end, n_ctx: self.info.n_ctx_per_session });
        }
        let mut slot = self.slot(session)?;
        if first_pos < slot.n_pos {
            // A replay: drop what the session holds from here on, then recompute.
            self.truncate(slot.seq, first_pos)?;
            slot.n_pos = first_pos;
            self.sessions.insert(session, slot);
        }

        let tail = self.info.is_tail();
        let n_embd = self.info.n_embd as usize;
        // SAFETY: the batch was allocated for `chunk` ≥ n tokens with one sequence id
        // each, and with `embd` (n_embd floats per token) exactly when this stage is not
        // stage 0 — which `check_input` matched against the input kind.
        unsafe {
            let b = &mut self.batch;
            b.n_tokens = n as i32;
            match input {
                StageInput::Tokens(t) => std::ptr::copy_nonoverlapping(t.as_ptr(), b.token, n),
                StageInput::Hidden(h) => std::ptr::copy_nonoverlapping(h.as_ptr(), b.embd, n * n_embd),
            }
            for i in 0..n {
                *b.pos.add(i) = (first_pos as usize + i) as i32;
                *b.n_seq_id.add(i) = 1;
                *(*b.seq_id.add(i)) = slot.seq;
                // A non-tail stage marks every token as output so that the last layer
                // keeps every row; the tail needs the last token's logits only, or every
                // token's for a verify step.
                *b.logits.add(i) = i8::from(!tail || all_rows || i == n - 1);
            }
        }
        if let Some(c) = self.capture.as_mut() {
            c.hit = false;
            c.data.clear();
        }
        // SAFETY: ctx and batch are valid; the capture box outlives the call.
        let rc = unsafe { sys::llama_decode(self.ctx.as_ptr(), self.batch) };
        let result = if rc != 0 {
            Err(StageError::Engine(format!("llama_decode returned {rc} for {n} tokens at position {first_pos}")))
        } else if let Some(c) = self.capture.as_mut() {
            if c.hit && c.data.len() == n * n_embd {
                Ok(StageOutput::Hidden(std::mem::take(&mut c.data)))
            } else {
                Err(StageError::Engine(format!("layer output {:?} was not captured", c.target)))
            }
        } else {
            let n_vocab = self.info.n_vocab as usize;
            let rows = if all_rows { 0..n } else { n - 1..n };
            let mut logits = Vec::with_capacity(rows.len() * n_vocab);
            let mut missing = false;
            for i in rows {
                // SAFETY: token i was marked for output; llama.cpp returns a pointer to
                // n_vocab floats valid until the next decode, or null on error.
                let p = unsafe { sys::llama_get_logits_ith(self.ctx.as_ptr(), i as i32) };
                if p.is_null() {
                    missing = true;
                    break;
                }
                logits.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n_vocab) });
            }
            if missing {
                Err(StageError::Engine("llama.cpp returned no logits".into()))
            } else {
                Ok(StageOutput::Logits(logits))
            }
        };
        match result {
            Ok(out) => {
                slot.n_pos = end;
                self.sessions.insert(session, slot);
                Ok(out)
            }
            Err(e) => {
                // Leave the session as it was before this step.
                let _ = self.truncate(slot.seq, first_pos);
                Err(e)
            }
        }
    }

    fn free_session(&mut self, session: SessionId) {
        if let Some(slot) = self.sessions.remove(&session) {
            // SAFETY: removing a whole sequence never fails (llama.h).
            unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.ctx.as_ptr()), slot.seq, -1, -1) };
            self.free_seqs.push(slot.seq);
        }
    }

    fn memory(&self) -> StageMemory {
        self.memory
    }
}

impl Drop for LlamaStage {
    fn drop(&mut self) {
        // SAFETY: each was created once in `load` and is freed once here, context
        // before model, before the capture box it points to is dropped.
        unsafe {
            sys::llama_batch_free(self.batch);
            sys::llama_free(self.ctx.as_ptr());
            sys::llama_model_free(self.model.as_ptr());
        }
    }
}

/// `cb_eval`: asked about each graph node, say yes only for the target; when it has
/// been computed, copy it out and return false, which stops the rest of the graph
/// (the output norm and LM head a non-tail stage does not need).
unsafe extern "C" fn eval_callback(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    // SAFETY: user_data is the stage's boxed Capture (set at context creation) and
    // `t` a live tensor of the graph being computed, per ggml's callback contract.
    let (cap, t) = unsafe { (&mut *user_data.cast::<Capture>(), &*t) };
    // SAFETY: ggml tensor names are NUL-terminated within their 64-byte array.
    let name = unsafe { std::ffi::CStr::from_ptr(t.name.as_ptr()) };
    let is_target = name == cap.target.as_c_str();
    if ask {
        return is_target;
    }
    if !is_target {
        return true;
    }
    let ok = t.type_ == sys::GGML_TYPE_F32 && unsafe { sys::ggml_is_contiguous(t) };
    if ok {
        let n = (t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]) as usize;
        cap.data.resize(n, 0.0);
        // SAFETY: the tensor is f32 and contiguous with n elements; data has room.
        unsafe { sys::ggml_backend_tensor_get(t, cap.data.as_mut_ptr().cast(), 0, n * 4) };
        cap.hit = true;
    }
    false
}

/// Load a model split at `points` into stages (one per range), building or reusing
/// verified shards in `cache`. No points: one stage over the original file.
pub fn load_split(
    model: &Path,
    points: &[u32],
    cache: &ShardCache,
    config: &StageConfig,
) -> Result<(ModelMeta, Vec<LlamaStage>), LoadError> {
    let (g, meta) = open_model(model).map_err(ShardError::from)?;
    let ranges = shoal_types::split_ranges(meta.n_layer, points, meta.layer_period(), meta.arch.name())
        .map_err(|source| LoadError::Split { path: model.to_owned(), source })?;
    let mut stages = Vec::with_capacity(ranges.len());
    for r in ranges {
        let shard = cache.get_or_build(model, &g, &meta, r)?;
        stages.push(LlamaStage::load(&shard.path, r, meta.n_layer, config)?);
    }
    Ok((meta, stages))
}
