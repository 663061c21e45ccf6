/* Block-scaled e4m3 quantization of bf16 / fp32 rows in one pass (memory/fp8_kernels.py calls it).
 *
 * Why C: the torch-op path (memory/fp8.py quantize_into) makes an fp32 copy of each chunk and runs
 * five passes over it (amax, amin, divide, clamp, cast), about 725 M values per CPU-second; a
 * load of a bf16 Flux file spends most of its time there. Here each 64-value block is read once
 * into L1, its largest magnitude found with integer max on the bit patterns, and each value
 * divided, clamped and rounded to e4m3 in registers: the bytes are read once and written once.
 *
 * Bitwise torch's: the same IEEE operations in the same order (fp32 division by the fp32 scale
 * amax / 448, clamp to +-448, c10's fp8e4m3fn_from_fp32_value rounding to nearest even with its
 * subnormal and NaN rules); built with -ffp-contract=off and without -ffast-math, and the
 * caller leaves the FPU's denormal modes as they are. tests/test_fp8_kernels.py checks every
 * bf16 bit pattern against torch.
 *
 * The largest magnitude: for IEEE floats with the sign cleared, the order of the bit patterns as
 * unsigned integers is the order of the values, +inf above every finite value and any NaN above
 * +inf; so one integer max gives torch's max(amax, -amin) (NaN when a NaN is present) without a
 * float compare.
 */
#include <stdint.h>
#include <string.h>

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

#define FP8_MAX 448.0f

/* torch's `clamp_(-448, 448)` then c10::detail::fp8e4m3fn_from_fp32_value, on the bit pattern of
 * the quotient y, in integer selects (so the loops vectorise):
 * - clamp: a magnitude above 448 becomes 448, a NaN passes through (torch's clamp keeps NaN);
 * - round to nearest even; below 2^-6 through c10's float add that aligns the value to e4m3's
 *   subnormal step; a magnitude >= 480 (only NaN is left there) -> 0x7F; the sign carried over. */
static inline uint8_t e4m3_from_quotient(float y) {
    const uint32_t fp8_max = 1087u << 20;     /* 480.0f */
    const uint32_t clamp_to = 0x43E00000u;    /* 448.0f */
    const uint32_t inf = 0x7F800000u;
    const uint32_t denorm_mask = 141u << 23;
    uint32_t u = f32_bits(y);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    u = ((u > clamp_to) & (u <= inf)) ? clamp_to : u;
    uint32_t sub = f32_bits(f32_from_bits(u) + f32_from_bits(denorm_mask)) - denorm_mask;
    uint32_t odd = (u >> 20) & 1u;
    uint32_t norm = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t r = u < (121u << 23) ? sub : norm;
    r = u >= fp8_max ? 0x7Fu : r;
    return (uint8_t)((r & 0xFFu) | (sign >> 24));
}

/* The largest magnitude's bit pattern (as fp32 bits) of n values. */
static inline uint32_t amax_bits(const void *x, int bf16, int64_t n) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)x;
        uint16_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            uint16_t a = h[i] & 0x7FFFu;
            m = a > m ? a : m;
        }
        return (uint32_t)m << 16;
    }
    const uint32_t *u = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = u[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

#if defined(__AVX2__)
#include <immintrin.h>

/* e4m3_from_quotient on 8 quotients at once, as 8 int32 (0..255). */
static inline __m256i e4m3_from_quotient8(__m256 y) {
    const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
    const __m256i clamp_to = _mm256_set1_epi32(0x43E00000);
    const __m256i inf_plus_1 = _mm256_set1_epi32(0x7F800001);
    const __m256i denorm_i = _mm256_set1_epi32(141 << 23);
    const __m256 denorm_f = _mm256_castsi256_ps(denorm_i);
    const __m256i bias = _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu));
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i min_normal = _mm256_set1_epi32(121 << 23);
    const __m256i fp8_max_m1 = _mm256_set1_epi32((1087 << 20) - 1);
    const __m256i nan8 = _mm256_set1_epi32(0x7F);
    const __m256i low8 = _mm256_set1_epi32(0xFF);
    __m256i u = _mm256_castps_si256(y);
    __m256i sign = _mm256_and_si256(u, sign_bit);
    u = _mm256_xor_si256(u, sign);                                   /* |y| bits, < 2^31: signed compares hold */
    __m256i over = _mm256_and_si256(_mm256_cmpgt_epi32(u, clamp_to), _mm256_cmpgt_epi32(inf_plus_1, u));
    u = _mm256_blendv_epi8(u, clamp_to, over);
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(u), denorm_f)), denorm_i);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), one);
    __m256i norm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), odd), 20);
    __m256i r = _mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(min_normal, u));
    r = _mm256_blendv_epi8(r, nan8, _mm256_cmpgt_epi32(u, fp8_max_m1));
    return _mm256_or_si256(_mm256_and_si256(r, low8), _mm256_srli_epi32(sign, 24));
}

