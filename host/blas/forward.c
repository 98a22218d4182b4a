/* The BLAS entry points MLX and the shim call (cblas_sgemm, _dgemm, _cgemm; cblas_sgemv),
 * forwarded to scipy-openblas32 from PyPI, which prefixes its symbols (`scipy_cblas_*`) so it
 * can sit beside another BLAS. Built by host/build.rs into libhost_blas.so when the system has
 * no OpenBLAS: linked into the binary ahead of libmlx, these definitions take the calls the
 * mlx-cpu wheel's reference BLAS would otherwise get. 32-bit integers (scipy-openblas32). */

typedef int blasint;

void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float *, blasint, const float *,
                       blasint, float, float *, blasint);
void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double *, blasint, const double *,
                       blasint, double, double *, blasint);
void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *, const void *, blasint, const void *,
                       blasint, const void *, void *, blasint);
void scipy_cblas_sgemv(int, int, blasint, blasint, float, const float *, blasint, const float *, blasint, float,
                       float *, blasint);
char *scipy_openblas_get_config(void);

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, float alpha, const float *a, blasint lda,
                 const float *b, blasint ldb, float beta, float *c, blasint ldc) {
  scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, double alpha, const double *a,
                 blasint lda, const double *b, blasint ldb, double beta, double *c, blasint ldc) {
  scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, const void *alpha, const void *a,
                 blasint lda, const void *b, blasint ldb, const void *beta, void *c, blasint ldc) {
  scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_sgemv(int order, int trans, blasint m, blasint n, float alpha, const float *a, blasint lda, const float *x,
                 blasint incx, float beta, float *y, blasint incy) {
  scipy_cblas_sgemv(order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy);
}

/* What is linked, for the startup log. */
const char *host_blas_config(void) { return scipy_openblas_get_config(); }
