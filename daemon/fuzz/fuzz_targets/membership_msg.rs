//! Fuzz target: any bytes given to the membership wire decoder, as each message type
//! a peer can send (member-to-member `Msg`, join requests and responses, admin
//! requests and responses, public facts), give a value or an error, never a panic;
//! a decoded value encodes again and that encoding decodes. (Equality is not
//! asserted: serde_json's float parsing is not exact without its `float_roundtrip`
//! feature, which the daemon does not use.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};
use shoal_membership::wire::{self, AdminRequest, AdminResponse, JoinRequest, JoinResponse, PublicInfo};
use shoal_membership::Msg;

/// Decode `body` as `T`; if it decodes, its encoding must decode too.
fn check<T: Serialize + DeserializeOwned>(body: &[u8]) {
    if let Ok(v) = wire::decode::<T>(body) {
        // Invariant: these types serialize to JSON without fallible parts (no maps
        // with non-string keys), so encoding what was decoded succeeds.
        let again = serde_json::to_vec(&v).expect("a decoded message encodes");
        if let Err(e) = wire::decode::<T>(&again) {
            panic!("a message we encoded does not decode: {e}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the type, so the fuzzer can specialise per type; every
    // type also sees the whole input, as a peer may send anything on any stream.
    let Some((&which, body)) = data.split_first() else { return };
    match which % 6 {
        0 => check::<Msg>(body),
        1 => check::<JoinRequest>(body),
        2 => check::<JoinResponse>(body),
        3 => check::<AdminRequest>(body),
        4 => check::<AdminResponse>(body),
        _ => check::<PublicInfo>(body),
    }
    if let Ok(s) = std::str::from_utf8(body) {
        let name = wire::clean_name(s);
        assert!(!name.is_empty() && name.len() <= 64 && !name.chars().any(char::is_control));
    }
});
