/* The host optimizer step's element loops (train/host_kernels.py builds and calls them).
 *
 * Why C: the settings no library kernel covers -- bf16 weights or moments with stochastic
 * rounding, fp32 masters beside bf16 weights, a bf16 gradient with fp32 moments, Adafactor -- as
 * torch ops take a dozen passes and full-size fp32 temporaries per tensor. Here each element is
 * read once per pass, updated in fp32 registers and written once. Plain C (no torch headers): it
 * builds in seconds with any C compiler (-fopenmp-simd only lets the `omp simd` reductions below
 * reassociate; no OpenMP runtime is used); the caller splits a tensor into ranges and calls these
 * from several threads (ctypes releases the GIL), so no OpenMP runtime is loaded beside torch's.
 *
 * Written for the auto-vectoriser (gcc -O3 -march=native; check with -fopt-info-vec-missed): every
 * loop below vectorises. What that needed: the element counter of the random bits is a 32-bit
 * induction variable (a 64-bit index made the vector loop narrow eight 64-bit lanes to 32 bits
 * each iteration), a NaN is chosen on the 32-bit word before it is narrowed to bf16 (one blend and
 * one pack per vector instead of two packs and a blend), and one division per element is a product
 * (sqrt(v) * (1 / bc2_sqrt)).
 *
 * Random bits for stochastic rounding come from a counter-based hash, lowbias32 (two
 * multiply-xorshift rounds) of a Weyl sequence: element i of a tensor draws mix32(i * W + key),
 * 32 bits, whose low and high halves are two 16-bit noises (the Weyl step W, an odd constant, is
 * free as an induction variable and spreads consecutive counters over the word; without it the low
 * halves of neighbouring elements were measurably correlated). One hash serves a weight and its
 * two bf16 moments' needs up to 32 bits; bf16 weights with bf16 moments (48 bits) draw a second
 * hash from a second Weyl sequence and key. So the draws depend only on (key, element index): not
 * on how the tensor is split across threads, and a resumed run draws the same bits as an
 * uninterrupted one (the key is derived from the seed, the tensor and its step count).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Round to nearest even (torch's fp32 -> bf16 conversion, NaN kept a quiet NaN). */
static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u = f32_bits(f);
    uint32_t r = (f != f) ? (u | 0x400000u) : u + 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}

/* Stochastic rounding: add 16 random bits below bf16's last bit and truncate (the fp32 bit pattern
 * is monotone in magnitude, so the carry lands with probability equal to the discarded fraction). */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t noise16) {
    uint32_t u = f32_bits(f);
    uint32_t r = (f != f) ? (u | 0x400000u) : u + noise16;
    return (uint16_t)(r >> 16);
}

/* lowbias32: a 32-bit integer hash with good avalanche (two multiply-xorshift rounds). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

#define WEYL_A 0x9E3779B9u      /* 2^32 / golden ratio */
#define WEYL_B 0x85EBCA77u      /* a second odd step, for the second stream */
#define KEY_B 0x6A09E667u       /* the second stream's key is key ^ KEY_B */

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* AdamW with decoupled weight decay, the operation order of torch's single-tensor AdamW:
 *   w *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2)*g*g;
 *   w -= step_size * m / (sqrt(v)/bc2_sqrt + eps)
 * (here sqrt(v) * (1/bc2_sqrt): one rounding more, one division less).
 * g is scaled by gscale first (per-parameter clipping). 1 - beta1 and 1 - beta2 come from the caller
 * (computed in double, as torch does: 1 - (float)0.999 is 1.3e-5 off). The weight is read from `master` (fp32)
 * when given, else from `w`; it is written to `master` and rounded to nearest into `w`, or rounded
 * stochastically (sr_w) or to nearest into a bf16 `w`, or stored into an fp32 `w`.
 * Moments: fp32, or bf16 rounded stochastically (sr_state) or to nearest.
 * Noise: stream A's word gives the moments (low half m, high half v) when sr_state, else the
 * weight (low half); with both, the weight takes the low half of stream B's word. */
