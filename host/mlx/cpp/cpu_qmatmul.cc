// Quantized weights kept quantized on the CPU (issue 47). MLX's CPU quantized_matmul runs at
// about a tenth of float32's speed, so GGUF files were dequantized to float32 at load, and a
// decode step of the 4-bit SmolLM2 read 0.54 GB of weights instead of ~0.1. This is the
// product on the packed weights, float32 arithmetic throughout (no int8 activations, so the
// parity suites against mlx-lm's float products hold):
//
//   y[r] = sum_g dot(scales[r, g] * q[r, g], x[g]) + biases[r, g] * sum(x[g])
//
// For a few activation rows (decode), each 32-weight chunk's codes become float weights once
// (AVX-512, 4 bits: looked up in the group's table of its 16 values, scale * code + bias;
// AVX-512, 8 bits: converted and scaled; AVX2: converted, summed unscaled per group and the sum
// scaled; the bias term, where not in the table, added from x's group sums) and are multiplied
// with the activations of several rows (AVX-512: tiles of 4 weight rows by up to 2 activation
// rows; AVX2: one weight row by up to 4 activation rows, two weight rows for one), which were
// reordered beforehand so a chunk's low nibbles meet the even positions and its high nibbles
// the odd ones (no interleaving in the loop). AVX-512 or AVX2 (chosen at run time), else
// portable C++. Large products are split by weight rows over a small pool of
// threads. For more rows (prefill chunks, wide batches), blocks of weight rows are dequantized
// into a scratch buffer that stays in L3 and multiplied with the process's sgemm, the BLAS
// MLX's float32 matmul uses.
//
// bench/RESULTS.md (session 37) has the decode and batch steps it gives, paired with float32.
#include "mlx/cpp/cpu_qmatmul.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics initialise their "undefined" operands from themselves.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/cpp/cpu_blas.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlx_shim {

// Set by tests to run the narrower kernels on a machine that has the wider ones.
std::atomic<int> cpu_qmatmul_isa_cap{3};

namespace {

// Up to this many activation rows read the packed weights; more take dequantize + sgemm.
// Measured with `host bench --batch` on the 2-core EPYC (bench/RESULTS.md, session 37), as
// aggregate tok/s against float32 weights: 4 rows 2.3x, 8 rows 1.55x, 16 rows (two passes)
// 1.0x; at 32, dequantize + sgemm runs 0.6-1.0x (the dequantization is its largest cost).
// AVX-512's tiles (session 42) pay at more rows (SmolLM2 Q4_1, `host bench`, four alternated
// rounds): prefill of 44 tokens 1.2x the dequantized product's, of 96 0.86x; a batch of 32
// decodes 1.2-1.6x.
constexpr int kPackedRows = 16, kPackedRowsAvx512 = 64;
// Floats of weights dequantized for one sgemm call (16 MB, inside this CPU's 32 MB L3): 1 MB
// blocks cost 2x at 16 rows and slowed prefill (OpenBLAS's per-call overhead at small N).
constexpr int kDequantizedBlock = 1 << 22;
// Rows of activations an AVX2 or portable kernel call carries at once (two accumulators a row
// live in AVX2's 16 registers); AVX-512's tiles take all of a product's rows.
constexpr int kRowsPerPass = 4;

enum Isa { kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

Isa detected_isa() {
#if defined(__x86_64__)
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
    return kPortable;
  }();
  return isa;
#else
  return kPortable;
#endif
}

Isa isa() {
  const int cap = cpu_qmatmul_isa_cap.load(std::memory_order_relaxed);
  const Isa found = detected_isa();
  return static_cast<Isa>(found < cap ? found : (cap < kPortable ? kPortable : cap));
}

int packed_rows(Isa level) { return level == kAvx512 ? kPackedRowsAvx512 : kPackedRows; }

// One product's operands, with R activation rows already reordered (`xp`, [R, K]) and summed
// per group (`xsum`, [R, groups], where the kernel reads them), and the kernels it takes: read
// once a product, so a test capping the ISA meanwhile cannot give it a kernel that reads sums
// it did not make.
struct Job {
  const uint8_t* w;
  size_t w_stride;  // bytes per weight row
  const float* scales;
  const float* biases;
  const float* xp;
  const float* xsum;
  int k, group, groups, bits, rows;
  float* y;
  int n;  // y is [rows, n]
  Isa isa;
};

// ---- Portable ------------------------------------------------------------------------------
void rows_portable(const Job& j, int n0, int n1) {
  const int chunks = j.group / 32;
  for (int c = n0; c < n1; c++) {
    const uint8_t* wr = j.w + static_cast<size_t>(c) * j.w_stride;
    const float* sr = j.scales + static_cast<size_t>(c) * j.groups;
    const float* br = j.biases + static_cast<size_t>(c) * j.groups;
    for (int r = 0; r < j.rows; r++) {
      const float* xp = j.xp + static_cast<size_t>(r) * j.k;
      const float* xs = j.xsum + static_cast<size_t>(r) * j.groups;
      float acc = 0.f, bias = 0.f;
      for (int g = 0; g < j.groups; g++) {
        float t = 0.f;
        for (int ch = 0; ch < chunks; ch++) {
          const int at = (g * chunks + ch) * 32;
          if (j.bits == 4) {
            const uint8_t* b = wr + at / 2;
            for (int i = 0; i < 16; i++) t += static_cast<float>(b[i] & 0x0F) * xp[at + i];
            for (int i = 0; i < 16; i++) t += static_cast<float>(b[i] >> 4) * xp[at + 16 + i];
          } else {
            const uint8_t* b = wr + at;
            for (int i = 0; i < 32; i++) t += static_cast<float>(b[i]) * xp[at + i];
          }
        }
        acc += sr[g] * t;
        bias += br[g] * xs[g];
      }
      j.y[static_cast<size_t>(r) * j.n + c] = acc + bias;
    }
  }
}

#if defined(__x86_64__)
// A 32-weight chunk's codes (the chunk at weight `at` of row `wr`) as bytes: the first sixteen
// in halves[0], the last sixteen in halves[1] (4 bits: the low and the high nibbles, which the
// reordered activations meet at their even and odd positions).
__attribute__((always_inline)) inline void chunk_codes(const uint8_t* wr, int at, int bits, __m128i halves[2]) {
  if (bits == 4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i by = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + at / 2));
    halves[0] = _mm_and_si128(by, low);
    halves[1] = _mm_and_si128(_mm_srli_epi16(by, 4), low);
  } else {
    halves[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + at));
    halves[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + at + 16));
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------
// The loops over a pass's rows are unrolled by pragma: at -O2 GCC leaves them rolled, and the
// accumulators then live on the stack (a pass of 8 rows ran no faster per row than 1).
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A chunk's codes as four vectors of eight floats, in the weights' order.
__attribute__((target("avx2,fma"), always_inline)) inline void codes_avx2(const uint8_t* wr, int at, int bits,
                                                                         __m256 q[4]) {
  __m128i h[2];
  chunk_codes(wr, at, bits, h);
  const __m128i eighths[4] = {h[0], _mm_srli_si128(h[0], 8), h[1], _mm_srli_si128(h[1], 8)};
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eighths[i]));
}

