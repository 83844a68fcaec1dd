//! Shard files: a GGUF holding layers `a..b` of a source model renumbered from 0,
//! which stock llama.cpp loads as a small model. Written by streaming tensor bytes
//! (memory use does not grow with the model), to a temporary file that is fsynced and
//! atomically renamed, then described by a manifest carrying its BLAKE3 hash; the cache
//! uses a shard only after re-checking that hash, so a torn or corrupted file is
//! rebuilt, never loaded.
//!
//! The manifest also carries one BLAKE3 hash per [`CHUNK_BYTES`] chunk, computed while
//! the shard is written (never later, from a file that may since have rotted), so that
//! a node receiving a shard from another can check each chunk as it arrives and resume
//! at the first one it does not hold. Chunks of zeros (the holes of a middle stage)
//! are flagged rather than hashed: they cost nothing to send or store. Shards fetched
//! from other nodes live in a part of the cache keyed by the source's content hash
//! ([`SourceHash`]), since the two nodes' paths to the model mean nothing to each other.

use crate::file::{align, write_header, Gguf, TensorInfo};
use crate::model::{Arch, ModelMeta};
use crate::value::{Value, ValueType};
use crate::GgufError;
use serde::{Deserialize, Serialize};
use shoal_types::{split_ranges, LayerRange};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// Bumped whenever the bytes a shard holds for the same source and range change.
pub const SHARD_FORMAT: u32 = 1;
/// Metadata keys Shoal adds to a shard, recording where it came from.
pub const KEY_SOURCE_LAYERS: &str = "shoal.shard.source_layers";

/// Errors of shard building and the shard cache.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The source model could not be read or is not acceptable.
    #[error(transparent)]
    Source(#[from] GgufError),
    /// The requested range is not a valid part of the model.
    #[error("{path}: cannot build shard {range}: {why}")]
    BadRange { path: PathBuf, range: LayerRange, why: String },
    /// Reading the source or writing the shard failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ShardError + '_ {
    move |source| ShardError::Io { path: path.to_owned(), source }
}

/// The unit of transfer and verification of a shard: 1 MiB keeps the manifest of a
/// 40 GB shard near 3 MB and the data re-sent after a cut small.
pub const CHUNK_BYTES: u64 = 1 << 20;

/// The content hash of a source model: BLAKE3 of the whole GGUF file. Together with a
/// layer range and [`SHARD_FORMAT`] it names a shard across nodes (paths do not).
/// Written as 64 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct SourceHash(pub [u8; 32]);

impl SourceHash {
    /// Hash the whole file at `path` (streamed; the catalog keeps the result).
    pub fn of_file(path: &Path) -> Result<SourceHash, ShardError> {
        let file = File::open(path).map_err(io_err(path))?;
        let mut h = blake3::Hasher::new();
        h.update_reader(file).map_err(io_err(path))?;
        Ok(SourceHash(*h.finalize().as_bytes()))
    }

    /// The hex form (64 digits).
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl std::fmt::Display for SourceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for SourceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SourceHash({})", &self.to_hex()[..16])
    }
}

impl std::str::FromStr for SourceHash {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        blake3::Hash::from_hex(s).map(|h| SourceHash(*h.as_bytes())).map_err(|_| format!("{s:?} is not a BLAKE3 hash"))
    }
}

impl From<SourceHash> for String {
    fn from(h: SourceHash) -> String {
        h.to_hex()
    }
}

impl TryFrom<String> for SourceHash {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// One chunk of a shard as its manifest records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Chunk {
    /// All zeros: sent as a marker, kept as a hole of a sparse file.
    Hole,
    /// BLAKE3 of the chunk's bytes.
    Data(blake3::Hash),
}

impl From<Chunk> for String {
    fn from(c: Chunk) -> String {
        match c {
            Chunk::Hole => "hole".to_string(),
            Chunk::Data(h) => h.to_hex().to_string(),
        }
    }
}

impl TryFrom<String> for Chunk {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        if s == "hole" {
            return Ok(Chunk::Hole);
        }
        blake3::Hash::from_hex(&s)
            .map(Chunk::Data)
            .map_err(|_| format!("chunk {s:?} is neither \"hole\" nor a BLAKE3 hash"))
    }
}

