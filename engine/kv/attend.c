/* A decode step's attention over float32 KV pages, for x86-64 with AVX-512: the exact pass
(strata_dense_pages_threads, here), and the sparse step's block choice (strata_choose) and
its attention over the chosen blocks (strata_attend_chosen), further down with their own
contracts; all three share one pool of worker threads (run_pieces).

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
#include <stdint.h>
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

/* Work in pieces over several threads: this one and up to MAX_THREADS - 1 workers of its
   own, started on first use. A worker that finished a job spins for the next one a while
   (SPIN pauses, ~20-40 us: a sparse step's phases follow each other within microseconds),
   then sleeps on a condition variable (a wake costs ~10 us, where Python's pool and its
   futures cost 40-200 us a layer). Pieces are taken in turn (a worker that starts late takes
   fewer, or none, and is not waited for). One job at a time uses the workers: a call that
   finds them busy runs its pieces on its own thread, in order. Callers keep each piece's
   result apart and merge them in order, so a result does not depend on which thread took
   which piece. */
#define MAX_THREADS 16
#define PIECES 4
#define SPIN 1000

typedef void (*task_fn)(void *ctx, int i);
static struct {
    task_fn fn;
    void *ctx;
    int pieces;
} job;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t gate = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static _Atomic unsigned long long generation;  /* written under gate */
static int sleeping;  /* under gate */
static _Atomic unsigned long long turn;  /* generation << 32 | next piece */
static _Atomic int finished;
static int workers;  /* under busy */

/* Take pieces of generation g's job until none is left (or another job has begun). */
static void take(unsigned long long g) {
    for (;;) {
        unsigned long long t = atomic_load(&turn);
        if (t >> 32 != (g & 0xffffffffULL) || (int)(t & 0xffffffffULL) >= job.pieces)
            return;
        if (atomic_compare_exchange_weak(&turn, &t, t + 1)) {
            job.fn(job.ctx, (int)(t & 0xffffffffULL));
            atomic_fetch_add(&finished, 1);
        }
    }
}

static void *worker(void *unused) {
    (void)unused;
    unsigned long long seen = atomic_load(&generation);
    for (;;) {
        for (int i = 0; i < SPIN && atomic_load(&generation) == seen; i++)
            _mm_pause();
        if (atomic_load(&generation) == seen) {
            pthread_mutex_lock(&gate);
            sleeping++;
            while (atomic_load(&generation) == seen)
                pthread_cond_wait(&wake, &gate);
            sleeping--;
            pthread_mutex_unlock(&gate);
        }
        seen = atomic_load(&generation);
        take(seen);
    }
    return NULL;
}

/* fn(ctx, i) for i in [0, pieces) on up to `threads` threads; returns when all are done. */
static void run_pieces(task_fn fn, void *ctx, int pieces, int threads) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (threads == 1 || pieces < 2 || pthread_mutex_trylock(&busy) != 0) {
        for (int i = 0; i < pieces; i++) fn(ctx, i);
        return;
    }
    while (workers < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0)
            break;
        pthread_detach(t);
        workers++;
    }
    unsigned long long g = atomic_load(&generation) + 1;
    /* a worker still looking at the last job's turn sees another generation from here on,
       before the job's fields change under it */
    atomic_store(&turn, (g & 0xffffffffULL) << 32 | 0x7fffffffULL);
    job.fn = fn;
    job.ctx = ctx;
    job.pieces = pieces;
    atomic_store(&finished, 0);
    pthread_mutex_lock(&gate);
    atomic_store(&turn, (g & 0xffffffffULL) << 32);
    atomic_store(&generation, g);
    if (sleeping)
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
    pthread_mutex_unlock(&busy);
}

/* A dense call cut in pieces: the first `cut` are pages, then the tail; each piece's partial
   (m, l: heads x rows, o: heads x rows x dv) kept apart. */
typedef struct {
    work_t w;
    int cut;
    float *m, *l, *o;
    _Atomic int failed;
} dense_job_t;

/* Piece i: pages [lo + span * i / cut, lo + span * (i + 1) / cut), or the tail. */
static void dense_piece(void *ctx, int i) {
    dense_job_t *d = ctx;
    const work_t *w = &d->w;
    size_t hr = (size_t)w->heads * w->rows;
    int n = w->hi - w->lo, tail = i == d->cut;
    int a = tail ? 0 : w->lo + (int)((long)n * i / d->cut);
    int b = tail ? 0 : w->lo + (int)((long)n * (i + 1) / d->cut);
    if (!alone(w, a, b, tail, d->m + hr * i, d->l + hr * i, d->o + hr * w->dv * i))
        d->failed = 1;
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
    if (threads == 1 || pieces < 2)
        return alone(&w, lo, hi, tlen > 0, m_out, l_out, o_out);
    size_t hr = (size_t)heads * rows;
    float *part = malloc(sizeof(float) * hr * (dv + 2) * pieces);
    if (part == NULL)
        return alone(&w, lo, hi, tlen > 0, m_out, l_out, o_out);
    dense_job_t d;
    d.w = w;
    d.cut = cut;
    d.m = part;
    d.l = part + hr * pieces;
    d.o = part + 2 * hr * pieces;
    atomic_store(&d.failed, 0);
    run_pieces(dense_piece, &d, pieces, threads);
    int ok = !atomic_load(&d.failed);
    for (size_t i = 0; ok && i < hr; i++) {  /* the pieces' partials, merged in order */
        float top = -INFINITY;
        for (int j = 0; j < pieces; j++)
            top = d.m[hr * j + i] > top ? d.m[hr * j + i] : top;
        float total = 0.0f, *o = o_out + i * dv;
        memset(o, 0, sizeof(float) * (size_t)dv);
        for (int j = 0; j < pieces; j++) {
            float c = expf(d.m[hr * j + i] - top);
            total += d.l[hr * j + i] * c;
            const float *oj = d.o + (hr * j + i) * dv;
            for (int x = 0; x < dv; x++) o[x] += oj[x] * c;
        }
        m_out[i] = top;
        l_out[i] = total;
    }
    free(part);
    return ok;
}