static inline __attribute__((always_inline)) void adamw_body(
        int64_t lo, int64_t hi, void *restrict w, const int w_bf16, const int has_master, float *restrict master,
        const void *restrict g, const int g_bf16,
        void *restrict m, void *restrict v, const int mv_bf16, float gscale, float decay, float one_minus_b1,
        float beta2, float one_minus_b2, float eps, float step_size, float bc2_sqrt, const int sr_w,
        const int sr_state, uint32_t key) {
    const float inv_bc2 = 1.0f / bc2_sqrt;
    uint32_t ca = (uint32_t)lo * WEYL_A + key, cb = (uint32_t)lo * WEYL_B + (key ^ KEY_B);
    for (int64_t i = lo; i < hi; i++, ca += WEYL_A, cb += WEYL_B) {
        float x = has_master ? master[i] : load(w, w_bf16, i);
        float gi = load(g, g_bf16, i) * gscale;
        float mi = load(m, mv_bf16, i), vi = load(v, mv_bf16, i);
        x *= decay;
        mi = mi + one_minus_b1 * (gi - mi);
        vi = vi * beta2 + one_minus_b2 * gi * gi;
        float denom = sqrtf(vi) * inv_bc2 + eps;
        x = x - step_size * (mi / denom);
        const uint32_t ha = (sr_w || sr_state) ? mix32(ca) : 0u;
        if (mv_bf16) {
            if (sr_state) {
                ((uint16_t *)m)[i] = f32_to_bf16_sr(mi, ha & 0xFFFFu);
                ((uint16_t *)v)[i] = f32_to_bf16_sr(vi, ha >> 16);
            } else {
                ((uint16_t *)m)[i] = f32_to_bf16_rne(mi);
                ((uint16_t *)v)[i] = f32_to_bf16_rne(vi);
            }
        } else {
            ((float *)m)[i] = mi;
            ((float *)v)[i] = vi;
        }
        if (has_master) {
            master[i] = x;
            if (w_bf16) ((uint16_t *)w)[i] = f32_to_bf16_rne(x);
            else ((float *)w)[i] = x;
        } else if (w_bf16) {
            ((uint16_t *)w)[i] = sr_w ? f32_to_bf16_sr(x, (sr_state ? mix32(cb) : ha) & 0xFFFFu)
                                      : f32_to_bf16_rne(x);
        } else {
            ((float *)w)[i] = x;
        }
    }
}

#define ADAMW_CASE(WB, GB, MB, SRW, SRS)                                                              \
    if (w_bf16 == WB && g_bf16 == GB && mv_bf16 == MB && sr_w == SRW && sr_state == SRS && master) {  \
        adamw_body(lo, hi, w, WB, 1, master, g, GB, m, v, MB, gscale, decay, one_minus_b1, beta2, one_minus_b2, eps, \
                   step_size, bc2_sqrt, SRW, SRS, key);                                                          \
        return 0;                                                                                     \
    }                                                                                                 \
    if (w_bf16 == WB && g_bf16 == GB && mv_bf16 == MB && sr_w == SRW && sr_state == SRS && !master) { \
        adamw_body(lo, hi, w, WB, 0, master, g, GB, m, v, MB, gscale, decay, one_minus_b1, beta2, one_minus_b2, eps, \
                   step_size, bc2_sqrt, SRW, SRS, key);                                                          \
        return 0;                                                                                     \
    }

