//! Fuzz target: the pairing exchange with arbitrary peer messages. A member answering
//! an arbitrary first message, checking an arbitrary confirmation, and a joiner
//! finishing on an arbitrary reply each give a value or an error, never a panic; an
//! arbitrary string parses as a pairing code or is refused, and a parsed code prints
//! as digits that parse back to it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_membership::pairing::{Joiner, PairingCode, Responder};
use shoal_types::NodeId;

fuzz_target!(|data: &[u8]| {
    let code: PairingCode = "1234-5678".parse().expect("a well-formed code parses");
    let joiner = NodeId([1; 32]);
    let member = NodeId([2; 32]);
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 3 {
        // The member's side: the joiner's first message is the first 33 bytes (or
        // fewer), its confirmation the rest.
        0 => {
            let (first, confirmation) = rest.split_at(rest.len().min(33));
            if let Ok((responder, reply)) = Responder::respond(&code, joiner, member, first) {
                assert_eq!(reply.len(), 65);
                let _ = responder.confirm(confirmation);
            }
        }
        // The joiner's side: whatever the member replies.
        1 => {
            let (j, first) = Joiner::start(&code, joiner, member);
            assert_eq!(first.len(), 33);
            let _ = j.finish(rest);
        }
        // Codes as typed by a person (or sent by a client).
        _ => {
            if let Ok(s) = std::str::from_utf8(rest) {
                if let Ok(c) = s.parse::<PairingCode>() {
                    let shown = c.to_string();
                    assert_eq!(shown.parse::<PairingCode>().expect("a shown code parses"), c);
                }
            }
        }
    }
});
