//! llama.cpp's device list on this machine: there is always a CPU device.

#[test]
fn the_cpu_device_is_listed_with_memory_and_every_device_is_named() {
    let devices = shoal_engine::devices();
    assert!(!devices.is_empty(), "no devices listed");
    let cpu = devices.iter().find(|d| d.kind == "cpu").unwrap_or_else(|| panic!("no cpu device in {devices:?}"));
    assert!(cpu.total_bytes > 0, "{cpu:?}");
    assert!(cpu.free_bytes <= cpu.total_bytes, "{cpu:?}");
    for d in &devices {
        assert!(!d.name.is_empty(), "{d:?}");
        assert!(["cpu", "gpu", "igpu", "accel", "meta"].contains(&d.kind.as_str()), "{d:?}");
    }
    // Calling again (the periodic refresh) gives the same devices.
    let again: Vec<_> = shoal_engine::devices().into_iter().map(|d| d.name).collect();
    assert_eq!(again, devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>());
}
