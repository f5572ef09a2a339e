/* The one-pass AdamW step with compact states (issue 21; [Note: compact states] in compact.py,
 * whose `reference_step` is this file's specification in PyTorch: the two agree bit for bit,
 * tests/test_compact.py). Built with adamw_one_pass.c into one library (native.py).
 *
 * Per element, in fp32, the formulas and their order of adamw_one_pass.c; what differs is how
 * the states are read and written:
 * - moments as fp32, as bf16 (stochastically rounded), or as 8-bit codes with an fp32 scale per
 *   block of 256 elements (QBLOCK_BYTES = 260 bytes a block: the codes, then the scale);
 * - master weights as fp32 (the new weights cast to the nearest compute-dtype value), or none:
 *   the bf16 weights are the master, stochastically rounded.
 * Stochastic rounding reads 32 random bits per element and step: a hash of the element's index
 * in its unit's shard and a key (compact.stream_key: seed, unit, step), so that results do not
 * depend on threads, pieces or resumes. The low 16 round the weights, the next 8 the first
 * moment, the top 8 the second.
 *
 * A call steps one piece of a unit's shard with a table of runs (the piece's runs of one param
 * group, each with its coefficients, or frozen): an 8-bit block holds elements of several runs
 * where a param group ends inside it, and is encoded once, after all of them are stepped.
 */
#include <float.h>

#include "adamw_kernel.h"

#if !defined(QBLOCK) || !defined(QBLOCK_BYTES) || !defined(M_BIAS) || !defined(V_LARGEST)
#error "the moments' format comes from tiered/tiers/moments.py: build through optim/native.py"
#endif
#define CHUNK 4096 /* elements a thread steps before it writes their weights out */
#define SCALARS 9  /* per run: adamw._one_pass_scalars' 8, then 1 for a frozen run */

/* The stream's bits for element `index`: murmur3's 32-bit finalizer of index + key. */
static inline uint32_t random_bits(uint32_t index, uint32_t key) {
    uint32_t h = index + key;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* Stochastically: up with probability (the dropped 16 bits) / 2^16, by the 16 random bits
 * `r` (8 bits: shifted up, a probability in steps of 1/256); a NaN stays a quiet NaN. */
static inline bf16_bits to_bf16_stochastic(float f, uint32_t r) {
    uint32_t u = float_bits(f);
    return (bf16_bits)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + r) >> 16);
}

/* The 8-bit code of a normalized value x (|x| at most the map's largest, but for rounding), in
 * a map of 3 mantissa bits and exponent bias `bias`, rounded up with a probability in steps of
 * 1/256 by the 8 random bits r8: compact.encode's rules. Where |x| is below the smallest normal
 * code, 2^(1-bias), adding that to it makes an fp32 whose top 3 mantissa bits are the evenly
 * spaced code (its exponent one more than a normal code's bits would say), so that one
 * rounding serves both ranges. */
static inline uint32_t encode(float x, uint32_t r8, int bias, int is_signed, uint32_t max_code,
                              uint32_t nan_code) {
    const uint32_t x_bits = float_bits(x), a_bits = x_bits & 0x7fffffffu;
    const float a = bits_float(a_bits);
    const float smallest_normal = bits_float((uint32_t)(128 - bias) << 23); /* 2^(1-bias) */
    const int below = a < smallest_normal;
    const uint32_t shifted = float_bits(below ? a + smallest_normal : a);
    const uint32_t offset = (uint32_t)(below ? 128 - bias : 127 - bias) << 3;
    uint32_t code = ((shifted + (r8 << 12)) >> 20) - offset;
    code = code > max_code ? max_code : code;
    if (is_signed)
        code |= code != 0 ? (x_bits >> 24) & 0x80u : 0u; /* a sign, but never -0 (NaN) */
    else
        code = (a_bits != 0 && code == 0) ? 1u : code;
    return a_bits < 0x7f800000u ? code : nan_code; /* finite */
}

/* A code's value, CodeMap.values's, computed rather than looked up (a gather from a table was
 * the 8-bit kernel's slowest part): for E > 0 the code's bits are an fp32's exponent and
 * mantissa, rebiased; for E = 0 it is M 2^(-bias - 2). */
