/* Exact attention of a decode step over float32 KV pages, for x86-64 with AVX-512.

Contract: strata_dense_pages_threads(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo,
hi, tk, tkh, tv, tvh, tlen, causal, threads, m_out, l_out, o_out) computes what
engine.kv.cpu_native.dense_pages documents: the softmax partial (running max m (H, R), sum
l (H, R), unnormalised output o (H, R, dv)) of the scaled queries q (H, R, dim) over pages
[lo, hi) of k and v, where key t of page n, head h starts at k + n * kn + h * kh + t * dim
(values alike with vn, vh, dv: each page's rows contiguous), then over a tail of tlen keys a
head (head h's at tk + h * tkh, values at tv + h * tvh) whose last `causal` are the queries'
own tokens, on up to `threads` threads. It returns 1 when done and 0 where it does not take
the case (no AVX-512, rows past MAX_ROWS, dim or dv not a multiple of 64 up to MAX_DIM, size
not a multiple of 4 up to MAX_SIZE, a tail past MAX_SIZE or shorter than `causal`): the
caller's loops run then. exp is Cephes' expf polynomial, as the numba loops' (relative error
~1e-7; arguments clamped to [-87, 88]). strata_dense_pages_avx512() says whether it can run.

Why: a decode step at 16k keys reads 755 MB of K and V (the starter); the numba loops
reached ~18 GB/s a core, what these cores stream is ~34. Here a page is read once, pages in
memory order (page outer, head inner), the scores of 4 query rows and 4 keys per pass in 16
registers, and each row's weighted value sums in registers across the page's keys.
*/

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define RB 4          /* query rows a block */
#define MAX_ROWS 32   /* these three: engine.kv.cpu_native.fits mirrors them */
#define MAX_DIM 256
#define MAX_SIZE 512  /* tokens a page */
#define MAX_HEADS 64
#define HINT _MM_HINT_T0  /* into L1: T1 (L2) read slower here */

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

/* Scores of nr (<= RB) query rows qb (nr x dim, contiguous) against `size` keys into p
   (row r at p + r * stride); `ahead`: the next keys to prefetch, spread over these (NULL:
   none). Keys past a multiple of 4 (a tail's) one at a time. Inlined with nr constant (the
   BLOCK functions), so the accumulators stay in registers. */
__attribute__((target("avx512f"), always_inline)) static inline void scores_n(
        const float *qb, const float *keys, int dim, int size, int stride, float *p,
        const char *ahead, const int nr) {
    int t = 0;
    for (; t + 4 <= size; t += 4) {
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
            _mm_storeu_ps(p + (size_t)r * stride + t,
                          sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
    for (; t < size; t++) {
        const float *k0 = keys + (size_t)t * dim;
        for (int r = 0; r < nr; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < dim; c += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qb + (size_t)r * dim + c),
                                      _mm512_loadu_ps(k0 + c), acc);
            p[(size_t)r * stride + t] = _mm512_reduce_add_ps(acc);
        }
    }
}

/* Row `p` (size scores) to weights against the running max *m, sum *l and output row o (dv):
   the online softmax's rescale where the row's max passes *m. */
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
    if (t < size) {  /* the last 1 to 15 */
        __mmask16 k = (__mmask16)((1u << (size - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), mm));
        _mm512_mask_storeu_ps(p + t, k, e);
        s += _mm512_mask_reduce_add_ps(k, e);
    }
    *l += s;
}

/* o (nr x dv) += p (nr x size, rows `stride` apart) @ vals (size x dv), 64 columns at a time
   in registers; `ahead`: the next values to prefetch (NULL: none). Inlined with nr
   constant. */
__attribute__((target("avx512f"), always_inline)) static inline void weigh_n(
        const float *p, const float *vals, int size, int stride, int dv, float *o,
        const char *ahead, const int nr) {
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
                __m512 w = _mm512_set1_ps(p[(size_t)r * stride + t]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(w, vv[j], acc[r][j]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++)
                _mm512_storeu_ps(o + (size_t)r * dv + c + 16 * j, acc[r][j]);
    }
}