// NR weight rows (c, c + step, ...) against R activation rows. Each (weight row, activation
// row) pair sums a group's products of unscaled codes in two chains (a chunk's even and odd
// eighths), then adds them, scaled, to its accumulator: one multiply-add a group on the
// loop-carried chain, where scaling the codes first put two a chunk on each of two chains and
// the multiply-add's latency, not the loads, set the pace (the product of one row on this
// AVX2-only EPYC: 2.6-5.1 GB/s of weights that way, 7-9 with the chains and two streams;
// bench/RESULTS.md, session 50). A pair sums in the same order whatever NR and R, so a row's
// result has the same bits alone or in a batch.
template <int R, int NR>
__attribute__((target("avx2,fma"), always_inline)) inline void tile_avx2(const Job& j, int c, int step) {
  const int chunks = j.group / 32;
  __m256 acc[NR][R];
#pragma GCC unroll 2
  for (int a = 0; a < NR; a++) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[a][r] = _mm256_setzero_ps();
  }
  for (int g = 0; g < j.groups; g++) {
    __m256 t[NR][R][2];
#pragma GCC unroll 2
    for (int a = 0; a < NR; a++) {
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) t[a][r][0] = t[a][r][1] = _mm256_setzero_ps();
    }
    for (int ch = 0; ch < chunks; ch++) {
      const int at = (g * chunks + ch) * 32;
#pragma GCC unroll 2
      for (int a = 0; a < NR; a++) {
        __m256 q[4];
        codes_avx2(j.w + static_cast<size_t>(c + a * step) * j.w_stride, at, j.bits, q);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          const float* xp = j.xp + static_cast<size_t>(r) * j.k + at;
#pragma GCC unroll 4
          for (int i = 0; i < 4; i++) {
            t[a][r][i & 1] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xp + 8 * i), t[a][r][i & 1]);
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int a = 0; a < NR; a++) {
      const __m256 s = _mm256_set1_ps(j.scales[static_cast<size_t>(c + a * step) * j.groups + g]);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[a][r] = _mm256_fmadd_ps(s, _mm256_add_ps(t[a][r][0], t[a][r][1]), acc[a][r]);
    }
  }
#pragma GCC unroll 2
  for (int a = 0; a < NR; a++) {
    const size_t row = static_cast<size_t>(c + a * step);
    const float* br = j.biases + row * j.groups;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const float* xs = j.xsum + static_cast<size_t>(r) * j.groups;
      __m256 bv = _mm256_setzero_ps();
      int g = 0;
      for (; g + 8 <= j.groups; g += 8) bv = _mm256_fmadd_ps(_mm256_loadu_ps(br + g), _mm256_loadu_ps(xs + g), bv);
      float bias = hsum256(bv);
      for (; g < j.groups; g++) bias += br[g] * xs[g];
      j.y[static_cast<size_t>(r) * j.n + row] = hsum256(acc[a][r]) + bias;
    }
  }
}

// Weight rows [n0, n1) against R activation rows. A lone activation row takes its weight rows
// two at a time, one from each half of the range (two streams a page or more apart, as
// rows_avx512 does).
template <int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const Job& j, int n0, int n1) {
  if (R == 1) {
    const int half = (n1 - n0) / 2;
    for (int c = n0; c < n0 + half; c++) tile_avx2<1, 2>(j, c, half);
    if ((n1 - n0) % 2 != 0) tile_avx2<1, 1>(j, n1 - 1, 1);
    return;
  }
  for (int c = n0; c < n1; c++) tile_avx2<R, 1>(j, c, 1);
}

