/* The CPU backend's small kernels (chapter 08): a product of one row, RMSNorm and RoPE, in
   float32. At one decoded row a step reads every weight once and does little else, so it runs
   at the speed of memory, plus whatever it spends between reads: here each operation is one
   call over plain arrays, where PyTorch dispatches several small ones.
   Built with paged_decode.c by minicb/attention/cpu_kernel.py; threads are OpenMP's, as many as
   the caller's torch.get_num_threads(). */

#include <math.h>
#include <stdint.h>

/* y[r] = w[r, :] . x (+ bias[r]) for one row x [in], w in nn.Linear's [out, in] layout: each
   weight row is read once, front to back, and the rows are split over the threads. */
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t out,
              int64_t in, int64_t num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < out; r++) {
        const float *row = w + r * in;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int64_t k = 0; k < in; k++) dot += x[k] * row[k];
        y[r] = bias ? dot + bias[r] : dot;
    }
}

/* out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)) for rows x [rows, dim] (row stride
   x_stride), out contiguous: torch_ref.rms_norm's arithmetic, summed in another order. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps, int64_t num_threads) {
    #pragma omp parallel for num_threads(rows > 1 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * dim, squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += xt[d] * xt[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) ot[d] = weight[d] * (xt[d] * inv);
    }
}

/* Rotate q and k in place by each token's angles (cos, sin: [tokens, head_dim / 2]), pairing
   element i of a head with i + head_dim / 2 as transformers' rotate_half does. Head h of token t
   starts at q + t * q_stride + h * head_dim (k likewise). */
static void rotate(float *x, int64_t stride, int64_t heads, int64_t t, int64_t head_dim,
                   const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + t * stride + h * head_dim, *b = a + half;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float ai = a[i], bi = b[i];
            a[i] = ai * c[i] - bi * s[i];
            b[i] = bi * c[i] + ai * s[i];
        }
    }
}

void rope_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride,
              int64_t k_heads, int64_t tokens, int64_t head_dim, const float *cos,
              const float *sin, int64_t num_threads) {
    #pragma omp parallel for num_threads(tokens > 1 ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * (head_dim / 2), *s = sin + t * (head_dim / 2);
        rotate(q, q_stride, q_heads, t, head_dim, c, s);
        rotate(k, k_stride, k_heads, t, head_dim, c, s);
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
    rms_norm_f32(x, hidden, input_norm, h, 1, hidden, eps, 1);
    gemv_f32(h, qkv_w, qkv_b, qkv, q_size + 2 * kv_size, hidden, num_threads);
    if (q_norm) {  /* each head normalized over head_dim, in place */
        rms_norm_f32(qkv, head_dim, q_norm, qkv, heads, head_dim, eps, 1);
        rms_norm_f32(k, head_dim, k_norm, k, kv_heads, head_dim, eps, 1);
    }
    rope_f32(qkv, q_size, heads, k, kv_size, kv_heads, 1, head_dim, cos, sin, 1);
    for (int64_t i = 0; i < kv_size; i++) {
        k_cache[slot * kv_size + i] = k[i];
        v_cache[slot * kv_size + i] = v[i];
    }
    if (paged_decode_attention(qkv, q_size, k_cache, v_cache, att, page_table, 0, context_len,
                               1, heads, kv_heads, head_dim, page_size, *context_len, scale, 1))
        return 1;
    gemv_f32(att, o_w, o_b, sum, hidden, q_size, num_threads);
    for (int64_t i = 0; i < hidden; i++) x[i] += sum[i];
    rms_norm_f32(x, hidden, post_norm, h, 1, hidden, eps, 1);
    gemv_f32(h, gate_up_w, 0, mlp, 2 * inter, hidden, num_threads);
    for (int64_t i = 0; i < inter; i++) mlp[i] = mlp[i] / (1.0f + expf(-mlp[i])) * mlp[inter + i];
    gemv_f32(mlp, down_w, 0, sum, hidden, inter, num_threads);
    for (int64_t i = 0; i < hidden; i++) x[i] += sum[i];
    return 0;
}
