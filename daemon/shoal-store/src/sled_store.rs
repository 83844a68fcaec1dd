//! `SledStore`: the `Store` over sled 0.34, one tree per space, flushed before every ack.

use crate::error::BackendError;
use crate::{Space, Store, StoreError, Write};
use sled::transaction::{ConflictableTransactionError, TransactionError, TransactionalTree};
use sled::Transactional;
use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The store's directory inside the node's data directory.
pub const STORE_DIR: &str = "state.sled";

/// The store format this build writes. Raise it with a step in `SledStore::upgrade`
/// whenever what is stored changes in a way an older reader would misread; a store
/// of a newer format is refused. 0 is a store of Shoal 0.1.0 before formats were
/// recorded (`daemon/shoal/tests/data/node-0.1.0` keeps one, read by `tests/upgrade.rs`).
pub const FORMAT: u32 = 1;

/// Where the format is kept ([`Space::Node`]).
pub const FORMAT_KEY: &str = "format";

/// sled's page cache limit: the state is small (members, terms, settings, profiles).
const CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// The node's [`Store`] on disk: sled 0.34 in `<data dir>/state.sled`, one tree per
/// [`Space`]. Every write is on disk before it returns (sled's `flush`, then
/// `fdatasync`s of what that leaves unsynced: see `sync`), and no read sees a write
/// before it is on disk. One process at a time: sled locks the directory.
pub struct SledStore {
    path: PathBuf,
    db: sled::Db,
    /// Readers share it; a writer holds it from its first change until its flush is
    /// done, so reads never see a write that is not durable yet, nor half a batch.
    gate: RwLock<()>,
    /// One tree per space, indexed by [`Space::index`].
    trees: [sled::Tree; Space::ALL.len()],
    /// sled's log file, opened again to `fdatasync` it after sled's flush (see `sync`).
    log: File,
    /// The blob files already synced (names in `state.sled/blobs`).
    synced_blobs: Mutex<HashSet<OsString>>,
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore").field("path", &self.path).finish_non_exhaustive()
    }
}

