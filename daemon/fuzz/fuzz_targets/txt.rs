//! Fuzz target: an mDNS TXT record (RDATA bytes) and SRV port from anyone on the LAN
//! decode into an advert or an error, never a panic; a decoded advert encodes to TXT
//! properties that decode to the same advert.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_net::Advert;

fuzz_target!(|data: &[u8]| {
    let Some((port, record)) = data.split_first_chunk::<2>() else { return };
    let port = u16::from_be_bytes(*port);
    if let Ok(advert) = Advert::from_txt_record(record, port) {
        let again = Advert::from_txt(&advert.to_txt(), port).expect("an advert we encode decodes");
        assert_eq!(again, advert);
    }
});