int strata_dense_pages_avx512(void) {
    return avx512();
}

/* ---- A sparse decode step's block choice: strata_choose ----

Contract: strata_choose(...) computes what engine.kv.cpu_loops.choose computes (its
arguments, as cpu_kernels.choose checks them) into out (H, k): per KV head, the page bound
of pages [lo, lo + c) and the n_first best (every page when c <= 2 n_first), the block bound
of their blocks from float16 summaries, the voted blocks and those outside the read_pages
best pages dropped, the m best rescored by their true logits against the keys of pool pk and
the k best kept; candidates before E scored with the queries rotated back by their far
shift. Ties are broken as cpu_loops.top_k breaks them (by index), so the blocks and their
order are the loop's up to float rounding. Returns 0 where it does not take the case (no
AVX-512, D not a multiple of 16 up to MAX_DIM, more than MAX_ROWS rows, scratch not had).

Why: on the starter at 32k the numba loop took ~0.47 ms of each layer's decode step (14 ms
a step, one thread); here the float16 summaries are widened 16 at a time (vcvtph2ps) and
4 candidates' bounds share each load of the query rows. */

/* Candidates whose summaries, and rescored blocks whose keys, are asked for ahead: the step
   runs after MLX's products have evicted the caches, and they lie apart. */
#define BOUND_AHEAD 16
#define KEYS_AHEAD 8

typedef struct {  /* the far shift's angle tables (SPLIT x half each) */
    const float *cl, *sl, *ch, *sh;
    int half, split;
    long e, s0;
} far_t;

/* The query rows q (rows x dim) rotated by -d positions into out: q . R(d) k = R(-d) q . k,
   so a block whose keys are turned by d is scored against q turned back (the rows, not the
   block's keys, are rotated). RoPE's halves layout over the first 2 half dims. */
__attribute__((target("avx512f"))) static void turn_back(const far_t *f, long d,
                                                        const float *q, int rows, int dim,
                                                        float *out) {
    long a = d < 0 ? -d : d;
    long hi = a / f->split, lo = a % f->split;
    int half = f->half;
    const float *ch = f->ch + hi * half, *sh = f->sh + hi * half;
    const float *cl = f->cl + lo * half, *sl = f->sl + lo * half;
    float c[MAX_DIM / 2], s[MAX_DIM / 2];
    for (int i = 0; i < half; i++) {  /* angle sum: hi * split + lo; sin(-d) = -sin(d) */
        c[i] = ch[i] * cl[i] - sh[i] * sl[i];
        float si = sh[i] * cl[i] + ch[i] * sl[i];
        s[i] = d > 0 ? -si : si;
    }
    for (int r = 0; r < rows; r++) {
        const float *x = q + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        for (int i = 0; i < half; i++) {
            o[i] = x[i] * c[i] - x[i + half] * s[i];
            o[i + half] = x[i] * s[i] + x[i + half] * c[i];
        }
        for (int i = 2 * half; i < dim; i++)
            o[i] = x[i];
    }
}

/* The queries q (rows x dim) for candidates starting at token st: turned back by the far
   shift (E + S - st) into qq when st < E, else q itself. */
static const float *far_rows(const far_t *f, long st, const float *q, int rows, int dim,
                             float *qq) {
    if (st >= f->e)
        return q;
    turn_back(f, f->e + f->s0 - st, q, rows, dim, qq);
    return qq;
}

/* Ask for the `bytes` from p into the caches, a line at a time. */
static void ask(const void *p, size_t bytes) {
    for (size_t y = 0; y < bytes; y += 64)
        _mm_prefetch((const char *)p + y, HINT);
}

/* Ask for the angle table rows turn_back reads for d positions (a random row of 2 MB of
   tables per block otherwise missed the caches). */
static void turn_ahead(const far_t *f, long d) {
    d = d < 0 ? -d : d;
    long hi = d / f->split, lo = d % f->split;
    size_t bytes = (size_t)f->half * 4;
    ask(f->cl + lo * f->half, bytes);
    ask(f->sl + lo * f->half, bytes);
    ask(f->ch + hi * f->half, bytes);
    ask(f->sh + hi * f->half, bytes);
}