/// Written next to a shard (`<shard>.json`) once the shard is complete and synced.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    /// [`SHARD_FORMAT`] it was written with.
    pub format: u32,
    /// The source layers it holds.
    pub layers: LayerRange,
    /// Its size in bytes.
    pub bytes: u64,
    /// BLAKE3 of the whole file, hex.
    pub blake3: String,
    /// The content hash of the source it was cut from, where the builder knew it
    /// (shards built from a path alone do not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceHash>,
    /// Bytes per chunk ([`CHUNK_BYTES`]); 0 in manifests written before chunks existed.
    #[serde(default)]
    pub chunk_bytes: u64,
    /// One entry per chunk, in file order; the last chunk may be short.
    #[serde(default)]
    pub chunks: Vec<Chunk>,
}

/// The most chunks a manifest may list: a 256 GiB shard at [`CHUNK_BYTES`]. Bounds
/// what a manifest from another node can make us allocate.
pub const MAX_CHUNKS: u64 = 1 << 18;

impl Manifest {
    /// The byte range `(offset, len)` of chunk `i`, if it exists.
    pub fn chunk_span(&self, i: usize) -> Option<(u64, u64)> {
        let offset = (i as u64).checked_mul(self.chunk_bytes)?;
        if i >= self.chunks.len() || offset >= self.bytes {
            return None;
        }
        Some((offset, self.chunk_bytes.min(self.bytes - offset)))
    }

    /// Bytes of the chunks that are not holes: what a transfer of the whole shard sends.
    pub fn data_bytes(&self) -> u64 {
        (0..self.chunks.len())
            .filter(|&i| self.chunks[i] != Chunk::Hole)
            .filter_map(|i| self.chunk_span(i))
            .map(|(_, len)| len)
            .sum()
    }

    /// Is it internally consistent, with chunk hashes (a manifest from another node, or
    /// an old one without chunks, may not be)? `Err` says what is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.format != SHARD_FORMAT {
            return Err(format!("shard format {} (this build writes {SHARD_FORMAT})", self.format));
        }
        if self.layers.is_empty() {
            return Err(format!("empty layer range {}", self.layers));
        }
        if blake3::Hash::from_hex(&self.blake3).is_err() {
            return Err("its file hash is not a BLAKE3 hash".into());
        }
        if self.chunk_bytes != CHUNK_BYTES {
            return Err(format!("chunks of {} bytes (expected {CHUNK_BYTES})", self.chunk_bytes));
        }
        let n = self.bytes.div_ceil(self.chunk_bytes);
        if n > MAX_CHUNKS {
            return Err(format!("{} bytes is more than a shard may hold", self.bytes));
        }
        if self.chunks.len() as u64 != n {
            return Err(format!("{} chunk entries for {} bytes (expected {n})", self.chunks.len(), self.bytes));
        }
        Ok(())
    }
}

/// Which non-layer tensors a stage reads, and so which must hold real bytes; the
/// others become zero-filled holes (sparse on disk) that llama.cpp's loader requires
/// but never reads. Keep in step with [`ModelMeta::stage_weight_bytes`].
fn needs_tensor(name: &str, meta: &ModelMeta, range: LayerRange) -> bool {
    let first = range.start == 0;
    let tail = range.end == meta.n_layer;
    match name {
        "token_embd.weight" => first || (tail && meta.tied_embeddings),
        "output.weight" => tail,
        _ => true,
    }
}

/// Write the shard for `range` of the source `src` (already parsed) to `dest`,
/// atomically. Returns its manifest (also written to `<dest>.json`).
pub fn write_shard(src: &Gguf, meta: &ModelMeta, range: LayerRange, dest: &Path) -> Result<Manifest, ShardError> {
    write_shard_of(src, meta, range, dest, None)
}

