/* Strata's cblas_sgemm for MLX on Linux CPU (engine/matvec.py builds and loads it).
 *
 * Loaded with RTLD_GLOBAL before OpenBLAS, so MLX's matmul reaches this cblas_sgemm first.
 * A row-major product whose A has one row (a decode step's every projection) becomes one
 * sgemv; every other call goes to OpenBLAS's own sgemm unchanged. Why: OpenBLAS 0.3.21
 * (Debian 12) packs B for every sgemm, one row included, which made a starter decode step's
 * products about twice as slow as sgemv over the same weights (docs/benchmarks.md).
 * strata_matvec_attach() must run before MLX computes anything (before it, a call would
 * jump to NULL): engine/matvec.py attaches it before mlx.core is imported.
 *
 * Packed weights: a float32 weight that was dequantized from 4- or 8-bit affine codes
 * (w = scale * q + bias per group of `group` along a row) can be registered with those codes
 * (strata_matvec_pack). A product of up to M_MAX rows whose B is that weight, stored n x k
 * (a decode step's, a speculative verify pass's, a small batch's), then reads the codes (an
 * eighth or a quarter of the bytes) and computes sum_g scale_g (sum q x) + bias_g (sum x) on
 * x86-64 with AVX2/FMA or AVX-512: the same products up to float rounding, each row's bit
 * for bit the same whatever rows are beside it. Why: a decode step reads every weight once, and float32
 * weights made it memory-bound (docs/benchmarks.md). Each call checks B at fixed spots
 * against the values seen at registration, so a freed weight whose memory another array
 * reuses is never read as packed; the registry is read-locked while a product runs.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define STRATA_X86 1
#endif

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static unsigned long long as_gemv;  /* calls forwarded to sgemv: tests check MLX's path */

static void choose_kernels(void);

void strata_matvec_attach(void *sgemm, void *sgemv) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
    choose_kernels();
}

unsigned long long strata_matvec_count(void) {
    return __atomic_load_n(&as_gemv, __ATOMIC_RELAXED);
}


/* ---- packed weights ---------------------------------------------------------------- */

/* M_MAX: past 8 rows OpenBLAS's sgemm over the float32 weights was faster (the starter's
 * 211 products: 48.5 against 54.4 ms at 8 rows, 85.9 against 45.2 at 16) */
enum { CAP = 4096, PROBES = 4, MAX_K = 32768, M_MAX = 8 };

typedef struct {
    const float *w;  /* the key: B as MLX passes it (NULL: empty; TOMB: removed) */
    int n, k, bits, group;
    const uint8_t *codes;            /* n rows of k * bits / 8 bytes, MLX's packing */
    const float *scales, *biases;    /* n x k / group */
    float probe[PROBES];
} packed_t;

/* rows r0..r1 of the product of m rows of x (as `run_packed` lays them out) into y (m rows
 * of ldy): y = alpha (w x) + beta y */
typedef void (*rows_fn)(const packed_t *, int, int, int, const float *, const float *, float *,
                        int, float, float);

static const float TOMB_VALUE = 0.0f;
#define TOMB (&TOMB_VALUE)
static packed_t table[CAP];
static int live;
static pthread_rwlock_t lock = PTHREAD_RWLOCK_INITIALIZER;
static unsigned long long as_packed;
static rows_fn kernel;  /* NULL: no kernel for this CPU */

static size_t slot_of(const float *w) {
    uintptr_t h = (uintptr_t)w;
    h ^= h >> 17;
    h *= 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 40) % CAP;
}

static size_t probe_at(const packed_t *e, int i) {
    /* the first and last element and two between: rows apart, so that one reused page
     * does not hold them all */
    size_t last = (size_t)e->n * e->k - 1;
    return i == 0 ? 0 : i == PROBES - 1 ? last : last / (PROBES - 1) * i;
}

static int unpacked_equal(const packed_t *e, int row) {
    /* row `row` of the codes dequantized (scale * q + bias, float32) equals B's row */
    int per = 8 / e->bits, mask = (1 << e->bits) - 1;
    const uint8_t *c = e->codes + (size_t)row * e->k * e->bits / 8;
    const float *s = e->scales + (size_t)row * (e->k / e->group);
    const float *b = e->biases + (size_t)row * (e->k / e->group);
    for (int j = 0; j < e->k; j++) {
        int q = (c[j / per] >> (e->bits * (j % per))) & mask;
        volatile float v = s[j / e->group] * (float)q;  /* no fused multiply-add */
        float want = e->w[(size_t)row * e->k + j];
        float got = v + b[j / e->group];
        if (memcmp(&got, &want, sizeof got) != 0)
            return 0;
    }
    return 1;
}

