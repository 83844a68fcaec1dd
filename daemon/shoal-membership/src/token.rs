//! Join tokens: a one-time secret for a node installed without anyone at its keyboard
//! (a hub box, a PC set up remotely). A member's owner makes one (`shoal nodes token`);
//! the new node is given it at install (`shoal serve --join-token T`, or the file
//! `join-token` in its data directory) and pairs with the member that made it, using the
//! token's secret as the SPAKE2 password of [`crate::pairing`]. The token names its
//! cluster, so the new node never talks to another cluster's members, and its id, so the
//! member knows which secret to answer with. Pure: the caller passes wall-clock times
//! (tokens outlive a restart of the member, so monotonic clocks would not do).
//!
//! The secret is 128 random bits: no guessing bound is needed for safety, but a token is
//! still burnt after [`MAX_TOKEN_ATTEMPTS`] exchanges that did not end in a join, and
//! consumed by the one that does.

use crate::pairing::{PairError, Secret};
use serde::{Deserialize, Serialize};
use shoal_types::ClusterId;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// What every token's text starts with.
const PREFIX: &str = "shoal-join";
/// Exchanges a token allows before it is burnt.
pub const MAX_TOKEN_ATTEMPTS: u32 = 5;
/// Tokens one member keeps outstanding at once (the oldest go first).
pub const MAX_TOKENS: usize = 32;
/// The longest validity a token may be given: 30 days.
pub const MAX_TOKEN_TTL_MS: u64 = 30 * 24 * 3600 * 1000;

/// A join token: the cluster it admits to, its id, and its secret.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    /// The cluster the token admits to.
    pub cluster: ClusterId,
    /// Names the token at the member that made it (public: sent beside the exchange).
    pub id: TokenId,
    /// The SPAKE2 password; never sent.
    secret: [u8; 16],
}

/// A token's public name.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenId(pub [u8; 4]);

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenId({self})")
    }
}

impl FromStr for TokenId {
    type Err = PairError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut id = [0u8; 4];
        hex::decode_to_slice(s, &mut id).map_err(|_| PairError::BadCode("a token id is 8 hex digits".into()))?;
        Ok(TokenId(id))
    }
}

impl JoinToken {
    /// A fresh token for `cluster` from OS randomness.
    pub fn generate(cluster: ClusterId) -> JoinToken {
        let mut bytes = [0u8; 20];
        // Invariant: the OS RNG works; a node without one cannot do TLS either.
        getrandom::getrandom(&mut bytes).expect("the operating system's random number generator failed");
        let (id, secret) = bytes.split_at(4);
        JoinToken {
            cluster,
            // Both slices have the lengths split above.
            id: TokenId(id.try_into().expect("4 bytes")),
            secret: secret.try_into().expect("16 bytes"),
        }
    }
}

impl Secret for JoinToken {
    fn password(&self) -> Vec<u8> {
        self.secret.to_vec()
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}-{}-{}-{}", self.cluster, self.id, hex::encode(self.secret))
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret: tokens end up in logs through `{:?}`.
        write!(f, "JoinToken({}-{}-****)", self.cluster, self.id)
    }
}

impl FromStr for JoinToken {
    type Err = PairError;

    /// Parse `shoal-join-<cluster>-<id>-<secret>`; errors never echo the text (it may be
    /// a mistyped secret).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| PairError::BadCode(format!("not a join token: {why}"));
        let rest = s
            .trim()
            .strip_prefix(PREFIX)
            .and_then(|r| r.strip_prefix('-'))
            .ok_or_else(|| bad("it starts with shoal-join-"))?;
        let parts: Vec<&str> = rest.split('-').collect();
        let [cluster, id, secret] = parts.as_slice() else { return Err(bad("it has four parts separated by '-'")) };
        let cluster: ClusterId = cluster.parse().map_err(|_| bad("its cluster id is 32 hex digits"))?;
        let id: TokenId = id.parse().map_err(|_| bad("its id is 8 hex digits"))?;
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(secret, &mut bytes).map_err(|_| bad("its secret is 32 hex digits"))?;
        Ok(JoinToken { cluster, id, secret: bytes })
    }
}

/// Whether `text` looks like a join token rather than a pairing code.
pub fn is_token(text: &str) -> bool {
    text.trim().starts_with(PREFIX)
}

/// One token a member made, as kept in its store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    /// The secret, hex.
    secret: String,
    /// Valid until then (Unix time, ms).
    pub expires_unix_ms: u64,
    /// Exchanges begun with it.
    pub attempts: u32,
}

/// The tokens a member made and has not seen used: kept in its store (not in the
/// replicated state, which every member may read), so only that member can admit with
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    /// By token id (hex).
    issued: BTreeMap<String, Issued>,
}

impl Tokens {
    /// Make a token for `cluster`, valid `ttl_ms` (at most [`MAX_TOKEN_TTL_MS`]) from
    /// `now_unix_ms`. Expired tokens are forgotten; past [`MAX_TOKENS`] the one expiring
    /// first goes.
    pub fn issue(&mut self, cluster: ClusterId, now_unix_ms: u64, ttl_ms: u64) -> JoinToken {
        self.issued.retain(|_, t| t.expires_unix_ms > now_unix_ms && t.attempts < MAX_TOKEN_ATTEMPTS);
        while self.issued.len() >= MAX_TOKENS {
            let first = self.issued.iter().min_by_key(|(_, t)| t.expires_unix_ms).map(|(k, _)| k.clone());
            match first {
                Some(k) => self.issued.remove(&k),
                None => break,
            };
        }
        let token = JoinToken::generate(cluster);
        let expires_unix_ms = now_unix_ms.saturating_add(ttl_ms.min(MAX_TOKEN_TTL_MS));
        self.issued
            .insert(token.id.to_string(), Issued { secret: hex::encode(token.secret), expires_unix_ms, attempts: 0 });
        token
    }

