// The host's CPU attention for long causal queries (cpu_attention.cc).
#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace mlx_shim {

// Queries of up to this many positions keep MLX's path (the models pass them an explicit
// mask, op for op as MLX's fallback: models/src/layers.rs, SHORT_QUERY).
constexpr int kShortQuery = 32;

// Causal attention of q [B, H, L, D] over k, v [B, KVH, S, D] (L <= S: query i sits at
// position S - L + i), float32, on the CPU by the host's own primitive; nullopt where that
// does not apply (another device or dtype, L <= kShortQuery, no CBLAS loaded, or
// HOST_CPU_ATTENTION=0): the caller then takes MLX's own.
std::optional<mlx::core::array> cpu_causal_attention(const mlx::core::array& q, const mlx::core::array& k,
                                                     const mlx::core::array& v, float scale);

}  // namespace mlx_shim