/* Register B = w (n x k float32, row-major) as dequantized from codes/scales/biases.
 * 1 on success; 0 where it cannot be served (no kernel for this CPU or bit width, a shape
 * it does not take, a full registry, or rows that do not dequantize to w exactly). */
int strata_matvec_pack(const float *w, int n, int k, const void *codes, const float *scales,
                       const float *biases, int bits, int group) {
    if (kernel == NULL || (bits != 4 && bits != 8) || n <= 0 || k <= 0 ||
        k > MAX_K || group <= 0 || group % 32 != 0 || k % group != 0 || w == NULL)
        return 0;
    packed_t e = {w, n, k, bits, group, (const uint8_t *)codes, scales, biases, {0}};
    if (!unpacked_equal(&e, 0) || !unpacked_equal(&e, n - 1))
        return 0;
    for (int i = 0; i < PROBES; i++)
        e.probe[i] = w[probe_at(&e, i)];
    int ok = 0;
    pthread_rwlock_wrlock(&lock);
    if (live < CAP / 2) {
        size_t i = slot_of(w), free_at = CAP;
        for (size_t step = 0; step < CAP; step++, i = (i + 1) % CAP) {
            if (table[i].w == w) { free_at = i; break; }  /* registered again: replaced */
            if (table[i].w == TOMB && free_at == CAP) free_at = i;
            if (table[i].w == NULL) { if (free_at == CAP) free_at = i; break; }
        }
        if (free_at < CAP) {
            live += table[free_at].w != w;
            table[free_at] = e;
            ok = 1;
        }
    }
    pthread_rwlock_unlock(&lock);
    return ok;
}

/* Forget w (a no-op if it is not registered). */
void strata_matvec_unpack(const float *w) {
    pthread_rwlock_wrlock(&lock);
    size_t i = slot_of(w);
    for (size_t step = 0; step < CAP && table[i].w != NULL; step++, i = (i + 1) % CAP)
        if (table[i].w == w) {
            table[i].w = TOMB;
            live--;
            break;
        }
    pthread_rwlock_unlock(&lock);
}

/* Weights registered now. */
int strata_matvec_packed_live(void) {
    pthread_rwlock_rdlock(&lock);
    int n = live;
    pthread_rwlock_unlock(&lock);
    return n;
}

unsigned long long strata_matvec_packed_count(void) {
    return __atomic_load_n(&as_packed, __ATOMIC_RELAXED);
}

/* 1 where this machine has a kernel for `bits`. */
int strata_matvec_packs(int bits) {
    return kernel != NULL && (bits == 4 || bits == 8);
}

static const packed_t *find(const float *w, int n, int k, int ldb) {
    size_t i = slot_of(w);
    for (size_t step = 0; step < CAP && table[i].w != NULL; step++, i = (i + 1) % CAP) {
        const packed_t *e = &table[i];
        if (e->w != w)
            continue;
        if (e->n != n || e->k != k || ldb != k)
            return NULL;
        for (int p = 0; p < PROBES; p++)
            if (memcmp(&w[probe_at(e, p)], &e->probe[p], sizeof(float)) != 0)
                return NULL;
        return e;
    }
    return NULL;
}

#ifdef STRATA_X86
/* Rows of x as the kernels read them, one after another (k floats each): for 4 bits each run
 * of 32 split into its 16 even and 16 odd elements (a code byte holds elements 2i and 2i + 1
 * in its low and high nibble); for 8 bits as they are. Then each row's group sums. */
static __thread float *x_buf;
static __thread size_t x_cap;

/* One weight row r against m (1..MROWS, a constant where inlined) rows of x: out[i] =
 * sum_g scale_g (sum q x_i) + bias_g (sum x_i). Each x row's result is computed in the same
 * order whatever m is, so a verify step's rows equal single decode steps' bit for bit. */
#define MROWS 4

