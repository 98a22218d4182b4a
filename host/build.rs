//! Binaries and tests of this crate run without environment variables: point their
//! runtime search path (RUNPATH, so LD_LIBRARY_PATH can still swap in another libmlx,
//! e.g. the CUDA build on the GPU machine) at the wheel's library folder.
//!
//! On Linux, when the system has OpenBLAS (Debian: libopenblas0-pthread), link it as a
//! direct dependency: its BLAS symbols then take precedence over the slow reference BLAS
//! bundled with the mlx-cpu wheel (float32 matmul ~10x faster on a 2-core VM). Without it,
//! OpenBLAS comes from PyPI (`scipy-openblas32`, self-contained, its symbols prefixed
//! `scipy_`) into the same cache as the MLX wheel, and `blas/forward.c`, built into
//! `libhost_blas.so` beside it, gives MLX's and the shim's `cblas_*` calls to it; if pip cannot
//! fetch it, the wheel's reference BLAS stays (with a warning). The build reruns when the
//! system library folder changes (OpenBLAS installed or removed). `HOST_BLAS=bundled` keeps
//! the wheel's BLAS; `HOST_BLAS=openblas` requires the system's; `HOST_BLAS=pypi` takes
//! PyPI's even beside the system's.
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
    if let Some(dir) = candidates.iter().find(|d| Path::new(d).is_dir()) {
        // A library installed or removed there changes the folder: the choice is made again.
        println!("cargo:rerun-if-changed={dir}");
    }
    let found = candidates.iter().find(|d| Path::new(d).join("libopenblas.so.0").exists());
    let found = found.filter(|_| choice != "pypi");
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
        (None, _) => match pypi_openblas() {
            Ok(lib) => {
                let dir = lib.parent().expect("a file in a folder").display().to_string();
                println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
                println!("cargo:rustc-link-arg=-L{dir}");
                println!("cargo:rustc-link-arg=-l:libhost_blas.so");
                println!("cargo:rustc-link-arg=-Wl,--as-needed");
                println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
                println!("cargo:rustc-env=HOST_LINKED_BLAS={}", lib.display());
            }
            Err(e) if choice == "pypi" => panic!("HOST_BLAS=pypi: {e}"),
            Err(e) => {
                println!("cargo:rustc-env=HOST_LINKED_BLAS=");
                println!("cargo:warning=no OpenBLAS ({e}): using the mlx-cpu wheel's slower bundled BLAS (apt-get install libopenblas0-pthread and rebuild for ~2x faster CPU decode)");
            }
        },
    }
}

/// scipy-openblas32 from PyPI: the version the forwarders are written against.
const SCIPY_OPENBLAS: &str = "0.3.34.481.3";

/// `libhost_blas.so` (blas/forward.c over PyPI's OpenBLAS) in the host cache, fetched and
/// built once; its path.
fn pypi_openblas() -> Result<PathBuf, String> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let source = manifest_dir.join("blas/forward.c");
    println!("cargo:rerun-if-changed={}", source.display());
    // The mlx crate's build chose the cache (and reruns when HOST_CACHE_DIR changes).
    let cache =
        PathBuf::from(std::env::var("DEP_MLX_CACHE_DIR").map_err(|_| "the mlx crate published no cache folder")?);
    let target = cache.join(format!("scipy-openblas32-{SCIPY_OPENBLAS}"));
    let openblas = target.join("scipy_openblas32/lib/libscipy_openblas.so");
    if !openblas.is_file() {
        let tmp = cache.join(format!(".scipy-openblas32-{SCIPY_OPENBLAS}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"])
            .args(["--only-binary=:all:", "--target"])
            .arg(&tmp)
            .arg(format!("scipy-openblas32=={SCIPY_OPENBLAS}"))
            .status()
            .map_err(|e| format!("python3: {e}"))?;
        if !status.success() {
            return Err(format!("python3 -m pip install scipy-openblas32=={SCIPY_OPENBLAS} failed ({status})"));
        }
        let _ = std::fs::remove_dir_all(&target);
        std::fs::rename(&tmp, &target).map_err(|e| format!("moving it into {}: {e}", target.display()))?;
        if !openblas.is_file() {
            return Err(format!("{} is missing after pip install", openblas.display()));
        }
    }
    // Rebuilt when the forwarders change (the source's hash in the file name).
    let text = std::fs::read(&source).map_err(|e| format!("{}: {e}", source.display()))?;
    let hash = text.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let dir = target.join(format!("forward-{hash:016x}"));
    let lib = dir.join("libhost_blas.so");
    if lib.is_file() {
        return Ok(lib);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let libdir = openblas.parent().expect("in a folder");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let tmp = dir.join("libhost_blas.so.tmp");
    let status = Command::new(&cc)
        .args(["-O2", "-shared", "-fPIC", "-o"])
        .arg(&tmp)
        .arg(&source)
        .arg(format!("-L{}", libdir.display()))
        .arg("-l:libscipy_openblas.so")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .status()
        .map_err(|e| format!("{cc}: {e}"))?;
    if !status.success() {
        return Err(format!("{cc} could not build {} ({status})", source.display()));
    }
    std::fs::rename(&tmp, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    Ok(lib)
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
