//! Pairing: a new node joins with a short code shown by an existing member, and the code
//! never crosses the network, in the clear or otherwise. Pure: no sockets, no clock (the
//! caller passes `now_ms`); the only outside input is OS randomness.
//!
//! The exchange runs over a QUIC connection whose mutual TLS gave each side the other's
//! [`NodeId`]. It is SPAKE2 (a password-authenticated key exchange, Ed25519 group) with
//! both node ids as its identities, followed by key confirmation:
//!
//! ```text
//! joiner (A)                                          member (B)
//!   first   = pA  (33 bytes)           ─────────▶
//!                                      ◀─────────   reply = pB (33) || macB (32)
//!   checks macB: WrongCode if it fails
//!   conf    = macA (32 bytes)          ─────────▶
//!                                                   checks macA: WrongCode if it fails
//! macX = BLAKE3-keyed(K, labelX || joiner id || member id || pA || pB)
//! ```
//!
//! `K` is SPAKE2's shared key; it also depends on the code and both ids. The two labels
//! differ (and have the same length, so the MAC input parses one way only): neither MAC
//! can be reflected as the other.
//!
//! - An eavesdropper (who would first have to break the TLS around it) sees `pA` and
//!   `pB`, which reveal nothing it can test code guesses against offline.
//! - An active attacker gets one guess per exchange: from `pA`, the member's reply and
//!   the check of `macB`, a joiner learns whether the one code it committed to in `pA`
//!   was right, and nothing about any other code. A fake member likewise learns only
//!   whether its one guess matched. With 10^8 codes and [`Offers`] allowing 5 exchanges
//!   per code, a guesser's chance is at most 5 in 10^8.
//! - A relay in the middle (terminating TLS on both sides) cannot pass the exchange on:
//!   the ids each side saw differ, so the keys differ and the MACs fail.
//!
//! Why every begun exchange counts as an attempt: the joiner learns whether its guess
//! was right from `macB`, *before* it sends anything the member could judge. A guesser
//! simply never confirms a wrong guess, so a member that counted only failed
//! confirmations would give it unlimited guesses. Only a confirmed success is free (it
//! consumes the code).

use shoal_types::NodeId;
use spake2::{Ed25519Group, Identity, Password, Spake2};
use std::fmt;
use std::str::FromStr;

/// The number of distinct codes: 8 decimal digits.
const CODE_SPACE: u32 = 100_000_000;
/// Length of a SPAKE2 message: a side byte (`A`/`B`) and a compressed Edwards point.
const SPAKE_MSG_LEN: usize = 33;
/// Length of a confirmation MAC.
const MAC_LEN: usize = 32;
/// The member's reply: its SPAKE2 message, then its MAC.
const REPLY_LEN: usize = SPAKE_MSG_LEN + MAC_LEN;
/// MAC labels. Same length, so `label || fixed-length fields` is unambiguous.
const MEMBER_LABEL: &[u8; 20] = b"shoal pair member v1";
const JOINER_LABEL: &[u8; 20] = b"shoal pair joiner v1";

/// Why a pairing step failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PairError {
    /// The text is not a pairing code; says why, never echoing the input.
    #[error("not a pairing code: {0}")]
    BadCode(String),
    /// The other side used another code (or other node ids).
    #[error("the pairing code is wrong (or expired)")]
    WrongCode,
    /// The member has no code on offer.
    #[error("no pairing code is active on this node: run `shoal nodes pair` there")]
    NoOffer,
    /// The code has seen its maximum number of exchanges.
    #[error("too many attempts: this code is used up; make a new one with `shoal nodes pair`")]
    TooManyAttempts,
    /// An exchange came too soon after the previous one.
    #[error("attempts are too close together: try again in {wait_ms} ms")]
    TooSoon {
        /// How long until the next exchange is accepted.
        wait_ms: u64,
    },
    /// The code's time is up.
    #[error("the pairing code has expired; make a new one with `shoal nodes pair`")]
    Expired,
    /// A message of the exchange is malformed.
    #[error("malformed pairing message: {0}")]
    Protocol(String),
}

