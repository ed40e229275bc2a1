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

/* embeds, hidden: [T, D] (the tokens' embeddings and the hidden each pairs with); out: [T, D]
   the layer's pre-norm output; normed: [T, D] out through the head's final norm (nf), or NULL
   where nf is NULL; rows/pos: [T] each token's cache row and position (its key and value go to
   slot pos); kc/vc: the head's cache [rows, Hkv, S, hd]; wq/wk/wv: [H*hd or Hkv*hd, 2*D];
   bq/bk/bv: biases or NULL; n_in/n_hidden/n_post: the layer's three norms; nbr: the residual is
   hidden_norm(hidden) (norm_before_residual) rather than hidden. Tokens of one row are
   consecutive and in position order (a run, attention loads its keys once for all of them).
   scratch: >= specpair_eagle3_scratch(T, D, H, Hkv, hd, F, max pos + 1) floats. */
long specpair_eagle3_scratch(long T, long D, int H, int Hkv, int hd, long F, long L) {
    long qd = (long)H * hd, kd = (long)Hkv * hd;
    return T * (2 * D + 2 * qd + 2 * kd + 2 * F + 2 * D) + T * H * L + F;
}

int specpair_eagle3_layer(const float *embeds, const float *hidden, float *out, float *normed,
                          const long *rows, const long *pos, long T, long D, int H, int Hkv,
                          int hd, long F, float eps, const float *cos, const float *sin,
                          float *kc, float *vc, long S, const float *wq, const float *wk,
                          const float *wv, const float *wo, const float *wg, const float *wu,
                          const float *wd, const float *bq, const float *bk, const float *bv,
                          const float *n_in, const float *n_hidden, const float *n_post,
                          const float *nf, int nbr, float *scratch, int threads) {
    if (T < 1 || T > MAX_TOKENS || hd % 8 || hd > MAX_HEAD_DIM || H % Hkv) return -1;
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
    attention_out_and_mlp(att, res, out, wo, n_post, wg, wu, wd, x, g, u, o, scores + T * H * L,
                          T, D, qd, F, eps, threads);
    if (nf && normed)
        for (long t = 0; t < T; t++) rms_norm(out + t * D, nf, normed + t * D, D, eps);
    return 0;
}
