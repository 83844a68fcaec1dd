//! Finding models other tools already keep on disk, to use them in place (never
//! copied): Ollama's store, the Hugging Face hub cache, LM Studio's models folder.
//! A scan only proposes candidates (a suggested name and a path); `describe` decides
//! whether each one is a model Shoal can run. Whatever a scan cannot use (a malformed
//! manifest, a dangling symlink, an unreadable folder) is skipped with its reason:
//! these folders belong to other programs, and nothing in them may stop a scan.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// Largest Ollama manifest read (real ones are under 2 KiB).
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Deepest folder nesting followed inside a Hugging Face snapshot (repos put GGUFs in
/// subfolders such as `Q4_K_M/`; a symlink loop must not recurse forever).
const MAX_SNAPSHOT_DEPTH: usize = 8;
/// Ollama's media type for the model weights layer.
const OLLAMA_MODEL_MEDIA_TYPE: &str = "application/vnd.ollama.image.model";
/// Ollama's default registry: models from it are named without the host.
const OLLAMA_REGISTRY: &str = "registry.ollama.ai";

/// Which store a candidate was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Ollama (`manifests/` + `blobs/`).
    Ollama,
    /// The Hugging Face hub cache (`models--org--repo/snapshots/<rev>/`).
    HfCache,
    /// LM Studio (`<publisher>/<repo>/<file>.gguf`).
    LmStudio,
}

/// A file that looks like a model, with the name the catalog could give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Suggested catalog name: `ollama:<model>:<tag>` (`ollama:<namespace>/<model>:<tag>`
    /// outside the `library` namespace, with the host first for other registries),
    /// `org/repo/path/file.gguf` (`org/repo@rev/…` for a revision other than `main`'s).
    pub name: String,
    /// The file to use in place (for the HF cache: the snapshot's symlink, as people
    /// know it; it resolves into `blobs/`).
    pub path: PathBuf,
    /// Where it was found.
    pub source: Source,
}

/// Why a scan passed over something.
#[derive(Debug, thiserror::Error)]
pub enum SkipReason {
    /// A folder or file could not be read.
    #[error("cannot read it: {0}")]
    Unreadable(io::Error),
    /// An Ollama manifest that is not the JSON Ollama writes.
    #[error("malformed Ollama manifest: {0}")]
    MalformedManifest(String),
    /// An Ollama manifest without a model layer (an adapter or projector only).
    #[error("the manifest names no {OLLAMA_MODEL_MEDIA_TYPE} layer")]
    NoModelLayer,
    /// A digest that is not `sha256:` and 64 hex digits (it becomes a file name, so
    /// nothing else is trusted).
    #[error("digest {0:?} is not sha256:<64 hex digits>")]
    BadDigest(String),
    /// The manifest's blob is not in `blobs/`.
    #[error("blob {0} is missing")]
    MissingBlob(PathBuf),
    /// A symlink whose target does not exist (a cache cleaned by hand).
    #[error("dangling symlink")]
    DanglingSymlink,
    /// One part of a model split over several files (`-00001-of-00003.gguf`), which
    /// Shoal does not read.
    #[error("one part of a multi-file GGUF; merge the parts first (llama-gguf-split --merge)")]
    SplitGguf,
    /// A vision projector (`mmproj-*.gguf`), not a language model.
    #[error("a multimodal projector, not a language model")]
    Projector,
    /// The same file was already proposed under another name.
    #[error("the same file as {0}")]
    SameFileAs(String),
}

/// Something a scan passed over, and why.
#[derive(Debug)]
pub struct Skipped {
    /// What was skipped.
    pub path: PathBuf,
    /// Why.
    pub reason: SkipReason,
}

/// What a scan found.
#[derive(Debug, Default)]
pub struct Scan {
    /// Files to describe and add.
    pub found: Vec<Candidate>,
    /// What was passed over, with reasons (for a `--verbose` listing).
    pub skipped: Vec<Skipped>,
}

impl Scan {
    fn skip(&mut self, path: impl Into<PathBuf>, reason: SkipReason) {
        let path = path.into();
        tracing::debug!(path = %path.display(), %reason, "scan: skipped");
        self.skipped.push(Skipped { path, reason });
    }

    /// Propose `path` unless the same file was proposed already (two Ollama tags of one
    /// blob, one file in two HF revisions): the catalog keys entries by content anyway.
    /// A skip is recorded against `origin`, what named the file (an Ollama manifest).
    fn propose(
        &mut self,
        seen: &mut HashMap<PathBuf, String>,
        name: String,
        path: PathBuf,
        source: Source,
        origin: &Path,
    ) {
        let key = fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if let Some(first) = seen.get(&key) {
            let reason = SkipReason::SameFileAs(first.clone());
            self.skip(origin, reason);
            return;
        }
        seen.insert(key, name.clone());
        self.found.push(Candidate { name, path, source });
    }
}

