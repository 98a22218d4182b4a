//! Finds a prebuilt MLX (headers + libmlx) and compiles the C++ shim against it.
//!
//! Search order: `MLX_DIR` (a folder holding `include/` and `lib/`), then an installed
//! Python `mlx` package whose folder has both, then a pinned wheel that this script installs
//! with pip into `${HOST_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/host}/mlx-<variant>-<version>`.
//! The library folder is published as `DEP_MLX_LIB_DIR` so binaries can set their rpath.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=HOST_CACHE_DIR");
    println!("cargo:rerun-if-changed=cpp/shim.h");
    println!("cargo:rerun-if-changed=cpp/shim.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_attention.h");
    println!("cargo:rerun-if-changed=cpp/cpu_attention.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_matmul.h");
    println!("cargo:rerun-if-changed=cpp/cpu_matmul.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_qmatmul.h");
    println!("cargo:rerun-if-changed=cpp/cpu_qmatmul.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_exp.h");
    println!("cargo:rerun-if-changed=cpp/cpu_exp.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_blas.h");
    println!("cargo:rerun-if-changed=src/ffi.rs");

    let dir = find_mlx().unwrap_or_else(|why| panic!("cannot find MLX {MLX_VERSION}: {why}"));
    let include = dir.join("include");
    let lib = dir.join("lib");

    cxx_build::bridge("src/ffi.rs")
        .file("cpp/shim.cc")
        .file("cpp/cpu_attention.cc")
        .file("cpp/cpu_matmul.cc")
        .file("cpp/cpu_qmatmul.cc")
        .file("cpp/cpu_exp.cc")
        .std("c++20")
        .flag("-isystem")
        .flag(include.to_str().expect("MLX include path is UTF-8"))
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("mlx_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if cfg!(target_os = "macos") {
        for fw in ["Metal", "Foundation", "QuartzCore", "Accelerate"] {
            println!("cargo:rustc-link-lib=framework={fw}");
        }
    }
    // Published to dependents as DEP_MLX_LIB_DIR / DEP_MLX_INCLUDE_DIR.
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:include_dir={}", include.display());
    // And the download cache (DEP_MLX_CACHE_DIR: the host's build puts PyPI's OpenBLAS there).
    if let Ok(cache) = cache_dir() {
        println!("cargo:cache_dir={}", cache.display());
    }
    // This crate's own tests need the rpath too.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// The host's download cache: `$HOST_CACHE_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/host`.
fn cache_dir() -> Result<PathBuf, String> {
    match env::var_os("HOST_CACHE_DIR") {
        Some(d) => Ok(PathBuf::from(d)),
        None => Ok(env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or("neither HOME nor XDG_CACHE_HOME is set")?
            .join("host")),
    }
}

fn has_mlx(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file()
        && (dir.join("lib/libmlx.so").is_file() || dir.join("lib/libmlx.dylib").is_file())
}

fn wheel() -> &'static str {
    if cfg!(target_os = "macos") {
        "mlx-metal"
    } else if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        "mlx-cuda-13"
    } else {
        "mlx-cpu"
    }
}

fn find_mlx() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("MLX_DIR") {
        let dir = PathBuf::from(dir);
        return if has_mlx(&dir) {
            Ok(dir)
        } else {
            Err(format!("MLX_DIR={} has no include/mlx/mlx.h and lib/libmlx.*", dir.display()))
        };
    }
    // An installed Python mlx counts only if it is the pinned version and ships the library
    // (plain `mlx` on Linux is the Python layer; `mlx-cpu`/`mlx-cuda-13` bring libmlx).
    // A CUDA build is never picked up implicitly: it must be asked for with the feature.
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        for py in ["python3", "python"] {
            let out = Command::new(py)
                .args(["-c", "import mlx, os, importlib.metadata as m; print(os.path.dirname(mlx.__file__)); print(m.version('mlx'))"])
                .output();
            if let Ok(out) = out {
                let text = String::from_utf8_lossy(&out.stdout);
                let mut lines = text.lines();
                if let (Some(dir), Some(version)) = (lines.next(), lines.next()) {
                    let dir = PathBuf::from(dir.trim());
                    if version.trim() == MLX_VERSION && has_mlx(&dir) && !is_cuda(&dir) {
                        return Ok(dir);
                    }
                }
            }
        }
    }
    let cache = cache_dir()?;
    let target = cache.join(format!("{}-{MLX_VERSION}", wheel()));
    let dir = target.join("mlx");
    if has_mlx(&dir) {
        return Ok(dir);
    }
    eprintln!("installing {}=={MLX_VERSION} into {}", wheel(), target.display());
    let tmp = cache.join(format!(".{}-{MLX_VERSION}.tmp", wheel()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut last = String::new();
    for py in ["python3", "python"] {
        let status = Command::new(py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "--target",
            ])
            .arg(&tmp)
            .arg(format!("{}=={MLX_VERSION}", wheel()))
            .status();
        match status {
            Ok(s) if s.success() => {
                let _ = std::fs::remove_dir_all(&target);
                std::fs::rename(&tmp, &target)
                    .map_err(|e| format!("moving the wheel into {}: {e}", target.display()))?;
                return if has_mlx(&dir) {
                    Ok(dir)
                } else {
                    Err(format!("{} has no MLX headers and library after pip install", dir.display()))
                };
            }
            Ok(s) => last = format!("{py} -m pip install {}=={MLX_VERSION} failed ({s})", wheel()),
            Err(e) => last = format!("{py}: {e}"),
        }
    }
    Err(format!("{last}; set MLX_DIR to a folder with include/ and lib/ from the {} wheel", wheel()))
}

fn is_cuda(dir: &Path) -> bool {
    dir.join("lib/libmlx.so").is_file() && dir.parent().map(|p| p.join("nvidia").exists()).unwrap_or(false)
}
