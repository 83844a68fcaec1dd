//! Process-wide llama.cpp state: the backend (initialised once), and the log hook that
//! routes llama.cpp's messages to `tracing` and lets a loader read the buffer sizes
//! llama.cpp reports while it creates a context.

use llama_cpp_2::llama_backend::LlamaBackend;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();

/// The llama.cpp backend, initialised on first use.
pub(crate) fn backend() -> &'static LlamaBackend {
    BACKEND.get_or_init(|| {
        // SAFETY: installs a plain function pointer that lives for the whole program.
        unsafe { llama_cpp_sys_2::llama_log_set(Some(log_hook), std::ptr::null_mut()) };
        // Invariant: this closure runs once per process (OnceLock), and nothing else in
        // Shoal initialises the backend, so init cannot find it already initialised.
        LlamaBackend::init().expect("llama.cpp backend initialised twice")
    })
}

thread_local! {
    /// Lines llama.cpp logged on this thread while a capture was active.
    static CAPTURE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Run `f`, returning what llama.cpp logged on this thread meanwhile (loads and
/// context creation log on the calling thread).
pub(crate) fn capture_log<T>(f: impl FnOnce() -> T) -> (T, String) {
    CAPTURE.with(|c| *c.borrow_mut() = Some(String::new()));
    let out = f();
    let text = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    (out, text)
}

unsafe extern "C" fn log_hook(level: llama_cpp_sys_2::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    CAPTURE.with(|c| {
        if let Some(buf) = c.borrow_mut().as_mut() {
            buf.push_str(&text);
        }
    });
    let line = text.trim_end();
    if line.is_empty() {
        return;
    }
    match level {
        llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR => tracing::error!(target: "llama.cpp", "{line}"),
        llama_cpp_sys_2::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "llama.cpp", "{line}"),
        _ => tracing::trace!(target: "llama.cpp", "{line}"),
    }
}

/// Sum of the sizes llama.cpp reported in lines like
/// `llama_kv_cache:        CPU KV buffer size =     3.00 MiB` containing `marker`.
pub(crate) fn reported_mib(log: &str, marker: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains(marker))
        .filter_map(|l| l.split('=').nth(1))
        .filter_map(|v| v.trim().strip_suffix("MiB").and_then(|n| n.trim().parse::<f64>().ok()))
        .map(|mib| (mib * 1024.0 * 1024.0).round() as u64)
        .sum()
}

/// The llama.cpp backends compiled into this build: the CPU always, the GPU ones by the
/// `cuda`, `vulkan` and `metal` features (`shoal --version` lists them).
pub const COMPILED_BACKENDS: &[&str] = &[
    "cpu",
    #[cfg(feature = "cuda")]
    "cuda",
    #[cfg(feature = "vulkan")]
    "vulkan",
    #[cfg(feature = "metal")]
    "metal",
];

/// llama.cpp's description of the CPU features and backends in use.
pub fn system_info() -> String {
    backend();
    // SAFETY: returns a pointer to a static string owned by llama.cpp.
    unsafe { CStr::from_ptr(llama_cpp_sys_2::llama_print_system_info()) }.to_string_lossy().into_owned()
}

/// ggml's own (block size, bytes per block) for type id `id`; used to check the
/// table in `shoal-gguf` against the library actually linked.
pub fn ggml_type_geometry(id: u32) -> (u64, u64) {
    // SAFETY: plain lookups in ggml's static type table; ids come from our own table.
    unsafe {
        let t = id as llama_cpp_sys_2::ggml_type;
        (llama_cpp_sys_2::ggml_blck_size(t) as u64, llama_cpp_sys_2::ggml_type_size(t) as u64)
    }
}

/// A type [`requantize`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    /// 4 bits per weight, blocks of 32 (`Q4_0`).
    Q4_0,
    /// 8 bits per weight, blocks of 32 (`Q8_0`).
    Q8_0,
}

/// Write `src` (any GGUF llama.cpp loads) to `dst` with its weights in `to`, through
/// llama.cpp's own quantizer (already quantized weights are requantized). Tests and
/// benches make a draft model this way: the same network, numbers that differ.
pub fn requantize(src: &std::path::Path, dst: &std::path::Path, to: Quant) -> Result<(), String> {
    backend();
    let path = |p: &std::path::Path| {
        std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{}: a NUL in the path", p.display()))
    };
    let (src_c, dst_c) = (path(src)?, path(dst)?);
    // SAFETY: default params are plain data (null pointers for the optional tables);
    // both paths outlive the call, which reads and writes files only.
    let rc = unsafe {
        let mut p = llama_cpp_sys_2::llama_model_quantize_default_params();
        p.ftype = match to {
            Quant::Q4_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_0,
            Quant::Q8_0 => llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0,
        };
        p.allow_requantize = true;
        p.nthread = 1;
        llama_cpp_sys_2::llama_model_quantize(src_c.as_ptr(), dst_c.as_ptr(), &p)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("llama.cpp could not quantize {} to {to:?} (code {rc})", src.display()))
    }
}
