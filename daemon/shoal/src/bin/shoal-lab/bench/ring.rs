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
    ring(work, tokens, run_for, None).unwrap_or(0.0)
}

/// [`tokens_per_s`] with thread `i` kept on CPU `cpus[i]` (as [`balanced`] assigns
/// them): what the machine gives the same ring when its scheduler cannot stack two
/// runnable threads on one core while another idles. `None` where threads cannot be
/// pinned (not Linux, or a CPU the calling thread may not use).
pub fn tokens_per_s_pinned(work: &[Duration], tokens: usize, run_for: Duration, cpus: &[usize]) -> Option<f64> {
    ring(work, tokens, run_for, Some(cpus))
}

/// The CPUs the calling thread may run on (Linux; for a thread not pinned, the
/// process's), in order; empty where unknown.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it for this
        // process (pid 0) and reads no further than the size given.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
        }
    }
    #[cfg(not(target_os = "linux"))]
    Vec::new()
}

/// Stages onto `cpus` so that the busiest CPU has as little to do per token as this
/// greedy rule finds (heaviest stage first, each onto the least loaded CPU): the CPU
/// of each stage, and the busiest CPU's work per token, which bounds a pinned ring at
/// any number of tokens. Empty with no CPUs.
pub fn balanced(work: &[Duration], cpus: &[usize]) -> (Vec<usize>, Duration) {
    if cpus.is_empty() {
        return (Vec::new(), Duration::ZERO);
    }
    let mut load = vec![Duration::ZERO; cpus.len()];
    let mut on = vec![0usize; work.len()];
    let mut order: Vec<usize> = (0..work.len()).collect();
    order.sort_by(|&a, &b| work[b].cmp(&work[a]).then(a.cmp(&b)));
    for i in order {
        // Invariant: `load` is not empty (cpus is not).
        let (c, _) = load.iter().enumerate().min_by_key(|(c, l)| (**l, *c)).expect("a CPU");
        load[c] += work[i];
        on[i] = cpus[c];
    }
    (on, load.into_iter().max().unwrap_or_default())
}

/// The ring itself; with `cpus`, each thread pinned first (`None` if that fails).
fn ring(work: &[Duration], tokens: usize, run_for: Duration, cpus: Option<&[usize]>) -> Option<f64> {
    let n = work.len().max(1);
    let slots: Arc<Vec<Slot>> = Arc::new((0..n).map(|_| Slot::default()).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let unpinned = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (slots, stop, done, unpinned) = (slots.clone(), stop.clone(), done.clone(), unpinned.clone());
            let work = work.get(i).copied().unwrap_or_default();
            let cpu = cpus.map(|c| c.get(i).copied());
            std::thread::spawn(move || {
                if let Some(cpu) = cpu {
                    if !cpu.is_some_and(pin) {
                        unpinned.store(true, Ordering::Release);
                    }
                }
                stage(i, &slots, work, &stop, &done)
            })
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
    (!unpinned.load(Ordering::Acquire)).then_some(rate)
}

/// Keeps the calling thread on `cpu` (Linux); false where it cannot.
fn pin(cpu: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: a zeroed cpu_set_t is a valid empty set, `cpu` is inside it (checked
        // above), and the call reads no further than the size given.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        false
    }
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

    #[test]
    fn stages_are_spread_over_the_cpus_heaviest_first() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        // The heaviest alone, the two others together: 50 against 25 + 45.
        assert_eq!(balanced(&ms(&[25, 50, 45]), &[0, 1]), (vec![1, 0, 1], Duration::from_millis(70)));
        assert_eq!(balanced(&ms(&[4, 4, 4]), &[2, 5]), (vec![2, 5, 2], Duration::from_millis(8)));
        assert_eq!(balanced(&ms(&[1, 2, 3]), &[0, 1, 2, 3]).1, Duration::from_millis(3));
        assert_eq!(balanced(&ms(&[1, 2]), &[]), (vec![], Duration::ZERO));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_ring_pinned_to_one_cpu_shares_it() {
        // Two tokens round three 2 ms stages: on two free cores up to ~333 a second;
        // all three threads on one CPU, at most what one core computes, ~167. More
        // would mean the threads were not pinned.
        let allowed = allowed_cpus();
        let Some(&cpu) = allowed.first() else { return };
        // Pinning takes: the pinned thread may run on that CPU alone.
        let only = std::thread::spawn(move || (pin(cpu), allowed_cpus())).join().expect("the thread ran");
        assert_eq!(only, (true, vec![cpu]));
        assert_eq!(allowed_cpus(), allowed, "the calling thread is not pinned");
        let work = [Duration::from_millis(2); 3];
        let rate = tokens_per_s_pinned(&work, 2, Duration::from_secs(1), &[cpu; 3]).expect("pinned");
        assert!(rate > 0.0 && rate <= 1000.0 / 6.0 * 1.05, "{rate}");
        // A CPU that does not exist, or one this process may not use, cannot be pinned
        // to: no figure rather than a wrong one.
        assert_eq!(tokens_per_s_pinned(&work, 1, Duration::from_millis(100), &[usize::MAX; 3]), None);
        if let Some(other) = (0..libc::CPU_SETSIZE as usize).find(|c| !allowed.contains(c)) {
            assert_eq!(tokens_per_s_pinned(&work, 1, Duration::from_millis(100), &[other; 3]), None);
        }
    }
}