/* One block of nr query rows (rows first..first + nr of their head) against `size` keys and
   values: scores, weights, weighted values. causal > 1: the keys end with the queries' own
   `causal` tokens, rows rep-major (row i is token i % causal), and a row sees none after its
   own (-inf, whose weight is ~1e-38: no sum here tells it from 0). */
#define BLOCK(nr)                                                                            \
    __attribute__((target("avx512f"))) static void block##nr(                               \
            const float *qb, const float *keys, const float *vals, int dim, int size, int dv, \
            float *m, float *l, float *o, float *p, const char *nk, const char *nv,          \
            int first, int causal) {                                                         \
        scores_n(qb, keys, dim, size, size, p, nk, nr);                                      \
        for (int r = 0; r < nr; r++) {                                                       \
            if (causal > 1)                                                                  \
                for (int t = size - causal + (first + r) % causal + 1; t < size; t++)        \
                    p[(size_t)r * size + t] = -INFINITY;                                     \
            weights(p + (size_t)r * size, size, m + r, l + r, o + (size_t)r * dv, dv);       \
        }                                                                                    \
        weigh_n(p, vals, size, size, dv, o, nv, nr);                                         \
    }
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

/* Every head's rows, in blocks, against one page (or the tail) of `size` keys per head. */
__attribute__((target("avx512f"))) static void span(
        const float *q, int heads, int rows, int dim, const float *k, long kh, const float *v,
        long vh, int size, int dv, float *m, float *l, float *o, float *p, const float *next_k,
        const float *next_v, int causal) {
    for (int h = 0; h < heads; h++) {
        const float *keys = k + h * kh, *vals = v + h * vh;
        /* the (page, head) read next, prefetched while this one is attended */
        const char *nk = (const char *)(h + 1 < heads ? keys + kh : next_k);
        const char *nv = (const char *)(h + 1 < heads ? vals + vh : next_v);
        for (int b = 0; b < rows; b += RB) {
            size_t row = (size_t)h * rows + b;
            const float *qb = q + row * dim;
            float *mb = m + row, *lb = l + row, *ob = o + row * dv;
            switch (rows - b < RB ? rows - b : RB) {
                case 1: block1(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv, b, causal);
                        break;
                case 2: block2(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv, b, causal);
                        break;
                case 3: block3(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv, b, causal);
                        break;
                default: block4(qb, keys, vals, dim, size, dv, mb, lb, ob, p, nk, nv, b,
                                causal);
            }
            nk = nv = NULL;  /* prefetched once a page */
        }
    }
}

/* What a call attends: pages [lo, hi) of k, v and, where tlen > 0, a tail of tlen keys per
   head (head h's at tk + h * tkh, values at tv + h * tvh) ending with `causal` query
   tokens. */
typedef struct {
    const float *q, *k, *v, *tk, *tv;
    int heads, rows, dim, size, dv, lo, hi, tlen, causal;
    long kn, kh, vn, vh, tkh, tvh;
} work_t;

static int takes(const work_t *w) {
    return avx512() && w->heads >= 1 && w->heads <= MAX_HEADS && w->rows >= 1
           && w->rows <= MAX_ROWS && w->dim >= 64 && w->dim <= MAX_DIM && w->dim % 64 == 0
           && w->dv >= 64 && w->dv <= MAX_DIM && w->dv % 64 == 0 && w->size >= 4
           && w->size <= MAX_SIZE && w->size % 4 == 0 && w->lo >= 0 && w->hi >= w->lo
           && w->tlen >= 0 && w->tlen <= MAX_SIZE && (w->hi > w->lo || w->tlen > 0)
           && w->causal >= 1 && (w->causal == 1 || (w->rows % w->causal == 0
                                                    && w->causal <= w->tlen));
}

/* Pages [lo, hi), then the tail when `tail`, into m, l, o (which start the softmax here) on
   this thread; 0 where the scores' scratch is not had. */
