//! Unit tests: one behaviour suite run on both `MemStore` and `SledStore`, plus sled-only
//! tests (reopen, lock, layout).

use crate::{MemStore, SledStore, Space, Store, StoreError, StoreExt, Write};
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Member {
    id: String,
    addr: String,
}

fn member(id: &str) -> Member {
    Member { id: id.into(), addr: format!("10.0.0.{}:7000", id.len()) }
}

/// What `Store::list` returns.
type Entries = Vec<(String, Vec<u8>)>;

fn kv(k: &str, v: &[u8]) -> (String, Vec<u8>) {
    (k.to_owned(), v.to_vec())
}

/// put/get/list/remove, space independence, key order.
fn basic_ops(store: &dyn Store) {
    assert_eq!(store.get(Space::Node, "cluster").unwrap(), None);
    assert!(store.list(Space::Members).unwrap().is_empty());

    store.put(Space::Node, "cluster", b"c1").unwrap();
    assert_eq!(store.get(Space::Node, "cluster").unwrap().as_deref(), Some(&b"c1"[..]));
    store.put(Space::Node, "cluster", b"c2").unwrap();
    assert_eq!(store.get(Space::Node, "cluster").unwrap().as_deref(), Some(&b"c2"[..]));

    // The same key in another space is another entry.
    assert_eq!(store.get(Space::Settings, "cluster").unwrap(), None);
    store.put(Space::Settings, "cluster", b"s").unwrap();
    assert_eq!(store.get(Space::Node, "cluster").unwrap().as_deref(), Some(&b"c2"[..]));

    // list: key order, whatever the insertion order; only that space; empty values kept.
    for k in ["node-b", "node-a", "node-c", "node-aa", "Node-Z"] {
        store.put(Space::Members, k, k.as_bytes()).unwrap();
    }
    store.put(Space::Members, "empty", b"").unwrap();
    assert_eq!(
        store.list(Space::Members).unwrap(),
        vec![
            kv("Node-Z", b"Node-Z"),
            kv("empty", b""),
            kv("node-a", b"node-a"),
            kv("node-aa", b"node-aa"),
            kv("node-b", b"node-b"),
            kv("node-c", b"node-c"),
        ]
    );
    assert_eq!(store.list(Space::Settings).unwrap(), vec![kv("cluster", b"s")]);

    // Non-ASCII keys and binary values round-trip.
    let binary: Vec<u8> = (0..=255u8).collect();
    store.put(Space::Profiles, "gpu-é/0", &binary).unwrap();
    assert_eq!(store.get(Space::Profiles, "gpu-é/0").unwrap(), Some(binary.clone()));
    assert_eq!(store.list(Space::Profiles).unwrap(), vec![("gpu-é/0".to_owned(), binary)]);

    store.remove(Space::Members, "node-b").unwrap();
    assert_eq!(store.get(Space::Members, "node-b").unwrap(), None);
    // Removing what is absent is not an error.
    store.remove(Space::Members, "node-b").unwrap();
    store.remove(Space::Cluster, "never").unwrap();
    let keys: Vec<String> = store.list(Space::Members).unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["Node-Z", "empty", "node-a", "node-aa", "node-c"]);

    // Every space is usable and separate.
    for space in Space::ALL {
        store.put(space, "probe", space.name().as_bytes()).unwrap();
    }
    for space in Space::ALL {
        assert_eq!(store.get(space, "probe").unwrap(), Some(space.name().as_bytes().to_vec()));
    }
}

/// apply: every write of a batch, across spaces, in order (a later write wins).
fn apply_batches(store: &dyn Store) {
    store.put(Space::Node, "role", b"candidate").unwrap();
    store.put(Space::Members, "gone", b"x").unwrap();
    store
        .apply(vec![
            Write::put_json(Space::Members, "node-1", &member("node-1")).unwrap(),
            Write::put_json(Space::Election, "term", &7u64).unwrap(),
            Write::Put { space: Space::Election, key: "vote".into(), value: b"node-1".to_vec() },
            Write::Remove { space: Space::Members, key: "gone".into() },
            Write::Remove { space: Space::Node, key: "role".into() },
            Write::Put { space: Space::Cluster, key: "snapshot".into(), value: b"first".to_vec() },
            Write::Put { space: Space::Cluster, key: "snapshot".into(), value: b"second".to_vec() },
            Write::Put { space: Space::Node, key: "tmp".into(), value: b"t".to_vec() },
            Write::Remove { space: Space::Node, key: "tmp".into() },
        ])
        .unwrap();
    assert_eq!(store.get_json::<Member>(Space::Members, "node-1").unwrap(), Some(member("node-1")));
    assert_eq!(store.get(Space::Members, "gone").unwrap(), None);
    assert_eq!(store.get_json::<u64>(Space::Election, "term").unwrap(), Some(7));
    assert_eq!(store.get(Space::Election, "vote").unwrap().as_deref(), Some(&b"node-1"[..]));
    assert_eq!(store.get(Space::Node, "role").unwrap(), None);
    assert_eq!(store.get(Space::Node, "tmp").unwrap(), None);
    assert_eq!(store.get(Space::Cluster, "snapshot").unwrap().as_deref(), Some(&b"second"[..]));
    // An empty batch changes nothing.
    store.apply(Vec::new()).unwrap();
    assert_eq!(store.list(Space::Members).unwrap().len(), 1);
}

