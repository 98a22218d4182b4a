// Implementations of the functions declared in shim.h. Each one converts Rust slices to MLX
// shapes and wraps the result in a unique_ptr; MLX's exceptions pass through to cxx, which
// turns them into Rust errors.
#include "mlx/cpp/shim.h"
#include "mlx/cpp/cpu_attention.h"
#include "mlx/cpp/cpu_matmul.h"
#include "mlx/cpp/cpu_qmatmul.h"
#include "mlx/cpp/cpu_exp.h"

#include <cstdio>
#include <cstdlib>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cstring>
#include <optional>
#include <sstream>

#include "mlx/backend/cuda/cuda.h"
#include "mlx/graph_utils.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace mx = mlx::core;

namespace mlx_shim {
namespace {

// Dtype codes shared with src/dtype.rs.
mx::Dtype to_dtype(uint8_t code) {
  switch (code) {
    case 0: return mx::bool_;
    case 1: return mx::uint8;
    case 2: return mx::uint16;
    case 3: return mx::uint32;
    case 4: return mx::uint64;
    case 5: return mx::int8;
    case 6: return mx::int16;
    case 7: return mx::int32;
    case 8: return mx::int64;
    case 9: return mx::float16;
    case 10: return mx::float32;
    case 11: return mx::float64;
    case 12: return mx::bfloat16;
    case 13: return mx::complex64;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(code));
}

uint8_t from_dtype(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return 0;
    case mx::Dtype::Val::uint8: return 1;
    case mx::Dtype::Val::uint16: return 2;
    case mx::Dtype::Val::uint32: return 3;
    case mx::Dtype::Val::uint64: return 4;
    case mx::Dtype::Val::int8: return 5;
    case mx::Dtype::Val::int16: return 6;
    case mx::Dtype::Val::int32: return 7;
    case mx::Dtype::Val::int64: return 8;
    case mx::Dtype::Val::float16: return 9;
    case mx::Dtype::Val::float32: return 10;
    case mx::Dtype::Val::float64: return 11;
    case mx::Dtype::Val::bfloat16: return 12;
    case mx::Dtype::Val::complex64: return 13;
  }
  return 255;
}

// ---- 4-bit matrix-vector kernel for decoding (issue 6) -------------------------------------
// MLX CUDA's 4-bit quantized matmul moves ~0.64 TB/s on an H200 for one activation row (bf16
// moves ~3 TB/s), so a 4-bit decode step was slower than a bf16 one. This kernel computes the
// same product, y = x @ dequantize(w).T for one row x, through MLX's custom-kernel API (NVRTC,
// compiled once per shape and dtype, launched inside MLX's CUDA graphs).
//
// Format (MLX affine, bits 4, group G): w uint32 [rows, in/8], eight 4-bit values per word,
// lowest bits first; scales, biases [rows, in/G] in the activation dtype;
// y[r] = sum_g scales[r,g] * dot(q[r,g], x[g]) + biases[r,g] * sum(x[g]).
//
// Each warp computes R rows. Per iteration a lane takes one 32-weight chunk (16 bytes of each
// row, coalesced across the warp), converts the chunk's 32 activations to float once and uses
// them for all R rows (the activation vector is re-read from L1/L2 once per R rows instead of
// once per row). Nibbles become floats without an int-to-float conversion (quarter rate):
// a byte permute builds the float 2^23 + n and one subtraction leaves n exactly. Float
// accumulation, a warp-shuffle reduction, one rounding to T at the end. G is a multiple of
// 32, so a chunk never straddles two groups. bench/device/qgemv.py reads this source (between
// the BEGIN/END lines) to check and time it against MLX's kernel on the 8B's shapes.
// Measured (bench/RESULTS.md, session 6): 1.8 TB/s over an 8B decode step against MLX's 0.74;
// about 3 instructions per weight make it issue-bound (bench/NOTES.md has the next steps).
// BEGIN qmv4
constexpr const char* kQmv4Header = R"CUDA(
__device__ __forceinline__ float host_nibble(uint32_t bytes, int k) {
  return __int_as_float(__byte_perm(bytes, 0x4B000000u, 0x7440u + k)) - 8388608.f;
}
)CUDA";
constexpr const char* kQmv4Source = R"CUDA(
  constexpr int CHUNKS = IN / 32;
  constexpr int GROUPS = IN / GROUP;
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= ROWS) return;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int c = lane; c < CHUNKS; c += 32) {
    float xf[32];
    float sx = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 raw = xv[c * 4 + i];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        xf[i * 8 + j] = static_cast<float>(e[j]);
        sx += xf[i * 8 + j];
      }
    }
    const int g = (c * 32) / GROUP;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= ROWS) break;
      const uint4 q = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * (IN / 8))[c];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = words[i] & 0x0F0F0F0Fu;
        const uint32_t hi = (words[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          dot += host_nibble(lo, k) * xf[i * 8 + 2 * k];
          dot += host_nibble(hi, k) * xf[i * 8 + 2 * k + 1];
        }
      }
      const size_t sg = static_cast<size_t>(row) * GROUPS + g;
      acc[r] += static_cast<float>(scales[sg]) * dot + static_cast<float>(biases[sg]) * sx;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (lane == 0 && row0 + r < ROWS) y[row0 + r] = static_cast<T>(acc[r]);
  }
)CUDA";
// END qmv4
// BEGIN qmm4
// The same product for a batch of activation rows (decoding several sequences at once,
// 2..=32 rows): each warp decodes its weight rows' nibbles once per 32-element chunk and
// applies them to every activation row (read from L1/L2: a batch's x is at most 32 x IN
// elements), so the weights are read once per step whatever the batch. NB (a power of two
// >= the batch) sizes the accumulators; the batch itself, M, comes in `meta`.
constexpr const char* kQmm4Source = R"CUDA(
  constexpr int CHUNKS = IN / 32;
  constexpr int GROUPS = IN / GROUP;
  const int M = meta[0];
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= ROWS) return;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[R][NB];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;
  for (int c = lane; c < CHUNKS; c += 32) {
    const int g = (c * 32) / GROUP;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= ROWS) break;
      const uint4 q = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * (IN / 8))[c];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      float wf[32];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = words[i] & 0x0F0F0F0Fu;
        const uint32_t hi = (words[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          wf[i * 8 + 2 * k] = host_nibble(lo, k);
          wf[i * 8 + 2 * k + 1] = host_nibble(hi, k);
        }
      }
      const size_t sg = static_cast<size_t>(row) * GROUPS + g;
      const float scale = static_cast<float>(scales[sg]);
      const float bias = static_cast<float>(biases[sg]);
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        if (b >= M) break;
        float dot = 0.f, sx = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 raw = xv[(static_cast<size_t>(b) * CHUNKS + c) * 4 + i];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float xf = static_cast<float>(e[j]);
            dot += wf[i * 8 + j] * xf;
            sx += xf;
          }
        }
        acc[r][b] += scale * dot + bias * sx;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if (b >= M) break;
      float v = acc[r][b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && row0 + r < ROWS) y[static_cast<size_t>(b) * ROWS + row0 + r] = static_cast<T>(v);
    }
  }
)CUDA";
// END qmm4
constexpr int kQmm4MaxRows = 32;

constexpr int kQmv4RowsPerWarp = 2;

// HOST_QGEMV=0 keeps MLX's kernel everywhere (for A/B runs); read once.
bool qmv4_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_QGEMV");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