// ---- AVX-512 -------------------------------------------------------------------------------
// The sum of v's lanes (GCC 12's _mm512_reduce_add_ps warns of an uninitialized temporary).
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) inline float hsum512(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  __m128 s = _mm512_castps512_ps128(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A tile of NR weight rows by MR activation rows, two accumulators each (a chunk's first half
// and its second, as the kernel before the tiles summed: 2 * NR * MR <= 16 of the 32
// registers); the tile's weight rows are c, c + step, ... Per chunk half, each activation
// vector is loaded once for NR weight rows: a pass of one weight row by eight activation rows
// loaded as many activations as it did multiply-adds, and the loads, not the arithmetic, set
// its pace (SmolLM2's products on this EPYC's core, 8 rows: 1.75-1.9 G multiply-adds of 16
// lanes a second; tiles of 4 x 2: 1.9-2.0). Tiles of 4 x 4 with one accumulator a pair ran
// 2.3-2.7 G, but one accumulator sums 2x longer chains, and Gemma 4's 4-bit parity test then
// missed mlx-lm's logits by 1.06e-5 of the largest (its bound 1e-5). 4 bits: per group, each
// weight row's 16 possible weights, scale * code + bias, looked up by code (vpermps reads an
// index's low 4 bits): no conversion, no scaling, no bias term afterwards. 8 bits: codes
// converted and scaled, the bias term added at the end from x's group sums.
//
// Every (weight row, activation row) pair sums in the same order whatever the tile (each half's
// accumulator chunk by chunk, then the two added), so a row's result has the same bits alone or
// in a batch.
template <int BITS, int NR, int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline void tile_avx512(const Job& j, int c,
                                                                                                  int r0, int step) {
  const int chunks = j.group / 32;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[2][NR][MR];
#pragma GCC unroll 4
  for (int a = 0; a < NR; a++) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) acc[0][a][r] = acc[1][a][r] = _mm512_setzero_ps();
  }
  // One pointer per stream, the tile's weight rows at fixed strides from it (few registers).
  const float* x = j.xp + static_cast<size_t>(r0) * j.k;
  const uint8_t* w = j.w + static_cast<size_t>(c) * j.w_stride;
  const float* sc = j.scales + static_cast<size_t>(c) * j.groups;
  const float* bi = j.biases + static_cast<size_t>(c) * j.groups;
  const size_t ws = j.w_stride * step, gs = static_cast<size_t>(j.groups) * step, xs = static_cast<size_t>(j.k);
  for (int g = 0; g < j.groups; g++, sc++, bi++) {
    __m512 table[NR];  // 4 bits: the group's 16 weights; 8 bits: its scale
#pragma GCC unroll 4
    for (int a = 0; a < NR; a++) {
      table[a] = BITS == 4 ? _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[a * gs]), _mm512_set1_ps(bi[a * gs]))
                           : _mm512_set1_ps(sc[a * gs]);
    }
    for (int ch = 0; ch < chunks; ch++, w += BITS * 4, x += 32) {
      __m512i codes[NR];
      if (BITS == 4) {
#pragma GCC unroll 4
        for (int a = 0; a < NR; a++) {
          codes[a] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + a * ws)));
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; h++) {
        __m512 q[NR];
#pragma GCC unroll 4
        for (int a = 0; a < NR; a++) {
          if (BITS == 4) {
            q[a] = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(codes[a], 4) : codes[a], table[a]);
          } else {
            const __m128i by = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + a * ws + 16 * h));
            q[a] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(by)), table[a]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
          const __m512 xv = _mm512_loadu_ps(x + r * xs + 16 * h);
#pragma GCC unroll 4
          for (int a = 0; a < NR; a++) acc[h][a][r] = _mm512_fmadd_ps(q[a], xv, acc[h][a][r]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int a = 0; a < NR; a++) {
    const size_t row = static_cast<size_t>(c) + static_cast<size_t>(a) * step;
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
      float bias = 0.f;
      if (BITS != 4) {
        const float* br = j.biases + row * j.groups;
        const float* xsum = j.xsum + static_cast<size_t>(r0 + r) * j.groups;
        __m512 bv = _mm512_setzero_ps();
        for (int g = 0; g < j.groups; g += 16) {
          const __mmask16 m = j.groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (j.groups - g)) - 1);
          bv = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, br + g), _mm512_maskz_loadu_ps(m, xsum + g), bv);
        }
        bias = hsum512(bv);
      }
      j.y[static_cast<size_t>(r0 + r) * j.n + row] = hsum512(_mm512_add_ps(acc[0][a][r], acc[1][a][r])) + bias;
    }
  }
}

// Weight rows [c, c + NR) against all j.rows activation rows, in tiles of up to 2 rows.
template <int BITS, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void tiles_avx512(const Job& j, int c) {
  int r0 = 0;
  for (; r0 + 2 <= j.rows; r0 += 2) tile_avx512<BITS, NR, 2>(j, c, r0, 1);
  if (r0 < j.rows) tile_avx512<BITS, NR, 1>(j, c, r0, 1);
}

// Weight rows [n0, n1). One activation row is bound by the weights' bytes: adjacent weight
// rows read together are several streams a few hundred bytes apart, which two threads drew at
// 10-15 GB/s where one stream each drew 16-22; so a lone row's weight rows go two at a time,
// one from each half of the range (two streams a page or more apart: 18-22 GB/s).
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void rows_avx512(const Job& j, int n0, int n1) {
  if (j.rows == 1) {
    const int half = (n1 - n0) / 2;
    for (int c = n0; c < n0 + half; c++) tile_avx512<BITS, 2, 1>(j, c, 0, half);
    if ((n1 - n0) % 2 != 0) tile_avx512<BITS, 1, 1>(j, n1 - 1, 0, 1);
    return;
  }
  int c = n0;
  for (; c + 4 <= n1; c += 4) tiles_avx512<BITS, 4>(j, c);
  for (; c < n1; c++) tiles_avx512<BITS, 1>(j, c);
}
#endif

// Weight rows [n0, n1) dequantized (scale * q + bias) into `out` ([n1 - n0, K]), each
// 32-weight chunk in the order the activations were reordered in (low nibbles, then high).
void dequantize_portable(const Job& j, int n0, int n1, float* out) {
  for (int c = n0; c < n1; c++, out += j.k) {
    const uint8_t* wr = j.w + static_cast<size_t>(c) * j.w_stride;
    const float* sr = j.scales + static_cast<size_t>(c) * j.groups;
    const float* br = j.biases + static_cast<size_t>(c) * j.groups;
    for (int at = 0; at < j.k; at += 32) {
      const float s = sr[at / j.group], b = br[at / j.group];
      for (int i = 0; i < 16; i++) {
        const int lo = j.bits == 4 ? wr[at / 2 + i] & 0x0F : wr[at + i];
        const int hi = j.bits == 4 ? wr[at / 2 + i] >> 4 : wr[at + 16 + i];
        out[at + i] = s * static_cast<float>(lo) + b;
        out[at + 16 + i] = s * static_cast<float>(hi) + b;
      }
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void dequantize_avx512(const Job& j, int n0, int n1,
                                                                                 float* out) {
  for (int c = n0; c < n1; c++, out += j.k) {
    const uint8_t* wr = j.w + static_cast<size_t>(c) * j.w_stride;
    const float* sr = j.scales + static_cast<size_t>(c) * j.groups;
    const float* br = j.biases + static_cast<size_t>(c) * j.groups;
    for (int at = 0; at < j.k; at += 32) {
      const __m512 s = _mm512_set1_ps(sr[at / j.group]), b = _mm512_set1_ps(br[at / j.group]);
      __m128i h[2];
      chunk_codes(wr, at, j.bits, h);
      _mm512_storeu_ps(out + at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h[0])), s, b));
      _mm512_storeu_ps(out + at + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h[1])), s, b));
    }
  }
}

