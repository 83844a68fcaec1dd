//! Admin authentication, pure (time comes in as an argument): the password's slow
//! salted hash (Argon2id, a PHC string), session tokens a node checks on its own (a MAC
//! under a key only that node can compute), the CSRF token bound to a session, and the
//! limit on wrong passwords.
//!
//! Why tokens and not a session table: no state to keep or replicate per login. Whose
//! key: the cluster state carries the record (hash and a random session key) to every
//! member, so a key taken from it alone would let any member, or whoever holds a
//! member's disk, mint sessions for every other node unnoticed (security review F1). A
//! node's sessions are signed with the record's key *and* a secret derived from the
//! node's own private key: a login is good on the node it was made on (a browser keeps a
//! cookie per address anyway), and a new password (a new record key) still ends every
//! session on every node at once.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// The key of the admin credentials in the cluster state.
pub const AUTH_KEY: &str = "admin/auth";

/// Shortest password accepted.
pub const MIN_PASSWORD: usize = 8;
/// Longest password accepted (Argon2 hashes any length; this bounds the work a
/// stranger can ask for).
pub const MAX_PASSWORD: usize = 1024;

/// Token format version, the first field of every token.
const TOKEN_TAG: &str = "s1";

/// Why a password cannot be set.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// Fewer than [`MIN_PASSWORD`] characters.
    #[error("the password needs at least {MIN_PASSWORD} characters")]
    TooShort,
    /// More than [`MAX_PASSWORD`] bytes.
    #[error("the password may have at most {MAX_PASSWORD} bytes")]
    TooLong,
    /// The system gave no random bytes for the salt or key.
    #[error("no randomness: {0}")]
    Random(String),
    /// Argon2 refused (cannot happen with the fixed parameters).
    #[error("hashing failed: {0}")]
    Hash(String),
}

/// Why a session token is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionError {
    /// Not a token of this format.
    #[error("not a session token")]
    Malformed,
    /// Signed by another key: another cluster's, or made before the password changed.
    #[error("a session of another cluster, or from before the password changed")]
    Forged,
    /// Past its expiry.
    #[error("the session expired")]
    Expired,
}

/// The admin credentials: one entry of the cluster state ([`AUTH_KEY`]), which only
/// members ever hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthRecord {
    /// Argon2id hash of the password, as a PHC string (salt and parameters inside).
    pub password: String,
    /// 32 random bytes, hex: the key sessions are signed with.
    pub session_key: String,
    /// When the password was set, Unix seconds.
    pub set_at: u64,
}

/// A session a token proved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// When it ends, Unix seconds.
    pub expires: u64,
    /// Its random part (hex): names it for logout.
    pub nonce: String,
}

impl AuthRecord {
    /// Credentials for `password`, with a new salt and a new session key.
    pub fn new(password: &str, now: u64) -> Result<AuthRecord, AuthError> {
        check_length(password)?;
        let mut salt = [0u8; 16];
        let mut key = [0u8; 32];
        getrandom::getrandom(&mut salt).map_err(|e| AuthError::Random(e.to_string()))?;
        getrandom::getrandom(&mut key).map_err(|e| AuthError::Random(e.to_string()))?;
        let salt = argon2::password_hash::SaltString::encode_b64(&salt).map_err(|e| AuthError::Hash(e.to_string()))?;
        let hash = argon2::PasswordHasher::hash_password(&argon2::Argon2::default(), password.as_bytes(), &salt)
            .map_err(|e| AuthError::Hash(e.to_string()))?;
        Ok(AuthRecord { password: hash.to_string(), session_key: hex::encode(key), set_at: now })
    }

    /// Whether `password` is the one these credentials hold (Argon2's comparison is
    /// constant-time). Slow by design (tens of ms): run it off the async threads.
    pub fn verify(&self, password: &str) -> bool {
        if password.len() > MAX_PASSWORD {
            return false;
        }
        let Ok(hash) = argon2::PasswordHash::new(&self.password) else { return false };
        argon2::PasswordVerifier::verify_password(&argon2::Argon2::default(), password.as_bytes(), &hash).is_ok()
    }

    /// A new session token for `cluster` on the node whose secret is `node`, valid for
    /// `ttl` seconds from `now`.
    pub fn issue(&self, node: &[u8; 32], cluster: &str, now: u64, ttl: u64) -> Result<String, AuthError> {
        let mut nonce = [0u8; 16];
        getrandom::getrandom(&mut nonce).map_err(|e| AuthError::Random(e.to_string()))?;
        let body = format!("{TOKEN_TAG}.{}.{}", now.saturating_add(ttl), hex::encode(nonce));
        let mac = self
            .mac(node, cluster, &body)
            .ok_or_else(|| AuthError::Hash("the session key is not 32 hex bytes".into()))?;
        Ok(format!("{body}.{}", mac.to_hex()))
    }

