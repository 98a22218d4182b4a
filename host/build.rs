//! Binaries and tests of this crate run without environment variables: point their
//! runtime search path (RUNPATH, so LD_LIBRARY_PATH can still swap in another libmlx,
//! e.g. the CUDA build on the GPU machine) at the wheel's library folder.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    }
}
