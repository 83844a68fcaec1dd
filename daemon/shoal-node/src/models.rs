//! The model catalog as the node serves it: `models add/ls/rm/import` on typed
//! [`CatalogEntry`] values kept in the cluster state under `catalog/<content hash>`.
//! Files are described and hashed on a blocking thread (minutes for a 40 GB model);
//! entries change only through the leader (a `Put` or `Delete` that a majority stores).

use crate::api::{ApiError, CopyState, ErrorKind, ModelRow, NodeResponse, StoreKind};
use shoal_catalog::{CatalogError, Described};
use shoal_membership::node::{Handle, View};
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_net::NodeId;
use shoal_planner::ModelProfile;
use shoal_types::{CatalogEntry, Holder};
use std::path::{Path, PathBuf};

/// The catalog entries of `view`'s state that parse (a malformed one, which no Shoal
/// wrote, is skipped with a warning rather than failing every listing).
pub fn entries(view: &View) -> Vec<CatalogEntry> {
    let Some(state) = &view.state else { return Vec::new() };
    state
        .entries
        .range(CatalogEntry::KEY_PREFIX.to_string()..)
        .take_while(|(k, _)| k.starts_with(CatalogEntry::KEY_PREFIX))
        .filter_map(|(k, v)| match serde_json::from_value::<CatalogEntry>(v.clone()) {
            Ok(e) if e.key() == *k && e.validate().is_ok() => Some(e),
            Ok(_) | Err(_) => {
                tracing::warn!(key = %k, "a catalog entry that does not parse; skipped");
                None
            }
        })
        .collect()
}

/// The entry named `model` (its name, or a unique prefix of at least 8 hex digits of
/// its content hash).
pub fn find<'a>(entries: &'a [CatalogEntry], model: &str) -> Result<&'a CatalogEntry, ApiError> {
    if let Some(e) = entries.iter().find(|e| e.name == model) {
        return Ok(e);
    }
    let by_hash: Vec<&CatalogEntry> = if model.len() >= 8 && model.chars().all(|c| c.is_ascii_hexdigit()) {
        entries.iter().filter(|e| e.content_hash.starts_with(&model.to_ascii_lowercase())).collect()
    } else {
        Vec::new()
    };
    match by_hash.as_slice() {
        [one] => Ok(one),
        [] => Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no model {model:?} in the catalog (see `shoal models ls`)"),
        )),
        _ => {
            Err(ApiError::new(ErrorKind::BadRequest, format!("{model:?} names several models; give more of the hash")))
        }
    }
}

/// Describe and hash `path` on a blocking thread, telling `progress(hashed, total)`
/// as the hash advances; with the planner's profile of it.
async fn describe(
    path: PathBuf,
    mut progress: impl FnMut(u64, u64) + Send + 'static,
) -> Result<(Described, ModelProfile), ApiError> {
    tokio::task::spawn_blocking(move || {
        let described = shoal_catalog::describe_with_progress(&path, &mut progress).map_err(refused)?;
        // describe() validated the file: the header reads again.
        let profile = crate::runtime::profile_of(&path)
            .ok_or_else(|| ApiError::new(ErrorKind::Refused, format!("{}: no planner profile", path.display())))?;
        Ok((described, profile))
    })
    .await
    .map_err(|e| ApiError::new(ErrorKind::Unavailable, format!("describing the file failed: {e}")))?
}

fn refused(e: CatalogError) -> ApiError {
    let kind = match e {
        CatalogError::Unreadable { .. } | CatalogError::NonUtf8Path { .. } => ErrorKind::BadRequest,
        _ => ErrorKind::Refused,
    };
    ApiError::new(kind, e.to_string())
}

/// Add the file at `path` as `name` (default: the file's name), with `me` as a holder.
pub async fn add(me: NodeId, membership: &Handle, path: &str, name: Option<String>) -> Result<CatalogEntry, ApiError> {
    add_with_progress(me, membership, path, name, |_, _| {}).await
}

/// [`add`], telling `progress(hashed, total)` as the file's hash advances.
pub async fn add_with_progress(
    me: NodeId,
    membership: &Handle,
    path: &str,
    name: Option<String>,
    progress: impl FnMut(u64, u64) + Send + 'static,
) -> Result<CatalogEntry, ApiError> {
    let path = Path::new(path);
    if !path.is_absolute() {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!("{}: give the node an absolute path", path.display()),
        ));
    }
    let (described, profile) = describe(path.to_owned(), progress).await?;
    add_described(me, membership, described, profile, name).await
}