    /// The session `token` proves, for `cluster` on the node whose secret is `node`, at
    /// `now`.
    pub fn check(&self, node: &[u8; 32], cluster: &str, token: &str, now: u64) -> Result<Session, SessionError> {
        let (body, mac) = token.rsplit_once('.').ok_or(SessionError::Malformed)?;
        let mut parts = body.split('.');
        let (Some(TOKEN_TAG), Some(expires), Some(nonce), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(SessionError::Malformed);
        };
        let expires: u64 = expires.parse().map_err(|_| SessionError::Malformed)?;
        if nonce.len() != 32 || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(SessionError::Malformed);
        }
        let presented = blake3::Hash::from_hex(mac).map_err(|_| SessionError::Malformed)?;
        // blake3::Hash compares in constant time.
        if self.mac(node, cluster, body) != Some(presented) {
            return Err(SessionError::Forged);
        }
        if now >= expires {
            return Err(SessionError::Expired);
        }
        Ok(Session { expires, nonce: nonce.to_string() })
    }

    /// The CSRF token of session `token`: what the page must send back in a header with
    /// every change it asks for. Bound to the session (a token of another session, or
    /// of another cluster, does not match) and secret to the page (the session cookie
    /// is HttpOnly, so a script cannot derive it).
    pub fn csrf(&self, node: &[u8; 32], cluster: &str, token: &str) -> String {
        self.mac(node, cluster, &format!("csrf.{token}")).map(|h| h.to_hex()[..32].to_string()).unwrap_or_default()
    }

    /// Whether `presented` is session `token`'s CSRF token (constant time).
    pub fn csrf_matches(&self, node: &[u8; 32], cluster: &str, token: &str, presented: &str) -> bool {
        let want = self.csrf(node, cluster, token);
        !want.is_empty() && constant_eq(want.as_bytes(), presented.as_bytes())
    }

    /// MAC of `body` under this node's session key (the record's key keyed by the
    /// node's secret: see the module's doc), with the cluster's id in the input too (two
    /// clusters never share a key, but a copied record still names its cluster).
    fn mac(&self, node: &[u8; 32], cluster: &str, body: &str) -> Option<blake3::Hash> {
        let key: [u8; 32] = hex::decode(&self.session_key).ok()?.try_into().ok()?;
        let key = blake3::keyed_hash(node, &key);
        let mut h = blake3::Hasher::new_keyed(key.as_bytes());
        h.update(cluster.as_bytes());
        h.update(b"\n");
        h.update(body.as_bytes());
        Some(h.finalize())
    }
}

/// Whether `a` and `b` are the same bytes, in time that depends on their lengths only
/// (CSRF tokens, a hub's setup code).
pub(crate) fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `password` has an acceptable length.
pub fn check_length(password: &str) -> Result<(), AuthError> {
    if password.chars().count() < MIN_PASSWORD {
        return Err(AuthError::TooShort);
    }
    if password.len() > MAX_PASSWORD {
        return Err(AuthError::TooLong);
    }
    Ok(())
}

/// Wrong passwords per client address: after `max` within `window` seconds, further
/// attempts from that address are refused without being checked until the oldest
/// falls out of the window. An attempt counts as wrong from the moment it is let
/// through ([`Attempts::begin`]) until it proves right ([`Attempts::right`]), so
/// attempts sent at once cannot all slip past the limit while their hashes run.
/// IPv6 addresses count by their /64 (one machine can hold many addresses in it). A
/// total over every address (loopback aside) bounds a LAN full of addresses to
/// `max_total` per window; this machine's own browser is never locked out by others, nor
/// is a machine that logged in before (the owner's laptop: strangers guessing from
/// many addresses fill the total, security review F7).
#[derive(Debug)]
pub struct Attempts {
    /// Attempts allowed per address within the window.
    max: usize,
    /// Attempts allowed over all addresses within the window.
    max_total: usize,
    /// The window, seconds.
    window: u64,
    /// Times (Unix seconds) of recent attempts not proven right, per address.
    by_addr: HashMap<IpAddr, VecDeque<u64>>,
    /// The same, all addresses but loopback and `known`.
    all: VecDeque<u64>,
    /// Machines (as counted) a right password came from, with when: the total does not
    /// hold them back. At most [`MAX_KNOWN`], the oldest forgotten first.
    known: HashMap<IpAddr, u64>,
}