// The kernels serve one activation row (qmv4) or up to kQmm4MaxRows (qmm4: a batch of
// sequences decoding), bf16/f16 activations with scales and
// biases of the same dtype, 4 bits, a group size that is a multiple of 32, an input width
// that is a multiple of 32 (whole 16-byte chunks per row), on a CUDA stream. The kernel reads
// x as 16-byte vectors: a one-row x is a whole array or a whole row of one (offset a multiple
// of the width, so of 32 elements); nothing in the host slices inside a row.
bool qmv4_applies(const array& x, const array& w, const array& scales, const array& biases,
                  bool transpose, int group_size, int bits) {
  if (!transpose || bits != 4 || group_size <= 0 || group_size % 32 != 0 || !qmv4_enabled()) return false;
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) return false;
  const auto dt = x.dtype();
  if ((dt != mx::bfloat16 && dt != mx::float16) || scales.dtype() != dt || biases.dtype() != dt ||
      w.dtype() != mx::uint32) {
    return false;
  }
  const int in = x.shape(-1);
  const int rows = w.shape(0);
  // One activation row (qmv4), or a batch of up to kQmm4MaxRows whole rows (qmm4).
  if (in <= 0 || x.size() % in != 0 || x.size() / in > static_cast<size_t>(kQmm4MaxRows) ||
      in % 32 != 0 || in % group_size != 0 ||
      static_cast<int64_t>(w.shape(1)) * 8 != in || scales.shape(0) != rows ||
      scales.shape(1) != in / group_size || biases.shape() != scales.shape()) {
    return false;
  }
  static const bool cuda = mx::cu::is_available();
  return cuda && mx::default_device() == mx::Device::gpu;
}

// ---- Batched 4-bit products: dequantize, then multiply (issue 19) ---------------------------
// From a few activation rows up (sequences decoding together, prefill chunks), MLX CUDA's
// quantized_matmul and the shim's qmm4 both re-read activations per weight row and run far
// below the bandwidth: on the H200 the 8B's 4-bit step at 32 rows took ~88 ms with qmm4 and
// ~117 ms with MLX's kernel against ~8 ms in bf16. Dequantizing each weight to the activation
// dtype and running MLX's (cuBLAS) matmul reads 4 bits, writes and reads 16 per weight, once
// per step whatever the batch. Measured on the H200 (bench/RESULTS.md, `host bench --batch`
// with HOST_QDEQUANT_ROWS=0/4/8): the 8B's 32-row step 24 ms against 89 ms with qmm4, 16 rows
// 22.5 ms against 45; at 8 rows qmm4 is as fast (20 ms) and below that faster, hence 9.
// Prefill chunks take this path too (about 2x the prefill tok/s of MLX's kernel). The cost is
// memory: MLX CUDA frees a step's temporaries when its work completes, so the dequantized
// copies of a whole step are held at once (the 8B at 32 rows peaked at 27.6 GB against
// 14.5 GB); the engine's warm-up measures that peak and keeps it out of the KV budget.
// HOST_QDEQUANT_ROWS=N moves the threshold (0 turns it off); read once.
constexpr int kQdequantMinRows = 9;
int qdequant_min_rows() {
  static const int rows = [] {
    const char* v = std::getenv("HOST_QDEQUANT_ROWS");
    if (!v) return kQdequantMinRows;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 0 || n > (1 << 30)) {
      std::fprintf(stderr, "HOST_QDEQUANT_ROWS=%s is not a row count (0 turns the path off); using %d\n", v,
                   kQdequantMinRows);
      return kQdequantMinRows;
    }
    return static_cast<int>(n);
  }();
  return rows;
}

bool dequant_applies(const array& x, const array& w, bool transpose, int bits) {
  const int min_rows = qdequant_min_rows();
  // 4 bits only: the 8-bit crossover has not been measured.
  if (min_rows <= 0 || !transpose || bits != 4 || x.ndim() < 1 || w.ndim() != 2) return false;
  const auto dt = x.dtype();
  if (dt != mx::bfloat16 && dt != mx::float16) return false;
  const int in = x.shape(-1);
  if (in <= 0 || x.size() / in < static_cast<size_t>(min_rows)) return false;
  static const bool cuda = mx::cu::is_available();
  return cuda && mx::default_device() == mx::Device::gpu;
}

array qmv4(const array& x, const array& w, const array& scales, const array& biases, int group_size) {
  static const auto kernel = mx::fast::cuda_kernel("host_qmv4", {"x", "w", "scales", "biases"}, {"y"},
                                                   kQmv4Source, kQmv4Header);
  static const auto batched = mx::fast::cuda_kernel("host_qmm4", {"x", "w", "scales", "biases", "meta"}, {"y"},
                                                    kQmm4Source, kQmv4Header);
  const int in = x.shape(-1);
  const int rows = w.shape(0);
  auto out_shape = x.shape();
  out_shape.back() = rows;
  const int warps = (rows + kQmv4RowsPerWarp - 1) / kQmv4RowsPerWarp;
  const int m = static_cast<int>(x.size() / in);
  if (m > 1) {
    int nb = 2;
    while (nb < m) nb *= 2;
    const array meta(std::initializer_list<int32_t>{m});
    return batched({x, w, scales, biases, meta}, {out_shape}, {x.dtype()}, {warps * 32, 1, 1}, {256, 1, 1},
                   {{"T", x.dtype()}, {"ROWS", rows}, {"IN", in}, {"GROUP", group_size}, {"R", kQmv4RowsPerWarp},
                    {"NB", nb}},
                   std::nullopt, false, {})[0];
  }
  return kernel({x, w, scales, biases}, {out_shape}, {x.dtype()}, {warps * 32, 1, 1}, {256, 1, 1},
                {{"T", x.dtype()}, {"ROWS", rows}, {"IN", in}, {"GROUP", group_size}, {"R", kQmv4RowsPerWarp}},
                std::nullopt, false, {})[0];
}

// ---- Constraint masks applied to a batch's logits (issue 23) ---------------------------------
// A constrained batch step refuses each row's tokens by a `[1, V]` bool row kept on the device
// (true where refused). With MLX's ops that is a concatenate of the B rows (one copy kernel per
// row) and a where: B + 1 launches on the engine thread's separate sampling, a step's only
// work beyond an unconstrained one's (bench/RESULTS.md, session 28: 0.17 ms of a 2.4 ms
// llama-1b batch-of-8 step, most of it launches). This kernel reads the rows where they lie:
// one launch for up to kMaskedRows rows (more are taken in groups). On the CPU, or under
// HOST_MASK_KERNEL=0 (for A/B runs; read once), MLX's ops do it.
constexpr int kMaskedRows = 8;
constexpr const char* kMaskedRowsSource = R"CUDA(
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (t >= V) return;
  const bool* rows[8] = {m0, m1, m2, m3, m4, m5, m6, m7};
  const size_t at = static_cast<size_t>(r) * V + t;
  out[at] = rows[r][t] ? static_cast<T>(__int_as_float(0xff800000)) : logits[at];
)CUDA";

bool masked_rows_kernel_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_MASK_KERNEL");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

array masked_rows_array(const array& logits, const ArrayList& rows, const array& neg_inf) {
  const auto& refused = rows.items;
  const int b = logits.ndim() == 2 ? logits.shape(0) : -1;
  if (b != static_cast<int>(refused.size()) || b < 1) {
    throw std::invalid_argument("masked_rows: a [B, V] logits array and B refused rows are needed");
  }
  static const bool cuda = mx::cu::is_available();
  const auto dt = logits.dtype();
  const int v = logits.shape(1);
  const bool rows_fit = std::all_of(refused.begin(), refused.end(), [v](const array& r) {
    return r.dtype() == mx::bool_ && r.ndim() == 2 && r.shape(0) == 1 && r.shape(1) == v;
  });
  const bool applies = masked_rows_kernel_enabled() && cuda && mx::default_device() == mx::Device::gpu && rows_fit &&
                       (dt == mx::bfloat16 || dt == mx::float16 || dt == mx::float32);
  if (!applies) {
    const array all = refused.size() == 1 ? refused[0] : mx::concatenate(refused, 0);
    return mx::where(all, neg_inf, logits);
  }
  static const auto kernel =
      mx::fast::cuda_kernel("host_masked_rows", {"logits", "m0", "m1", "m2", "m3", "m4", "m5", "m6", "m7"}, {"out"},
                            kMaskedRowsSource, "");
  const int blocks = (v + 255) / 256;
  std::vector<array> parts;
  for (int start = 0; start < b; start += kMaskedRows) {
    const int n = std::min(kMaskedRows, b - start);
    std::vector<array> inputs{n == b ? logits : mx::slice(logits, {start, 0}, {start + n, v})};
    for (int i = 0; i < kMaskedRows; ++i) inputs.push_back(refused[start + std::min(i, n - 1)]);
    const mx::Shape shape{n, v};
    parts.push_back(kernel(inputs, {shape}, {dt}, {blocks * 256, n, 1}, {256, 1, 1}, {{"T", dt}, {"V", v}},
                           std::nullopt, false, {})[0]);
  }
  return parts.size() == 1 ? parts[0] : mx::concatenate(parts, 0);
}

