//! MLX's distributed communication (`mlx::core::distributed`): one process-wide group of
//! ranks, joined with [`init`], and the collectives a tensor-parallel model needs.
//! Backends: `ring` (TCP; CPUs, over loopback too), `nccl` (NVIDIA GPUs), `mpi`, `jaccl`.
//! The ring backend reads `MLX_RANK` and `MLX_HOSTFILE` (a JSON file listing each rank's
//! `ip:port`s) from the environment.

use crate::array::wrap;
use crate::ffi::ffi;
use crate::{Array, Result};

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
