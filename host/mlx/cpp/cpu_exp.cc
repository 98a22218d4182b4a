// MLX's CPU kernels redone with the same bits (issue 47). Three that spend their time in exp,
// sixteen lanes at a time (AVX-512) or eight (AVX2) with the same bits: SwiGLU, silu(gate) * x
// (mlx-lm's compiled `swiglu`), the log-sum-exp over the vocabulary that every sampled token's
// log-probabilities take, and softmax (a decode step's attention). Only on x86-64, where MLX's kernels are the scalar ones mirrored
// here (on ARM its NEON kernels sum in lanes, another order). MLX's CPU elementwise
// kernels are scalar on x86 (its SIMD types have no x86 implementation), and its exp calls
// libm's fmaf through the PLT for each term of its polynomial: in a batch-8 decode step of
// SmolLM2 (4-bit weights) the fused SwiGLU was 17% of the time and the log-sum-exp another 9%,
// against 39% for the weight products (bench/RESULTS.md, session 41). The arithmetic here is
// MLX's `simd::exp` step for step (Cephes' polynomial by fma, 2^ipart by bit shifting, ipart =
// floor(double(x) + 0.5), taken exactly), its `Sigmoid` (1 / (1 + exp(|g|)), mirrored for
// g >= 0) and its log-sum-exp (a running maximum, then exp(x - max) summed in order from the
// first element, log(sum) + max), each step rounded to float as the scalar kernel rounds it.
// Contraction of a product and a sum into one fma is off in this file, as it is in MLX's
// kernels (compiled without FMA instructions), so the results are equal bit for bit
// (`cpu_exp_kernels_are_mlxs_bit_for_bit`).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include "mlx/cpp/cpu_exp.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlx_shim {

std::atomic<int> cpu_exp_mode{2};

namespace {

// MLX's scalar `simd::exp` (mlx/backend/cpu/simd/math.h), step for step.
inline float mlx_exp(float x_init) {
  float x = x_init * 1.442695f;
  const float ipart = static_cast<float>(std::floor(static_cast<double>(x) + 0.5));
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  const int32_t epart = (static_cast<int32_t>(ipart) + 127) << 23;
  float two;
  std::memcpy(&two, &epart, sizeof two);
  float result = std::isnan(x_init) ? x_init : two * x;
  if (x_init > 88.0f) result = std::numeric_limits<float>::infinity();
  if (x_init < -88.0f) result = 0.0f;
  return result;
}

// MLX's `Sigmoid` then the two products, one element.
inline float swiglu_one(float g, float x) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(g)));
  const float s = g < 0.0f ? y : 1.0f - y;
  return (g * s) * x;
}

void swiglu_scalar(const float* g, const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = swiglu_one(g[i], x[i]);
}

// MLX's CPU log-sum-exp of one row (mlx/backend/cpu/logsumexp.cpp with its one-lane SIMD).
float logsumexp_scalar(const float* x, int64_t m) {
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m; i++) most = std::isnan(x[i]) ? x[i] : (x[i] > most ? x[i] : most);
  float sum = 0.0f;
  for (int64_t i = 0; i < m; i++) sum = sum + mlx_exp(x[i] - most);
  return std::isinf(most) ? most : std::log(sum) + most;
}

// MLX's CPU softmax of one float32 row (mlx/backend/cpu/softmax.cpp with its one-lane SIMD):
// the exponentials stored, summed in order, then scaled by 1 / their sum.
void softmax_scalar(const float* x, float* out, int64_t m) {
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m; i++) most = std::isnan(x[i]) ? x[i] : (x[i] > most ? x[i] : most);
  float sum = 0.0f;
  for (int64_t i = 0; i < m; i++) {
    out[i] = mlx_exp(x[i] - most);
    sum = sum + out[i];
  }
  const float scale = 1 / sum;
  for (int64_t i = 0; i < m; i++) out[i] = out[i] * scale;
}

#if defined(__x86_64__)
#define HOST_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

