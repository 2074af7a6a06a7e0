/* Paged decode attention for the CPU (chapter 08): one query row per request, read against its
   keys and values where they lie, page by page, with no gathered copy of its context.

   out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, where K_b and V_b are the first
   context_lens[b] tokens of request b's pages (page_tables[b]) and h reads kv head
   h / (num_heads / num_kv_heads) (grouped-query attention).

   Caches are [num_pages, page_size, num_kv_heads, head_dim], as in minicb/attention, in float32
   (paged_decode_attention) or bfloat16 (paged_decode_attention_bf16); q and out are float32,
   and all arithmetic is float32. Work is split over requests with OpenMP: the process already
   holds PyTorch's libgomp, so this shares its thread pool, with as many threads as the caller's
   torch.get_num_threads().
   Built once by minicb/attention/cpu_kernel.py with the system C compiler. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* e^x for x <= 0 (a score minus its row's maximum), to about 2e-7 relative: glibc's expf is a
   function call the compiler cannot vectorize, and at one call per key and head it took a
   quarter of the kernel's time. Cody-Waite reduction to x = n ln2 + r, |r| <= ln2 / 2, then
   Cephes' degree-6 polynomial for e^r, then 2^n through the float's exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* below that e^x is under float's smallest normal */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t bits; float value; } two_to_n = {.bits = ((int32_t)n + 127) << 23};
    return p * two_to_n.value;
}

/* One token's row of a cache [kv_heads * head_dim] as float32: the cache's own memory when it
   is float32, else the row widened into `scratch` (bfloat16 is the top half of a float32's
   bits). Widening in its own plain loop lets gcc vectorize it; inside the `omp simd` loops
   below, the type pun kept them scalar (4x slower). Also asks the memory system for the same
   row of the next page (`ahead`, -1 for none): pages lie anywhere in the pool, so the hardware
   prefetcher cannot guess where the next one is, but the page table knows. */
static inline __attribute__((always_inline))
const float *read_token(const void *cache, int64_t token, int64_t ahead, int64_t length,
                        float *scratch, const int bf16) {
    const int64_t element = bf16 ? 2 : 4, line = 64 / element;  /* elements per cache line */
    if (ahead >= 0)
        for (int64_t c = 0; c < length; c += line)
            __builtin_prefetch((const char *)cache + (ahead + c) * element);
    if (!bf16) return (const float *)cache + token;
    const uint16_t *half = (const uint16_t *)cache + token;
    uint32_t *bits = (uint32_t *)scratch;
    for (int64_t c = 0; c < length; c++) bits[c] = (uint32_t)half[c] << 16;
    return scratch;
}

/* The first element of the page holding context position `start` (a page boundary), and of
   the page after it (-1 when the context ends on this page). */
static inline __attribute__((always_inline))
int64_t locate_page(const int32_t *table, int64_t start, int64_t ctx, int64_t page_size,
                    int64_t page_stride, int64_t *next) {
    *next = start + page_size < ctx ? table[start / page_size + 1] * page_stride : -1;
    return table[start / page_size] * page_stride;
}

/* The kernel, for either cache type; `bf16` is a constant in each caller below, so the compiler
   builds two loops, each without a branch in it. Returns 0, or 1 if a thread could not
   allocate its score buffer (out is then incomplete). */
