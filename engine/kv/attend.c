/* Exact attention of a decode step over float32 KV pages, for x86-64 with AVX-512.

Contract: strata_dense_pages(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi,
m_out, l_out, o_out) computes what engine.kv.cpu_kernels.dense_pages documents: the softmax
partial (running max m (H, R), sum l (H, R), unnormalised output o (H, R, dv)) of the scaled
queries q (H, R, dim) over pages [lo, hi) of k and v, where key t of page n, head h starts at
k + n * kn + h * kh + t * dim (values alike with vn, vh, dv): each page's rows contiguous.
It returns 1 when done and 0, touching nothing, where it does not take the case (no AVX-512,
rows past MAX_ROWS, dim or dv not a multiple of 64 up to MAX_DIM, size not a multiple of 4
up to MAX_SIZE): the caller's loops run then. exp is Cephes' expf polynomial, as the numba
loops' (relative error ~1e-7; arguments clamped to [-87, 88]).

Why: a decode step at 16k keys reads 755 MB of K and V (the starter); the numba loops
reached ~18 GB/s a core, what these cores stream is ~34. Here a page is read once, pages in
memory order (page outer, head inner), the scores of 4 query rows and 4 keys per pass in 16
registers, and each row's weighted value sums in registers across the page's keys.
A call allocates a page's scores and frees them; nothing is kept, so threads may call it at
once on disjoint outputs.
*/

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define RB 4          /* query rows a block */
#define MAX_ROWS 32
#define MAX_DIM 256
#define MAX_SIZE 512  /* tokens a page */
#define MAX_HEADS 64
#ifndef HINT
#define HINT _MM_HINT_T0
#endif

static int avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return known;
}

__attribute__((target("avx512f"), always_inline)) static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f),
                                                    _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

/* The four horizontal sums of a, b, c, d, in that order. */
__attribute__((target("avx512f"), always_inline)) static inline __m128 sum4(
        __m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: ab = (a0+a2, b0+b2, a1+a3, b1+b3), cd alike; shuffle 0x44 takes
       ab's and cd's elements 0, 1 and 0xEE their 2, 3: their sum is the lane's (a, b, c, d) */
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of nr (<= RB) query rows qb (nr x dim, contiguous) against a page's keys into p
   (nr x size); `ahead`: the next keys to prefetch, spread over these (NULL: none). Inlined
   with nr constant (the `_n` wrappers), so the accumulators stay in registers. */
__attribute__((target("avx512f"), always_inline)) static inline void scores_n(
        const float *qb, const float *keys, int dim, int size, float *p, const char *ahead,
        const int nr) {
    for (int t = 0; t < size; t += 4) {
        if (ahead != NULL)  /* 4 keys' lines of the next page a pass over 4 keys */
            for (int b = 0; b < 16 * dim; b += 64)
                _mm_prefetch(ahead + (size_t)t * dim * 4 + b, HINT);
        __m512 acc[RB][4];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        const float *k0 = keys + (size_t)t * dim;
        for (int c = 0; c < dim; c += 16) {
            __m512 kv[4];
            for (int j = 0; j < 4; j++) kv[j] = _mm512_loadu_ps(k0 + (size_t)j * dim + c);
            for (int r = 0; r < nr; r++) {
                __m512 qv = _mm512_loadu_ps(qb + (size_t)r * dim + c);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(qv, kv[j], acc[r][j]);
            }
        }
        for (int r = 0; r < nr; r++)
            _mm_storeu_ps(p + (size_t)r * size + t,
                          sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
}

/* Row `p` (size scores) to weights against the running max *m, sum *l and output row o (dv):
   the online softmax's rescale where the page's max passes *m. */
__attribute__((target("avx512f"))) static void weights(float *p, int size, float *m, float *l,
                                                       float *o, int dv) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t + 16 <= size; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(p + t));
    float big = _mm512_reduce_max_ps(top);
    for (int t = size - size % 16; t < size; t++) big = p[t] > big ? p[t] : big;
    if (big > *m) {
        float c = expf(*m - big);
        *l *= c;
        for (int j = 0; j < dv; j++) o[j] *= c;
        *m = big;
    }
    __m512 mm = _mm512_set1_ps(*m), sum = _mm512_setzero_ps();
    int t = 0;
    for (; t + 16 <= size; t += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t), mm));
        _mm512_storeu_ps(p + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    float s = _mm512_reduce_add_ps(sum);
    if (t < size) {  /* a page of 4 to 12 tokens more than a multiple of 16 */
        __mmask16 k = (__mmask16)((1u << (size - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), mm));
        _mm512_mask_storeu_ps(p + t, k, e);
        s += _mm512_mask_reduce_add_ps(k, e);
    }
    *l += s;
}

/* o (nr x dv) += p (nr x size) @ vals (size x dv), 64 columns at a time in registers;
   `ahead`: the next values to prefetch (NULL: none). Inlined with nr constant. */
