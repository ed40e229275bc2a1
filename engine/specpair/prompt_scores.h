/* Attention scores of many queries against keys they all read at the same place: a prompt's
   chunk (one row's 64 tokens), or a decode step's rows sharing a prompt prefix by reference.
   Included by cpu_kernels.c (it uses its v8, fma8, kv_rows, kv_at, MAX_HEAD_DIM); called from
   attend_group before its own score loop, which then skips the keys done here.

   Why: dot8 scores eight keys for one query in eight lane chains (lane j of key r sums
   q[8c+j] * k_r[8c+j] over c), then adds each key's eight lanes in order with hsum8x8, a
   transpose of 24 shuffles and 8 adds for every query and every eight keys. In a 1,696-token
   prompt that transpose is as much work as the FMAs (the scores ran at ~42 GFLOP/s where the
   products run at ~90; 1.20 of a prefill's 7.07 CPU-s, quiet). Here eight keys are transposed
   once (lane r = key r) and read by every query of the group: for each lane j, one vector holds
   all eight keys' lane-j chains, q[8c+j] broadcast against the transposed keys, and the eight
   keys' scores are 0 + chain_0 + chain_1 + ... + chain_7, vector adds.

   Bitwise dot8's: each key's lane-j chain is the same FMAs (q[8c+j] * k[8c+j] + acc, c
   ascending, from +0), and its lanes are added in hsum8x8's (and dot's hsum's) order, starting
   from +0. Only which register holds a sum changes. The broadcast keeps a -0's sign (an
   initializer, not 0 + x). */

#if defined(__AVX512VL__)
/* 6 queries x 2 tiles of 8 keys: 12 scores and 12 lane chains in registers, 2 key vectors
   and a broadcast: 27 of AVX-512VL's 32 vector registers. */
#define PS_QB 6
#elif defined(__AVX__)
#define PS_QB 2          /* 16 registers: 4 + 4 + 2 + 1 */
#else
#define PS_QB 2
#endif
/* Fewer queries than this read the keys as before: a transpose of eight keys costs about as
   much as six queries' hsum8x8. */
#ifndef PS_MIN_QUERIES
#define PS_MIN_QUERIES 8
#endif

/* kt[j] = lane j of rows r[0..7] as one vector (lane r): an 8 x 8 transpose, data moved only. */
static inline void ps_transpose8(const float *const *r, v8 *kt) {
#if defined(__AVX__)
    __m256 a0 = _mm256_loadu_ps(r[0]), a1 = _mm256_loadu_ps(r[1]), a2 = _mm256_loadu_ps(r[2]);
    __m256 a3 = _mm256_loadu_ps(r[3]), a4 = _mm256_loadu_ps(r[4]), a5 = _mm256_loadu_ps(r[5]);
    __m256 a6 = _mm256_loadu_ps(r[6]), a7 = _mm256_loadu_ps(r[7]);
    __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
    __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
    __m256 t4 = _mm256_unpacklo_ps(a4, a5), t5 = _mm256_unpackhi_ps(a4, a5);
    __m256 t6 = _mm256_unpacklo_ps(a6, a7), t7 = _mm256_unpackhi_ps(a6, a7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    kt[0] = (v8)_mm256_permute2f128_ps(u0, u4, 0x20);
    kt[1] = (v8)_mm256_permute2f128_ps(u1, u5, 0x20);
    kt[2] = (v8)_mm256_permute2f128_ps(u2, u6, 0x20);
    kt[3] = (v8)_mm256_permute2f128_ps(u3, u7, 0x20);
    kt[4] = (v8)_mm256_permute2f128_ps(u0, u4, 0x31);
    kt[5] = (v8)_mm256_permute2f128_ps(u1, u5, 0x31);
    kt[6] = (v8)_mm256_permute2f128_ps(u2, u6, 0x31);
    kt[7] = (v8)_mm256_permute2f128_ps(u3, u7, 0x31);
#else
    for (int j = 0; j < 8; j++)
        for (int k = 0; k < 8; k++) kt[j][k] = r[k][j];
#endif
}

/* A test's build (-DPS_TEST_BROKEN, tests/engine/test_engine_prompt_scores.py) adds lane 0's
   chain twice: scores that differ, which the test must see (so it shows this path ran). */
#if defined(PS_TEST_BROKEN)
#define PS_ADD(s, acc) ((s) + (acc) + (j == 0 ? (acc) : (v8){0}))
#else
#define PS_ADD(s, acc) ((s) + (acc))
#endif

/* QB queries x TILES tiles of eight keys, the tiles transposed in kt: kt[(tile * chunks + c) * 8
   + j] holds the eight keys' element 8c + j. out[i] + 8 * tile: query i's eight scores. */
#define PS_KERNEL(QB, TILES)                                                                   \
    static void ps_block_##QB##_##TILES(const float *const *qv, const v8 *kt, int chunks,       \
                                        float *const *out) {                                    \
        v8 s[QB][TILES];                                                                        \
        _Pragma("GCC unroll 16")                                                                \
        for (int i = 0; i < QB * TILES; i++) s[i / TILES][i % TILES] = (v8){0};                 \
        for (int j = 0; j < 8; j++) {                                                           \
            v8 acc[QB][TILES];                                                                  \
            _Pragma("GCC unroll 16")                                                            \
            for (int i = 0; i < QB * TILES; i++) acc[i / TILES][i % TILES] = (v8){0};           \
            for (int c = 0; c < chunks; c++) {                                                  \
                v8 k[TILES];                                                                    \
                _Pragma("GCC unroll 2")                                                         \
                for (int t = 0; t < TILES; t++) {                                               \
                    k[t] = kt[((long)t * chunks + c) * 8 + j];                                  \
                    REGISTER(k[t]);                                                             \
                }                                                                               \
                _Pragma("GCC unroll 8")                                                         \
                for (int i = 0; i < QB; i++) {                                                  \
                    float x = qv[i][8 * c + j];                                                 \
                    v8 a = {x, x, x, x, x, x, x, x};                                            \
                    _Pragma("GCC unroll 2")                                                     \
                    for (int t = 0; t < TILES; t++) acc[i][t] = fma8(a, k[t], acc[i][t]);       \
                }                                                                               \
            }                                                                                   \
            _Pragma("GCC unroll 16")                                                            \
            for (int i = 0; i < QB * TILES; i++)                                                \
                s[i / TILES][i % TILES] = PS_ADD(s[i / TILES][i % TILES], acc[i / TILES][i % TILES]);\
        }                                                                                       \
        _Pragma("GCC unroll 16")                                                                \
        for (int i = 0; i < QB * TILES; i++)                                                    \
            __builtin_memcpy(out[i / TILES] + 8 * (i % TILES), &s[i / TILES][i % TILES],        \
                             sizeof(v8));                                                       \
    }
