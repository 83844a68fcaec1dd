//! Pipeline frames: a fixed 40-byte little-endian header and a payload. Decoding
//! checks every field against the receiver's limits before anything is allocated
//! or trusted: a frame from the network gives a value or an error, never a panic.
//!
//! ```text
//! 0  magic "SF"      2  version u8      3  kind u8
//! 4  session u64     12 step u32        16 epoch u32
//! 20 first_pos u32   24 n_tokens u32    28 dtype u8     29 flags u8   30 reserved u16 (0)
//! 32 payload_len u32 36 sent_us u32                      40 payload
//! ```
//!
//! `sent_us` is the sender's wall clock in microseconds (mod 2³²) when the frame left
//! its protocol core: the receiver subtracts it from its own clock to measure the
//! hop's latency (wire and queues). Exact between processes of one host; across
//! hosts it is off by their clock offset, so it is a statistic, never a decision input.

/// Most alternatives a Token frame's log-probabilities list.
pub const MAX_TOP_LOGPROBS: usize = shoal_types::MAX_TOP_LOGPROBS as usize;

/// Header length in bytes.
pub const HEADER_LEN: usize = 40;
const MAGIC: [u8; 2] = *b"SF";
const VERSION: u8 = 2;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Opens a session along the chain (payload: session parameters, opaque bytes).
    Open = 1,
    /// Hidden states for positions `first_pos..first_pos + n_tokens`.
    Hidden = 2,
    /// Sampled token ids, tail → coordinator (dtype I32); or one token with its
    /// log-probabilities (dtype Bytes: the id, its logprob, then (id, logprob) pairs of
    /// the most likely tokens, all little-endian 32-bit, at most [`MAX_TOP_LOGPROBS`]).
    Token = 3,
    /// Ends a session; stages free it. The tail's answer carries the logits digest.
    Close = 4,
    /// A refusal, with a UTF-8 reason; travels on to the coordinator.
    Error = 5,
    /// A stage does not hold the positions before this step (it restarted, or frames
    /// were lost): the coordinator replays the session.
    Lost = 6,
}

/// Element type of the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Dtype {
    /// Opaque bytes (Open, Close, Error).
    Bytes = 0,
    /// 32-bit token ids.
    I32 = 1,
    /// 32-bit floats: the default for hidden states, exact.
    F32 = 2,
    /// 16-bit floats: half the bytes, not bit-exact.
    F16 = 3,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::Bytes => 1,
            Dtype::F16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
        }
    }
}

/// This host's wall clock in microseconds, mod 2³² (never 0, which means unstamped).
pub fn wall_us() -> u32 {
    let us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros());
    (us as u32).max(1)
}

/// Flag: the tail should sample and return a token for this step.
pub const FLAG_SAMPLE: u8 = 1;
/// Flag: a speculative verify step. Its Hidden frames carry, after the hidden states,
/// the step's input token ids (`n_tokens` i32: the last emitted token, then the
/// drafts); the tail computes every position's logits, samples row by row while the
/// samples equal the drafts, and answers with every token it sampled.
pub const FLAG_VERIFY: u8 = 2;

/// One frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// What it carries.
    pub kind: FrameKind,
    /// The generation it belongs to.
    pub session: u64,
    /// Step number within the session (prompt chunks, then one per token).
    pub step: u32,
    /// Session epoch: bumped when the session restarts, so stale frames are told apart.
    pub epoch: u32,
    /// First position the payload covers.
    pub first_pos: u32,
    /// Tokens the payload covers.
    pub n_tokens: u32,
    /// Element type.
    pub dtype: Dtype,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// Sender's wall clock (µs, mod 2³²) when the frame was sent; 0 when not stamped.
    /// Only for latency statistics ([`wall_us`], [`Frame::age_us`]).
    pub sent_us: u32,
}