/// [`write_shard`], recording `source` (the content hash of the file `src` was read
/// from, which the caller vouches for) in the manifest.
pub fn write_shard_of(
    src: &Gguf,
    meta: &ModelMeta,
    range: LayerRange,
    dest: &Path,
    source: Option<SourceHash>,
) -> Result<Manifest, ShardError> {
    let bad_range = |why: String| ShardError::BadRange { path: src.path.clone(), range, why };
    if range.is_empty() || range.end > meta.n_layer {
        return Err(bad_range(format!("the model has layers 0..{}", meta.n_layer)));
    }
    let period = meta.layer_period();
    if !range.start.is_multiple_of(period) || (!range.end.is_multiple_of(period) && range.end != meta.n_layer) {
        return Err(bad_range(format!(
            "{} derives per-layer behaviour with a period of {period}: boundaries must be multiples of {period}",
            meta.arch.name()
        )));
    }

    if meta.refused_stage_layers.contains(&range.len()) {
        return Err(bad_range(format!(
            "llama.cpp would take a {} model of {} layers for another variant (see ModelMeta::refused_stage_layers)",
            meta.arch.name(),
            range.len()
        )));
    }

    // Metadata: everything copied; counts and per-layer arrays cut to the range.
    let prefix = format!("{}.", meta.arch.name());
    let n_layer_all = meta.n_layer + meta.nextn_layers;
    let integer = |k: &str, v: &Value, n: u64| {
        Value::integer_as(n, v.value_type()).ok_or_else(|| bad_range(format!("{k} has a non-integer type")))
    };
    let mut metadata = Vec::with_capacity(src.metadata.len() + 2);
    for (k, v) in &src.metadata {
        let key = k.strip_prefix(&prefix);
        let v = match (key, v) {
            (Some("block_count"), _) => integer(k, v, u64::from(range.len()))?,
            // The next-token-prediction blocks stay out of every shard.
            (Some("nextn_predict_layers"), _) => integer(k, v, 0)?,
            // Dense layers lead the stack (DeepSeek): as many as the range still has.
            (Some("leading_dense_block_count"), _) => {
                let lead = v.as_u64().ok_or_else(|| bad_range(format!("{k} has a non-integer type")))?;
                integer(k, v, lead.saturating_sub(u64::from(range.start)).min(u64::from(range.len())))?
            }
            (Some(_), Value::Array(ty, items))
                if items.len() == meta.n_layer as usize || items.len() == n_layer_all as usize =>
            {
                Value::Array(*ty, items[range.start as usize..range.end as usize].to_vec())
            }
            _ => v.clone(),
        };
        metadata.push((k.clone(), v));
    }
    if meta.arch == Arch::DeepSeek2 && !metadata.iter().any(|(k, _)| *k == format!("{prefix}attention.q_lora_rank")) {
        // A "lite" model (no low-rank query), which llama.cpp recognises by its layer
        // count: a shard of another size says it outright.
        metadata.push((format!("{prefix}attention.q_lora_rank"), Value::U32(0)));
    }
    if !meta.swa_layers.is_empty() {
        // The range's own sliding-window pattern, which llama.cpp reads before any
        // period: with it, a shard's layer 0 keeps the kind it had in the model, so
        // the architecture's pattern does not constrain where stages start.
        let kinds = &meta.swa_layers[range.start as usize..range.end as usize];
        let pattern = format!("{prefix}attention.sliding_window_pattern");
        metadata.retain(|(k, _)| *k != pattern);
        if kinds.contains(&true) {
            metadata.push((pattern, Value::Array(ValueType::Bool, kinds.iter().map(|&b| Value::Bool(b)).collect())));
        } else if meta.arch == Arch::Gemma3 {
            // Only full-attention layers: llama.cpp insists that a model with a
            // sliding window has a sliding layer, so this shard has no window (its
            // layers compute as they did; Gemma 3's graph has a variant without one).
            let window = format!("{prefix}attention.sliding_window");
            for (k, v) in metadata.iter_mut().filter(|(k, _)| *k == window) {
                *v = Value::integer_as(0, v.value_type()).ok_or_else(|| bad_range(format!("{k} is not an integer")))?;
            }
        } else {
            return Err(bad_range(format!(
                "{} needs a sliding-window layer in every stage, and layers {range} have none",
                meta.arch.name()
            )));
        }
    }
    metadata.push((
        KEY_SOURCE_LAYERS.to_string(),
        Value::Array(ValueType::U32, vec![Value::U32(range.start), Value::U32(range.end)]),
    ));

    // Tensor table: the range's blocks renumbered, plus every non-layer tensor.
    struct Plan<'a> {
        src: &'a TensorInfo,
        hole: bool,
    }
    let mut plan = Vec::new();
    let mut tensors = Vec::new();
    let mut offset = 0u64;
    for t in &src.tensors {
        let name = match t.layer() {
            Some((i, rest)) if range.contains(i) => format!("blk.{}.{rest}", i - range.start),
            Some(_) => continue,
            None => t.name.clone(),
        };
        tensors.push(TensorInfo { name, offset, ..t.clone() });
        plan.push(Plan { src: t, hole: !needs_tensor(&t.name, meta, range) });
        offset = align(offset + t.bytes, src.alignment);
    }

    let dir = dest.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tmp = temp_path(dest);
    let result = (|| {
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).map_err(io_err(&tmp))?;
        let mut hasher = blake3::Hasher::new();
        let mut chunks = Chunker::default();
        let mut out =
            HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hasher: &mut hasher, chunks: &mut chunks };
        let header_len = write_header(&mut out, &metadata, &tensors, src.alignment).map_err(io_err(&tmp))?;
        let mut input = File::open(&src.path).map_err(io_err(&src.path))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut written = 0u64;
        for (p, t) in plan.iter().zip(&tensors) {
            out.pad_to(t.offset - written).map_err(io_err(&tmp))?;
            written = t.offset;
            if p.hole {
                out.hole(t.bytes).map_err(io_err(&tmp))?;
            } else {
                input.seek(SeekFrom::Start(src.file_offset(p.src))).map_err(io_err(&src.path))?;
                let mut left = t.bytes;
                while left > 0 {
                    let n = left.min(buf.len() as u64) as usize;
                    input.read_exact(&mut buf[..n]).map_err(io_err(&src.path))?;
                    out.write_all(&buf[..n]).map_err(io_err(&tmp))?;
                    left -= n as u64;
                }
            }
            written += t.bytes;
        }
        let total = header_len + written;
        let file = out.finish().map_err(io_err(&tmp))?;
        // A trailing hole is not a byte written: fix the length explicitly.
        file.set_len(total).map_err(io_err(&tmp))?;
        file.sync_all().map_err(io_err(&tmp))?;
        Ok::<_, ShardError>(Manifest {
            format: SHARD_FORMAT,
            layers: range,
            bytes: total,
            blake3: hasher.finalize().to_hex().to_string(),
            source,
            chunk_bytes: CHUNK_BYTES,
            chunks: chunks.finish(),
        })
    })();
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    // The manifest goes last: a shard without one (or with a stale one) is rebuilt.
    let _ = fs::remove_file(manifest_path(dest));
    fs::rename(&tmp, dest).map_err(io_err(dest))?;
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io_err(dest)(io::Error::other(e)))?;
    write_atomic(&manifest_path(dest), &json)?;
    sync_dir(dir);
    Ok(manifest)
}

