// The host's AVX2 product of 4-bit weights by one activation row (host/mlx/cpp/cpu_qmatmul.cc,
// rows_avx2<1>), on the weights of a SmolLM2-135M decode step (30 layers' projections and the
// 49152 x 576 output layer, group 32, float32 scales and biases: 101 MB, over this EPYC's L3),
// in milliseconds per token: the kernel before session 50 ("A", codes scaled first, two
// multiply-adds a chunk on each of two loop-carried chains) against the chains of unscaled
// codes per group ("B", one multiply-add a group on the loop-carried chain), one weight row at
// a time, two (adjacent or from each half of the range, as the host now takes them) or four.
//
//   g++ -O2 -std=c++17 -pthread bench/cpu-qgemv-avx2.cc -o /tmp/qgemv && /tmp/qgemv 1 && /tmp/qgemv 2
//
// The argument is the threads (each takes half of every product's rows). Best of 15 passes;
// this machine's run-to-run spread is wide, so read the ratios within a run.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <thread>
struct Job { const uint8_t* w; size_t w_stride; const float* scales; const float* biases; const float* xp; const float* xsum; int k, group, groups; float* y; };
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
// A: current
__attribute__((target("avx2,fma"))) void kA(const Job& j, int n0, int n1) {
  const int chunks = j.group / 32; const __m128i low = _mm_set1_epi8(0x0F);
  for (int c = n0; c < n1; c++) {
    const uint8_t* wr = j.w + (size_t)c * j.w_stride; const float* sr = j.scales + (size_t)c * j.groups; const float* br = j.biases + (size_t)c * j.groups;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int g = 0; g < j.groups; g++) {
      const __m256 s = _mm256_set1_ps(sr[g]);
      for (int ch = 0; ch < chunks; ch++) {
        const int at = (g * chunks + ch) * 32;
        const __m128i by = _mm_loadu_si128((const __m128i*)(wr + at / 2));
        const __m128i lo = _mm_and_si128(by, low), hi = _mm_and_si128(_mm_srli_epi16(by, 4), low);
        __m256 q[4];
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)); q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)); q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int i = 0; i < 4; i++) q[i] = _mm256_mul_ps(q[i], s);
        const float* xp = j.xp + at;
        for (int i = 0; i < 4; i++) { if (i & 1) a1 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xp + 8 * i), a1); else a0 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xp + 8 * i), a0); }
      }
    }
    __m256 bv = _mm256_setzero_ps(); int g = 0; const float* xs = j.xsum;
    for (; g + 8 <= j.groups; g += 8) bv = _mm256_fmadd_ps(_mm256_loadu_ps(br + g), _mm256_loadu_ps(xs + g), bv);
    float bias = hsum256(bv); for (; g < j.groups; g++) bias += br[g] * xs[g];
    j.y[c] = hsum256(_mm256_add_ps(a0, a1)) + bias;
  }
}
// B: unscaled per-group partial, then acc = fma(s, t, acc); NR weight rows at once (from halves when HALVES)
template <int NR, bool HALVES>
__attribute__((target("avx2,fma"))) void kB(const Job& j, int n0, int n1) {
  const int chunks = j.group / 32; const __m128i low = _mm_set1_epi8(0x0F);
  const int step = HALVES ? (n1 - n0) / NR : 1;
  int cend = HALVES ? n0 + step : n1;
  for (int c = n0; c < cend; c += HALVES ? 1 : NR) {
    __m256 acc[NR];
    for (int a = 0; a < NR; a++) acc[a] = _mm256_setzero_ps();
    for (int g = 0; g < j.groups; g++) {
      __m256 t[NR][2];
      for (int a = 0; a < NR; a++) t[a][0] = t[a][1] = _mm256_setzero_ps();
      for (int ch = 0; ch < chunks; ch++) {
        const int at = (g * chunks + ch) * 32;
        const float* xp = j.xp + at;
        const __m256 x0 = _mm256_loadu_ps(xp), x1 = _mm256_loadu_ps(xp + 8), x2 = _mm256_loadu_ps(xp + 16), x3 = _mm256_loadu_ps(xp + 24);
#pragma GCC unroll 4
        for (int a = 0; a < NR; a++) {
          const uint8_t* wr = j.w + (size_t)(c + a * step) * j.w_stride;
          const __m128i by = _mm_loadu_si128((const __m128i*)(wr + at / 2));
          const __m128i lo = _mm_and_si128(by, low), hi = _mm_and_si128(_mm_srli_epi16(by, 4), low);
          t[a][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0, t[a][0]);
          t[a][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), x1, t[a][1]);
          t[a][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, t[a][0]);
          t[a][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), x3, t[a][1]);
        }
      }
#pragma GCC unroll 4
      for (int a = 0; a < NR; a++) acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(j.scales[(size_t)(c + a * step) * j.groups + g]), _mm256_add_ps(t[a][0], t[a][1]), acc[a]);
    }
    for (int a = 0; a < NR; a++) {
      const int row = c + a * step; const float* br = j.biases + (size_t)row * j.groups;
      __m256 bv = _mm256_setzero_ps(); int g = 0; const float* xs = j.xsum;
      for (; g + 8 <= j.groups; g += 8) bv = _mm256_fmadd_ps(_mm256_loadu_ps(br + g), _mm256_loadu_ps(xs + g), bv);
      float bias = hsum256(bv); for (; g < j.groups; g++) bias += br[g] * xs[g];
      j.y[row] = hsum256(acc[a]) + bias;
    }
  }
  if (HALVES) for (int c = n0 + step * NR; c < n1; c++) kA(j, c, c + 1);
}
int main(int argc, char** argv) {
  struct S { int n, k; } shapes[] = {{576,576},{192,576},{192,576},{576,576},{1536,576},{1536,576},{576,1536}};
  const int layers = 30; const int group = 32;
  struct M { std::vector<uint8_t> w; std::vector<float> s, b; int n, k; };
  std::vector<M> ms;
  for (int l = 0; l < layers; l++) for (auto sh : shapes) { M m; m.n = sh.n; m.k = sh.k; m.w.resize((size_t)sh.n * sh.k / 2); for (auto& v : m.w) v = rand(); m.s.resize((size_t)sh.n * sh.k / group); m.b = m.s; for (auto& v : m.s) v = 0.01f * (rand() % 100); ms.push_back(std::move(m)); }
  { M m; m.n = 49152; m.k = 576; m.w.resize((size_t)m.n * m.k / 2); for (auto& v : m.w) v = rand(); m.s.resize((size_t)m.n * m.k / group, 0.01f); m.b = m.s; ms.push_back(std::move(m)); }
  std::vector<float> x(1536), xs(48), y(49152), y2(49152);
  for (auto& v : x) v = (rand() % 1000) / 1000.f;
  for (auto& v : xs) v = 1.f;
  size_t bytes = 0; for (auto& m : ms) bytes += m.w.size() + 8 * m.s.size();
  printf("weights, scales and biases: %.1f MB\n\n", bytes / 1e6);
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  auto run = [&](auto kern) {
    auto part = [&](int t) { for (auto& m : ms) {
      Job j{m.w.data(), (size_t)m.k / 2, m.s.data(), m.b.data(), x.data(), xs.data(), m.k, group, m.k / group, y.data()};
      kern(j, m.n * t / threads, m.n * (t + 1) / threads); } };
    if (threads == 1) part(0); else { std::thread th([&] { part(1); }); part(0); th.join(); }
  };
  double anchor = 0;
  auto time = [&](const char* name, auto kern) {
    run(kern);
    double best = 1e9;
    for (int rep = 0; rep < 15; rep++) { auto t0 = std::chrono::steady_clock::now(); run(kern); double d = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); if (d < best) best = d; }
    if (name[0] == 'A') anchor = best;
    printf("| %s | %d | %.2f | %.1f | %.2fx |\n", name, threads, best, bytes / best / 1e6, anchor / best);
  };
  printf("| kernel | threads | ms/token | GB/s of weights | speed vs A |\n|---|---|---|---|---|\n");
  for (int round = 0; round < 2; round++) {
    time("A current", kA);
    time("B 1 row", kB<1, false>);
    time("B 2 rows adjacent", kB<2, false>);
    time("B 2 rows halves", kB<2, true>);
    time("B 4 rows adjacent", kB<4, false>);
  }
  // check: B vs A
  for (auto& m : ms) { Job j{m.w.data(), (size_t)m.k / 2, m.s.data(), m.b.data(), x.data(), xs.data(), m.k, group, m.k / group, y.data()}; kA(j, 0, m.n); Job j2 = j; j2.y = y2.data(); kB<2, true>(j2, 0, m.n); double md = 0; for (int i = 0; i < m.n; i++) md = std::max(md, (double)std::abs(y[i] - y2[i]) / (std::abs(y[i]) + 1e-3)); if (&m == &ms.back()) printf("rel diff %.2e\n", md); }
}