/* The same for far_rows at token st. */
static void far_ahead(const far_t *f, long st) {
    if (st < f->e)
        turn_ahead(f, f->e + f->s0 - st);
}

/* Column j of x (rows x n) to its logsumexp over rows into out[j] (-inf for an all -inf
   column), exp as attend's. */
__attribute__((target("avx512f"))) static void lse_cols(const float *x, int rows, int n,
                                                        float *out) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 top = _mm512_maskz_loadu_ps(k, x + j);
        for (int r = 1; r < rows; r++)
            top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(k, x + (size_t)r * n + j));
        float t[16], big[16], total[16];
        _mm512_storeu_ps(big, top);
        for (int u = 0; u < 16; u++)
            t[u] = isfinite(big[u]) ? big[u] : 0.0f;
        __m512 shift = _mm512_loadu_ps(t), sum = _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(k, x + (size_t)r * n + j), shift)));
        _mm512_storeu_ps(total, sum);
        for (int u = 0; u < 16 && j + u < n; u++)
            out[j + u] = big[u] > -INFINITY ? logf(total[u]) + t[u] : -INFINITY;
    }
}

/* 16 summary values at element `at` of a float16 (bits) or float32 array, as float32. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 wide16(
        const void *a, size_t at, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + at)))
                : _mm512_loadu_ps((const float *)a + at);
}

/* One head's bound of n candidates into out (n,): candidate j's summaries (dim values) at
   element off[j] of mn and mx (float16 bits when `half`, else float32); q (rows x dim), m
   (rows,); each run of `group` candidates scored with q turned by starts[that run's first]
   (far_rows). x: scratch of rows x n, qq, qp, qn: rows x dim. */
__attribute__((target("avx512f"))) static void bound_c(
        const void *mn, const void *mx, int half, const size_t *off, int n, const float *q,
        const float *m, int rows, int dim, const long *starts, int group, const far_t *f,
        float *out, float *x, float *qq, float *qp, float *qn) {
    for (int j0 = 0; j0 < n; j0 += group) {
        if (j0 + group < n)
            far_ahead(f, starts[j0 + group]);
        const float *qs = far_rows(f, starts[j0], q, rows, dim, qq);
        for (size_t i = 0; i < (size_t)rows * dim; i += 16) {
            __m512 v = _mm512_loadu_ps(qs + i), z = _mm512_setzero_ps();
            _mm512_storeu_ps(qp + i, _mm512_max_ps(v, z));
            _mm512_storeu_ps(qn + i, _mm512_min_ps(v, z));
        }
        int j1 = j0 + group < n ? j0 + group : n;
        for (int j = j0; j < j1; j += 4) {
            int w = j1 - j < 4 ? j1 - j : 4;
            size_t width = half ? 2 : 4;
            for (int u = j + BOUND_AHEAD; u < j + BOUND_AHEAD + 4 && u < n; u++) {
                ask((const char *)mn + off[u] * width, (size_t)dim * width);
                ask((const char *)mx + off[u] * width, (size_t)dim * width);
            }
            size_t o[4];
            for (int u = 0; u < 4; u++) o[u] = off[j + (u < w ? u : 0)];
            for (int r0 = 0; r0 < rows; r0 += RB) {
                int nr = rows - r0 < RB ? rows - r0 : RB;
                __m512 acc[RB][4];
                for (int r = 0; r < RB; r++)
                    for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
                for (int c = 0; c < dim; c += 16) {
                    __m512 hs[4], ls[4];
                    for (int u = 0; u < 4; u++) {
                        hs[u] = wide16(mx, o[u] + c, half);
                        ls[u] = wide16(mn, o[u] + c, half);
                    }
                    for (int r = 0; r < nr; r++) {
                        __m512 up = _mm512_loadu_ps(qp + (size_t)(r0 + r) * dim + c);
                        __m512 dn = _mm512_loadu_ps(qn + (size_t)(r0 + r) * dim + c);
                        for (int u = 0; u < 4; u++)
                            acc[r][u] = _mm512_fmadd_ps(dn, ls[u],
                                                        _mm512_fmadd_ps(up, hs[u], acc[r][u]));
                    }
                }
                for (int r = 0; r < nr; r++) {
                    float v[4];
                    _mm_storeu_ps(v, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
                    for (int u = 0; u < w; u++)
                        x[(size_t)(r0 + r) * n + j + u] = v[u] - m[r0 + r];
                }
            }
        }
    }
    lse_cols(x, rows, n, out);
}

/* The value at ascending rank `rank` of a[0..n) (moved around): three-way quickselect, so
   runs of equal values (-inf) cost one pass. */
static float nth(float *a, int n, int rank) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float p = a[lo + (hi - lo) / 2];
        int lt = lo, i = lo, gt = hi;
        while (i <= gt) {
            if (a[i] < p) { float t = a[lt]; a[lt++] = a[i]; a[i++] = t; }
            else if (a[i] > p) { float t = a[gt]; a[gt--] = a[i]; a[i] = t; }
            else i++;
        }
        if (rank < lt) hi = lt - 1;
        else if (rank > gt) lo = gt + 1;
        else return p;
    }
    return a[lo];
}