__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void row_avx512(const packed_t *e, int r, int m, int bits, const float *x,
                              const float *xs, float *out) {
    const int k = e->k, G = k / e->group, per = bits == 4 ? 32 : 16, runs = e->group / per;
    const int ldxs = k / e->group;
    const uint8_t *c = e->codes + (size_t)r * k * bits / 8;
    const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m512 acc[MROWS];
    float bias[MROWS];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < m; i++) {
        acc[i] = _mm512_setzero_ps();
        bias[i] = 0.0f;
    }
    for (int g = 0; g < G; g++) {
        __m512 t[MROWS];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < m; i++)
            t[i] = _mm512_setzero_ps();
        for (int u = 0; u < runs; u++) {
            int at = g * runs + u;
            __m128i by = _mm_loadu_si128((const __m128i *)(c + at * 16));
            if (bits == 4) {
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(by, m4)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_and_si128(_mm_srli_epi16(by, 4), m4)));
                _Pragma("GCC unroll 4")
                for (int i = 0; i < m; i++) {
                    const float *xi = x + (size_t)i * k + at * 32;
                    t[i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xi), t[i]);
                    t[i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xi + 16), t[i]);
                }
            } else {
                __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(by));
                _Pragma("GCC unroll 4")
                for (int i = 0; i < m; i++)
                    t[i] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x + (size_t)i * k + at * 16),
                                           t[i]);
            }
        }
        __m512 sv = _mm512_set1_ps(s[g]);
        _Pragma("GCC unroll 4")
        for (int i = 0; i < m; i++) {
            acc[i] = _mm512_fmadd_ps(t[i], sv, acc[i]);
            bias[i] = __builtin_fmaf(b[g], xs[i * ldxs + g], bias[i]);  /* fused in every m */
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < m; i++)
        out[i] = _mm512_reduce_add_ps(acc[i]) + bias[i];
}

__attribute__((target("avx2,fma"), always_inline))
static inline float sum8(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 widen8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

__attribute__((target("avx2,fma"), always_inline))
static inline void row_avx2(const packed_t *e, int r, int m, int bits, const float *x,
                            const float *xs, float *out) {
    const int k = e->k, G = k / e->group, per = bits == 4 ? 32 : 16, runs = e->group / per;
    const int ldxs = k / e->group;
    const uint8_t *c = e->codes + (size_t)r * k * bits / 8;
    const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256 acc[MROWS];
    float bias[MROWS];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < m; i++) {
        acc[i] = _mm256_setzero_ps();
        bias[i] = 0.0f;
    }
    for (int g = 0; g < G; g++) {
        __m256 t[MROWS];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < m; i++)
            t[i] = _mm256_setzero_ps();
        for (int u = 0; u < runs; u++) {
            int at = g * runs + u;
            __m128i by = _mm_loadu_si128((const __m128i *)(c + at * 16));
            __m256 q[4];
            int parts;
            if (bits == 4) {
                __m128i lo = _mm_and_si128(by, m4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(by, 4), m4);
                q[0] = widen8(lo);
                q[1] = widen8(_mm_srli_si128(lo, 8));
                q[2] = widen8(hi);
                q[3] = widen8(_mm_srli_si128(hi, 8));
                parts = 4;
            } else {
                q[0] = widen8(by);
                q[1] = widen8(_mm_srli_si128(by, 8));
                parts = 2;
            }
            _Pragma("GCC unroll 4")
            for (int i = 0; i < m; i++) {
                const float *xi = x + (size_t)i * k + at * per;
                _Pragma("GCC unroll 4")
                for (int j = 0; j < parts; j++)
                    t[i] = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(xi + 8 * j), t[i]);
            }
        }
        __m256 sv = _mm256_set1_ps(s[g]);
        _Pragma("GCC unroll 4")
        for (int i = 0; i < m; i++) {
            acc[i] = _mm256_fmadd_ps(t[i], sv, acc[i]);
            bias[i] = __builtin_fmaf(b[g], xs[i * ldxs + g], bias[i]);  /* fused in every m */
        }
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < m; i++)
        out[i] = sum8(acc[i]) + bias[i];
}

/* The kernels: for each weight row, the x rows MROWS at a time (the row's codes stay in L1
 * between them); `m` and `bits` constants in each call below, so that each combination is
 * compiled on its own. */
#define ROWS_KERNEL(name, row, isa)                                                        \
    __attribute__((target(isa)))                                                           \
    static void name(const packed_t *e, int r0, int r1, int m, const float *x,             \
                     const float *xs, float *y, int ldy, float alpha, float beta) {        \
        const int k = e->k, G = k / e->group;                                             \
        float out[MROWS];                                                                  \
        for (int r = r0; r < r1; r++)                                                      \
            for (int i0 = 0; i0 < m; i0 += MROWS) {                                        \
                const float *xi = x + (size_t)i0 * k, *si = xs + (size_t)i0 * G;           \
                int mm = m - i0 < MROWS ? m - i0 : MROWS;                                  \
                if (e->bits == 4) {                                                        \
                    switch (mm) {                                                          \
                    case 1: row(e, r, 1, 4, xi, si, out); break;                           \
                    case 2: row(e, r, 2, 4, xi, si, out); break;                           \
                    case 3: row(e, r, 3, 4, xi, si, out); break;                           \
                    default: row(e, r, 4, 4, xi, si, out); break;                          \
                    }                                                                      \
                } else {                                                                   \
                    switch (mm) {                                                          \
                    case 1: row(e, r, 1, 8, xi, si, out); break;                           \
                    case 2: row(e, r, 2, 8, xi, si, out); break;                           \
                    case 3: row(e, r, 3, 8, xi, si, out); break;                           \
                    default: row(e, r, 4, 8, xi, si, out); break;                          \
                    }                                                                      \
                }                                                                          \
                for (int i = 0; i < mm; i++) {                                             \
                    float *yi = y + (size_t)(i0 + i) * ldy + r;                            \
                    float v = alpha * out[i];                                              \
                    *yi = beta == 0.0f ? v : v + beta * *yi;                               \
                }                                                                          \
            }                                                                              \
    }