int lt_adamw(int64_t lo, int64_t hi, void *w, int w_bf16, float *master, const void *g, int g_bf16,
             void *m, void *v, int mv_bf16, float gscale, float decay, float one_minus_b1, float beta2,
             float one_minus_b2, float eps, float step_size, float bc2_sqrt, int sr_w, int sr_state, uint32_t key) {
    /* Each combination is its own loop, so the compiler vectorises it without branches inside. */
    ADAMW_CASE(1, 1, 0, 1, 0) ADAMW_CASE(1, 1, 0, 0, 0) ADAMW_CASE(1, 1, 1, 1, 1) ADAMW_CASE(1, 1, 1, 1, 0)
    ADAMW_CASE(1, 1, 1, 0, 1) ADAMW_CASE(1, 1, 1, 0, 0) ADAMW_CASE(1, 0, 0, 1, 0) ADAMW_CASE(1, 0, 0, 0, 0)
    ADAMW_CASE(1, 0, 1, 1, 1) ADAMW_CASE(1, 0, 1, 1, 0) ADAMW_CASE(1, 0, 1, 0, 1) ADAMW_CASE(1, 0, 1, 0, 0)
    ADAMW_CASE(0, 1, 0, 0, 0) ADAMW_CASE(0, 1, 1, 0, 1) ADAMW_CASE(0, 1, 1, 0, 0) ADAMW_CASE(0, 0, 0, 0, 0)
    ADAMW_CASE(0, 0, 1, 0, 1) ADAMW_CASE(0, 0, 1, 0, 0)
    return 1;   /* a combination not built: the caller falls back to torch ops */
}

/* Sum of squares of x[lo:hi]: fp32 sums over blocks of SUM_BLOCK elements (32 lanes: four vector
 * accumulators, so the adds do not wait on each other), added in double. The caller aligns lo to
 * SUM_BLOCK, so the blocks, and the sum, do not depend on the thread split. (The clipping norm of
 * a gradient without an fp32 copy.) */
#define SUM_BLOCK 4096
#define SUM_LANES 32
static inline __attribute__((always_inline)) double sumsq_body(int64_t lo, int64_t hi, const void *x, const int bf16) {
    double s = 0.0;
    for (int64_t b = lo; b < hi; b += SUM_BLOCK) {
        const int64_t e = (hi - b) < SUM_BLOCK ? hi : b + SUM_BLOCK;
        float acc[SUM_LANES];
        for (int j = 0; j < SUM_LANES; j++) acc[j] = 0.0f;
        int64_t i = b;
        for (; i + SUM_LANES <= e; i += SUM_LANES)
            for (int j = 0; j < SUM_LANES; j++) {
                float t = load(x, bf16, i + j);
                acc[j] += t * t;
            }
        for (int j = 0; i < e; i++, j++) {
            float t = load(x, bf16, i);
            acc[j] += t * t;
        }
        for (int width = SUM_LANES / 2; width > 0; width /= 2)
            for (int j = 0; j < width; j++) acc[j] += acc[j + width];
        s += acc[0];
    }
    return s;
}

double lt_sumsq(int64_t lo, int64_t hi, const void *x, int bf16) {
    return bf16 ? sumsq_body(lo, hi, x, 1) : sumsq_body(lo, hi, x, 0);
}

/* torch.lerp's formula (two branches, for accuracy near either end). */
static inline float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

/* Adafactor (torch's _single_tensor_adafactor, factored second moment) on a (rows, cols) weight,
 * in three passes over the gradient:
 *   A  lt_adafactor_sums: per row the sum of g^2, per block of ROW_BLOCK rows and column the sum
 *      of g^2 (fp32; a later call adds the blocks in order, in double), and sum w^2 -- the
 *      gradient unscaled: the clipping norm is the sum of the row sums, so clipping costs no
 *      pass of its own, and its scale multiplies the sums afterwards;
 *   -  lt_adafactor_moments (one thread, vectors of rows and cols): the two moments' lerps;
 *   B  lt_adafactor_update(apply = 0): sum of the update's squares;
 *   C  lt_adafactor_update(apply = 1): the update.
 * A splits rows at multiples of ROW_BLOCK, so every sum is the same for any thread split. */