static inline float decode(uint32_t code, int bias, int is_signed, uint32_t nan_code) {
    const uint32_t magnitude = is_signed ? code & 0x7fu : code;
    const float normal = bits_float((magnitude << 20) + ((uint32_t)(127 - bias) << 23));
    const float subnormal =
        (float)(int32_t)magnitude * bits_float((uint32_t)(127 - bias - 2) << 23);
    const float value = bits_float(float_bits(magnitude >= 8 ? normal : subnormal) |
                                   (is_signed ? (code & 0x80u) << 24 : 0u));
    return code == nan_code ? NAN : value;
}

/* How the moments are kept: fp32, bf16, or 8-bit blocks. */
#define MOMENTS_f32 0
#define MOMENTS_bf16 1
#define MOMENTS_q8 2

/* A block's `count` moments from the piece's element `start`, as fp32, into m and v. */
static inline void load_moments(int format, const void *exp_avg, const void *exp_avg_sq,
                                int64_t start, int count, float *restrict m,
                                float *restrict v) {
    if (format == MOMENTS_f32) {
        memcpy(m, (const float *)exp_avg + start, (size_t)count * 4);
        memcpy(v, (const float *)exp_avg_sq + start, (size_t)count * 4);
    } else if (format == MOMENTS_bf16) {
        const bf16_bits *m_in = (const bf16_bits *)exp_avg + start;
        const bf16_bits *v_in = (const bf16_bits *)exp_avg_sq + start;
        _Pragma("omp simd")
        for (int j = 0; j < count; j++) {
            m[j] = from_bf16(m_in[j]);
            v[j] = from_bf16(v_in[j]);
        }
    } else {
        const uint8_t *m_in = (const uint8_t *)exp_avg + (start / QBLOCK) * QBLOCK_BYTES;
        const uint8_t *v_in = (const uint8_t *)exp_avg_sq + (start / QBLOCK) * QBLOCK_BYTES;
        float m_scale, v_scale;
        memcpy(&m_scale, m_in + QBLOCK, 4);
        memcpy(&v_scale, v_in + QBLOCK, 4);
        _Pragma("omp simd")
        for (int j = 0; j < count; j++) {
            m[j] = decode(m_in[j], M_BIAS, 1, M_NAN) * m_scale;
            v[j] = decode(v_in[j], V_BIAS, 0, V_NAN) * v_scale;
        }
    }
}

/* A block's codes and scales (see store_moments). Not inlined: inlined into the kernel, gcc 12
 * left this loop scalar. */
__attribute__((noinline)) static void encode_block(uint8_t *restrict m_out,
                                                   uint8_t *restrict v_out,
                                                   const float *restrict m,
                                                   const float *restrict v,
                                                   const uint32_t *restrict random, int count) {
    /* The largest finite magnitudes: a NaN or infinity keeps a code of its own and is not
     * counted, so that it does not wipe out its block's other elements. */
    float m_largest = 0.0f, v_largest = 0.0f;
    _Pragma("omp simd reduction(max:m_largest, v_largest)")
    for (int j = 0; j < count; j++) {
        const float a = fabsf(m[j]), b = fabsf(v[j]);
        m_largest = (a <= FLT_MAX && a > m_largest) ? a : m_largest;
        v_largest = (b <= FLT_MAX && b > v_largest) ? b : v_largest;
    }
    const float m_scale = m_largest / M_LARGEST, v_scale = v_largest / V_LARGEST;
    const float m_inverse = m_scale > 0.0f ? fminf(1.0f / m_scale, FLT_MAX) : 0.0f;
    const float v_inverse = v_scale > 0.0f ? fminf(1.0f / v_scale, FLT_MAX) : 0.0f;
    _Pragma("omp simd")
    for (int j = 0; j < count; j++) {
        const uint32_t r = random[j];
        m_out[j] = (uint8_t)encode(m[j] * m_inverse, (r >> 16) & 0xffu, M_BIAS, 1, M_MAX_CODE,
                                   M_NAN);
        v_out[j] = (uint8_t)encode(v[j] * v_inverse, r >> 24, V_BIAS, 0, V_MAX_CODE, V_NAN);
    }
    memcpy(m_out + QBLOCK, &m_scale, 4);
    memcpy(v_out + QBLOCK, &v_scale, 4);
}

/* Write a block's new moments back, rounded by bits 16-23 (first) and 24-31 (second) of each
 * element's random bits. */