ROWS_KERNEL(rows_avx512, row_avx512, "avx512f,avx512bw")
ROWS_KERNEL(rows_avx2, row_avx2, "avx2,fma")

static void choose_kernels(void) {
    /* STRATA_MATVEC_ISA=avx2 or =none narrows the choice (the tests run each kernel) */
    const char *isa = getenv("STRATA_MATVEC_ISA");
    int wide = isa == NULL || strcmp(isa, "avx2") != 0;
    if (isa != NULL && strcmp(isa, "none") == 0)
        return;
    __builtin_cpu_init();
    if (wide && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        kernel = rows_avx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        kernel = rows_avx2;
}

/* C (m rows of ldc) = alpha A B^T + beta C for m <= M_MAX rows of A (row i, element j at
 * a[i * row_step + j * elem_step]) and a packed B. */
static void run_packed(const packed_t *e, int m, const float *a, size_t row_step,
                       size_t elem_step, float alpha, float beta, float *c, int ldc) {
    const int k = e->k, G = k / e->group;
    size_t need = (size_t)m * (k + G);
    if (need > x_cap) {
        float *grown = realloc(x_buf, need * sizeof(float));
        if (grown == NULL) {  /* out of memory: sgemm's job after all */
            real_sgemm(ROW_MAJOR, elem_step == 1 ? NO_TRANS : TRANS, TRANS, m, e->n, k, alpha,
                       a, (int)(elem_step == 1 ? row_step : elem_step), e->w, k, beta, c, ldc);
            return;
        }
        x_buf = grown;
        x_cap = need;
    }
    float *xs = x_buf + (size_t)m * k;
    for (int i = 0; i < m; i++) {
        const float *ai = a + i * row_step;
        float *xi = x_buf + (size_t)i * k;
        for (int run = 0; run < k / 32; run++)
            for (int j = 0; j < 16; j++) {
                float ev = ai[(size_t)(run * 32 + 2 * j) * elem_step];
                float od = ai[(size_t)(run * 32 + 2 * j + 1) * elem_step];
                if (e->bits == 4) {
                    xi[run * 32 + j] = ev;
                    xi[run * 32 + 16 + j] = od;
                } else {
                    xi[run * 32 + 2 * j] = ev;
                    xi[run * 32 + 2 * j + 1] = od;
                }
            }
        for (int g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int j = 0; j < e->group; j++)
                sum += xi[g * e->group + j];  /* a group's elements in any order: a sum */
            xs[(size_t)i * G + g] = sum;
        }
    }
    kernel(e, 0, e->n, m, x_buf, xs, c, ldc, alpha, beta);
}
#else
static void choose_kernels(void) {}
static void run_packed(const packed_t *e, int m, const float *a, size_t row_step,
                       size_t elem_step, float alpha, float beta, float *c, int ldc) {
    (void)e; (void)m; (void)a; (void)row_step; (void)elem_step; (void)alpha; (void)beta;
    (void)c; (void)ldc;
}
#endif

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && trans_b == TRANS && m >= 1 && m <= M_MAX && n > 0 && k > 0 &&
        ldc >= n) {
        /* nn.Linear's x @ w.T for a decode step (m = 1), a verify step or a small batch:
         * w may be a packed weight */
        pthread_rwlock_rdlock(&lock);
        const packed_t *e = live ? find(b, n, k, ldb) : NULL;
        if (e != NULL) {
            int plain = trans_a == NO_TRANS;
            run_packed(e, m, a, plain ? (size_t)lda : 1, plain ? 1 : (size_t)lda, alpha, beta,
                       c, ldc);
            pthread_rwlock_unlock(&lock);
            __atomic_add_fetch(&as_packed, 1, __ATOMIC_RELAXED);
            return;
        }
        pthread_rwlock_unlock(&lock);
    }
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