/// JSON helpers round-trip; a value that does not decode is `Corrupt`, naming space and key.
fn json_and_corruption(store: &dyn Store) {
    store.put_json(Space::Members, "node-a", &member("node-a")).unwrap();
    store.put_json(Space::Members, "node-b", &member("node-b")).unwrap();
    assert_eq!(
        store.list_json::<Member>(Space::Members).unwrap(),
        vec![("node-a".to_owned(), member("node-a")), ("node-b".to_owned(), member("node-b"))]
    );
    assert_eq!(store.get_json::<Member>(Space::Members, "absent").unwrap(), None);

    store.put(Space::Members, "node-c", b"{\"id\": \"node-c\", trunc").unwrap();
    let err = store.get_json::<Member>(Space::Members, "node-c").unwrap_err();
    match &err {
        StoreError::Corrupt { space, key, .. } => {
            assert_eq!(*space, Space::Members);
            assert_eq!(key, "node-c");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(err.to_string().contains("members/node-c"), "{err}");
    let err = store.list_json::<Member>(Space::Members).unwrap_err();
    assert!(matches!(&err, StoreError::Corrupt { key, .. } if key == "node-c"), "{err:?}");

    // Valid JSON of the wrong shape is corrupt too.
    store.put_json(Space::Election, "term", &"not a number").unwrap();
    let err = store.get_json::<u64>(Space::Election, "term").unwrap_err();
    assert!(matches!(&err, StoreError::Corrupt { space: Space::Election, .. }), "{err:?}");
}

#[test]
fn mem_store_behaves() {
    basic_ops(&MemStore::new());
    apply_batches(&MemStore::new());
    json_and_corruption(&MemStore::default());
}

#[test]
fn sled_store_behaves() {
    for suite in [basic_ops, apply_batches, json_and_corruption] {
        let dir = tempfile::tempdir().unwrap();
        suite(&SledStore::open(dir.path()).unwrap());
    }
}

#[test]
fn sled_store_keeps_everything_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let expected: Vec<(Space, Entries)> = {
        let store = SledStore::open(&data).unwrap();
        assert_eq!(store.path(), data.join("state.sled"));
        basic_ops(&store);
        store
            .apply(vec![
                Write::put_json(Space::Election, "term", &3u64).unwrap(),
                Write::put_json(Space::Members, "node-j", &member("node-j")).unwrap(),
                Write::Remove { space: Space::Members, key: "node-a".into() },
            ])
            .unwrap();
        store.put(Space::Cluster, "bad", b"{").unwrap();
        Space::ALL.iter().map(|&s| (s, store.list(s).unwrap())).collect()
    };
    assert!(data.join("state.sled").is_dir());
    for round in 0..3 {
        let store = SledStore::open(&data).unwrap();
        for (space, entries) in &expected {
            assert_eq!(&store.list(*space).unwrap(), entries, "space {space}, round {round}");
        }
        assert_eq!(store.get(Space::Members, "node-a").unwrap(), None);
        assert_eq!(store.get_json::<Member>(Space::Members, "node-j").unwrap(), Some(member("node-j")));
        assert_eq!(store.get_json::<u64>(Space::Election, "term").unwrap(), Some(3));
        assert!(matches!(
            store.get_json::<Member>(Space::Cluster, "bad"),
            Err(StoreError::Corrupt { space: Space::Cluster, .. })
        ));
    }
    // A store with many writes and removes reopens to the last state.
    {
        let store = SledStore::open(&data).unwrap();
        for i in 0..200u32 {
            store.put(Space::Profiles, &format!("p{i:03}"), &i.to_le_bytes()).unwrap();
        }
        for i in (0..200u32).step_by(2) {
            store.remove(Space::Profiles, &format!("p{i:03}")).unwrap();
        }
    }
    let store = SledStore::open(&data).unwrap();
    // (basic_ops left "gpu-é/0" and "probe" there too.)
    let profiles: Vec<_> =
        store.list(Space::Profiles).unwrap().into_iter().filter(|(k, _)| k.len() == 4 && k.starts_with('p')).collect();
    assert_eq!(profiles.len(), 100);
    for (n, (key, value)) in profiles.iter().enumerate() {
        let i = 2 * n as u32 + 1;
        assert_eq!(key, &format!("p{i:03}"));
        assert_eq!(value, &i.to_le_bytes());
    }
}

#[test]
fn sled_store_open_twice_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(dir.path()).unwrap();
    store.put(Space::Node, "cluster", b"c").unwrap();
    let err = SledStore::open(dir.path()).unwrap_err();
    assert!(matches!(&err, StoreError::InUse { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("in use by another shoal process"), "{msg}");
    assert!(msg.contains(&dir.path().join("state.sled").display().to_string()), "{msg}");
    // The failed open changed nothing; once the holder is gone, it opens.
    assert_eq!(store.get(Space::Node, "cluster").unwrap().as_deref(), Some(&b"c"[..]));
    drop(store);
    let store = SledStore::open(dir.path()).unwrap();
    assert_eq!(store.get(Space::Node, "cluster").unwrap().as_deref(), Some(&b"c"[..]));
}

#[test]
fn sled_store_open_on_a_file_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = SledStore::open(&file).unwrap_err();
    assert!(err.to_string().contains("not-a-dir"), "{err}");
}

#[test]
fn stores_work_as_trait_objects_across_threads() {
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<std::sync::Arc<dyn Store>> =
        vec![std::sync::Arc::new(MemStore::new()), std::sync::Arc::new(SledStore::open(dir.path()).unwrap())];
    for store in stores {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..10 {
                        store.put_json(Space::Profiles, &format!("t{t}-{i}"), &(t * 100 + i)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let all = store.list_json::<i32>(Space::Profiles).unwrap();
        assert_eq!(all.len(), 40);
        assert!(all.iter().all(|(k, v)| *k == format!("t{}-{}", v / 100, v % 100)));
    }
}

#[test]
fn sled_store_records_its_format_upgrades_older_and_refuses_newer() {
    let dir = tempfile::tempdir().unwrap();
    // A new store records the format this build writes.
    {
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(store.format().unwrap(), crate::FORMAT);
        store.put(Space::Members, "m", b"kept").unwrap();
        // As a store of a Shoal from before formats: no format entry.
        store.remove(Space::Node, crate::FORMAT_KEY).unwrap();
        assert_eq!(store.format().unwrap(), 0);
    }
    // Opened again, it is upgraded and its data kept.
    {
        let store = SledStore::open(dir.path()).unwrap();
        assert_eq!(store.format().unwrap(), crate::FORMAT);
        assert_eq!(store.get(Space::Members, "m").unwrap().as_deref(), Some(&b"kept"[..]));
        // As a newer Shoal would leave it.
        store.put(Space::Node, crate::FORMAT_KEY, (crate::FORMAT + 1).to_string().as_bytes()).unwrap();
    }
    // A newer format is refused, with both numbers, and left as it is.
    let err = SledStore::open(dir.path()).unwrap_err();
    match &err {
        StoreError::TooNew { found, supported, .. } => {
            assert_eq!((*found, *supported), (crate::FORMAT + 1, crate::FORMAT));
        }
        other => panic!("expected TooNew, got {other:?}"),
    }
    assert!(err.to_string().contains("newer Shoal"), "{err}");
    // The refusal released the store (it can be opened, and is still refused).
    assert!(matches!(SledStore::open(dir.path()), Err(StoreError::TooNew { .. })));
    // A format that is not a number is a corrupt entry, not a guess.
    {
        let db = sled::open(dir.path().join(crate::STORE_DIR)).unwrap();
        db.open_tree("node").unwrap().insert(crate::FORMAT_KEY, &b"two"[..]).unwrap();
        db.flush().unwrap();
    }
    assert!(matches!(SledStore::open(dir.path()), Err(StoreError::Corrupt { space: Space::Node, .. })));
}
