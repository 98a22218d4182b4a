//! Binaries and tests of this crate run without environment variables: point their
//! runtime search path (RUNPATH, so LD_LIBRARY_PATH can still swap in another libmlx,
//! e.g. the CUDA build on the GPU machine) at the wheel's library folder.
//!
//! On Linux, when the system has OpenBLAS (Debian: libopenblas0-pthread), link it as a
//! direct dependency: its BLAS symbols then take precedence over the slow reference BLAS
//! bundled with the mlx-cpu wheel (float32 matmul ~10x faster on a 2-core VM).
//! `HOST_BLAS=bundled` keeps the wheel's BLAS; `HOST_BLAS=openblas` requires OpenBLAS.

use std::path::Path;

fn main() {
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
