//! Fuzz target: any bytes given to the frame decoder give a frame or an error; a
//! decoded frame re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_net::{Frame, FrameLimits};

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits { n_embd: 8, max_tokens: 16, max_message: 4096 };
    if let Ok(f) = Frame::decode(data, &limits) {
        assert_eq!(f.encode(), data);
        let _ = f.hidden_values();
        let _ = f.token_ids();
    }
});