/// Does the file at `path` match `manifest` (size and BLAKE3)?
pub fn verify(path: &Path, manifest: &Manifest) -> Result<bool, ShardError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(path)(e)),
    };
    if file.metadata().map_err(io_err(path))?.len() != manifest.bytes {
        return Ok(false);
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(file).map_err(io_err(path))?;
    Ok(hasher.finalize().to_hex().as_str() == manifest.blake3)
}

/// A directory of shards, keyed by source file identity and layer range.
#[derive(Clone, Debug)]
pub struct ShardCache {
    /// Root of the cache; one sub-directory per source model.
    dir: PathBuf,
}

/// A shard ready to load.
#[derive(Clone, Debug)]
pub struct ShardFile {
    /// The GGUF to hand to llama.cpp.
    pub path: PathBuf,
    /// Layers of the source model it holds.
    pub layers: LayerRange,
    /// True when it was (re)built by this call rather than found valid in the cache.
    pub built: bool,
}

impl ShardCache {
    /// A cache rooted at `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The cache's root directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the shard of `range` of `source` lives (whether or not it exists yet).
    /// The key covers the source's path, size and modification time, so a changed
    /// source never matches an old shard.
    pub fn shard_path(&self, source: &Path, range: LayerRange) -> Result<PathBuf, ShardError> {
        let md = fs::metadata(source).map_err(io_err(source))?;
        let mtime = md.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        let abs = fs::canonicalize(source).map_err(io_err(source))?;
        let mut h = blake3::Hasher::new();
        h.update(abs.as_os_str().as_encoded_bytes());
        h.update(&md.len().to_le_bytes());
        h.update(&mtime.to_le_bytes());
        h.update(&SHARD_FORMAT.to_le_bytes());
        let key = &h.finalize().to_hex()[..16];
        let stem = source.file_stem().map_or("model".into(), |s| s.to_string_lossy());
        Ok(self.dir.join(format!("{stem}-{key}")).join(format!("layers-{}-{}.gguf", range.start, range.end)))
    }

