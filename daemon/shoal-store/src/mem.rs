//! `MemStore`: the in-memory `Store` for tests (nothing survives the process).

use crate::{Space, Store, StoreError, Write};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

type Spaces = [BTreeMap<String, Vec<u8>>; Space::ALL.len()];

/// A [`Store`] in memory, behind a mutex: same semantics as [`crate::SledStore`]
/// (key order, atomic batches) except durability. For tests.
#[derive(Debug, Default)]
pub struct MemStore {
    spaces: Mutex<Spaces>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, Spaces> {
        // No code panics while holding the lock, and every critical section leaves the
        // maps consistent, so a poisoned lock still guards valid data.
        self.spaces.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store for MemStore {
    fn get(&self, space: Space, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.lock()[space.index()].get(key).cloned())
    }

    fn put(&self, space: Space, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock()[space.index()].insert(key.to_owned(), value.to_vec());
        Ok(())
    }

    fn remove(&self, space: Space, key: &str) -> Result<(), StoreError> {
        self.lock()[space.index()].remove(key);
        Ok(())
    }

    fn list(&self, space: Space) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self.lock()[space.index()].iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    fn apply(&self, batch: Vec<Write>) -> Result<(), StoreError> {
        // Nothing below can fail, and the lock is held throughout: all or none.
        let mut spaces = self.lock();
        for write in batch {
            match write {
                Write::Put { space, key, value } => {
                    spaces[space.index()].insert(key, value);
                }
                Write::Remove { space, key } => {
                    spaces[space.index()].remove(&key);
                }
            }
        }
        Ok(())
    }
}