static inline void store_moments(int format, void *exp_avg, void *exp_avg_sq, int64_t start,
                                 int count, const float *restrict m, const float *restrict v,
                                 const uint32_t *restrict random) {
    if (format == MOMENTS_f32) {
        memcpy((float *)exp_avg + start, m, (size_t)count * 4);
        memcpy((float *)exp_avg_sq + start, v, (size_t)count * 4);
    } else if (format == MOMENTS_bf16) {
        bf16_bits *m_out = (bf16_bits *)exp_avg + start, *v_out = (bf16_bits *)exp_avg_sq + start;
        _Pragma("omp simd")
        for (int j = 0; j < count; j++) {
            m_out[j] = to_bf16_stochastic(m[j], ((random[j] >> 16) & 0xffu) << 8);
            v_out[j] = to_bf16_stochastic(v[j], (random[j] >> 24) << 8);
        }
    } else {
        encode_block((uint8_t *)exp_avg + (start / QBLOCK) * QBLOCK_BYTES,
                     (uint8_t *)exp_avg_sq + (start / QBLOCK) * QBLOCK_BYTES, m, v, random,
                     count);
    }
}

/* One run's elements [from, to) of a block whose moments are in m_block[], v_block[] and random
 * bits in random[] (indexed from the block's first element, `base`). GRADIENT reads element i's
 * gradient as fp32; with a master, the new weight goes to master[i] and, to nearest, out;
 * without, the weights are the master, read from weights_in and rounded stochastically by the
 * random bits' low 16. FROM: as adamw_one_pass.c's lerp. */
#define STEP_RUN(GRADIENT, FROM, HAS_MASTER, FROM_WEIGHT, TO_WEIGHT)                            \
    _Pragma("omp simd")                                                                        \
    for (int64_t i = from; i < to; i++) {                                                      \
        const int64_t j = i - base;                                                            \
        const float g = GRADIENT;                                                              \
        const float m = (FROM) + lerp_by * (g - m_block[j]);                                   \
        const float v = v_block[j] * beta2 + g * (g * sq_weight);                              \
        const float p_old = HAS_MASTER ? master[i] : FROM_WEIGHT(weights_in[i]);               \
        const float p = p_old * decay - step_size * m / (sqrtf(v) / bias2_sqrt + eps);         \
        m_block[j] = m;                                                                        \
        v_block[j] = v;                                                                        \
        if (HAS_MASTER) {                                                                      \
            master[i] = p;                                                                     \
            out[i - chunk] = TO_WEIGHT(p);                                                     \
        } else {                                                                               \
            out[i - chunk] = to_bf16_stochastic(p, random[j] & 0xffffu);                       \
        }                                                                                      \
    }