// ---- Causal attention of a short query (speculative verification, issue 5) ------------------
// A verification scores L = 2..32 new positions against S cached keys. MLX's fused attention
// sends such a query to cuDNN, which builds an execution plan per (L, S), i.e. per
// verification (~45 ms); the host's unfused graph (two batched products, a select and a
// softmax per layer) needs no plan but costs ~3 ms of MLX dispatch per SmolLM2 verification
// against ~0.4 ms for one-token attention (bench/NOTES.md, session 11). This kernel is one
// op per layer: one block per (head, query row) computes the row's scores into shared memory,
// its softmax, and the weighted sum of values, in float, for the causal mask of a query block
// that ends the sequence (query i sees keys 0 .. S - L + i). S, L and the scale arrive in a
// small int32 array (`meta`), so one compiled kernel per (dtype, heads, KV heads, head dim)
// serves every verification. bench/device/sq_attention.py reads this source (between the
// BEGIN/END lines) to check it against MLX's attention and time it.
// BEGIN sq_attention
constexpr const char* kSqAttentionHeader = R"CUDA(
__device__ __forceinline__ float host_block_reduce(float x, float* scratch, bool take_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = take_max ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < warps; ++w) r = take_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}
)CUDA";
constexpr const char* kSqAttentionSource = R"CUDA(
  constexpr int THREADS = 128;
  constexpr int GROUPS = THREADS / D;  // key-range groups for the value sum (D <= THREADS)
  __shared__ float qs[D];
  __shared__ float p[MAXS];
  __shared__ float part[GROUPS][D];
  __shared__ float scratch[THREADS / 32];
  const int S = meta[0], L = meta[1];
  const float scale = __int_as_float(meta[2]);
  const int row = blockIdx.x;  // head * L + query
  const int tid = threadIdx.x;
  const int head = row / L, i = row - head * L;
  const int kv = head / (H / KVH);
  const int n = S - L + i + 1;  // keys this query sees
  const T* qrow = q + static_cast<size_t>(row) * D;
  for (int d = tid; d < D; d += THREADS) qs[d] = static_cast<float>(qrow[d]) * scale;
  __syncthreads();
  const T* kh = k + static_cast<size_t>(kv) * S * D;
  float top = -3.402823466e38f;
  for (int j = tid; j < n; j += THREADS) {
    const T* kr = kh + static_cast<size_t>(j) * D;
    float s = 0.f;
#pragma unroll 16
    for (int d = 0; d < D; ++d) s += qs[d] * static_cast<float>(kr[d]);
    p[j] = s;
    top = fmaxf(top, s);
  }
  top = host_block_reduce(top, scratch, true);
  float sum = 0.f;
  for (int j = tid; j < n; j += THREADS) {
    const float e = __expf(p[j] - top);
    p[j] = e;
    sum += e;
  }
  sum = host_block_reduce(sum, scratch, false);
  const int g = tid / D, d = tid - g * D;
  if (g < GROUPS) {
    const T* vh = v + static_cast<size_t>(kv) * S * D + d;
    float acc = 0.f;
    for (int j = g; j < n; j += GROUPS) acc += p[j] * static_cast<float>(vh[static_cast<size_t>(j) * D]);
    part[g][d] = acc;
  }
  __syncthreads();
  if (tid < D) {
    float acc = 0.f;
#pragma unroll
    for (int gg = 0; gg < GROUPS; ++gg) acc += part[gg][tid];
    o[static_cast<size_t>(row) * D + tid] = static_cast<T>(acc / sum);
  }
)CUDA";
// END sq_attention
constexpr int kSqAttentionMaxKeys = 4096;
constexpr int kSqAttentionThreads = 128;

// HOST_SQ_KERNEL=1 turns the kernel on (off by default until it has won an A/B); read once.
bool sq_attention_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_SQ_KERNEL");
    return v && std::string(v) == "1";
  }();
  return on;
}

// q [1, H, L, D], k and v [1, KVH, S, D] (any strides: they are made contiguous), L in 2..32,
// L <= S <= kSqAttentionMaxKeys, D 64 or 128, H a multiple of KVH, a float dtype, on CUDA.
bool sq_attention_applies(const array& q, const array& k, const array& v) {
  if (!sq_attention_enabled() || q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape()) return false;
  const int h = q.shape(1), l = q.shape(2), d = q.shape(3), kvh = k.shape(1), s = k.shape(2);
  const auto dt = q.dtype();
  if (q.shape(0) != 1 || k.shape(0) != 1 || k.shape(3) != d || (d != 64 && d != 128) || kvh <= 0 ||
      h % kvh != 0 || l < 2 || l > 32 || s < l || s > kSqAttentionMaxKeys ||
      (dt != mx::bfloat16 && dt != mx::float16 && dt != mx::float32) || k.dtype() != dt || v.dtype() != dt) {
    return false;
  }
  static const bool cuda = mx::cu::is_available();
  return cuda && mx::default_device() == mx::Device::gpu;
}

array sq_attention(const array& q, const array& k, const array& v, float scale) {
  static const auto kernel = mx::fast::cuda_kernel("host_sq_attention", {"q", "k", "v", "meta"}, {"o"},
                                                   kSqAttentionSource, kSqAttentionHeader);
  const int h = q.shape(1), l = q.shape(2), d = q.shape(3), kvh = k.shape(1), s = k.shape(2);
  int32_t bits;
  std::memcpy(&bits, &scale, sizeof bits);
  const array meta(std::initializer_list<int32_t>{s, l, bits});
  return kernel({q, k, v, meta}, {q.shape()}, {q.dtype()}, {h * l * kSqAttentionThreads, 1, 1},
                {kSqAttentionThreads, 1, 1},
                {{"T", q.dtype()}, {"H", h}, {"KVH", kvh}, {"D", d}, {"MAXS", kSqAttentionMaxKeys}},
                std::nullopt, false, {})[0];
}

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> to_ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }
Ptr wrap(array a) { return std::make_unique<array>(std::move(a)); }

size_t checked_elements(rust::Slice<const int32_t> shape) {
  size_t n = 1;
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension " + std::to_string(d));
    n *= static_cast<size_t>(d);
  }
  return n;
}

// MLX trusts the caller that a buffer matches its shape; this is where we check it.
template <typename T>
Ptr from_buffer(rust::Slice<const T> data, rust::Slice<const int32_t> shape) {
  size_t n = checked_elements(shape);
  if (n != data.size()) {
    throw std::invalid_argument("buffer has " + std::to_string(data.size()) +
                                " elements but the shape needs " + std::to_string(n));
  }
  return wrap(array(data.data(), to_shape(shape), mx::TypeToDtype<T>()));
}

