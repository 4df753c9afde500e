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
 * (strata_matvec_pack). A one-row product whose B is that weight, stored n x k, then reads
 * the codes (an eighth or a quarter of the bytes) and computes
 * sum_g scale_g (sum q x) + bias_g (sum x) on x86-64 with AVX2/FMA or AVX-512: the same
 * products up to float rounding. Why: a decode step reads every weight once, and float32
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

enum { CAP = 4096, PROBES = 4, MAX_K = 32768 };

typedef struct {
    const float *w;  /* the key: B as MLX passes it (NULL: empty; TOMB: removed) */
    int n, k, bits, group;
    const uint8_t *codes;            /* n rows of k * bits / 8 bytes, MLX's packing */
    const float *scales, *biases;    /* n x k / group */
    float probe[PROBES];
} packed_t;

typedef void (*row_fn)(const packed_t *, int, int, const float *, const float *, float *,
                       float, float);

static const float TOMB_VALUE = 0.0f;
#define TOMB (&TOMB_VALUE)
static packed_t table[CAP];
static int live;
static pthread_rwlock_t lock = PTHREAD_RWLOCK_INITIALIZER;
static unsigned long long as_packed;
static row_fn rows4, rows8;

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
    if ((bits == 4 ? rows4 : bits == 8 ? rows8 : NULL) == NULL || n <= 0 || k <= 0 ||
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
    return (bits == 4 ? rows4 : bits == 8 ? rows8 : NULL) != NULL;
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
/* x as the kernels read it: for 4 bits, each run of 32 split into its 16 even and 16 odd
 * elements (a code byte holds elements 2i and 2i + 1 in its low and high nibble); for 8
 * bits as it is. xs: the sum of each group. */
static __thread float x_split[MAX_K], x_sums[MAX_K / 32];

__attribute__((target("avx2,fma")))
static float sum8(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

__attribute__((target("avx2,fma")))
static void rows4_avx2(const packed_t *e, int r0, int r1, const float *xe, const float *xs,
                       float *y, float alpha, float beta) {
    const int k = e->k, G = k / e->group, runs = e->group / 32;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int r = r0; r < r1; r++) {
        const uint8_t *c = e->codes + (size_t)r * (k / 2);
        const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
        __m256 acc = _mm256_setzero_ps();
        float bias = 0.0f;
        for (int g = 0; g < G; g++) {
            __m256 t = _mm256_setzero_ps();
            for (int u = 0; u < runs; u++) {
                int at = g * runs + u;
                __m128i by = _mm_loadu_si128((const __m128i *)(c + at * 16));
                __m128i lo = _mm_and_si128(by, m4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(by, 4), m4);
                const float *x = xe + at * 32;
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                                    _mm256_loadu_ps(x), t);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                        _mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), t);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                                    _mm256_loadu_ps(x + 16), t);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                        _mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), t);
            }
            acc = _mm256_fmadd_ps(t, _mm256_set1_ps(s[g]), acc);
            bias += b[g] * xs[g];
        }
        float v = alpha * (sum8(acc) + bias);
        y[r] = beta == 0.0f ? v : v + beta * y[r];
    }
}

__attribute__((target("avx2,fma")))
static void rows8_avx2(const packed_t *e, int r0, int r1, const float *x, const float *xs,
                       float *y, float alpha, float beta) {
    const int k = e->k, G = k / e->group, runs = e->group / 16;
    for (int r = r0; r < r1; r++) {
        const uint8_t *c = e->codes + (size_t)r * k;
        const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
        __m256 acc = _mm256_setzero_ps();
        float bias = 0.0f;
        for (int g = 0; g < G; g++) {
            __m256 t = _mm256_setzero_ps();
            for (int u = 0; u < runs; u++) {
                int at = (g * runs + u) * 16;
                __m128i by = _mm_loadu_si128((const __m128i *)(c + at));
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(by)),
                                    _mm256_loadu_ps(x + at), t);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                        _mm_srli_si128(by, 8))), _mm256_loadu_ps(x + at + 8), t);
            }
            acc = _mm256_fmadd_ps(t, _mm256_set1_ps(s[g]), acc);
            bias += b[g] * xs[g];
        }
        float v = alpha * (sum8(acc) + bias);
        y[r] = beta == 0.0f ? v : v + beta * y[r];
    }
}

