//! Describing a model file for the catalog (validate it, hash all of it, read its
//! facts) and checking, before it is served, that it is still the file that was added.

use shoal_gguf::{GgufError, Value};
use shoal_types::{CatalogEntry, Holder, NodeId};
use std::collections::BTreeMap;
use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// Bytes read per step while hashing: large enough that syscalls cost nothing next to
/// BLAKE3, small enough that hashing a 40 GB model holds 1 MiB of it at a time.
const HASH_CHUNK: usize = 1 << 20;

/// Why a file cannot be (or can no longer be) a catalog model. Every variant names the
/// file; the text says what is wrong and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The file (or its metadata) could not be read.
    #[error("{path}: cannot read it: {source}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// Not a GGUF file at all (no `GGUF` magic): a safetensors file, an HTML error
    /// page saved by a download, a shard of something else.
    #[error("{path}: not a GGUF file ({what})")]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// What was found instead.
        what: String,
    },
    /// A GGUF file that ends before its header or tensors do: an interrupted copy or
    /// download.
    #[error("{path}: truncated GGUF ({what}); the copy or download was probably cut short")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What is missing.
        what: String,
    },
    /// A GGUF whose header is malformed.
    #[error("{path}: malformed GGUF: {what}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        what: String,
    },
    /// Well-formed, but an architecture (or GGUF version) Shoal has not verified.
    #[error("{path}: unsupported: {what}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is unsupported.
        what: String,
    },
    /// Well-formed GGUF, but not a model llama.cpp could load (missing tensors or keys).
    #[error("{path}: not a usable model: {what}")]
    NotAModel {
        /// The file.
        path: PathBuf,
        /// What is missing.
        what: String,
    },
    /// The path is not UTF-8, so it cannot be recorded in the cluster state (JSON).
    #[error("{path}: the path is not valid UTF-8; rename or move the file")]
    NonUtf8Path {
        /// The file.
        path: PathBuf,
    },
    /// The file changed while it was being hashed: its size or time moved under us.
    #[error("{path}: the file changed while it was being read (a copy or download still in progress?); try again once it is complete")]
    ChangedWhileReading {
        /// The file.
        path: PathBuf,
    },
    /// The file is no longer what was added to the catalog: it is refused, never
    /// served, until it is added again.
    #[error("{path}: the file changed since it was added to the catalog as {name:?} ({what}); it will not be served. If the new file is wanted, add it to the catalog again (remove the old entry first)")]
    Changed {
        /// The file.
        path: PathBuf,
        /// The catalog name it was added as.
        name: String,
        /// What differs (size, content hash).
        what: String,
    },
}

impl CatalogError {
    fn unreadable(path: &Path, source: io::Error) -> Self {
        CatalogError::Unreadable { path: path.to_owned(), source }
    }
}

impl From<GgufError> for CatalogError {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io { path, source } => CatalogError::Unreadable { path, source },
            GgufError::Truncated { path, what } => CatalogError::Truncated { path, what },
            GgufError::Invalid { path, offset, what } => {
                CatalogError::Malformed { path, what: format!("at byte {offset}: {what}") }
            }
            GgufError::Unsupported { path, what } => CatalogError::Unsupported { path, what },
            GgufError::Model { path, what } => CatalogError::NotAModel { path, what },
        }
    }
}

/// A described model file: its catalog entry (named after the file, with no holders
/// yet) and this node's [`Holder`] record of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// The entry; `name` is the file's name until the caller picks another, and
    /// `holders` is empty (the node id is the caller's).
    pub entry: CatalogEntry,
    /// Where this node holds it and what the file looked like when hashed.
    pub holder: Holder,
}

impl Described {
    /// The entry with `node` as its holder.
    pub fn into_entry(self, node: NodeId) -> CatalogEntry {
        let mut entry = self.entry;
        entry.holders.insert(node, self.holder);
        entry
    }
}

/// What [`check_unchanged`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verified {
    /// Same size and modification time as recorded: trusted without reading it.
    Unchanged,
    /// The time (only) moved, and a full re-hash matched the entry: the same bytes.
    /// The caller should record the new holder so the next check is fast again.
    Rehashed(Holder),
}

/// Validate the GGUF at `path` (refusing architectures Shoal cannot run), hash all of
/// it, and describe it for the catalog. Reads the whole file once, 1 MiB at a time.
pub fn describe(path: &Path) -> Result<Described, CatalogError> {
    describe_with_progress(path, &mut |_, _| {})
}

