//! Devices, evaluation and memory accounting.

use crate::ffi::ffi;
use crate::ops::list;
use crate::{Array, Result};

/// Where MLX runs new operations by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    /// The default device of the calling thread.
    pub fn default_device() -> Device {
        if ffi::default_device_is_gpu() {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }
    /// Makes `self` the default device; fails if this build of MLX has no such device.
    pub fn set_default(self) -> Result<()> {
        Ok(ffi::set_default_device_gpu(self == Device::Gpu)?)
    }
    /// Whether the linked libmlx has a GPU backend and a GPU is present (Metal or CUDA).
    pub fn gpu_available() -> bool {
        ffi::gpu_is_available()
    }
    /// Total memory of the device as MLX reports it (`None` where it does not, e.g. the CPU).
    pub fn memory_size(self) -> Option<usize> {
        ffi::device_memory_size(self == Device::Gpu).ok().filter(|&n| n > 0)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        })
    }
}

/// A queue of work on one device. Each thread starts with a default stream per device;
/// `Stream::new` makes another (mlx-lm runs generation on its own stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    index: i32,
    device: Device,
}

impl Stream {
    pub fn new(device: Device) -> Result<Stream> {
        Ok(Stream { index: ffi::new_stream(device == Device::Gpu)?, device })
    }
    /// Makes this the calling thread's default stream for its device.
    pub fn set_default(self) -> Result<()> {
        Ok(ffi::set_default_stream(self.index, self.device == Device::Gpu)?)
    }
    pub fn device(self) -> Device {
        self.device
    }
}

/// Evaluates the arrays (and everything they depend on), blocking until done.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    Ok(ffi::eval(&list(arrays))?)
}

/// Starts evaluating the arrays and returns at once; reading them later waits.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    Ok(ffi::async_eval(&list(arrays))?)
}

/// Starts `arrays` (as `async_eval`) together with a private copy of `value`, which another
/// thread may then wait for and read (`Detached`) while this one goes on building and
/// starting graphs.
pub fn async_eval_detached(arrays: &[&Array], value: &Array) -> Result<Detached> {
    let copy = value.copy()?;
    let mut all = arrays.to_vec();
    all.push(&copy);
    async_eval(&all)?;
    Ok(Detached(copy))
}

/// An array already started and held by nothing else (`async_eval_detached`). Arrays are
/// not `Send` (a lazy graph belongs to its thread's stream); this one may go to another
/// thread because its work is already on the stream: reading it only waits for the work's
/// event and copies the values out, and its own state is nobody else's (its inputs are
/// reached only through reference counts, which are atomic).
pub struct Detached(Array);

// SAFETY: see `Detached`: started before it exists, and owned by one thread at a time.
unsafe impl Send for Detached {}

impl Detached {
    /// Waits for the value and reads it, as int32.
    pub fn to_vec_i32(self) -> Result<Vec<i32>> {
        self.0.to_vec_i32()
    }
}

/// The not yet evaluated graph behind `arrays`, in Graphviz dot (MLX's `export_to_dot`):
/// one node per primitive, which is what MLX dispatches as a kernel.
pub fn graph_dot(arrays: &[&Array]) -> String {
    ffi::graph_dot(&list(arrays))
}

/// The widest instructions the CPU quantized product may use (3 AVX-512, 2 AVX2, 1 portable
/// C++; it never goes wider than the CPU has): for tests of the narrower kernels. Returns how
/// many activation rows the product then reads the packed weights for (a row's bits its own
/// alone or with others up to that many).
#[doc(hidden)]
pub fn cap_cpu_qmatmul_isa(level: i32) -> i32 {
    ffi::cap_cpu_qmatmul_isa(level)
}

/// Which kernels `ops::swiglu` and `logsumexp` over the last axis run on the CPU for float32:
/// 0 MLX's, 1 the host's scalar loops, 2 (the default) the widest of its AVX-512 and AVX2 loops
/// the CPU has, 3 its AVX2 loops where the CPU has them: for tests.
#[doc(hidden)]
pub fn set_cpu_exp_mode(mode: i32) {
    ffi::set_cpu_exp_mode(mode);
}

/// Whether quantized products on the CPU are the shim's own (`HOST_CPU_QMATMUL` unset or not
/// `0`): loaders keep quantized weights packed for them, else expand them to float32.
pub fn cpu_quantized_products() -> bool {
    ffi::cpu_quantized_products()
}

/// Waits for all work queued on the default stream.
pub fn synchronize() -> Result<()> {
    Ok(ffi::synchronize()?)
}

/// Ends the process with `code` at once, running no exit handlers: for a process whose
/// MLX work could not be stopped (a thread still inside a step). A plain exit then tears
/// down MLX's statics and the BLAS library under that thread: OpenBLAS's exit handler joins
/// its worker threads and hangs for good on ones a running step holds. Output buffered in C
/// stdio is flushed first; Rust's `eprintln!` and `tracing` write unbuffered.
pub fn exit_without_teardown(code: i32) -> ! {
    ffi::exit_without_teardown(code);
    unreachable!("_Exit returned")
}

/// The linked libmlx's version string.
pub fn version() -> String {
    ffi::version()
}

/// Memory accounting and limits of MLX's allocator.
pub mod memory {
    use super::ffi;

    /// Bytes held by live arrays.
    pub fn active() -> usize {
        ffi::get_active_memory()
    }
    /// The most `active()` has been since start or the last `reset_peak()`.
    pub fn peak() -> usize {
        ffi::get_peak_memory()
    }
    /// Bytes freed but kept by the allocator for reuse.
    pub fn cache() -> usize {
        ffi::get_cache_memory()
    }
    pub fn reset_peak() {
        ffi::reset_peak_memory()
    }
    /// Sets the allocation limit; returns the previous one.
    pub fn set_limit(bytes: usize) -> usize {
        ffi::set_memory_limit(bytes)
    }
    /// Sets how much freed memory the allocator keeps; returns the previous limit.
    pub fn set_cache_limit(bytes: usize) -> usize {
        ffi::set_cache_limit(bytes)
    }
    /// Returns the allocator's cached buffers to the system (and, with glibc, the heap's free
    /// pages: `malloc_trim`).
    pub fn clear_cache() {
        ffi::clear_cache()
    }
}
