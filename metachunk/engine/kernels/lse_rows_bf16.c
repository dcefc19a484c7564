/* The log-sum-exp of each row of a bfloat16 matrix, in float32: the normaliser of the LM head's
 * logits that PPL scoring needs for every position and every vocabulary entry.
 *
 * Why C: torch has no CPU kernel that reduces bfloat16 rows in float32 without first writing a
 * float32 copy. Its way (copy, then log_softmax in place) makes four passes over a 1,024 x 8,192
 * tile; this makes two over each 16 KB row while it sits in L1: the max, then the sum of exps.
 *
 * AVX-512F only: a CPU with native bfloat16 compute (AVX-512 BF16 or AMX, the CPUs on which
 * --dtype auto picks bfloat16) has it. metachunk/engine/kernels/__init__.py compiles and loads this file
 * and checks the flag; the caller keeps torch's ops everywhere else.
 *
 * exp is a degree-5 polynomial for 2^f on [0, 1) scaled by 2^n (vscalefps): relative error
 * below 2e-7, under float32's own rounding of a sum of 8,192 terms. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline float bf16_to_float(uint16_t v) {
    union {
        uint32_t u;
        float f;
    } bits;
    bits.u = (uint32_t)v << 16;
    return bits.f;
}

/* exp(x) for x <= 0 (below -87 it returns exp(-87), which no sum of these rows notices). */
static inline __m512 exp_nonpositive_x16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)); /* log2(e) */
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.8775767e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9893397e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826318e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999994e-1f));
    return _mm512_scalef_ps(p, n);
}

/* out[r * out_stride] = log(sum_c exp(x[r * row_stride + c])) for r < rows, c < cols. */
void lse_rows_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t row_stride, float *out,
                   int64_t out_stride) {
    int64_t body = cols - cols % 16;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * row_stride;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0; /* max_ps drops a NaN; torch's log-sum-exp of a row with one is NaN */
        for (int64_t c = 0; c < body; c += 16) {
            __m512 v = load_bf16x16(p + c);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vmax = _mm512_max_ps(vmax, v);
        }
        float m = _mm512_reduce_max_ps(vmax);
        for (int64_t c = body; c < cols; c++) {
            float v = bf16_to_float(p[c]);
            nan |= isnan(v);
            m = fmaxf(m, v);
        }
        if (nan || isinf(m)) { /* NaN; all -inf (or a +inf): no finite normaliser to shift by */
            out[r * out_stride] = nan ? NAN : m;
            continue;
        }
        /* two accumulators: consecutive adds do not wait on each other */
        __m512 vm = _mm512_set1_ps(m), s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 32 <= body; c += 32) {
            s0 = _mm512_add_ps(s0, exp_nonpositive_x16(_mm512_sub_ps(load_bf16x16(p + c), vm)));
            s1 = _mm512_add_ps(s1, exp_nonpositive_x16(_mm512_sub_ps(load_bf16x16(p + c + 16), vm)));
        }
        for (; c < body; c += 16) s0 = _mm512_add_ps(s0, exp_nonpositive_x16(_mm512_sub_ps(load_bf16x16(p + c), vm)));
        float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        for (c = body; c < cols; c++) s += expf(bf16_to_float(p[c]) - m);
        out[r * out_stride] = m + logf(s);
    }
}