// dequantize_avx512 in eight lanes (it runs on the calling thread, before each block's sgemm:
// scalar, it was 5% of a 512-token prefill on an AVX2-only EPYC).
__attribute__((target("avx2,fma"))) void dequantize_avx2(const Job& j, int n0, int n1, float* out) {
  for (int c = n0; c < n1; c++, out += j.k) {
    const uint8_t* wr = j.w + static_cast<size_t>(c) * j.w_stride;
    const float* sr = j.scales + static_cast<size_t>(c) * j.groups;
    const float* br = j.biases + static_cast<size_t>(c) * j.groups;
    for (int at = 0; at < j.k; at += 32) {
      const __m256 s = _mm256_set1_ps(sr[at / j.group]), b = _mm256_set1_ps(br[at / j.group]);
      __m256 q[4];
      codes_avx2(wr, at, j.bits, q);
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + at + 8 * i, _mm256_fmadd_ps(q[i], s, b));
    }
  }
}
#endif

void dequantize_rows(const Job& j, int n0, int n1, float* out) {
#if defined(__x86_64__)
  if (j.isa == kAvx512) return dequantize_avx512(j, n0, n1, out);
  if (j.isa == kAvx2) return dequantize_avx2(j, n0, n1, out);
#endif
  dequantize_portable(j, n0, n1, out);
}

void run_rows(const Job& j, int n0, int n1) {
#if defined(__x86_64__)
  const Isa level = j.isa;
  if (level >= kAvx2) {
    if (level == kAvx512) return j.bits == 4 ? rows_avx512<4>(j, n0, n1) : rows_avx512<8>(j, n0, n1);
    switch (j.rows) {
      case 1: return rows_avx2<1>(j, n0, n1);
      case 2: return rows_avx2<2>(j, n0, n1);
      case 3: return rows_avx2<3>(j, n0, n1);
      default: return rows_avx2<4>(j, n0, n1);
    }
  }
#endif
  rows_portable(j, n0, n1);
}

// ---- Threads -------------------------------------------------------------------------------
// The CPUs this process may run on, or OPENBLAS_NUM_THREADS where set (the e2e suite runs
// servers side by side with it at 1): the shim's products share the cores the BLAS would.
int thread_count() {
  static const int n = [] {
    if (const char* v = std::getenv("OPENBLAS_NUM_THREADS")) {
      const int t = std::atoi(v);
      if (t >= 1) return t < 64 ? t : 64;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      const int c = CPU_COUNT(&set);
      return c < 1 ? 1 : (c < 64 ? c : 64);
    }
    const unsigned h = std::thread::hardware_concurrency();
    return h == 0 ? 1 : static_cast<int>(h < 64 ? h : 64);
  }();
  return n;
}

// Workers that wait for a product to be split over them; the calling thread takes part. A
// second caller while one product runs (two CPU streams) runs its own product alone. A worker
// that finishes spins a while before it sleeps: a decode step runs one product after another
// with short serial ops between, and waking a sleeping worker (a futex call, then the
// scheduler) cost the calling thread ~4% of an 8-row step; the caller likewise waits for the
// workers' last tasks with pauses, not `sched_yield` calls.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(thread_count() - 1);  // never destroyed: workers outlive exit
    return *pool;
  }

  // Calls fn(i) for every i in [0, tasks).
  void run(int tasks, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || workers_ == 0 || tasks <= 1) {
      for (int i = 0; i < tasks; i++) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      open_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    // A worker about to sleep counted itself under the mutex before this product was posted.
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    take(fn, tasks);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = false;
    }
    for (int spin = 0; active_.load(std::memory_order_acquire) != 0; spin++) {
      if (spin < kSpins) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  // Pauses a worker spins before sleeping (~100 microseconds at ~40 ns a pause on this EPYC:
  // longer than the serial ops between a step's products, far shorter than a step).
  static constexpr int kSpins = 2500;

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  explicit Pool(int workers) : workers_(workers < 0 ? 0 : workers) {
    for (int i = 0; i < workers_; i++) std::thread([this] { work(); }).detach();
  }

  void take(const std::function<void(int)>& fn, int tasks) {
    for (int i = next_.fetch_add(1); i < tasks; i = next_.fetch_add(1)) fn(i);
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      for (int spin = 0; spin < kSpins && generation_.load(std::memory_order_acquire) == seen; spin++) pause();
      const std::function<void(int)>* fn;
      int tasks;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load(std::memory_order_relaxed) == seen) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
        seen = generation_.load(std::memory_order_relaxed);
        if (!open_) continue;
        active_.fetch_add(1);
        fn = fn_;
        tasks = tasks_;
      }
      take(*fn, tasks);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int workers_;
  std::mutex busy_, mutex_;
  std::condition_variable wake_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  bool open_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> next_{0}, active_{0}, sleepers_{0};
};

// Splits weight rows [0, n) into tasks of whole rows for the pool: products under 256k
// multiply-adds (~20 microseconds) stay on the calling thread, where waking a worker would
// cost as much. SmolLM2's decode, three rounds each: 65.1 / 64.9 / 68.7 tok/s with this
// threshold (every layer's products split), 69.1 / 56.8 / 61.4 at 1M (the MLP's and the
// output layer's), 52.6 / 59.2 / 59.0 on one thread: one core streams ~9 GB/s of weights,
// two ~15.
void for_row_ranges(int n, size_t weights, const std::function<void(int, int)>& body) {
  const int threads = thread_count();
  if (threads <= 1 || weights < (size_t{1} << 18)) return body(0, n);
  const int tasks = threads * 4;
  const int per = (n + tasks - 1) / tasks;
  Pool::get().run(tasks, [&](int t) {
    const int a = t * per, b = a + per < n ? a + per : n;
    if (a < b) body(a, b);
  });
}