/// Where Ollama keeps models: `$OLLAMA_MODELS`, else `~/.ollama/models` (every
/// platform) and `/usr/share/ollama/.ollama/models` (the Linux service's user).
/// Only folders that exist are returned.
pub fn ollama_roots() -> Vec<PathBuf> {
    ollama_roots_from(&|k| std::env::var_os(k)).into_iter().filter(|p| p.is_dir()).collect()
}

/// [`ollama_roots`] from the given environment, whether the folders exist or not.
pub fn ollama_roots_from(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    if let Some(dir) = non_empty(env("OLLAMA_MODELS")) {
        return vec![PathBuf::from(dir)];
    }
    let mut roots = Vec::new();
    if let Some(home) = home(env) {
        roots.push(home.join(".ollama").join("models"));
    }
    if cfg!(target_os = "linux") {
        roots.push(PathBuf::from("/usr/share/ollama/.ollama/models"));
    }
    roots
}

/// The Hugging Face hub cache: `$HF_HUB_CACHE` (or the older `$HUGGINGFACE_HUB_CACHE`),
/// else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
/// `~/.cache/huggingface/hub` (on every platform, as `huggingface_hub` does).
pub fn hf_cache_root() -> Option<PathBuf> {
    hf_cache_root_from(&|k| std::env::var_os(k))
}

/// [`hf_cache_root`] from the given environment.
pub fn hf_cache_root_from(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    if let Some(dir) = non_empty(env("HF_HUB_CACHE")).or_else(|| non_empty(env("HUGGINGFACE_HUB_CACHE"))) {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = non_empty(env("HF_HOME")) {
        return Some(PathBuf::from(dir).join("hub"));
    }
    let cache = non_empty(env("XDG_CACHE_HOME")).map(PathBuf::from).or_else(|| home(env).map(|h| h.join(".cache")))?;
    Some(cache.join("huggingface").join("hub"))
}

/// Where LM Studio keeps models: `~/.lmstudio/models`, and the older
/// `~/.cache/lm-studio/models`. Only folders that exist are returned. (A folder chosen
/// in LM Studio's settings is not looked up: pass it to [`scan_lmstudio`].)
pub fn lmstudio_roots() -> Vec<PathBuf> {
    lmstudio_roots_from(&|k| std::env::var_os(k)).into_iter().filter(|p| p.is_dir()).collect()
}

/// [`lmstudio_roots`] from the given environment, whether the folders exist or not.
pub fn lmstudio_roots_from(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    home(env)
        .map(|h| vec![h.join(".lmstudio").join("models"), h.join(".cache").join("lm-studio").join("models")])
        .unwrap_or_default()
}

/// Scan an Ollama models folder: every manifest under
/// `manifests/<registry>/<namespace>/<model>/<tag>` whose model layer's blob
/// (`blobs/sha256-<hex>`) exists.
pub fn scan_ollama(root: &Path) -> Scan {
    let mut scan = Scan::default();
    let mut seen = HashMap::new();
    let manifests = root.join("manifests");
    for (host, host_dir) in subdirs(&mut scan, &manifests) {
        for (namespace, ns_dir) in subdirs(&mut scan, &host_dir) {
            for (model, model_dir) in subdirs(&mut scan, &ns_dir) {
                for (tag, manifest) in entries(&mut scan, &model_dir) {
                    if manifest.is_dir() {
                        continue;
                    }
                    let digest = match ollama_model_digest(&manifest) {
                        Ok(d) => d,
                        Err(reason) => {
                            scan.skip(manifest, reason);
                            continue;
                        }
                    };
                    let blob = root.join("blobs").join(format!("sha256-{digest}"));
                    if !blob.is_file() {
                        scan.skip(manifest, SkipReason::MissingBlob(blob));
                        continue;
                    }
                    let name = match (host.as_str(), namespace.as_str()) {
                        (OLLAMA_REGISTRY, "library") => format!("ollama:{model}:{tag}"),
                        (OLLAMA_REGISTRY, ns) => format!("ollama:{ns}/{model}:{tag}"),
                        (host, ns) => format!("ollama:{host}/{ns}/{model}:{tag}"),
                    };
                    scan.propose(&mut seen, name, blob, Source::Ollama, &manifest);
                }
            }
        }
    }
    scan
}

/// The hex digest of the model layer named by the Ollama manifest at `path`.
fn ollama_model_digest(path: &Path) -> Result<String, SkipReason> {
    #[derive(serde::Deserialize)]
    struct Manifest {
        layers: Vec<Layer>,
    }
    #[derive(serde::Deserialize)]
    struct Layer {
        #[serde(rename = "mediaType")]
        media_type: String,
        digest: String,
    }
    let mut bytes = Vec::new();
    let file = fs::File::open(path).map_err(SkipReason::Unreadable)?;
    file.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut bytes).map_err(SkipReason::Unreadable)?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(SkipReason::MalformedManifest(format!("larger than {MAX_MANIFEST_BYTES} bytes")));
    }
    let manifest: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| SkipReason::MalformedManifest(e.to_string()))?;
    let layer =
        manifest.layers.iter().find(|l| l.media_type == OLLAMA_MODEL_MEDIA_TYPE).ok_or(SkipReason::NoModelLayer)?;
    let hex = layer.digest.strip_prefix("sha256:").unwrap_or("");
    // The digest becomes a path component: exactly 64 hex digits, or it is not used.
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(SkipReason::BadDigest(layer.digest.chars().take(80).collect()));
    }
    Ok(hex.to_ascii_lowercase())
}

