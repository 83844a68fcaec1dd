//! A node that only does discovery, for the namespace test (`tests/discovery.rs`): it
//! advertises a fresh identity on the interfaces matching `v*` (or the patterns given
//! as arguments) and prints one line per event until killed:
//! `self <id>`, then `found <id> <addr>,<addr>…` and `lost <id>`.

use shoal_net::{Advert, Discovery, DiscoveryEvent, Identity, InterfaceFilter, PROTOCOL_VERSION};
use shoal_types::Role;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut allow: Vec<String> = std::env::args().skip(1).collect();
    if allow.is_empty() {
        allow.push("v*".into());
    }
    let node = Identity::generate()?.id();
    let advert = Advert {
        node,
        protocol: PROTOCOL_VERSION,
        cluster: None,
        port: 7400,
        join_port: 7401,
        ram_available: 8 << 30,
        vram_free: 0,
        devices: "probe".into(),
        role: Role::Pc,
        version: env!("CARGO_PKG_VERSION").into(),
    };
    let (_discovery, mut events) = Discovery::start(advert, &InterfaceFilter { allow, deny: Vec::new() })?;
    println!("self {node}");
    while let Some(event) = events.blocking_recv() {
        match event {
            DiscoveryEvent::Found { advert, addrs } => {
                let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
                println!("found {} {}", advert.node, addrs.join(","));
            }
            DiscoveryEvent::Lost { node } => println!("lost {node}"),
        }
    }
    Ok(())
}