/// Machines remembered as having logged in (a household's few, with room to spare).
const MAX_KNOWN: usize = 64;

impl Default for Attempts {
    /// Five per address per minute, sixty in all.
    fn default() -> Attempts {
        Attempts::new(5, 60, 60)
    }
}

impl Attempts {
    /// A limit of `max` attempts per address and `max_total` in all per `window` seconds.
    pub fn new(max: usize, max_total: usize, window: u64) -> Attempts {
        Attempts { max, max_total, window, by_addr: HashMap::new(), all: VecDeque::new(), known: HashMap::new() }
    }

    /// Let an attempt from `ip` at `now` be checked, counting it as wrong until
    /// [`Attempts::right`] says otherwise; `Err(seconds)`: refused unchecked, and when
    /// the next one may come.
    pub fn begin(&mut self, ip: IpAddr, now: u64) -> Result<(), u64> {
        self.expire(now);
        let key = shoal_api::machine(ip);
        let counted = !shoal_api::is_loopback(ip) && !self.known.contains_key(&key);
        let retry = |oldest: Option<&u64>, window: u64| oldest.map_or(1, |t| (t + window).saturating_sub(now).max(1));
        if let Some(q) = self.by_addr.get(&key) {
            if q.len() >= self.max {
                return Err(retry(q.front(), self.window));
            }
        }
        if counted && self.all.len() >= self.max_total {
            return Err(retry(self.all.front(), self.window));
        }
        self.by_addr.entry(key).or_default().push_back(now);
        if counted {
            self.all.push_back(now);
        }
        Ok(())
    }

    /// The attempt from `ip` begun at `at` was right: it no longer counts.
    pub fn right(&mut self, ip: IpAddr, at: u64) {
        let key = shoal_api::machine(ip);
        let was_known = self.known.contains_key(&key);
        if !shoal_api::is_loopback(ip) {
            if self.known.len() >= MAX_KNOWN && !was_known {
                if let Some(oldest) = self.known.iter().min_by_key(|(_, t)| **t).map(|(k, _)| *k) {
                    self.known.remove(&oldest);
                }
            }
            self.known.insert(key, at);
        }
        if let Some(q) = self.by_addr.get_mut(&key) {
            if let Some(i) = q.iter().rposition(|t| *t == at) {
                q.remove(i);
            }
            if q.is_empty() {
                self.by_addr.remove(&key);
            }
        }
        // A known machine's attempt was never in the total.
        if !shoal_api::is_loopback(ip) && !was_known {
            if let Some(i) = self.all.iter().rposition(|t| *t == at) {
                self.all.remove(i);
            }
        }
    }

