//! The devices llama.cpp can run on (CPU, GPUs, accelerators), read from ggml's
//! backend registry for the node inventory.

use crate::backend::backend;
use shoal_types::DeviceInventory;
use std::ffi::{c_char, CStr};

/// Every device in llama.cpp's backend registry, in registry order, with its memory
/// now (free and total bytes; for the CPU device, the host's RAM).
///
/// Initialises the backend first if nothing has yet. Cheap enough to call
/// periodically: each call asks every device for its memory.
pub fn devices() -> Vec<DeviceInventory> {
    backend();
    // SAFETY: the backend is initialised (above); the registry is a process-wide table
    // that llama.cpp fills once and only reads afterwards.
    let count = unsafe { llama_cpp_sys_2::ggml_backend_dev_count() };
    (0..count).filter_map(device).collect()
}

/// The device at `index` (< `ggml_backend_dev_count()`), or `None` if the registry
/// gives no device there.
fn device(index: usize) -> Option<DeviceInventory> {
    // SAFETY: `index` is below the registry's count, which never shrinks.
    let dev = unsafe { llama_cpp_sys_2::ggml_backend_dev_get(index) };
    if dev.is_null() {
        return None;
    }
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: `dev` is a non-null device from the registry, which lives for the whole
    // process; the two out-pointers point at live locals. The getters only read it.
    let (name, description, kind) = unsafe {
        llama_cpp_sys_2::ggml_backend_dev_memory(dev, &mut free, &mut total);
        (
            text(llama_cpp_sys_2::ggml_backend_dev_name(dev)),
            text(llama_cpp_sys_2::ggml_backend_dev_description(dev)),
            llama_cpp_sys_2::ggml_backend_dev_type(dev),
        )
    };
    Some(DeviceInventory {
        name,
        description,
        kind: kind_name(kind).to_owned(),
        free_bytes: free as u64,
        total_bytes: total as u64,
    })
}

/// Our name for ggml's device type.
fn kind_name(kind: llama_cpp_sys_2::ggml_backend_dev_type) -> &'static str {
    match kind {
        llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_CPU => "cpu",
        llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_GPU => "gpu",
        llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_IGPU => "igpu",
        llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_ACCEL => "accel",
        llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_META => "meta",
        _ => "unknown",
    }
}

/// A C string owned by llama.cpp, copied; empty if null.
///
/// # Safety
/// `p` is null or points at a NUL-terminated string valid for this call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_null_string_reads_as_empty() {
        // SAFETY: null is allowed; the literal is NUL-terminated and static.
        unsafe {
            assert_eq!(text(std::ptr::null()), "");
            assert_eq!(text(c"CPU".as_ptr()), "CPU");
        }
    }

    #[test]
    fn every_device_type_has_a_name() {
        assert_eq!(kind_name(llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_CPU), "cpu");
        assert_eq!(kind_name(llama_cpp_sys_2::GGML_BACKEND_DEVICE_TYPE_IGPU), "igpu");
        assert_eq!(kind_name(99), "unknown");
    }
}