// One element of S as T (half types convert through float).
template <typename T, typename S>
T element(S v) {
  if constexpr (std::is_same_v<S, mx::float16_t> || std::is_same_v<S, mx::bfloat16_t>) {
    return static_cast<T>(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// Copies the evaluated `c` (stored as S, any strides) out as T, in row-major order.
template <typename T, typename S>
void copy_out(const array& c, rust::Vec<T>& out) {
  const S* p = c.data<S>();
  const size_t n = c.size();
  out.reserve(n);
  if (c.flags().row_contiguous) {
    for (size_t i = 0; i < n; ++i) out.push_back(element<T>(p[i]));
    return;
  }
  const auto& shape = c.shape();
  const auto& strides = c.strides();
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> idx(nd, 0);
  int64_t off = 0;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(element<T>(p[off]));
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

// Evaluates `a` and copies it out as T. `a` is evaluated on its own and converted here, on
// the CPU, element by element: no MLX operation runs after it. A conversion queued on `a`'s
// (GPU) stream would wait for everything queued there since, such as the next decode step
// dispatched while this token was computed; one on the CPU stream would make MLX synchronize
// the two devices with its slow atomic events (an `event_signal_kernel` per read, measured
// in bench/NOTES.md).
template <typename T>
rust::Vec<T> read(const array& a) {
  array c = a;
  mx::eval(c);
  rust::Vec<T> out;
  switch (c.dtype()) {
    case mx::bool_: copy_out<T, bool>(c, out); break;
    case mx::uint8: copy_out<T, uint8_t>(c, out); break;
    case mx::uint16: copy_out<T, uint16_t>(c, out); break;
    case mx::uint32: copy_out<T, uint32_t>(c, out); break;
    case mx::uint64: copy_out<T, uint64_t>(c, out); break;
    case mx::int8: copy_out<T, int8_t>(c, out); break;
    case mx::int16: copy_out<T, int16_t>(c, out); break;
    case mx::int32: copy_out<T, int32_t>(c, out); break;
    case mx::int64: copy_out<T, int64_t>(c, out); break;
    case mx::float16: copy_out<T, mx::float16_t>(c, out); break;
    case mx::bfloat16: copy_out<T, mx::bfloat16_t>(c, out); break;
    case mx::float32: copy_out<T, float>(c, out); break;
    case mx::float64: copy_out<T, double>(c, out); break;
    default: throw std::invalid_argument("cannot read an array of this dtype (complex) as numbers");
  }
  return out;
}

const mx::GGUFMetaData& meta(const Loaded& l, rust::Str key) {
  auto it = l.gguf_meta.find(std::string(key));
  if (it == l.gguf_meta.end()) throw std::out_of_range("no metadata key " + std::string(key));
  return it->second;
}

}  // namespace

std::unique_ptr<ArrayList> list_new() { return std::make_unique<ArrayList>(); }
void list_push(ArrayList& list, const array& a) { list.items.push_back(a); }
size_t list_len(const ArrayList& list) { return list.items.size(); }
Ptr list_get(const ArrayList& list, size_t i) { return std::make_unique<array>(list.items.at(i)); }

Ptr from_f32(rust::Slice<const float> d, rust::Slice<const int32_t> s) { return from_buffer(d, s); }
Ptr from_i32(rust::Slice<const int32_t> d, rust::Slice<const int32_t> s) { return from_buffer(d, s); }
Ptr from_u32(rust::Slice<const uint32_t> d, rust::Slice<const int32_t> s) { return from_buffer(d, s); }
Ptr scalar_f32(float v, uint8_t dt) { return wrap(array(v, to_dtype(dt))); }
Ptr zeros(rust::Slice<const int32_t> s, uint8_t dt) {
  checked_elements(s);
  return wrap(mx::zeros(to_shape(s), to_dtype(dt)));
}
Ptr uninit(rust::Slice<const int32_t> s, uint8_t dt) {
  checked_elements(s);
  if (auto a = cpu_uninit(to_shape(s), to_dtype(dt))) return wrap(std::move(*a));
  return wrap(mx::zeros(to_shape(s), to_dtype(dt)));
}
Ptr arange(double start, double stop, double step, uint8_t dt) {
  return wrap(mx::arange(start, stop, step, to_dtype(dt)));
}
Ptr clone(const array& a) { return std::make_unique<array>(a); }
rust::Vec<int32_t> shape(const array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
uint8_t dtype(const array& a) { return from_dtype(a.dtype()); }
bool is_available(const array& a) { return a.is_available(); }
size_t size(const array& a) { return a.size(); }
size_t nbytes(const array& a) { return a.nbytes(); }
rust::Vec<float> to_f32(const array& a) { return read<float>(a); }
rust::Vec<int32_t> to_i32(const array& a) { return read<int32_t>(a); }
rust::Vec<uint32_t> to_u32(const array& a) { return read<uint32_t>(a); }
Ptr astype(const array& a, uint8_t dt) { return wrap(mx::astype(a, to_dtype(dt))); }

#define BINARY(name) \
  Ptr name(const array& a, const array& b) { return wrap(mx::name(a, b)); }
BINARY(add)
BINARY(subtract)
BINARY(multiply)
BINARY(divide)
BINARY(maximum)
BINARY(minimum)
BINARY(greater)
BINARY(greater_equal)
BINARY(less)
BINARY(equal)
BINARY(logical_and)
BINARY(logical_or)
BINARY(power)
BINARY(floor_divide)
BINARY(bitwise_and)
#undef BINARY

#define UNARY(name) \
  Ptr name(const array& a) { return wrap(mx::name(a)); }
UNARY(negative)
UNARY(exp)
UNARY(log)
UNARY(sqrt)
UNARY(sigmoid)
#undef UNARY

Ptr where(const array& c, const array& a, const array& b) { return wrap(mx::where(c, a, b)); }

// mlx-lm's `swiglu` is `mx.compile(shapeless=True)` of silu(gate) * x; compiling the same
// graph here keeps the fused kernel, and with it the rounding, identical to the reference.
// On the CPU, float32 goes to the host's own kernel (cpu_exp.cc: the same bits, sixteen
// lanes at a time).
Ptr swiglu(const array& gate, const array& x) {
  if (auto y = cpu_swiglu(gate, x)) return wrap(std::move(*y));
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        return {mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0])), in[1])};
      },
      /* shapeless = */ true);
  return wrap(fn({gate, x})[0]);
}

// mlx-lm's `swiglu_oai` (GPT-OSS's experts, `mx.compile(shapeless=True)`): the gate clipped
// above at `limit`, the linear part to +-limit, then (x + 1) * gate * sigmoid(alpha * gate).
Ptr swiglu_oai(const array& gate, const array& x) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        auto c = [&](float v) { return array(v, in[0].dtype()); };
        auto g = mx::minimum(in[0], c(7.0f));
        auto u = mx::clip(in[1], c(-7.0f), c(7.0f));
        return {mx::multiply(mx::add(u, c(1.0f)), mx::multiply(g, mx::sigmoid(mx::multiply(c(1.702f), g))))};
      },
      /* shapeless = */ true);
  return wrap(fn({gate, x})[0]);
}

// `nn.silu` (mlx.nn, `mx.compile(shapeless=True)`): x * sigmoid(x).
Ptr silu(const array& x) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> { return {mx::multiply(in[0], mx::sigmoid(in[0]))}; },
      /* shapeless = */ true);
  return wrap(fn({x})[0]);
}

// mlx-lm's `precise_swiglu(h, gate, x)` (`mx.compile(shapeless=True)`): silu(gate) * x in
// float32, cast to h's dtype (Qwen3-Next's gated RMSNorm).
Ptr precise_swiglu(const array& h, const array& gate, const array& x) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        auto g = mx::astype(in[1], mx::float32);
        g = mx::multiply(g, mx::sigmoid(g));
        return {mx::astype(mx::multiply(g, mx::astype(in[2], mx::float32)), in[0].dtype())};
      },
      /* shapeless = */ true);
  return wrap(fn({h, gate, x})[0]);
}

