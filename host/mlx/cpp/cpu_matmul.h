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

}  // namespace mlx_shim
