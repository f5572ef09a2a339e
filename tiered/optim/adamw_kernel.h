/* What the native AdamW kernels (adamw_one_pass.c, adamw_compact.c) share: bit casts, the
 * compute dtypes' conversions, and writing a block of new weights out. */
#ifndef TIERED_ADAMW_KERNEL_H
#define TIERED_ADAMW_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_bits;

static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float from_bf16(bf16_bits h) { return bits_float((uint32_t)h << 16); }

/* Round to nearest even, a NaN kept a quiet NaN, as torch's cast; branch-free, to vectorize. */
static inline bf16_bits to_bf16(float f) {
    const uint32_t u = float_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16_bits)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

static inline float from_f32(float f) { return f; }
static inline float to_f32(float f) { return f; }

#if defined(__FLT16_MAX__) /* the compiler's _Float16: IEEE half, round to nearest even */
static inline float from_f16(_Float16 h) { return (float)h; }
static inline _Float16 to_f16(float f) { return (_Float16)f; }
#endif

/* Copy a block of new weights out; non-temporal where the destination is aligned, so that a
 * store does not first read the line it overwrites. */
static inline void write_out(void *dst, const void *src, size_t bytes) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && bytes % 64 == 0) {
        for (size_t j = 0; j < bytes; j += 64)
            _mm512_stream_si512((__m512i *)((char *)dst + j),
                                _mm512_load_si512((const void *)((const char *)src + j)));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && bytes % 32 == 0) {
        for (size_t j = 0; j < bytes; j += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + j),
                                _mm256_load_si256((const __m256i *)((const char *)src + j)));
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* Non-temporal stores are weakly ordered: each thread that made some fences them before the
 * kernel returns and the caller says the weights are written. */
static inline void fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_sfence();
#endif
}

#endif