/// [`describe`], calling `progress(hashed, total)` as the hash advances (a 40 GB model
/// takes tens of seconds to hash).
pub fn describe_with_progress(path: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Described, CatalogError> {
    // Absolute, not canonical: the node may run in another directory than the CLI, and
    // a symlink the user chose (a Hugging Face snapshot) stays the name they know.
    let path = std::path::absolute(path).map_err(|e| CatalogError::unreadable(path, e))?;
    let path_str = path.to_str().ok_or_else(|| CatalogError::NonUtf8Path { path: path.clone() })?.to_owned();
    let mut file = File::open(&path).map_err(|e| CatalogError::unreadable(&path, e))?;
    let before = file.metadata().map_err(|e| CatalogError::unreadable(&path, e))?;
    if !before.is_file() {
        return Err(CatalogError::NotGguf { path, what: "not a regular file".into() });
    }
    check_magic(&mut file, &path)?;
    let (gguf, meta) = open_model(&path, before.len())?;
    let quantisation = quantisation(&gguf);

    let (hash, hashed) =
        hash_reader(&mut file, before.len(), progress).map_err(|e| CatalogError::unreadable(&path, e))?;
    let after = std::fs::metadata(&path).map_err(|e| CatalogError::unreadable(&path, e))?;
    // The header was parsed and the bytes hashed through different reads: only a file
    // that kept its size and time throughout is known to be the one described.
    if hashed != before.len() || after.len() != before.len() || mtime_ns(&after) != mtime_ns(&before) {
        return Err(CatalogError::ChangedWhileReading { path });
    }
    let header_hash = header_hash(&mut file, gguf.data_offset).map_err(|e| CatalogError::unreadable(&path, e))?;
    let name = path.file_name().map_or_else(|| path_str.clone(), |n| n.to_string_lossy().into_owned());
    let entry = CatalogEntry {
        name,
        content_hash: hash,
        size: before.len(),
        arch: meta.arch.name().to_owned(),
        n_layer: meta.n_layer,
        context_length: meta.n_ctx_train,
        quantisation,
        layer_period: meta.layer_period(),
        holders: BTreeMap::new(),
        header_hash: Some(header_hash),
    };
    let holder = Holder { path: path_str, size: before.len(), mtime_ns: mtime_ns(&before) };
    Ok(Described { entry, holder })
}

/// Before serving `holder`'s copy of `entry`: is the file still the one added?
///
/// Same size and modification time: yes, without reading it (re-hashing 40 GB on every
/// load would take minutes). Another size: no. Same size, another time: the whole file
/// is re-hashed, and only the entry's hash lets it through. A changed file is an error
/// ([`CatalogError::Changed`]), never a file to serve.
///
/// Like git's index, the fast path trusts the file system's timestamps: a rewrite of the
/// same size within the timestamp's granularity that also restores the time goes
/// unnoticed until the next full check.
pub fn check_unchanged(entry: &CatalogEntry, holder: &Holder) -> Result<Verified, CatalogError> {
    let path = Path::new(&holder.path);
    let changed = |what: String| CatalogError::Changed { path: path.to_owned(), name: entry.name.clone(), what };
    let meta = std::fs::metadata(path).map_err(|e| CatalogError::unreadable(path, e))?;
    if meta.len() != holder.size {
        return Err(changed(format!("size {} bytes, was {}", meta.len(), holder.size)));
    }
    if mtime_ns(&meta) == holder.mtime_ns {
        return Ok(Verified::Unchanged);
    }
    let mut file = File::open(path).map_err(|e| CatalogError::unreadable(path, e))?;
    let (hash, hashed) =
        hash_reader(&mut file, meta.len(), &mut |_, _| {}).map_err(|e| CatalogError::unreadable(path, e))?;
    if hashed != holder.size {
        return Err(changed(format!("size {hashed} bytes while hashing, was {}", holder.size)));
    }
    if hash != entry.content_hash {
        return Err(changed(format!("content hash {hash}, was {}", entry.content_hash)));
    }
    Ok(Verified::Rehashed(Holder { path: holder.path.clone(), size: meta.len(), mtime_ns: mtime_ns(&meta) }))
}

/// BLAKE3 (hex) of the whole file at `path`, read 1 MiB at a time.
pub fn hash_file(path: &Path) -> Result<String, CatalogError> {
    let mut file = File::open(path).map_err(|e| CatalogError::unreadable(path, e))?;
    let len = file.metadata().map_err(|e| CatalogError::unreadable(path, e))?.len();
    Ok(hash_reader(&mut file, len, &mut |_, _| {}).map_err(|e| CatalogError::unreadable(path, e))?.0)
}

/// Hash everything `r` yields; returns the hex hash and the bytes read.
/// BLAKE3 of the first `len` bytes of `file` (its header: see
/// [`CatalogEntry::header_hash`]), hex.
fn header_hash(file: &mut File, len: u64) -> io::Result<String> {
    use std::io::Seek;
    file.seek(io::SeekFrom::Start(0))?;
    let mut hasher = blake3::Hasher::new();
    let copied = io::copy(&mut Read::by_ref(file).take(len), &mut hasher)?;
    if copied != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ends inside its header"));
    }
    Ok(hasher.finalize().to_hex().to_string())
}