impl SledStore {
    /// Opens the store in `dir` (the node's data directory), creating `dir` and
    /// `<dir>/state.sled` if needed. Fails with [`StoreError::InUse`] if another
    /// process (or another `SledStore` in this one) has it open, after waiting ~1 s
    /// for a store just closed here to let go of it.
    pub fn open(dir: &Path) -> Result<SledStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.to_owned(), source })?;
        let path = dir.join(STORE_DIR);
        let db = open_db(&path)?;

        let mut trees = Vec::with_capacity(Space::ALL.len());
        for space in Space::ALL {
            let tree = db.open_tree(space.name()).map_err(|e| StoreError::Open {
                path: path.clone(),
                source: format!("cannot open the tree {space}: {e}").into(),
            })?;
            trees.push(tree);
        }
        // One tree was pushed per entry of Space::ALL just above, so this cannot fail.
        let trees: [sled::Tree; Space::ALL.len()] = trees
            .try_into()
            .map_err(|_| StoreError::Open { path: path.clone(), source: "not one tree per space".into() })?;

        // sled 0.34 "flushes" its log with sync_file_range on Linux, which neither
        // writes the file's metadata (its length grows as the log does) nor flushes the
        // drive's cache: an fdatasync of the same file after each flush does both.
        let log_path = path.join("db");
        let log = File::open(&log_path).map_err(|source| StoreError::Io { path: log_path, source })?;
        // Make the new directory entries (state.sled, its files) durable too.
        sync_dir(&path)?;
        sync_dir(dir)?;

        let store = SledStore { path, db, gate: RwLock::new(()), trees, log, synced_blobs: Mutex::new(HashSet::new()) };
        // Whatever sled just recovered or created is on disk before anyone builds on it.
        store.sync("flush after opening")?;
        store.upgrade()?;
        tracing::debug!(path = %store.path.display(), "store opened");
        Ok(store)
    }

    /// The store's directory (`<data dir>/state.sled`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_gate(&self) -> RwLockReadGuard<'_, ()> {
        // The lock guards no data (`()`), so a poisoned one is as good as a sound one.
        self.gate.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_gate(&self) -> RwLockWriteGuard<'_, ()> {
        // The lock guards no data (`()`), so a poisoned one is as good as a sound one.
        self.gate.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn tree(&self, space: Space) -> &sled::Tree {
        &self.trees[space.index()]
    }

    /// Bring a store written by an older Shoal to [`FORMAT`] (each step in order, the
    /// new format recorded last, so a step interrupted by a crash runs again), or refuse
    /// one a newer Shoal wrote (its data could be misread, then overwritten).
    fn upgrade(&self) -> Result<(), StoreError> {
        let found = self.format()?;
        if found > FORMAT {
            return Err(StoreError::TooNew { path: self.path.clone(), found, supported: FORMAT });
        }
        for from in found..FORMAT {
            match from {
                // Format 1 only starts recording the format: the data of 0 is read as is.
                0 => {}
                _ => unreachable!("a step for every format below FORMAT"),
            }
        }
        if found != FORMAT {
            if found > 0 || !self.is_empty()? {
                tracing::info!(from = found, to = FORMAT, path = %self.path.display(), "store upgraded");
            }
            self.put(Space::Node, FORMAT_KEY, FORMAT.to_string().as_bytes())?;
        }
        Ok(())
    }

    /// The format this store records (0: none, a store written before formats were).
    pub fn format(&self) -> Result<u32, StoreError> {
        match self.get(Space::Node, FORMAT_KEY)? {
            None => Ok(0),
            Some(v) => std::str::from_utf8(&v).ok().and_then(|t| t.parse().ok()).ok_or_else(|| StoreError::Corrupt {
                space: Space::Node,
                key: FORMAT_KEY.into(),
                why: "not a format number".into(),
            }),
        }
    }

    fn is_empty(&self) -> Result<bool, StoreError> {
        for space in Space::ALL {
            if !self.list(space)?.is_empty() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes every write so far durable. sled's `flush` alone is not enough for power
    /// loss (it only SIGKILL-proofs): on Linux it ends with `sync_file_range` on its log,
    /// which neither persists the file's length nor flushes the drive's cache, and it
    /// never syncs its blob files (messages over ≈ 128 KiB, e.g. a leaf of 16 values of
    /// 8 KiB) nor its directory (snapshot renames). So after it: `fdatasync` the blob
    /// files not synced yet, then the log, then the directory.
    fn sync(&self, op: &str) -> Result<(), StoreError> {
        self.db.flush().map_err(|e| backend(op, e))?;
        self.sync_blobs()?;
        self.log.sync_data().map_err(|source| StoreError::Io { path: self.path.join("db"), source })?;
        sync_dir(&self.path)
    }

    /// `fdatasync`s every blob file not synced before (and then `blobs/` itself).
    fn sync_blobs(&self) -> Result<(), StoreError> {
        let dir = self.path.join("blobs");
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| StoreError::Io { path, source }
        };
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            // sled creates it on open; without it there is nothing to sync.
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(&dir)(e)),
        };
        // The set guards plain data; a panic while it is held leaves at worst a name
        // missing, which only means one more fsync.
        let mut synced = self.synced_blobs.lock().unwrap_or_else(PoisonError::into_inner);
        let mut present = HashSet::new();
        let mut new = false;
        for entry in entries {
            let name = entry.map_err(io(&dir))?.file_name();
            if !synced.contains(&name) {
                let path = dir.join(&name);
                match File::open(&path).and_then(|f| f.sync_data()) {
                    Ok(()) => new = true,
                    // sled removed it meanwhile (blob GC): nothing to keep.
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(io(&path)(e)),
                }
            }
            present.insert(name);
        }
        *synced = present;
        if new {
            sync_dir(&dir)?;
        }
        Ok(())
    }
}

impl Store for SledStore {
    fn get(&self, space: Space, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let _gate = self.read_gate();
        let value = self.tree(space).get(key.as_bytes()).map_err(|e| backend(&format!("read {space}/{key}"), e))?;
        Ok(value.map(|v| v.to_vec()))
    }