// ---- The primitive -------------------------------------------------------------------------
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    // Row-contiguous: cpu_quantized_matmul passes every input through mx::contiguous.
    encoder.dispatch([in = inputs, y = out.data<float>(), group = group_, bits = bits_]() {
      const auto &x = in[0], &w = in[1], &s = in[2], &b = in[3];
      const int n = w.shape(0), k = x.shape(-1);
      const int rows = static_cast<int>(x.size() / k);
      Job j{w.data<uint8_t>(), static_cast<size_t>(k) * bits / 8, s.data<float>(), b.data<float>(), nullptr,
            nullptr, k, group, k / group, bits, 0, nullptr, n, isa()};
      product(j, x.data<float>(), rows, y);
    });
  }

  // y [rows, n] = x [rows, k] @ the job's weights: packed up to the kernels' limit, else
  // dequantized blocks through sgemm (or, with no sgemm, packed passes of the limit).
  static void product(Job j, const float* x, int rows, float* y) {
    const int limit = packed_rows(j.isa);
    if (rows <= limit) return packed(j, x, rows, y);
    if (blas::sgemm() != nullptr) return dequantized(j, x, rows, y);
    for (int r0 = 0; r0 < rows; r0 += limit) {
      packed(j, x + static_cast<size_t>(r0) * j.k, std::min(limit, rows - r0), y + static_cast<size_t>(r0) * j.n);
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU quantized matmul has no GPU version");
  }

  const char* name() const override { return "HostCpuQmatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const QuantizedMatmul*>(&other);
    return o != nullptr && o->group_ == group_ && o->bits_ == bits_;
  }

 private:
  // `rows` rows of x reordered as the kernels read them: per 32-value chunk, for 4 bits the
  // even positions then the odd (a byte's low nibble, then its high), for 8 bits as they are.
  static void reorder(const float* x, int rows, int k, int bits, Isa level, float* out) {
    if (bits != 4) {
      std::memcpy(out, x, sizeof(float) * static_cast<size_t>(rows) * k);
      return;
    }
#if defined(__x86_64__)
    if (level == kAvx512) return reorder_avx512(x, static_cast<size_t>(rows) * k, out);
#endif
    for (size_t at = 0; at < static_cast<size_t>(rows) * k; at += 32) {
      for (int i = 0; i < 16; i++) {
        out[at + i] = x[at + 2 * i];
        out[at + 16 + i] = x[at + 2 * i + 1];
      }
    }
  }

#if defined(__x86_64__)
  // The same with two permutes a chunk (the scalar loop was half of the calling thread's time
  // outside the kernels in an 8-row step).
  __attribute__((target("avx512f"))) static void reorder_avx512(const float* x, size_t n, float* out) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (size_t at = 0; at < n; at += 32) {
      const __m512 a = _mm512_loadu_ps(x + at), b = _mm512_loadu_ps(x + at + 16);
      _mm512_storeu_ps(out + at, _mm512_permutex2var_ps(a, even, b));
      _mm512_storeu_ps(out + at + 16, _mm512_permutex2var_ps(a, odd, b));
    }
  }
#endif

  // A few rows: all at once (AVX-512) or kRowsPerPass at a time, each pass over the packed weights.
  static void packed(Job j, const float* x, int rows, float* y) {
    thread_local std::vector<float> xp, xsum;
    xp.resize(static_cast<size_t>(rows) * j.k);
    xsum.resize(static_cast<size_t>(rows) * j.groups);
    reorder(x, rows, j.k, j.bits, j.isa, xp.data());
    // The group sums carry the bias term, except where AVX-512 looks 4-bit weights up in their
    // group's table (bias included): there they were computed for nothing, on the calling
    // thread alone while the others wait (an in-order sum is a chain of dependent adds).
    if (!(j.bits == 4 && j.isa == kAvx512)) {
      for (int g = 0; g < rows * j.groups; g++) {
        const float* v = x + static_cast<size_t>(g) * j.group;
        float sum = 0.f;
        for (int i = 0; i < j.group; i++) sum += v[i];
        xsum[g] = sum;
      }
    }
    // AVX-512's kernels tile the rows themselves; AVX2's and the portable take passes of a few.
    const int per_pass = j.isa == kAvx512 ? rows : kRowsPerPass;
    for (int r0 = 0; r0 < rows; r0 += per_pass) {
      j.xp = xp.data() + static_cast<size_t>(r0) * j.k;
      j.xsum = xsum.data() + static_cast<size_t>(r0) * j.groups;
      j.rows = rows - r0 < per_pass ? rows - r0 : per_pass;
      j.y = y + static_cast<size_t>(r0) * j.n;
      for_row_ranges(j.n, static_cast<size_t>(j.n) * j.k * j.rows, [&](int a, int b) { run_rows(j, a, b); });
    }
  }

  // Many rows: blocks of weight rows dequantized (as MLX's dequantize: scale * q + bias) and
  // multiplied by sgemm into the block's columns of y. Weights and activations share the
  // kernels' reordering of each chunk, so the dequantized rows are written as they lie.
  static void dequantized(const Job& j, const float* x, int rows, float* y) {
    const int block = std::max(16, kDequantizedBlock / j.k);
    thread_local std::vector<float> scratch, xp;
    scratch.resize(static_cast<size_t>(block) * j.k);
    xp.resize(static_cast<size_t>(rows) * j.k);
    reorder(x, rows, j.k, j.bits, j.isa, xp.data());
    for (int n0 = 0; n0 < j.n; n0 += block) {
      const int nb = j.n - n0 < block ? j.n - n0 : block;
      dequantize_rows(j, n0, n0 + nb, scratch.data());
      blas::sgemm()(blas::kRowMajor, blas::kNoTrans, blas::kTrans, rows, nb, j.k, 1.f, xp.data(), j.k,
                    scratch.data(), j.k, 0.f, y + n0, j.n);
    }
  }

  int group_, bits_;
};