fn hash_reader(r: &mut impl Read, total: u64, progress: &mut dyn FnMut(u64, u64)) -> io::Result<(String, u64)> {
    // From the start whatever was read before (the magic check).
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; HASH_CHUNK];
    let mut done = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        done += n as u64;
        progress(done, total);
    }
    Ok((hasher.finalize().to_hex().to_string(), done))
}

/// `shoal_gguf::open_model`, telling a truncated file from a malformed one: the reader
/// calls a header whose sizes run past the end of the file invalid (it cannot know
/// which part lies), so such a header is parsed again as if the file were long enough.
/// If it then parses (or runs into the real end of the file), the header is consistent
/// and the file is merely short: an interrupted copy or download.
fn open_model(path: &Path, len: u64) -> Result<(shoal_gguf::Gguf, shoal_gguf::ModelMeta), CatalogError> {
    /// Long enough for any model; the reader's memory budget stays capped
    /// (`MAX_HEADER_MEMORY`) whatever length it is told.
    const AS_IF_LONG: u64 = 1 << 50;
    match shoal_gguf::open_model(path) {
        Err(GgufError::Invalid { path: p, offset, what }) => {
            let file = File::open(path).map_err(|e| CatalogError::unreadable(path, e))?;
            let reader = io::BufReader::with_capacity(1 << 20, file);
            match shoal_gguf::Gguf::parse(reader, AS_IF_LONG, path) {
                Ok(g) => {
                    let needed = g.tensors.last().map_or(g.data_offset, |t| g.file_offset(t).saturating_add(t.bytes));
                    Err(CatalogError::Truncated {
                        path: p,
                        what: format!("the file has {len} bytes, its tensors need {needed}"),
                    })
                }
                Err(GgufError::Truncated { what, .. }) => Err(CatalogError::Truncated { path: p, what }),
                Err(_) => Err(CatalogError::Malformed { path: p, what: format!("at byte {offset}: {what}") }),
            }
        }
        other => Ok(other?),
    }
}

/// Refuse a file that does not start with `GGUF`, before the header reader gives a
/// less direct reason; leaves the file at offset 0.
fn check_magic(file: &mut File, path: &Path) -> Result<(), CatalogError> {
    use std::io::{Seek, SeekFrom};
    let mut magic = Vec::with_capacity(4);
    file.by_ref().take(4).read_to_end(&mut magic).map_err(|e| CatalogError::unreadable(path, e))?;
    file.seek(SeekFrom::Start(0)).map_err(|e| CatalogError::unreadable(path, e))?;
    if magic.as_slice() == b"GGUF" {
        return Ok(());
    }
    let what = if magic.is_empty() {
        "the file is empty".to_owned()
    } else if magic.len() < 4 {
        format!("only {} bytes", magic.len())
    } else {
        format!("starts with {:02x?}, not \"GGUF\"", magic)
    };
    Err(CatalogError::NotGguf { path: path.to_owned(), what })
}

/// Nanoseconds since the Unix epoch of the file's modification time; 0 when the
/// platform has none or it lies before 1970 (then any touch still changes it).
pub fn mtime_ns(meta: &Metadata) -> u64 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The model's quantisation as people name it (`Q4_K_M`): `general.file_type` when the
/// file says, else the tensor type holding most of the bytes.
fn quantisation(g: &shoal_gguf::Gguf) -> String {
    if let Some(name) = g.get("general.file_type").and_then(Value::as_u64).and_then(file_type_name) {
        return name.to_owned();
    }
    let mut by_type: BTreeMap<&str, u64> = BTreeMap::new();
    for t in &g.tensors {
        *by_type.entry(t.ggml_type.name).or_default() += t.bytes;
    }
    // Ties go to the first name in order, so the answer is deterministic.
    let top = by_type.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)));
    top.map_or_else(|| "unknown".to_owned(), |(name, _)| name.to_ascii_uppercase())
}

/// llama.cpp's `llama_ftype` values (llama.h) by their usual short names. Gaps are
/// values llama.cpp removed; they fall back to the dominant tensor type.
fn file_type_name(ftype: u64) -> Option<&'static str> {
    Some(match ftype {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_of_a_reader_is_blake3_of_all_its_bytes_across_chunks() {
        let data: Vec<u8> = (0..(HASH_CHUNK * 2 + 17)).map(|i| (i % 251) as u8).collect();
        let mut seen = Vec::new();
        let (hash, n) = hash_reader(&mut data.as_slice(), data.len() as u64, &mut |d, t| seen.push((d, t))).unwrap();
        assert_eq!(hash, blake3::hash(&data).to_hex().to_string());
        assert_eq!(n, data.len() as u64);
        assert_eq!(seen.last(), Some(&(n, n)));
    }

    #[test]
    fn known_file_types_have_their_llama_cpp_names() {
        assert_eq!(file_type_name(3), Some("Q4_1"));
        assert_eq!(file_type_name(15), Some("Q4_K_M"));
        assert_eq!(file_type_name(33), None, "removed from llama.cpp");
    }
}