// MLX's `simd::exp` on sixteen lanes.
HOST_AVX512 inline __m512 exp16(__m512 x_init) {
  const __m512 one = _mm512_set1_ps(1.0f);
  // ipart = floor(x + 0.5) taken exactly: floor(x), plus one where x's fraction (x - floor(x),
  // exact wherever it could be below a half) is at least a half, as MLX's double sum rounds.
  const __m512 xs = _mm512_mul_ps(x_init, _mm512_set1_ps(1.442695f));
  const __m512 fl = _mm512_roundscale_ps(xs, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(xs, fl), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 ipart = _mm512_mask_add_ps(fl, up, fl, one);
  const __m512 fpart = _mm512_sub_ps(xs, ipart);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, fpart, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, fpart, one);
  const __m512i epart =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(ipart), _mm512_set1_epi32(127)), 23);
  __m512 e = _mm512_mul_ps(_mm512_castsi512_ps(epart), p);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x_init, x_init, _CMP_UNORD_Q), x_init);  // NaN stays
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x_init, _mm512_set1_ps(88.0f), _CMP_GT_OQ),
                         _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x_init, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

HOST_AVX512 void swiglu_avx512(const float* g, const float* x, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(gv), abs_mask)));
    // Sigmoid: y = 1 / (1 + exp(|g|)); g < 0 ? y : 1 - y.
    const __m512 y = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 s = _mm512_mask_mov_ps(_mm512_sub_ps(one, y), neg, y);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(gv, s), _mm512_loadu_ps(x + i)));
  }
  swiglu_scalar(g + i, x + i, out + i, n - i);
}

// A row's maximum, and whether it holds a NaN (then MLX's order decides what comes out, and
// the callers take the scalar loop).
HOST_AVX512 float row_max_avx512(const float* x, int64_t m, bool& nan) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  float most = _mm512_reduce_max_ps(vmax);
  for (; i < m; i++) {
    if (std::isnan(x[i])) unordered = 1;
    most = x[i] > most ? x[i] : most;
  }
  nan = unordered != 0;
  return most;
}

// The row's maximum as MLX's running `maximum` finds it (the first NaN, if any), then the sum
// of exp(x - max) in element order: the exponentials sixteen at a time, added one by one.
HOST_AVX512 float logsumexp_avx512(const float* x, int64_t m) {
  bool nan = false;
  const float most = row_max_avx512(x, m, nan);
  int64_t i = 0;
  if (nan) return logsumexp_scalar(x, m);  // NaN: MLX's order decides which one comes out
  const __m512 vmost = _mm512_set1_ps(most);
  alignas(64) float e[16];
  float sum = 0.0f;
  for (i = 0; i + 16 <= m; i += 16) {
    _mm512_store_ps(e, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmost)));
    for (int l = 0; l < 16; l++) sum += e[l];
  }
  for (; i < m; i++) sum += mlx_exp(x[i] - most);
  return std::isinf(most) ? most : std::log(sum) + most;
}

HOST_AVX512 void softmax_avx512(const float* x, float* out, int64_t m) {
  bool nan = false;
  const float most = row_max_avx512(x, m, nan);
  int64_t i = 0;
  if (nan) return softmax_scalar(x, out, m);
  const __m512 vmost = _mm512_set1_ps(most);
  float sum = 0.0f;
  for (i = 0; i + 16 <= m; i += 16) {
    _mm512_storeu_ps(out + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmost)));
    for (int l = 0; l < 16; l++) sum += out[i + l];
  }
  for (; i < m; i++) {
    out[i] = mlx_exp(x[i] - most);
    sum += out[i];
  }
  const float scale = 1 / sum;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (i = 0; i + 16 <= m; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), vscale));
  for (; i < m; i++) out[i] = out[i] * scale;
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

#define HOST_AVX2 __attribute__((target("avx2,fma")))

// exp16's arithmetic on eight lanes (the masks as blends).
HOST_AVX2 inline __m256 exp8(__m256 x_init) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 xs = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256 fl = _mm256_round_ps(xs, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(xs, fl), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 ipart = _mm256_blendv_ps(fl, _mm256_add_ps(fl, one), up);
  const __m256 fpart = _mm256_sub_ps(xs, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, one);
  const __m256i epart =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  e = _mm256_blendv_ps(e, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));  // NaN stays
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

