//! API keys as the replicated cluster state holds them (`apikey/<name>`): a name and
//! the BLAKE3 hash of the secret, never the secret itself (it is shown once, when made).
//! Checking a presented key compares hashes in constant time. No I/O here.

use serde::{Deserialize, Serialize};

/// One API key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    /// What it is for, e.g. `open-webui` (unique; the key's handle in `keys revoke`).
    pub name: String,
    /// BLAKE3 of the secret, 64 hex digits.
    pub hash: String,
    /// When it was made, seconds since the Unix epoch.
    pub created_unix: u64,
    /// What it may do. Keys made before scopes existed read as [`KeyScope::Chat`].
    #[serde(default)]
    pub scope: KeyScope,
}

/// What an API key may do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyScope {
    /// What a chat client needs: list and describe models, generate (a request for a
    /// model not loaded yet loads it, as with Ollama). Not pull, delete, or load and
    /// unload on its own (an empty prompt, `keep_alive: 0`).
    #[default]
    Chat,
    /// Everything the API does, as this machine's own tools may.
    Admin,
}

impl std::fmt::Display for KeyScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KeyScope::Chat => "chat",
            KeyScope::Admin => "admin",
        })
    }
}

/// Longest key name accepted.
pub const MAX_KEY_NAME: usize = 64;

/// What every secret starts with (so that people and secret scanners recognise one).
pub const SECRET_PREFIX: &str = "sk-shoal-";

impl ApiKey {
    /// Key prefix in the cluster state.
    pub const KEY_PREFIX: &'static str = "apikey/";

    /// Its key: `apikey/<name>`.
    pub fn key(&self) -> String {
        format!("{}{}", Self::KEY_PREFIX, self.name)
    }

    /// A key named `name` for `secret`, allowed `scope`.
    pub fn new(name: &str, secret: &str, created_unix: u64, scope: KeyScope) -> ApiKey {
        ApiKey { name: name.into(), hash: blake3::hash(secret.as_bytes()).to_hex().to_string(), created_unix, scope }
    }

    /// Whether `name` is one people can type and the state can hold: 1 to
    /// [`MAX_KEY_NAME`] letters, digits, `-`, `_` or `.`.
    pub fn valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= MAX_KEY_NAME
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    }

    /// Whether `presented` is this key's secret. Constant time in the secret: the
    /// hashes are compared with `blake3::Hash`'s constant-time equality.
    pub fn matches(&self, presented: &str) -> bool {
        match blake3::Hash::from_hex(&self.hash) {
            Ok(h) => h == blake3::hash(presented.as_bytes()),
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ApiKey, KeyScope};

    #[test]
    fn a_key_made_before_scopes_is_a_chat_key() {
        let old: ApiKey = serde_json::from_str(r#"{"name": "w", "hash": "00", "created_unix": 1}"#).unwrap();
        assert_eq!(old.scope, KeyScope::Chat);
        let admin = ApiKey::new("a", "s", 1, KeyScope::Admin);
        assert!(serde_json::to_string(&admin).unwrap().contains(r#""scope":"admin""#));
    }

    #[test]
    fn a_key_matches_its_secret_only_and_keeps_no_secret() {
        let k = ApiKey::new("webui", "sk-shoal-abc", 1, KeyScope::Chat);
        assert!(k.matches("sk-shoal-abc"));
        assert!(!k.matches("sk-shoal-abd") && !k.matches("") && !k.matches("sk-shoal-abc "));
        assert!(!serde_json::to_string(&k).unwrap().contains("sk-shoal-abc"));
        assert_eq!(k.key(), "apikey/webui");
        let broken = ApiKey { hash: "zz".into(), ..k };
        assert!(!broken.matches("sk-shoal-abc"));
    }

    #[test]
    fn names_are_short_plain_words() {
        assert!(ApiKey::valid_name("open-webui_2.x"));
        for bad in ["", "a b", "a/b", "é", &"x".repeat(65)] {
            assert!(!ApiKey::valid_name(bad), "{bad:?}");
        }
    }
}