/// A pairing code: 8 decimal digits, shown as `1234-5678`.
///
/// Parsing accepts `12345678`, `1234 5678` and `1234-5678` (ASCII digits only), with
/// surrounding whitespace. `Debug` hides the digits, so a code does not end up in logs.
#[derive(Clone, PartialEq, Eq)]
pub struct PairingCode(u32);

impl PairingCode {
    /// A fresh code from OS randomness, uniform over all 10^8 codes (rejection
    /// sampling, no modulo bias).
    ///
    /// # Panics
    /// If the operating system's random number generator fails, which leaves nothing
    /// safe to do.
    pub fn generate() -> PairingCode {
        // The largest multiple of 10^8 that fits in a u32's range: 42 * 10^8.
        const ZONE: u64 = (1u64 << 32) / CODE_SPACE as u64 * CODE_SPACE as u64;
        loop {
            let mut buf = [0u8; 4];
            // Invariant: the OS RNG works; a node without one cannot pair (or do TLS).
            getrandom::getrandom(&mut buf).expect("the operating system's random number generator failed");
            let x = u32::from_le_bytes(buf);
            if u64::from(x) < ZONE {
                return PairingCode(x % CODE_SPACE);
            }
        }
    }

    /// The 8 ASCII digits: the SPAKE2 password.
    fn digits(&self) -> [u8; 8] {
        let mut out = [0u8; 8];
        let mut n = self.0;
        for d in out.iter_mut().rev() {
            // `n % 10` < 10, so the cast cannot truncate.
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        out
    }
}

impl fmt::Display for PairingCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:04}", self.0 / 10_000, self.0 % 10_000)
    }
}

impl fmt::Debug for PairingCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PairingCode(****-****)")
    }
}

impl FromStr for PairingCode {
    type Err = PairError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let len = s.chars().count();
        let bad_chars = || {
            PairError::BadCode(format!(
                "a pairing code has only the digits 0-9, with an optional '-' or space in the middle \
                 (got {len} characters)"
            ))
        };
        if !s.is_ascii() {
            return Err(bad_chars());
        }
        let bytes = s.as_bytes();
        let digits: Vec<u8> = match bytes.len() {
            8 => bytes.to_vec(),
            9 if matches!(bytes[4], b'-' | b' ') => bytes[..4].iter().chain(&bytes[5..]).copied().collect(),
            _ => {
                return Err(PairError::BadCode(format!(
                    "a pairing code is 8 digits, like 1234-5678 (got {len} characters)"
                )))
            }
        };
        if !digits.iter().all(u8::is_ascii_digit) {
            return Err(bad_chars());
        }
        Ok(PairingCode(digits.iter().fold(0u32, |n, d| n * 10 + u32::from(d - b'0'))))
    }
}

/// A SPAKE2 password: a code's 8 digits, or a join token's secret (see [`crate::token`]).
/// Both sides must use the same one; which one a joiner means is told by the token id it
/// sends beside its first message (none: the member's current code).
pub trait Secret {
    /// The password bytes.
    fn password(&self) -> Vec<u8>;
}

impl Secret for PairingCode {
    fn password(&self) -> Vec<u8> {
        self.digits().to_vec()
    }
}

fn password(secret: &dyn Secret) -> Password {
    Password::new(secret.password())
}

/// The confirmation MAC of one side over the whole exchange.
fn mac(key: &[u8; 32], label: &[u8; 20], joiner: NodeId, member: NodeId, first: &[u8], second: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(label).update(&joiner.0).update(&member.0).update(first).update(second);
    h.finalize()
}

/// Finish SPAKE2 on the peer's message; a malformed message is a protocol error.
fn shared_key(spake: Spake2<Ed25519Group>, peer_msg: &[u8]) -> Result<[u8; 32], PairError> {
    let key = spake.finish(peer_msg).map_err(|e| PairError::Protocol(format!("bad SPAKE2 message: {e:?}")))?;
    key.as_slice()
        .try_into()
        .map_err(|_| PairError::Protocol(format!("SPAKE2 gave a {}-byte key, expected 32", key.len())))
}

