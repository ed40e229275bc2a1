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

#include <stddef.h>     /* NULL: elsewhere only immintrin.h brought it, so a build without AVX failed */
#include <stdlib.h>     /* realloc: own_rows */
#include <omp.h>        /* omp_get_thread_num: a thread's own norm rows */

typedef float v8 __attribute__((vector_size(32)));

#if defined(__AVX__)
#include <immintrin.h>   /* __m256 and its shuffles are used wherever AVX is, with or without FMA */
#endif
#if defined(__FMA__) && defined(__AVX__)
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

/* hsum of eight vectors at once: lane r of the result is hsum(a[r]), bitwise. An 8x8 transpose
   puts lane j of every a[r] in column j, and 0 + col 0 + col 1 + ... + col 7 adds each vector's
   lanes in hsum's order, eight sums per add. One hsum is ~16 dependent scalar operations (lane
   extracts and adds): as many as the eight FMAs of a 64-wide dot product, so a score or a
   linear's output paid twice its arithmetic; this pays ~32 vector operations for eight. */
static inline v8 hsum8x8(const v8 *a) {
#if defined(__AVX__)
    __m256 t0 = _mm256_unpacklo_ps((__m256)a[0], (__m256)a[1]);
    __m256 t1 = _mm256_unpackhi_ps((__m256)a[0], (__m256)a[1]);
    __m256 t2 = _mm256_unpacklo_ps((__m256)a[2], (__m256)a[3]);
    __m256 t3 = _mm256_unpackhi_ps((__m256)a[2], (__m256)a[3]);
    __m256 t4 = _mm256_unpacklo_ps((__m256)a[4], (__m256)a[5]);
    __m256 t5 = _mm256_unpackhi_ps((__m256)a[4], (__m256)a[5]);
    __m256 t6 = _mm256_unpacklo_ps((__m256)a[6], (__m256)a[7]);
    __m256 t7 = _mm256_unpackhi_ps((__m256)a[6], (__m256)a[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    v8 s = (v8){0};                                   /* columns 0..7, added in lane order */
    s = s + (v8)_mm256_permute2f128_ps(u0, u4, 0x20);
    s = s + (v8)_mm256_permute2f128_ps(u1, u5, 0x20);
    s = s + (v8)_mm256_permute2f128_ps(u2, u6, 0x20);
    s = s + (v8)_mm256_permute2f128_ps(u3, u7, 0x20);
    s = s + (v8)_mm256_permute2f128_ps(u0, u4, 0x31);
    s = s + (v8)_mm256_permute2f128_ps(u1, u5, 0x31);
    s = s + (v8)_mm256_permute2f128_ps(u2, u6, 0x31);
    s = s + (v8)_mm256_permute2f128_ps(u3, u7, 0x31);
    return s;
#else
    v8 s;
    for (int r = 0; r < 8; r++) s[r] = hsum(a[r]);
    return s;
#endif
}

/* REGISTER(v): keep v in a register. Without it GCC folds the weight load into each of the MM
   multiply-adds for MM = 2 and 3 (it reads the weight MM times, the x rows once), which made a
   3-row product cost more than a 4-row one (1.29x against 1.13x a 1-row product, all weights of
   SmolLM2, 2-core Zen 3). It changes which operand is loaded, not the arithmetic. Only where
   a v8 fits one register ("x": a ymm register, so AVX); elsewhere the compiler decides. */
#if defined(__GNUC__) && defined(__AVX__)
#define REGISTER(v) __asm__("" : "+x"(v))
#else
#define REGISTER(v) (void)0
#endif
/* PREFETCH_AHEAD(p, I): ask for the weight row AHEAD_ROWS rows past p (one call a 64-byte line),
   into L2 (locality 2: not L1, where it would evict x and the accumulators' spills). With more
   than one row of x a weight row takes several times longer to consume than to read, and the
   hardware prefetcher then stops running ahead: from memory a 4-row product cost 2.5-3x a 1-row
   one (SmolLM2's 30 layers' products 46 ms against 16 ms; its LM head 12.7 against 3.7 ms; one
   thread, AMD EPYC with AVX-512, CPU time, min of 4, load ~20), where from cache it cost the
   same. Fetched 16 rows ahead (the then task block of 16; 37-98 KB for SmolLM2's widths), the 4-row
   products cost 17 ms and 4.0 ms, 8 rows 24 ms (from 59), 16 rows 45 (from 80). A 1-row product
   is left as it was (the hardware keeps up with it). A prefetch changes no arithmetic: every
   output is bitwise what it was. Past the end of a matrix it reads nothing (prefetches do not
   fault). */
#define AHEAD_ROWS 16
#define PREFETCH_AHEAD(p, I) __builtin_prefetch((p) + AHEAD_ROWS * (I), 0, 2)
#define ROWS_KERNEL(MM, EPILOGUE)                                                       \
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
                if (MM > 1 && !(i & 15)) PREFETCH_AHEAD(w + i, I);                       \
                REGISTER(wv);                                                            \
                for (int m = 0; m < MM; m++) {                                           \
                    v8 xv;                                                               \
                    __builtin_memcpy(&xv, x + m * I + i, sizeof xv);                     \
                    acc[m] = fma8(wv, xv, acc[m]);                                                   \
                }                                                                        \
            }                                                                            \
            EPILOGUE                                                                     \
            for (int m = 0; m < MM; m++) {                                               \
                float s = hsum(acc[m]);                                                  \
                for (long j = i; j < I; j++) s += w[j] * x[m * I + j];                   \
                y[m * O + o] = s;                                                        \
            }                                                                            \
        }                                                                                \
    }

/* EPILOGUE UNROLLED: with the loop over the MM sums unrolled, GCC keeps the accumulators in
   registers for their horizontal sums; rolled, it stores them and reads each lane back from the
   stack, which cost a 2-row product 1.16x a 1-row one (1.00-1.05x unrolled; 1 to 8 rows all
   gained or held). One row keeps the rolled form: unrolled it measured 4-9% slower. */
#define UNROLLED _Pragma("GCC unroll 8")
ROWS_KERNEL(1, ) ROWS_KERNEL(2, UNROLLED) ROWS_KERNEL(3, UNROLLED) ROWS_KERNEL(4, UNROLLED)
ROWS_KERNEL(5, UNROLLED) ROWS_KERNEL(6, UNROLLED) ROWS_KERNEL(7, UNROLLED) ROWS_KERNEL(8, UNROLLED)

typedef void (*rows_fn)(const float *, const float *, float *, long, long, long, long);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* MR rows of x against NR weight rows o..o+NR-1 over the whole width: MR * NR sums, each in
   ROWS_KERNEL's order (eight lanes over i, then the lanes in order: hsum8x8, bitwise hsum, then
   the tail), so a tile changes how many sums run at once, never how one is added up. Per
   eight-float step it loads MR + NR vectors for MR * NR FMAs: 4 x 4 loads half a vector an FMA
   where 4 x 2 loaded 0.75, and the L1's loads were the limit once the weights were in cache
   (AVX-512 machines give the 256-bit vectors 32 registers: 16 sums, 4 rows and a weight fit;
   with AVX2's 16 they would spill, and four rows go in two 4 x 2 tiles there: tile_4rows). */
#define TILE_KERNEL(MR, NR)                                                                \
    static void tile_##MR##x##NR(const float *x, const float *W, float *y, long I, long O, \
                                 long o) {                                               \
        const float *w = W + o * I;                                                      \
        v8 acc[(MR * NR + 7) / 8 * 8];                                                   \
        _Pragma("GCC unroll 32")                                                         \
        for (int a = 0; a < (MR * NR + 7) / 8 * 8; a++) acc[a] = (v8){0};                \
        long i = 0;                                                                      \
        for (; i + 8 <= I; i += 8) {                                                     \
            v8 xv[MR];                                                                   \
            _Pragma("GCC unroll 8")                                                      \
            for (int m = 0; m < MR; m++) {                                               \
                __builtin_memcpy(&xv[m], x + m * I + i, sizeof xv[m]);                   \
                REGISTER(xv[m]);                                                         \
            }                                                                            \
            if (!(i & 15)) {                                                             \
                _Pragma("GCC unroll 8")                                                  \
                for (int n = 0; n < NR; n++) PREFETCH_AHEAD(w + n * I + i, I);           \
            }                                                                            \
            _Pragma("GCC unroll 8")                                                      \
            for (int n = 0; n < NR; n++) {                                               \
                v8 wv;                                                                   \
                __builtin_memcpy(&wv, w + n * I + i, sizeof wv);                         \
                REGISTER(wv);                                                            \
                _Pragma("GCC unroll 8")                                                  \
                for (int m = 0; m < MR; m++)                                             \
                    acc[m * NR + n] = fma8(wv, xv[m], acc[m * NR + n]);                  \
            }                                                                            \
        }                                                                                \
        _Pragma("GCC unroll 4")                                                          \
        for (int g = 0; g < (MR * NR + 7) / 8; g++) {                                    \
            v8 s = hsum8x8(acc + 8 * g);                                                 \
            _Pragma("GCC unroll 8")                                                      \
            for (int r = 0; r < 8; r++) {                                                \
                if (8 * g + r >= MR * NR) break;                                         \
                int m = (8 * g + r) / NR, n = (8 * g + r) % NR;                          \
                float t = s[r];                                                          \
                for (long j = i; j < I; j++) t += w[n * I + j] * x[m * I + j];           \
                y[m * O + o + n] = t;                                                    \
            }                                                                            \
        }                                                                                \
    }
