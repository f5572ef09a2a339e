/* The one-pass AdamW step on the CPU (tiered/optim/native.py builds this for the machine it
 * runs on): the gradient in the compute dtype (or fp32) read, fp32 master weights and moments
 * read and written, the new weights written in the compute dtype, in one pass over memory.
 *
 * The formulas, their order and the coefficients (`scalars`, from adamw._one_pass_scalars) are
 * those of adamw._adamw_one_pass as inductor compiles it, with no fused multiply-adds
 * (-ffp-contract=off): the results are the compiled kernel's, bit for bit (tests/test_adamw.py),
 * but for which NaN comes out where two meet: x86 gives an operation's first NaN operand, and
 * compilers order a sum's operands as they like, so its sign and payload may differ by path
 * (as they did between the old loop's vector body and its epilogue); a NaN is a NaN.
 * -fno-math-errno is what lets sqrtf vectorize.
 *
 * [Note: streaming the weights out] The new weights are written with non-temporal stores, so
 * that a store does not first read the line it overwrites. Straight from the registers: staged
 * in a buffer and streamed out after (the earlier form, as gcc cannot emit a streaming store
 * from a loop it vectorizes), the step ran 0.90-0.91x torch's fused kernel on 2 cores of the
 * reference VM; from the registers, 1.02-1.06x (bench/RESULTS.md, eighteenth session). So where
 * the CPU has AVX-512 the step is written with its intrinsics, 16 elements at a time: the same
 * operations in the same order as the portable loop, which steps the elements before the first
 * aligned store and after the last whole vector, and all of them elsewhere.
 */
#include <omp.h>

#include "adamw_kernel.h"

/* The step's coefficients, as adamw._one_pass_scalars gives them. */
typedef struct {
    float decay, beta2, avg_weight, sq_weight, eps, step_size, bias2_sqrt, divisor;
} Coefficients;

/* Element i of the portable loop. GRADIENT is its gradient as fp32, divided or not; the first
 * moment moves by lerp as torch computes it, from the nearer end (FROM: g, or exp_avg[i]) by
 * lerp_by. */
#define STEP_ELEMENT(GRADIENT, FROM, TO_WEIGHT)                                                 \
    {                                                                                           \
        const float g = GRADIENT;                                                               \
        const float m = (FROM) + lerp_by * (g - exp_avg[i]);                                    \
        const float v = exp_avg_sq[i] * c.beta2 + g * (g * c.sq_weight);                        \
        const float p = master[i] * c.decay - c.step_size * m / (sqrtf(v) / c.bias2_sqrt + c.eps); \
        exp_avg[i] = m;                                                                         \
        exp_avg_sq[i] = v;                                                                      \
        master[i] = p;                                                                          \
        weights[i] = TO_WEIGHT(p);                                                              \
    }

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const bf16_bits *p) {
    const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

/* to_bf16 on 16 values, streamed to dst (32-byte aligned). */
static inline void stream16_bf16(bf16_bits *dst, __m512 p) {
    const __m512i u = _mm512_castps_si512(p), high = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i bits = _mm512_mask_mov_epi32(rounded, nan,
                                               _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_stream_si256((__m256i *)dst, _mm512_cvtepi32_epi16(bits));
}

#if defined(__FLT16_MAX__)
static inline __m512 load16_f16(const _Float16 *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void stream16_f16(_Float16 *dst, __m512 p) {
    _mm256_stream_si256((__m256i *)dst,
                        _mm512_cvtps_ph(p, _MM_FROUND_CUR_DIRECTION)); /* as (_Float16)f */
}
#endif

/* Elements [i, i + 16) by AVX-512, as STEP_ELEMENT steps each. */
#define STEP_VECTOR(G, W, HAS_DIVISOR, FROM_END)                                                \
    {                                                                                           \
        __m512 g = load16_##G(grad + i);                                                        \
        if (HAS_DIVISOR)                                                                        \
            g = _mm512_div_ps(g, _mm512_set1_ps(c.divisor));                                    \
        const __m512 m_old = _mm512_loadu_ps(exp_avg + i);                                      \
        const __m512 m = _mm512_add_ps(FROM_END ? g : m_old,                                    \
                                       _mm512_mul_ps(_mm512_set1_ps(lerp_by),                   \
                                                     _mm512_sub_ps(g, m_old)));                 \
        const __m512 v = _mm512_add_ps(                                                         \
            _mm512_mul_ps(_mm512_loadu_ps(exp_avg_sq + i), _mm512_set1_ps(c.beta2)),            \
            _mm512_mul_ps(g, _mm512_mul_ps(g, _mm512_set1_ps(c.sq_weight))));                   \
        const __m512 denominator = _mm512_add_ps(                                               \
            _mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bias2_sqrt)),                     \
            _mm512_set1_ps(c.eps));                                                             \
        const __m512 p = _mm512_sub_ps(                                                         \
            _mm512_mul_ps(_mm512_loadu_ps(master + i), _mm512_set1_ps(c.decay)),                \
            _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.step_size), m), denominator));         \
        _mm512_storeu_ps(exp_avg + i, m);                                                       \
        _mm512_storeu_ps(exp_avg_sq + i, v);                                                    \
        _mm512_storeu_ps(master + i, p);                                                        \
        stream16_##W(weights + i, p);                                                           \
    }
#endif