/// Put `described` in the catalog as `name`: a new entry, or this node joining the
/// holders of the entry with the same content.
async fn add_described(
    me: NodeId,
    membership: &Handle,
    described: Described,
    profile: ModelProfile,
    name: Option<String>,
) -> Result<CatalogEntry, ApiError> {
    let view = membership.view().borrow().clone();
    if view.state.is_none() {
        return Err(ApiError::new(ErrorKind::Unavailable, "this node is not in a cluster yet"));
    }
    let all = entries(&view);
    let Described { entry: mut fresh, holder } = described;
    if let Some(name) = name {
        fresh.name = name;
    }
    let header_hash = fresh.header_hash.clone();
    let mut entry = match all.iter().find(|e| e.content_hash == fresh.content_hash) {
        // The same bytes are one entry, under the name they were first added with.
        Some(existing) => existing.clone(),
        None => {
            if let Some(other) = all.iter().find(|e| e.name == fresh.name) {
                return Err(ApiError::new(
                    ErrorKind::Conflict,
                    format!(
                        "the name {:?} is taken by another model ({}…); choose another with --name",
                        fresh.name,
                        &other.content_hash[..12]
                    ),
                ));
            }
            fresh
        }
    };
    entry.holders.insert(me, holder);
    // An entry added before headers were hashed gets this node's hash of the same bytes.
    if entry.header_hash.is_none() {
        entry.header_hash = header_hash;
    }
    entry.validate().map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
    // The planner's profile first: a catalog entry is loadable once it exists.
    let profile_key = format!("{}{}", crate::runtime::PROFILE_PREFIX, entry.content_hash);
    if !view.state.as_ref().is_some_and(|s| s.entries.contains_key(&profile_key)) {
        let value = serde_json::to_value(&profile).map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        commit(membership, AdminRequest::Put { key: profile_key, value }).await?;
    }
    let value = serde_json::to_value(&entry).map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
    commit(membership, AdminRequest::Put { key: entry.key(), value }).await?;
    Ok(entry)
}

/// Remove `model` from the catalog (refused while it is loaded).
pub async fn remove(membership: &Handle, model: &str) -> Result<CatalogEntry, ApiError> {
    let view = membership.view().borrow().clone();
    let all = entries(&view);
    let entry = find(&all, model)?.clone();
    let load_key = format!("{}{}", shoal_types::LoadSpec::KEY_PREFIX, entry.content_hash);
    if view.state.as_ref().is_some_and(|s| s.entries.contains_key(&load_key)) {
        return Err(ApiError::new(
            ErrorKind::Conflict,
            format!("{} is loaded: `shoal models unload` it first", entry.name),
        ));
    }
    commit(membership, AdminRequest::Delete { key: entry.key() }).await?;
    let profile_key = format!("{}{}", crate::runtime::PROFILE_PREFIX, entry.content_hash);
    commit(membership, AdminRequest::Delete { key: profile_key }).await?;
    // The members' speeds on it go too (the state is bounded; nothing plans it now).
    let suffix = format!("/{}", entry.content_hash);
    let speeds: Vec<String> = view.state.as_ref().map_or_else(Vec::new, |s| {
        let prefix = shoal_types::Speed::KEY_PREFIX;
        s.entries
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter(|(k, _)| k.ends_with(&suffix))
            .map(|(k, _)| k.clone())
            .collect()
    });
    for key in speeds {
        commit(membership, AdminRequest::Delete { key }).await?;
    }
    Ok(entry)
}

/// The catalog, with a quick look at this node's copies.
pub fn list(me: NodeId, view: &View) -> Vec<ModelRow> {
    let mut placements = crate::runtime::placements(view);
    let mut rows: Vec<ModelRow> = entries(view)
        .into_iter()
        .map(|entry| {
            let here = entry.holders.get(&me).map(copy_state);
            let placement = placements.remove(&entry.content_hash);
            ModelRow { entry, here, placement }
        })
        .collect();
    rows.sort_by(|a, b| a.entry.name.cmp(&b.entry.name));
    rows
}

/// Size and time against the record; no hashing (listing must stay quick).
pub(crate) fn copy_state(holder: &Holder) -> CopyState {
    match std::fs::metadata(&holder.path) {
        Ok(m) if m.len() == holder.size && shoal_catalog::mtime_ns(&m) == holder.mtime_ns => CopyState::Unchanged,
        Ok(_) => CopyState::Changed,
        Err(_) => CopyState::Missing,
    }
}