    /// Return a verified shard for `range` of `source`, building it if it is missing,
    /// torn or corrupted. The whole model (`0..n_layer`) is the source file itself.
    pub fn get_or_build(
        &self,
        source: &Path,
        src: &Gguf,
        meta: &ModelMeta,
        range: LayerRange,
    ) -> Result<ShardFile, ShardError> {
        if range == LayerRange::new(0, meta.n_layer) {
            return Ok(ShardFile { path: source.to_owned(), layers: range, built: false });
        }
        // Validate the range against the architecture before touching the disk.
        check_range(source, meta, range)?;
        let path = self.shard_path(source, range)?;
        if let Some(manifest) = read_manifest(&path) {
            if manifest.format == SHARD_FORMAT && manifest.layers == range && verify(&path, &manifest)? {
                return Ok(ShardFile { path, layers: range, built: false });
            }
            tracing::warn!(path = %path.display(), "cached shard failed verification; rebuilding");
        }
        write_shard(src, meta, range, &path)?;
        Ok(ShardFile { path, layers: range, built: true })
    }
}

/// Shards keyed by content: what nodes exchange.
impl ShardCache {
    /// Where the shard of `range` of the source whose content hash is `source` lives
    /// (whether or not it exists yet): `<dir>/blake3-<source>/layers-<a>-<b>.f<format>.gguf`.
    pub fn content_path(&self, source: &SourceHash, range: LayerRange) -> PathBuf {
        self.dir
            .join(format!("blake3-{}", source.to_hex()))
            .join(format!("layers-{}-{}.f{SHARD_FORMAT}.gguf", range.start, range.end))
    }

    /// The manifest of the content-keyed shard of `range` of `source` if one is there,
    /// consistent, with chunk hashes, for this source and range, and the file has its
    /// size. The file's hash is *not* checked (a whole read): a server streams the file
    /// and its receiver checks every chunk; a local user calls [`ShardCache::cached`].
    pub fn content_manifest(&self, source: &SourceHash, range: LayerRange) -> Option<Manifest> {
        let path = self.content_path(source, range);
        let m = read_manifest(&path)?;
        let len = fs::metadata(&path).ok()?.len();
        (m.check().is_ok() && m.layers == range && m.source == Some(*source) && len == m.bytes).then_some(m)
    }

    /// The content-keyed shard of `range` of `source`, if it is cached and its whole
    /// file matches its manifest.
    pub fn cached(&self, source: &SourceHash, range: LayerRange) -> Result<Option<(ShardFile, Manifest)>, ShardError> {
        let Some(m) = self.content_manifest(source, range) else { return Ok(None) };
        let path = self.content_path(source, range);
        if !verify(&path, &m)? {
            tracing::warn!(path = %path.display(), "cached shard failed verification");
            return Ok(None);
        }
        Ok(Some((ShardFile { path, layers: range, built: false }, m)))
    }

    /// The content-keyed shard of `range` of the model at `model`, whose content hash
    /// the caller vouches is `source`: reused when cached and verified, built otherwise.
    /// Blocking (reads the source; runs for seconds on a large model).
    pub fn build_for(
        &self,
        source: &SourceHash,
        model: &Path,
        range: LayerRange,
    ) -> Result<(ShardFile, Manifest), ShardError> {
        if let Some(hit) = self.cached(source, range)? {
            return Ok(hit);
        }
        let (g, meta) = crate::open_model(model)?;
        check_range(model, &meta, range)?;
        let path = self.content_path(source, range);
        let m = write_shard_of(&g, &meta, range, &path, Some(*source))?;
        Ok((ShardFile { path, layers: range, built: true }, m))
    }
}

/// Is `range` a part of the model that a shard can hold (inside it, on the period)?
fn check_range(model: &Path, meta: &ModelMeta, range: LayerRange) -> Result<(), ShardError> {
    if range == LayerRange::new(0, meta.n_layer) {
        return Ok(());
    }
    let points: Vec<u32> = [range.start, range.end].into_iter().filter(|&p| p != 0 && p != meta.n_layer).collect();
    split_ranges(meta.n_layer, &points, meta.layer_period(), meta.arch.name()).map_err(|e| ShardError::BadRange {
        path: model.to_owned(),
        range,
        why: e.to_string(),
    })?;
    Ok(())
}