/* Elements [lo, hi): by vectors from the first whose weights are 32-byte aligned (the streaming
 * store's need), element by element before it and after the last whole vector. step_g*_w*
 * calls it with HAS_DIVISOR and FROM_END fixed, four ways: x / 1 is x, to the bit, so without
 * a divisor the step has one division fewer (two, as the fused kernel's). */
#define STEP_RANGE(G, GRAD_T, W, WEIGHT_T)                                                      \
    static inline __attribute__((always_inline)) void step_range_g##G##_w##W(                   \
        Coefficients c, int has_divisor, int from_end, float *restrict master,                  \
        const GRAD_T *restrict grad, float *restrict exp_avg, float *restrict exp_avg_sq,       \
        WEIGHT_T *restrict weights, int64_t lo, int64_t hi) {                                   \
        const float lerp_by = from_end ? -(1.0f - c.avg_weight) : c.avg_weight;                 \
        int64_t vectors = lo, tail = lo;                                                        \
        VECTOR_BOUNDS(WEIGHT_T)                                                                 \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = lo; i < vectors; i++)                                                  \
            STEP_ELEMENT(has_divisor ? from_##G(grad[i]) / c.divisor : from_##G(grad[i]),       \
                         from_end ? g : exp_avg[i], to_##W)                                     \
        VECTOR_LOOP(G, W)                                                                       \
        _Pragma("omp simd")                                                                     \
        for (int64_t i = tail; i < hi; i++)                                                     \
            STEP_ELEMENT(has_divisor ? from_##G(grad[i]) / c.divisor : from_##G(grad[i]),       \
                         from_end ? g : exp_avg[i], to_##W)                                     \
    }                                                                                           \
    static void step_g##G##_w##W(Coefficients c, float *restrict master,                        \
                                 const GRAD_T *restrict grad, float *restrict exp_avg,          \
                                 float *restrict exp_avg_sq, WEIGHT_T *restrict weights,        \
                                 int64_t lo, int64_t hi) {                                      \
        const int has_divisor = c.divisor != 1.0f, from_end = fabsf(c.avg_weight) >= 0.5f;      \
        if (has_divisor && from_end)                                                            \
            step_range_g##G##_w##W(c, 1, 1, master, grad, exp_avg, exp_avg_sq, weights, lo, hi); \
        else if (has_divisor)                                                                   \
            step_range_g##G##_w##W(c, 1, 0, master, grad, exp_avg, exp_avg_sq, weights, lo, hi); \
        else if (from_end)                                                                      \
            step_range_g##G##_w##W(c, 0, 1, master, grad, exp_avg, exp_avg_sq, weights, lo, hi); \
        else                                                                                    \
            step_range_g##G##_w##W(c, 0, 0, master, grad, exp_avg, exp_avg_sq, weights, lo, hi); \
    }

#if defined(__AVX512F__)
/* vectors: the first element whose weights are aligned (or hi); tail: after the last vector. */
#define VECTOR_BOUNDS(WEIGHT_T)                                                                 \
    vectors = lo + (int64_t)((32 - ((uintptr_t)(weights + lo) & 31)) & 31) / sizeof(WEIGHT_T); \
    /* weights not on their own type's alignment never reach 32 bytes: all element by element */ \
    vectors = vectors < hi && (uintptr_t)weights % sizeof(WEIGHT_T) == 0 ? vectors : hi;       \
    tail = vectors + (hi - vectors) / 16 * 16;
#define VECTOR_LOOP(G, W)                                                                       \
    for (int64_t i = vectors; i < tail; i += 16)                                                \
        STEP_VECTOR(G, W, has_divisor, from_end)
#else
#define VECTOR_BOUNDS(WEIGHT_T) vectors = tail = lo;
#define VECTOR_LOOP(G, W)
#endif

/* Each thread of the team steps one contiguous range, a whole number of vectors long (the
 * team's size as it is: OpenMP may give fewer threads than asked for). */
#define ONE_PASS(G, GRAD_T, W, WEIGHT_T)                                                        \
    STEP_RANGE(G, GRAD_T, W, WEIGHT_T)                                                          \
    void one_pass_g##G##_w##W(float *restrict master, const GRAD_T *restrict grad,              \
                              float *restrict exp_avg, float *restrict exp_avg_sq,              \
                              WEIGHT_T *restrict weights, int64_t n, const float *scalars,      \
                              int threads) {                                                    \
        Coefficients c;                                                                         \
        memcpy(&c, scalars, sizeof c);                                                          \
        _Pragma("omp parallel num_threads(threads)")                                            \
        {                                                                                       \
            const int64_t team = omp_get_num_threads();                                         \
            const int64_t per_thread = ((n + team - 1) / team + 15) & ~(int64_t)15;             \
            const int64_t lo = omp_get_thread_num() * per_thread;                               \
            const int64_t hi = lo + per_thread < n ? lo + per_thread : n;                       \
            if (lo < hi)                                                                        \
                step_g##G##_w##W(c, master, grad, exp_avg, exp_avg_sq, weights, lo, hi);        \
            fence(); /* each thread's own streaming stores */                                   \
        }                                                                                       \
    }

ONE_PASS(bf16, bf16_bits, bf16, bf16_bits)
ONE_PASS(f32, float, bf16, bf16_bits)

#if defined(__FLT16_MAX__) /* the compiler's _Float16: IEEE half, round to nearest even */
ONE_PASS(f16, _Float16, f16, _Float16)
ONE_PASS(f32, float, f16, _Float16)
#endif
