//! Embeds uPlot (the admin page's charts, MIT, from npm) when scripts/setup.sh has put
//! it in the npm cache outside the repository: `$SHOAL_UPLOT_DIR`, else
//! `~/.cache/shoal/npm/uplot/node_modules/uplot/dist`. Without it the page still
//! works and shows its activity as numbers; the build says so.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=SHOAL_UPLOT_DIR");
    println!("cargo:rerun-if-env-changed=HOME");
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dir = std::env::var_os("SHOAL_UPLOT_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/shoal/npm/uplot/node_modules/uplot/dist"))
    });
    let found = dir.as_ref().filter(|d| d.is_dir()).and_then(|d| {
        // Only a path that exists: Cargo reruns a build script whose listed path is
        // missing on every build.
        println!("cargo:rerun-if-changed={}", d.display());
        let js = std::fs::read_to_string(d.join("uPlot.iife.min.js")).ok()?;
        let css = std::fs::read_to_string(d.join("uPlot.min.css")).ok()?;
        Some((js, css))
    });
    let (js, css) = found.unwrap_or_else(|| {
        println!(
            "cargo:warning=uPlot not found (run scripts/setup.sh, or set SHOAL_UPLOT_DIR): the admin page shows activity as numbers, without charts"
        );
        ("/* uPlot was not embedded in this build */".into(), String::new())
    });
    std::fs::write(out.join("uplot.js"), js).expect("OUT_DIR is writable");
    std::fs::write(out.join("uplot.css"), css).expect("OUT_DIR is writable");
}