static inline __m256 load8(const void *x, int bf16, int64_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}
#endif

/* q[i] = e4m3(clamp(x[i] / scale)) for n values. */
static inline void divide_run(const void *x, int bf16, uint8_t *restrict q, int64_t n, float scale) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= n; i += 32) {
        __m256i a = e4m3_from_quotient8(_mm256_div_ps(load8(x, bf16, i), s));
        __m256i b = e4m3_from_quotient8(_mm256_div_ps(load8(x, bf16, i + 8), s));
        __m256i c = e4m3_from_quotient8(_mm256_div_ps(load8(x, bf16, i + 16), s));
        __m256i d = e4m3_from_quotient8(_mm256_div_ps(load8(x, bf16, i + 24), s));
        /* int32 0..255 -> bytes; the packs interleave 128-bit lanes, the permute restores the order */
        __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
#endif
    if (bf16) {
        const uint16_t *h = (const uint16_t *)x;
        for (; i < n; i++)
            q[i] = e4m3_from_quotient(f32_from_bits((uint32_t)h[i] << 16) / scale);
    } else {
        const uint32_t *u = (const uint32_t *)x;
        for (; i < n; i++)
            q[i] = e4m3_from_quotient(f32_from_bits(u[i]) / scale);
    }
}

/* torch's scale of a block: amax / 448 where amax > 0, else 1 (amax 0 or NaN). */
static inline float block_scale(uint32_t m) {
    return (m > 0 && m <= 0x7F800000u) ? f32_from_bits(m) / FP8_MAX : 1.0f;
}

/* Rows [r0, r1) of a (rows, width) bf16 (bf16 = 1) or fp32 matrix `x` (row stride `width`) ->
 * q (rows, width) e4m3 bytes and scale (rows, width / block) fp32, both indexed from row r0 of
 * the caller's arrays: q + r0 * width, scale + r0 * nb. `block` divides `width` (a per-row scale
 * is block = width). */
void lt_fp8_quantize_rows(int64_t r0, int64_t r1, int64_t width, int64_t block, const void *x, int bf16,
                          uint8_t *q, float *scale) {
    const int64_t nb = width / block;
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++) {
        const char *row = (const char *)x + r * width * size;
        uint8_t *qr = q + r * width;
        float *sr = scale + r * nb;
        for (int64_t b = 0; b < nb; b++) {
            const char *xb = row + b * block * size;
            float s;
            if (block == 64) {            /* the usual case, the loops specialised for 64 values */
                s = block_scale(bf16 ? amax_bits(xb, 1, 64) : amax_bits(xb, 0, 64));
                if (bf16)
                    divide_run(xb, 1, qr + b * 64, 64, s);
                else
                    divide_run(xb, 0, qr + b * 64, 64, s);
            } else {
                s = block_scale(amax_bits(xb, bf16, block));
                divide_run(xb, bf16, qr + b * block, block, s);
            }
            sr[b] = s;
        }
    }
}
