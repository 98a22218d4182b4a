// The process's CBLAS, found at run time: the BLAS MLX's own CPU ops resolve to (OpenBLAS
// where the host links it, else the wheel's), so the shim's CPU kernels multiply with the
// same library. Null where none is loaded: those kernels then leave the op to MLX.
#pragma once

#include <dlfcn.h>

namespace mlx_shim::blas {

// As every CBLAS declares them (row major 101, no transpose 111, transpose 112).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);
using Sgemv = void (*)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

inline Sgemm sgemm() {
  static const Sgemm found = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return found;
}

inline Sgemv sgemv() {
  static const Sgemv found = reinterpret_cast<Sgemv>(dlsym(RTLD_DEFAULT, "cblas_sgemv"));
  return found;
}

}  // namespace mlx_shim::blas