/// Scan a Hugging Face hub cache: every `.gguf` under
/// `models--<org>--<repo>/snapshots/<rev>/`, named `org/repo/<path in repo>`. The
/// revision `refs/main` points at is scanned first and named without a revision;
/// others are named `org/repo@<rev>/…`, and a file they share with it is proposed once.
pub fn scan_hf_cache(root: &Path) -> Scan {
    let mut scan = Scan::default();
    let mut seen = HashMap::new();
    for (dir_name, repo_dir) in subdirs(&mut scan, root) {
        // `datasets--…`, `spaces--…`, `.locks` hold no models.
        let Some(repo_id) = dir_name.strip_prefix("models--") else { continue };
        let repo = repo_id.replace("--", "/");
        let main = fs::read_to_string(repo_dir.join("refs").join("main")).ok().map(|s| s.trim().to_owned());
        let mut revisions = subdirs(&mut scan, &repo_dir.join("snapshots"));
        // `main`'s revision first, then the others in name order (already sorted).
        revisions.sort_by_key(|(rev, _)| Some(rev) != main.as_ref());
        for (rev, snapshot) in revisions {
            let prefix = if Some(&rev) == main.as_ref() { repo.clone() } else { format!("{repo}@{rev}") };
            let mut files = Vec::new();
            gguf_files(&mut scan, &snapshot, PathBuf::new(), 0, &mut files);
            for (rel, path) in files {
                let rel = rel.to_string_lossy().replace('\\', "/");
                scan.propose(&mut seen, format!("{prefix}/{rel}"), path.clone(), Source::HfCache, &path);
            }
        }
    }
    scan
}

/// Scan an LM Studio models folder: `<publisher>/<repo>/<file>.gguf`, named
/// `publisher/repo/file.gguf` (the Hugging Face repo it came from, usually).
pub fn scan_lmstudio(root: &Path) -> Scan {
    let mut scan = Scan::default();
    let mut seen = HashMap::new();
    for (publisher, pub_dir) in subdirs(&mut scan, root) {
        for (repo, repo_dir) in subdirs(&mut scan, &pub_dir) {
            for (file, path) in entries(&mut scan, &repo_dir) {
                if let Some(path) = usable_gguf(&mut scan, &file, path) {
                    let name = format!("{publisher}/{repo}/{file}");
                    scan.propose(&mut seen, name, path.clone(), Source::LmStudio, &path);
                }
            }
        }
    }
    scan
}

/// Collect `.gguf` files under `dir` (recursively, to [`MAX_SNAPSHOT_DEPTH`]), with
/// their paths relative to the snapshot.
fn gguf_files(scan: &mut Scan, dir: &Path, rel: PathBuf, depth: usize, out: &mut Vec<(PathBuf, PathBuf)>) {
    for (name, path) in entries(scan, dir) {
        if path.is_dir() {
            if depth < MAX_SNAPSHOT_DEPTH {
                gguf_files(scan, &path, rel.join(&name), depth + 1, out);
            }
        } else if let Some(path) = usable_gguf(scan, &name, path) {
            out.push((rel.join(name), path));
        }
    }
}

/// `path` if it is a `.gguf` file worth describing; a skip with the reason if it is
/// a GGUF that cannot be (dangling, split, projector); `None` for other files.
fn usable_gguf(scan: &mut Scan, name: &str, path: PathBuf) -> Option<PathBuf> {
    let lower = name.to_ascii_lowercase();
    if !lower.ends_with(".gguf") {
        return None;
    }
    match fs::metadata(&path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return None,
        Err(e) if e.kind() == io::ErrorKind::NotFound && fs::symlink_metadata(&path).is_ok() => {
            scan.skip(path, SkipReason::DanglingSymlink);
            return None;
        }
        Err(e) => {
            scan.skip(path, SkipReason::Unreadable(e));
            return None;
        }
    }
    if lower.starts_with("mmproj") {
        scan.skip(path, SkipReason::Projector);
        return None;
    }
    if is_split_part(&lower) {
        scan.skip(path, SkipReason::SplitGguf);
        return None;
    }
    Some(path)
}

