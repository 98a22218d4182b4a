// The host's CPU product for a few rows against a weight matrix (cpu_matmul.cc).
#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace mlx_shim {

// Rows of `x` up to this many take one matrix-vector product each; more keep MLX's matmul.
constexpr int kFewRows = 4;

// alpha * x @ b (+ beta * c), x [..., K] with at most kFewRows rows in all, b [K, N], c
// (optional) [N], float32 on the CPU, by the host's own primitive; nullopt where that does
// not apply (another device or dtype or shape, no CBLAS loaded, or HOST_CPU_GEMV=0): the
// caller then takes MLX's matmul or addmm.
std::optional<mlx::core::array> cpu_few_rows_matmul(const mlx::core::array& x, const mlx::core::array& b,
                                                    const mlx::core::array* c, float alpha, float beta);

// a @ b as MLX's matmul computes it on the CPU (float32), the same cblas_sgemm call for each
// matrix of the batch, the batch's matrices spread over the host's CPU threads: a batch
// step's attention is many small products (SmolLM2, 8 rows: 72 of one query row each, twice a
// layer), which MLX runs one after another on one thread. nullopt where that does not apply
// (another device or dtype, one matrix, products too small to share or large enough for
// the BLAS's own threads, HOST_CPU_BATCH_MATMUL=0): the caller then takes MLX's matmul.
std::optional<mlx::core::array> cpu_batched_matmul(const mlx::core::array& a, const mlx::core::array& b);

}  // namespace mlx_shim