// mlx-lm's `logit_softcap(softcap, x)` (gemma4_text.py, `mx.compile(shapeless=True)`):
// tanh(x / softcap) * softcap, the cap a scalar of x's dtype.
Ptr softcap(const array& x, float cap) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        return {mx::multiply(mx::tanh(mx::divide(in[0], in[1])), in[1])};
      },
      /* shapeless = */ true);
  return wrap(fn({x, array(cap, x.dtype())})[0]);
}

// mlx-lm's `compute_g` (gated_delta.py, `mx.compile(shapeless=True)`): the Gated DeltaNet's
// decay, exp(-exp(A_log) * softplus(a + dt_bias)), softplus being logaddexp(x, 0).
Ptr gated_delta_g(const array& a_log, const array& a, const array& dt_bias) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        auto x = mx::add(in[1], in[2]);
        auto softplus = mx::logaddexp(x, array(0.0f, x.dtype()));
        return {mx::exp(mx::multiply(mx::negative(mx::exp(mx::astype(in[0], mx::float32))), softplus))};
      },
      /* shapeless = */ true);
  return wrap(fn({a_log, a, dt_bias})[0]);
}

// mlx-lm's `_gated_delta_step_ops` without a mask (`mx.compile`): one step of the gated delta
// rule. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dv, Dk]. Returns
// (y [B, H, Dv] in q's dtype, the new state).
std::unique_ptr<ArrayList> gated_delta_step(const array& q, const array& k, const array& v, const array& g,
                                             const array& beta, const array& state) {
  static auto fn = mx::compile([](const std::vector<array>& in) -> std::vector<array> {
    const auto &q = in[0], &k = in[1], &v = in[2], &g = in[3], &beta = in[4];
    auto state = mx::multiply(in[5], mx::expand_dims(g, {-2, -1}));
    auto k_row = mx::expand_dims(k, -2);
    auto kv_mem = mx::sum(mx::multiply(state, k_row), -1);
    auto delta = mx::multiply(mx::subtract(v, kv_mem), mx::expand_dims(beta, -1));
    state = mx::add(state, mx::multiply(k_row, mx::expand_dims(delta, -1)));
    auto y = mx::sum(mx::multiply(state, mx::expand_dims(q, -2)), -1);
    return {mx::astype(y, q.dtype()), state};
  });
  auto out = fn({q, k, v, g, beta, state});
  auto list = std::make_unique<ArrayList>();
  for (auto& a : out) list->items.push_back(a);
  return list;
}

// The Gated DeltaNet's decay in log space, -exp(A_log) * softplus(a + dt_bias): what
// `gated_delta_g` exponentiates, for the chunked recurrence (which sums it along a chunk).
Ptr gated_delta_log_g(const array& a_log, const array& a, const array& dt_bias) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        auto x = mx::add(in[1], in[2]);
        auto softplus = mx::logaddexp(x, array(0.0f, x.dtype()));
        return {mx::multiply(mx::negative(mx::exp(mx::astype(in[0], mx::float32))), softplus)};
      },
      /* shapeless = */ true);
  return wrap(fn({a_log, a, dt_bias})[0]);
}

namespace {

// The inverse of unit lower-triangular matrices x [..., C, C] (C a power of two), by
// doubling: the inverses of the diagonal blocks of size s give those of size 2s through
// [[A, 0], [L, D]]^-1 = [[A^-1, 0], [-D^-1 L A^-1, D^-1]]. log2(C) levels of batched matmuls,
// as stable as forward substitution, whose C sequential steps it replaces.
array unit_lower_inverse(const array& x) {
  const int c = x.shape(-1);
  mx::Shape lead(x.shape().begin(), x.shape().end() - 2);
  auto with = [&](std::initializer_list<int> tail) {
    mx::Shape s = lead;
    for (int d : tail) s.push_back(d);
    return s;
  };
  // Diagonal blocks of size s of the inverse, [..., C/s, s, s]; the 1x1 ones are 1.
  array inv = mx::ones(with({c, 1, 1}), x.dtype());
  for (int s = 1; s < c; s *= 2) {
    const int m = c / (2 * s);
    // The diagonal blocks of size 2s of x: [..., m, 2s, m, 2s] -> [..., 2s, 2s, m] -> [..., m, 2s, 2s].
    auto blocks = mx::reshape(x, with({m, 2 * s, m, 2 * s}));
    const int nd = blocks.ndim();
    blocks = mx::moveaxis(mx::diagonal(blocks, 0, nd - 4, nd - 2), -1, -3);
    // Its lower-left s x s block (rows s.., columns ..s).
    mx::Shape start(nd - 1, 0), stop = blocks.shape();
    start[nd - 3] = s;
    stop[nd - 2] = s;
    auto low = mx::slice(blocks, start, stop);
    auto pairs = mx::reshape(inv, with({m, 2, s, s}));
    const int pd = pairs.ndim();
    auto take = [&](int i) {
      mx::Shape start(pd, 0), stop = pairs.shape();
      start[pd - 3] = i;
      stop[pd - 3] = i + 1;
      return mx::squeeze(mx::slice(pairs, start, stop), pd - 3);
    };
    auto a = take(0), d = take(1);
    auto off = mx::negative(mx::matmul(mx::matmul(d, low), a));
    auto top = mx::concatenate({a, mx::zeros_like(a)}, -1);
    auto bottom = mx::concatenate({off, d}, -1);
    inv = mx::concatenate({top, bottom}, -2);
  }
  return mx::reshape(inv, with({c, c}));
}

}  // namespace