/* cpu_loops.top_k: the indices of the k largest of x (n,) into idx, those above the k-th
   largest first, then its equals, each in index order. tmp: scratch (n,). */
static void top_k(const float *x, int n, int k, long *idx, float *tmp) {
    if (k >= n) {
        for (int i = 0; i < n; i++) idx[i] = i;
        return;
    }
    memcpy(tmp, x, sizeof(float) * (size_t)n);
    float thr = nth(tmp, n, n - k);
    int j = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > thr) idx[j++] = i;
    for (int i = 0; i < n && j < k; i++)
        if (x[i] == thr) idx[j++] = i;
}

/* The largest q.k of each of `rows` rows over a block's b keys (contiguous rows of dim)
   into best (rows,); p: scratch of RB x b. */
__attribute__((target("avx512f"))) static void block_max(const float *q, int rows, int dim,
                                                         const float *keys, int b,
                                                         float *best, float *p) {
    for (int r0 = 0; r0 < rows; r0 += RB) {
        int nr = rows - r0 < RB ? rows - r0 : RB;
        const float *qb = q + (size_t)r0 * dim;
        switch (nr) {
            case 1: scores_n(qb, keys, dim, b, b, p, NULL, 1); break;
            case 2: scores_n(qb, keys, dim, b, b, p, NULL, 2); break;
            case 3: scores_n(qb, keys, dim, b, b, p, NULL, 3); break;
            default: scores_n(qb, keys, dim, b, b, p, NULL, 4);
        }
        for (int r = 0; r < nr; r++) {
            float big = p[(size_t)r * b];
            for (int t = 1; t < b; t++)
                big = p[(size_t)r * b + t] > big ? p[(size_t)r * b + t] : big;
            best[r0 + r] = big;
        }
    }
}

/* A choice in phases of pieces (run_pieces): per head the page bound and its best pages
   (piece h), the blocks' bound (piece h x parts + part: a run of the head's pages), the
   voted and unread blocks dropped (this thread), the shortlist rescored (a run of each
   head's shortlist), the k best kept (this thread). Each piece writes its own rows. */
typedef struct {
    const float *pmin, *pmax, *q, *m0, *pk;
    const uint16_t *bmin, *bmax;
    const long *slot_of;
    far_t f;
    long pages, ks0, ks1;
    int heads, rows, dim, lo, c, n_pick, page_run, nb, b, n, m, parts, identity, most;
    long *first, *starts, *at;  /* H x n_pick, H x most, H x m */
    size_t *off;  /* H x most */
    float *sc, *xr, *best;  /* H x n, H x rows x m, H x c */
    float *scratch;  /* per piece: x (rows x most), qq, qp, qn (rows x dim), p (RB x b),
                        rbest (rows) */
    size_t per;  /* floats of scratch a piece */
} choice_t;

/* Piece i's bound of head h's candidates [a, z) (their off and starts filled) into out, on
   the piece's scratch. */
static void bound_piece(choice_t *w, int i, int h, const void *mn, const void *mx, int half,
                        int a, int z, int group, float *out) {
    size_t hrd = (size_t)w->rows * w->dim;
    float *x = w->scratch + w->per * i, *qq = x + (size_t)w->rows * w->most;
    bound_c(mn, mx, half, w->off + (size_t)h * w->most + a, z - a, w->q + h * hrd,
            w->m0 + (size_t)h * w->rows, w->rows, w->dim, w->starts + (size_t)h * w->most + a,
            group, &w->f, out, x, qq, qq + hrd, qq + 2 * hrd);
}

/* Piece h x parts + part: the page bound of a run of head h's candidate pages (runs start
   at multiples of page_run, whose pages share a turn) into best. Page p of head h is row
   p H + h of pmin, pmax. */
static void choose_pages(void *ctx, int i) {
    choice_t *w = ctx;
    int h = i / w->parts, part = i % w->parts;
    int runs = (w->c + w->page_run - 1) / w->page_run;
    int a = runs * part / w->parts * w->page_run, z = runs * (part + 1) / w->parts * w->page_run;
    z = z < w->c ? z : w->c;
    size_t *off = w->off + (size_t)h * w->most;
    long *starts = w->starts + (size_t)h * w->most;
    for (int j = a; j < z; j++) {
        off[j] = ((size_t)(w->lo + j) * w->heads + h) * w->dim;
        starts[j] = (long)(w->lo + j) * w->nb * w->b;
    }
    if (z > a)
        bound_piece(w, i, h, w->pmin, w->pmax, 0, a, z, w->page_run,
                    w->best + (size_t)h * w->c + a);
}

/* Piece h x parts + part: the block bound of the blocks of a run of head h's chosen pages
   (first[h]) into sc. */
