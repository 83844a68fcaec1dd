//! One writer per shard file in this process: a fetch and a build (or two fetches) of
//! the same shard would otherwise write the same `.part` or temporary file at once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

type KeyMutex = tokio::sync::Mutex<()>;

static LOCKS: Mutex<Option<HashMap<PathBuf, Weak<KeyMutex>>>> = Mutex::new(None);

/// Hold the returned guard while writing the shard at `dest`.
pub(crate) async fn lock(dest: &Path) -> tokio::sync::OwnedMutexGuard<()> {
    let m = {
        // A poisoned lock only means a holder panicked while editing the map, whose
        // entries are valid at every step.
        let mut all = LOCKS.lock().unwrap_or_else(|e| e.into_inner());
        let all = all.get_or_insert_with(HashMap::new);
        // Forget keys nobody holds, so the map stays as small as the work in progress.
        all.retain(|_, w| w.strong_count() > 0);
        match all.get(dest).and_then(Weak::upgrade) {
            Some(m) => m,
            None => {
                let m = Arc::new(KeyMutex::new(()));
                all.insert(dest.to_owned(), Arc::downgrade(&m));
                m
            }
        }
    };
    m.lock_owned().await
}