TILE_KERNEL(1, 8) TILE_KERNEL(2, 4) TILE_KERNEL(3, 4) TILE_KERNEL(4, 2)
#if defined(__AVX512VL__)
/* 4 x 6 (24 sums, 4 rows and a weight: 29 of the 32 registers) for full passes of 8 rows, the
   32-row decode step's and a prompt's calls (MAX_TOKENS): 10 vector loads for 24 FMAs where 4 x 4
   made 8 for 16. SmolLM2's products at 32 and 64 rows, 1 thread, CPU time, alternated with 4 x 4
   (docs/measurements/2026-12-07f-products.md): 0.88-0.98x the time from memory, 0.92-0.97x
   from cache. */
#define SIX_OUTPUT_TILES 1
TILE_KERNEL(4, 4)
TILE_KERNEL(4, 6)
static void tile_4rows(const float *x, const float *W, float *y, long I, long O, long o) {
    tile_4x4(x, W, y, I, O, o);
}
#else
static void tile_4rows(const float *x, const float *W, float *y, long I, long O, long o) {
    tile_4x2(x, W, y, I, O, o);
    tile_4x2(x, W, y, I, O, o + 2);
}
#endif

typedef void (*tile_fn)(const float *, const float *, float *, long, long, long);
static const tile_fn TILES[4] = {0, tile_1x8, tile_2x4, tile_3x4};
static const int TILE_OUTS[4] = {0, 8, 4, 4};

/* Rows 0..mm-1 of x (mm <= 8) against weight rows o0..o1-1. Every output is computed once,
   in the same order, whatever the tiling.
   - 1-3 rows (only a call of 1-3 rows: passes have 4 or more) read the weights from memory
     once, and one stream a row of outputs is what the hardware prefetcher keeps up with: a 1 x 8
     tile (eight weight rows at once) cost 1.4x rows_1, 2 x 4 and 3 x 4 1.1-1.2x rows_2/3
     (SmolLM2's LM head and layers, 1 thread, CPU time, load ~11).
   - 4 rows: 4 x 2 tiles (4 x 4 measured 0.83-1.05x their GFLOP/s from memory, load ~12).
   - 5-8 rows: four rows at a time in 4 x 4 tiles, the one to three left in TILES[rest] over
     the same outputs while their weights are in cache: the weights are read from memory once
     (before, the rows left were a second pass through ROWS, and 5 rows cost 1.6x four).
     Outputs outer, rows inner: a tile's weights stay in L1 for every row group.
   - 8 rows with 32 vector registers: 4 x 6 tiles, then 4 x 4 and the one-output kernel for a
     block's last outputs. */
static void rows_block(const float *x, const float *W, float *y, long I, long O, long o0,
                       long o1, long mm) {
#if defined(SIX_OUTPUT_TILES)
    if (mm == 8) {
        long o = o0;
        for (; o + 6 <= o1; o += 6) {
            tile_4x6(x, W, y, I, O, o);
            tile_4x6(x + 4 * I, W, y + 4 * O, I, O, o);
        }
        for (; o + 4 <= o1; o += 4) {
            tile_4x4(x, W, y, I, O, o);
            tile_4x4(x + 4 * I, W, y + 4 * O, I, O, o);
        }
        if (o < o1) ROWS[8](x, W, y, I, O, o, o1);
        return;
    }
#endif
    if (mm < 4) {
        ROWS[mm](x, W, y, I, O, o0, o1);
        return;
    }
    if (mm == 4) {
        long o2 = o0 + (o1 - o0) / 2 * 2;
        for (long o = o0; o < o2; o += 2) tile_4x2(x, W, y, I, O, o);
        if (o2 < o1) ROWS[4](x, W, y, I, O, o2, o1);
        return;
    }
    long m4 = mm / 4 * 4, rest = mm - m4;
    long on4 = o0 + (o1 - o0) / 4 * 4;
    long onr = rest ? o0 + (o1 - o0) / TILE_OUTS[rest] * TILE_OUTS[rest] : o0;
    long oend = on4 > onr ? on4 : onr;
    for (long o = o0; o < oend; o += 4) {
        if (o < on4)
            for (long m = 0; m < m4; m += 4) tile_4rows(x + m * I, W, y + m * O, I, O, o);
        if (rest && o < onr && (o - o0) % TILE_OUTS[rest] == 0)
            TILES[rest](x + m4 * I, W, y + m4 * O, I, O, o);
    }
    if (on4 < o1) ROWS[m4](x, W, y, I, O, on4, o1);
    if (rest && onr < o1) ROWS[rest](x + m4 * I, W, y + m4 * O, I, O, onr, o1);
}

/* Rows of x per call: k+1 <= 9 at batch 1, one token a row at batch 64. Above 16 a batch's
   decode step went to torch (BLAS and ~45 small operations a layer): 32 rows stepped 4x the
   time of 16 on the 2-core machine beside other jobs (docs/measurements/2026-12-06-paged-cpu.md).
   Passes of 8 rows over a block of BLOCK
   weight rows (<= 150 KB, in the core's cache after the first) keep the weights read once.
   128, not 64, for a prompt's calls (issue 51, docs/measurements/2026-12-08b-cold-prompt-calls.md):
   SmolLM2's cold 1,696-token prompt in 14 calls, not 27, took 0.95-0.98x the CPU (the attention's
   keys read by a group twice as large, half the calls' fixed costs); the products alone gained
   nothing (their weights' re-read a call is hidden by the prefetch: ~100 GFLOP/s at 64 rows a
   call and at 128-1,696). A call's scratch grows with it (layer_scratch: T * H * positions floats
   of scores, 7.8 MB at 128 tokens x 1,696 positions for SmolLM2), and each attention task's
   stack holds anc[MAX_TOKENS][MAX_TOKENS] (128 KB). A measuring build may set another
   (-DMAX_TOKENS=64: bench/cold_prefill_ab.py --call-tokens). */
#ifndef MAX_TOKENS
#define MAX_TOKENS 128
#endif

int specpair_max_tokens(void) { return MAX_TOKENS; }

/* Output rows per task: a multiple of the 4 x 6 tiles' six, and small enough that a 192-row
   matrix splits evenly (8 tasks). 24 measured 0.96-1.00x the time of 16 at 64 rows (1 thread,
   CPU time, load ~5), the same at 8 and 32. */
#define BLOCK 24

/* x: [M, I]; for each of n weights W[j]: [O[j], I] -> y[j]: [M, O[j]]; all contiguous float32,
   1 <= M <= MAX_TOKENS. Several weights that read the same x (q, k and v; gate and up) go in one call,
   so the threads share out all their rows at once: one fork-join instead of three, no idle
   thread on a small matrix, and no concatenated copy of the weights. More than 8 rows go in
   even passes of at most 8 (a ninth accumulator would not fit in the registers), block by
   block: a block's weights (BLOCK rows, <= 150 KB) come from memory in the first pass and from
   the core's cache in the next, so 16 rows read the weights from memory once (9 rows: 1.76x
   a 1-row product, against 1.88x with a full pass over memory each). A row's arithmetic is
   the same in any pass. */
/* Inside a parallel region (a layer's: specpair_llama_layer) the calling team shares the blocks
   out (an orphaned worksharing loop, ending at its barrier: every output written before any
   thread goes on); called outside one, the caller does them all. Which thread computes a block
   changes no arithmetic. Blocks are of equal work but the last of each weight. */
static void linear_team(const float *x, const float *const *W, float *const *y, const long *O,
                        int n, long M, long I) {
    long first[9];
    first[0] = 0;
    for (int j = 0; j < n; j++) first[j + 1] = first[j] + (O[j] + BLOCK - 1) / BLOCK;
    long passes = (M + 7) / 8;
#pragma omp for schedule(static)
    for (long b = 0; b < first[n]; b++) {
        int j = 0;
        while (b >= first[j + 1]) j++;
        long o0 = (b - first[j]) * BLOCK, o1 = o0 + BLOCK < O[j] ? o0 + BLOCK : O[j];
        for (long c = 0; c < passes; c++) {
            long m0 = M * c / passes, m1 = M * (c + 1) / passes;
            rows_block(x + m0 * I, W[j], y[j] + m0 * O[j], I, O[j], o0, o1, m1 - m0);
        }
    }
}

int specpair_small_linear(const float *x, const float *const *W, float *const *y, const long *O,
                          int n, long M, long I, int threads) {
    if (M < 1 || M > MAX_TOKENS || n < 1 || n > 8) return -1;
#pragma omp parallel num_threads(threads)
    linear_team(x, W, y, O, n, M, I);
    return 0;
}

/* ---- One Llama-shaped decoder layer for a few tokens, in one call ----------------------------

   On a 2-core CPU a decode step of a 135M model spends a third of its time dispatching ~45 small
   torch operations per layer (norms, rotary embedding, cache writes, attention, activations),
   ~7 us each, none of which moves many bytes. Here a layer is one call: RMSNorm, q/k/v through
   the kernel above, the rotary embedding (Hugging Face's half-split layout), the cache write at
   each token's position, causal attention over positions (grouped-query), the output projection,
   RMSNorm, SiLU-gated MLP, both residuals. Each token's result is computed in the same order
   whatever the other tokens are, as above.

   The families that differ from Llama only inside attention run here too, each option NULL or 0
   where a model lacks it: q/k/v biases (Qwen2), an RMSNorm over each head's q and k before the
   rotary embedding (Qwen3: qn, kn [hd]), and a sliding window (Mistral, Qwen2/3 with
   use_sliding_window): a token at position p attends keys at positions p-window+1..p, as
   Hugging Face's sliding_window_overlay. Every option is per token, so the bitwise equality of a
   token's result across calls holds for each.

   h: [T, D] residual stream, updated in place; rows/pos: [T] each token's cache row and position;
   slot: [T] the cache slot its key and value go to (NULL: its position); parent: [T] for a token
   tree, the index of the token's parent in this call, -1 where the token continues the row's
   cache contiguously (NULL: every token does: a chain);
   cos/sin: [T, hd]; kc/vc: [rows, Hkv, S, hd]; all contiguous float32 (rows, pos: int64);
   or, a paged cache (table not NULL): kc/vc a pool [S blocks, Hkv, block, hd] and table
   [rows, table_width] int64, each row's blocks in position order (kv_rows);
   bq/bk/bv: [H*hd]/[Hkv*hd]/[Hkv*hd] or NULL; qn/kn: [hd] or NULL; window: 0 for none;
   scratch: >= T*(2*D + 2*H*hd + 2*Hkv*hd + 2*F) + T*H*(max pos + 1) + F floats. */

