//! Link probing over a node's own QUIC connections ([`alpn::PROBE`](crate::alpn::PROBE)):
//! how long a decode-sized frame takes from one node to the next when the receiver has
//! idled between tokens (as a pipeline stage does) and when it is busy (kept awake),
//! and the bandwidth bulk transfers get, for prefill frames. The planner's link profiles come from here.
//!
//! The protocol is one bidirectional stream per exchange: the asker writes an 8-byte
//! header `[payload_len: u32 BE][reply_len: u32 BE]`, then `payload_len` bytes, and
//! finishes; the server reads them all and answers `reply_len` zero bytes. The payload
//! is bounded by [`MAX_PROBE_BYTES`], the reply by [`MAX_FRAME_BYTES`] (the bulk
//! transfer goes one way only), and a connection gets one exchange at a time, each
//! within [`EXCHANGE_TIMEOUT`]: a peer cannot make a node send much.

use std::time::{Duration, Instant};

/// The most bytes an asker may send in one exchange (the bulk transfer).
pub const MAX_PROBE_BYTES: u32 = 16 << 20;
/// The largest frame probed, and the largest reply a server sends.
pub const MAX_FRAME_BYTES: u32 = 256 << 10;
/// An exchange that takes longer ends.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The connection or a stream failed.
    #[error("link probe: {0}")]
    Stream(String),
    /// A length over the limits was asked for (or a frame of 0 bytes).
    #[error("link probe: {0} bytes is out of bounds (frames 1..={MAX_FRAME_BYTES}, bulk ≤ {MAX_PROBE_BYTES}: over the limit)")]
    TooLarge(u32),
    /// The exchange took longer than [`EXCHANGE_TIMEOUT`].
    #[error("link probe: no answer within {} s", EXCHANGE_TIMEOUT.as_secs())]
    Timeout,
}

/// What a probe measured on one link, in the direction asker → server.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkMeasure {
    /// QUIC's smoothed round-trip time after the probe, ms.
    pub rtt_ms: f64,
    /// One-way time of a `frame_bytes` frame to a receiver that idled `idle_ms`: half the
    /// median echo time, ms. Includes the network stacks and the wake-ups on both sides.
    pub frame_ms: f64,
    /// The same back to back (the receiver busy or kept awake): the link and the two
    /// stacks without the wake-up, ms.
    pub hot_frame_ms: f64,
    /// What waking the receiver after an idle pause adds to a frame: the median echo
    /// after the pause less the median echo back to back (one wake-up, not halved), ms.
    pub wake_ms: f64,
    /// The frame size probed, bytes.
    pub frame_bytes: u32,
    /// How long the receiver idled before each frame, ms.
    pub idle_ms: f64,
    /// Throughput of a bulk transfer (its time less one echo), Mbit/s.
    pub mbit_per_s: f64,
    /// Echoes timed.
    pub samples: u32,
}

/// How a link is probed.
#[derive(Clone, Copy, Debug)]
pub struct ProbeOptions {
    /// Frame size (a decode step's hidden state: `n_embd` × 4 bytes).
    pub frame_bytes: u32,
    /// Echoes timed.
    pub rounds: u32,
    /// Pause before each echo (a stage idles between tokens).
    pub idle: Duration,
    /// Bytes of the bulk transfer (0: no bandwidth measurement).
    pub bulk_bytes: u32,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions { frame_bytes: 4096, rounds: 21, idle: Duration::from_millis(10), bulk_bytes: 4 << 20 }
    }
}

/// Serve probes on an accepted connection until it closes, one exchange at a time
/// (an asker times them one after the other anyway); a peer asking for too much gets
/// its stream reset, nothing more.
pub async fn serve(conn: quinn::Connection) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        match tokio::time::timeout(EXCHANGE_TIMEOUT, answer(send, recv)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!("probe exchange ended: {e}"),
            Err(_) => tracing::debug!("probe exchange timed out"),
        }
    }
}

async fn answer(mut send: quinn::SendStream, mut recv: quinn::RecvStream) -> Result<(), ProbeError> {
    let stream = |e: &dyn std::fmt::Display| ProbeError::Stream(e.to_string());
    let mut header = [0u8; 8];
    recv.read_exact(&mut header).await.map_err(|e| stream(&e))?;
    let (payload, reply) = lengths(header);
    for (n, max) in [(payload, MAX_PROBE_BYTES), (reply, MAX_FRAME_BYTES)] {
        if n > max {
            let _ = send.reset(1u32.into());
            return Err(ProbeError::TooLarge(n));
        }
    }
    let mut left = payload as usize;
    while left > 0 {
        match recv.read_chunk(left, true).await.map_err(|e| stream(&e))? {
            Some(chunk) => left -= chunk.bytes.len().min(left),
            None => return Err(ProbeError::Stream("the payload ended early".into())),
        }
    }
    write_zeros(&mut send, reply).await?;
    send.finish().map_err(|e| stream(&e))
}

