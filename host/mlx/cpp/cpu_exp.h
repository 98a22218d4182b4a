// The host's SwiGLU on the CPU (cpu_exp.cc): MLX's compiled kernel's bits, sixteen lanes at
// a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#include "mlx/mlx.h"

namespace mlx_shim {

// silu(gate) * x for float32 arrays of one shape on the CPU, by the host's own primitive
// (AVX-512 where the CPU has it, else MLX's scalar arithmetic): the same bits as MLX's
// compiled `swiglu`. nullopt where that does not apply (another device or dtype, or
// HOST_CPU_EXP=0): the caller then takes MLX's compiled kernel.
std::optional<mlx::core::array> cpu_swiglu(const mlx::core::array& gate, const mlx::core::array& x);

// An array of `shape` whose values are unspecified (its buffer allocated, nothing written) on
// the CPU; nullopt on another device (then zeros).
std::optional<mlx::core::array> cpu_uninit(const mlx::core::Shape& shape, mlx::core::Dtype dtype);

// logsumexp over the last axis of a float32 array on the CPU (MLX's LogSumExp's bits), or
// nullopt where that does not apply (then MLX's).
std::optional<mlx::core::array> cpu_logsumexp(const mlx::core::array& x, bool keepdims);

// softmax over the last axis of a float32 array on the CPU (MLX's Softmax's bits), or nullopt
// where that does not apply (then MLX's).
std::optional<mlx::core::array> cpu_softmax(const mlx::core::array& x);

// RMSNorm of a float32 array's last axis on the CPU (what `fast::rms_norm` computes there
// from eleven primitives, in one), with an optional float32 weight of that length; nullopt
// where that does not apply (then MLX's).
std::optional<mlx::core::array> cpu_rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& w,
                                             float eps);

// The rotary embedding of a float32 array [B, ..., T, D] on the CPU (what `fast::rope` computes
// there from some thirty primitives, in one): `base` or `freqs`, int32 offsets (one or B);
// nullopt where that does not apply (then MLX's).
std::optional<mlx::core::array> cpu_rope(const mlx::core::array& x, int dims, bool traditional,
                                         std::optional<float> base, float scale, const mlx::core::array& offset,
                                         const std::optional<mlx::core::array>& freqs);

// Whether these kernels serve anything: false under HOST_CPU_EXP=0 (read once).
bool cpu_exp_enabled();

// Set by tests: 0 MLX's kernels, 1 the host's scalar loops, 2 (default) its AVX-512 loops
// where the CPU has them.
extern std::atomic<int> cpu_exp_mode;

}  // namespace mlx_shim