    /// Forget attempts older than the window (the maps stay as small as the window's
    /// attempts, which the limits bound).
    fn expire(&mut self, now: u64) {
        let window = self.window;
        let old = |t: &u64| t.saturating_add(window) <= now;
        while self.all.front().is_some_and(old) {
            self.all.pop_front();
        }
        self.by_addr.retain(|_, q| {
            while q.front().is_some_and(old) {
                q.pop_front();
            }
            !q.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_verify_and_lengths_are_enforced() {
        let rec = AuthRecord::new("correct horse", 1).unwrap();
        assert!(rec.password.starts_with("$argon2id$"), "{}", rec.password);
        assert!(rec.verify("correct horse"));
        assert!(!rec.verify("correct horsE"));
        assert_eq!(AuthRecord::new("short", 1), Err(AuthError::TooShort));
        assert_eq!(AuthRecord::new(&"x".repeat(MAX_PASSWORD + 1), 1), Err(AuthError::TooLong));
        let again = AuthRecord::new("correct horse", 1).unwrap();
        assert_ne!(rec.password, again.password, "a new salt each time");
        assert_ne!(rec.session_key, again.session_key);
    }

    /// A node's secret, as `Identity::derive_key` makes it.
    const N: &[u8; 32] = &[7; 32];

    #[test]
    fn tokens_are_bound_to_key_cluster_node_and_time() {
        let rec = AuthRecord::new("correct horse", 0).unwrap();
        let token = rec.issue(N, "c1", 100, 60).unwrap();
        let s = rec.check(N, "c1", &token, 159).unwrap();
        assert_eq!(s.expires, 160);
        assert_eq!(rec.check(N, "c1", &token, 160), Err(SessionError::Expired));
        assert_eq!(rec.check(N, "c2", &token, 120), Err(SessionError::Forged), "another cluster's id");
        let other = AuthRecord::new("correct horse", 0).unwrap();
        assert_eq!(other.check(N, "c1", &token, 120), Err(SessionError::Forged), "another key (a new password)");
        // Moving the expiry breaks the MAC.
        let (_, rest) = token.split_once('.').unwrap();
        let (_, tail) = rest.split_once('.').unwrap();
        assert_eq!(rec.check(N, "c1", &format!("s1.999999.{tail}"), 120), Err(SessionError::Forged));
        for bad in ["", "s1", "s1.1.2.3", "s2.1.00.00", "s1.x.y.z", &format!("{token}.x")] {
            assert_eq!(rec.check(N, "c1", bad, 120), Err(SessionError::Malformed), "{bad:?}");
        }
        // Another node (another node secret) holding the same record cannot mint or
        // accept this node's sessions (security review F1).
        assert_eq!(rec.check(&[8; 32], "c1", &token, 120), Err(SessionError::Forged));
        let theirs = rec.issue(&[8; 32], "c1", 100, 60).unwrap();
        assert_eq!(rec.check(N, "c1", &theirs, 120), Err(SessionError::Forged));
        assert_ne!(rec.csrf(&[8; 32], "c1", &token), rec.csrf(N, "c1", &token));
    }

    #[test]
    fn csrf_tokens_belong_to_one_session() {
        let rec = AuthRecord::new("correct horse", 0).unwrap();
        let (a, b) = (rec.issue(N, "c1", 0, 60).unwrap(), rec.issue(N, "c1", 0, 60).unwrap());
        let ca = rec.csrf(N, "c1", &a);
        assert_eq!(ca.len(), 32);
        assert!(rec.csrf_matches(N, "c1", &a, &ca));
        assert!(!rec.csrf_matches(N, "c1", &b, &ca));
        assert!(!rec.csrf_matches(N, "c2", &a, &ca));
        assert!(!rec.csrf_matches(N, "c1", &a, ""));
    }

    #[test]
    fn the_sixth_attempt_within_the_window_is_refused_until_the_first_ages_out() {
        let mut at = Attempts::new(5, 60, 60);
        let (ip, other): (IpAddr, IpAddr) = ("10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        for t in 0..5 {
            assert_eq!(at.begin(ip, 100 + t), Ok(()), "attempt {t}, all still being checked");
        }
        assert_eq!(at.begin(ip, 110), Err(50), "five in flight or wrong: retry when the first is a minute old");
        assert_eq!(at.begin(other, 110), Ok(()), "another address has its own count");
        at.right(ip, 104);
        assert_eq!(at.begin(ip, 111), Ok(()), "a right one no longer counts");
        assert!(at.begin(ip, 112).is_err());
        assert_eq!(at.begin(ip, 160), Ok(()), "the first aged out");
    }

    #[test]
    fn ipv6_counts_by_its_64_and_loopback_is_kept_out_of_the_total() {
        let mut at = Attempts::new(2, 3, 60);
        let a: IpAddr = "fd00:1:2:3::10".parse().unwrap();
        let b: IpAddr = "fd00:1:2:3::11".parse().unwrap();
        assert!(at.begin(a, 0).is_ok() && at.begin(b, 0).is_ok());
        assert!(at.begin("fd00:1:2:3::12".parse().unwrap(), 0).is_err(), "one /64, one count");
        assert!(at.begin("10.0.0.9".parse().unwrap(), 0).is_ok());
        assert!(at.begin("10.0.0.8".parse().unwrap(), 0).is_err(), "the total over every address");
        assert!(
            at.begin("127.0.0.1".parse().unwrap(), 0).is_ok(),
            "this machine's browser is not locked out by others"
        );
        assert!(at.begin("::ffff:127.0.0.1".parse().unwrap(), 0).is_ok());
    }

    #[test]
    fn strangers_filling_the_total_do_not_lock_out_a_machine_that_logged_in_before() {
        let mut at = Attempts::new(5, 10, 60);
        let laptop: IpAddr = "192.168.1.30".parse().unwrap();
        at.begin(laptop, 0).unwrap();
        at.right(laptop, 0);
        // Eight strangers' addresses, wrong passwords, until the total is full.
        let mut refused = 0;
        for k in 0..8u8 {
            for _ in 0..5 {
                refused += usize::from(at.begin(IpAddr::from([10, 0, 0, k]), 1).is_err());
            }
        }
        assert!(refused > 0, "the total never filled");
        assert!(at.begin("10.0.1.1".parse().unwrap(), 1).is_err(), "a new address is held by the total");
        // The owner's laptop still gets its own five tries.
        for _ in 0..5 {
            assert_eq!(at.begin(laptop, 2), Ok(()));
        }
        assert!(at.begin(laptop, 2).is_err(), "its own limit holds");
    }
}