HOST_AVX2 void swiglu_avx2(const float* g, const float* x, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_and_ps(gv, abs_mask))));
    const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 s = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, neg);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, s), _mm256_loadu_ps(x + i)));
  }
  swiglu_scalar(g + i, x + i, out + i, n - i);
}

// row_max_avx512 on eight lanes.
HOST_AVX2 float row_max_avx2(const float* x, int64_t m, bool& nan) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float most = lanes[0];
  for (int l = 1; l < 8; l++) most = lanes[l] > most ? lanes[l] : most;
  nan = _mm256_movemask_ps(unordered) != 0;
  for (; i < m; i++) {
    if (std::isnan(x[i])) nan = true;
    most = x[i] > most ? x[i] : most;
  }
  return most;
}

HOST_AVX2 float logsumexp_avx2(const float* x, int64_t m) {
  bool nan = false;
  const float most = row_max_avx2(x, m, nan);
  int64_t i = 0;
  if (nan) return logsumexp_scalar(x, m);
  const __m256 vmost = _mm256_set1_ps(most);
  alignas(32) float e[8];
  float sum = 0.0f;
  for (i = 0; i + 8 <= m; i += 8) {
    _mm256_store_ps(e, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmost)));
    for (int l = 0; l < 8; l++) sum += e[l];
  }
  for (; i < m; i++) sum += mlx_exp(x[i] - most);
  return std::isinf(most) ? most : std::log(sum) + most;
}

HOST_AVX2 void softmax_row_avx2(const float* x, float* out, int64_t m) {
  bool nan = false;
  const float most = row_max_avx2(x, m, nan);
  int64_t i = 0;
  if (nan) return softmax_scalar(x, out, m);
  const __m256 vmost = _mm256_set1_ps(most);
  float sum = 0.0f;
  for (i = 0; i + 8 <= m; i += 8) {
    _mm256_storeu_ps(out + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmost)));
    for (int l = 0; l < 8; l++) sum += out[i + l];
  }
  for (; i < m; i++) {
    out[i] = mlx_exp(x[i] - most);
    sum += out[i];
  }
  const float scale = 1 / sum;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (i = 0; i + 8 <= m; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), vscale));
  for (; i < m; i++) out[i] = out[i] * scale;
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

// The loops cpu_exp_mode picks: 1 the scalar ones, 2 (the default) the widest this CPU has,
// 3 AVX2's where the CPU has them (tests, on a CPU with AVX-512).
enum class Lanes { kScalar, kAvx2, kAvx512 };

Lanes lanes() {
#if defined(__x86_64__)
  const int mode = cpu_exp_mode.load(std::memory_order_relaxed);
  if (mode == 2 && has_avx512()) return Lanes::kAvx512;
  if (mode >= 2 && has_avx2()) return Lanes::kAvx2;
#endif
  return Lanes::kScalar;
}

float logsumexp_run(const float* x, int64_t m) {
#if defined(__x86_64__)
  switch (lanes()) {
    case Lanes::kAvx512: return logsumexp_avx512(x, m);
    case Lanes::kAvx2: return logsumexp_avx2(x, m);
    case Lanes::kScalar: break;
  }
#endif
  return logsumexp_scalar(x, m);
}

void softmax_run(const float* x, float* out, int64_t m) {
#if defined(__x86_64__)
  switch (lanes()) {
    case Lanes::kAvx512: return softmax_avx512(x, out, m);
    case Lanes::kAvx2: return softmax_row_avx2(x, out, m);
    case Lanes::kScalar: break;
  }
#endif
  softmax_scalar(x, out, m);
}

void swiglu_run(const float* g, const float* x, float* out, int64_t n) {
#if defined(__x86_64__)
  switch (lanes()) {
    case Lanes::kAvx512: return swiglu_avx512(g, x, out, n);
    case Lanes::kAvx2: return swiglu_avx2(g, x, out, n);
    case Lanes::kScalar: break;
  }
#endif
  swiglu_scalar(g, x, out, n);
}