__attribute__((target("avx512f"), always_inline)) static inline void weigh_n(
        const float *p, const float *vals, int size, int dv, float *o, const char *ahead,
        const int nr) {
    if (ahead != NULL)  /* the next values, all at once */
        for (size_t b = 0; b < (size_t)size * dv * 4; b += 64)
            _mm_prefetch(ahead + b, HINT);
    for (int c = 0; c < dv; c += 64) {
        __m512 acc[RB][4];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm512_loadu_ps(o + (size_t)r * dv + c + 16 * j);
        for (int t = 0; t < size; t++) {
            const float *v0 = vals + (size_t)t * dv + c;
            __m512 vv[4];
            for (int j = 0; j < 4; j++) vv[j] = _mm512_loadu_ps(v0 + 16 * j);
            for (int r = 0; r < nr; r++) {
                __m512 w = _mm512_set1_ps(p[(size_t)r * size + t]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(w, vv[j], acc[r][j]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++)
                _mm512_storeu_ps(o + (size_t)r * dv + c + 16 * j, acc[r][j]);
    }
}

/* One block of nr query rows against one page: scores, weights, weighted values. */
#define BLOCK(nr)                                                                            \
    __attribute__((target("avx512f"))) static void block##nr(                               \
            const float *qb, const float *keys, const float *vals, int dim, int size, int dv,  \
            float *m, float *l, float *o, float *p, const char *nk, const char *nv) {          \
        scores_n(qb, keys, dim, size, p, nk, nr);                                            \
        for (int r = 0; r < nr; r++)                                                         \
            weights(p + (size_t)r * size, size, m + r, l + r, o + (size_t)r * dv, dv);       \
        weigh_n(p, vals, size, dv, o, nv, nr);                                               \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

__attribute__((target("avx512f"))) static void run(
        const float *q, int heads, int rows, int dim, const float *k, long kn, long kh,
        const float *v, long vn, long vh, int size, int dv, int lo, int hi, float *m,
        float *l, float *o, float *p) {
    for (size_t i = 0; i < (size_t)heads * rows; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)heads * rows * dv);
    for (int n = lo; n < hi; n++) {  /* pages in memory order: each page's heads in turn */
        for (int h = 0; h < heads; h++) {
            const float *keys = k + n * kn + h * kh;
            const float *vals = v + n * vn + h * vh;
            /* the (page, head) read next, prefetched while this one is attended */
            int nn = h + 1 < heads ? n : n + 1, nh = h + 1 < heads ? h + 1 : 0;
            const char *nk = nn < hi ? (const char *)(k + nn * kn + nh * kh) : NULL;
            const char *nv = nn < hi ? (const char *)(v + nn * vn + nh * vh) : NULL;
            for (int b = 0; b < rows; b += RB) {
                size_t row = (size_t)h * rows + b;
                const float *qb = q + row * dim;
                float *mb = m + row, *lb = l + row, *ob = o + row * dv;
                switch (rows - b < RB ? rows - b : RB) {
                    case 1: block1(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv); break;
                    case 2: block2(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv); break;
                    case 3: block3(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv); break;
                    default: block4(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv);
                }
                nk = nv = NULL;  /* prefetched once a page */
            }
        }
    }
}

static int takes(int heads, int rows, int dim, int size, int dv, int lo, int hi) {
    return avx512() && heads >= 1 && heads <= MAX_HEADS && rows >= 1 && rows <= MAX_ROWS
           && dim >= 64 && dim <= MAX_DIM && dim % 64 == 0 && dv >= 64 && dv <= MAX_DIM
           && dv % 64 == 0 && size >= 4 && size <= MAX_SIZE && size % 4 == 0 && lo >= 0
           && hi > lo;
}

/* Pages [lo, hi) into m, l, o on this thread; 0 where the scores' scratch is not had. */
static int alone(const float *q, int heads, int rows, int dim, const float *k, long kn,
                 long kh, const float *v, long vn, long vh, int size, int dv, int lo, int hi,
                 float *m, float *l, float *o) {
    float *p = malloc(sizeof(float) * RB * (size_t)size);
    if (p == NULL)
        return 0;
    run(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi, m, l, o, p);
    free(p);
    return 1;
}

int strata_dense_pages(const float *q, int heads, int rows, int dim, const float *k, long kn,
                       long kh, const float *v, long vn, long vh, int size, int dv, int lo,
                       int hi, float *m_out, float *l_out, float *o_out) {
    if (!takes(heads, rows, dim, size, dv, lo, hi))
        return 0;
    return alone(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi, m_out, l_out,
                 o_out);
}

/* The same over several threads: this one and up to MAX_THREADS - 1 workers of its own,
   started on first use and woken per call (a condition variable: ~10 us, where Python's
   pool and its futures cost 40-200 us a layer). The pages are cut into PIECES per thread,
   taken in turn (a worker that starts late takes fewer, or none, and is not waited for);
   each piece's partial is kept apart and they are merged in page order, so a call's result
   does not depend on which thread took which piece. One call at a time uses the workers:
   a call that finds them busy runs alone. */
#define MAX_THREADS 16
#define PIECES 4
#define MAX_PIECES (PIECES * MAX_THREADS)

static struct {
    const float *q, *k, *v;
    int heads, rows, dim, size, dv, lo, pieces, span;
    long kn, kh, vn, vh;
    float *m, *l, *o;  /* per piece: heads x rows, heads x rows, heads x rows x dv */
    _Atomic int failed;
} job;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t gate = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static unsigned long long generation;  /* under gate */
static _Atomic unsigned long long turn;  /* generation << 32 | next piece */
static _Atomic int finished;
static int workers;  /* under busy */

/* The piece's pages: [lo + span * i / pieces, lo + span * (i + 1) / pieces). */
static void piece(int i) {
    int a = job.lo + (int)((long)job.span * i / job.pieces);
    int b = job.lo + (int)((long)job.span * (i + 1) / job.pieces);
    size_t hr = (size_t)job.heads * job.rows;
    if (!alone(job.q, job.heads, job.rows, job.dim, job.k, job.kn, job.kh, job.v, job.vn,
               job.vh, job.size, job.dv, a, b, job.m + hr * i, job.l + hr * i,
               job.o + hr * job.dv * i))
        job.failed = 1;
}

/* Take pieces of generation g's job until none is left (or another job has begun). */
static void take(unsigned long long g) {
    for (;;) {
        unsigned long long t = atomic_load(&turn);
        if (t >> 32 != (g & 0xffffffffULL) || (int)(t & 0xffffffffULL) >= job.pieces)
            return;
        if (atomic_compare_exchange_weak(&turn, &t, t + 1)) {
            piece((int)(t & 0xffffffffULL));
            atomic_fetch_add(&finished, 1);
        }
    }
}

static void *worker(void *unused) {
    (void)unused;
    pthread_mutex_lock(&gate);
    unsigned long long seen = generation;
    for (;;) {
        while (generation == seen)
            pthread_cond_wait(&wake, &gate);
        seen = generation;
        pthread_mutex_unlock(&gate);
        take(seen);
        pthread_mutex_lock(&gate);
    }
    return NULL;
}

int strata_dense_pages_threads(const float *q, int heads, int rows, int dim, const float *k,
                               long kn, long kh, const float *v, long vn, long vh, int size,
                               int dv, int lo, int hi, int threads, float *m_out,
                               float *l_out, float *o_out) {
    if (!takes(heads, rows, dim, size, dv, lo, hi))
        return 0;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (threads == 1 || hi - lo < 2 || pthread_mutex_trylock(&busy) != 0)
        return alone(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi, m_out,
                     l_out, o_out);
    while (workers < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0)
            break;
        pthread_detach(t);
        workers++;
    }
    int pieces = PIECES * threads < hi - lo ? PIECES * threads : hi - lo;
    size_t hr = (size_t)heads * rows;
    float *part = malloc(sizeof(float) * hr * (dv + 2) * pieces);
    if (part == NULL || workers == 0) {
        free(part);
        pthread_mutex_unlock(&busy);
        return alone(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi, m_out,
                     l_out, o_out);
    }
    job.q = q; job.k = k; job.v = v; job.heads = heads; job.rows = rows; job.dim = dim;
    job.size = size; job.dv = dv; job.lo = lo; job.span = hi - lo; job.pieces = pieces;
    job.kn = kn; job.kh = kh; job.vn = vn; job.vh = vh; job.failed = 0;
    job.m = part; job.l = part + hr * pieces; job.o = part + 2 * hr * pieces;
    atomic_store(&finished, 0);
    pthread_mutex_lock(&gate);
    unsigned long long g = ++generation;
    atomic_store(&turn, (g & 0xffffffffULL) << 32);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&gate);
    take(g);
    /* every piece is taken: wait for those still running on a worker */
    for (int spins = 0; atomic_load(&finished) < pieces; spins++) {
        if (spins < 2000)
            _mm_pause();
        else
            sched_yield();
    }
    int ok = !job.failed;
    for (size_t i = 0; ok && i < hr; i++) {  /* the pieces' partials, merged in page order */
        float top = -INFINITY;
        for (int j = 0; j < pieces; j++)
            top = job.m[hr * j + i] > top ? job.m[hr * j + i] : top;
        float total = 0.0f, *o = o_out + i * dv;
        memset(o, 0, sizeof(float) * (size_t)dv);
        for (int j = 0; j < pieces; j++) {
            float c = expf(job.m[hr * j + i] - top);
            total += job.l[hr * j + i] * c;
            const float *oj = job.o + (hr * j + i) * dv;
            for (int x = 0; x < dv; x++) o[x] += oj[x] * c;
        }
        m_out[i] = top;
        l_out[i] = total;
    }
    free(part);
    pthread_mutex_unlock(&busy);
    return ok;
}

int strata_dense_pages_avx512(void) {
    return avx512();
}