static void rms_norm(const float *x, const float *w, float *out, long D, float eps) {
    double ss = 0.0;   /* not float: a long sum of squares loses digits, as torch avoids */
    for (long i = 0; i < D; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / __builtin_sqrtf((float)(ss / D) + eps);
    for (long i = 0; i < D; i++) out[i] = w[i] * (x[i] * scale);
}

static void rope(float *x, const float *cos, const float *sin, int heads, int hd) {
    int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (long)h * hd;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* q.k in eight lanes (the order is fixed, so every token's scores round alike). */
static inline float dot(const float *a, const float *b, int n) {
    v8 acc = (v8){0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 av, bv;
        __builtin_memcpy(&av, a + i, sizeof av);
        __builtin_memcpy(&bv, b + i, sizeof bv);
        acc = fma8(av, bv, acc);
    }
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* dot(a, k_r) for eight rows k_r of length n (n a multiple of 8): four consecutive at k0, four
   at k1 (a paged cache's block holds four or more positions, so a group of four never straddles
   blocks), each rounded exactly as dot() does, the eight lane sums at once (hsum8x8). */
static inline void dot8(const float *a, const float *k0, const float *k1, int n, float *out) {
    v8 acc[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
    for (int i = 0; i < n; i += 8) {
        v8 av;
        __builtin_memcpy(&av, a + i, sizeof av);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++) {
            v8 kv;
            __builtin_memcpy(&kv, (r < 4 ? k0 + (long)r * n : k1 + (long)(r - 4) * n) + i,
                             sizeof kv);
            acc[r] = fma8(av, kv, acc[r]);
        }
    }
    v8 s = hsum8x8(acc);
    __builtin_memcpy(out, &s, sizeof s);
}

/* dot8 for two queries a and b against the same eight keys (two rows reading a shared prefix's
   block): each key chunk loaded once for both, 16 sums (AVX-512VL's 32 vector registers hold
   them with the two queries and the key). out_a and out_b are bitwise dot8(a, ...) and
   dot8(b, ...): each sum's FMAs are dot8's own, in its order. */
static inline void dot8_pair(const float *a, const float *b, const float *k0, const float *k1,
                             int n, float *out_a, float *out_b) {
#if defined(__AVX512VL__)
    v8 acc_a[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
    v8 acc_b[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
    for (int i = 0; i < n; i += 8) {
        v8 av, bv;
        __builtin_memcpy(&av, a + i, sizeof av);
        __builtin_memcpy(&bv, b + i, sizeof bv);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < 8; r++) {
            v8 kv;
            __builtin_memcpy(&kv, (r < 4 ? k0 + (long)r * n : k1 + (long)(r - 4) * n) + i,
                             sizeof kv);
            acc_a[r] = fma8(av, kv, acc_a[r]);
            acc_b[r] = fma8(bv, kv, acc_b[r]);
        }
    }
    v8 sa = hsum8x8(acc_a), sb = hsum8x8(acc_b);
    __builtin_memcpy(out_a, &sa, sizeof sa);
    __builtin_memcpy(out_b, &sb, sizeof sb);
#else   /* AVX2's 16 registers: 16 sums would spill; one query at a time */
    dot8(a, k0, k1, n, out_a);
    dot8(b, k0, k1, n, out_b);
#endif
}

/* e^x in eight lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n):
   within 2 ulp of expf, and a scalar expf per score or activation cost more than the whole
   attention or MLP arithmetic around it. */
typedef int v8i __attribute__((vector_size(32)));
static inline v8 select8(v8i mask, v8 a, v8 b) {   /* mask lane -1: a, 0: b */
    v8i ai, bi;
    __builtin_memcpy(&ai, &a, sizeof ai);
    __builtin_memcpy(&bi, &b, sizeof bi);
    v8i r = (ai & mask) | (bi & ~mask);
    v8 out;
    __builtin_memcpy(&out, &r, sizeof out);
    return out;
}
/* The clamps, the floor and the max below as one instruction each where AVX has them, with the
   very results of the selects they replace (SPECPAIR_SELECT_EXP: the selects, the reference a
   test compares with): min_ps(a, b) is a < b ? a : b and max_ps(a, b) a > b ? a : b lane by
   lane, NaNs and zeros' signs included, and floor_ps is the truncation less one below a
   negative non-integer for every clamped fx (|fx| < 2^7). The selects cost 3 instructions and
   the floor 5, a third of exp8 (the softmax's and the SiLU's exponentials). */
#if defined(__AVX__) && !defined(SPECPAIR_SELECT_EXP)
static inline v8 min8(v8 a, v8 b) { return (v8)_mm256_min_ps((__m256)a, (__m256)b); }
static inline v8 max8(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
static inline v8 floor8(v8 x) { return (v8)_mm256_floor_ps((__m256)x); }
#else
static inline v8 min8(v8 a, v8 b) { return select8(a < b, a, b); }
static inline v8 max8(v8 a, v8 b) { return select8(a > b, a, b); }
static inline v8 floor8(v8 x) {
    v8 t = __builtin_convertvector(__builtin_convertvector(x, v8i), v8);
    return select8(t > x, t - 1.0f, t);
}
#endif
static inline v8 exp8(v8 x) {
    const v8 hi = (v8){0} + 88.3762626647949f, lo = (v8){0} - 87.3365447504019f;
    x = min8(hi, x);                                      /* x > hi ? hi : x */
    x = max8(lo, x);                                      /* x < lo ? lo : x */
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 nf = floor8(fx);
    v8i n = __builtin_convertvector(nf, v8i);
    x = x - nf * 0.693359375f;
    x = x - nf * -2.12194440e-4f;
    v8 y = (v8){0} + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v8i bits = (n + 127) << 23;
    v8 scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* exp over n floats in place: eight lanes at a time, the tail through the same lanes. */
static inline void exp_inplace(float *s, long n) {
    long p = 0;
    for (; p + 8 <= n; p += 8) {
        v8 v;
        __builtin_memcpy(&v, s + p, sizeof v);
        v = exp8(v);
        __builtin_memcpy(s + p, &v, sizeof v);
    }
    if (p < n) {
        v8 v = (v8){0};
        for (long j = p; j < n; j++) v[j - p] = s[j];
        v = exp8(v);
        for (long j = p; j < n; j++) s[j] = v[j - p];
    }
}

static void run_linear(const float *x, const float *const *W, float *const *y, const long *O, int n,
                       long M, long I, int threads) {
    specpair_small_linear(x, W, y, O, n, M, I, threads);
}

#define MAX_HEAD_DIM 256

#ifdef SPECPAIR_PROFILE
/* A measuring build's phase clock (bench/layer_kernel_ab.py builds one with -DSPECPAIR_PROFILE;
   a served build has none of it): seconds in each phase of specpair_llama_layer, summed over
   calls until specpair_profile reads them. The attention's parts are summed over its threads. */
#include <time.h>
/* P_SILU stays 0: the SiLU runs inside the gate/up phase (gate_up_silu_team) */
enum { P_QKV, P_ROPE, P_ATTN, P_OUT, P_GATEUP, P_SILU, P_DOWN, P_SCORES, P_SOFTMAX, P_VALUES, P_N };
/* CPU seconds, not wall (on a shared machine a wall clock counts other jobs' turns): the
   process's for the phases between marks (every thread of a parallel product), a thread's own
   for the attention's parts (each task measures itself). */
static double prof_s[P_N], prof_t;
static double prof_now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
#define PROF_START() (prof_t = prof_now(CLOCK_PROCESS_CPUTIME_ID))
/* in a layer's region, after a phase's barrier: its first thread marks (outside one: the caller) */
#define PROF_MARK(i) do { _Pragma("omp master") {                                             \
                          double t_ = prof_now(CLOCK_PROCESS_CPUTIME_ID); prof_s[i] += t_ - prof_t; \
                          prof_t = t_; } } while (0)
#define PROF_LOCAL(v) double v = prof_now(CLOCK_THREAD_CPUTIME_ID)
#define PROF_ADD(i, v) do { double t_ = prof_now(CLOCK_THREAD_CPUTIME_ID);                     \
                            _Pragma("omp atomic") prof_s[i] += t_ - v; v = t_; } while (0)
int specpair_profile(double *out) {
    for (int i = 0; i < P_N; i++) out[i] = prof_s[i], prof_s[i] = 0;
    return P_N;
}
#else
#define PROF_START() (void)0
#define PROF_MARK(i) (void)0
#define PROF_LOCAL(v) (void)0
#define PROF_ADD(i, v) (void)0
#endif

/* TEAM_PHASE(): where a phase of a layer's parallel region begins (each phase a worksharing
   loop; its end a barrier only where a later phase reads what it wrote). A served build has
   nothing there. A test's build (-DSPECPAIR_STAGGER_US=N, tests/engine/test_engine_layer_region.py)
   holds the team's first thread back N us at each, so it writes its share of every phase late:
   a barrier missing between a phase and a reader of it lets another thread read that share
   unwritten (the test's NaN-filled scratch), which a race on an unloaded machine rarely shows. */
#ifdef SPECPAIR_STAGGER_US
#include <omp.h>
#include <unistd.h>
/* The thread held back: the first; in specpair_llama_layers' layers after the first, the last
   (its static loops' shares are the later ones, which only the first thread's next phase reads
   across: the barrier between two layers shows missing only when the last thread writes late). */
static __thread int stagger_thread;
#define TEAM_PHASE() do { if (omp_get_thread_num() == stagger_thread) usleep(SPECPAIR_STAGGER_US); } while (0)
#define STAGGER_LAYER(l) (stagger_thread = (l) > 0 ? omp_get_num_threads() - 1 : 0)
#else
#define TEAM_PHASE() (void)0
#define STAGGER_LAYER(l) (void)0
#endif

/* Where a row's keys (or values) for one key/value head live: a contiguous row of the cache
   [rows, Hkv, S, hd], or (a paged cache) the row's block table into a pool of blocks
   [blocks, Hkv, block, hd], position p in table[p / block] at p % block. Every read goes through
   kv_at; the arithmetic on what it reads is the same either way, so a paged step is bitwise the
   contiguous one. A block holds a power of 2, at least 4, positions: dot8's groups of four keys share a
   block, and a key's block is a shift away (a division a key was a visible share of a step). */
typedef struct {
    const float *base;     /* contiguous: this row's head's first key; paged: the pool */
    const long *table;     /* paged: this row's block table; NULL: contiguous */
    long block, j, Hkv;
    int hd;
} kv_rows;

static inline const float *kv_at(const kv_rows *r, long p) {
    if (!r->table) return r->base + p * r->hd;
    int shift = __builtin_ctzl((unsigned long)r->block);
    return r->base + ((r->table[p >> shift] * r->Hkv + r->j) * r->block + (p & (r->block - 1)))
                     * r->hd;
}

/* The end of the run of positions from p (before `limit`) stored one after another: to the end
   of p's block, or (a contiguous cache) to the limit. */
static inline long run_end(const kv_rows *v, long p, long limit) {
    long end = v->table ? (p | (v->block - 1)) + 1 : limit;
    return end < limit ? end : limit;
}

/* A tile's share of one token's weighted sum: acc += s[p] * v_p for p = a..b-1 ascending (slots
   past n0 from anc, as weighted_sum), the sums copied into locals for the tile so that, with
   chunks a constant at the call (always inlined), they live in registers. */
#define VALUE_TILE 64
/* A run of at least this many tokens of one row (a prompt's chunk) is attended as a group
   (a measuring build may set it past MAX_TOKENS: every run through attend_run, as before). */
#ifndef PROMPT_RUN
#define PROMPT_RUN 16
#endif
static inline __attribute__((always_inline)) void
accumulate_values(const float *s, const kv_rows *v, long a, long b, long n0, const long *anc,
                  int m, int chunks, v8 *acc) {
    v8 r[MAX_HEAD_DIM / 8];
    for (int c = 0; c < chunks; c++) r[c] = acc[c];
    for (long p = a; p < b;) {
        /* a run of positions in one block (or the tree's one slot): one address computed for
           it, not one a position (kv_at's table read and products cost as much as the FMAs) */
        long end = p < n0 ? run_end(v, p, b < n0 ? b : n0) : p + 1;
        const float *vp = kv_at(v, p < n0 ? p : anc[m - 1 - (p - n0)]);
        for (; p < end; p++, vp += v->hd) {
            v8 w = (v8){0} + s[p];
            for (int c = 0; c < chunks; c++) {
                v8 x;
                __builtin_memcpy(&x, vp + c * 8, sizeof x);
                r[c] = fma8(w, x, r[c]);
            }
        }
    }
    for (int c = 0; c < chunks; c++) acc[c] = r[c];
}

/* Two tokens' shares of a tile whose values they both read at the same place (their rows' tables
   name the same blocks there: a shared prefix), positions a..b-1 all before both tokens' own
   keys: each value vector is loaded once for both, four eight-float chunks at a time (eight
   sums in registers), where accumulate_values loads it once a token. Each token's chunk sums
   are accumulate_values' own: the same FMAs, positions ascending. */
static inline __attribute__((always_inline)) void
accumulate_values_pair(const float *s0, const float *s1, const kv_rows *v, long a, long b,
                       int chunks, v8 *acc0, v8 *acc1) {
    for (int c0 = 0; c0 < chunks; c0 += 4) {
        v8 r0[4], r1[4];
        for (int c = 0; c < 4; c++) r0[c] = acc0[c0 + c], r1[c] = acc1[c0 + c];
        for (long p = a; p < b;) {
            long end = run_end(v, p, b);
            for (const float *vp = kv_at(v, p) + c0 * 8; p < end; p++, vp += v->hd) {
                v8 w0 = (v8){0} + s0[p], w1 = (v8){0} + s1[p];
                _Pragma("GCC unroll 4")
                for (int c = 0; c < 4; c++) {
                    v8 x;
                    __builtin_memcpy(&x, vp + c * 8, sizeof x);
                    REGISTER(x);
                    r0[c] = fma8(w0, x, r0[c]);
                    r1[c] = fma8(w1, x, r1[c]);
                }
            }
        }
        for (int c = 0; c < 4; c++) acc0[c0 + c] = r0[c], acc1[c0 + c] = r1[c];
    }
}

/* Four tokens' shares of such a tile (all four rows' tables name the same blocks there, all
   positions before every token's own keys): each value vector loaded once for four tokens, where
   the pair loads it once for two. QUAD_CHUNKS eight-float chunks at a time: 4 x 4 sums, four
   weights and a value chunk need 21 vector registers (AVX-512VL's 32 ymm), 4 x 2 fit AVX2's 16.
   Each token's chunk sums are accumulate_values' own: the same FMAs, positions ascending (a
   chunk's sum never meets another chunk's or another token's). */
#if defined(__AVX512VL__)
#define QUAD_CHUNKS 4
#else
#define QUAD_CHUNKS 2
#endif
static inline __attribute__((always_inline)) void
accumulate_values_quad(const float *const *s, const kv_rows *v, long a, long b, int chunks,
                       v8 *const *acc) {
    for (int c0 = 0; c0 < chunks; c0 += QUAD_CHUNKS) {
        v8 r[4][QUAD_CHUNKS];
        for (int t = 0; t < 4; t++)
            for (int c = 0; c < QUAD_CHUNKS; c++) r[t][c] = acc[t][c0 + c];
        for (long p = a; p < b;) {
            long end = run_end(v, p, b);
            for (const float *vp = kv_at(v, p) + c0 * 8; p < end; p++, vp += v->hd) {
                v8 w0 = (v8){0} + s[0][p], w1 = (v8){0} + s[1][p];
                v8 w2 = (v8){0} + s[2][p], w3 = (v8){0} + s[3][p];
                _Pragma("GCC unroll 4")
                for (int c = 0; c < QUAD_CHUNKS; c++) {
                    v8 x;
                    __builtin_memcpy(&x, vp + c * 8, sizeof x);
                    REGISTER(x);
                    r[0][c] = fma8(w0, x, r[0][c]);
                    r[1][c] = fma8(w1, x, r[1][c]);
                    r[2][c] = fma8(w2, x, r[2][c]);
                    r[3][c] = fma8(w3, x, r[3][c]);
                }
            }
        }
        for (int t = 0; t < 4; t++)
            for (int c = 0; c < QUAD_CHUNKS; c++) acc[t][c0 + c] = r[t][c];
    }
}

/* Whether two rows' tables name the same blocks for positions a..b-1 (paged caches only). */
static inline int same_blocks(const kv_rows *x, const kv_rows *y, long a, long b) {
    int shift = __builtin_ctzl((unsigned long)x->block);
    for (long k = a >> shift; k <= (b - 1) >> shift; k++)
        if (x->table[k] != y->table[k]) return 0;
    return 1;
}

/* out = inv * sum_p s[p] * v_p, keys ascending from position lo (0, or a sliding window's
   first): the value rows lo..n0-1 of the contiguous prefix, then (a token tree) the m rows at
   slots anc[m-1], ..., anc[0], whose scores are s[n0..n0+m-1]. hd = 8 * chunks floats. The
   same accumulations in the same order either way. */
static void weighted_sum(const float *s, const kv_rows *v, long lo, long n0, const long *anc, int m,
                         int chunks, float inv, float *out) {
    v8 acc[MAX_HEAD_DIM / 8];
    for (int c = 0; c < chunks; c++) acc[c] = (v8){0};
    accumulate_values(s, v, lo, n0 + m, n0, anc, m, chunks, acc);
    for (int c = 0; c < chunks; c++) {
        v8 r = acc[c] * inv;
        __builtin_memcpy(out + c * 8, &r, sizeof r);
    }
}

/* Token t's keys past the contiguous prefix: the cache slots of t and of its ancestors within
   this call (anc[0] = t's own slot, then its parent's, ...), and the prefix length n0 (keys
   0..n0-1 at slots 0..n0-1). Without a tree (parent NULL) that is t alone, n0 = pos[t]. */
static int tree_keys(const long *pos, const long *slot, const long *parent, long t, long *anc,
                     long *n0) {
    int m = 0;
    long a = t;
    for (;;) {
        anc[m++] = slot ? slot[a] : pos[a];
        if (!parent || parent[a] < 0) break;
        a = parent[a];
    }
    *n0 = pos[a];
    return m;
}

/* Token qv's scores against the keys at p..p+7 (p a multiple of 8) that it sees, those in
   [first, n): all eight at once where it sees them all (dot8), else one by one (dot). A key's
   score is the same value either way, whichever tile or call computes it. */
static inline void score_tile(const float *qv, const kv_rows *kr, long p, long first, long n,
                              int hd, float *s) {
    if (first == p && p + 8 <= n) dot8(qv, kv_at(kr, p), kv_at(kr, p + 4), hd, s + p);
    else for (long k = first; k < n && k < p + 8; k++) s[k] = dot(qv, kv_at(kr, k), hd);
}

/* A token's softmax over its scores s[l..n-1], in place up to the normalisation: each scaled,
   less their max, through e^x; returns 1 / the sum (which the weighted sum applies). The scaling
   and the max in eight lanes (a max is the same value whichever lane finds it: the largest;
   a -0 for a +0 changes no difference but a zero's sign, and e^(+-0) is 1), the exponentials and
   the sum as before: the sum's lane j over s[l + 8c + j], the tail added after, in order. */
static float softmax_exp(float *s, long l, long n, float scale) {
    v8 m8 = (v8){0} - __builtin_inff();
    long p = l;
    for (; p + 8 <= n; p += 8) {
        v8 v;
        __builtin_memcpy(&v, s + p, sizeof v);
        m8 = max8(v * scale, m8);    /* scaled again below, not stored: one pass of stores less */
    }
    float mx = -__builtin_inff();
    for (int j = 0; j < 8; j++)
        if (m8[j] > mx) mx = m8[j];
    for (long k = p; k < n; k++) {
        s[k] *= scale;
        if (s[k] > mx) mx = s[k];
    }
    v8 sum8 = (v8){0};
    for (p = l; p + 8 <= n; p += 8) {
        v8 v;
        __builtin_memcpy(&v, s + p, sizeof v);
        v = exp8(v * scale - mx);
        __builtin_memcpy(s + p, &v, sizeof v);
        sum8 += v;
    }
    if (p < n) {                      /* the tail through the same lanes, as exp_inplace */
        v8 v = (v8){0};
        for (long j = p; j < n; j++) v[j - p] = s[j] - mx;
        v = exp8(v);
        for (long j = p; j < n; j++) s[j] = v[j - p];
    }
    float sum = hsum(sum8);
    for (; p < n; p++) sum += s[p];
    return 1.0f / sum;
}

/* Causal attention for query head hh of tokens a..b-1, all of one cache row: token t sees keys
   at positions 0..pos[t]. Every (token, key) score and every token's weighted sum is computed in
   the same order as for that token alone (eight lanes, keys ascending), whatever the run's
   length: the run shares loads, never arithmetic. In a token tree (parent given) a token's keys
   at positions past its prefix are its ancestors' slots, not the slots that follow: its scores
   and sums are the very ones it would get with those ancestors as a plain chain (dot8 rounds
   each key as dot does), which keeps a tree's verification bitwise equal to decoding. */
static void attend_run(const float *q, const float *kc, const float *vc, float *att, float *scores,
                       const long *pos, const long *slot, const long *parent, long row, long a,
                       long b, int hh, int H, int Hkv, int hd, long S, long L, long window,
                       const long *table, long table_width, long block) {
    int j = hh / (H / Hkv), chunks = hd / 8;
    long qd = (long)H * hd, nmax = 0, lomin = L;
    kv_rows kr = {kc + (row * Hkv + j) * S * hd, NULL, block, j, Hkv, hd}, vr = kr;
    vr.base = vc + (row * Hkv + j) * S * hd;
    if (table) {
        kr.base = kc, vr.base = vc;
        kr.table = vr.table = table + row * table_width;
    }
    float scale = 1.0f / __builtin_sqrtf((float)hd);
    long anc[MAX_TOKENS][MAX_TOKENS], n0[MAX_TOKENS], lo[MAX_TOKENS];
    int m[MAX_TOKENS];
    for (long t = a; t < b; t++) {
        m[t - a] = tree_keys(pos, slot, parent, t, anc[t - a], &n0[t - a]);
        if (n0[t - a] > nmax) nmax = n0[t - a];
        /* the first position the token sees: 0, or its sliding window's first */
        lo[t - a] = window > 0 && pos[t] - window + 1 > 0 ? pos[t] - window + 1 : 0;
        if (lo[t - a] < lomin) lomin = lo[t - a];
    }
    /* Prefix scores: eight keys at a time (eight independent chains), each tile for every
       token. A key's score is the same whichever tile or call computes it (dot8 rounds as dot). */
    for (long p = lomin / 8 * 8; p < nmax; p += 8) {
        for (long t = a; t < b; t++) {
            long n = n0[t - a], first = lo[t - a] > p ? lo[t - a] : p;
            score_tile(q + t * qd + (long)hh * hd, &kr, p, first, n, hd,
                       scores + (t * H + hh) * L);
        }
    }
    /* The rest: the token itself and its ancestors in this call, in position order. */
    for (long t = a; t < b; t++) {
        const float *qv = q + t * qd + (long)hh * hd;
        float *s = scores + (t * H + hh) * L;
        for (int i = 0; i < m[t - a]; i++)
            s[n0[t - a] + i] = dot(qv, kv_at(&kr, anc[t - a][m[t - a] - 1 - i]), hd);
    }
    /* Softmax per token over its own keys. */
    float inv[MAX_TOKENS];
    for (long t = a; t < b; t++)
        inv[t - a] = softmax_exp(scores + (t * H + hh) * L, lo[t - a], pos[t] + 1, scale);
    /* Weighted sums of values, token by token (the values are in the core's caches by now). */
    for (long t = a; t < b; t++) {
        const float *s = scores + (t * H + hh) * L;
        float *out = att + t * qd + (long)hh * hd;
        weighted_sum(s, &vr, lo[t - a], n0[t - a], anc[t - a], m[t - a], chunks, inv[t - a],
                     out);
    }
}



/* A paged cache's attention for query head hh of a group of runs whose rows share their first
   block (a prompt prefix served by reference): tokens toks[0..n-1], each of its own row (table).
   Each key and value is loaded once for every token of the group that reads it at that position:
   keys outer, tokens inner, so a prefix block that 32 rows share is read from memory once, not
   32 times. Every (token, key) score, every token's softmax and every token's weighted sum is
   computed exactly as attend_run computes it for that token (the same dot8/dot per key, the same
   ascending accumulation of values into the token's own eight-lane sums), so the result is
   bitwise attend_run's whatever the grouping.
   GQA: the task takes query heads h0..h0+heads-1, all of one key/value head (H / Hkv query heads
   read the same keys and values): each key tile transposed once for heads x n queries, each
   value tile read once for all of them. A query (head, token) is an entry e = (head - h0) * n
   + token index; its scores, softmax and sums are its own whatever entries share a load. */
#include "prompt_scores.h"   /* many queries' scores against keys read at one place */

static void attend_group(const float *q, const float *kc, const float *vc, float *att,
                         float *scores, const long *pos, const long *slot, const long *parent,
                         const long *rows, const long *toks, long n, int h0, int heads, int H,
                         int Hkv, int hd, long L, long window, const long *table,
                         long table_width, long block) {
    int j = h0 / (H / Hkv), chunks = hd / 8;
    long qd = (long)H * hd, nmax = 0, lomin = L, pend = 0, ne = n * heads;
    float scale = 1.0f / __builtin_sqrtf((float)hd);
    kv_rows kr[MAX_TOKENS], vr[MAX_TOKENS];
    long anc[MAX_TOKENS][MAX_TOKENS], n0[MAX_TOKENS], lo[MAX_TOKENS];
    int m[MAX_TOKENS];
    PROF_LOCAL(clock);
    for (long i = 0; i < n; i++) {
        long t = toks[i];
        kr[i] = (kv_rows){kc, table + rows[t] * table_width, block, j, Hkv, hd};
        vr[i] = kr[i];
        vr[i].base = vc;
        m[i] = tree_keys(pos, slot, parent, t, anc[i], &n0[i]);
        if (n0[i] > nmax) nmax = n0[i];
        if (n0[i] + m[i] > pend) pend = n0[i] + m[i];
        lo[i] = window > 0 && pos[t] - window + 1 > 0 ? pos[t] - window + 1 : 0;
        if (lo[i] < lomin) lomin = lo[i];
    }
    long done_from, done_to;     /* keys every token reads at one place: prompt_scores.h */
    prompt_scores(q, qd, h0, heads, hd, kr, toks, n, lo, n0, scores, H, L, &done_from, &done_to);
    for (long p = lomin / 8 * 8; p < nmax; p += 8) {
        if (p >= done_from && p < done_to) continue;
        for (int hh = h0; hh < h0 + heads; hh++)
        for (long i = 0; i < n; i++) {
            long t = toks[i], first = lo[i] > p ? lo[i] : p;
            /* this token and the next see all eight keys, stored at the same place for both
               (a shared prefix): their scores from one read of the keys */
            if (i + 1 < n && first == p && p + 8 <= n0[i] && lo[i + 1] <= p && p + 8 <= n0[i + 1]) {
                const float *k0 = kv_at(&kr[i], p), *k1 = kv_at(&kr[i], p + 4);
                if (k0 == kv_at(&kr[i + 1], p) && k1 == kv_at(&kr[i + 1], p + 4)) {
                    long u = toks[i + 1];
                    dot8_pair(q + t * qd + (long)hh * hd, q + u * qd + (long)hh * hd, k0, k1, hd,
                              scores + (t * H + hh) * L + p, scores + (u * H + hh) * L + p);
                    i++;
                    continue;
                }
            }
            score_tile(q + t * qd + (long)hh * hd, &kr[i], p, first, n0[i], hd,
                       scores + (t * H + hh) * L);
        }
    }
    PROF_ADD(P_SCORES, clock);
    float inv[MAX_TOKENS * (MAX_HEAD_DIM / 8)];     /* ne <= MAX_TOKENS * MAX_HEAD_DIM / hd */
    for (long e = 0; e < ne; e++) {
        long i = e % n, t = toks[i], hh = h0 + e / n;
        const float *qv = q + t * qd + hh * hd;
        float *s = scores + (t * H + hh) * L;
        for (int a = 0; a < m[i]; a++)
            s[n0[i] + a] = dot(qv, kv_at(&kr[i], anc[i][m[i] - 1 - a]), hd);
        inv[e] = softmax_exp(s, lo[i], pos[t] + 1, scale);
    }
    PROF_ADD(P_SOFTMAX, clock);
    /* Values: tiles of VALUE_TILE positions outer, tokens inner, each token's sums in ascending
       positions (as weighted_sum). A tile's values (16 KB at hd 64) stay in L1 while every token
       of the group reads them, and a token's sums stay in registers across the tile, loaded and
       stored once a tile rather than once a position. Entries e, e + 1, ... may be two heads
       of one token or two tokens: a value load shared, never a sum. The sums: chunks vectors an
       entry, ne * chunks <= MAX_TOKENS * MAX_HEAD_DIM / 8 (plan_step's heads a task). */
    static __thread v8 acc[MAX_TOKENS * (MAX_HEAD_DIM / 8)];
#define ENTRY_SCORES(e) (scores + (toks[(e) % n] * H + h0 + (e) / n) * L)
    for (long i = 0; i < ne * chunks; i++) acc[i] = (v8){0};
    for (long p0 = lomin; p0 < pend; p0 += VALUE_TILE) {
        long p1 = p0 + VALUE_TILE < pend ? p0 + VALUE_TILE : pend;
        for (long e = 0; e < ne; e++) {
            long i = e % n;
            long a = lo[i] > p0 ? lo[i] : p0, b = n0[i] + m[i] < p1 ? n0[i] + m[i] : p1;
            if (a >= b) continue;
            const float *s = ENTRY_SCORES(e);
            /* the next entries that read this whole tile at the same blocks as entry e, before
               their tokens' own keys: four of them share each value load
               (accumulate_values_quad) */
            int along = 1;
            if (chunks % QUAD_CHUNKS == 0 && a == p0 && b == p1 && p1 <= n0[i])
                while (along < 4 && e + along < ne && lo[(e + along) % n] <= p0
                       && p1 <= n0[(e + along) % n]
                       && same_blocks(&vr[i], &vr[(e + along) % n], p0, p1))
                    along++;
            if (along == 4) {
                const float *s4[4];
                v8 *acc4[4];
                for (int k = 0; k < 4; k++)
                    s4[k] = ENTRY_SCORES(e + k), acc4[k] = acc + (e + k) * chunks;
                accumulate_values_quad(s4, &vr[i], p0, p1, chunks, acc4);
                e += 3;
                continue;
            }
            long i1 = (e + 1) % n;
            if (chunks % 4 == 0 && e + 1 < ne && a == p0 && b == p1 && p1 <= n0[i]
                && lo[i1] <= p0 && p1 <= n0[i1] && same_blocks(&vr[i], &vr[i1], p0, p1)) {
                accumulate_values_pair(s, ENTRY_SCORES(e + 1), &vr[i], p0, p1, chunks,
                                       acc + e * chunks, acc + (e + 1) * chunks);
                e++;
                continue;
            }
            if (chunks == 8)    /* hd 64: the eight sums as named registers */
                accumulate_values(s, &vr[i], a, b, n0[i], anc[i], m[i], 8, acc + e * 8);
            else
                accumulate_values(s, &vr[i], a, b, n0[i], anc[i], m[i], chunks, acc + e * chunks);
        }
    }
#undef ENTRY_SCORES
    for (long e = 0; e < ne; e++) {
        float *out = att + toks[e % n] * qd + (h0 + e / n) * hd;
        for (int c = 0; c < chunks; c++) {
            v8 r = acc[e * chunks + c] * inv[e];
            __builtin_memcpy(out + c * 8, &r, sizeof r);
        }
    }
    PROF_ADD(P_VALUES, clock);
}


int specpair_max_head_dim(void) { return MAX_HEAD_DIM; }

/* The attention's softmax (to 1 / the sum, which it returns) and exp8 over n floats, for the
   tests that hold them to their reference build (SPECPAIR_SELECT_EXP) bit for bit. */
float specpair_softmax_exp(float *s, long l, long n, float scale) { return softmax_exp(s, l, n, scale); }
int specpair_exp(float *s, long n) { exp_inplace(s, n); return 0; }

/* g = SiLU(g) * u over n floats, eight lanes at a time. e^-g is exp8's, lane by lane
   (exp_inplace's numbers: exp8 has no cross-lane step, so where a lane sits changes nothing),
   then g / (1 + e) * u in the lanes: the scalar loop's operations, each rounded once. No
   scratch: the lanes stay in registers (a shared F-float buffer held one token at a time).
   Eight whole lanes load and store as vectors: filled lane by lane they cost 3.7x the time
   (0.232 against 0.063 CPU-s for a 1,696-token SmolLM2 prompt's 78M, 4% of its prefill;
   the same bits); only a run's last few lanes go one by one. */
static void silu_lanes(float *g, const float *u, long n) {
    for (long at = 0; at < n; at += 8) {
        long w = n - at < 8 ? n - at : 8;
        v8 gv = (v8){0}, uv = (v8){0};
        if (w == 8) {
            __builtin_memcpy(&gv, g + at, sizeof gv);
            __builtin_memcpy(&uv, u + at, sizeof uv);
        } else {
            for (long j = 0; j < w; j++) gv[j] = g[at + j], uv[j] = u[at + j];
        }
        v8 e = exp8(-gv);
        v8 r = gv / (1.0f + e) * uv;
        if (w == 8)
            __builtin_memcpy(g + at, &r, sizeof r);
        else
            for (long j = 0; j < w; j++) g[at + j] = r[j];
    }
}

/* g = SiLU(x Wg^T) * (x Wu^T) for x [T, I], block by block of outputs: one thread computes a
   block's gate and up outputs (each as linear_team computes it: rows_block, passes of at most 8
   rows) and its SiLU right after, while they are in its cache, so no barrier separates the
   products from the SiLU. Ends at its loop's barrier (the down product reads g whole). */
static void gate_up_silu_team(const float *x, const float *wg, const float *wu, float *g,
                              float *u, long T, long I, long F) {
    long passes = (T + 7) / 8;
#pragma omp for schedule(static)
    for (long b = 0; b < (F + BLOCK - 1) / BLOCK; b++) {
        long o0 = b * BLOCK, o1 = o0 + BLOCK < F ? o0 + BLOCK : F;
        for (long c = 0; c < passes; c++) {
            long m0 = T * c / passes, m1 = T * (c + 1) / passes;
            rows_block(x + m0 * I, wg, g + m0 * F, I, F, o0, o1, m1 - m0);
            rows_block(x + m0 * I, wu, u + m0 * F, I, F, o0, o1, m1 - m0);
        }
        for (long t = 0; t < T; t++) silu_lanes(g + t * F + o0, u + t * F + o0, o1 - o0);
    }
}

/* The second half of a decoder layer, after the attention att [T, qd]: out = residual + att Wo,
   then out += down(SiLU(gate(x)) * up(x)) with x = post_norm(out). The target's layer (residual
   and out the same: in place) and the EAGLE-3 head's (head_kernels.c) both end so: one home.
   x [T, D], g and u [T, F], o [T, D]: scratch.
   Run by a team inside its parallel region (or alone): a barrier ends each phase that a later
   one reads whole (the products read every row of their input; a token's norm reads its whole
   row of out); the last, out += o, ends without one: the region's end is its barrier, and a
   caller that goes on inside the region must put one there.
   own: 2 * T * D floats of this thread's alone, or NULL (every thread alike). Given, every
   thread computes every token's residual + att Wo and its norm into its own rows, where the
   team shared them (writing out) and met at a barrier before gate/up: one barrier fewer, and
   out = that sum + the down product at the end, the same two roundings as before. */
static void mlp_team(const float *att, const float *residual, float *out, const float *wo,
                     const float *n_post, const float *wg, const float *wu, const float *wd,
                     float *x, float *g, float *u, float *o, long T, long D, long qd, long F,
                     float eps, float *own) {
    TEAM_PHASE();
    {
        const float *Ws[1] = {wo};
        float *ys[1] = {o};
        long Os[1] = {D};
        linear_team(att, Ws, ys, Os, 1, T, qd);
    }
    PROF_MARK(P_OUT);
    TEAM_PHASE();
    float *sum = own, *xn = own ? own + T * D : NULL;
    if (own) {
        /* o (att Wo) is next written by the down product, after gate/up's barrier, which
           the other threads pass only once they have read it here; residual (h, in place)
           is written only by the last loop */
        for (long t = 0; t < T; t++) {
            for (long i = t * D; i < (t + 1) * D; i++) sum[i] = residual[i] + o[i];
            rms_norm(sum + t * D, n_post, xn + t * D, D, eps);
        }
    } else {
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            for (long i = t * D; i < (t + 1) * D; i++) out[i] = residual[i] + o[i];
            rms_norm(out + t * D, n_post, x + t * D, D, eps);
        }
    }
    TEAM_PHASE();
    gate_up_silu_team(own ? xn : x, wg, wu, g, u, T, D, F);
    PROF_MARK(P_GATEUP);
    TEAM_PHASE();
    {
        const float *Ws[1] = {wd};
        float *ys[1] = {o};
        long Os[1] = {D};
        linear_team(g, Ws, ys, Os, 1, T, F);
    }
    TEAM_PHASE();
    if (own) {
#pragma omp for schedule(static) nowait
        for (long i = 0; i < T * D; i++) out[i] = sum[i] + o[i];
    } else {
#pragma omp for schedule(static) nowait
        for (long i = 0; i < T * D; i++) out[i] += o[i];
    }
}

/* mlp_team in a region of its own (the EAGLE-3 head's layer, head_kernels.c). */
static void attention_out_and_mlp(const float *att, const float *residual, float *out,
                                  const float *wo, const float *n_post, const float *wg,
                                  const float *wu, const float *wd, float *x, float *g, float *u,
                                  float *o, long T, long D, long qd, long F, float eps,
                                  int threads) {
#pragma omp parallel num_threads(threads)
    mlp_team(att, residual, out, wo, n_post, wg, wu, wd, x, g, u, o, T, D, qd, F, eps, NULL);
    PROF_MARK(P_DOWN);
}

/* What every layer of a call shares: its tokens, where they go, the shapes, and the attention's
   plan (index work only), made once a call by plan_step before the team starts. */
typedef struct {
    const long *rows, *pos, *slot, *parent, *table;
    const float *cos, *sin;
    long T, D, F, qd, kd, L, S, table_width, block, runs, groups;
    int H, Hkv, hd;
    float eps;
    float *own;          /* threads * 2 * T * D floats: each thread's own rows, or NULL */
    long run_start[MAX_TOKENS + 1], toks[MAX_TOKENS], group_start[MAX_TOKENS + 1];
    int group_runs[MAX_TOKENS];
    /* group gi's tasks: task_start[gi] .. task_start[gi + 1] - 1. A lone run's: one a query
       head (attend_run); a group's: head_parts a key/value head (attend_group, each part of its
       H / Hkv query heads one task) */
    long task_start[MAX_TOKENS + 1];
    int head_parts;
} step_plan;

/* Checks a call's tokens (the codes specpair_llama_layer returns) and plans its attention. */
static int plan_step(step_plan *P, const long *rows, const long *pos, const long *slot,
                     const long *parent, long T, long D, int H, int Hkv, int hd, long F, float eps,
                     const float *cos, const float *sin, long S, const long *table,
                     long table_width, long block, int threads) {
    if (T < 1 || T > MAX_TOKENS || hd % 8 || hd > MAX_HEAD_DIM || H % Hkv) return -1;
    long L = 0, reach = 0;
    for (long t = 0; t < T; t++) {
        long at = slot ? slot[t] : pos[t];
        if (pos[t] + 1 > L) L = pos[t] + 1;
        if (at + 1 > reach) reach = at + 1;
        /* a tree's parent is an earlier token of the same row, one position before */
        if (parent && parent[t] >= 0 && (parent[t] >= t || rows[parent[t]] != rows[t]
                                         || pos[parent[t]] != pos[t] - 1)) return -3;
    }
    if (table) {
        /* S: the pool's blocks. Every position a token reads or writes is in its row's table,
           at a block of the pool. */
        if (block < 4 || (block & (block - 1))) return -4;
        for (long t = 0; t < T; t++) {
            long far = (slot ? slot[t] : pos[t]) > pos[t] ? (slot ? slot[t] : pos[t]) : pos[t];
            if (far / block >= table_width) return -2;
            for (long b = 0; b <= far / block; b++) {
                long id = table[rows[t] * table_width + b];
                if (id < 0 || id >= S) return -2;
            }
        }
    } else if (L > S || reach > S) return -2;
    *P = (step_plan){rows, pos, slot, parent, table, cos, sin, T, D, F, (long)H * hd,
                     (long)Hkv * hd, L, S, table_width, block, 0, 0, H, Hkv, hd, eps};

    /* Attention's tasks, one per (run, query head): a run is the consecutive tokens of one row
       (a verification's k+1 tokens), which read the same keys and values, so each key and value
       is loaded once for all of them rather than once per token. Index work only (no data):
       planned once a call, before the team starts, for every layer of it. */
    long *run_start = P->run_start, runs = 0;
    for (long t = 0; t < T; t++)
        if (t == 0 || rows[t] != rows[t - 1]) run_start[runs++] = t;
    run_start[runs] = T;
    long *toks = P->toks, *group_start = P->group_start, groups = 0, placed = 0;
    int *group_runs = P->group_runs;
    if (table) {
        /* A paged cache: runs whose rows begin at the same block (a shared prompt prefix) are
           one group, attended together (attend_group), tokens in call order within it. A group
           of at least two runs a thread is cut into one part a thread: one group's H tasks
           on 2 threads left one idle for a ninth of the attention (H = 9), and a part still
           reads each key once for its many rows. */
        int taken[MAX_TOKENS] = {0};
        /* A group's tasks: a key/value head's H / Hkv query heads each (GQA: they read the same
           keys and values, so a key tile transposed once serves all their queries, a value
           tile is read once for all), in head_parts parts of at most MAX_HEAD_DIM / hd heads
           (attend_group's sums hold MAX_TOKENS * MAX_HEAD_DIM / 8 vectors). */
        int G = H / Hkv, fit = MAX_HEAD_DIM / hd;
        P->head_parts = (G + fit - 1) / fit;
        long per_part = (long)Hkv * P->head_parts, gcd = per_part;
        for (long b = threads; b;) {                   /* gcd(per_part, threads) */
            long c = gcd % b;
            gcd = b, b = c;
        }
        for (long r = 0; r < runs; r++) {
            if (taken[r]) continue;
            long first = table[rows[run_start[r]] * table_width], members[MAX_TOKENS], count = 0;
            for (long r2 = r; r2 < runs; r2++) {
                if (taken[r2] || table[rows[run_start[r2]] * table_width] != first) continue;
                taken[r2] = 1;
                members[count++] = r2;
            }
            if (count == 1 && run_start[r + 1] - run_start[r] >= PROMPT_RUN) {
                /* A prompt's chunk: one row's many tokens, attended as a group (keys and values
                   tile by tile, each read once for all its tokens), cut into one part a thread
                   at equal work (a token's work is its keys: pos + 1, which grows along the
                   run), so the H tasks of each part keep both threads busy. */
                long a = run_start[r], b = run_start[r + 1], work = 0, done = 0;
                long parts = threads > 1 && b - a >= 2L * threads ? threads : 1;
                for (long t = a; t < b; t++) work += pos[t] + 1;
                for (long part = 0, t = a; part < parts && t < b; part++) {
                    /* the part ends where the work done reaches its share (each part >= 1 token) */
                    group_runs[groups] = 0;
                    group_start[groups++] = placed;
                    for (long from = t; t < b && (part == parts - 1 || t == from
                                                  || done + pos[t] + 1 <= work * (part + 1) / parts);)
                        done += pos[t] + 1, toks[placed++] = t++;
                }
                continue;
            }
            /* Rows sharing a prefix: cut by rows into as few parts as make the group's tasks
               (per_part a part) a multiple of the threads (SmolLM2: 3 key/value heads x 2
               parts on 2 threads, 3 tasks each, a key tile transposed for 3 x 16 queries; one
               part a query head was 9 tasks, 5 against 4) */
            long parts = threads > 1 && count >= 2L * threads ? threads / gcd : 1;
            for (long part = 0; part < parts; part++) {
                long c0 = count * part / parts, c1 = count * (part + 1) / parts;
                group_runs[groups] = (int)(c1 - c0);
                group_start[groups++] = placed;
                for (long c = c0; c < c1; c++)
                    for (long t = run_start[members[c]]; t < run_start[members[c] + 1]; t++)
                        toks[placed++] = t;
            }
        }
        group_start[groups] = placed;
        P->task_start[0] = 0;
        for (long gi = 0; gi < groups; gi++)
            P->task_start[gi + 1] = P->task_start[gi] + (group_runs[gi] == 1 ? H : per_part);
    }

    P->runs = runs;
    P->groups = groups;
    return 0;
}

/* A buffer of at least n floats of the calling thread's (the engine's: kept and grown across
   calls), or NULL where malloc fails. The layers' teams' own rows: one 2 * T * D slice a
   thread, given out before the region so that every thread takes the same path. */
static float *own_rows(long n) {
    static __thread float *rows;
    static __thread long held;
    if (n > held) {
        float *grown = realloc(rows, n * sizeof(float));
        if (!grown) return NULL;
        rows = grown, held = n;
    }
    return rows;
}

/* One decoder layer by the team of the parallel region it is called in (its phases orphaned
   worksharing loops): w the layer's 14 tensors (LAYER_TENSORS' order: wq wk wv wo wg wu wd n1
   n2 bq bk bv qn kn, the last five NULL where the family lacks them), kc/vc its cache. Ends with
   the last residual's loop, without a barrier: the region's end is that barrier, or the caller's
   next layer begins with one.

   The whole layer is one parallel region: its threads meet only at the barriers that end
   the phases a later phase reads whole (the products read every row of their input, the
   attention every token's keys), and the work between the products (norms, rotary
   embedding, cache writes, SiLU, residuals) is shared out by token or by lanes, not run by
   one thread while the other waits. Before, each layer forked and joined five regions with
   that work serial between them: a 32-row decode step's second thread slept ~40 ms in ~190
   sleeps a step (docs/measurements/2026-12-07f-decode-step-overhead.md). Which thread does
   a token, a block or a task changes no arithmetic: every output is bitwise as before. */
static void layer_team(const step_plan *P, float *h, const float *const *w, float *kc,
                       float *vc, long window, float *scratch) {
    const long *rows = P->rows, *pos = P->pos, *slot = P->slot, *parent = P->parent;
    const long *table = P->table, *run_start = P->run_start, *toks = P->toks;
    const long *group_start = P->group_start;
    const int *group_runs = P->group_runs;
    const float *cos = P->cos, *sin = P->sin;
    long T = P->T, D = P->D, F = P->F, qd = P->qd, kd = P->kd, L = P->L, S = P->S;
    long table_width = P->table_width, block = P->block, runs = P->runs, groups = P->groups;
    int H = P->H, Hkv = P->Hkv, hd = P->hd;
    float eps = P->eps;
    const float *wq = w[0], *wk = w[1], *wv = w[2], *wo = w[3], *wg = w[4], *wu = w[5];
    const float *wd = w[6], *n1 = w[7], *n2 = w[8], *bq = w[9], *bk = w[10], *bv = w[11];
    const float *qn = w[12], *kn = w[13];
    float *x = scratch, *q = x + T * D, *k = q + T * qd, *v = k + T * kd, *att = v + T * kd;
    float *g = att + T * qd, *u = g + T * F, *o = u + T * F, *scores = o + T * D;
    /* Every thread norms every token into a buffer of its own, where the team shared the
       tokens' norms in x and met at a barrier before the products (which read every row): the
       same rms_norm, so the same bits, and 30 barriers a step fewer for T * D norm work twice
       (~20 us of a 32-row step's ~100 ms a thread). h is whole here: the layer's region starts
       after the step's or the previous layer's barrier. */
    TEAM_PHASE();
    float *own = P->own ? P->own + (long)omp_get_thread_num() * 2 * T * D : NULL, *xn = own;
    if (!xn) {    /* no memory for the buffers (every thread alike): shared norms and a barrier */
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) rms_norm(h + t * D, n1, x + t * D, D, eps);
    } else {
        for (long t = 0; t < T; t++) rms_norm(h + t * D, n1, xn + t * D, D, eps);
    }
    TEAM_PHASE();
    {
        const float *Ws[3] = {wq, wk, wv};
        float *ys[3] = {q, k, v};
        long Os[3] = {qd, kd, kd};
        linear_team(xn ? xn : x, Ws, ys, Os, 3, T, D);
    }
    PROF_MARK(P_QKV);
    /* Each token's own q, k and v, and its own cache slots (no two tokens of a call write
       the same slot). */
    TEAM_PHASE();
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        float *qt = q + t * qd, *kt = k + t * kd, *vt = v + t * kd;
        if (bq) for (long i = 0; i < qd; i++) qt[i] += bq[i];
        if (bk) for (long i = 0; i < kd; i++) kt[i] += bk[i];
        if (bv) for (long i = 0; i < kd; i++) vt[i] += bv[i];
        /* Qwen3: each head's q and k normed over the head dimension, before the rotation
           (in place: rms_norm reads all of x before it writes, and each out[i] from x[i]
           alone) */
        if (qn) for (int j = 0; j < H; j++) rms_norm(qt + (long)j * hd, qn, qt + (long)j * hd, hd, eps);
        if (kn) for (int j = 0; j < Hkv; j++) rms_norm(kt + (long)j * hd, kn, kt + (long)j * hd, hd, eps);
        rope(q + t * qd, cos + t * hd, sin + t * hd, H, hd);
        rope(k + t * kd, cos + t * hd, sin + t * hd, Hkv, hd);
        for (int j = 0; j < Hkv; j++) {
            kv_rows kr = {kc + (rows[t] * Hkv + j) * S * hd, NULL, block, j, Hkv, hd}, vr = kr;
            vr.base = vc + (rows[t] * Hkv + j) * S * hd;
            if (table) {
                kr.base = kc, vr.base = vc;
                kr.table = vr.table = table + rows[t] * table_width;
            }
            long at = slot ? slot[t] : pos[t];
            __builtin_memcpy((float *)kv_at(&kr, at), k + t * kd + (long)j * hd, hd * sizeof(float));
            __builtin_memcpy((float *)kv_at(&vr, at), v + t * kd + (long)j * hd, hd * sizeof(float));
        }
    }
    PROF_MARK(P_ROPE);
    TEAM_PHASE();
    if (table) {
        const long *task_start = P->task_start;
        int G = H / Hkv, parts = P->head_parts;
#pragma omp for schedule(dynamic)
        for (long task = 0; task < task_start[groups]; task++) {
            long gi = 0, top = groups;       /* the group: task_start[gi] <= task < [gi + 1] */
            while (top - gi > 1) {
                long mid = (gi + top) / 2;
                if (task_start[mid] <= task) gi = mid;
                else top = mid;
            }
            long k = task - task_start[gi], t0 = toks[group_start[gi]];
            if (group_runs[gi] == 1)     /* one row's few tokens: its run as before */
                attend_run(q, kc, vc, att, scores, pos, slot, parent, rows[t0], t0,
                           t0 + group_start[gi + 1] - group_start[gi], (int)k, H,
                           Hkv, hd, S, L, window, table, table_width, block);
            else {                       /* key/value head k / parts, its part k % parts */
                int h0 = (int)(k / parts) * G, c = (int)(k % parts);
                attend_group(q, kc, vc, att, scores, pos, slot, parent, rows,
                             toks + group_start[gi], group_start[gi + 1] - group_start[gi],
                             h0 + G * c / parts, G * (c + 1) / parts - G * c / parts, H, Hkv,
                             hd, L, window, table, table_width, block);
            }
        }
    } else {
#pragma omp for schedule(static)
        for (long task = 0; task < runs * H; task++) {
            long r = task / H;
            int hh = (int)(task % H);
            attend_run(q, kc, vc, att, scores, pos, slot, parent, rows[run_start[r]],
                       run_start[r], run_start[r + 1], hh, H, Hkv, hd, S, L, window, table,
                       table_width, block);
        }
    }
    PROF_MARK(P_ATTN);
    mlp_team(att, h, h, wo, n2, wg, wu, wd, x, g, u, o, T, D, qd, F, eps, own);
}

int specpair_llama_layer(float *h, const long *rows, const long *pos, const long *slot,
                         const long *parent, long T, long D, int H,
                         int Hkv, int hd, long F, float eps, const float *cos, const float *sin,
                         float *kc, float *vc, long S, const long *table, long table_width,
                         long block, const float *wq, const float *wk,
                         const float *wv, const float *wo, const float *wg, const float *wu,
                         const float *wd, const float *n1, const float *n2, const float *bq,
                         const float *bk, const float *bv, const float *qn, const float *kn,
                         long window, float *scratch, int threads) {
    if (window < 0) return -1;
    step_plan P;
    int rc = plan_step(&P, rows, pos, slot, parent, T, D, H, Hkv, hd, F, eps, cos, sin, S, table,
                       table_width, block, threads);
    if (rc) return rc;
    const float *w[14] = {wq, wk, wv, wo, wg, wu, wd, n1, n2, bq, bk, bv, qn, kn};
    P.own = own_rows((long)threads * 2 * T * D);
    PROF_START();
#pragma omp parallel num_threads(threads)
    layer_team(&P, h, w, kc, vc, window, scratch);
    PROF_MARK(P_DOWN);
    return 0;
}

/* A step's `layers` decoder layers over the same tokens in one call and one parallel region
   (issue 51): each layer as specpair_llama_layer computes it (layer_team), with one barrier
   between two layers where each layer forked and joined a region of its own, and no Python
   between them. With two threads the 32-row decode step's pool thread slept at 30 joins and
   30 forks a step more than this, and the engine ran 30 calls' argument conversion alone.
   kc/vc: [layers] each layer's cache (all of one shape: S as specpair_llama_layer's);
   weights: [layers * 14], each layer's tensors in layer_team's order; windows: [layers];
   capture_at: [layers] or NULL: where capture_at[l] >= 0, layer l's input h is copied to
   captured + capture_at[l] * T * D (an EAGLE-3 head's features, taken on the way). Codes as
   specpair_llama_layer's; nothing is computed when one is refused. */
int specpair_llama_layers(float *h, const long *rows, const long *pos, const long *slot,
                          const long *parent, long T, long D, int H, int Hkv, int hd, long F,
                          float eps, const float *cos, const float *sin, float *const *kc,
                          float *const *vc, long S, const long *table, long table_width,
                          long block, int layers, const float *const *weights,
                          const long *windows, const long *capture_at, float *captured,
                          float *scratch, int threads) {
    if (layers < 1) return -1;
    for (int l = 0; l < layers; l++)
        if (windows[l] < 0 || (capture_at && capture_at[l] >= 0 && !captured)) return -1;
    step_plan P;
    int rc = plan_step(&P, rows, pos, slot, parent, T, D, H, Hkv, hd, F, eps, cos, sin, S, table,
                       table_width, block, threads);
    if (rc) return rc;
    P.own = own_rows((long)threads * 2 * T * D);
    PROF_START();
#pragma omp parallel num_threads(threads)
    for (int l = 0; l < layers; l++) {
        if (l > 0) {
            /* the previous layer's last loop (h += its MLP) ends without a barrier; this
               layer's norm (and a capture) read every token's h */
#pragma omp barrier
            PROF_MARK(P_DOWN);
        }
        if (capture_at && capture_at[l] >= 0) {
            /* nowait: h is next written by this layer's first residual, three barriers on */
            float *c = captured + capture_at[l] * T * D;
#pragma omp for schedule(static) nowait
            for (long i = 0; i < T * D; i++) c[i] = h[i];
        }
        STAGGER_LAYER(l);
        layer_team(&P, h, weights + 14L * l, kc[l], vc[l], windows[l], scratch);
        if (l == layers - 1) STAGGER_LAYER(0);
    }
    PROF_MARK(P_DOWN);
    return 0;
}