// Where each of an array's rows of its last dimension starts, in elements from its data, if
// that dimension is contiguous (a view of a fused gate/up projection's half is): else empty.
std::vector<int64_t> row_starts(const mx::array& a) {
  const int nd = a.ndim();
  if (nd == 0 || (a.shape(-1) > 1 && a.strides()[nd - 1] != 1)) return {};
  const int64_t rows = a.size() / std::max<int64_t>(a.shape(-1), 1);
  std::vector<int64_t> starts(rows);
  for (int64_t r = 0; r < rows; r++) {
    int64_t rest = r, at = 0;
    for (int d = nd - 2; d >= 0; d--) {
      at += (rest % a.shape(d)) * static_cast<int64_t>(a.strides()[d]);
      rest /= a.shape(d);
    }
    starts[r] = at;
  }
  return starts;
}

// Element i's (in row-major order) offset from an array's data.
int64_t offset(const mx::array& a, int64_t i) {
  int64_t at = 0;
  for (int d = a.ndim() - 1; d >= 0; d--) {
    at += (i % a.shape(d)) * static_cast<int64_t>(a.strides()[d]);
    i /= a.shape(d);
  }
  return at;
}

enum class Kind { kSwiglu, kLogSumExp, kSoftmax };

// Row r of `a`'s last dimension: in place where `starts` (row_starts) has it, else gathered
// into `scratch` (a strided last dimension).
const float* row_at(const mx::array& a, const std::vector<int64_t>& starts, int64_t r, std::vector<float>& scratch) {
  if (!starts.empty()) return a.data<float>() + starts[r];
  const int64_t m = a.shape(-1);
  scratch.resize(m);
  for (int64_t i = 0; i < m; i++) scratch[i] = a.data<float>()[offset(a, r * m + i)];
  return scratch.data();
}