/// `…-00001-of-00003.gguf`, llama.cpp's gguf-split naming.
fn is_split_part(lower: &str) -> bool {
    let Some(stem) = lower.strip_suffix(".gguf") else { return false };
    let b = stem.as_bytes();
    // "-NNNNN-of-NNNNN" is 15 bytes.
    b.len() >= 15 && {
        let t = &b[b.len() - 15..];
        t[0] == b'-'
            && t[1..6].iter().all(u8::is_ascii_digit)
            && &t[6..10] == b"-of-"
            && t[10..15].iter().all(u8::is_ascii_digit)
    }
}

/// The entries of `dir` with UTF-8 names, sorted by name (so scans are deterministic);
/// an unreadable folder or entry is skipped with its reason, a non-UTF-8 name silently
/// (it could not be a catalog name), hidden entries (`.locks`, `.DS_Store`) too.
fn entries(scan: &mut Scan, dir: &Path) -> Vec<(String, PathBuf)> {
    let read = match fs::read_dir(dir) {
        Ok(r) => r,
        // A store that is not there (no Ollama installed) is no news.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            scan.skip(dir, SkipReason::Unreadable(e));
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for entry in read {
        match entry {
            Ok(e) => {
                if let Ok(name) = e.file_name().into_string() {
                    if !name.starts_with('.') {
                        out.push((name, e.path()));
                    }
                }
            }
            Err(e) => scan.skip(dir, SkipReason::Unreadable(e)),
        }
    }
    out.sort();
    out
}

/// The subfolders of `dir` (following symlinks), as [`entries`].
fn subdirs(scan: &mut Scan, dir: &Path) -> Vec<(String, PathBuf)> {
    entries(scan, dir).into_iter().filter(|(_, p)| p.is_dir()).collect()
}

fn non_empty(v: Option<OsString>) -> Option<OsString> {
    v.filter(|v| !v.is_empty())
}

/// The user's home: `$HOME`, else `%USERPROFILE%` (Windows).
fn home(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    non_empty(env("HOME")).or_else(|| non_empty(env("USERPROFILE"))).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
    }

    #[test]
    fn hf_cache_root_prefers_hf_hub_cache_then_hf_home_then_xdg_then_home() {
        let all = [("HF_HUB_CACHE", "/a"), ("HF_HOME", "/b"), ("XDG_CACHE_HOME", "/c"), ("HOME", "/h")];
        assert_eq!(hf_cache_root_from(&env(&all)), Some(PathBuf::from("/a")));
        assert_eq!(hf_cache_root_from(&env(&all[1..])), Some(PathBuf::from("/b/hub")));
        assert_eq!(hf_cache_root_from(&env(&all[2..])), Some(PathBuf::from("/c/huggingface/hub")));
        assert_eq!(hf_cache_root_from(&env(&all[3..])), Some(PathBuf::from("/h/.cache/huggingface/hub")));
        assert_eq!(
            hf_cache_root_from(&env(&[("HF_HUB_CACHE", ""), ("HOME", "/h")])),
            Some("/h/.cache/huggingface/hub".into())
        );
        assert_eq!(hf_cache_root_from(&env(&[])), None);
    }

    #[test]
    fn ollama_roots_honour_ollama_models_else_home_and_the_linux_service() {
        assert_eq!(ollama_roots_from(&env(&[("OLLAMA_MODELS", "/m"), ("HOME", "/h")])), vec![PathBuf::from("/m")]);
        let roots = ollama_roots_from(&env(&[("HOME", "/h")]));
        assert_eq!(roots[0], PathBuf::from("/h/.ollama/models"));
        if cfg!(target_os = "linux") {
            assert_eq!(roots[1], PathBuf::from("/usr/share/ollama/.ollama/models"));
        }
        let lm = lmstudio_roots_from(&env(&[("HOME", "/h")]));
        assert_eq!(lm, vec![PathBuf::from("/h/.lmstudio/models"), PathBuf::from("/h/.cache/lm-studio/models")]);
    }

    #[test]
    fn split_parts_are_recognised_by_llama_cpp_naming() {
        assert!(is_split_part("qwen-72b-q4_k_m-00001-of-00003.gguf"));
        assert!(!is_split_part("qwen-72b-q4_k_m.gguf"));
        assert!(!is_split_part("00001-of-00003.gguf"));
    }
}