static void choose_blocks(void *ctx, int i) {
    choice_t *w = ctx;
    int h = i / w->parts, part = i % w->parts;
    int a = w->n_pick * part / w->parts * w->nb, z = w->n_pick * (part + 1) / w->parts * w->nb;
    size_t *off = w->off + (size_t)h * w->most;
    long *starts = w->starts + (size_t)h * w->most;
    const long *fh = w->first + (size_t)h * w->n_pick;
    for (int j = a; j < z; j++) {  /* their blocks, in the float16 pools */
        long pg = fh[j / w->nb] + w->lo;
        off[j] = (((size_t)h * w->pages + pg) * w->nb + j % w->nb) * w->dim;
        starts[j] = (pg * w->nb + j % w->nb) * (long)w->b;
    }
    if (z > a)
        bound_piece(w, i, h, w->bmin, w->bmax, 1, a, z, w->nb, w->sc + (size_t)h * w->n + a);
}

static void choose_keys(void *ctx, int i) {
    choice_t *w = ctx;
    int h = i / w->parts, part = i % w->parts;
    int a = w->m * part / w->parts, z = w->m * (part + 1) / w->parts;
    size_t hrd = (size_t)w->rows * w->dim;
    float *qq = w->scratch + w->per * i + (size_t)w->rows * w->most;
    float *p = qq + 3 * hrd, *rbest = p + (size_t)RB * w->b;
    const float *qh = w->q + h * hrd, *mh = w->m0 + (size_t)h * w->rows;
    const long *at = w->at + (size_t)h * w->m;
    float *xr = w->xr + (size_t)h * w->rows * w->m;
    int nb = w->nb, b = w->b, dim = w->dim;
    size_t bytes = (size_t)b * dim * 4;
#define KEYS_OF(a_) (w->pk + (w->identity ? (a_) / nb : w->slot_of[(a_) / nb]) * w->ks0 \
                     + h * w->ks1 + ((a_) % nb) * (long)b * dim)
    for (int j = a; j < a + KEYS_AHEAD && j < z; j++)  /* the first blocks' keys */
        ask(KEYS_OF(at[j]), bytes);
    for (int j = a; j < z; j++) {
        if (j + KEYS_AHEAD < z) {  /* a block's keys are a random read: ask early */
            ask(KEYS_OF(at[j + KEYS_AHEAD]), bytes);
            far_ahead(&w->f, at[j + KEYS_AHEAD] * (long)b);
        }
        const float *qs = far_rows(&w->f, at[j] * (long)b, qh, w->rows, dim, qq);
        block_max(qs, w->rows, dim, KEYS_OF(at[j]), b, rbest, p);
        for (int r = 0; r < w->rows; r++) xr[(size_t)r * w->m + j] = rbest[r] - mh[r];
    }
#undef KEYS_OF
}

