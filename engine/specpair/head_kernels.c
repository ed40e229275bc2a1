/* An EAGLE-3 head's decoder layer for a few tokens of several rows, in one call (head_kernels.py).

   The head's layer (eagle3.Eagle3Layer, vLLM's Eagle3LlamaForCausalLM layer) is a Llama layer
   except before its attention: q, k and v read [input_layernorm(embedding), hidden_norm(hidden)],
   2 * D wide, and the residual is the hidden alone (or its norm: norm_before_residual). In eager
   PyTorch its ~40 small operations a step cost more than its arithmetic on the CPU (a round of
   three drafts for one row took ~20 ms beside a ~85 ms target verification of SmolLM2, one
   thread); here a step of every drafting row is one call, and the head's final norm rides along
   (what the draft vocabulary's logits read).

   It reuses the target's layer kernel's parts (cpu_kernels.c, included as it is: the same
   products, rotary embedding, cache writes and attention), so every token's result is computed
   in the same order whatever the other tokens in the call are: a row's drafts are bitwise the
   same alone and in a batch. */

#include "cpu_kernels.c"
#include <omp.h>
#include <stdlib.h>

/* ---- The LM head's top-1, fused: greedy drafting reads only each row's argmax ----------------

   A greedy draft is the argmax of the head's logits over its draft vocabulary. Written out
   whole (cpu_kernels.linear) a row is 4 * Vd bytes stored and read back by a top-k, and the
   LM head is most of a step (SmolLM2's 49,152 tokens: 4.6 of 5.5 CPU ms a row, the top-k 0.2;
   bench/head_top1.py). Here each thread scores its contiguous share of the vocabulary
   TOP_BLOCK tokens at a time into a buffer that stays in L1 and folds each block into a running
   (max, index) per row; the threads' results are folded in vocabulary order. Each logit is
   computed by rows_block, as specpair_small_linear computes it (every output the same sum in
   the same order whatever the tiling), so the index is the argmax of the logits the unfused LM
   head writes. Ties go as torch.argmax's: the lowest index among equal maxima, the first NaN
   where there is one (a NaN beats every number, no later one beats it). */
#define TOP_BLOCK 16

/* Whether (v, at) replaces the running best (b, bi): bi < 0 is no best yet. Blocks and threads
   are folded in index order, so a strict > keeps the lowest index of equal values. */
static inline int top_beats(float v, float b, long bi) {
    return bi < 0 || v > b || (v != v && b == b);
}

/* top[p] = argmax over v < V of x[p] . W[v] for p < P (x [P, I], W [V, I], float32, contiguous;
   1 <= P <= MAX_TOKENS). -> 0, or -1 (a bad size) or -4 (no memory). */
int specpair_top1_linear(const float *x, const float *W, long *top, long P, long I, long V,
                         int threads) {
    if (P < 1 || P > MAX_TOKENS || V < 1 || I < 1) return -1;
    long blocks = (V + TOP_BLOCK - 1) / TOP_BLOCK;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
    float *best = malloc(sizeof(float) * threads * P);
    long *at = malloc(sizeof(long) * threads * P);
    if (!best || !at) {
        free(best);
        free(at);
        return -4;
    }
    int used = 1;
    long passes = (P + 7) / 8;      /* as specpair_small_linear: passes of at most 8 rows */
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        if (t == 0) used = n;
        float buf[MAX_TOKENS * TOP_BLOCK], *b = best + (long)t * P;
        long *bi = at + (long)t * P;
        for (long p = 0; p < P; p++) bi[p] = -1, b[p] = 0.0f;
        for (long k = blocks * t / n; k < blocks * (t + 1) / n; k++) {
            long o0 = k * TOP_BLOCK, width = o0 + TOP_BLOCK < V ? TOP_BLOCK : V - o0;
            for (long c = 0; c < passes; c++) {
                long m0 = P * c / passes, m1 = P * (c + 1) / passes;
                rows_block(x + m0 * I, W + o0 * I, buf + m0 * TOP_BLOCK, I, TOP_BLOCK, 0, width,
                           m1 - m0);
            }
            for (long p = 0; p < P; p++)
                for (long o = 0; o < width; o++) {
                    float v = buf[p * TOP_BLOCK + o];
                    if (top_beats(v, b[p], bi[p])) b[p] = v, bi[p] = o0 + o;
                }
        }
    }
    for (long p = 0; p < P; p++) {
        float b = 0.0f;
        long bi = -1;
        for (int t = 0; t < used; t++)
            if (at[(long)t * P + p] >= 0 && top_beats(best[(long)t * P + p], b, bi))
                b = best[(long)t * P + p], bi = at[(long)t * P + p];
        top[p] = bi;
    }
    free(best);
    free(at);
    return 0;
}

/* embeds, hidden: [T, D] (the tokens' embeddings and the hidden each pairs with); out: [T, D]
   the layer's pre-norm output; normed: [T, D] out through the head's final norm (nf), or NULL
   where nf is NULL; rows/pos: [T] each token's cache row and position (its key and value go to
   slot pos); kc/vc: the head's cache [rows, Hkv, S, hd]; wq/wk/wv: [H*hd or Hkv*hd, 2*D];
   bq/bk/bv: biases or NULL; n_in/n_hidden/n_post: the layer's three norms; nbr: the residual is
   hidden_norm(hidden) (norm_before_residual) rather than hidden. Tokens of one row are
   consecutive and in position order (a run, attention loads its keys once for all of them).
   lm: the head's LM head [V, D] or NULL; where given, top[p] = the argmax of normed row pick[p]
   against it, p < P (specpair_top1_linear, so greedy drafting writes no logits row; pick NULL:
   every token, P = T; 1 <= P <= MAX_TOKENS, each pick in 0..T-1; nf and normed needed).
   scratch: >= specpair_eagle3_scratch(T, D, H, Hkv, hd, F, max pos + 1) floats. */