    fn put(&self, space: Space, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let _gate = self.write_gate();
        self.tree(space).insert(key.as_bytes(), value).map_err(|e| backend(&format!("write {space}/{key}"), e))?;
        self.sync(&format!("flush {space}/{key}"))
    }

    fn remove(&self, space: Space, key: &str) -> Result<(), StoreError> {
        let _gate = self.write_gate();
        self.tree(space).remove(key.as_bytes()).map_err(|e| backend(&format!("remove {space}/{key}"), e))?;
        self.sync(&format!("flush the removal of {space}/{key}"))
    }

    fn list(&self, space: Space) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let _gate = self.read_gate();
        self.tree(space)
            .iter()
            .map(|entry| {
                let (key, value) = entry.map_err(|e| backend(&format!("list {space}"), e))?;
                let key = String::from_utf8(key.to_vec()).map_err(|e| StoreError::Corrupt {
                    space,
                    key: String::from_utf8_lossy(e.as_bytes()).into_owned(),
                    why: "the key is not UTF-8".into(),
                })?;
                Ok((key, value.to_vec()))
            })
            .collect()
    }

    fn apply(&self, batch: Vec<Write>) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let _gate = self.write_gate();
        // A transaction over every tree: sled commits it as one sealed log batch, which
        // recovery replays entirely or not at all.
        let trees: Vec<&sled::Tree> = self.trees.iter().collect();
        let result: Result<(), TransactionError<()>> =
            trees.as_slice().transaction(|views: &Vec<TransactionalTree>| {
                for write in &batch {
                    match write {
                        Write::Put { space, key, value } => {
                            views[space.index()].insert(key.as_bytes(), value.as_slice())?;
                        }
                        Write::Remove { space, key } => {
                            views[space.index()].remove(key.as_bytes())?;
                        }
                    }
                }
                Ok::<(), ConflictableTransactionError<()>>(())
            });
        match result {
            Ok(()) => {}
            Err(TransactionError::Storage(e)) => return Err(backend("apply a batch", e)),
            // The closure above never aborts; should it ever, nothing was written.
            Err(TransactionError::Abort(())) => return Err(backend_msg("apply a batch", "the transaction aborted")),
        }
        self.sync("flush a batch")
    }
}

fn backend(op: &str, e: sled::Error) -> StoreError {
    StoreError::Backend { op: op.to_owned(), source: Box::new(e) }
}

fn backend_msg(op: &str, why: &str) -> StoreError {
    StoreError::Backend { op: op.to_owned(), source: why.into() }
}

/// Opens sled's database at `path`, waiting up to ~1 s for a lock that a store just
/// dropped in this process still holds: sled 0.34 finishes its last writes on
/// background threads that keep the database file (and its lock) open a moment after
/// the `Db` is dropped, so a store closed and opened again at once (a node restarted
/// in-process, the tests) would otherwise be refused as in use. A lock that another
/// live store holds is still refused, after the wait.
fn open_db(path: &Path) -> Result<sled::Db, StoreError> {
    let mut wait = std::time::Duration::from_millis(5);
    let mut waited = std::time::Duration::ZERO;
    loop {
        match sled::Config::new().path(path).cache_capacity(CACHE_BYTES).open() {
            Ok(db) => return Ok(db),
            Err(e) => match open_error(path, e) {
                StoreError::InUse { .. } if waited < std::time::Duration::from_secs(1) => {
                    std::thread::sleep(wait);
                    waited += wait;
                    wait = (wait * 2).min(std::time::Duration::from_millis(200));
                }
                other => return Err(other),
            },
        }
    }
}

/// sled 0.34 reports a held lock as `Io(Other, "could not acquire lock on ...")` (its
/// `try_lock_exclusive` on `state.sled/db` failed with EWOULDBLOCK); nothing typed.
fn open_error(path: &Path, e: sled::Error) -> StoreError {
    if let sled::Error::Io(io) = &e {
        if io.to_string().starts_with("could not acquire lock") {
            return StoreError::InUse { path: path.to_owned() };
        }
    }
    StoreError::Open { path: path.to_owned(), source: Box::new(e) as BackendError }
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|source| StoreError::Io { path: dir.to_owned(), source })
}