// The gated delta rule over a whole sequence in chunks (the WY form of flash-linear-attention's
// `chunk_gated_delta_rule`), the same recurrence as `gated_delta_step` applied position by
// position: q, k [B, T, H, Dk] (normalized and scaled), v [B, T, H, Dv], log_g and beta
// [B, T, H], state [B, H, Dv, Dk] (float32). Within a chunk the positions' writes are solved
// together (a unit lower-triangular system); the state passes from chunk to chunk. T / chunk
// sequential steps instead of T, the rest as matmuls. Returns (y [B, T, H, Dv] in q's dtype,
// the state after the last position). Padding past T has k = 0, beta = 0 and no decay, so it
// leaves the state as it is.
std::unique_ptr<ArrayList> gated_delta_chunked(const array& q_in, const array& k_in, const array& v_in,
                                               const array& log_g, const array& beta_in, const array& state,
                                               int32_t chunk) {
  const int b = q_in.shape(0), t = q_in.shape(1), h = q_in.shape(2), dv = v_in.shape(3);
  if (chunk < 1 || (chunk & (chunk - 1)) != 0) throw std::invalid_argument("gated_delta_chunked: chunk must be a power of two");
  const int c = chunk, n = (t + c - 1) / c, pad = n * c - t;
  const auto f32 = mx::float32;
  // [B, T, H, D] -> [B, H, N, C, D], float32, zero-padded to N * C positions.
  auto chunks = [&](const array& x, bool vec) {
    auto y = mx::astype(x, f32);
    y = vec ? mx::transpose(y, {0, 2, 1, 3}) : mx::transpose(y, {0, 2, 1});
    if (pad > 0) {
      std::vector<std::pair<int, int>> widths(y.ndim(), {0, 0});
      widths[2] = {0, pad};
      y = mx::pad(y, widths);
    }
    mx::Shape shape{b, h, n, c};
    if (vec) shape.push_back(y.shape(3));
    return mx::reshape(y, shape);
  };
  auto q = chunks(q_in, true), k = chunks(k_in, true), v = chunks(v_in, true);
  auto beta = chunks(beta_in, false), lg = chunks(log_g, false);
  auto g = mx::cumsum(lg, -1);  // [B, H, N, C]: the log decay from the chunk's start
  auto rows = mx::expand_dims(g, -1), cols = mx::expand_dims(g, -2);
  auto lower = mx::tril(mx::ones({c, c}, f32));
  auto strict = mx::tril(mx::ones({c, c}, f32), -1);
  // decay[i, j] = prod of the decays after j up to i (i >= j), 0 above the diagonal.
  auto decay = mx::multiply(mx::exp(mx::minimum(mx::subtract(rows, cols), array(0.0f))), lower);
  auto bcol = mx::expand_dims(beta, -1);
  auto kb = mx::multiply(k, bcol), vb = mx::multiply(v, bcol);
  auto kt = mx::swapaxes(k, -1, -2);
  auto within = mx::multiply(mx::multiply(mx::matmul(kb, kt), decay), strict);
  auto solve = unit_lower_inverse(mx::add(within, mx::eye(c, f32)));
  auto u = mx::matmul(solve, vb);                                                  // [B, H, N, C, Dv]
  auto w = mx::matmul(solve, mx::multiply(kb, mx::exp(rows)));                     // [B, H, N, C, Dk]
  auto qk = mx::multiply(mx::matmul(q, kt), decay);                                // [B, H, N, C, C]
  auto qg = mx::multiply(q, mx::exp(rows));                                        // [B, H, N, C, Dk]
  auto last = mx::slice(g, {0, 0, 0, c - 1}, {b, h, n, c});                        // [B, H, N, 1]
  auto kd = mx::multiply(k, mx::exp(mx::expand_dims(mx::subtract(last, g), -1)));  // [B, H, N, C, Dk]
  auto at = [&](const array& x, int i) {
    mx::Shape start(x.ndim(), 0), stop = x.shape();
    start[2] = i;
    stop[2] = i + 1;
    return mx::squeeze(mx::slice(x, start, stop), 2);
  };
  auto s = mx::swapaxes(mx::astype(state, f32), -1, -2);  // [B, H, Dk, Dv]
  std::vector<array> outs;
  outs.reserve(n);
  for (int i = 0; i < n; ++i) {
    auto fresh = mx::subtract(at(u, i), mx::matmul(at(w, i), s));  // each position's write, [B, H, C, Dv]
    outs.push_back(mx::add(mx::matmul(at(qg, i), s), mx::matmul(at(qk, i), fresh)));
    auto fade = mx::exp(mx::expand_dims(at(last, i), -1));  // [B, H, 1, 1]
    s = mx::add(mx::multiply(s, fade), mx::matmul(mx::swapaxes(at(kd, i), -1, -2), fresh));
  }
  auto y = n == 1 ? outs[0] : mx::concatenate(outs, 2);  // [B, H, N * C, Dv]
  if (pad > 0) y = mx::slice(y, {0, 0, 0, 0}, {b, h, t, dv});
  y = mx::astype(mx::transpose(y, {0, 2, 1, 3}), q_in.dtype());
  auto list = std::make_unique<ArrayList>();
  list->items.push_back(y);
  list->items.push_back(mx::swapaxes(s, -1, -2));
  return list;
}

// A depthwise or grouped 1D convolution, stride 1, no padding: x [B, L, C_in], w [C_out, K,
// C_in / groups] (`nn.Conv1d`'s layout).
Ptr conv1d(const array& x, const array& w, int32_t groups) {
  return wrap(mx::conv1d(x, w, /* stride = */ 1, /* padding = */ 0, /* dilation = */ 1, groups));
}

Ptr repeat_axis(const array& a, int32_t repeats, int32_t axis) { return wrap(mx::repeat(a, repeats, axis)); }

// `mx.fast.rms_norm(x, None, eps)`: no weight.
Ptr rms_norm_plain(const array& x, float eps) {
  if (auto y = cpu_rms_norm(x, std::nullopt, eps)) return wrap(std::move(*y));
  return wrap(mx::fast::rms_norm(x, std::nullopt, eps));
}

// `nn.gelu_approx` (mlx.nn, `mx.compile(shapeless=True)`): 0.5 x (1 + tanh(sqrt(2/pi)
// (x + 0.044715 x^3))), with Python's scalars as arrays of x's dtype and the same compile.
Ptr gelu_approx(const array& x) {
  static auto fn = mx::compile(
      [](const std::vector<array>& in) -> std::vector<array> {
        const array& a = in[0];
        auto c = [&](double v) { return array(static_cast<float>(v), a.dtype()); };
        auto cube = mx::power(a, c(3.0));
        auto inner = mx::multiply(c(0.7978845608028654) /* math.sqrt(2 / math.pi) */, mx::add(a, mx::multiply(c(0.044715), cube)));
        return {mx::multiply(mx::multiply(c(0.5), a), mx::add(c(1.0), mx::tanh(inner)))};
      },
      /* shapeless = */ true);
  return wrap(fn({x})[0]);
}

Ptr sum(const array& a, rust::Slice<const int32_t> ax, bool k) { return wrap(mx::sum(a, to_ints(ax), k)); }
Ptr max(const array& a, rust::Slice<const int32_t> ax, bool k) { return wrap(mx::max(a, to_ints(ax), k)); }
Ptr mean(const array& a, rust::Slice<const int32_t> ax, bool k) { return wrap(mx::mean(a, to_ints(ax), k)); }
// Over the last axis of float32 on the CPU: the host's kernel (cpu_exp.cc, MLX's bits).
Ptr logsumexp(const array& a, rust::Slice<const int32_t> ax, bool k) {
  if (ax.size() == 1 && a.ndim() > 0 && (ax[0] == -1 || ax[0] == static_cast<int32_t>(a.ndim()) - 1)) {
    if (auto y = cpu_logsumexp(a, k)) return wrap(std::move(*y));
  }
  return wrap(mx::logsumexp(a, to_ints(ax), k));
}
Ptr argmax(const array& a, int32_t axis, bool k) { return wrap(mx::argmax(a, axis, k)); }
Ptr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cumsum(a, axis, reverse, inclusive));
}

Ptr reshape(const array& a, rust::Slice<const int32_t> s) { return wrap(mx::reshape(a, to_shape(s))); }
Ptr transpose(const array& a, rust::Slice<const int32_t> ax) { return wrap(mx::transpose(a, to_ints(ax))); }
Ptr expand_dims(const array& a, rust::Slice<const int32_t> ax) { return wrap(mx::expand_dims(a, to_ints(ax))); }
Ptr squeeze(const array& a, rust::Slice<const int32_t> ax) { return wrap(mx::squeeze(a, to_ints(ax))); }
Ptr broadcast_to(const array& a, rust::Slice<const int32_t> s) { return wrap(mx::broadcast_to(a, to_shape(s))); }
Ptr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
          rust::Slice<const int32_t> strides) {
  return wrap(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
Ptr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                 rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice_update(src, update, to_shape(start), to_shape(stop), to_shape(strides)));
}
Ptr take(const array& a, const array& idx, int32_t axis) { return wrap(mx::take(a, idx, axis)); }
Ptr take_along_axis(const array& a, const array& idx, int32_t axis) {
  return wrap(mx::take_along_axis(a, idx, axis));
}
Ptr put_along_axis(const array& a, const array& idx, const array& v, int32_t axis) {
  return wrap(mx::put_along_axis(a, idx, v, axis));
}
Ptr scatter_add_axis(const array& a, const array& idx, const array& v, int32_t axis) {
  return wrap(mx::scatter_add_axis(a, idx, v, axis));
}
Ptr concatenate(const ArrayList& arrays, int32_t axis) { return wrap(mx::concatenate(arrays.items, axis)); }
Ptr masked_rows(const array& logits, const ArrayList& rows, const array& neg_inf) {
  return wrap(masked_rows_array(logits, rows, neg_inf));
}
Ptr contiguous(const array& a) { return wrap(mx::contiguous(a)); }
Ptr copy(const array& a) { return wrap(mx::copy(a)); }