// MLX's gather_qmm (a mixture of experts' products) in float32: output matrix i is x's matrix
// lhs[i] ([..., M, K]) times expert rhs[i]'s weights ([E, N, ...]), as QuantizedMatmul's
// product per matrix (MLX's is its scalar quantized kernel per matrix, ~10x slower). Runs of
// one-row matrices with the same expert (mlx-lm sorts a prompt's (token, expert) pairs by
// expert) go through the product together as rows of one; runs are spread over the pool when
// there are several. Inputs contiguous; lhs and rhs uint32 in the output's batch shape.
class GatherQmm : public mx::UnaryPrimitive {
 public:
  GatherQmm(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = inputs, y = out.data<float>(), group = group_, bits = bits_]() {
      const auto &x = in[0], &w = in[1], &s = in[2], &b = in[3];
      const uint32_t *li = in[4].data<uint32_t>(), *ri = in[5].data<uint32_t>();
      const int k = x.shape(-1), m = x.shape(-2), n = w.shape(-2), mats = static_cast<int>(in[4].size());
      const size_t w_stride = static_cast<size_t>(k) * bits / 8, groups = static_cast<size_t>(k / group);
      // Runs [start, end) of matrices sharing an expert (one-row matrices only).
      std::vector<std::pair<int, int>> runs;
      for (int i = 0; i < mats; i++) {
        if (m == 1 && !runs.empty() && ri[runs.back().first] == ri[i]) {
          runs.back().second = i + 1;
        } else {
          runs.emplace_back(i, i + 1);
        }
      }
      const Isa level = isa();
      auto run = [&](int r) {
        const auto [a, e] = runs[r];
        const size_t wi = ri[a];
        Job j{w.data<uint8_t>() + wi * n * w_stride, w_stride, s.data<float>() + wi * n * groups,
              b.data<float>() + wi * n * groups, nullptr, nullptr, k, group, static_cast<int>(groups), bits, 0,
              nullptr, n, level};
        float* out = y + static_cast<size_t>(a) * m * n;
        if (m != 1) return QuantizedMatmul::product(j, x.data<float>() + static_cast<size_t>(li[a]) * m * k, m, out);
        thread_local std::vector<float> rows;
        rows.resize(static_cast<size_t>(e - a) * k);
        for (int i = a; i < e; i++) {
          std::memcpy(rows.data() + static_cast<size_t>(i - a) * k, x.data<float>() + static_cast<size_t>(li[i]) * k,
                      sizeof(float) * k);
        }
        QuantizedMatmul::product(j, rows.data(), e - a, out);
      };
      // Several runs: one a task (each product then on its task's thread); else each product
      // spreads itself.
      const bool share = runs.size() > 1 && static_cast<size_t>(n) * k * m * mats >= (size_t{1} << 18);
      if (share) {
        Pool::get().run(static_cast<int>(runs.size()), run);
      } else {
        for (int r = 0; r < static_cast<int>(runs.size()); r++) run(r);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU gathered quantized matmul has no GPU version");
  }

  const char* name() const override { return "HostCpuGatherQmm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const GatherQmm*>(&other);
    return o != nullptr && o->group_ == group_ && o->bits_ == bits_;
  }

 private:
  int group_, bits_;
};

// ---- bfloat16, with MLX's bits -------------------------------------------------------------
// An MLX folder in bfloat16 (mlx-community's quantized models are) keeps bfloat16 on the CPU
// (mlx-lm computes there in it, and the parity suites hold the host to mlx-lm's ids). MLX's CPU
// product for it, `_qmm_t<bfloat16_t>` (this wheel's x86 build has no SIMD type for it), rounds
// to bfloat16 after every operation, one weight at a time in K order:
//
//   sum = bf16(sum + bf16(x[k] * bf16(bf16(scale * q[k]) + bias)))
//
// a scalar emulation per weight: a narrow Qwen3.5-MoE of 40 layers decoded 1.1 tok/s, 89% of
// it there. This kernel does the same operations in the same order for sixteen weight rows at
// once (AVX-512 lanes): each a float32 operation (exact where MLX's is: the operands are
// bfloat16) rounded as MLX's `_MLX_BFloat16(float)` rounds (to nearest even by adding
// 0x7FFF plus the kept part's lowest bit; NaN to 0x7FC0): MLX's bits. Weight rows are
// spread over the pool. AVX-512, AVX2 (eight lanes) or portable C++ (one weight at a time, as
// MLX, but spread over the cores), as the float32 kernels are chosen (`cap_cpu_qmatmul_isa`);
// under HOST_CPU_QMATMUL=0, MLX's.
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// MLX's `_MLX_BFloat16(float)`: to nearest even, NaN to 0x7FC0 (as a float: the bfloat16's bits
// on top).
inline float round_bf16_scalar(float v) {
  if (std::isnan(v)) return bf16_float(0x7FC0);
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u += ((u >> 16) & 1) + 0x7FFFu;
  return bf16_float(static_cast<uint16_t>(u >> 16));
}

void bf16_rows_portable(const uint32_t* w, const uint16_t* scales, const uint16_t* biases, const uint16_t* x,
                        uint16_t* y, int k, int group, int bits, int n0, int n1) {
  const int per_pack = 32 / bits, packs = k / per_pack, groups = k / group;
  const uint32_t code_mask = (1u << bits) - 1;
  for (int r = n0; r < n1; r++) {
    const uint32_t* wr = w + static_cast<size_t>(r) * packs;
    float sum = 0.f;
    int at = 0;
    for (int g = 0; g < groups; g++) {
      const float s = bf16_float(scales[static_cast<size_t>(r) * groups + g]);
      const float b = bf16_float(biases[static_cast<size_t>(r) * groups + g]);
      for (int p = g * group / per_pack; p < (g + 1) * group / per_pack; p++) {
        for (int c = 0; c < per_pack; c++, at++) {
          const float q = static_cast<float>((wr[p] >> (bits * c)) & code_mask);
          const float v = round_bf16_scalar(round_bf16_scalar(s * q) + b);
          sum = round_bf16_scalar(sum + round_bf16_scalar(bf16_float(x[at]) * v));
        }
      }
    }
    uint32_t u;
    std::memcpy(&u, &sum, sizeof u);
    y[r] = static_cast<uint16_t>(u >> 16);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) inline __m256 round_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i kept = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(kept, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan));
}