static inline __attribute__((always_inline))
int attend_pages(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                 float *out, const int32_t *page_tables, int64_t table_stride,
                 const int32_t *context_lens, int64_t num_rows, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t page_size, int64_t max_context,
                 float scale, int64_t num_threads, const int bf16)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  /* next token in a page */
    const int64_t page_stride = page_size * token_stride;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads > 0 ? (int)num_threads : 1)
    {
        /* exact two-pass softmax: all of a row's scores first, so each key and value is read
           once and no running rescale is needed */
        const int64_t score_count = num_heads * (max_context > 0 ? max_context : 1);
        float *scores = malloc(sizeof(float) * (size_t)score_count);
        float *scratch = malloc(sizeof(float) * (size_t)token_stride);
        if (!scores || !scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        /* one request per work item, all its heads together: a page is then read front to
           back, one contiguous block, which the hardware prefetcher streams (split by kv head,
           each item read a third of every page and ran 1.7x slower once caches went cold).
           Fewer requests than threads (one decoded stream) split each by kv head, so no
           thread idles; a head's arithmetic is the same either way. */
        const int64_t splits = num_rows < num_threads ? num_kv_heads : 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * splits; item++) {
            if (!scores || !scratch) continue;
            const int64_t b = item / splits, h0 = item % splits * (num_heads / splits);
            const int64_t h1 = h0 + num_heads / splits;
            /* the caller sized the score buffers for max_context: never read past it */
            const int64_t ctx = context_lens[b] < max_context ? context_lens[b] : max_context;
            const int32_t *table = page_tables + b * table_stride;
            const float *qb = q + b * q_row_stride;
            float *ob = out + b * num_heads * head_dim;
            for (int64_t i = h0 * head_dim; i < h1 * head_dim; i++) ob[i] = 0.0f;
            if (ctx <= 0) continue;

            /* pass 1: every head's score against each key, page by page (no division per
               token) */
            for (int64_t start = 0, next; start < ctx; start += page_size) {
                const int64_t n = ctx - start < page_size ? ctx - start : page_size;
                const int64_t page = locate_page(table, start, ctx, page_size, page_stride, &next);
                for (int64_t i = 0; i < n; i++) {
                    const float *keys = read_token(k_cache, page + i * token_stride,
                                                   next < 0 ? -1 : next + i * token_stride,
                                                   token_stride, scratch, bf16);
                    for (int64_t h = h0; h < h1; h++) {
                        const float *k = keys + (h / group) * head_dim;
                        const float *qh = qb + h * head_dim;
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * k[d];
                        scores[h * max_context + start + i] = dot * scale;
                    }
                }
            }
            /* softmax over each head's scores, in place */
            for (int64_t h = h0; h < h1; h++) {
                float *s = scores + h * max_context;
                float top = s[0];
                #pragma omp simd reduction(max:top)
                for (int64_t t = 1; t < ctx; t++) top = s[t] > top ? s[t] : top;
                float total = 0.0f;
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < ctx; t++) {
                    s[t] = exp_nonpositive(s[t] - top);
                    total += s[t];
                }
                const float inv = 1.0f / total;
                for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
            }
            /* pass 2: the probability-weighted sum of the values, page by page */
            for (int64_t start = 0, next; start < ctx; start += page_size) {
                const int64_t n = ctx - start < page_size ? ctx - start : page_size;
                const int64_t page = locate_page(table, start, ctx, page_size, page_stride, &next);
                for (int64_t i = 0; i < n; i++) {
                    const float *values = read_token(v_cache, page + i * token_stride,
                                                     next < 0 ? -1 : next + i * token_stride,
                                                     token_stride, scratch, bf16);
                    for (int64_t h = h0; h < h1; h++) {
                        const float *v = values + (h / group) * head_dim;
                        const float p = scores[h * max_context + start + i];
                        float *oh = ob + h * head_dim;
                        #pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) oh[d] += p * v[d];
                    }
                }
            }
        }
        free(scores);
        free(scratch);
    }
    return failed;
}

#define ARGUMENTS                                                                                \
    const float *q, int64_t q_row_stride,          /* [rows, num_heads, head_dim] */            \
    const void *k_cache, const void *v_cache,      /* [pages, page_size, kv_heads, head_dim] */ \
    float *out,                                    /* [rows, num_heads, head_dim], contiguous */ \
    const int32_t *page_tables, int64_t table_stride,  /* [rows, >= pages needed] */            \
    const int32_t *context_lens,                   /* [rows] */                                 \
    int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                \
    int64_t page_size, int64_t max_context, float scale,                                    \
    int64_t num_threads          /* the caller's torch.get_num_threads() */
#define PASS q, q_row_stride, k_cache, v_cache, out, page_tables, table_stride, context_lens, \
    num_rows, num_heads, num_kv_heads, head_dim, page_size, max_context, scale, num_threads

int paged_decode_attention(ARGUMENTS) { return attend_pages(PASS, 0); }
int paged_decode_attention_bf16(ARGUMENTS) { return attend_pages(PASS, 1); }