/// Probe the link of `conn` (whose peer serves [`serve`]).
pub async fn measure(conn: &quinn::Connection, opts: &ProbeOptions) -> Result<LinkMeasure, ProbeError> {
    if opts.frame_bytes == 0 || opts.frame_bytes > MAX_FRAME_BYTES {
        return Err(ProbeError::TooLarge(opts.frame_bytes));
    }
    if opts.bulk_bytes > MAX_PROBE_BYTES {
        return Err(ProbeError::TooLarge(opts.bulk_bytes));
    }
    // One untimed echo first: the connection's first streams pay for flow-control
    // windows opening.
    exchange(conn, opts.frame_bytes, opts.frame_bytes).await?;
    let mut echoes = Vec::with_capacity(opts.rounds as usize);
    for _ in 0..opts.rounds.max(1) {
        tokio::time::sleep(opts.idle).await;
        echoes.push(exchange(conn, opts.frame_bytes, opts.frame_bytes).await?);
    }
    let mut hot = Vec::with_capacity(opts.rounds as usize);
    for _ in 0..opts.rounds.max(1) {
        hot.push(exchange(conn, opts.frame_bytes, opts.frame_bytes).await?);
    }
    let echo_ms = median(&mut echoes);
    let hot_ms = median(&mut hot);
    let mbit_per_s = if opts.bulk_bytes == 0 {
        0.0
    } else {
        // A first transfer, untimed, opens the congestion window (slow start would
        // otherwise make a long link look narrow).
        exchange(conn, opts.bulk_bytes / 4, 1).await?;
        let total = exchange(conn, opts.bulk_bytes, 1).await?;
        // The bulk exchange also paid one round trip; what is left is the transfer. A
        // floor keeps a loopback link from dividing by (almost) zero.
        let transfer_ms = (total - hot_ms).max(total * 0.05).max(1e-3);
        f64::from(opts.bulk_bytes) * 8.0 / (transfer_ms * 1000.0)
    };
    Ok(LinkMeasure {
        rtt_ms: conn.rtt().as_secs_f64() * 1000.0,
        frame_ms: echo_ms / 2.0,
        hot_frame_ms: hot_ms / 2.0,
        wake_ms: (echo_ms - hot_ms).max(0.0),
        frame_bytes: opts.frame_bytes,
        idle_ms: opts.idle.as_secs_f64() * 1000.0,
        mbit_per_s,
        samples: echoes.len() as u32,
    })
}

/// One exchange: send `payload` bytes, wait for `reply` bytes; its time in ms.
async fn exchange(conn: &quinn::Connection, payload: u32, reply: u32) -> Result<f64, ProbeError> {
    tokio::time::timeout(EXCHANGE_TIMEOUT, exchange_once(conn, payload, reply))
        .await
        .map_err(|_| ProbeError::Timeout)?
}

async fn exchange_once(conn: &quinn::Connection, payload: u32, reply: u32) -> Result<f64, ProbeError> {
    let stream = |e: &dyn std::fmt::Display| ProbeError::Stream(e.to_string());
    let start = Instant::now();
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| stream(&e))?;
    let mut header = [0u8; 8];
    header[..4].copy_from_slice(&payload.to_be_bytes());
    header[4..].copy_from_slice(&reply.to_be_bytes());
    send.write_all(&header).await.map_err(|e| stream(&e))?;
    write_zeros(&mut send, payload).await?;
    send.finish().map_err(|e| stream(&e))?;
    let mut left = reply as usize;
    while left > 0 {
        match recv.read_chunk(left, true).await.map_err(|e| stream(&e))? {
            Some(chunk) => left -= chunk.bytes.len().min(left),
            None => return Err(ProbeError::Stream("the reply ended early".into())),
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1000.0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn lengths(header: [u8; 8]) -> (u32, u32) {
    let [a, b, c, d, e, f, g, h] = header;
    (u32::from_be_bytes([a, b, c, d]), u32::from_be_bytes([e, f, g, h]))
}

async fn write_zeros(send: &mut quinn::SendStream, n: u32) -> Result<(), ProbeError> {
    static BLOCK: [u8; 64 << 10] = [0; 64 << 10];
    let mut left = n as usize;
    while left > 0 {
        let k = left.min(BLOCK.len());
        send.write_all(&BLOCK[..k]).await.map_err(|e| ProbeError::Stream(e.to_string()))?;
        left -= k;
    }
    Ok(())
}