/// What a receiver accepts.
#[derive(Clone, Copy, Debug)]
pub struct FrameLimits {
    /// Hidden-state width of the model.
    pub n_embd: u32,
    /// Most tokens in one frame (the chunk size C).
    pub max_tokens: u32,
    /// Most payload bytes of an Open/Close/Error frame.
    pub max_message: u32,
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame of {0} bytes is shorter than its {HEADER_LEN}-byte header")]
    Short(usize),
    #[error("bad magic {0:02x?}")]
    Magic([u8; 2]),
    #[error("unsupported frame version {0}")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("unknown dtype {0}")]
    Dtype(u8),
    #[error("dtype {dtype:?} is not valid for a {kind:?} frame")]
    DtypeForKind { kind: FrameKind, dtype: Dtype },
    #[error("{n} tokens in one frame (1..={max} allowed)")]
    Tokens { n: u32, max: u32 },
    #[error("payload of {got} bytes, expected {want}")]
    Length { got: usize, want: usize },
    #[error("reserved header bytes are not zero")]
    Reserved,
}

impl Frame {
    /// Hidden states as f32 (exact) for `n_tokens` tokens.
    pub fn hidden(
        session: u64,
        step: u32,
        epoch: u32,
        first_pos: u32,
        values: &[f32],
        n_embd: u32,
        dtype: Dtype,
    ) -> Frame {
        let n_tokens = (values.len() / n_embd.max(1) as usize) as u32;
        let payload = match dtype {
            Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let dtype = if dtype == Dtype::F16 { Dtype::F16 } else { Dtype::F32 };
        Frame {
            kind: FrameKind::Hidden,
            session,
            step,
            epoch,
            first_pos,
            n_tokens,
            dtype,
            flags: 0,
            payload,
            sent_us: 0,
        }
    }

    /// A frame carrying opaque bytes (Open, Close, Error).
    pub fn message(kind: FrameKind, session: u64, step: u32, epoch: u32, bytes: Vec<u8>) -> Frame {
        Frame {
            kind,
            session,
            step,
            epoch,
            first_pos: 0,
            n_tokens: 0,
            dtype: Dtype::Bytes,
            flags: 0,
            payload: bytes,
            sent_us: 0,
        }
    }

    /// Token ids.
    pub fn tokens(session: u64, step: u32, epoch: u32, first_pos: u32, tokens: &[i32]) -> Frame {
        Frame {
            kind: FrameKind::Token,
            session,
            step,
            epoch,
            first_pos,
            n_tokens: tokens.len() as u32,
            dtype: Dtype::I32,
            flags: 0,
            payload: tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
            sent_us: 0,
        }
    }

    /// Serialise.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind as u8);
        out.extend_from_slice(&self.session.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.first_pos.to_le_bytes());
        out.extend_from_slice(&self.n_tokens.to_le_bytes());
        out.push(self.dtype as u8);
        out.push(self.flags);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.sent_us.to_le_bytes());
        out.extend_from_slice(&self.payload);
        out
    }

    /// Parse and validate `bytes` against `limits`.
    pub fn decode(bytes: &[u8], limits: &FrameLimits) -> Result<Frame, FrameError> {
        if bytes.len() < HEADER_LEN {
            return Err(FrameError::Short(bytes.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let magic = [bytes[0], bytes[1]];
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        if bytes[2] != VERSION {
            return Err(FrameError::Version(bytes[2]));
        }
        let kind = match bytes[3] {
            1 => FrameKind::Open,
            2 => FrameKind::Hidden,
            3 => FrameKind::Token,
            4 => FrameKind::Close,
            5 => FrameKind::Error,
            6 => FrameKind::Lost,
            k => return Err(FrameError::Kind(k)),
        };
        let dtype = match bytes[28] {
            0 => Dtype::Bytes,
            1 => Dtype::I32,
            2 => Dtype::F32,
            3 => Dtype::F16,
            d => return Err(FrameError::Dtype(d)),
        };
        if bytes[30] != 0 || bytes[31] != 0 {
            return Err(FrameError::Reserved);
        }
        let n_tokens = u32_at(24);
        let payload_len = u32_at(32) as usize;
        let payload = &bytes[HEADER_LEN..];
        let want = match (kind, dtype) {
            (FrameKind::Hidden, Dtype::F32 | Dtype::F16) | (FrameKind::Token, Dtype::I32) => {
                if n_tokens == 0 || n_tokens > limits.max_tokens {
                    return Err(FrameError::Tokens { n: n_tokens, max: limits.max_tokens });
                }
                let per_token = if kind == FrameKind::Hidden { limits.n_embd as usize } else { 1 };
                // A verify step's Hidden frame carries its token ids too.
                let ids =
                    if kind == FrameKind::Hidden && bytes[29] & FLAG_VERIFY != 0 { n_tokens as usize * 4 } else { 0 };
                n_tokens as usize * per_token * dtype.size() + ids
            }
            (FrameKind::Token, Dtype::Bytes) => {
                // One token with its log-probabilities: 8 bytes, then 8 per alternative.
                let alternatives = payload_len.checked_sub(8).map(|b| (b / 8, b % 8));
                if n_tokens != 1 || !matches!(alternatives, Some((k, 0)) if k <= MAX_TOP_LOGPROBS) {
                    return Err(FrameError::Length { got: payload_len, want: 8 + 8 * MAX_TOP_LOGPROBS });
                }
                payload_len
            }
            (FrameKind::Open | FrameKind::Close | FrameKind::Error | FrameKind::Lost, Dtype::Bytes) => {
                if payload_len > limits.max_message as usize {
                    return Err(FrameError::Length { got: payload_len, want: limits.max_message as usize });
                }
                payload_len
            }
            _ => return Err(FrameError::DtypeForKind { kind, dtype }),
        };
        if payload_len != want || payload.len() != want {
            return Err(FrameError::Length { got: payload.len().min(payload_len), want });
        }
        Ok(Frame {
            kind,
            session: u64::from_le_bytes(bytes[4..12].try_into().map_err(|_| FrameError::Short(bytes.len()))?),
            step: u32_at(12),
            epoch: u32_at(16),
            first_pos: u32_at(20),
            n_tokens,
            dtype,
            flags: bytes[29],
            payload: payload.to_vec(),
            sent_us: u32_at(36),
        })
    }

    /// Microseconds since the sender stamped this frame, by this host's clock (`None`
    /// when unstamped or when the sender's clock is ahead of ours).
    pub fn age_us(&self) -> Option<u32> {
        if self.sent_us == 0 {
            return None;
        }
        let age = wall_us().wrapping_sub(self.sent_us);
        // Ages over ~35 minutes are a clock ahead of ours (wrapped negative).
        (age < 1 << 31).then_some(age)
    }

    /// The hidden states, as f32 (converted from f16 if sent so).
    pub fn hidden_values(&self) -> Vec<f32> {
        let values = &self.payload[..self.payload.len() - self.step_token_bytes()];
        match self.dtype {
            Dtype::F16 => values.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            _ => values.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        }
    }

    /// Mark a Hidden frame as a verify step carrying its input token ids
    /// ([`FLAG_VERIFY`]); `tokens` must number `n_tokens`.
    pub fn with_step_tokens(mut self, tokens: &[i32]) -> Frame {
        debug_assert_eq!(tokens.len(), self.n_tokens as usize);
        self.flags |= FLAG_VERIFY;
        self.payload.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        self
    }

    /// A verify step's input token ids (empty for other frames).
    pub fn step_tokens(&self) -> Vec<i32> {
        let n = self.step_token_bytes();
        self.payload[self.payload.len() - n..]
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Bytes at the end of the payload that hold a verify step's token ids (decode
    /// checked that they are there).
    fn step_token_bytes(&self) -> usize {
        if self.kind == FrameKind::Hidden && self.flags & FLAG_VERIFY != 0 {
            (self.n_tokens as usize * 4).min(self.payload.len())
        } else {
            0
        }
    }

    /// One sampled token with its log-probabilities ([`FrameKind::Token`], dtype Bytes).
    pub fn token_with_logprobs(
        session: u64,
        step: u32,
        epoch: u32,
        first_pos: u32,
        token: i32,
        lp: &shoal_types::TokenLogprobs,
    ) -> Frame {
        let top = &lp.top[..lp.top.len().min(MAX_TOP_LOGPROBS)];
        let mut payload = Vec::with_capacity(8 + 8 * top.len());
        payload.extend_from_slice(&token.to_le_bytes());
        payload.extend_from_slice(&lp.logprob.to_le_bytes());
        for (t, x) in top {
            payload.extend_from_slice(&t.to_le_bytes());
            payload.extend_from_slice(&x.to_le_bytes());
        }
        Frame { dtype: Dtype::Bytes, payload, ..Frame::tokens(session, step, epoch, first_pos, &[token]) }
    }

    /// The token ids of a Token frame.
    pub fn token_ids(&self) -> Vec<i32> {
        let ids = match self.dtype {
            // With log-probabilities: the one token, first.
            Dtype::Bytes => &self.payload[..self.payload.len().min(4)],
            _ => &self.payload[..],
        };
        ids.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    /// The log-probabilities a Token frame carries, if any.
    pub fn token_logprobs(&self) -> Option<shoal_types::TokenLogprobs> {
        if self.kind != FrameKind::Token || self.dtype != Dtype::Bytes || self.payload.len() < 8 {
            return None;
        }
        let word = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        let top = self.payload[8..]
            .chunks_exact(8)
            .map(|p| (i32::from_le_bytes(word(&p[..4])), f32::from_le_bytes(word(&p[4..]))))
            .collect();
        Some(shoal_types::TokenLogprobs { logprob: f32::from_le_bytes(word(&self.payload[4..8])), top })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: FrameLimits = FrameLimits { n_embd: 4, max_tokens: 8, max_message: 64 };

    #[test]
    fn a_token_with_logprobs_round_trips_and_bad_lengths_are_refused() {
        let lp = shoal_types::TokenLogprobs { logprob: -0.5, top: vec![(7, -0.5), (3, -1.25)] };
        let f = Frame::token_with_logprobs(9, 4, 1, 12, 7, &lp);
        let back = Frame::decode(&f.encode(), &L).unwrap();
        assert_eq!((back.kind, back.token_ids(), back.first_pos), (FrameKind::Token, vec![7], 12));
        assert_eq!(back.token_logprobs(), Some(lp));
        assert_eq!(Frame::tokens(9, 4, 1, 12, &[7]).token_logprobs(), None);
        // Not a whole number of pairs, more pairs than allowed, or two tokens: refused.
        for (n_tokens, len) in [(1u32, 12usize), (1, 8 + 8 * (MAX_TOP_LOGPROBS + 1)), (2, 16), (1, 4)] {
            let mut b = f.encode();
            b.truncate(HEADER_LEN);
            b[24..28].copy_from_slice(&n_tokens.to_le_bytes());
            b[32..36].copy_from_slice(&(len as u32).to_le_bytes());
            b.resize(HEADER_LEN + len, 0);
            let limits = FrameLimits { max_message: 4096, ..L };
            assert!(matches!(Frame::decode(&b, &limits), Err(FrameError::Length { .. })), "{n_tokens} {len}");
        }
    }

    #[test]
    fn a_verify_step_carries_its_tokens() {
        let h = Frame::hidden(7, 3, 1, 10, &[1.0, -2.5, 3.25, 0.0, 5.0, 6.0, 7.0, 8.0], 4, Dtype::F32);
        let v = h.clone().with_step_tokens(&[11, 12]);
        let d = Frame::decode(&v.encode(), &L).unwrap();
        assert_eq!(d.flags & FLAG_VERIFY, FLAG_VERIFY);
        assert_eq!(d.hidden_values(), h.hidden_values());
        assert_eq!(d.step_tokens(), vec![11, 12]);
        assert!(h.step_tokens().is_empty());
        // The flag without the ids, or the ids without the flag: refused.
        let mut b = h.encode();
        b[29] |= FLAG_VERIFY;
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::Length { .. })));
        let mut b = v.encode();
        b[29] &= !FLAG_VERIFY;
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::Length { .. })));
    }

    #[test]
    fn frames_round_trip() {
        let h = Frame::hidden(7, 3, 1, 10, &[1.0, -2.5, 3.25, 0.0, 5.0, 6.0, 7.0, 8.0], 4, Dtype::F32);
        let d = Frame::decode(&h.encode(), &L).unwrap();
        assert_eq!(d, h);
        assert_eq!(d.hidden_values(), vec![1.0, -2.5, 3.25, 0.0, 5.0, 6.0, 7.0, 8.0]);
        let half = Frame::hidden(7, 3, 1, 10, &[1.0, -2.5, 3.25, 0.1], 4, Dtype::F16);
        let v = Frame::decode(&half.encode(), &L).unwrap().hidden_values();
        assert_eq!(&v[..3], &[1.0, -2.5, 3.25]);
        assert!((v[3] - 0.1).abs() < 1e-3);
        let t = Frame::tokens(7, 4, 1, 12, &[42]);
        assert_eq!(Frame::decode(&t.encode(), &L).unwrap().token_ids(), vec![42]);
        let o = Frame::message(FrameKind::Open, 7, 0, 1, b"{}".to_vec());
        assert_eq!(Frame::decode(&o.encode(), &L).unwrap(), o);
    }

    #[test]
    fn the_send_stamp_travels_and_gives_an_age() {
        let mut t = Frame::tokens(7, 4, 1, 12, &[42]);
        assert_eq!(t.age_us(), None, "unstamped");
        t.sent_us = wall_us().wrapping_sub(1500);
        let d = Frame::decode(&t.encode(), &L).unwrap();
        assert_eq!(d.sent_us, t.sent_us);
        let age = d.age_us().unwrap();
        assert!((1500..1_000_000).contains(&age), "{age}");
        // A sender clock ahead of ours gives no age rather than a huge one.
        t.sent_us = wall_us().wrapping_add(5_000_000);
        assert_eq!(t.age_us(), None);
    }

    #[test]
    fn malformed_frames_are_refused() {
        let good = Frame::hidden(1, 0, 0, 0, &[0.5; 8], 4, Dtype::F32).encode();
        let mut b = good.clone();
        b.truncate(good.len() - 4);
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::Length { .. })));
        assert_eq!(Frame::decode(&good[..10], &L), Err(FrameError::Short(10)));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::Magic(_))));
        let mut b = good.clone();
        b[28] = 9;
        assert_eq!(Frame::decode(&b, &L), Err(FrameError::Dtype(9)));
        let mut b = good.clone();
        b[28] = Dtype::I32 as u8;
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::DtypeForKind { .. })));
        let mut b = good.clone();
        b[24..28].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(Frame::decode(&b, &L), Err(FrameError::Tokens { n: 9, .. })));
        let mut b = good.clone();
        b[3] = 77;
        assert_eq!(Frame::decode(&b, &L), Err(FrameError::Kind(77)));
        let mut b = good.clone();
        b[30] = 1;
        assert_eq!(Frame::decode(&b, &L), Err(FrameError::Reserved));
        // Header claims a longer payload than the limits allow for messages.
        let mut m = Frame::message(FrameKind::Error, 1, 0, 0, vec![b'x'; 65]).encode();
        assert!(matches!(Frame::decode(&m, &L), Err(FrameError::Length { .. })));
        m[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Frame::decode(&m, &L).is_err());
    }

    #[test]
    fn every_truncation_and_byte_flip_is_handled() {
        let good = Frame::tokens(1, 2, 3, 4, &[5, 6]).encode();
        for cut in 0..good.len() {
            assert!(Frame::decode(&good[..cut], &L).is_err());
        }
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut b = good.clone();
                b[i] ^= 1 << bit;
                let _ = Frame::decode(&b, &L);
            }
        }
    }
}