PS_KERNEL(1, 1) PS_KERNEL(2, 1) PS_KERNEL(1, 2) PS_KERNEL(2, 2)
#if PS_QB > 2
PS_KERNEL(3, 1) PS_KERNEL(4, 1) PS_KERNEL(5, 1) PS_KERNEL(6, 1)
PS_KERNEL(3, 2) PS_KERNEL(4, 2) PS_KERNEL(5, 2) PS_KERNEL(6, 2)
#endif
typedef void (*ps_block_fn)(const float *const *, const v8 *, int, float *const *);
static const ps_block_fn PS_BLOCKS[PS_QB + 1][3] = {
    {0, 0, 0}, {0, ps_block_1_1, ps_block_1_2}, {0, ps_block_2_1, ps_block_2_2},
#if PS_QB > 2
    {0, ps_block_3_1, ps_block_3_2}, {0, ps_block_4_1, ps_block_4_2},
    {0, ps_block_5_1, ps_block_5_2}, {0, ps_block_6_1, ps_block_6_2},
#endif
};

/* Scores of tokens toks[0..n-1] for query heads hh..hh+heads-1 (all of one key/value head:
   GQA's query heads read the same keys; kr[i] token i's keys, lo[i] and n0[i] the first key it
   sees and its prefix's end, as attend_group holds them) for every key in [*from, *to):
   the run of 8-key tiles that every token sees whole, at the same place for all (their tables
   name the same blocks there). Written where attend_group's loop writes them (scores +
   (t * H + head) * L + p); *from == *to: none here (too few queries, or no such run). Each
   tile's transposition serves heads x n queries: query e is head hh + e / n, token toks[e % n]. */
static void prompt_scores(const float *q, long qd, int hh, int heads, int hd, const kv_rows *kr,
                          const long *toks, long n, const long *lo, const long *n0, float *scores,
                          int H, long L, long *from, long *to) {
    *from = *to = 0;
    long queries = n * heads;
    if (queries < PS_MIN_QUERIES) return;
    long a = 0, b = n0[0];
    for (long i = 0; i < n; i++) {
        if (lo[i] > a) a = lo[i];
        if (n0[i] < b) b = n0[i];
    }
    a = (a + 7) / 8 * 8;
    b = b / 8 * 8;
    for (long i = 1; i < n && a < b; i++) {
        if (!kr[0].table) {                        /* a contiguous cache: one row only */
            if (kr[i].base != kr[0].base) b = a;
            continue;
        }
        int shift = __builtin_ctzl((unsigned long)kr[0].block);
        for (long k = a >> shift; k <= (b - 1) >> shift; k++)
            if (kr[i].table[k] != kr[0].table[k]) {
                long end = (k << shift) / 8 * 8;
                b = end > a ? end : a;
                break;
            }
    }
    if (b - a < 8) return;
    int chunks = hd / 8;
    static __thread v8 kt[2 * MAX_HEAD_DIM];          /* two tiles: 2 x (hd / 8) x 8 vectors */
    const float *qv[PS_QB];
    float *out[PS_QB];
    for (long p = a; p < b; p += 16) {
        int tiles = p + 16 <= b ? 2 : 1;
        for (int t = 0; t < tiles; t++) {
            /* keys p + 8t .. + 7: two groups of four stored one after another (a block holds
               a power of 2, at least 4, positions: as dot8 reads them) */
            const float *k0 = kv_at(&kr[0], p + 8 * t), *k1 = kv_at(&kr[0], p + 8 * t + 4);
            for (int c = 0; c < chunks; c++) {
                const float *rows[8];
                for (int r = 0; r < 8; r++)
                    rows[r] = (r < 4 ? k0 + (long)r * hd : k1 + (long)(r - 4) * hd) + 8 * c;
                ps_transpose8(rows, kt + ((long)t * chunks + c) * 8);
            }
        }
        for (long e0 = 0; e0 < queries; e0 += PS_QB) {
            int m = queries - e0 < PS_QB ? (int)(queries - e0) : PS_QB;
            for (int i = 0; i < m; i++) {
                long t = toks[(e0 + i) % n], head = hh + (e0 + i) / n;
                qv[i] = q + t * qd + head * hd;
                out[i] = scores + (t * H + head) * L + p;
            }
            PS_BLOCKS[m][tiles](qv, kt, chunks, out);
        }
    }
    *from = a;
    *to = b;
}