/// What `from` holds on this machine.
pub async fn scan(from: StoreKind) -> NodeResponse {
    let scan = tokio::task::spawn_blocking(move || scan_store(from)).await.unwrap_or_default();
    NodeResponse::Found {
        found: scan.found.iter().map(|c| (c.name.clone(), c.path.display().to_string())).collect(),
        skipped: scan.skipped.iter().map(|s| (s.path.display().to_string(), s.reason.to_string())).collect(),
    }
}

fn scan_store(from: StoreKind) -> shoal_catalog::Scan {
    let roots: Vec<PathBuf> = match from {
        StoreKind::Ollama => shoal_catalog::ollama_roots(),
        StoreKind::Lmstudio => shoal_catalog::lmstudio_roots(),
        StoreKind::Hf => shoal_catalog::hf_cache_root().into_iter().collect(),
    };
    let mut all = shoal_catalog::Scan::default();
    for root in roots {
        let s = match from {
            StoreKind::Ollama => shoal_catalog::scan_ollama(&root),
            StoreKind::Lmstudio => shoal_catalog::scan_lmstudio(&root),
            StoreKind::Hf => shoal_catalog::scan_hf_cache(&root),
        };
        all.found.extend(s.found);
        all.skipped.extend(s.skipped);
    }
    all
}

/// Add the models of `from` named in `names` (all when empty), each under its scan name.
pub async fn import(me: NodeId, membership: &Handle, from: StoreKind, names: &[String]) -> NodeResponse {
    let scan = tokio::task::spawn_blocking(move || scan_store(from)).await.unwrap_or_default();
    let mut added = Vec::new();
    let mut refused = Vec::new();
    for name in names {
        if !scan.found.iter().any(|c| &c.name == name) {
            refused.push((name.clone(), format!("not found in the {from:?} store (see `shoal models import --from`)")));
        }
    }
    for c in scan.found.iter().filter(|c| names.is_empty() || names.contains(&c.name)) {
        let result = match describe(c.path.clone(), |_, _| {}).await {
            Ok((d, profile)) => add_described(me, membership, d, profile, Some(c.name.clone())).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(e) => added.push(e),
            Err(e) => refused.push((c.name.clone(), e.message)),
        }
    }
    NodeResponse::Imported { added, refused }
}

/// Ask membership for a change and wait until it is committed.
/// Ask membership to commit `req`; its refusal becomes an `Unavailable` error.
pub(crate) async fn commit(membership: &Handle, req: AdminRequest) -> Result<(), ApiError> {
    match membership.ask(req).await {
        AdminResponse::Ok(_) => Ok(()),
        AdminResponse::Error(e) => Err(ApiError::new(ErrorKind::Unavailable, e)),
        other => Err(ApiError::new(ErrorKind::Unavailable, format!("unexpected answer from membership: {other:?}"))),
    }
}

/// Bytes `offset..` of the header of the model `hash`, from this node's unchanged copy
/// (see [`NodeRequest::ModelHeader`](crate::api::NodeRequest::ModelHeader)).
pub fn header(me: NodeId, view: &View, hash: &str, offset: u64) -> Result<NodeResponse, ApiError> {
    let entry = entries(view)
        .into_iter()
        .find(|e| e.content_hash == hash)
        .ok_or_else(|| ApiError::new(ErrorKind::NotFound, format!("no model {hash} in the catalog")))?;
    let holder = entry.holders.get(&me).filter(|h| copy_state(h) == CopyState::Unchanged).ok_or_else(|| {
        ApiError::new(ErrorKind::NotFound, format!("this node holds no unchanged copy of {}", entry.name))
    })?;
    let path = std::path::Path::new(&holder.path);
    let refused = |e: &dyn std::fmt::Display| ApiError::new(ErrorKind::Refused, format!("{}: {e}", path.display()));
    let g = shoal_gguf::Gguf::open(path).map_err(|e| refused(&e))?;
    if offset > g.data_offset {
        return Err(ApiError::new(ErrorKind::BadRequest, format!("offset {offset} is past the header")));
    }
    let n = (g.data_offset - offset).min(crate::api::HEADER_CHUNK);
    let mut bytes = vec![0u8; n as usize];
    let mut f = std::fs::File::open(path).map_err(|e| refused(&e))?;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(offset)).map_err(|e| refused(&e))?;
    std::io::Read::read_exact(&mut f, &mut bytes).map_err(|e| refused(&e))?;
    Ok(NodeResponse::Header { data_offset: g.data_offset, file_size: g.file_size, bytes })
}
