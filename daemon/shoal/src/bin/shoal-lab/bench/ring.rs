//! A machine reference for the pipeline's concurrency figures: a ring of threads, one
//! per stage, each computing a fixed CPU time per token and handing the token to the
//! next, with one or more tokens going round. No model, no networking, no protocol:
//! what the machine's scheduler gives a pipeline whose stages share its cores, in the
//! same run as the figures it is set beside (these machines drift).
//!
//! On an ideal two-core machine, two tokens in a ring of three stages whose slowest
//! takes less than half the round keep both cores computing: twice one token's rate.
//! A scheduler that stacks two runnable threads on one core while the other idles (a
//! VM packing its vCPUs does) gives less, and no pipeline on that machine can do better
//! than its ring.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One stage of the ring: the tokens waiting for it, and the signal that one came.
#[derive(Default)]
struct Slot {
    waiting: Mutex<usize>,
    came: Condvar,
}

/// Tokens per second that a ring of `work.len()` threads completes with `tokens`
/// tokens going round, each thread computing `work[i]` of its own CPU time per token
/// (wall time where the platform has no thread clock), counted over `run_for` after a
/// warm-up of four rounds' compute and 100 ms (wall time).
pub fn tokens_per_s(work: &[Duration], tokens: usize, run_for: Duration) -> f64 {
    let n = work.len().max(1);
    let slots: Arc<Vec<Slot>> = Arc::new((0..n).map(|_| Slot::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (slots, stop, done) = (slots.clone(), stop.clone(), done.clone());
            let work = work.get(i).copied().unwrap_or_default();
            std::thread::spawn(move || stage(i, &slots, work, &stop, &done))
        })
        .collect();
    set_waiting(&slots[0], tokens);
    // Warm-up: every thread started and ran, the tokens spread round the ring.
    let round: Duration = work.iter().sum();
    std::thread::sleep(round * 4 + Duration::from_millis(100));
    let (t0, d0) = (Instant::now(), done.load(Ordering::Acquire));
    std::thread::sleep(run_for);
    let rate = (done.load(Ordering::Acquire) - d0) as f64 / t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    for s in slots.iter() {
        // Wake every waiting thread; a poisoned lock only means a thread panicked.
        let _guard = s.waiting.lock();
        s.came.notify_all();
    }
    for t in threads {
        let _ = t.join();
    }
    rate
}

/// Puts `k` more tokens in `slot` and wakes its thread.
fn set_waiting(slot: &Slot, k: usize) {
    if let Ok(mut w) = slot.waiting.lock() {
        *w += k;
        slot.came.notify_one();
    }
}

/// Thread `i`'s loop: take a token, compute `work`, hand it to the next stage (the
/// last counts it done) until `stop`.
fn stage(i: usize, slots: &[Slot], work: Duration, stop: &AtomicBool, done: &AtomicU64) {
    let Some(me) = slots.get(i) else { return };
    loop {
        {
            let Ok(mut w) = me.waiting.lock() else { return };
            while *w == 0 && !stop.load(Ordering::Acquire) {
                w = match me.came.wait(w) {
                    Ok(w) => w,
                    Err(_) => return,
                };
            }
            if stop.load(Ordering::Acquire) {
                return;
            }
            *w -= 1;
        }
        compute(work);
        let next = (i + 1) % slots.len();
        if next == 0 {
            done.fetch_add(1, Ordering::AcqRel);
        }
        set_waiting(&slots[next], 1);
    }
}

/// Keeps this thread's core busy for `work` of the thread's CPU time: time the thread
/// spends off its core does not count, as a stage's compute does not advance then.
fn compute(work: Duration) {
    let clock = shoal_pipeline::service::thread_cpu_time;
    let (start, wall) = (clock(), Instant::now());
    let spent = || match (start, clock()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => wall.elapsed(),
    };
    let mut x = 1.0f64;
    while spent() < work {
        for _ in 0..1000 {
            x = std::hint::black_box(x * 1.000_000_1 + 1e-9);
        }
    }
    std::hint::black_box(x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_completes_about_one_token_per_round_with_one_token() {
        // Three stages of 2 ms: a round takes at least 6 ms of computing, so one token
        // completes at most ~167 times a second however fast the machine; a loaded
        // machine only slows it, but it must go round.
        let work = [Duration::from_millis(2); 3];
        let rate = tokens_per_s(&work, 1, Duration::from_secs(1));
        assert!(rate > 0.0, "the token went round: {rate}");
        assert!(rate <= 1000.0 / 6.0 * 1.05, "one token cannot go round faster than its compute: {rate}");
    }
}
