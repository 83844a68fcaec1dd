//! SIGKILL during writes never loses an acknowledged write, nor leaves half a batch.
//!
//! The parent tests re-run this test binary as a child (`child_writer`, ignored in a
//! normal run) that writes to a `SledStore` in a loop and prints `ack <i>` after each
//! write returns; the parent SIGKILLs it after a random number of acks (sometimes
//! before it has even opened the store), reopens the store and checks that every
//! acknowledged write is there and that the state is a whole prefix of the batches.

use serde::{Deserialize, Serialize};
use shoal_store::{SledStore, Space, Store, StoreExt, Write};
use std::io::{BufRead, BufReader, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where the child writes; set only by the parent for the child.
const CHILD_ENV: &str = "SHOAL_STORE_CHILD_DIR";
/// Every BLOB_EVERY-th batch is followed by a `put` of a bigger value.
const BLOB_EVERY: u64 = 5;
/// The most acks the parent waits for in a round.
const MAX_ACKS: u64 = 40;

/// A member approval, as the membership code would store it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Approval {
    seq: u64,
    node: String,
    approved_by: String,
}

fn member_key(i: u64) -> String {
    format!("node-{i:08}")
}

fn approval(i: u64) -> Approval {
    Approval { seq: i, node: member_key(i), approved_by: "node-leader".into() }
}

/// A bigger value (16..196 KiB: sled 0.34 writes messages over ≈ 128 KiB to separate
/// blob files): its sequence number, then a filler derived from it.
fn blob(i: u64) -> Vec<u8> {
    let len = 16 * 1024 + (i % 7) as usize * 30 * 1024;
    let mut v = i.to_le_bytes().to_vec();
    v.resize(len, (i % 251) as u8);
    v
}

/// The sequence number of a blob, after checking it is whole.
fn check_blob(v: &[u8]) -> u64 {
    assert!(v.len() >= 8, "blob of {} bytes", v.len());
    let i = u64::from_le_bytes(v[..8].try_into().unwrap());
    assert_eq!(v, blob(i).as_slice(), "blob {i} is torn");
    i
}

/// Open the store, waiting (up to 10 s) while its lock is held elsewhere: the other
/// side's handle may hold sled's lock a moment after it is dropped, and a sibling
/// test's child, forked meanwhile, holds a copy of the descriptor until it execs.
fn open_when_free(dir: &Path) -> Result<SledStore, shoal_store::StoreError> {
    let t0 = Instant::now();
    loop {
        match SledStore::open(dir) {
            Err(shoal_store::StoreError::InUse { .. }) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// The writer run in a child process; returns at once in a normal run.
#[test]
#[ignore = "the SIGKILL tests' writer: they run it in a child process"]
fn child_writer() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let store = open_when_free(Path::new(&dir)).expect("child: open the store");
    let start = match store.get_json::<u64>(Space::Election, "term").expect("child: read term") {
        Some(term) => term + 1,
        None => 0,
    };
    let mut out = std::io::stdout();
    // On a line of its own: libtest has just printed "test child_writer ... ".
    writeln!(out, "\nstart {start}").and_then(|()| out.flush()).expect("child: stdout");
    // Bounded, so that an orphan stops on its own; the parent kills it long before.
    for i in start..start + 100_000 {
        store
            .apply(vec![
                Write::put_json(Space::Members, &member_key(i), &approval(i)).unwrap(),
                Write::put_json(Space::Election, "term", &i).unwrap(),
            ])
            .expect("child: apply");
        if i % BLOB_EVERY == 0 {
            store.put(Space::Cluster, "snapshot", &blob(i)).expect("child: put blob");
        }
        writeln!(out, "ack {i}").and_then(|()| out.flush()).expect("child: stdout");
    }
}

/// xorshift64*: deterministic, so a failing round can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// When the parent kills the child.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// Right after spawning it (perhaps while sled is recovering).
    Spawn { after_us: u64 },
    /// After it printed `start` and then `acks` acks, and `after_us` more.
    Acks { acks: u64, after_us: u64 },
}

/// A child takes ≈ 75–130 ms from spawn to its `start` line (exec, libtest, opening
/// or creating the store), so a kill within this window lands anywhere in that.
const SPAWN_WINDOW_US: u64 = 150_000;

fn kill_at_spawn(rng: &mut Rng) -> KillAt {
    KillAt::Spawn { after_us: rng.below(SPAWN_WINDOW_US) }
}

fn kill_after_acks(rng: &mut Rng) -> KillAt {
    let after_us = match rng.below(3) {
        0 => 0,
        1 => rng.below(500),
        _ => rng.below(5_000),
    };
    KillAt::Acks { acks: rng.below(MAX_ACKS + 1), after_us }
}

/// What one round saw.
#[derive(Debug)]
struct Round {
    kill: KillAt,
    acked: Vec<u64>,
    term: Option<u64>,
}

/// Runs the child on `dir`, kills it as `kill` says, reopens the store and checks it
/// against the acks (and against `floor`, the term the previous round found).
fn round(dir: &Path, errs: &Path, kill: KillAt, floor: Option<u64>) -> Round {
    let exe = std::env::current_exe().unwrap();
    let stderr = std::fs::File::create(errs).unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "child_writer", "--nocapture", "--include-ignored", "--test-threads=1"])
        .env(CHILD_ENV, dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut acked = Vec::new();
    let mut start = None;
    match kill {
        KillAt::Spawn { after_us } => std::thread::sleep(Duration::from_micros(after_us)),
        KillAt::Acks { acks, after_us } => {
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            loop {
                if start.is_some() && acked.len() as u64 == acks {
                    break;
                }
                let Some(line) = lines.next() else {
                    let status = child.wait().unwrap();
                    panic!(
                        "{kill:?}: the child ended by itself ({status}) after {} acks:\n{}",
                        acked.len(),
                        std::fs::read_to_string(errs).unwrap_or_default()
                    );
                };
                let line = line.unwrap();
                if let Some(s) = line.strip_prefix("start ") {
                    start = Some(s.parse::<u64>().unwrap());
                } else if let Some(i) = line.strip_prefix("ack ") {
                    acked.push(i.parse::<u64>().unwrap());
                }
            }
            std::thread::sleep(Duration::from_micros(after_us));
            // `lines` (the pipe) stays open until after the kill: the child never
            // blocks or fails on a closed stdout before it dies.
            child.kill().unwrap();
            drop(lines);
        }
    }
    let _ = child.kill(); // SIGKILL (already sent in the Acks case)
    let status = child.wait().unwrap();
    {
        use std::os::unix::process::ExitStatusExt;
        assert!(
            status.signal() == Some(9),
            "{kill:?}: the child was not killed but ended with {status}:\n{}",
            std::fs::read_to_string(errs).unwrap_or_default()
        );
    }

    // The store opens, and holds every acknowledged write.
    let store = open_when_free(dir).unwrap_or_else(|e| panic!("{kill:?}: reopen after SIGKILL: {e}"));
    let term = store.get_json::<u64>(Space::Election, "term").unwrap();
    if let Some(start) = start {
        // The child found what the parent found after the previous round.
        assert_eq!(start, floor.map_or(0, |t| t + 1), "{kill:?}: the child started elsewhere");
        if let Some(&first) = acked.first() {
            assert_eq!(first, start, "acks start where the child said");
        }
    }
    if let Some(&last) = acked.last() {
        assert!(term >= Some(last), "{kill:?}: acked up to {last}, but term is {term:?}");
    }
    assert!(term >= floor, "{kill:?}: term went back from {floor:?} to {term:?}");
    // Batches are whole and form a prefix: the members are exactly node-0..=term.
    let members = store.list_json::<Approval>(Space::Members).unwrap();
    let expected = term.map_or(0, |t| t + 1);
    assert_eq!(members.len() as u64, expected, "{kill:?}: {} members for term {term:?}", members.len());
    for (i, (key, value)) in members.iter().enumerate() {
        let i = i as u64;
        assert_eq!(key, &member_key(i), "{kill:?}");
        assert_eq!(value, &approval(i), "{kill:?}");
    }
    for &i in &acked {
        assert!(store.get(Space::Members, &member_key(i)).unwrap().is_some(), "acked {i} lost");
    }
    // The bigger value is whole, and at least the last one acknowledged.
    let last_blob = acked.iter().rev().find(|&&i| i % BLOB_EVERY == 0).copied();
    let blob_now = store.get(Space::Cluster, "snapshot").unwrap().map(|v| check_blob(&v));
    assert!(blob_now >= last_blob, "{kill:?}: blob {blob_now:?} older than acked {last_blob:?}");
    if let (Some(b), Some(t)) = (blob_now, term) {
        assert!(b <= t, "blob {b} written after batch {t} yet batch {t} is the last");
    }
    Round { kill, acked, term }
}