// bf16_rows_avx512's arithmetic in eight lanes.
__attribute__((target("avx2"))) void bf16_rows_avx2(const uint32_t* w, const uint16_t* scales, const uint16_t* biases,
                                                     const uint16_t* x, uint16_t* y, int k, int group, int bits, int n0,
                                                     int n1) {
  const int per_pack = 32 / bits, packs = k / per_pack, groups = k / group;
  const __m256i code_mask = _mm256_set1_epi32((1 << bits) - 1);
  const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(packs));
  alignas(32) float sc[8], bi[8], out[8];
  for (int r0 = n0; r0 < n1; r0 += 8) {
    const int lanes = n1 - r0 < 8 ? n1 - r0 : 8;
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const uint32_t* wr = w + static_cast<size_t>(r0) * packs;
    __m256 sum = _mm256_setzero_ps();
    int at = 0;
    for (int g = 0; g < groups; g++) {
      for (int l = 0; l < 8; l++) {
        const size_t i = static_cast<size_t>(r0 + (l < lanes ? l : 0)) * groups + g;
        sc[l] = bf16_float(scales[i]);
        bi[l] = bf16_float(biases[i]);
      }
      const __m256 s = _mm256_load_ps(sc), b = _mm256_load_ps(bi);
      for (int p = g * group / per_pack; p < (g + 1) * group / per_pack; p++) {
        const __m256i pack = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(wr + p),
                                                         rows, live, 4);
        for (int c = 0; c < per_pack; c++, at++) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(pack, bits * c), code_mask));
          const __m256 v = round_bf16_avx2(_mm256_add_ps(round_bf16_avx2(_mm256_mul_ps(s, q)), b));
          sum = round_bf16_avx2(
              _mm256_add_ps(sum, round_bf16_avx2(_mm256_mul_ps(_mm256_set1_ps(bf16_float(x[at])), v))));
        }
      }
    }
    _mm256_store_ps(out, sum);
    for (int l = 0; l < lanes; l++) {
      uint32_t u;
      std::memcpy(&u, &out[l], sizeof u);
      y[r0 + l] = static_cast<uint16_t>(u >> 16);
    }
  }
}

__attribute__((target("avx512f"))) inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i kept = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(kept, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}


// y[m, n0..n1) for activation row m (x [K] bfloat16), weight rows n0..n1 (whole blocks of 16
// but the last).
__attribute__((target("avx512f"))) void bf16_rows_avx512(const uint32_t* w, const uint16_t* scales, const uint16_t* biases,
                                                          const uint16_t* x, uint16_t* y, int k, int group, int bits,
                                                          int n0, int n1) {
  const int per_pack = 32 / bits, packs = k / per_pack, groups = k / group;
  const __m512i code_mask = _mm512_set1_epi32((1 << bits) - 1);
  alignas(64) float sc[16], bi[16];
  alignas(64) uint16_t out[16];
  for (int r0 = n0; r0 < n1; r0 += 16) {
    const int lanes = n1 - r0 < 16 ? n1 - r0 : 16;
    const __mmask16 live = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(packs));
    const uint32_t* wr = w + static_cast<size_t>(r0) * packs;
    __m512 sum = _mm512_setzero_ps();
    int at = 0;  // the weight's position along K
    for (int g = 0; g < groups; g++) {
      for (int l = 0; l < 16; l++) {
        const size_t i = static_cast<size_t>(r0 + (l < lanes ? l : 0)) * groups + g;
        sc[l] = bf16_float(scales[i]);
        bi[l] = bf16_float(biases[i]);
      }
      const __m512 s = _mm512_load_ps(sc), b = _mm512_load_ps(bi);
      for (int p = g * group / per_pack; p < (g + 1) * group / per_pack; p++) {
        const __m512i pack = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, wr + p, 4);
        for (int c = 0; c < per_pack; c++, at++) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(pack, bits * c), code_mask));
          const __m512 v = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(s, q)), b));
          sum = round_bf16(_mm512_add_ps(sum, round_bf16(_mm512_mul_ps(_mm512_set1_ps(bf16_float(x[at])), v))));
        }
      }
    }
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(sum), 16));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), half);
    std::memcpy(y + r0, out, sizeof(uint16_t) * lanes);
  }
}
#endif

// The bfloat16 kernel `level` picks (all three give MLX's bits).
void bf16_rows(Isa level, const uint32_t* w, const uint16_t* scales, const uint16_t* biases, const uint16_t* x,
               uint16_t* y, int k, int group, int bits, int n0, int n1) {
#if defined(__x86_64__)
  if (level == kAvx512) return bf16_rows_avx512(w, scales, biases, x, y, k, group, bits, n0, n1);
  if (level == kAvx2) return bf16_rows_avx2(w, scales, biases, x, y, k, group, bits, n0, n1);
#endif
  bf16_rows_portable(w, scales, biases, x, y, k, group, bits, n0, n1);
}