#define ROW_BLOCK 256
double lt_adafactor_sums(int64_t r0, int64_t r1, int64_t cols, const void *g, int g_bf16, const void *w,
                         int w_bf16, float *rowsq, float *colpart);

static inline __attribute__((always_inline)) double sums_body(
        int64_t r0, int64_t r1, int64_t cols, const void *g, const int g_bf16, const void *w, const int w_bf16,
        float *restrict rowsq, float *restrict colpart) {
    double wsq = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        float *restrict cp = colpart + (r / ROW_BLOCK) * cols;
        const int64_t base = r * cols;
        float rs = 0.0f, ws = 0.0f;
        if (r % ROW_BLOCK == 0) {
#pragma omp simd reduction(+ : rs, ws)
            for (int64_t c = 0; c < cols; c++) {
                float gi = load(g, g_bf16, base + c), wi = load(w, w_bf16, base + c);
                cp[c] = gi * gi;
                rs += gi * gi;
                ws += wi * wi;
            }
        } else {
#pragma omp simd reduction(+ : rs, ws)
            for (int64_t c = 0; c < cols; c++) {
                float gi = load(g, g_bf16, base + c), wi = load(w, w_bf16, base + c);
                cp[c] += gi * gi;
                rs += gi * gi;
                ws += wi * wi;
            }
        }
        rowsq[r] = rs;
        wsq += ws;
    }
    return wsq;
}

double lt_adafactor_sums(int64_t r0, int64_t r1, int64_t cols, const void *g, int g_bf16, const void *w,
                         int w_bf16, float *rowsq, float *colpart) {
    if (g_bf16 && w_bf16) return sums_body(r0, r1, cols, g, 1, w, 1, rowsq, colpart);
    if (g_bf16) return sums_body(r0, r1, cols, g, 1, w, 0, rowsq, colpart);
    if (w_bf16) return sums_body(r0, r1, cols, g, 0, w, 1, rowsq, colpart);
    return sums_body(r0, r1, cols, g, 0, w, 0, rowsq, colpart);
}

/* The moments, given the sums of pass A and g2scale (the clipping scale squared): row_var[r] and
 * col_var[c] move toward the mean squares by `beta` (torch's lerp). Writes col_rs[c] =
 * 1/sqrt(col_var[c]) and *col_min = the smallest col_var; returns the sum of row_var (double). */
double lt_adafactor_moments(int64_t rows, int64_t cols, const float *rowsq, const float *colpart, float g2scale,
                            float beta, float *row_var, float *col_var, float *col_rs, float *col_min) {
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    double rsum = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        row_var[r] = lerp(row_var[r], (float)((double)rowsq[r] * g2scale / (double)cols), beta);
        rsum += row_var[r];
    }
    float cmin = INFINITY;
    for (int64_t c = 0; c < cols; c++) {
        double s = 0.0;
        for (int64_t b = 0; b < blocks; b++) s += colpart[b * cols + c];
        col_var[c] = lerp(col_var[c], (float)(s * g2scale / (double)rows), beta);
        col_rs[c] = 1.0f / sqrtf(col_var[c]);
        cmin = col_var[c] < cmin ? col_var[c] : cmin;
    }
    *col_min = cmin;
    return rsum;
}

/* Pass B (apply = 0): the sum of squares of the update u = g * gscale * rsqrt(max(row_var[r] *
 * inv_rmean * col_var[c], eps1sq)) over rows [r0, r1), nothing written. Pass C (apply = 1):
 * w = w*decay - coef*u, rounded as in lt_adamw (bf16: stochastically with sr_w, else to nearest).
 * A row whose every estimate is above eps1sq (row_var[r] * inv_rmean * col_min > eps1sq, nearly
 * always) takes u = g * (gscale / sqrt(row_var[r] * inv_rmean)) * col_rs[c]: a product per element
 * instead of a square root and a division (torch rounds the estimate, then its rsqrt; this differs
 * by a few ulp); any other row computes the clamped estimate per element. */
