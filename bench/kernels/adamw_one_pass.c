/* An experiment for issue 21, not used by tiered: the one-pass AdamW step (bf16 gradient in,
 * bf16 weights out, fp32 master and moments) written by hand, to see what inductor's compiled
 * loop leaves on the table. bench/bench_adamw_kernels.py --c-kernel builds it with
 * `gcc -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=off` and times it beside the
 * others. Same formulas and coefficients as tiered/optim/adamw.py's _adamw_one_pass (the
 * `scalars` it reads are _one_pass_scalars'), no fused multiply-adds: its results are the
 * compiled kernel's bit for bit (the bench checks).
 *
 * `-fno-math-errno` lets sqrtf vectorize (with errno it is a call); `stream` writes the
 * weights with non-temporal stores where a block is 64-byte aligned, so the store does not
 * first read the line it overwrites (the fused kernel has no such output stream).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 4096

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

/* Round to nearest even, NaN kept a (quiet) NaN: as torch's cast. Branch-free, to vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16;
    uint32_t nan = (x.u >> 16) | 0x40u;
    return (uint16_t)(((x.u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

void adamw_one_pass_bf16(float *restrict master, const uint16_t *restrict grad,
                         float *restrict exp_avg, float *restrict exp_avg_sq,
                         uint16_t *restrict weights, int64_t n, const float *scalars,
                         int threads, int stream) {
    const float decay = scalars[0], beta2 = scalars[1], avg_weight = scalars[2],
                sq_weight = scalars[3], eps = scalars[4], step_size = scalars[5],
                bias2_sqrt = scalars[6], divisor = scalars[7];
    /* x / 1 is x: without a divisor the loop has one division fewer (three a parameter is
     * one more than the fused kernel's two). */
    const int divided = divisor != 1.0f;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t base = 0; base < n; base += BLOCK) {
        int64_t end = base + BLOCK < n ? base + BLOCK : n;
        uint16_t out[BLOCK] __attribute__((aligned(64)));
#pragma omp simd
        for (int64_t i = base; i < end; i++) {
            float g = divided ? bf16_to_f32(grad[i]) / divisor : bf16_to_f32(grad[i]);
            float m = exp_avg[i] + avg_weight * (g - exp_avg[i]);
            float v = exp_avg_sq[i] * beta2 + g * (g * sq_weight);
            float p = master[i] * decay - step_size * m / (sqrtf(v) / bias2_sqrt + eps);
            exp_avg[i] = m;
            exp_avg_sq[i] = v;
            master[i] = p;
            out[i - base] = f32_to_bf16(p);
        }
#if defined(__AVX512F__)
        if (stream && end - base == BLOCK && ((uintptr_t)(weights + base) & 63) == 0) {
            for (int64_t j = 0; j < BLOCK; j += 32)
                _mm512_stream_si512((__m512i *)(weights + base + j),
                                    _mm512_load_si512((const void *)(out + j)));
            continue;
        }
#endif
        memcpy(weights + base, out, (size_t)(end - base) * sizeof(uint16_t));
    }
}
