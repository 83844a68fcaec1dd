//! A userspace impairment layer for tests and benchmarks: a wrapper around the QUIC
//! socket that delays (with jitter), drops and rate-limits outgoing datagrams, because
//! this kernel has no `tc netem`. Enabled only through an explicit option (`--impair`);
//! never on by default.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// What to do to outgoing datagrams.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Impairment {
    /// Added to every datagram.
    pub delay: Duration,
    /// Plus a uniform random extra in `[-jitter, +jitter]` (never below zero).
    pub jitter: Duration,
    /// Fraction of datagrams dropped (0.0 ..= 1.0).
    pub loss: f64,
    /// The link's rate, bits per second (0: unlimited): datagrams leave one after the
    /// other at this rate, queued behind each other, and a datagram that would wait more
    /// than [`QUEUE_LIMIT`] is dropped, as a router's full buffer drops it (so that
    /// congestion control sees a link of this speed, not an ever-growing delay).
    pub rate_bps: u64,
}

/// Longest a datagram waits in a rate-limited link's queue before it is dropped.
pub const QUEUE_LIMIT: Duration = Duration::from_millis(50);

impl Impairment {
    /// Does this impair anything?
    pub fn is_none(&self) -> bool {
        self.delay.is_zero() && self.jitter.is_zero() && self.loss == 0.0 && self.rate_bps == 0
    }
}

impl FromStr for Impairment {
    type Err = String;

    /// `delay=3ms,jitter=2ms,loss=1%,rate=100mbit` (any subset; `us`, `ms`, `s`; loss as %
    /// or fraction; rate in `kbit`, `mbit` or `gbit` per second).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = Impairment::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected key=value"))?;
            match k.trim() {
                "delay" => out.delay = duration(v)?,
                "jitter" => out.jitter = duration(v)?,
                "loss" => {
                    let v = v.trim();
                    let f = match v.strip_suffix('%') {
                        Some(p) => p.trim().parse::<f64>().map(|p| p / 100.0),
                        None => v.parse::<f64>(),
                    }
                    .map_err(|_| format!("loss {v:?} is not a number"))?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(format!("loss {v:?} is outside 0..100%"));
                    }
                    out.loss = f;
                }
                "rate" => out.rate_bps = rate(v)?,
                other => return Err(format!("unknown impairment {other:?} (delay, jitter, loss, rate)")),
            }
        }
        Ok(out)
    }
}

fn rate(v: &str) -> Result<u64, String> {
    let v = v.trim();
    let (num, unit) = v.split_at(v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len()));
    let n: f64 = num.trim().parse().map_err(|_| format!("{v:?} is not a rate"))?;
    let scale = match unit {
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        _ => return Err(format!("{v:?}: unit must be kbit, mbit or gbit")),
    };
    let bps = n * scale;
    if !(1e4..=1e11).contains(&bps) {
        return Err(format!("{v:?} is out of range (10kbit..100gbit)"));
    }
    Ok(bps as u64)
}