int strata_choose(const float *pmin, const float *pmax, const uint16_t *bmin,
                  const uint16_t *bmax, long pages, const float *q, const float *m0,
                  int heads, int rows, int dim, int lo, int c, int n_first, int page_run,
                  int nb, int b, long e, long s0, int split, const float *cl, const float *sl,
                  const float *ch, const float *sh, int half, const long *voted, int n_voted,
                  long n_blocks, int read_pages, int m, int k, const float *pk, long ks0,
                  long ks1, const long *slot_of, int identity, int threads, long *out) {
    if (!avx512() || heads < 1 || rows < 1 || rows > MAX_ROWS || dim < 16 || dim > MAX_DIM
        || dim % 16 || 2 * half > dim || c < 1 || nb < 1 || b < 1 || b > MAX_SIZE
        || page_run < 1 || k < 1)
        return 0;
    choice_t w;
    w.pmin = pmin; w.pmax = pmax; w.q = q; w.m0 = m0; w.pk = pk; w.bmin = bmin;
    w.bmax = bmax; w.slot_of = slot_of; w.pages = pages; w.ks0 = ks0; w.ks1 = ks1;
    w.f.cl = cl; w.f.sl = sl; w.f.ch = ch; w.f.sh = sh; w.f.half = half; w.f.split = split;
    w.f.e = e; w.f.s0 = s0;
    w.heads = heads; w.rows = rows; w.dim = dim; w.lo = lo; w.c = c; w.page_run = page_run;
    w.nb = nb; w.b = b; w.identity = identity;
    w.n_pick = c > 2 * n_first ? n_first : c;
    w.n = w.n_pick * nb;
    w.m = m < w.n ? m : w.n;
    if (k > w.m)
        return 0;
    w.parts = threads > 1 ? 2 : 1;
    w.most = w.n > c ? w.n : c;
    int pieces = heads * w.parts, n = w.n;
    w.per = (size_t)rows * w.most + 3 * (size_t)rows * dim + (size_t)RB * b + rows;
    size_t floats = w.per * pieces + (size_t)heads * (n + (size_t)rows * w.m + c) + w.m
                    + w.most;
    size_t longs = (size_t)heads * ((size_t)w.n_pick + 2 * (size_t)w.most + 2 * w.m) + c
                   + k;
    float *fs = malloc(sizeof(float) * floats);
    long *ls = malloc(sizeof(long) * longs);
    unsigned char *mark = calloc((size_t)(n_blocks > c ? n_blocks : c) + 1, 1);
    if (fs == NULL || ls == NULL || mark == NULL) {
        free(fs); free(ls); free(mark);
        return 0;
    }
    w.scratch = fs;
    w.sc = fs + w.per * pieces;
    w.xr = w.sc + (size_t)heads * n;
    w.best = w.xr + (size_t)heads * rows * w.m;
    float *tr = w.best + (size_t)heads * c, *tmp = tr + w.m;
    w.first = ls;
    w.starts = w.first + (size_t)heads * w.n_pick;
    w.off = (size_t *)(w.starts + (size_t)heads * w.most);
    w.at = (long *)w.off + (size_t)heads * w.most;
    long *pre = w.at + (size_t)heads * w.m, *keep = pre + (size_t)heads * w.m;
    long *pick = keep + c;
    if (w.n_pick < c) {  /* each head's n_pick best pages by the page bound */
        run_pieces(choose_pages, &w, pieces, threads);
        for (int h = 0; h < heads; h++)
            top_k(w.best + (size_t)h * c, c, w.n_pick, w.first + (size_t)h * w.n_pick, tmp);
    } else {
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < c; i++) w.first[(size_t)h * w.n_pick + i] = i;
    }
    run_pieces(choose_blocks, &w, pieces, threads);
    float *sc = w.sc;
    int n_pick = w.n_pick;
    if (n_voted > 0)  /* chosen already: the step chooses among the others */
        for (int h = 0; h < heads; h++) {
            const long *vh = voted + (size_t)h * n_voted;
            for (int v = 0; v < n_voted; v++) mark[vh[v]] = 1;
            for (int i = 0; i < n_pick; i++) {
                long base = (w.first[(size_t)h * n_pick + i] + lo) * nb;
                for (int t = 0; t < nb; t++)
                    if (mark[base + t]) sc[(size_t)h * n + i * nb + t] = -INFINITY;
            }
            for (int v = 0; v < n_voted; v++) mark[vh[v]] = 0;
        }
    if (read_pages < c) {  /* the pages a step reads: the best by any head's best block */
        float *best = w.best;
        for (int i = 0; i < c; i++) best[i] = -INFINITY;
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < n_pick; i++) {
                float top = -INFINITY;
                for (int t = 0; t < nb; t++) {
                    float v = sc[(size_t)h * n + i * nb + t];
                    top = v > top ? v : top;
                }
                long pg = w.first[(size_t)h * n_pick + i];
                best[pg] = top > best[pg] ? top : best[pg];
            }
        top_k(best, c, read_pages, keep, tmp);
        memset(mark, 0, (size_t)c);
        for (int i = 0; i < read_pages; i++) mark[keep[i]] = 1;
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < n_pick; i++)
                if (!mark[w.first[(size_t)h * n_pick + i]])
                    for (int t = 0; t < nb; t++) sc[(size_t)h * n + i * nb + t] = -INFINITY;
    }
    for (int h = 0; h < heads; h++) {  /* each head's shortlist: the m best by bound */
        long *ph = pre + (size_t)h * w.m, *at = w.at + (size_t)h * w.m;
        top_k(sc + (size_t)h * n, n, w.m, ph, tmp);
        for (int j = 0; j < w.m; j++)
            at[j] = (w.first[(size_t)h * n_pick + ph[j] / nb] + lo) * nb + ph[j] % nb;
    }
    run_pieces(choose_keys, &w, pieces, threads);
    for (int h = 0; h < heads; h++) {  /* the k best by true logits */
        const long *ph = pre + (size_t)h * w.m;
        lse_cols(w.xr + (size_t)h * rows * w.m, rows, w.m, tr);
        for (int j = 0; j < w.m; j++)
            if (sc[(size_t)h * n + ph[j]] == -INFINITY) tr[j] = -INFINITY;
        top_k(tr, w.m, k, pick, tmp);
        for (int j = 0; j < k; j++) out[(size_t)h * k + j] = w.at[(size_t)h * w.m + pick[j]];
    }
    free(fs); free(ls); free(mark);
    return 1;
}

/* ---- A sparse step's attention over what it reads: strata_attend_chosen ----

Contract: strata_attend_chosen(...) computes what engine.kv.cpu_loops.attend_chosen computes
(its arguments as cpu_kernels.attend_chosen checks them): per KV head, the softmax partial
of the queries q (H, R, D) over the sink pages' blocks, the chosen blocks (in position order)
and the window pages' blocks of the pools pk, pv (slots, H, P, D / Dv), each chosen or sink
block's keys turned as remap.block_deltas places them when `turned` (the reach layout when
`reach`, else InfLLM's), merged with the partial m_in, l_in, o_in, into m_out, l_out, o_out.
Each head's blocks are cut in pieces over up to `threads` threads, the pieces' partials
merged in order (the same bits whichever thread took which). Returns 0 where it does not
take the case (no AVX-512, D not a multiple of 16 or Dv of 64 up to MAX_DIM, more than
MAX_ROWS rows, blocks past MAX_SIZE keys, scratch not had).

Why: the numba loop (one head a thread over Python's pool) took ~0.17 ms of a 32k step's
layer: here 4 keys' scores share each load of the rows, the values are summed in registers
a block at a time, and the next blocks' keys, values and angle rows are asked for ahead. */

