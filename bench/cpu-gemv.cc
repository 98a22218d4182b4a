// OpenBLAS's sgemm against one sgemv per row, for the shapes of a SmolLM2-135M decode step
// (x [M, K] @ W.T, W [N, K] row-major, as MLX's CPU matmul calls it): the measurement behind
// host/mlx/cpp/cpu_matmul.cc's kFewRows. Built and run by bench/cpu-decode.sh:
//
//   g++ -O2 bench/cpu-gemv.cc /usr/lib/x86_64-linux-gnu/libopenblas.so.0 -o /tmp/cpu-gemv && /tmp/cpu-gemv
#include <chrono>
#include <cstdio>
#include <vector>

extern "C" {
void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
void cblas_sgemv(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
}

int main() {
  struct Shape {
    int n, k;
    const char* what;
  } shapes[] = {{576, 576, "q/o proj"},  {192, 576, "k/v proj"},     {1536, 576, "gate/up"},
                {576, 1536, "down"},     {49152, 576, "output layer"}};
  std::printf("| layer | N | K | rows | sgemm us | sgemv per row us | sgemm / sgemv |\n|---|---|---|---|---|---|---|\n");
  for (const auto& s : shapes) {
    for (int m : {1, 2, 4, 8, 16}) {
      std::vector<float> w(static_cast<size_t>(s.n) * s.k, 0.01f), x(static_cast<size_t>(m) * s.k, 0.5f),
          y(static_cast<size_t>(m) * s.n);
      auto time = [&](auto f) {
        for (int i = 0; i < 3; i++) f();
        const int reps = 200000000 / (s.n * s.k) + 3;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; i++) f();
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
      };
      const double gemm = time([&] {
        cblas_sgemm(101, 111, 112, m, s.n, s.k, 1.f, x.data(), s.k, w.data(), s.k, 0.f, y.data(), s.n);
      });
      const double gemv = time([&] {
        for (int r = 0; r < m; r++)
          cblas_sgemv(101, 111, s.n, s.k, 1.f, w.data(), s.k, x.data() + r * s.k, 1, 0.f, y.data() + r * s.n, 1);
      });
      std::printf("| %s | %d | %d | %d | %.1f | %.1f | %.2f |\n", s.what, s.n, s.k, m, gemm, gemv, gemm / gemv);
    }
  }
}