fn duration(v: &str) -> Result<Duration, String> {
    let v = v.trim();
    let (num, unit) = v.split_at(v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len()));
    let n: f64 = num.trim().parse().map_err(|_| format!("{v:?} is not a duration"))?;
    let secs = match unit {
        "us" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        _ => return Err(format!("{v:?}: unit must be us, ms or s")),
    };
    if !(0.0..=60.0).contains(&secs) {
        return Err(format!("{v:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The wrapping socket.
pub struct ImpairedSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    spec: Impairment,
    /// xorshift state for loss and jitter.
    rng: Mutex<u64>,
    /// Datagrams waiting for their send time, handed to the delay-line thread.
    line: Mutex<std::sync::mpsc::Sender<Delayed>>,
    /// With a rate: when the link finishes sending what is queued on it.
    link_free: Mutex<std::time::Instant>,
}

/// A datagram and when to send it.
struct Delayed {
    at: std::time::Instant,
    seq: u64,
    destination: SocketAddr,
    ecn: Option<quinn::udp::EcnCodepoint>,
    contents: Vec<u8>,
    src_ip: Option<std::net::IpAddr>,
}

impl PartialEq for Delayed {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Delayed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

impl fmt::Debug for ImpairedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImpairedSocket").field("spec", &self.spec).finish()
    }
}

impl ImpairedSocket {
    /// Wrap `inner`. Delayed datagrams are sent by a thread of their own that sleeps
    /// precisely until each is due (tokio's timer would round every delay up to the
    /// next millisecond, distorting what benchmarks measure).
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, spec: Impairment) -> Self {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1;
        let (tx, rx) = std::sync::mpsc::channel::<Delayed>();
        let out = inner.clone();
        // Invariant: spawning fails only when the process is out of threads or memory, and
        // this is a test/bench option: failing loudly there is right.
        std::thread::Builder::new()
            .name("impair".into())
            .spawn(move || delay_line(out, rx))
            .expect("spawning the impairment thread");
        Self {
            inner,
            spec,
            rng: Mutex::new(seed),
            line: Mutex::new(tx),
            link_free: Mutex::new(std::time::Instant::now()),
        }
    }

    fn random(&self) -> f64 {
        // A poisoned lock holds a valid u64 all the same.
        let mut s = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Sends each datagram when it is due; ends when the socket is dropped.
fn delay_line(out: Arc<dyn AsyncUdpSocket>, rx: std::sync::mpsc::Receiver<Delayed>) {
    use std::collections::BinaryHeap;
    let mut heap: BinaryHeap<std::cmp::Reverse<Delayed>> = BinaryHeap::new();
    loop {
        let now = std::time::Instant::now();
        while heap.peek().is_some_and(|d| d.0.at <= now) {
            if let Some(std::cmp::Reverse(d)) = heap.pop() {
                let t = Transmit {
                    destination: d.destination,
                    ecn: d.ecn,
                    contents: &d.contents,
                    segment_size: None,
                    src_ip: d.src_ip,
                };
                // A full socket buffer drops the datagram, as a congested link would.
                let _ = out.try_send(&t);
            }
        }
        let next = match heap.peek() {
            Some(d) => rx.recv_timeout(d.0.at.saturating_duration_since(now)),
            None => rx.recv().map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(d) => heap.push(std::cmp::Reverse(d)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

impl AsyncUdpSocket for ImpairedSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        if self.spec.loss > 0.0 && self.random() < self.spec.loss {
            return Ok(()); // lost on the air
        }
        let jitter = self.spec.jitter.as_secs_f64() * (2.0 * self.random() - 1.0);
        let mut delay = Duration::from_secs_f64((self.spec.delay.as_secs_f64() + jitter).max(0.0));
        if self.spec.rate_bps > 0 {
            // Serialised behind what is queued: it leaves when the link is free and its
            // own bits are sent; dropped if that is too far off (a full buffer).
            let now = std::time::Instant::now();
            // A poisoned lock still holds a valid instant.
            let mut free = self.link_free.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*free).max(now);
            let bits = t.contents.len() as f64 * 8.0;
            let sending = Duration::from_secs_f64(bits / self.spec.rate_bps as f64);
            // Room for two datagrams at least, however slow the link.
            if start - now > QUEUE_LIMIT.max(sending * 2) {
                return Ok(());
            }
            *free = start + sending;
            delay += *free - now;
        }
        if delay.is_zero() {
            return self.inner.try_send(t);
        }
        let seq = (self.random() * u64::MAX as f64) as u64;
        let d = Delayed {
            at: std::time::Instant::now() + delay,
            seq,
            destination: t.destination,
            ecn: t.ecn,
            contents: t.contents.to_vec(),
            src_ip: t.src_ip,
        };
        // The thread lives as long as this socket; if it is gone the datagram is lost.
        let _ = self.line.lock().unwrap_or_else(|e| e.into_inner()).send(d);
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        1 // one datagram per transmit, so each is delayed and dropped on its own
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let i: Impairment = "delay=3ms, jitter=2ms, loss=1%".parse().unwrap();
        assert_eq!(
            i,
            Impairment { delay: Duration::from_millis(3), jitter: Duration::from_millis(2), loss: 0.01, rate_bps: 0 }
        );
        assert_eq!("loss=0.5".parse::<Impairment>().unwrap().loss, 0.5);
        assert_eq!("delay=500us".parse::<Impairment>().unwrap().delay, Duration::from_micros(500));
        assert!("".parse::<Impairment>().unwrap().is_none());
        assert_eq!("rate=100mbit".parse::<Impairment>().unwrap().rate_bps, 100_000_000);
        assert_eq!("rate=1.5gbit".parse::<Impairment>().unwrap().rate_bps, 1_500_000_000);
        assert!(!"rate=64kbit".parse::<Impairment>().unwrap().is_none());
        for bad in
            ["delay=3", "loss=150%", "speed=1", "delay", "delay=-1ms", "jitter=100s", "rate=5", "rate=1kbit", "rate=x"]
        {
            assert!(bad.parse::<Impairment>().is_err(), "{bad} accepted");
        }
    }
}