long specpair_eagle3_scratch(long T, long D, int H, int Hkv, int hd, long F, long L) {
    long qd = (long)H * hd, kd = (long)Hkv * hd;
    return T * (2 * D + 2 * qd + 2 * kd + 2 * F + 2 * D) + T * H * L + F + MAX_TOKENS * D;
}

int specpair_eagle3_layer(const float *embeds, const float *hidden, float *out, float *normed,
                          const long *rows, const long *pos, long T, long D, int H, int Hkv,
                          int hd, long F, float eps, const float *cos, const float *sin,
                          float *kc, float *vc, long S, const float *wq, const float *wk,
                          const float *wv, const float *wo, const float *wg, const float *wu,
                          const float *wd, const float *bq, const float *bk, const float *bv,
                          const float *n_in, const float *n_hidden, const float *n_post,
                          const float *nf, int nbr, float *scratch, int threads,
                          const float *lm, long V, const long *pick, long P, long *top) {
    if (T < 1 || T > MAX_TOKENS || hd % 8 || hd > MAX_HEAD_DIM || H % Hkv) return -1;
    if (lm) {
        if (!nf || !normed || !top || (pick ? P < 1 || P > MAX_TOKENS : P != T)) return -1;
        for (long p = 0; pick && p < P; p++)
            if (pick[p] < 0 || pick[p] >= T) return -1;
    }
    long qd = (long)H * hd, kd = (long)Hkv * hd, L = 0;
    for (long t = 0; t < T; t++) {
        if (pos[t] < 0) return -2;
        if (pos[t] + 1 > L) L = pos[t] + 1;
        /* a run's tokens in position order, each one after the last */
        if (t > 0 && rows[t] == rows[t - 1] && pos[t] != pos[t - 1] + 1) return -3;
    }
    if (L > S) return -2;
    float *x = scratch, *q = x + T * 2 * D, *k = q + T * qd, *v = k + T * kd, *att = v + T * kd;
    float *g = att + T * qd, *u = g + T * F, *o = u + T * F, *res = o + T * D;
    float *scores = res + T * D;

    for (long t = 0; t < T; t++) {
        float *xt = x + t * 2 * D, *rt = res + t * D;
        rms_norm(embeds + t * D, n_in, xt, D, eps);
        rms_norm(hidden + t * D, n_hidden, xt + D, D, eps);
        for (long i = 0; i < D; i++) rt[i] = nbr ? xt[D + i] : hidden[t * D + i];
    }
    {
        const float *Ws[3] = {wq, wk, wv};
        float *ys[3] = {q, k, v};
        long Os[3] = {qd, kd, kd};
        run_linear(x, Ws, ys, Os, 3, T, 2 * D, threads);
    }
    for (long t = 0; t < T; t++) {
        float *qt = q + t * qd, *kt = k + t * kd, *vt = v + t * kd;
        if (bq) for (long i = 0; i < qd; i++) qt[i] += bq[i];
        if (bk) for (long i = 0; i < kd; i++) kt[i] += bk[i];
        if (bv) for (long i = 0; i < kd; i++) vt[i] += bv[i];
        rope(qt, cos + t * hd, sin + t * hd, H, hd);
        rope(kt, cos + t * hd, sin + t * hd, Hkv, hd);
        for (int j = 0; j < Hkv; j++) {
            long at = ((rows[t] * Hkv + j) * S + pos[t]) * hd;
            __builtin_memcpy(kc + at, kt + (long)j * hd, hd * sizeof(float));
            __builtin_memcpy(vc + at, vt + (long)j * hd, hd * sizeof(float));
        }
    }
    long run_start[MAX_TOKENS + 1], runs = 0;
    for (long t = 0; t < T; t++)
        if (t == 0 || rows[t] != rows[t - 1]) run_start[runs++] = t;
    run_start[runs] = T;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long task = 0; task < runs * H; task++) {
        long r = task / H;
        int hh = (int)(task % H);
        attend_run(q, kc, vc, att, scores, pos, NULL, NULL, rows[run_start[r]], run_start[r],
                   run_start[r + 1], hh, H, Hkv, hd, S, L, 0, NULL, 0, 0);
    }
    attention_out_and_mlp(att, res, out, wo, n_post, wg, wu, wd, x, g, u, o, T, D, qd, F, eps,
                          threads);
    if (nf && normed)
        for (long t = 0; t < T; t++) rms_norm(out + t * D, nf, normed + t * D, D, eps);
    if (!lm) return 0;
    const float *picked = normed;
    if (pick) {      /* the picked rows gathered after everything the layer's scratch holds */
        float *rowsp = scores + T * H * L + F;
        for (long p = 0; p < P; p++)
            __builtin_memcpy(rowsp + p * D, normed + pick[p] * D, D * sizeof(float));
        picked = rowsp;
    }
    return specpair_top1_linear(picked, lm, top, P, D, V, threads);
}