typedef struct {
    const float *q, *pk, *pv;
    long ks0, ks1, vs0, vs1;
    far_t f;
    int heads, rows, dim, dv, b, n, parts;
    const long *slots, *blk, *delta;  /* H x n: block j of head h */
    float *m, *l, *o;  /* per piece: rows, rows, rows x dv */
    float *scratch;  /* per piece: p (rows x n b), qq (rows x dim) */
    size_t per;
} chosen_t;

__attribute__((target("avx512f"))) static void chosen_piece(void *ctx, int i) {
    chosen_t *w = ctx;
    int h = i / w->parts, part = i % w->parts;
    int a = (int)((long)w->n * part / w->parts), z = (int)((long)w->n * (part + 1) / w->parts);
    int rows = w->rows, dim = w->dim, dv = w->dv, b = w->b, nk = (z - a) * b;
    float *m = w->m + (size_t)i * rows, *l = w->l + (size_t)i * rows;
    float *o = w->o + (size_t)i * rows * dv;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)rows * dv);
    if (nk == 0)
        return;
    float *p = w->scratch + w->per * i, *qq = p + (size_t)rows * nk;
    const float *qh = w->q + (size_t)h * rows * dim;
    const long *slots = w->slots + (size_t)h * w->n, *blk = w->blk + (size_t)h * w->n;
    const long *delta = w->delta + (size_t)h * w->n;
    size_t kbytes = (size_t)b * dim * 4, vbytes = (size_t)b * dv * 4;
#define KEYS(j) (w->pk + slots[j] * w->ks0 + h * w->ks1 + blk[j] * (long)b * dim)
#define VALS(j) (w->pv + slots[j] * w->vs0 + h * w->vs1 + blk[j] * (long)b * dv)
    for (int j = a; j < a + KEYS_AHEAD && j < z; j++)
        ask(KEYS(j), kbytes);
    long turned = 0;  /* the shift qq holds the rows turned by (0: none yet) */
    for (int j = a; j < z; j++) {  /* scores */
        if (j + KEYS_AHEAD < z) {
            ask(KEYS(j + KEYS_AHEAD), kbytes);
            if (delta[j + KEYS_AHEAD] != 0)
                turn_ahead(&w->f, delta[j + KEYS_AHEAD]);
        }
        const float *qs = qh;
        if (delta[j] != 0) {  /* neighbouring chosen blocks share a shift: turned once */
            if (delta[j] != turned) {
                turn_back(&w->f, delta[j], qh, rows, dim, qq);
                turned = delta[j];
            }
            qs = qq;
        }
        for (int r0 = 0; r0 < rows; r0 += RB) {
            const float *qb = qs + (size_t)r0 * dim;
            float *pb = p + (size_t)r0 * nk + (size_t)(j - a) * b;
            switch (rows - r0 < RB ? rows - r0 : RB) {
                case 1: scores_n(qb, KEYS(j), dim, b, nk, pb, NULL, 1); break;
                case 2: scores_n(qb, KEYS(j), dim, b, nk, pb, NULL, 2); break;
                case 3: scores_n(qb, KEYS(j), dim, b, nk, pb, NULL, 3); break;
                default: scores_n(qb, KEYS(j), dim, b, nk, pb, NULL, 4);
            }
        }
    }
    for (int j = a; j < a + KEYS_AHEAD && j < z; j++)
        ask(VALS(j), vbytes);
    for (int r = 0; r < rows; r++)  /* weights */
        weights(p + (size_t)r * nk, nk, m + r, l + r, o + (size_t)r * dv, dv);
    for (int j = a; j < z; j++) {  /* weights x values, a block at a time in place */
        const char *nv = j + KEYS_AHEAD < z ? (const char *)VALS(j + KEYS_AHEAD) : NULL;
        for (int r0 = 0; r0 < rows; r0 += RB) {
            const float *pb = p + (size_t)r0 * nk + (size_t)(j - a) * b;
            float *ob = o + (size_t)r0 * dv;
            switch (rows - r0 < RB ? rows - r0 : RB) {
                case 1: weigh_n(pb, VALS(j), b, nk, dv, ob, nv, 1); break;
                case 2: weigh_n(pb, VALS(j), b, nk, dv, ob, nv, 2); break;
                case 3: weigh_n(pb, VALS(j), b, nk, dv, ob, nv, 3); break;
                default: weigh_n(pb, VALS(j), b, nk, dv, ob, nv, 4);
            }
            nv = NULL;
        }
    }
#undef KEYS
#undef VALS
}

static int by_value(const void *x, const void *y) {
    long a = *(const long *)x, b = *(const long *)y;
    return (a > b) - (a < b);
}

