//! `shoal inventory --json` prints this machine's `NodeInventory`.

use shoal_types::NodeInventory;
use std::process::Command;

#[test]
fn inventory_json_describes_this_machine() {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).args(["inventory", "--json"]).output().unwrap();
    assert!(out.status.success(), "shoal inventory failed: {}", String::from_utf8_lossy(&out.stderr));
    let inv: NodeInventory = serde_json::from_slice(&out.stdout).unwrap();
    assert!(inv.cpu_cores >= 1, "{inv:?}");
    assert!(inv.ram_available_bytes > 0, "{inv:?}");
    assert!(inv.ram_total_bytes >= inv.ram_available_bytes, "{inv:?}");
    assert_eq!(inv.shoal_version, env!("CARGO_PKG_VERSION"));
    assert!(!inv.hostname.is_empty(), "{inv:?}");
    assert!(inv.gpus.iter().all(|g| g.kind != "cpu"), "{inv:?}");
}

#[test]
fn inventory_prints_one_fact_per_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).arg("inventory").output().unwrap();
    assert!(out.status.success(), "shoal inventory failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for key in ["hostname:", "os:", "shoal:", "cpu:", "cores:", "ram total:", "ram available:"] {
        assert!(text.lines().any(|l| l.starts_with(key)), "no {key} line in:\n{text}");
    }
}