/// A MAC received from the peer, as a `blake3::Hash` so that comparing it is
/// constant-time (`blake3::Hash`'s `PartialEq` is documented as constant-time).
fn received_mac(bytes: &[u8]) -> Result<blake3::Hash, PairError> {
    let arr: [u8; MAC_LEN] = bytes
        .try_into()
        .map_err(|_| PairError::Protocol(format!("a confirmation is {MAC_LEN} bytes, got {}", bytes.len())))?;
    Ok(blake3::Hash::from_bytes(arr))
}

/// The joiner's side of one exchange (SPAKE2 side A).
pub struct Joiner {
    spake: Spake2<Ed25519Group>,
    joiner: NodeId,
    member: NodeId,
    first: Vec<u8>,
}

impl fmt::Debug for Joiner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Joiner").field("joiner", &self.joiner).field("member", &self.member).finish_non_exhaustive()
    }
}

impl Joiner {
    /// Begin an exchange as node `joiner` with node `member` (both as seen in the TLS
    /// handshake). Returns the first message to send to the member.
    pub fn start(code: &dyn Secret, joiner: NodeId, member: NodeId) -> (Joiner, Vec<u8>) {
        let (spake, first) =
            Spake2::<Ed25519Group>::start_a(&password(code), &Identity::new(&joiner.0), &Identity::new(&member.0));
        (Joiner { spake, joiner, member, first: first.clone() }, first)
    }

    /// Take the member's reply (its SPAKE2 message and its MAC). On success, returns the
    /// joiner's confirmation to send back. [`PairError::WrongCode`] if the member's MAC
    /// does not verify (another code, or other node ids); [`PairError::Protocol`] if the
    /// reply is malformed.
    pub fn finish(self, reply: &[u8]) -> Result<Vec<u8>, PairError> {
        if reply.len() != REPLY_LEN {
            return Err(PairError::Protocol(format!("a reply is {REPLY_LEN} bytes, got {}", reply.len())));
        }
        let (second, their_mac) = reply.split_at(SPAKE_MSG_LEN);
        let their_mac = received_mac(their_mac)?;
        let key = shared_key(self.spake, second)?;
        let expected = mac(&key, MEMBER_LABEL, self.joiner, self.member, &self.first, second);
        // Constant-time: `blake3::Hash`'s `==`.
        if expected != their_mac {
            return Err(PairError::WrongCode);
        }
        Ok(mac(&key, JOINER_LABEL, self.joiner, self.member, &self.first, second).as_bytes().to_vec())
    }
}

/// The member's side of one exchange (SPAKE2 side B).
pub struct Responder {
    expected: blake3::Hash,
}

impl fmt::Debug for Responder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Responder").finish_non_exhaustive()
    }
}

impl Responder {
    /// Answer the joiner's first message, as node `member` paired with node `joiner`
    /// (both as seen in the TLS handshake), with the code from [`Offers::begin`].
    /// Returns the reply to send: the member's SPAKE2 message and its MAC.
    /// [`PairError::Protocol`] if `first` is malformed.
    pub fn respond(
        code: &dyn Secret,
        joiner: NodeId,
        member: NodeId,
        first: &[u8],
    ) -> Result<(Responder, Vec<u8>), PairError> {
        if first.len() != SPAKE_MSG_LEN {
            return Err(PairError::Protocol(format!("a first message is {SPAKE_MSG_LEN} bytes, got {}", first.len())));
        }
        let (spake, second) =
            Spake2::<Ed25519Group>::start_b(&password(code), &Identity::new(&joiner.0), &Identity::new(&member.0));
        let key = shared_key(spake, first)?;
        let ours = mac(&key, MEMBER_LABEL, joiner, member, first, &second);
        let expected = mac(&key, JOINER_LABEL, joiner, member, first, &second);
        let mut reply = second;
        reply.extend_from_slice(ours.as_bytes());
        Ok((Responder { expected }, reply))
    }

    /// Check the joiner's confirmation. `Ok(())`: the joiner knows the code (and saw
    /// the same node ids). [`PairError::WrongCode`] if it does not verify,
    /// [`PairError::Protocol`] if it is not 32 bytes.
    pub fn confirm(self, confirmation: &[u8]) -> Result<(), PairError> {
        // Constant-time: `blake3::Hash`'s `==`.
        if received_mac(confirmation)? == self.expected {
            Ok(())
        } else {
            Err(PairError::WrongCode)
        }
    }
}

