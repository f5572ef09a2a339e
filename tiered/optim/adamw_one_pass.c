/* The one-pass AdamW step on the CPU (tiered/optim/native.py builds this for the machine it
 * runs on): the gradient in the compute dtype (or fp32) read, fp32 master weights and moments
 * read and written, the new weights written in the compute dtype, in one pass over memory.
 *
 * The formulas, their order and the coefficients (`scalars`, from adamw._one_pass_scalars) are
 * those of adamw._adamw_one_pass as inductor compiles it, with no fused multiply-adds
 * (-ffp-contract=off): the results are the compiled kernel's, bit for bit (tests/test_adamw.py).
 * What it does better (bench/RESULTS.md, sixteenth session): the new weights go out with
 * non-temporal stores where a block is aligned, so a store does not first read the line it
 * overwrites, and the loop has none of inductor's per-call overheads, which cost most at a small
 * unit's size. -fno-math-errno is what lets sqrtf vectorize.
 */
#include "adamw_kernel.h"

#define BLOCK 4096 /* elements a thread steps before it writes their weights out */

/* One block of elements [base, end). GRADIENT is the gradient of element i as fp32, divided
 * or not; the first moment moves by lerp as torch computes it, from the nearer end (FROM: g,
 * or exp_avg[i]) by the weight's size. */
#define STEP_BLOCK(GRADIENT, FROM, TO_WEIGHT)                                                    \
    _Pragma("omp simd")                                                                         \
    for (int64_t i = base; i < end; i++) {                                                      \
        const float g = GRADIENT;                                                               \
        const float m = (FROM) + lerp_by * (g - exp_avg[i]);                                    \
        const float v = exp_avg_sq[i] * beta2 + g * (g * sq_weight);                            \
        const float p = master[i] * decay - step_size * m / (sqrtf(v) / bias2_sqrt + eps);     \
        exp_avg[i] = m;                                                                         \
        exp_avg_sq[i] = v;                                                                      \
        master[i] = p;                                                                          \
        out[i - base] = TO_WEIGHT(p);                                                           \
    }

/* x / 1 is x, to the bit: without a divisor the loop runs with one division fewer (three where
 * the fused kernel has two). */
#define ONE_PASS(NAME, GRAD_T, FROM_GRAD, WEIGHT_T, TO_WEIGHT)                                   \
    void NAME(float *restrict master, const GRAD_T *restrict grad, float *restrict exp_avg,     \
              float *restrict exp_avg_sq, WEIGHT_T *restrict weights, int64_t n,               \
              const float *scalars, int threads) {                                              \
        const float decay = scalars[0], beta2 = scalars[1], avg_weight = scalars[2],            \
                    sq_weight = scalars[3], eps = scalars[4], step_size = scalars[5],           \
                    bias2_sqrt = scalars[6], divisor = scalars[7];                              \
        const int from_end = fabsf(avg_weight) >= 0.5f;                                         \
        const float lerp_by = from_end ? -(1.0f - avg_weight) : avg_weight;                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
        for (int64_t base = 0; base < n; base += BLOCK) {                                        \
            const int64_t end = base + BLOCK < n ? base + BLOCK : n;                            \
            WEIGHT_T out[BLOCK] __attribute__((aligned(64)));                                   \
            if (divisor == 1.0f && !from_end) {                                                 \
                STEP_BLOCK(FROM_GRAD(grad[i]), exp_avg[i], TO_WEIGHT)                           \
            } else if (divisor == 1.0f) {                                                       \
                STEP_BLOCK(FROM_GRAD(grad[i]), g, TO_WEIGHT)                                    \
            } else if (!from_end) {                                                             \
                STEP_BLOCK(FROM_GRAD(grad[i]) / divisor, exp_avg[i], TO_WEIGHT)                 \
            } else {                                                                            \
                STEP_BLOCK(FROM_GRAD(grad[i]) / divisor, g, TO_WEIGHT)                          \
            }                                                                                   \
            write_out(weights + base, out, (size_t)(end - base) * sizeof(WEIGHT_T));           \
        }                                                                                       \
        fence();                                                                                \
    }

ONE_PASS(one_pass_gbf16_wbf16, bf16_bits, from_bf16, bf16_bits, to_bf16)
ONE_PASS(one_pass_gf32_wbf16, float, from_f32, bf16_bits, to_bf16)

#if defined(__FLT16_MAX__) /* the compiler's _Float16: IEEE half, round to nearest even */
ONE_PASS(one_pass_gf16_wf16, _Float16, from_f16, _Float16, to_f16)
ONE_PASS(one_pass_gf32_wf16, float, from_f32, _Float16, to_f16)
#endif