Ptr matmul(const array& a, const array& b) {
  if (auto y = cpu_few_rows_matmul(a, b, nullptr, 1.f, 0.f)) return wrap(std::move(*y));
  if (auto y = cpu_batched_matmul(a, b)) return wrap(std::move(*y));
  return wrap(mx::matmul(a, b));
}
Ptr addmm(const array& c, const array& a, const array& b, float alpha, float beta) {
  if (auto y = cpu_few_rows_matmul(a, b, &c, alpha, beta)) return wrap(std::move(*y));
  return wrap(mx::addmm(c, a, b, alpha, beta));
}
// The biases argument of MLX's quantized ops: affine mode's, none in the others.
static std::optional<array> mode_biases(const array& biases, const std::string& mode) {
  if (mode == "affine") {
    return biases;
  }
  return std::nullopt;
}

Ptr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                     bool transpose, int32_t group_size, int32_t bits, rust::Str mode_str,
                     bool host_kernels) {
  const std::string mode(mode_str);
  if (mode != "affine") {
    return wrap(mx::quantized_matmul(x, w, scales, std::nullopt, transpose, group_size, bits, mode));
  }
  if (host_kernels && transpose) {
    if (auto y = cpu_quantized_matmul(x, w, scales, biases, group_size, bits)) return wrap(std::move(*y));
  }
  if (host_kernels && dequant_applies(x, w, transpose, bits)) {
    const auto wd = mx::dequantize(w, scales, biases, group_size, bits, "affine", std::nullopt, x.dtype());
    return wrap(mx::matmul(x, mx::swapaxes(wd, 0, 1)));
  }
  if (host_kernels && qmv4_applies(x, w, scales, biases, transpose, group_size, bits)) {
    return wrap(qmv4(x, w, scales, biases, group_size));
  }
  return wrap(mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits));
}
// The products of mixture-of-experts layers (mlx-lm's SwitchLinear and QuantizedSwitchLinear):
// row i of `x` times the expert matrix `rhs_indices[i]` picks.
Ptr gather_mm(const array& a, const array& b, const array& rhs_indices, bool sorted_indices) {
  return wrap(mx::gather_mm(a, b, std::nullopt, rhs_indices, sorted_indices));
}
Ptr gather_qmm(const array& x, const array& w, const array& scales, const array& biases,
               const array& rhs_indices, bool transpose, int32_t group_size, int32_t bits,
               rust::Str mode_str, bool sorted_indices) {
  const std::string mode(mode_str);
  if (mode == "affine" && transpose) {
    if (auto y = cpu_gather_qmm(x, w, scales, biases, rhs_indices, group_size, bits, sorted_indices)) {
      return wrap(std::move(*y));
    }
  }
  return wrap(mx::gather_qmm(x, w, scales, mode_biases(biases, mode), std::nullopt, rhs_indices, transpose,
                             group_size, bits, mode, std::nullopt, sorted_indices));
}
Ptr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size,
               int32_t bits, rust::Str mode_str, uint8_t dt) {
  const std::string mode(mode_str);
  return wrap(mx::dequantize(w, scales, mode_biases(biases, mode), group_size, bits, mode, std::nullopt,
                             to_dtype(dt)));
}
std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits, rust::Str mode) {
  auto out = std::make_unique<ArrayList>();
  out->items = mx::quantize(w, group_size, bits, std::string(mode));
  return out;
}

// RMSNorm and RoPE on the CPU go to the host's one-primitive kernels (cpu_exp.cc: MLX's bits,
// where MLX builds each from a dozen or more primitives), elsewhere to MLX's.
Ptr rms_norm(const array& x, const array& w, float eps) {
  if (auto y = cpu_rms_norm(x, w, eps)) return wrap(std::move(*y));
  return wrap(mx::fast::rms_norm(x, w, eps));
}
Ptr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset) {
  if (auto y = cpu_rope(x, dims, traditional, base, scale, mx::array(offset), std::nullopt)) return wrap(std::move(*y));
  return wrap(mx::fast::rope(x, dims, traditional, base, scale, offset));
}
Ptr rope_freqs(const array& x, int32_t dims, bool traditional, float scale, int32_t offset,
               const array& freqs) {
  if (auto y = cpu_rope(x, dims, traditional, std::nullopt, scale, mx::array(offset), freqs)) return wrap(std::move(*y));
  return wrap(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offset, freqs));
}
Ptr rope_rows(const array& x, int32_t dims, bool traditional, float base, float scale,
              const array& offsets) {
  if (auto y = cpu_rope(x, dims, traditional, base, scale, offsets, std::nullopt)) return wrap(std::move(*y));
  return wrap(mx::fast::rope(x, dims, traditional, base, scale, offsets));
}
Ptr rope_rows_freqs(const array& x, int32_t dims, bool traditional, float scale, const array& offsets,
                    const array& freqs) {
  if (auto y = cpu_rope(x, dims, traditional, std::nullopt, scale, offsets, freqs)) return wrap(std::move(*y));
  return wrap(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offsets, freqs));
}
Ptr sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode) {
  if (std::string(mask_mode) == "causal") {
    if (auto o = cpu_causal_attention(q, k, v, scale)) return wrap(std::move(*o));
  }
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode)));
}
bool short_causal_attention_applies(const array& q, const array& k, const array& v) {
  return sq_attention_applies(q, k, v);
}
Ptr short_causal_attention(const array& q, const array& k, const array& v, float scale) {
  return wrap(sq_attention(q, k, v, scale));
}
Ptr sdpa_masked(const array& q, const array& k, const array& v, float scale, const array& mask) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, "array", mask));
}
// With attention sinks (GPT-OSS): one learned logit per head that takes a share of the softmax.
Ptr sdpa_sinks(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
               const array& sinks) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode), std::nullopt, sinks));
}
Ptr sdpa_masked_sinks(const array& q, const array& k, const array& v, float scale, const array& mask,
                      const array& sinks) {
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, "array", mask, sinks));
}

// Over the last axis of float32 on the CPU: the host's kernel (cpu_exp.cc, MLX's bits).
Ptr softmax(const array& a, rust::Slice<const int32_t> ax, bool precise) {
  if (ax.size() == 1 && a.ndim() > 0 && (ax[0] == -1 || ax[0] == static_cast<int32_t>(a.ndim()) - 1)) {
    if (auto y = cpu_softmax(a)) return wrap(std::move(*y));
  }
  return wrap(mx::softmax(a, to_ints(ax), precise));
}
Ptr sort(const array& a, int32_t axis) { return wrap(mx::sort(a, axis)); }
Ptr argsort(const array& a, int32_t axis) { return wrap(mx::argsort(a, axis)); }
Ptr argpartition(const array& a, int32_t kth, int32_t axis) { return wrap(mx::argpartition(a, kth, axis)); }
Ptr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
Ptr random_categorical(const array& logits, int32_t axis, const array& key) {
  return wrap(mx::random::categorical(logits, axis, key));
}
Ptr random_uniform(rust::Slice<const int32_t> s, const array& key) {
  return wrap(mx::random::uniform(to_shape(s), mx::float32, key));
}

void eval(const ArrayList& arrays) { mx::eval(arrays.items); }
void async_eval(const ArrayList& arrays) { mx::async_eval(arrays.items); }
rust::String graph_dot(const ArrayList& arrays) {
  std::ostringstream os;
  mx::export_to_dot(os, arrays.items);
  return rust::String(os.str());
}
void set_default_device_gpu(bool gpu) {
  mx::set_default_device(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu));
}
bool default_device_is_gpu() { return mx::default_device().type == mx::Device::gpu; }
bool gpu_is_available() { return mx::is_available(mx::Device(mx::Device::gpu)); }
size_t device_memory_size(bool gpu) {
  const auto& info = mx::device_info(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu));
  for (const char* key : {"total_memory", "memory_size"}) {
    auto it = info.find(key);
    if (it != info.end() && std::holds_alternative<size_t>(it->second)) return std::get<size_t>(it->second);
  }
  return 0;
}
void synchronize() { mx::synchronize(); }

