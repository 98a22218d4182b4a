//! Which device MLX runs on: the `--device` choice and setting MLX's default device.

use anyhow::{bail, Result};
use mlx::Device;

/// Which device MLX runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The GPU when this libmlx has one (Metal, CUDA), else the CPU.
    Auto,
    Cpu,
    Gpu,
}

impl DeviceChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Gpu => "gpu",
        }
    }
}

/// Picks and sets the default device; an explicit `gpu` without one is an error.
pub fn select_device(choice: DeviceChoice) -> Result<Device> {
    let device = match choice {
        DeviceChoice::Auto => {
            if Device::gpu_available() {
                Device::Gpu
            } else {
                Device::Cpu
            }
        }
        DeviceChoice::Cpu => Device::Cpu,
        DeviceChoice::Gpu if !Device::gpu_available() => {
            bail!("--device gpu: this libmlx ({}) has no usable GPU; use --device cpu", mlx::version())
        }
        DeviceChoice::Gpu => Device::Gpu,
    };
    device.set_default()?;
    Ok(device)
}

/// The BLAS the binary links for MLX's CPU products (chosen by build.rs), in words for the
/// startup log.
pub fn linked_blas() -> String {
    match env!("HOST_LINKED_BLAS") {
        "" => "the mlx-cpu wheel's reference BLAS (slow: install libopenblas0-pthread, or let the build fetch \
               scipy-openblas32 from PyPI, and rebuild)"
            .into(),
        path if path.ends_with("libhost_blas.so") => format!("OpenBLAS from PyPI (scipy-openblas32, {path})"),
        path => format!("OpenBLAS ({path})"),
    }
}