/// Tallies rounds for the closing line.
#[derive(Default)]
struct Tally {
    rounds: usize,
    spawn_kills: usize,
    acks: usize,
}

impl Tally {
    fn add(&mut self, round: &Round) {
        self.rounds += 1;
        self.spawn_kills += matches!(round.kill, KillAt::Spawn { .. }) as usize;
        self.acks += round.acked.len();
    }
}

/// 50 rounds on one directory: recovery after recovery after recovery.
#[test]
fn sigkill_never_loses_an_acknowledged_write() {
    let began = Instant::now();
    let mut rng = Rng(0x5eed_0001_d00d_f00d);
    let tmp = tempfile::tempdir().unwrap();
    let (dir, errs) = (tmp.path().join("data"), tmp.path().join("child.stderr"));
    let mut tally = Tally::default();
    let mut floor = None;
    for r in 0..50 {
        // One round in eight kills at spawn, the others after 0..=40 acks.
        let kill = if r % 8 == 3 { kill_at_spawn(&mut rng) } else { kill_after_acks(&mut rng) };
        let seen = round(&dir, &errs, kill, floor);
        tally.add(&seen);
        floor = seen.term;
    }
    assert!(tally.acks >= 500, "the seed gives too tame a run: {} acks", tally.acks);
    eprintln!(
        "same directory: {} rounds ({} killed at spawn), {} acked writes, final term {floor:?}, {:.1} s",
        tally.rounds,
        tally.spawn_kills,
        tally.acks,
        began.elapsed().as_secs_f64()
    );
}

/// Fresh directories: a kill at spawn (perhaps while sled creates the store), then a
/// round of writes on whatever that left.
#[test]
fn sigkill_on_a_fresh_store_never_loses_an_acknowledged_write() {
    let began = Instant::now();
    let mut rng = Rng(0x5eed_0002_cafe_beef);
    let tmp = tempfile::tempdir().unwrap();
    let errs = tmp.path().join("child.stderr");
    let mut tally = Tally::default();
    for d in 0..8 {
        let dir = tmp.path().join(format!("data-{d}"));
        let first = round(&dir, &errs, kill_at_spawn(&mut rng), None);
        tally.add(&first);
        tally.add(&round(&dir, &errs, kill_after_acks(&mut rng), first.term));
    }
    eprintln!(
        "fresh directories: {} rounds ({} killed at spawn), {} acked writes, {:.1} s",
        tally.rounds,
        tally.spawn_kills,
        tally.acks,
        began.elapsed().as_secs_f64()
    );
}