static int alone(const work_t *w, int lo, int hi, int tail, float *m, float *l, float *o) {
    int most = w->size > w->tlen ? w->size : w->tlen;
    float *p = malloc(sizeof(float) * RB * (size_t)most);
    if (p == NULL)
        return 0;
    for (size_t i = 0; i < (size_t)w->heads * w->rows; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)w->heads * w->rows * w->dv);
    for (int n = lo; n < hi; n++) {  /* pages in memory order: each page's heads in turn */
        const float *nk = n + 1 < hi ? w->k + (n + 1) * w->kn : NULL;
        const float *nv = n + 1 < hi ? w->v + (n + 1) * w->vn : NULL;
        span(w->q, w->heads, w->rows, w->dim, w->k + n * w->kn, w->kh, w->v + n * w->vn,
             w->vh, w->size, w->dv, m, l, o, p, nk, nv, 1);
    }
    if (tail)
        span(w->q, w->heads, w->rows, w->dim, w->tk, w->tkh, w->tv, w->tvh, w->tlen, w->dv,
             m, l, o, p, NULL, NULL, w->causal);
    free(p);
    return 1;
}

static work_t make(const float *q, int heads, int rows, int dim, const float *k, long kn,
                   long kh, const float *v, long vn, long vh, int size, int dv, int lo, int hi,
                   const float *tk, long tkh, const float *tv, long tvh, int tlen, int causal) {
    work_t w = {q, k, v, tk, tv, heads, rows, dim, size, dv, lo, hi, tlen, causal,
                kn, kh, vn, vh, tkh, tvh};
    return w;
}

/* Over several threads: this one and up to MAX_THREADS - 1 workers of its own,
   started on first use and woken per call (a condition variable: ~10 us, where Python's
   pool and its futures cost 40-200 us a layer). The pages are cut into PIECES per thread
   (the tail one more), taken in turn (a worker that starts late takes fewer, or none, and is
   not waited for); each piece's partial is kept apart and they are merged in order, so a
   call's result does not depend on which thread took which piece. One call at a time uses
   the workers: a call that finds them busy runs alone. */
#define MAX_THREADS 16
#define PIECES 4

static struct {
    work_t w;
    int pieces, cut;  /* pieces in all; the first `cut` are pages, then the tail */
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

/* Piece i: pages [lo + span * i / cut, lo + span * (i + 1) / cut), or the tail. */
static void piece(int i) {
    const work_t *w = &job.w;
    size_t hr = (size_t)w->heads * w->rows;
    int n = w->hi - w->lo, tail = i == job.cut;
    int a = tail ? 0 : w->lo + (int)((long)n * i / job.cut);
    int b = tail ? 0 : w->lo + (int)((long)n * (i + 1) / job.cut);
    if (!alone(w, a, b, tail, job.m + hr * i, job.l + hr * i, job.o + hr * w->dv * i))
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
                               int dv, int lo, int hi, const float *tk, long tkh,
                               const float *tv, long tvh, int tlen, int causal, int threads,
                               float *m_out, float *l_out, float *o_out) {
    work_t w = make(q, heads, rows, dim, k, kn, kh, v, vn, vh, size, dv, lo, hi, tk, tkh, tv,
                    tvh, tlen, causal);
    if (!takes(&w))
        return 0;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    int cut = PIECES * threads < hi - lo ? PIECES * threads : hi - lo;
    int pieces = cut + (tlen > 0);
    if (threads == 1 || pieces < 2 || pthread_mutex_trylock(&busy) != 0)
        return alone(&w, lo, hi, tlen > 0, m_out, l_out, o_out);
    while (workers < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0)
            break;
        pthread_detach(t);
        workers++;
    }
    size_t hr = (size_t)heads * rows;
    float *part = malloc(sizeof(float) * hr * (dv + 2) * pieces);
    if (part == NULL || workers == 0) {
        free(part);
        pthread_mutex_unlock(&busy);
        return alone(&w, lo, hi, tlen > 0, m_out, l_out, o_out);
    }
    job.w = w;
    job.pieces = pieces;
    job.cut = cut;
    job.failed = 0;
    job.m = part;
    job.l = part + hr * pieces;
    job.o = part + 2 * hr * pieces;
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
    for (size_t i = 0; ok && i < hr; i++) {  /* the pieces' partials, merged in order */
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
