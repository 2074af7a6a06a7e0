/* One decoded row on the CPU (chapter 08), in float32. At one row a decode step reads every
   weight once and does two flops per weight, so it runs at the speed of memory, plus whatever
   it spends between the reads: here a product streams each weight row once, and a whole
   decoder layer is one call, where PyTorch dispatches some thirty small operations.
   Built with paged_decode.c by minicb/attention/cpu_kernel.py; threads are OpenMP's, as many as
   the caller's torch.get_num_threads(). */

#include <math.h>
#include <stdint.h>

/* y[m, r] = x[m, :] . w[r, :] (+ bias[r]) for a few rows x [rows, in], w in nn.Linear's
   [out, in] layout: each weight row is read once, front to back (every x row dots it while it
   is in the L1 cache), and the weight rows are split over the threads. A row's arithmetic does
   not depend on the others. */
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows,
              int64_t out, int64_t in, int64_t num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < out; r++) {
        const float *row = w + r * in;
        for (int64_t m = 0; m < rows; m++) {
            const float *xm = x + m * in;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t k = 0; k < in; k++) dot += xm[k] * row[k];
            y[m * out + r] = bias ? dot + bias[r] : dot;
        }
    }
}

/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for `rows` rows of `dim` (in place when
   out is x): torch_ref.rms_norm's arithmetic, summed in another order. */
static void rms_norm_rows(const float *x, const float *weight, float *out, int64_t rows,
                          int64_t dim, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * dim;
        float *ot = out + t * dim, squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += xt[d] * xt[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) ot[d] = weight[d] * (xt[d] * inv);
    }
}

/* Rotate `heads` heads of head_dim in place by one token's angles (cos, sin: [head_dim / 2]),
   pairing element i with i + head_dim / 2 as transformers' rotate_half does. */
static void rope_heads(float *x, int64_t heads, int64_t head_dim, const float *cos,
                       const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * head_dim, *b = a + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float ai = a[i], bi = b[i];
            a[i] = ai * cos[i] - bi * sin[i];
            b[i] = bi * cos[i] + ai * sin[i];
        }
    }
}

int paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache,
                           const void *v_cache, float *out, const int32_t *page_tables,
                           int64_t table_stride, const int32_t *context_lens, int64_t num_rows,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t page_size, int64_t max_context, float scale,
                           int64_t num_threads);  /* paged_decode.c */

/* One decoded row through one decoder layer, in place on the residual stream x [hidden]: the
   arithmetic of minicb.model.llama.DecoderLayer for a single token, each step one of the
   kernels above, in one call where PyTorch dispatches about thirty operations.
     x += o_proj(attention(rope(qkv_proj(rms_norm(x)))))   (storing this token's k and v)
     x += down_proj(silu(gate) * up),  gate|up = gate_up_proj(rms_norm(x))
   Optional parts are NULL: the biases, q_norm and k_norm (Qwen3). `scratch` holds
   2 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * inter floats.
   Returns the attention kernel's status (0, or 1 when it could not allocate). */
int decode_layer_f32(float *x, float *scratch, const float *input_norm, const float *post_norm,
                     float eps, const float *qkv_w, const float *qkv_b, const float *q_norm,
                     const float *k_norm, const float *o_w, const float *o_b,
                     const float *gate_up_w, const float *down_w, const float *cos,
                     const float *sin, float *k_cache, float *v_cache, int64_t slot,
                     const int32_t *page_table, const int32_t *context_len, int64_t page_size,
                     int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t inter, float scale, int64_t num_threads) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    float *h = scratch, *sum = h + hidden, *qkv = sum + hidden, *att = qkv + q_size + 2 * kv_size;
    float *mlp = att + q_size, *k = qkv + q_size, *v = k + kv_size;
    rms_norm_rows(x, input_norm, h, 1, hidden, eps);
    gemv_f32(h, qkv_w, qkv_b, qkv, 1, q_size + 2 * kv_size, hidden, num_threads);
    if (q_norm) {  /* each head normalized over head_dim, in place */
        rms_norm_rows(qkv, q_norm, qkv, heads, head_dim, eps);
        rms_norm_rows(k, k_norm, k, kv_heads, head_dim, eps);
    }
    rope_heads(qkv, heads + kv_heads, head_dim, cos, sin);  /* q and k: adjacent */
    for (int64_t i = 0; i < kv_size; i++) {
        k_cache[slot * kv_size + i] = k[i];
        v_cache[slot * kv_size + i] = v[i];
    }
    if (paged_decode_attention(qkv, q_size, k_cache, v_cache, att, page_table, 0, context_len,
                               1, heads, kv_heads, head_dim, page_size, *context_len, scale,
                               num_threads))
        return 1;
    gemv_f32(att, o_w, o_b, sum, 1, hidden, q_size, num_threads);
    for (int64_t i = 0; i < hidden; i++) x[i] += sum[i];
    rms_norm_rows(x, post_norm, h, 1, hidden, eps);
    gemv_f32(h, gate_up_w, 0, mlp, 1, 2 * inter, hidden, num_threads);
    for (int64_t i = 0; i < inter; i++) mlp[i] = mlp[i] / (1.0f + expf(-mlp[i])) * mlp[inter + i];
    gemv_f32(mlp, down_w, 0, sum, 1, hidden, inter, num_threads);
    for (int64_t i = 0; i < hidden; i++) x[i] += sum[i];
    return 0;
}
