//! Binaries and tests of this crate run without environment variables: point their
//! runtime search path (RUNPATH, so LD_LIBRARY_PATH can still swap in another libmlx,
//! e.g. the CUDA build on the GPU machine) at the wheel's library folder.
//!
//! On Linux, when the system has OpenBLAS (Debian: libopenblas0-pthread), link it as a
//! direct dependency: its BLAS symbols then take precedence over the slow reference BLAS
//! bundled with the mlx-cpu wheel (float32 matmul ~10x faster on a 2-core VM).
//! `HOST_BLAS=bundled` keeps the wheel's BLAS; `HOST_BLAS=openblas` requires OpenBLAS.
//!
//! Built-in plugins: every `cdylib` crate in `plugins/` is built for wasm32-unknown-unknown
//! by a nested cargo (its own target folder, so it never waits on this build's lock) and
//! embedded with `include_bytes!` (`$OUT_DIR/builtin_plugins.rs`). `HOST_BUILTIN_PLUGINS=off`
//! builds a host without them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    builtin_plugins();
    println!("cargo:rerun-if-env-changed=HOST_BLAS");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    }
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        println!("cargo:rustc-env=HOST_LINKED_BLAS=");
        return;
    }
    let choice = std::env::var("HOST_BLAS").unwrap_or_else(|_| "auto".into());
    if choice == "bundled" {
        println!("cargo:rustc-env=HOST_LINKED_BLAS=");
        return;
    }
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let candidates = [format!("/usr/lib/{arch}-linux-gnu"), "/usr/lib64".into(), "/usr/lib".into()];
    let found = candidates.iter().find(|d| Path::new(d).join("libopenblas.so.0").exists());
    match (found, choice.as_str()) {
        (Some(dir), _) => {
            println!("cargo:rerun-if-changed={dir}/libopenblas.so.0");
            // --no-as-needed: nothing in the binary calls OpenBLAS itself; it is there to
            // interpose libmlx's BLAS calls.
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-L{dir}");
            println!("cargo:rustc-link-arg=-l:libopenblas.so.0");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
            // Tests give the same BLAS to the mlx-lm oracle (LD_PRELOAD) so both run the
            // same kernels.
            println!("cargo:rustc-env=HOST_LINKED_BLAS={dir}/libopenblas.so.0");
        }
        (None, "openblas") => {
            panic!("HOST_BLAS=openblas but no libopenblas.so.0 found; apt-get install libopenblas0-pthread")
        }
        (None, _) => {
            println!("cargo:rustc-env=HOST_LINKED_BLAS=");
            println!("cargo:warning=OpenBLAS not found: using the mlx-cpu wheel's slower bundled BLAS (apt-get install libopenblas0-pthread and rebuild for ~2x faster CPU decode)");
        }
    }
}

/// Builds the plugin crates of `plugins/` to wasm and writes the table that embeds them.
fn builtin_plugins() {
    println!("cargo:rerun-if-env-changed=HOST_BUILTIN_PLUGINS");
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let table = out.join("builtin_plugins.rs");
    for dir in ["plugins", "plugin-sdk"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    if std::env::var("HOST_BUILTIN_PLUGINS").as_deref() == Ok("off") {
        std::fs::write(&table, "pub static BUILTIN: &[(&str, &[u8])] = &[];\n").unwrap();
        return;
    }
    let mut crates: Vec<String> = std::fs::read_dir(root.join("plugins"))
        .expect("reading plugins/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| std::fs::read_to_string(p.join("Cargo.toml")).is_ok_and(|t| t.contains("cdylib")))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    ensure_wasm_target();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| root.join("target"));
    let target_dir = target_dir.join("builtin-plugins");
    let mut command = Command::new(cargo);
    command
        .current_dir(&root)
        .args(["build", "--release", "--locked", "--target", "wasm32-unknown-unknown", "--target-dir"])
        .arg(&target_dir)
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    // The outer build's flags and wrappers are for the host target, not for wasm.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "CARGO_MAKEFLAGS",
    ] {
        command.env_remove(var);
    }
    for name in &crates {
        command.args(["-p", name]);
    }
    let status = command.status().expect("running cargo for the built-in plugins");
    if !status.success() {
        panic!(
            "building the built-in plugins (plugins/*) for wasm32-unknown-unknown failed (see above). \
             If the target is missing: `rustup target add wasm32-unknown-unknown`; \
             to build a host without built-in plugins, set HOST_BUILTIN_PLUGINS=off"
        );
    }
    let mut rows = String::new();
    for name in &crates {
        let wasm = target_dir.join("wasm32-unknown-unknown/release").join(format!("{}.wasm", name.replace('-', "_")));
        let copy = out.join(format!("{name}.wasm"));
        std::fs::copy(&wasm, &copy).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()));
        rows.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", copy.display().to_string()));
    }
    std::fs::write(&table, format!("pub static BUILTIN: &[(&str, &[u8])] = &[\n{rows}];\n")).unwrap();
}

/// Adds the wasm32 target with rustup when this toolchain lacks it (rustup ships it as a
/// component of the toolchain; without rustup the nested build's error says what to do).
fn ensure_wasm_target() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(rustc).args(["--print", "sysroot"]).output().ok();
    let sysroot = sysroot.map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if sysroot.is_some_and(|s| s.join("lib/rustlib/wasm32-unknown-unknown").is_dir()) {
        return;
    }
    println!("cargo:warning=adding the wasm32-unknown-unknown target with rustup (built-in plugins)");
    let _ = Command::new("rustup").args(["target", "add", "wasm32-unknown-unknown"]).status();
}