__attribute__((target("avx512f,avx512bw")))
static void rows4_avx512(const packed_t *e, int r0, int r1, const float *xe,
                         const float *xs, float *y, float alpha, float beta) {
    const int k = e->k, G = k / e->group, runs = e->group / 32;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int r = r0; r < r1; r++) {
        const uint8_t *c = e->codes + (size_t)r * (k / 2);
        const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
        __m512 acc = _mm512_setzero_ps();
        float bias = 0.0f;
        for (int g = 0; g < G; g++) {
            __m512 t = _mm512_setzero_ps();
            for (int u = 0; u < runs; u++) {
                int at = g * runs + u;
                __m128i by = _mm_loadu_si128((const __m128i *)(c + at * 16));
                __m128i lo = _mm_and_si128(by, m4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(by, 4), m4);
                const float *x = xe + at * 32;
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)),
                                    _mm512_loadu_ps(x), t);
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)),
                                    _mm512_loadu_ps(x + 16), t);
            }
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[g]), acc);
            bias += b[g] * xs[g];
        }
        float v = alpha * (_mm512_reduce_add_ps(acc) + bias);
        y[r] = beta == 0.0f ? v : v + beta * y[r];
    }
}

__attribute__((target("avx512f,avx512bw")))
static void rows8_avx512(const packed_t *e, int r0, int r1, const float *x, const float *xs,
                         float *y, float alpha, float beta) {
    const int k = e->k, G = k / e->group, runs = e->group / 16;
    for (int r = r0; r < r1; r++) {
        const uint8_t *c = e->codes + (size_t)r * k;
        const float *s = e->scales + (size_t)r * G, *b = e->biases + (size_t)r * G;
        __m512 acc = _mm512_setzero_ps();
        float bias = 0.0f;
        for (int g = 0; g < G; g++) {
            __m512 t = _mm512_setzero_ps();
            for (int u = 0; u < runs; u++) {
                int at = (g * runs + u) * 16;
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                        _mm_loadu_si128((const __m128i *)(c + at)))),
                                    _mm512_loadu_ps(x + at), t);
            }
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[g]), acc);
            bias += b[g] * xs[g];
        }
        float v = alpha * (_mm512_reduce_add_ps(acc) + bias);
        y[r] = beta == 0.0f ? v : v + beta * y[r];
    }
}

static void choose_kernels(void) {
    /* STRATA_MATVEC_ISA=avx2 or =none narrows the choice (the tests run each kernel) */
    const char *isa = getenv("STRATA_MATVEC_ISA");
    int wide = isa == NULL || strcmp(isa, "avx2") != 0;
    if (isa != NULL && strcmp(isa, "none") == 0)
        return;
    __builtin_cpu_init();
    if (wide && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        rows4 = rows4_avx512;
        rows8 = rows8_avx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        rows4 = rows4_avx2;
        rows8 = rows8_avx2;
    }
}

static void run_packed(const packed_t *e, const float *a, int inc_a, float alpha, float beta,
                       float *c) {
    const int k = e->k;
    const float *x = a;
    if (e->bits == 4 || inc_a != 1) {
        for (int run = 0; run < k / 32; run++)
            for (int i = 0; i < 16; i++) {
                float ev = a[(size_t)(run * 32 + 2 * i) * inc_a];
                float od = a[(size_t)(run * 32 + 2 * i + 1) * inc_a];
                if (e->bits == 4) {
                    x_split[run * 32 + i] = ev;
                    x_split[run * 32 + 16 + i] = od;
                } else {
                    x_split[run * 32 + 2 * i] = ev;
                    x_split[run * 32 + 2 * i + 1] = od;
                }
            }
        x = x_split;
    }
    for (int g = 0; g < k / e->group; g++) {
        float sum = 0.0f;
        for (int i = 0; i < e->group; i++)
            sum += x[g * e->group + i];  /* a group's elements in any order: it is a sum */
        x_sums[g] = sum;
    }
    (e->bits == 4 ? rows4 : rows8)(e, 0, e->n, x, x_sums, c, alpha, beta);
}
#else
static void choose_kernels(void) {}
static void run_packed(const packed_t *e, const float *a, int inc_a, float alpha, float beta,
                       float *c) {
    (void)e; (void)a; (void)inc_a; (void)alpha; (void)beta; (void)c;
}
#endif

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && m == 1 && n > 0 && k > 0 && real_sgemv != NULL) {
        /* C's one row = alpha op(B)^T a + beta C: a is A's row (or column, transposed). */
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == TRANS) {  /* nn.Linear's x @ w.T: w may be a packed weight */
            pthread_rwlock_rdlock(&lock);
            const packed_t *e = live ? find(b, n, k, ldb) : NULL;
            if (e != NULL) {
                run_packed(e, a, inc_a, alpha, beta, c);
                pthread_rwlock_unlock(&lock);
                __atomic_add_fetch(&as_packed, 1, __ATOMIC_RELAXED);
                return;
            }
            pthread_rwlock_unlock(&lock);
        }
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