/// The code on offer and what has happened to it.
#[derive(Debug)]
struct Offer {
    code: PairingCode,
    expires_ms: u64,
    /// Exchanges begun with this code.
    attempts: u32,
    /// When the last exchange began.
    last_begin_ms: Option<u64>,
}

/// The code a member offers, with its limits. Pure: the caller passes `now_ms` (any
/// monotonic millisecond clock). At most one code is active; a new [`Offers::offer`]
/// replaces it.
#[derive(Debug)]
pub struct Offers {
    max_attempts: u32,
    min_gap_ms: u64,
    ttl_ms: u64,
    current: Option<Offer>,
}

impl Default for Offers {
    /// 5 attempts, 1 s apart at least, for 10 minutes.
    fn default() -> Offers {
        Offers::new(5, 1000, 10 * 60 * 1000)
    }
}

impl Offers {
    /// Codes allow `max_attempts` exchanges, at least `min_gap_ms` apart, and expire
    /// `ttl_ms` after they are made.
    pub fn new(max_attempts: u32, min_gap_ms: u64, ttl_ms: u64) -> Offers {
        Offers { max_attempts, min_gap_ms, ttl_ms, current: None }
    }

    /// Make a new code, valid until `now_ms + ttl`, replacing any earlier one (and its
    /// attempt count).
    pub fn offer(&mut self, now_ms: u64) -> PairingCode {
        let code = PairingCode::generate();
        self.current = Some(Offer {
            code: code.clone(),
            expires_ms: now_ms.saturating_add(self.ttl_ms),
            attempts: 0,
            last_begin_ms: None,
        });
        code
    }

    /// An exchange begins: returns the code to answer it with, or why not. Every begun
    /// exchange counts as an attempt (see the module docs); a refused one does not.
    /// Refusals, in order: [`PairError::NoOffer`] (none made, or consumed by a success),
    /// [`PairError::Expired`], [`PairError::TooManyAttempts`] (the code is burnt until
    /// the next `offer`), [`PairError::TooSoon`] (within `min_gap_ms` of the previous
    /// exchange's start).
    pub fn begin(&mut self, now_ms: u64) -> Result<PairingCode, PairError> {
        let offer = self.current.as_mut().ok_or(PairError::NoOffer)?;
        if now_ms >= offer.expires_ms {
            return Err(PairError::Expired);
        }
        if offer.attempts >= self.max_attempts {
            return Err(PairError::TooManyAttempts);
        }
        if let Some(last) = offer.last_begin_ms {
            let next = last.saturating_add(self.min_gap_ms);
            if now_ms < next {
                return Err(PairError::TooSoon { wait_ms: next - now_ms });
            }
        }
        offer.attempts += 1;
        offer.last_begin_ms = Some(now_ms);
        Ok(offer.code.clone())
    }

    /// The exchange succeeded (the joiner's confirmation verified): the code is consumed,
    /// one code = one join. A no-op when no code is active.
    ///
    /// Exchanges that overlap in time can each succeed before either reports it; a shell
    /// that must admit at most one node per code runs one exchange at a time.
    pub fn succeeded(&mut self) {
        self.current = None;
    }

    /// The exchange failed (wrong confirmation, malformed message, or abandoned). It was
    /// already counted by [`Offers::begin`], so there is nothing left to count; the shell
    /// reports every outcome all the same, so that a stricter policy can live here.
    pub fn failed(&mut self) {}