int strata_attend_chosen(const float *q, int heads, int rows, int dim, const float *pk,
                         long ks0, long ks1, const float *pv, long vs0, long vs1, int dv,
                         const long *chosen, int k, int sink, int hi, int n_pages, int nb,
                         int b, int turned, int reach, long end, long trained,
                         const long *slot_of, int identity, int split, const float *cl,
                         const float *sl, const float *ch, const float *sh, int half,
                         const float *m_in, const float *l_in, const float *o_in,
                         float *m_out, float *l_out, float *o_out, int threads) {
    if (!avx512() || heads < 1 || rows < 1 || rows > MAX_ROWS || dim < 16 || dim > MAX_DIM
        || dim % 16 || dv < 64 || dv > MAX_DIM || dv % 64 || b < 1 || b > MAX_SIZE
        || 2 * half > dim || k < 0 || nb < 1)
        return 0;
    chosen_t w;
    w.q = q; w.pk = pk; w.pv = pv; w.ks0 = ks0; w.ks1 = ks1; w.vs0 = vs0; w.vs1 = vs1;
    w.f.cl = cl; w.f.sl = sl; w.f.ch = ch; w.f.sh = sh; w.f.half = half; w.f.split = split;
    w.f.e = 0; w.f.s0 = 0;
    w.heads = heads; w.rows = rows; w.dim = dim; w.dv = dv; w.b = b;
    int n_sink = sink * nb;
    w.n = n_sink + k + (n_pages - hi) * nb;
    w.parts = threads > 1 ? 2 : 1;
    int pieces = heads * w.parts;
    int n = w.n;
    w.per = (size_t)rows * ((size_t)(n / w.parts + 1) * b) + (size_t)rows * dim;
    size_t floats = w.per * pieces + (size_t)pieces * rows * (2 + (size_t)dv);
    float *fs = malloc(sizeof(float) * floats);
    long *ls = malloc(sizeof(long) * ((size_t)heads * 3 * n + (size_t)k + 1));
    if (fs == NULL || ls == NULL) {
        free(fs); free(ls);
        return 0;
    }
    w.scratch = fs;
    w.m = fs + w.per * pieces;
    w.l = w.m + (size_t)pieces * rows;
    w.o = w.l + (size_t)pieces * rows;
    long *slots = ls, *blk = slots + (size_t)heads * n, *delta = blk + (size_t)heads * n;
    long *top = delta + (size_t)heads * n;
    long P = (long)nb * b, S = sink * P, K = (long)k * b, W0 = hi * P, E = end - trained;
    int near = reach && trained > 0 && 0 <= E && E <= W0 - S - K;
    long shift = near ? E : W0 - S - K;
    for (int h = 0; h < heads; h++) {  /* head h's blocks: sinks, chosen in order, window */
        memcpy(top, chosen + (size_t)h * k, sizeof(long) * (size_t)k);
        qsort(top, (size_t)k, sizeof(long), by_value);
        for (int j = 0; j < n; j++) {
            long a, d = 0;
            if (j < n_sink) {
                a = j;
                d = turned ? shift : 0;
            } else if (j < n_sink + k) {
                a = top[j - n_sink];
                long step = (long)(j - n_sink) * b - a * b;  /* j b - s_j */
                if (turned)
                    d = near ? (step + E + S > 0 ? step + E + S : 0) : step + W0 - K;
            } else {
                a = (long)hi * nb + j - n_sink - k;
            }
            slots[(size_t)h * n + j] = identity ? a / nb : slot_of[a / nb];
            blk[(size_t)h * n + j] = a % nb;
            delta[(size_t)h * n + j] = d;
        }
    }
    w.slots = slots; w.blk = blk; w.delta = delta;
    run_pieces(chosen_piece, &w, pieces, threads);
    for (int h = 0; h < heads; h++)  /* the given partial, then the pieces', in order */
        for (int r = 0; r < rows; r++) {
            size_t x = (size_t)h * rows + r;
            float top_m = m_in[x];
            for (int u = 0; u < w.parts; u++) {
                float mu = w.m[((size_t)h * w.parts + u) * rows + r];
                top_m = mu > top_m ? mu : top_m;
            }
            /* a partial of nothing (max -inf) weighs nothing, whatever top_m is */
            float c = m_in[x] == -INFINITY ? 0.0f : expf(m_in[x] - top_m);
            float total = l_in[x] * c;
            float *o = o_out + x * dv;
            for (int y = 0; y < dv; y++) o[y] = o_in[x * dv + y] * c;
            for (int u = 0; u < w.parts; u++) {
                size_t pr = ((size_t)h * w.parts + u) * rows + r;
                float cu = w.m[pr] == -INFINITY ? 0.0f : expf(w.m[pr] - top_m);
                total += w.l[pr] * cu;
                const float *ou = w.o + pr * dv;
                for (int y = 0; y < dv; y++) o[y] += ou[y] * cu;
            }
            m_out[x] = top_m;
            l_out[x] = total;
        }
    free(fs); free(ls);
    return 1;
}
