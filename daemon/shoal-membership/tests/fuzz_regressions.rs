//! Inputs of the `membership_msg` and `pairing` fuzz targets (daemon/fuzz), replayed
//! on stable: the seeds and every input a fuzz run found, each fixed at its root.

use serde::de::DeserializeOwned;
use serde::Serialize;
use shoal_membership::pairing::{Joiner, PairingCode, Responder};
use shoal_membership::wire::{self, AdminRequest, AdminResponse, JoinRequest, JoinResponse, PublicInfo};
use shoal_membership::Msg;
use shoal_testnet::fuzz_inputs::{is_seed, kept_inputs};
use shoal_types::NodeId;

/// Whether `body` decodes as `T`; if it does, its encoding decodes too.
fn decodes<T: Serialize + DeserializeOwned>(body: &[u8]) -> bool {
    match wire::decode::<T>(body) {
        Ok(v) => {
            let again = serde_json::to_vec(&v).expect("a decoded message encodes");
            wire::decode::<T>(&again).expect("an encoded message decodes");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn kept_membership_inputs_decode_or_are_refused() {
    for (path, data) in kept_inputs("membership_msg") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Some((&which, body)) = data.split_first() else { continue };
        let ok = match which % 6 {
            0 => decodes::<Msg>(body),
            1 => decodes::<JoinRequest>(body),
            2 => decodes::<JoinResponse>(body),
            3 => decodes::<AdminRequest>(body),
            4 => decodes::<AdminResponse>(body),
            _ => decodes::<PublicInfo>(body),
        };
        assert!(ok || !is_seed(&path), "seed {} does not decode", path.display());
    }
}

#[test]
fn kept_pairing_inputs_are_answered_or_refused() {
    let code: PairingCode = "1234-5678".parse().expect("a well-formed code parses");
    let (joiner, member) = (NodeId([1; 32]), NodeId([2; 32]));
    for (path, data) in kept_inputs("pairing") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Some((&which, rest)) = data.split_first() else { continue };
        match which % 3 {
            0 => {
                let (first, confirmation) = rest.split_at(rest.len().min(33));
                if let Ok((responder, _)) = Responder::respond(&code, joiner, member, first) {
                    // Not the joiner's confirmation: never accepted.
                    assert!(responder.confirm(confirmation).is_err(), "{}", path.display());
                }
            }
            1 => {
                let (j, _) = Joiner::start(&code, joiner, member);
                assert!(j.finish(rest).is_err(), "{}: a made-up reply verified", path.display());
            }
            _ => {
                let parsed = std::str::from_utf8(rest).ok().and_then(|s| s.parse::<PairingCode>().ok());
                if let Some(c) = &parsed {
                    assert_eq!(c.to_string().parse::<PairingCode>().ok().as_ref(), Some(c));
                }
                assert!(parsed.is_some() || !is_seed(&path), "seed {} does not parse", path.display());
            }
        }
    }
}
