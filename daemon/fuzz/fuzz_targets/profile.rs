//! Fuzz target: any text given to the cluster profile parser gives a profile or an
//! error, never a panic or an allocation the text does not pay for; a parsed profile
//! validates and its link costs can be looked up.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_planner::Profile;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(p) = Profile::parse(text) {
        p.cluster.validate().expect("a parsed profile is valid");
        for a in &p.cluster.devices {
            for b in &p.cluster.devices {
                let _ = p.cluster.link(&a.host, &b.host);
            }
        }
    }
});
