//! The node's side of the HTTP API: [`shoal_api::Backend`] over the cluster state (the
//! catalog and placements this node sees), a vocabulary read from a file this node
//! holds, and generation forwarded to the model's coordinator wherever it runs.

use crate::api::{ApiError, CopyState, ErrorKind};
use crate::models;
use crate::runtime::{self, Runtime};
use shoal_api::{Backend, Failure, FailureKind, ModelInfo, ModelState, TextModel};
use shoal_pipeline::{GenerateRequest, Report};
use shoal_types::TokenId;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The name of the file in the data directory that holds the API's bound address
/// (the CLI and tests read it; the port may be chosen by the system).
pub const HTTP_FILE: &str = "http";

/// The API's view of this node.
pub struct NodeBackend {
    /// Placement, stages, generation.
    pub(crate) rt: Arc<Runtime>,
    /// Vocabularies loaded so far, by content hash (a few MB each; models are few).
    pub(crate) texts: Mutex<HashMap<String, Arc<dyn TextModel>>>,
}

impl Backend for NodeBackend {
    async fn models(&self) -> Vec<ModelInfo> {
        let view = self.rt.membership.view().borrow().clone();
        let mut placements = runtime::placements(&view);
        let mut out = Vec::new();
        for entry in models::entries(&view) {
            let placement = placements.remove(&entry.content_hash);
            let (state, context) = match placement {
                None => (ModelState::Available, None),
                Some(p) => match &p.error {
                    Some(e) => (ModelState::Unplaced(e.clone()), Some(p.context)),
                    None if runtime::stages_ready(&self.rt, &view, &p).await => (ModelState::Ready, Some(p.context)),
                    None => (ModelState::Starting, Some(p.context)),
                },
            };
            out.push(ModelInfo { entry, state, context });
        }
        out.sort_by(|a, b| a.entry.name.cmp(&b.entry.name));
        out
    }

    async fn text(&self, model: &str) -> Result<Arc<dyn TextModel>, Failure> {
        let view = self.rt.membership.view().borrow().clone();
        let catalog = models::entries(&view);
        let entry = models::find(&catalog, model).map_err(failure)?.clone();
        if let Some(t) = lock(&self.texts).get(&entry.content_hash) {
            return Ok(t.clone());
        }
        let Some(engine) = self.rt.engine.clone() else {
            return Err(Failure::new(FailureKind::Unavailable, "this node runs no engine, so it reads no vocabulary"));
        };
        let file = self.vocab_file(&entry).ok_or_else(|| {
            Failure::new(
                FailureKind::Unavailable,
                format!(
                    "this node holds neither {} nor a shard of it, so it cannot tokenize; ask a node that runs a \
                     stage of it or holds the file",
                    entry.name
                ),
            )
        })?;
        let text = tokio::task::spawn_blocking(move || engine.text(&file))
            .await
            .map_err(|e| Failure::new(FailureKind::Internal, e.to_string()))?
            .map_err(|e| Failure::new(FailureKind::Internal, format!("the vocabulary of {}: {e}", entry.name)))?;
        lock(&self.texts).insert(entry.content_hash.clone(), text.clone());
        Ok(text)
    }

    async fn generate(
        &self,
        model: &str,
        request: GenerateRequest,
        tokens: mpsc::UnboundedSender<TokenId>,
    ) -> Result<Report, Failure> {
        runtime::generate(&self.rt, model, &request, |t| {
            let _ = tokens.send(t);
        })
        .await
        .map_err(failure)
    }
}

impl NodeBackend {
    /// A file on this node holding `entry`'s vocabulary: its own copy (when unchanged
    /// since it was added: a changed file is never read), else a shard of it (every
    /// shard keeps the whole metadata).
    fn vocab_file(&self, entry: &shoal_types::CatalogEntry) -> Option<PathBuf> {
        if let Some(h) = entry.holders.get(&self.rt.me) {
            if models::copy_state(h) == CopyState::Unchanged {
                return Some(PathBuf::from(&h.path));
            }
        }
        let dir = self.rt.cache.dir().join(format!("blake3-{}", entry.content_hash));
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "gguf") && Path::new(p).is_file())
    }
}

/// A node error as the API maps it to a status.
fn failure(e: ApiError) -> Failure {
    let kind = match e.kind {
        ErrorKind::BadRequest | ErrorKind::Refused | ErrorKind::Conflict => FailureKind::BadRequest,
        ErrorKind::Forbidden => FailureKind::Forbidden,
        ErrorKind::NotFound => FailureKind::NotFound,
        ErrorKind::Unavailable => FailureKind::Unavailable,
        ErrorKind::Busy => FailureKind::Busy,
    };
    Failure::new(kind, e.message)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the map leaves it whole (inserts are single calls).
    m.lock().unwrap_or_else(|e| e.into_inner())
}