static inline __attribute__((always_inline)) double update_body(
        int64_t r0, int64_t r1, int64_t cols, const void *g, const int g_bf16, float gscale, void *w,
        const int w_bf16, const float *rvar, const float *cvar, const float *crs, float col_min, float inv_rmean,
        float eps1sq, float decay, float coef, const int apply, const int sr_w, uint32_t key) {
    double total = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        const float rv = rvar[r] * inv_rmean;
        const int64_t base = r * cols;
        const int fast = rv * col_min > eps1sq;
        float s = 0.0f;
        if (!apply) {
            if (fast) {
#pragma omp simd reduction(+ : s)
                for (int64_t c = 0; c < cols; c++) {
                    float u = load(g, g_bf16, base + c) * crs[c];
                    s += u * u;
                }
                const float k = gscale / sqrtf(rv);
                total += s * (k * k);          /* a float per row: the double sum is exact in any order */
            } else {
#pragma omp simd reduction(+ : s)
                for (int64_t c = 0; c < cols; c++) {
                    float est = rv * cvar[c];
                    est = est > eps1sq ? est : eps1sq;
                    float u = load(g, g_bf16, base + c) * gscale / sqrtf(est);
                    s += u * u;
                }
                total += s;
            }
            continue;
        }
        uint32_t ca = (uint32_t)base * WEYL_A + key;
        if (fast) {
            const float k = coef * (gscale / sqrtf(rv));
            for (int64_t c = 0; c < cols; c++, ca += WEYL_A) {
                const int64_t i = base + c;
                float x = load(w, w_bf16, i) * decay - k * (load(g, g_bf16, i) * crs[c]);
                if (w_bf16) ((uint16_t *)w)[i] = sr_w ? f32_to_bf16_sr(x, mix32(ca) & 0xFFFFu) : f32_to_bf16_rne(x);
                else ((float *)w)[i] = x;
            }
        } else {
            for (int64_t c = 0; c < cols; c++, ca += WEYL_A) {
                const int64_t i = base + c;
                float est = rv * cvar[c];
                est = est > eps1sq ? est : eps1sq;
                float u = load(g, g_bf16, i) * gscale / sqrtf(est);
                float x = load(w, w_bf16, i) * decay - coef * u;
                if (w_bf16) ((uint16_t *)w)[i] = sr_w ? f32_to_bf16_sr(x, mix32(ca) & 0xFFFFu) : f32_to_bf16_rne(x);
                else ((float *)w)[i] = x;
            }
        }
    }
    return total;
}

#define ADAFACTOR_CASE(GB, WB, AP, SRW)                                                                 \
    if (g_bf16 == GB && w_bf16 == WB && apply == AP && sr_w == SRW)                                     \
        return update_body(r0, r1, cols, g, GB, gscale, w, WB, rvar, cvar, crs, col_min, inv_rmean, eps1sq, \
                           decay, coef, AP, SRW, key);

double lt_adafactor_update(int64_t r0, int64_t r1, int64_t cols, const void *g, int g_bf16, float gscale,
                           void *w, int w_bf16, const float *rvar, const float *cvar, const float *crs,
                           float col_min, float inv_rmean, float eps1sq, float decay, float coef, int apply,
                           int sr_w, uint32_t key) {
    ADAFACTOR_CASE(1, 1, 0, 0) ADAFACTOR_CASE(1, 1, 1, 1) ADAFACTOR_CASE(1, 1, 1, 0)
    ADAFACTOR_CASE(0, 0, 0, 0) ADAFACTOR_CASE(0, 0, 1, 0) ADAFACTOR_CASE(0, 1, 0, 0) ADAFACTOR_CASE(0, 1, 1, 1)
    ADAFACTOR_CASE(0, 1, 1, 0) ADAFACTOR_CASE(1, 0, 0, 0) ADAFACTOR_CASE(1, 0, 1, 0)
    return -1.0;
}
