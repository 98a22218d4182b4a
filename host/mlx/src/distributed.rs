//! MLX's distributed communication (`mlx::core::distributed`): one process-wide group of
//! ranks, joined with [`init`], and the collectives a tensor-parallel model needs.
//! Backends: `ring` (TCP; CPUs, over loopback too), `nccl` (NVIDIA GPUs), `mpi`, `jaccl`.
//! The ring backend reads `MLX_RANK` and `MLX_HOSTFILE` (a JSON file listing each rank's
//! `ip:port`s) from the environment.

use crate::array::wrap;
use crate::ffi::ffi;
use crate::{Array, Dtype, Result};

/// This process's place in the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub rank: usize,
    pub size: usize,
}

/// Joins the group with `backend` ("ring", "nccl", "mpi", "any"); fails if the backend
/// cannot start (e.g. a peer is unreachable).
pub fn init(backend: &str) -> Result<Group> {
    let size = ffi::distributed_init(backend)? as usize;
    let rank = ffi::distributed_rank()? as usize;
    Ok(Group { rank, size })
}

/// The element-wise sum of `a` over all ranks (lazy, like every op).
pub fn all_sum(a: &Array) -> Result<Array> {
    wrap(ffi::all_sum(&a.0))
}

/// Sends `a` to rank `dst` (lazy: evaluating the returned array sends it). The ring backend
/// sends only to a neighbour in the ring (rank ± 1).
pub fn send(a: &Array, dst: usize) -> Result<Array> {
    wrap(ffi::send_to(&a.0, dst as i32))
}

/// An array of `shape` and `dtype` received from rank `src` (lazy, like `send`).
pub fn recv(shape: &[usize], dtype: Dtype, src: usize) -> Result<Array> {
    let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    wrap(ffi::recv_from(&dims, dtype as u8, src as i32))
}

/// As `recv`, received only after `after` is evaluated (a `send` this rank must finish before
/// its peer answers: MLX would otherwise be free to run the receive first and wait forever).
pub fn recv_after(shape: &[usize], dtype: Dtype, src: usize, after: &Array) -> Result<Array> {
    let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    wrap(ffi::recv_after(&dims, dtype as u8, src as i32, &after.0))
}
