//! API keys in the cluster state (`apikey/<name>`, hashes only): made, listed and
//! revoked by the node's owner; checked by the HTTP API for requests from other
//! machines. A revoked key stops working on every node as soon as the deletion is
//! applied there.

use crate::api::{ApiError, ErrorKind};
use crate::models::commit;
use shoal_membership::node::{Handle, View};
use shoal_membership::wire::AdminRequest;
use shoal_types::apikey::SECRET_PREFIX;
use shoal_types::{ApiKey, KeyScope};

/// The keys of `view`'s state that parse.
pub fn list(view: &View) -> Vec<ApiKey> {
    let Some(state) = &view.state else { return Vec::new() };
    state
        .entries
        .range(ApiKey::KEY_PREFIX.to_string()..)
        .take_while(|(k, _)| k.starts_with(ApiKey::KEY_PREFIX))
        .filter_map(|(_, v)| serde_json::from_value::<ApiKey>(v.clone()).ok())
        .collect()
}

/// The scope of the key of `view`'s whose secret `presented` is, if any. Every key is
/// compared (constant time each), so the time taken says nothing about which one
/// matched.
pub fn check(view: &View, presented: &str) -> Option<KeyScope> {
    list(view).iter().fold(None, |found, k| if k.matches(presented) { Some(k.scope) } else { found })
}

/// Make a key named `name` allowed `scope`; returns it and its secret (shown once,
/// never stored).
pub async fn create(membership: &Handle, name: &str, scope: KeyScope) -> Result<(ApiKey, String), ApiError> {
    if !ApiKey::valid_name(name) {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!("key name {name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"),
        ));
    }
    if list(&membership.view().borrow()).iter().any(|k| k.name == name) {
        return Err(ApiError::new(ErrorKind::Conflict, format!("a key named {name} exists (revoke it first)")));
    }
    let mut bytes = [0u8; 24];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| ApiError::new(ErrorKind::Unavailable, format!("no randomness for a key: {e}")))?;
    let secret = format!("{SECRET_PREFIX}{}", hex::encode(bytes));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let key = ApiKey::new(name, &secret, now, scope);
    // Invariant: plain strings and numbers always serialise.
    let value = serde_json::to_value(&key).expect("a key serialises");
    commit(membership, AdminRequest::Put { key: key.key(), value }).await?;
    Ok((key, secret))
}

/// Revoke the key named `name`.
pub async fn revoke(membership: &Handle, name: &str) -> Result<ApiKey, ApiError> {
    let key = list(&membership.view().borrow())
        .into_iter()
        .find(|k| k.name == name)
        .ok_or_else(|| ApiError::new(ErrorKind::NotFound, format!("no key named {name}")))?;
    commit(membership, AdminRequest::Delete { key: key.key() }).await?;
    Ok(key)
}
