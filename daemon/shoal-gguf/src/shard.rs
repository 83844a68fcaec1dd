//! Shard files: a GGUF holding layers `a..b` of a source model renumbered from 0,
//! which stock llama.cpp loads as a small model. Written by streaming tensor bytes
//! (memory use does not grow with the model), to a temporary file that is fsynced and
//! atomically renamed, then described by a manifest carrying its BLAKE3 hash; the cache
//! uses a shard only after re-checking that hash, so a torn or corrupted file is
//! rebuilt, never loaded.

use crate::file::{align, write_header, Gguf, TensorInfo};
use crate::model::ModelMeta;
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

    // Metadata: everything copied; block_count and per-layer arrays cut to the range.
    let prefix = format!("{}.", meta.arch.name());
    let mut metadata = Vec::with_capacity(src.metadata.len() + 1);
    for (k, v) in &src.metadata {
        let v = if *k == format!("{prefix}block_count") {
            Value::integer_as(u64::from(range.len()), v.value_type())
                .ok_or_else(|| bad_range(format!("{k} has a non-integer type")))?
        } else {
            match v {
                Value::Array(ty, items) if k.starts_with(&prefix) && items.len() == meta.n_layer as usize => {
                    Value::Array(*ty, items[range.start as usize..range.end as usize].to_vec())
                }
                _ => v.clone(),
            }
        };
        metadata.push((k.clone(), v));
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
        let mut out = HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hasher: &mut hasher };
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
        let points: Vec<u32> = [range.start, range.end].into_iter().filter(|&p| p != 0 && p != meta.n_layer).collect();
        split_ranges(meta.n_layer, &points, meta.layer_period(), meta.arch.name())
            .map_err(|e| ShardError::BadRange { path: source.to_owned(), range, why: e.to_string() })?;
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

/// Writes through to a file while hashing every byte of the file's final content,
/// holes (zeros) included.
struct HashingWriter<'h> {
    inner: BufWriter<File>,
    hasher: &'h mut blake3::Hasher,
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
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