// The bfloat16 products' primitive: a dense one (x [..., K], w [N, K * bits / 32], scales and
// biases [N, K / group]: one matrix, x's rows its rows) or, `gathered`, MLX's gather_qmm (a
// mixture of experts' products): output matrix i is x's matrix lhs[i] ([..., M, K]) times
// expert rhs[i]'s weights ([E, N, ...]), each as a dense product (MLX's `_bs_qmm_dispatch_typed`
// calls `_qmm_t` per matrix). Inputs contiguous; lhs and rhs uint32 in the output's batch shape.
class QmmBf16 : public mx::UnaryPrimitive {
 public:
  QmmBf16(mx::Stream stream, int group_size, int bits, bool gathered)
      : mx::UnaryPrimitive(stream), group_(group_size), bits_(bits), gathered_(gathered) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in = inputs, y = out.data<uint16_t>(), group = group_, bits = bits_, gathered = gathered_]() {
      const Isa level = isa();
      const auto &x = in[0], &w = in[1], &s = in[2], &b = in[3];
      const int k = x.shape(-1), n = w.shape(-2);
      const uint32_t zero = 0;
      const uint32_t* li = gathered ? in[4].data<uint32_t>() : &zero;
      const uint32_t* ri = gathered ? in[5].data<uint32_t>() : &zero;
      const int mats = gathered ? static_cast<int>(in[4].size()) : 1;
      const int m = gathered ? x.shape(-2) : static_cast<int>(x.size() / k);
      const size_t w_els = static_cast<size_t>(w.shape(-1)) * n, g_els = static_cast<size_t>(s.shape(-1)) * n;
      const auto* xs = reinterpret_cast<const uint16_t*>(x.data<mx::bfloat16_t>());
      const auto* ss = reinterpret_cast<const uint16_t*>(s.data<mx::bfloat16_t>());
      const auto* bs = reinterpret_cast<const uint16_t*>(b.data<mx::bfloat16_t>());
      // Tasks of (matrix, block of 16 weight rows) ranges; products under 256k multiply-adds
      // stay on this thread.
      const int blocks = (n + 15) / 16, all = mats * blocks;
      const bool share = static_cast<size_t>(n) * k * m * mats >= (size_t{1} << 18);
      const int tasks = share ? std::min(all, thread_count() * 4) : 1;
      const int per = (all + tasks - 1) / tasks;
      Pool::get().run(tasks, [&](int t) {
        for (int u = t * per; u < std::min(all, (t + 1) * per); u++) {
          const int i = u / blocks, r0 = (u % blocks) * 16, r1 = std::min(n, r0 + 16);
          const size_t xi = li[i], wi = ri[i];
          for (int r = 0; r < m; r++) {
            bf16_rows(level, w.data<uint32_t>() + wi * w_els, ss + wi * g_els, bs + wi * g_els,
                      xs + (xi * m + r) * k, y + (static_cast<size_t>(i) * m + r) * n, k, group, bits, r0, r1);
          }
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the host's CPU bfloat16 quantized products have no GPU version");
  }

  const char* name() const override { return gathered_ ? "HostCpuGatherQmmBf16" : "HostCpuQmatmulBf16"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const QmmBf16*>(&other);
    return o != nullptr && o->group_ == group_ && o->bits_ == bits_ && o->gathered_ == gathered_;
  }

 private:
  int group_, bits_;
  bool gathered_;
};

// A weight already in memory and row-contiguous as it is: a `contiguous` of each would be
// three more graph nodes per product, evaluated every step for nothing.
mx::array as_is(const mx::array& a) { return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a); }

// The bfloat16 product where it applies (see above), else nullopt.
std::optional<mx::array> bf16_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                               const mx::array& biases, int group_size, int bits) {
  if ((bits != 4 && bits != 8) || group_size < 32 || group_size % 32 != 0) return std::nullopt;
  if (x.dtype() != mx::bfloat16 || w.dtype() != mx::uint32 || scales.dtype() != mx::bfloat16 ||
      biases.dtype() != mx::bfloat16) {
    return std::nullopt;
  }
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape()) return std::nullopt;
  const int n = w.shape(0), k = w.shape(1) * 32 / bits;
  if (n == 0 || k == 0 || x.shape(-1) != k || k % group_size != 0 || scales.shape(0) != n ||
      scales.shape(1) != k / group_size || x.size() == 0) {
    return std::nullopt;
  }
  auto shape = x.shape();
  shape.back() = n;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::bfloat16, std::make_shared<QmmBf16>(stream, group_size, bits, false),
                   {mx::contiguous(x), as_is(w), as_is(scales), as_is(biases)});
}

}  // namespace

std::optional<mx::array> cpu_gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                                        const mx::array& biases, const mx::array& rhs_indices, int group_size,
                                        int bits, bool sorted_indices) {
  if (!cpu_qmatmul_enabled() || mx::default_device() != mx::Device::cpu) return std::nullopt;
  if ((bits != 4 && bits != 8) || group_size < 32 || group_size % 32 != 0) return std::nullopt;
  const auto dt = x.dtype();
  const bool bf16 = dt == mx::bfloat16;
  if (!(bf16 || dt == mx::float32) || w.dtype() != mx::uint32 || scales.dtype() != dt || biases.dtype() != dt ||
      w.ndim() != 3 || scales.ndim() != 3 || biases.shape() != scales.shape()) {
    return std::nullopt;
  }
  // MLX's own op, lazily: its node's inputs are the operands as its primitive gets them (the
  // indices broadcast to the output's batch shape, lhs made where none was given).
  auto ref = mx::gather_qmm(x, w, scales, biases, std::nullopt, rhs_indices, true, group_size, bits, "affine",
                            std::nullopt, sorted_indices);
  if (!ref.has_primitive() || std::string(ref.primitive().name()) != "GatherQMM" || ref.inputs().size() != 6 ||
      ref.dtype() != dt) {
    return std::nullopt;
  }
  const auto& in = ref.inputs();
  const int k = in[0].shape(-1), n = in[1].shape(-2);
  if (in[0].ndim() < 2 || in[1].shape(-1) * 32 / bits != k || k % group_size != 0 || in[2].shape(-2) != n ||
      in[2].shape(-1) != k / group_size || in[4].dtype() != mx::uint32 || in[5].dtype() != mx::uint32 ||
      in[4].size() != in[5].size() || ref.shape(-1) != n || ref.shape(-2) != in[0].shape(-2)) {
    return std::nullopt;
  }
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::shared_ptr<mx::Primitive> primitive;
  if (bf16) {
    primitive = std::make_shared<QmmBf16>(stream, group_size, bits, true);
  } else {
    primitive = std::make_shared<GatherQmm>(stream, group_size, bits);
  }
  return mx::array(ref.shape(), dt, primitive,
                   {mx::contiguous(in[0]), as_is(in[1]), as_is(in[2]), as_is(in[3]), mx::contiguous(in[4]),
                    mx::contiguous(in[5])});
}

int cpu_qmatmul_packed_rows() { return packed_rows(isa()); }

void cpu_parallel_for(int tasks, const std::function<void(int)>& fn) { Pool::get().run(tasks, fn); }

int cpu_threads() { return thread_count(); }

bool cpu_qmatmul_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HOST_CPU_QMATMUL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

std::optional<mx::array> cpu_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                              const mx::array& biases, int group_size, int bits) {
  if (!cpu_qmatmul_enabled() || mx::default_device() != mx::Device::cpu) return std::nullopt;
  if (x.dtype() == mx::bfloat16) return bf16_quantized_matmul(x, w, scales, biases, group_size, bits);
  if ((bits != 4 && bits != 8) || group_size < 32 || group_size % 32 != 0) return std::nullopt;
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32 || scales.dtype() != mx::float32 ||
      biases.dtype() != mx::float32) {
    return std::nullopt;
  }
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape()) return std::nullopt;
  const int n = w.shape(0), k = w.shape(1) * 32 / bits;
  if (n == 0 || k == 0 || x.shape(-1) != k || scales.shape(0) != n || scales.shape(1) != k / group_size) {
    return std::nullopt;
  }
  const size_t rows = x.size() / k;
  if (rows == 0 || (rows > static_cast<size_t>(packed_rows(isa())) && blas::sgemm() == nullptr)) return std::nullopt;
  auto shape = x.shape();
  shape.back() = n;
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(stream, group_size, bits),
                   {mx::contiguous(x), as_is(w), as_is(scales), as_is(biases)});
}

}  // namespace mlx_shim