/// Make the complete, synced file `part` the shard at `dest` described by `manifest`,
/// the way [`write_shard`] finishes one: any old manifest removed, the file renamed,
/// then the manifest written (so a shard is never described before it is whole).
/// The caller has checked the file against the manifest.
pub fn install(part: &Path, dest: &Path, manifest: &Manifest) -> Result<(), ShardError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let _ = fs::remove_file(manifest_path(dest));
    fs::rename(part, dest).map_err(io_err(dest))?;
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| io_err(dest)(io::Error::other(e)))?;
    write_atomic(&manifest_path(dest), &json)?;
    sync_dir(dir);
    Ok(())
}

/// The manifest of the shard at `shard`, if it exists and parses.
pub fn read_manifest(shard: &Path) -> Option<Manifest> {
    serde_json::from_slice(&fs::read(manifest_path(shard)).ok()?).ok()
}

/// `<shard>.json`.
pub fn manifest_path(shard: &Path) -> PathBuf {
    let mut p = shard.as_os_str().to_owned();
    p.push(".json");
    PathBuf::from(p)
}

/// A unique temporary name beside `dest`; never loaded, removed on failure.
fn temp_path(dest: &Path) -> PathBuf {
    let mut p = dest.as_os_str().to_owned();
    p.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(p)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ShardError> {
    let tmp = temp_path(path);
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

/// Make renames in `dir` durable (best effort: not every platform can open a directory).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Hashes a file's content chunk by chunk as it is written, flagging chunks of zeros.
#[derive(Default)]
struct Chunker {
    current: blake3::Hasher,
    /// Bytes of the current chunk so far.
    filled: u64,
    /// Every byte of the current chunk so far was zero.
    zero: bool,
    done: Vec<Chunk>,
}

impl Chunker {
    fn update(&mut self, mut buf: &[u8]) {
        while !buf.is_empty() {
            if self.filled == 0 {
                self.zero = true;
            }
            let k = (CHUNK_BYTES - self.filled).min(buf.len() as u64) as usize;
            let (part, rest) = buf.split_at(k);
            // `all` stops at the first non-zero byte: data chunks cost one compare.
            self.zero = self.zero && part.iter().all(|&b| b == 0);
            self.current.update(part);
            self.filled += k as u64;
            buf = rest;
            if self.filled == CHUNK_BYTES {
                self.close();
            }
        }
    }

    /// `n` zero bytes (a hole); whole chunks of them are recorded without hashing.
    fn zeros(&mut self, mut n: u64) {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        while n > 0 {
            if self.filled == 0 && n >= CHUNK_BYTES {
                self.done.push(Chunk::Hole);
                n -= CHUNK_BYTES;
                continue;
            }
            let k = n.min(ZEROS.len() as u64).min(CHUNK_BYTES - self.filled);
            self.update(&ZEROS[..k as usize]);
            n -= k;
        }
    }

    fn close(&mut self) {
        let chunk = if self.zero { Chunk::Hole } else { Chunk::Data(self.current.finalize()) };
        self.done.push(chunk);
        self.current.reset();
        self.filled = 0;
    }

    fn finish(mut self) -> Vec<Chunk> {
        if self.filled > 0 {
            self.close();
        }
        self.done
    }
}

/// Writes through to a file while hashing every byte of the file's final content,
/// holes (zeros) included, as a whole and per chunk.
struct HashingWriter<'h> {
    inner: BufWriter<File>,
    hasher: &'h mut blake3::Hasher,
    chunks: &'h mut Chunker,
}

impl HashingWriter<'_> {
    /// `n` zero bytes of alignment padding.
    fn pad_to(&mut self, n: u64) -> io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        let mut left = n;
        while left > 0 {
            let k = left.min(64) as usize;
            self.write_all(&ZEROS[..k])?;
            left -= k as u64;
        }
        Ok(())
    }

    /// Skip `n` bytes, leaving a hole that reads as zeros.
    fn hole(&mut self, n: u64) -> io::Result<()> {
        self.inner.flush()?;
        self.inner.get_mut().seek(SeekFrom::Current(n as i64))?;
        let zeros = vec![0u8; n.min(1 << 20) as usize];
        let mut left = n;
        while left > 0 {
            let k = left.min(zeros.len() as u64) as usize;
            self.hasher.update(&zeros[..k]);
            left -= k as u64;
        }
        self.chunks.zeros(n);
        Ok(())
    }

    fn finish(self) -> io::Result<File> {
        self.inner.into_inner().map_err(|e| e.into_error())
    }
}

impl Write for HashingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.chunks.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