// The three kernels as one primitive: float32 rows of the inputs' last dimension in, the
// output row-contiguous (a log-sum-exp's one value a row).
class ExpKernel : public mx::UnaryPrimitive {
 public:
  ExpKernel(mx::Stream stream, Kind kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = inputs, y = out.data<float>(), kind = kind_]() {
      const int64_t m = in[0].shape(-1), rows = static_cast<int64_t>(in[0].size()) / m;
      const auto starts0 = row_starts(in[0]);
      const auto starts1 = in.size() > 1 ? row_starts(in[1]) : std::vector<int64_t>{};
      std::vector<float> scratch0, scratch1;
      for (int64_t r = 0; r < rows; r++) {
        const float* a = row_at(in[0], starts0, r, scratch0);
        switch (kind) {
          case Kind::kSwiglu: swiglu_run(a, row_at(in[1], starts1, r, scratch1), y + r * m, m); break;
          case Kind::kLogSumExp: y[r] = logsumexp_run(a, m); break;
          case Kind::kSoftmax: softmax_run(a, y + r * m, m); break;
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU exp kernels have no GPU version");
  }

  const char* name() const override {
    switch (kind_) {
      case Kind::kSwiglu: return "HostCpuSwiglu";
      case Kind::kLogSumExp: return "HostCpuLogSumExp";
      case Kind::kSoftmax: break;
    }
    return "HostCpuSoftmax";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const ExpKernel*>(&other);
    return o != nullptr && o->kind_ == kind_;
  }

 private:
  Kind kind_;
};

// MLX's RMSNorm on the CPU, which `fast::rms_norm` builds from eleven primitives there
// (square, sum, a multiply by 1/n, add eps, rsqrt, two multiplies, and their broadcasts):
// the same arithmetic in one pass over each row. The sum of squares goes in order from the
// first element as MLX's one-lane reduction adds it, the mean is that sum times float(1 / n)
// (`mean`'s normalizer), then x * (1 / sqrt(mean + eps)) and that times the weight, each
// product rounded to float on its own. No weight: MLX multiplies by 1, which changes nothing.
class RmsNormKernel : public mx::UnaryPrimitive {
 public:
  RmsNormKernel(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = inputs, y = out.data<float>(), eps = eps_]() {
      const int64_t m = in[0].shape(-1), rows = static_cast<int64_t>(in[0].size()) / m;
      const auto starts = row_starts(in[0]);
      std::vector<float> scratch, w;
      if (in.size() > 1) {
        w.resize(m);
        for (int64_t i = 0; i < m; i++) w[i] = in[1].data<float>()[offset(in[1], i)];
      }
      const float inv_n = static_cast<float>(1.0 / static_cast<double>(m));
      for (int64_t r = 0; r < rows; r++) {
        const float* a = row_at(in[0], starts, r, scratch);
        float acc = 0.0f;
        for (int64_t i = 0; i < m; i++) {
          const float sq = a[i] * a[i];
          acc = acc + sq;
        }
        const float mean = (0.0f + acc) * inv_n;
        const float rs = mx::simd::rsqrt(mx::simd::Simd<float, 1>(mean + eps)).value;
        float* o = y + r * m;
        if (w.empty()) {
          for (int64_t i = 0; i < m; i++) o[i] = a[i] * rs;
        } else {
          for (int64_t i = 0; i < m; i++) {
            const float n = a[i] * rs;
            o[i] = n * w[i];
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU RMSNorm has no GPU version");
  }

  const char* name() const override { return "HostCpuRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const RmsNormKernel*>(&other);
    return o != nullptr && o->eps_ == eps_;
  }

 private:
  float eps_;
};

// MLX's rotary embedding on the CPU, which `fast::rope` builds from some thirty primitives
// there per call (mlx/fast.cpp's fallback): positions (t + offset) * scale, inverse
// frequencies exp(-i * (log(base) / (dims / 2))) or 1 / freqs, theta = position * frequency,
// MLX's own cos and sin of it (its `simd` functions, included from its headers), then
// x1 * cos - x2 * sin and x1 * sin + x2 * cos (halves, or even and odd features when
// `traditional`), the features past `dims` copied. Inputs: x [B, ..., T, D], the offsets
// (int32, one or B), and the frequencies where given.
class RopeKernel : public mx::UnaryPrimitive {
 public:
  RopeKernel(mx::Stream stream, int dims, bool traditional, std::optional<float> base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = inputs, y = out.data<float>(), dims = dims_, traditional = traditional_, base = base_,
                      scale = scale_]() {
      const auto& x = in[0];
      const int64_t d = x.shape(-1), t_len = x.shape(-2), b_len = x.shape(0);
      const int64_t rows = static_cast<int64_t>(x.size()) / d, per_b = rows / b_len;
      const int half = dims / 2;
      std::vector<float> inv(half);
      if (in.size() > 2) {
        for (int i = 0; i < half; i++) inv[i] = 1.0f / in[2].data<float>()[offset(in[2], i)];
      } else {
        const float step = std::log(*base) / half;
        for (int i = 0; i < half; i++) {
          const float a = -static_cast<float>(i) * step;
          inv[i] = mx::simd::exp(mx::simd::Simd<float, 1>(a)).value;
        }
      }
      // cos and sin for each row position (b, t) once, as MLX computes them before they
      // broadcast over the heads.
      const auto& offs = in[1];
      const int64_t positions = offs.size() == 1 ? 1 : b_len;
      std::vector<float> cs(positions * t_len * half), sn(positions * t_len * half);
      for (int64_t b = 0; b < positions; b++) {
        const int32_t off = offs.data<int32_t>()[offset(offs, b)];
        for (int64_t t = 0; t < t_len; t++) {
          const float pos = (static_cast<float>(t) + static_cast<float>(off)) * scale;
          float* c = cs.data() + (b * t_len + t) * half;
          float* s = sn.data() + (b * t_len + t) * half;
          for (int i = 0; i < half; i++) {
            const float theta = pos * inv[i];
            c[i] = mx::simd::cos(mx::simd::Simd<float, 1>(theta)).value;
            s[i] = mx::simd::sin(mx::simd::Simd<float, 1>(theta)).value;
          }
        }
      }
      const auto starts = row_starts(x);
      std::vector<float> scratch;
      for (int64_t r = 0; r < rows; r++) {
        const int64_t b = positions == 1 ? 0 : r / per_b, t = r % t_len;
        const float* c = cs.data() + (b * t_len + t) * half;
        const float* sv = sn.data() + (b * t_len + t) * half;
        const float* a = row_at(x, starts, r, scratch);
        float* o = y + r * d;
        for (int i = 0; i < half; i++) {
          const int64_t i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
          const float x1 = a[i1], x2 = a[i2];
          const float p = x1 * c[i], q = x2 * sv[i];
          const float u = x1 * sv[i], v = x2 * c[i];
          o[i1] = p - q;
          o[i2] = u + v;
        }
        for (int64_t i = dims; i < d; i++) o[i] = a[i];
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU rotary embedding has no GPU version");
  }

  const char* name() const override { return "HostCpuRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const RopeKernel*>(&other);
    return o != nullptr && o->dims_ == dims_ && o->traditional_ == traditional_ && o->base_ == base_ &&
           o->scale_ == scale_;
  }

 private:
  int dims_;
  bool traditional_;
  std::optional<float> base_;
  float scale_;
};

// An array whose values are whatever its fresh buffer holds: the allocation, nothing written
// (pages the caller never writes are never touched).
class UninitBuffer : public mx::UnaryPrimitive {
 public:
  explicit UninitBuffer(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's unwritten buffer is a CPU primitive");
  }

  const char* name() const override { return "HostUninit"; }
};

// Whether the host's kernels take float32 `x` here (else nullopt goes back to MLX's).
bool serves(const mx::array& x) {
#if defined(__x86_64__)
  return cpu_exp_enabled() && cpu_exp_mode.load() != 0 && mx::default_device() == mx::Device::cpu &&
         x.dtype() == mx::float32 && x.ndim() > 0 && x.size() > 0;
#else
  (void)x;  // MLX's kernels are vectorized there, summing in their own order
  return false;
#endif
}

}  // namespace

bool cpu_exp_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_CPU_EXP");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

std::optional<mx::array> cpu_uninit(const mx::Shape& shape, mx::Dtype dtype) {
  if (mx::default_device() != mx::Device::cpu) return std::nullopt;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, dtype, std::make_shared<UninitBuffer>(stream), {});
}

std::optional<mx::array> cpu_swiglu(const mx::array& gate, const mx::array& x) {
  if (!serves(gate) || x.dtype() != mx::float32 || gate.shape() != x.shape()) return std::nullopt;
  // The inputs' layouts are read when they are evaluated: a view's rows (a fused gate/up
  // projection's halves) are read in place.
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<ExpKernel>(stream, Kind::kSwiglu), {gate, x});
}

std::optional<mx::array> cpu_logsumexp(const mx::array& x, bool keepdims) {
  if (!serves(x)) return std::nullopt;
  auto shape = x.shape();
  if (keepdims) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<ExpKernel>(stream, Kind::kLogSumExp), {x});
}

std::optional<mx::array> cpu_softmax(const mx::array& x) {
  if (!serves(x)) return std::nullopt;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<ExpKernel>(stream, Kind::kSoftmax), {x});
}

std::optional<mx::array> cpu_rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  if (!serves(x)) return std::nullopt;
  if (w && (w->dtype() != mx::float32 || w->ndim() != 1 || w->size() != static_cast<size_t>(x.shape(-1)))) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  if (w) inputs.push_back(*w);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNormKernel>(stream, eps), std::move(inputs));
}

std::optional<mx::array> cpu_rope(const mx::array& x, int dims, bool traditional, std::optional<float> base,
                                  float scale, const mx::array& offset, const std::optional<mx::array>& freqs) {
  if (!serves(x) || x.ndim() < 3 || dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) return std::nullopt;
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0)))) {
    return std::nullopt;
  }
  if (freqs ? (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != dims / 2) : !base) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x, offset};
  if (freqs) inputs.push_back(*freqs);
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeKernel>(stream, dims, traditional, base, scale),
                   std::move(inputs));
}

}  // namespace mlx_shim