#define COMPACT(NAME, GRAD_T, FROM_GRAD, WEIGHT_T, FROM_WEIGHT, TO_WEIGHT, HAS_MASTER, MOMENTS) \
    void NAME(float *master, const WEIGHT_T *weights_in, const GRAD_T *restrict grad,          \
              void *exp_avg, void *exp_avg_sq, WEIGHT_T *weights_out, int64_t n,               \
              int64_t first, const int64_t *bounds, const float *run_scalars, int runs,       \
              uint32_t key, int threads) {                                                     \
        _Pragma("omp parallel num_threads(threads)")                                           \
        {                                                                                      \
        _Pragma("omp for schedule(static) nowait") /* the fence below needs no barrier */     \
        for (int64_t chunk = 0; chunk < n; chunk += CHUNK) {                                   \
            const int64_t chunk_end = chunk + CHUNK < n ? chunk + CHUNK : n;                   \
            WEIGHT_T out[CHUNK] __attribute__((aligned(64)));                                  \
            float m_block[QBLOCK] __attribute__((aligned(64)));                                \
            float v_block[QBLOCK] __attribute__((aligned(64)));                                \
            uint32_t random[QBLOCK] __attribute__((aligned(64)));                              \
            int r = 0;                                                                         \
            for (int64_t base = chunk; base < chunk_end; base += QBLOCK) {                     \
                const int64_t block_end = base + QBLOCK < chunk_end ? base + QBLOCK : chunk_end; \
                const int count = (int)(block_end - base);                                     \
                const uint32_t index = (uint32_t)(first + base);                               \
                if (!HAS_MASTER || MOMENTS != MOMENTS_f32) {                                   \
                    _Pragma("omp simd")                                                        \
                    for (int j = 0; j < count; j++)                                            \
                        random[j] = random_bits(index + (uint32_t)j, key);                     \
                }                                                                              \
                load_moments(MOMENTS, exp_avg, exp_avg_sq, base, count, m_block, v_block);     \
                while (bounds[r + 1] <= base) r++;                                             \
                for (int k = r; k < runs && bounds[k] < block_end; k++) {                      \
                    const int64_t from = bounds[k] > base ? bounds[k] : base;                  \
                    const int64_t to = bounds[k + 1] < block_end ? bounds[k + 1] : block_end;  \
                    const float *s = run_scalars + (int64_t)k * SCALARS;                       \
                    if (s[8] != 0.0f) { /* frozen: unchanged, its weights written out */       \
                        for (int64_t i = from; i < to; i++)                                    \
                            out[i - chunk] = HAS_MASTER ? TO_WEIGHT(master[i]) : weights_in[i]; \
                        continue;                                                              \
                    }                                                                          \
                    const float decay = s[0], beta2 = s[1], avg_weight = s[2],                 \
                                sq_weight = s[3], eps = s[4], step_size = s[5],                \
                                bias2_sqrt = s[6], divisor = s[7];                             \
                    const int from_end = fabsf(avg_weight) >= 0.5f;                            \
                    const float lerp_by = from_end ? -(1.0f - avg_weight) : avg_weight;        \
                    if (divisor == 1.0f && !from_end) {                                        \
                        STEP_RUN(FROM_GRAD(grad[i]), m_block[j], HAS_MASTER, FROM_WEIGHT,      \
                                 TO_WEIGHT)                                                    \
                    } else if (divisor == 1.0f) {                                              \
                        STEP_RUN(FROM_GRAD(grad[i]), g, HAS_MASTER, FROM_WEIGHT, TO_WEIGHT)    \
                    } else if (!from_end) {                                                    \
                        STEP_RUN(FROM_GRAD(grad[i]) / divisor, m_block[j], HAS_MASTER,         \
                                 FROM_WEIGHT, TO_WEIGHT)                                       \
                    } else {                                                                   \
                        STEP_RUN(FROM_GRAD(grad[i]) / divisor, g, HAS_MASTER, FROM_WEIGHT,     \
                                 TO_WEIGHT)                                                    \
                    }                                                                          \
                }                                                                              \
                store_moments(MOMENTS, exp_avg, exp_avg_sq, base, count, m_block, v_block,     \
                              random);                                                         \
            }                                                                                  \
            write_out(weights_out + chunk, out, (size_t)(chunk_end - chunk) * sizeof(WEIGHT_T)); \
        }                                                                                      \
        fence(); /* each thread's own streaming stores */                                      \
        }                                                                                      \
    }

/* The variants native.native_compact_step names, compact_g<gradient>_w<weights>_p<master>_m<
 * moments>: each dtype by its name's T_, from_ and to_; the master fp32 (HAS_f32) or none. */
#define T_bf16 bf16_bits
#define T_f16 _Float16
#define T_f32 float
#define HAS_f32 1
#define HAS_bf16 0
#define VARIANT(G, W, P, M)                                                                    \
    COMPACT(compact_g##G##_w##W##_p##P##_m##M, T_##G, from_##G, T_##W, from_##W, to_##W,      \
            HAS_##P, MOMENTS_##M)
#define COMPACT_MOMENTS(G, W, P) VARIANT(G, W, P, bf16) VARIANT(G, W, P, q8)

COMPACT_MOMENTS(bf16, bf16, f32)
COMPACT_MOMENTS(f32, bf16, f32)
COMPACT_MOMENTS(f32, f32, f32)
VARIANT(bf16, bf16, bf16, f32) /* bf16 masters: also with fp32 moments */
COMPACT_MOMENTS(bf16, bf16, bf16)
VARIANT(f32, bf16, bf16, f32)
COMPACT_MOMENTS(f32, bf16, bf16)
#if defined(__FLT16_MAX__)
COMPACT_MOMENTS(f16, f16, f32)
COMPACT_MOMENTS(f32, f16, f32)
#endif
