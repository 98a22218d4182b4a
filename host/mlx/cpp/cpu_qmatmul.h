// The host's CPU product against MLX-quantized weights (cpu_qmatmul.cc).
#pragma once

#include <atomic>
#include <functional>
#include <optional>

#include "mlx/mlx.h"

namespace mlx_shim {

// x @ dequantize(w).T for float32 x [..., K] and MLX affine weights (bits 4 or 8, group a
// multiple of 32; w uint32 [N, K * bits / 32], scales and biases float32 [N, K / group]) on
// the CPU, by the host's own primitive: a few rows read the packed weights once (no float
// copy of them), more rows multiply dequantized blocks of them with the process's sgemm.
// bfloat16 x with bfloat16 scales and biases (an MLX folder in bfloat16): MLX's own CPU
// arithmetic for it (bfloat16 rounding after every operation), its bits, sixteen weight rows
// at once (AVX-512 only).
// nullopt where that does not apply (another device, dtype, mode or shape, or
// HOST_CPU_QMATMUL=0): the caller then takes MLX's quantized_matmul.
std::optional<mlx::core::array> cpu_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                                     const mlx::core::array& scales, const mlx::core::array& biases,
                                                     int group_size, int bits);

// MLX's gather_qmm (transposed weights, affine, no lhs indices: a mixture of experts'
// products) with cpu_quantized_matmul's kernels per matrix: float32 (a run of one-row
// matrices sharing an expert as one product's rows), or bfloat16 (MLX's bits; AVX-512).
// nullopt where that does not apply.
std::optional<mlx::core::array> cpu_gather_qmm(const mlx::core::array& x, const mlx::core::array& w,
                                               const mlx::core::array& scales, const mlx::core::array& biases,
                                               const mlx::core::array& rhs_indices, int group_size, int bits,
                                               bool sorted_indices);

// Whether cpu_quantized_matmul serves anything: false under HOST_CPU_QMATMUL=0 (read once).
bool cpu_qmatmul_enabled();

// The widest kernel cpu_quantized_matmul may pick (3 AVX-512, 2 AVX2, 1 portable C++).
extern std::atomic<int> cpu_qmatmul_isa_cap;

// Activation rows up to which cpu_quantized_matmul reads the packed weights now (the kernel
// the CPU and the cap give); a row's result has the same bits alone or with others up to it.
int cpu_qmatmul_packed_rows();

// Calls fn(i) for every i in [0, tasks) over the pool of threads the products above use (the
// calling thread takes part; one thread a core, or OPENBLAS_NUM_THREADS). A call made while
// another runs, or with one thread, runs on the calling thread alone.
void cpu_parallel_for(int tasks, const std::function<void(int)>& fn);

// The threads cpu_parallel_for spreads over.
int cpu_threads();

}  // namespace mlx_shim