namespace {
std::optional<mx::distributed::Group> group;
}

int32_t distributed_init(rust::Str backend) {
  group = mx::distributed::init(true, std::string(backend));
  return group->size();
}
int32_t distributed_rank() {
  if (!group) throw std::runtime_error("distributed_init was not called");
  return group->rank();
}
Ptr all_sum(const array& a) {
  if (!group) throw std::runtime_error("distributed_init was not called");
  return std::make_unique<array>(mx::distributed::all_sum(a, *group));
}
Ptr send_to(const array& a, int32_t dst) {
  if (!group) throw std::runtime_error("distributed_init was not called");
  return std::make_unique<array>(mx::distributed::send(a, dst, *group));
}
Ptr recv_from(rust::Slice<const int32_t> shape, uint8_t dt, int32_t src) {
  if (!group) throw std::runtime_error("distributed_init was not called");
  checked_elements(shape);
  return std::make_unique<array>(mx::distributed::recv(to_shape(shape), to_dtype(dt), src, *group));
}
// MLX's `recv` has no inputs, so nothing orders it after a `send` of the same graph: a rank
// that sends to a peer and then waits for the peer's answer could run the receive first and
// wait forever. This is `recv`'s node with `after` as an input, which MLX evaluates first;
// the receive itself ignores its inputs (MLX's `Recv::eval_cpu` only asserts there are none,
// in debug builds).
Ptr recv_after(rust::Slice<const int32_t> shape, uint8_t dt, int32_t src, const array& after) {
  if (!group) throw std::runtime_error("distributed_init was not called");
  checked_elements(shape);
  auto r = mx::distributed::recv(to_shape(shape), to_dtype(dt), src, *group);
  return std::make_unique<array>(r.shape(), r.dtype(), r.primitive_ptr(), std::vector<array>{after});
}
int32_t new_stream(bool gpu) {
  return mx::new_stream(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu)).index;
}
void set_default_stream(int32_t index, bool gpu) {
  mx::set_default_stream(mx::Stream(index, gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu)));
}
size_t get_active_memory() { return mx::get_active_memory(); }
size_t get_peak_memory() { return mx::get_peak_memory(); }
size_t get_cache_memory() { return mx::get_cache_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t set_memory_limit(size_t limit) { return mx::set_memory_limit(limit); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }
void clear_cache() {
  mx::clear_cache();
#if defined(__GLIBC__)
  // The CPU allocator's buffers come from malloc: hand the freed ones back to the system too,
  // or a server's resident memory keeps the high-water mark of every batch shape it ran.
  malloc_trim(0);
#endif
}
rust::String version() { return rust::String(mx::version()); }
void exit_without_teardown(int32_t code) {
  std::fflush(nullptr);
  std::_Exit(code);
}

int32_t cap_cpu_qmatmul_isa(int32_t level) {
  cpu_qmatmul_isa_cap.store(level);
  return cpu_qmatmul_packed_rows();
}
void set_cpu_exp_mode(int32_t mode) { cpu_exp_mode.store(mode); }
bool cpu_quantized_products() { return cpu_qmatmul_enabled(); }

std::unique_ptr<Loaded> load_safetensors(rust::Str path) {
  auto [arrays, meta] = mx::load_safetensors(std::string(path));
  auto out = std::make_unique<Loaded>();
  for (auto& [name, a] : arrays) {
    out->names.push_back(name);
    out->arrays.push_back(a);
  }
  out->string_meta = std::move(meta);
  return out;
}

std::unique_ptr<Loaded> load_gguf(rust::Str path) {
  auto [arrays, meta] = mx::load_gguf(std::string(path));
  auto out = std::make_unique<Loaded>();
  for (auto& [name, a] : arrays) {
    out->names.push_back(name);
    out->arrays.push_back(a);
  }
  out->gguf_meta = std::move(meta);
  return out;
}

void save_safetensors(rust::Str path, const Loaded& loaded) {
  std::unordered_map<std::string, array> map;
  for (size_t i = 0; i < loaded.names.size(); ++i) map.insert({loaded.names[i], loaded.arrays[i]});
  mx::save_safetensors(std::string(path), map, loaded.string_meta);
}
void save_gguf(rust::Str path, const Loaded& loaded) {
  std::unordered_map<std::string, array> map;
  for (size_t i = 0; i < loaded.names.size(); ++i) map.insert({loaded.names[i], loaded.arrays[i]});
  mx::save_gguf(std::string(path), map, loaded.gguf_meta);
}
void loaded_push_meta_string(Loaded& l, rust::Str key, rust::Str value) {
  l.gguf_meta.insert_or_assign(std::string(key), mx::GGUFMetaData(std::string(value)));
}
void loaded_push_meta_strings(Loaded& l, rust::Str key, rust::Slice<const rust::String> values) {
  std::vector<std::string> v;
  for (auto& s : values) v.emplace_back(std::string(s));
  l.gguf_meta.insert_or_assign(std::string(key), mx::GGUFMetaData(std::move(v)));
}
void loaded_push_meta_array(Loaded& l, rust::Str key, const array& a) {
  l.gguf_meta.insert_or_assign(std::string(key), mx::GGUFMetaData(a));
}
std::unique_ptr<Loaded> loaded_new() { return std::make_unique<Loaded>(); }
void loaded_push(Loaded& l, rust::Str name, const array& a) {
  l.names.emplace_back(name);
  l.arrays.push_back(a);
}
size_t loaded_len(const Loaded& l) { return l.names.size(); }
rust::String loaded_name(const Loaded& l, size_t i) { return rust::String(l.names.at(i)); }
Ptr loaded_array(const Loaded& l, size_t i) { return std::make_unique<array>(l.arrays.at(i)); }
rust::Vec<rust::String> loaded_meta_keys(const Loaded& l) {
  rust::Vec<rust::String> out;
  for (auto& [k, _] : l.gguf_meta) out.push_back(rust::String(k));
  for (auto& [k, _] : l.string_meta) out.push_back(rust::String(k));
  return out;
}
uint8_t loaded_meta_kind(const Loaded& l, rust::Str key) {
  std::string k(key);
  if (auto it = l.string_meta.find(k); it != l.string_meta.end()) return 2;
  auto it = l.gguf_meta.find(k);
  if (it == l.gguf_meta.end()) return 0;
  if (std::holds_alternative<array>(it->second)) return 1;
  if (std::holds_alternative<std::string>(it->second)) return 2;
  if (std::holds_alternative<std::vector<std::string>>(it->second)) return 3;
  return 0;
}
rust::String loaded_meta_string(const Loaded& l, rust::Str key) {
  std::string k(key);
  if (auto it = l.string_meta.find(k); it != l.string_meta.end()) return rust::String(it->second);
  return rust::String(std::get<std::string>(meta(l, key)));
}
rust::Vec<rust::String> loaded_meta_strings(const Loaded& l, rust::Str key) {
  rust::Vec<rust::String> out;
  const auto& v = std::get<std::vector<std::string>>(meta(l, key));
  out.reserve(v.size());
  // Vocabulary entries can hold arbitrary bytes; keep them lossless for valid UTF-8
  // and replace the rest rather than throwing.
  for (auto& s : v) out.push_back(rust::String::lossy(s));
  return out;
}
Ptr loaded_meta_array(const Loaded& l, rust::Str key) {
  return std::make_unique<array>(std::get<array>(meta(l, key)));
}

}  // namespace mlx_shim
