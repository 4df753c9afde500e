/* Strata's cblas_sgemm for MLX on Linux CPU (engine/matvec.py builds and loads it).
 *
 * Loaded with RTLD_GLOBAL before OpenBLAS, so MLX's matmul reaches this cblas_sgemm first.
 * A row-major product whose A has one row (a decode step's every projection) becomes one
 * sgemv; every other call goes to OpenBLAS's own sgemm unchanged. Why: OpenBLAS 0.3.21
 * (Debian 12) packs B for every sgemm, one row included, which made a starter decode step's
 * products about twice as slow as sgemv over the same weights (docs/benchmarks.md).
 * strata_matvec_attach() must run before MLX computes anything (before it, a call would
 * jump to NULL): engine/matvec.py attaches it before mlx.core is imported.
 */
#include <stddef.h>
#include <string.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static unsigned long long as_gemv;  /* calls forwarded to sgemv: tests check MLX's path */

void strata_matvec_attach(void *sgemm, void *sgemv) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
}

unsigned long long strata_matvec_count(void) {
    return __atomic_load_n(&as_gemv, __ATOMIC_RELAXED);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && m == 1 && n > 0 && k > 0 && real_sgemv != NULL) {
        /* C's one row = alpha op(B)^T a + beta C: a is A's row (or column, transposed). */
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (beta == 0.0f)  /* MLX leaves C uninitialised: sgemv must not scale a NaN */
            memset(c, 0, sizeof(float) * (size_t)n);
        if (trans_b == NO_TRANS)  /* B is k x n */
            real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
        else  /* B is stored n x k */
            real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
        __atomic_add_fetch(&as_gemv, 1, __ATOMIC_RELAXED);
        return;
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