    /// An exchange with token `id` begins: its secret, or why not. Every begun exchange
    /// counts (as with codes, a guesser learns the outcome before confirming).
    /// [`PairError::NoOffer`] when this member did not make it (the joiner tries another).
    pub fn begin(&mut self, cluster: ClusterId, id: TokenId, now_unix_ms: u64) -> Result<JoinToken, PairError> {
        let t = self.issued.get_mut(&id.to_string()).ok_or(PairError::NoOffer)?;
        if now_unix_ms >= t.expires_unix_ms {
            return Err(PairError::Expired);
        }
        if t.attempts >= MAX_TOKEN_ATTEMPTS {
            return Err(PairError::TooManyAttempts);
        }
        t.attempts += 1;
        let mut secret = [0u8; 16];
        // Only `issue` writes secrets, always 16 bytes as hex; a store edited by hand
        // that breaks this makes the token unusable, not the node.
        hex::decode_to_slice(&t.secret, &mut secret).map_err(|_| PairError::NoOffer)?;
        Ok(JoinToken { cluster, id, secret })
    }

    /// The exchange with `id` admitted its node: the token is used up.
    pub fn succeeded(&mut self, id: TokenId) {
        self.issued.remove(&id.to_string());
    }

    /// Tokens still usable at `now_unix_ms`.
    pub fn active(&self, now_unix_ms: u64) -> usize {
        self.issued.values().filter(|t| t.expires_unix_ms > now_unix_ms && t.attempts < MAX_TOKEN_ATTEMPTS).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pairing::{Joiner, Responder};
    use shoal_types::NodeId;

    const C: ClusterId = ClusterId([7; 16]);

    #[test]
    fn a_token_round_trips_as_text_and_never_shows_its_secret_in_debug() {
        let t = JoinToken::generate(C);
        let text = t.to_string();
        assert!(is_token(&text));
        assert_eq!(text.parse::<JoinToken>().unwrap(), t);
        assert!(!format!("{t:?}").contains(&hex::encode(t.secret)));
        for bad in ["", "shoal-join", "shoal-join-zz-00000000-00", &text[..text.len() - 1], &text.replace("shoal", "x")]
        {
            let e = bad.parse::<JoinToken>().unwrap_err().to_string();
            assert!(e.contains("not a join token"), "{e}");
        }
    }

    #[test]
    fn a_token_pairs_once_and_a_wrong_secret_fails() {
        let (j, m) = (NodeId([1; 32]), NodeId([2; 32]));
        let mut tokens = Tokens::default();
        let t = tokens.issue(C, 1_000, 60_000);
        let held = tokens.begin(C, t.id, 2_000).unwrap();
        let (joiner, first) = Joiner::start(&t, j, m);
        let (responder, reply) = Responder::respond(&held, j, m, &first).unwrap();
        let confirm = joiner.finish(&reply).unwrap();
        responder.confirm(&confirm).unwrap();
        tokens.succeeded(t.id);
        assert_eq!(tokens.begin(C, t.id, 3_000), Err(PairError::NoOffer), "a used token works again");

        // Another token with the same id but another secret: the MACs fail.
        let t2 = tokens.issue(C, 1_000, 60_000);
        let forged = JoinToken { secret: [0; 16], ..t2.clone() };
        let (joiner, first) = Joiner::start(&forged, j, m);
        let held = tokens.begin(C, t2.id, 2_000).unwrap();
        let (_r, reply) = Responder::respond(&held, j, m, &first).unwrap();
        assert_eq!(joiner.finish(&reply), Err(PairError::WrongCode));
    }

    #[test]
    fn tokens_expire_and_burn_after_too_many_attempts() {
        let mut tokens = Tokens::default();
        let t = tokens.issue(C, 0, 10_000);
        assert_eq!(tokens.begin(C, t.id, 10_000), Err(PairError::Expired));
        let t = tokens.issue(C, 0, 10_000);
        for _ in 0..MAX_TOKEN_ATTEMPTS {
            tokens.begin(C, t.id, 1).unwrap();
        }
        assert_eq!(tokens.begin(C, t.id, 1), Err(PairError::TooManyAttempts));
        assert_eq!(tokens.active(10_000), 0);
        // A validity past the cap is cut to it.
        let t = tokens.issue(C, 0, u64::MAX);
        assert_eq!(tokens.issued[&t.id.to_string()].expires_unix_ms, MAX_TOKEN_TTL_MS);
    }

    #[test]
    fn a_member_keeps_a_bounded_number_of_tokens() {
        let mut tokens = Tokens::default();
        for i in 0..(MAX_TOKENS as u64 + 10) {
            tokens.issue(C, 0, 1_000 + i);
        }
        assert_eq!(tokens.issued.len(), MAX_TOKENS);
    }
}
