/* y[m, o] = sum_i x[m, i] * W[o, i] for a few rows of x (a decode step or a verification).

   At batch 1 a decode step is a chain of matrix-vector products: every weight is read once and
   used for a handful of multiply-adds, so the step costs what reading the weights costs. BLAS
   kernels tuned for large products reach about half the machine's read bandwidth there, and a
   5-row product (verifying 4 drafts) costs them twice a 1-row one. This kernel streams each
   weight row once and applies it to all M rows of x while it is in registers, so M rows cost
   little more than one.

   Each output is summed in the same order whatever M is: a token's logits are bitwise the same
   in a 1-token decode step and in a k+1-token verification, so speculation cannot change greedy
   output through rounding. That needs every instantiation to round alike, so the compiler may
   not fuse multiply-adds where it sees fit (-ffp-contract=off); fma8 fuses them explicitly where
   the CPU has FMA. GCC vector extensions otherwise: the same source builds for AVX2, AVX-512 and
   NEON with -march=native. */

typedef float v8 __attribute__((vector_size(32)));

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

#define ROWS_KERNEL(MM)                                                                  \
    static void rows_##MM(const float *x, const float *W, float *y, long I, long O,      \
                          long o0, long o1) {                                            \
        for (long o = o0; o < o1; o++) {                                                 \
            const float *w = W + o * I;                                                  \
            v8 acc[MM];                                                                  \
            for (int m = 0; m < MM; m++) acc[m] = (v8){0};                               \
            long i = 0;                                                                  \
            for (; i + 8 <= I; i += 8) {                                                 \
                v8 wv;                                                                   \
                __builtin_memcpy(&wv, w + i, sizeof wv);                                 \
                for (int m = 0; m < MM; m++) {                                           \
                    v8 xv;                                                               \
                    __builtin_memcpy(&xv, x + m * I + i, sizeof xv);                     \
                    acc[m] = fma8(wv, xv, acc[m]);                                                   \
                }                                                                        \
            }                                                                            \
            for (int m = 0; m < MM; m++) {                                               \
                float s = hsum(acc[m]);                                                  \
                for (long j = i; j < I; j++) s += w[j] * x[m * I + j];                   \
                y[m * O + o] = s;                                                        \
            }                                                                            \
        }                                                                                \
    }

ROWS_KERNEL(1) ROWS_KERNEL(2) ROWS_KERNEL(3) ROWS_KERNEL(4)
ROWS_KERNEL(5) ROWS_KERNEL(6) ROWS_KERNEL(7) ROWS_KERNEL(8)

typedef void (*rows_fn)(const float *, const float *, float *, long, long, long, long);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

int specpair_max_rows(void) { return 8; }

#define BLOCK 16   /* output rows per task: small enough that a 192-row matrix splits evenly */

/* x: [M, I]; for each of n weights W[j]: [O[j], I] -> y[j]: [M, O[j]]; all contiguous float32,
   1 <= M <= 8. Several weights that read the same x (q, k and v; gate and up) go in one call, so
   the threads share out all their rows at once: one fork-join instead of three, no idle thread
   on a small matrix, and no concatenated copy of the weights. */
int specpair_small_linear(const float *x, const float *const *W, float *const *y, const long *O,
                          int n, long M, long I, int threads) {
    if (M < 1 || M > 8 || n < 1 || n > 8) return -1;
    rows_fn f = ROWS[M];
    long first[9];
    first[0] = 0;
    for (int j = 0; j < n; j++) first[j + 1] = first[j] + (O[j] + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < first[n]; b++) {
        int j = 0;
        while (b >= first[j + 1]) j++;
        long o0 = (b - first[j]) * BLOCK, o1 = o0 + BLOCK < O[j] ? o0 + BLOCK : O[j];
        f(x, W[j], y[j], I, O[j], o0, o1);
    }
    return 0;
}