    /// Whether a code can still be used now, and if so until when (ms, on the caller's
    /// clock). `None` if there is no code, it was consumed, has expired or is burnt.
    pub fn active(&self, now_ms: u64) -> Option<u64> {
        self.current.as_ref().filter(|o| now_ms < o.expires_ms && o.attempts < self.max_attempts).map(|o| o.expires_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const J: NodeId = NodeId([1; 32]);
    const M: NodeId = NodeId([2; 32]);
    const X: NodeId = NodeId([3; 32]);

    fn code(s: &str) -> PairingCode {
        s.parse().unwrap()
    }

    /// One full exchange; the joiner's and the member's views of the ids are given.
    fn exchange(
        jcode: &PairingCode,
        mcode: &PairingCode,
        (jj, jm): (NodeId, NodeId),
        (mj, mm): (NodeId, NodeId),
    ) -> Result<(Vec<u8>, Vec<u8>), PairError> {
        let (joiner, first) = Joiner::start(jcode, jj, jm);
        let (responder, reply) = Responder::respond(mcode, mj, mm, &first)?;
        let conf = joiner.finish(&reply)?;
        responder.confirm(&conf)?;
        Ok((reply, conf))
    }

    fn is_protocol<T>(r: &Result<T, PairError>) -> bool {
        matches!(r, Err(PairError::Protocol(_)))
    }

    fn pattern(len: usize) -> Vec<u8> {
        // Starts with 3: never a valid SPAKE2 side byte ('A' = 0x41, 'B' = 0x42).
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn right_code_pairs_with_fresh_keys_each_time() {
        let c = code("1234-5678");
        let (reply1, conf1) = exchange(&c, &c, (J, M), (J, M)).unwrap();
        let (reply2, conf2) = exchange(&c, &c, (J, M), (J, M)).unwrap();
        assert_eq!(reply1.len(), REPLY_LEN);
        assert_eq!(conf1.len(), MAC_LEN);
        assert_ne!(reply1, reply2);
        assert_ne!(reply1[SPAKE_MSG_LEN..], reply2[SPAKE_MSG_LEN..], "member MACs differ");
        assert_ne!(conf1, conf2);
    }

    #[test]
    fn wrong_code_fails_at_the_joiner() {
        let (joiner, first) = Joiner::start(&code("1234-5678"), J, M);
        let (_responder, reply) = Responder::respond(&code("1234-5679"), J, M, &first).unwrap();
        assert_eq!(joiner.finish(&reply), Err(PairError::WrongCode));
    }

    #[test]
    fn forged_or_replayed_confirmation_fails_at_the_member() {
        let c = code("0000-0042");
        // A joiner that ignores the member's MAC and sends something else.
        let (_joiner, first) = Joiner::start(&code("9999-9999"), J, M);
        let (responder, _) = Responder::respond(&c, J, M, &first).unwrap();
        assert_eq!(responder.confirm(&[0; MAC_LEN]), Err(PairError::WrongCode));

        // A confirmation from an earlier, successful exchange, replayed.
        let (_, old_conf) = exchange(&c, &c, (J, M), (J, M)).unwrap();
        let (_joiner, first) = Joiner::start(&c, J, M);
        let (responder, _) = Responder::respond(&c, J, M, &first).unwrap();
        assert_eq!(responder.confirm(&old_conf), Err(PairError::WrongCode));

        // The member's own MAC reflected back.
        let (_joiner, first) = Joiner::start(&c, J, M);
        let (responder, reply) = Responder::respond(&c, J, M, &first).unwrap();
        assert_eq!(responder.confirm(&reply[SPAKE_MSG_LEN..]), Err(PairError::WrongCode));
    }

    #[test]
    fn node_ids_are_bound_into_the_key() {
        let c = code("1234-5678");
        assert_eq!(exchange(&c, &c, (J, M), (M, J)), Err(PairError::WrongCode), "swapped");
        assert_eq!(exchange(&c, &c, (J, M), (X, M)), Err(PairError::WrongCode), "other joiner");
        assert_eq!(exchange(&c, &c, (J, M), (J, X)), Err(PairError::WrongCode), "other member");
        assert_eq!(exchange(&c, &c, (J, X), (J, M)), Err(PairError::WrongCode), "joiner sees another member");
    }

    #[test]
    fn malformed_messages_are_protocol_errors() {
        let c = code("1234-5678");
        for len in 0..100 {
            let junk = pattern(len);
            let r = Responder::respond(&c, J, M, &junk);
            assert!(is_protocol(&r), "first message of {len} bytes");

            let (joiner, first) = Joiner::start(&c, J, M);
            assert!(is_protocol(&joiner.finish(&junk)), "reply of {len} bytes");

            let (responder, _) = Responder::respond(&c, J, M, &first).unwrap();
            let r = responder.confirm(&junk);
            if len == MAC_LEN {
                assert_eq!(r, Err(PairError::WrongCode));
            } else {
                assert!(is_protocol(&r), "confirmation of {len} bytes");
            }
        }
        // Right lengths and side bytes, points that may not decode: never a panic, and
        // some of them (about half of all y values) are refused as malformed.
        let mut refused = 0;
        for k in 0..32u8 {
            let mut first = vec![b'A'];
            first.extend([k.wrapping_mul(37).wrapping_add(5); 32]);
            if is_protocol(&Responder::respond(&c, J, M, &first)) {
                refused += 1;
            }
            let (joiner, first) = Joiner::start(&c, J, M);
            let (_, mut reply) = Responder::respond(&c, J, M, &first).unwrap();
            reply[1..SPAKE_MSG_LEN].fill(k.wrapping_mul(37).wrapping_add(5));
            assert!(joiner.finish(&reply).is_err());
        }
        assert!(refused > 0);
        // The side byte is checked: the joiner's own message bounced back.
        let (joiner, first) = Joiner::start(&c, J, M);
        let mut reply = first.clone();
        reply.extend([0; MAC_LEN]);
        assert!(is_protocol(&joiner.finish(&reply)));
        let (_, reply) = Responder::respond(&c, J, M, &first).unwrap();
        assert!(is_protocol(&Responder::respond(&c, J, M, &reply[..SPAKE_MSG_LEN])));
    }

    #[test]
    fn code_parsing_and_display() {
        for s in ["12345678", "1234 5678", "1234-5678", "  1234-5678\n", "\t12345678 "] {
            assert_eq!(code(s), PairingCode(12_345_678), "{s:?}");
        }
        assert_eq!(code("0000-0042").to_string(), "0000-0042");
        assert_eq!(code("00000000").to_string(), "0000-0000");
        assert_eq!(code("9999 9999").to_string(), "9999-9999");
        assert_eq!(code("0012-3400").digits(), *b"00123400");
        let bad = [
            "1234-567",
            "abcd-efgh",
            "12345678 9",
            "",
            "   ",
            "١٢٣٤٥٦٧٨",
            "1234--5678",
            "1234  5678",
            "1234_5678",
            "123-45678",
            "+1234567",
            "-1234567",
            "123456789",
            "1234-5678-",
            "1234\u{2010}5678",
        ];
        for s in bad {
            match s.parse::<PairingCode>() {
                Err(PairError::BadCode(why)) => {
                    let t = s.trim();
                    assert!(t.is_empty() || !why.contains(t), "{why:?} echoes {s:?}");
                }
                other => panic!("{s:?} parsed as {other:?}"),
            }
        }
        let err = "abcd-efgh".parse::<PairingCode>().unwrap_err().to_string();
        assert!(err.starts_with("not a pairing code"), "{err}");
        assert!(!err.contains("abcd"), "{err}");
    }

    #[test]
    fn debug_hides_the_digits() {
        let c = code("1234-5678");
        assert_eq!(format!("{c:?}"), "PairingCode(****-****)");
        let mut offers = Offers::default();
        let c = offers.offer(0);
        let digits = String::from_utf8(c.digits().to_vec()).unwrap();
        let (joiner, first) = Joiner::start(&c, J, M);
        let (responder, _) = Responder::respond(&c, J, M, &first).unwrap();
        let shown = format!("{offers:?} {joiner:?} {responder:?}");
        assert!(!shown.contains(&c.to_string()) && !shown.contains(&digits), "{shown}");
    }

    #[test]
    fn generated_codes_are_spread() {
        let codes: Vec<PairingCode> = (0..1000).map(|_| PairingCode::generate()).collect();
        for c in &codes {
            assert!(c.0 < CODE_SPACE);
            let shown = c.to_string();
            assert_eq!(shown.len(), 9);
            assert_eq!(shown.parse::<PairingCode>().unwrap(), *c);
        }
        assert!(codes.iter().any(|c| *c != codes[0]));
        for pos in 0..8 {
            let seen: std::collections::BTreeSet<u8> = codes.iter().map(|c| c.digits()[pos]).collect();
            assert!(seen.len() >= 5, "position {pos} saw only {seen:?}");
        }
    }

    #[test]
    fn offers_limit_attempts() {
        let mut offers = Offers::new(5, 1000, 600_000);
        let c = offers.offer(0);
        let mut now = 10;
        for _ in 0..5 {
            assert_eq!(offers.begin(now), Ok(c.clone()));
            offers.failed();
            now += 1000;
        }
        assert_eq!(offers.begin(now), Err(PairError::TooManyAttempts));
        assert_eq!(offers.begin(now + 60_000), Err(PairError::TooManyAttempts), "stays burnt");
        assert_eq!(offers.active(now), None);

        // Abandoned exchanges (never reported) count too.
        let mut offers = Offers::new(2, 0, 600_000);
        offers.offer(0);
        assert!(offers.begin(1).is_ok());
        assert!(offers.begin(2).is_ok());
        assert_eq!(offers.begin(3), Err(PairError::TooManyAttempts));
    }

    #[test]
    fn offers_space_attempts() {
        let mut offers = Offers::default();
        offers.offer(0);
        assert!(offers.begin(5_000).is_ok());
        assert_eq!(offers.begin(5_000), Err(PairError::TooSoon { wait_ms: 1000 }));
        assert_eq!(offers.begin(5_600), Err(PairError::TooSoon { wait_ms: 400 }));
        assert_eq!(offers.begin(4_000), Err(PairError::TooSoon { wait_ms: 2000 }), "clock went back");
        assert!(offers.begin(6_000).is_ok(), "refusals do not count nor move the gap");
        // Two real attempts so far: three more allowed.
        for i in 1..=3 {
            assert!(offers.begin(6_000 + i * 1000).is_ok());
        }
        assert_eq!(offers.begin(20_000), Err(PairError::TooManyAttempts));
    }

    #[test]
    fn offers_expire() {
        let mut offers = Offers::new(5, 1000, 60_000);
        assert_eq!(offers.begin(0), Err(PairError::NoOffer));
        assert_eq!(offers.active(0), None);
        offers.offer(1_000);
        assert_eq!(offers.active(1_000), Some(61_000));
        assert!(offers.begin(60_999).is_ok());
        assert_eq!(offers.active(61_000), None);
        assert_eq!(offers.begin(61_000), Err(PairError::Expired));
        assert_eq!(offers.begin(u64::MAX), Err(PairError::Expired));
    }

    #[test]
    fn success_consumes_the_code_and_a_new_offer_resets() {
        let mut offers = Offers::default();
        let c = offers.offer(0);
        let used = offers.begin(1).unwrap();
        assert_eq!(used, c);
        exchange(&used, &used, (J, M), (J, M)).unwrap();
        offers.succeeded();
        assert_eq!(offers.begin(5_000), Err(PairError::NoOffer));
        assert_eq!(offers.active(5_000), None);

        // Burn a code, then offer anew: all limits reset.
        let mut offers = Offers::default();
        offers.offer(0);
        for i in 0..5 {
            offers.begin(i * 1000).unwrap();
            offers.failed();
        }
        assert_eq!(offers.begin(10_000), Err(PairError::TooManyAttempts));
        offers.offer(700_000);
        assert_eq!(offers.active(700_000), Some(1_300_000));
        assert!(offers.begin(700_000).is_ok(), "no gap carried over");
        assert_eq!(offers.begin(1_300_000), Err(PairError::Expired), "old expiry replaced");
    }

    #[test]
    fn error_messages() {
        assert_eq!(PairError::WrongCode.to_string(), "the pairing code is wrong (or expired)");
        assert_eq!(
            PairError::NoOffer.to_string(),
            "no pairing code is active on this node: run `shoal nodes pair` there"
        );
        assert_eq!(
            PairError::TooManyAttempts.to_string(),
            "too many attempts: this code is used up; make a new one with `shoal nodes pair`"
        );
        assert!(PairError::TooSoon { wait_ms: 250 }.to_string().contains("250 ms"));
    }
}
