/* The host optimizer step's element loops (train/host_kernels.py builds and calls them).
 *
 * Why C: the settings no library kernel covers -- bf16 weights or moments with stochastic
 * rounding, fp32 masters beside bf16 weights, a bf16 gradient with fp32 moments, Adafactor on bf16
 * weights -- as torch ops take a dozen passes and full-size fp32 temporaries per tensor. Here each
 * element is read once, updated in fp32 registers and written once. Plain C (no torch headers): it
 * builds in about a second with any C compiler (-fopenmp-simd only lets the `omp simd` reductions
 * below reassociate; no OpenMP runtime is used); the caller splits a tensor into ranges and calls
 * these from several threads (ctypes releases the GIL), so no OpenMP runtime is loaded beside
 * torch's.
 *
 * Random bits for stochastic rounding come from a counter-based hash of (key, element index): the
 * draws do not depend on how the tensor is split across threads, and a resumed run draws the same
 * bits as an uninterrupted one (the key is derived from the seed, the tensor and its step count).
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
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Stochastic rounding: add 16 random bits below bf16's last bit and truncate (the fp32 bit pattern
 * is monotone in magnitude, so the carry lands with probability equal to the discarded fraction). */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t noise16) {
    uint32_t u = f32_bits(f);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + noise16) >> 16);
}

/* A 32-bit integer hash with good avalanche (two multiply-xorshift rounds). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* AdamW with decoupled weight decay, the operation order of torch's single-tensor AdamW:
 *   w *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2)*g*g;
 *   w -= step_size * m / (sqrt(v)/bc2_sqrt + eps)
 * g is scaled by gscale first (per-parameter clipping). 1 - beta1 and 1 - beta2 come from the caller
 * (computed in double, as torch does: 1 - (float)0.999 is 1.3e-5 off). The weight is read from `master` (fp32)
 * when given, else from `w`; it is written to `master` and rounded to nearest into `w`, or rounded
 * stochastically (sr_w) or to nearest into a bf16 `w`, or stored into an fp32 `w`.
 * Moments: fp32, or bf16 rounded stochastically (sr_state) or to nearest. */
static inline __attribute__((always_inline)) void adamw_body(
        int64_t lo, int64_t hi, void *restrict w, const int w_bf16, const int has_master, float *restrict master,
        const void *restrict g, const int g_bf16,
        void *restrict m, void *restrict v, const int mv_bf16, float gscale, float decay, float one_minus_b1,
        float beta2, float one_minus_b2, float eps, float step_size, float bc2_sqrt, const int sr_w,
        const int sr_state, uint32_t key) {
    for (int64_t i = lo; i < hi; i++) {
        float x = has_master ? master[i] : load(w, w_bf16, i);
        float gi = load(g, g_bf16, i) * gscale;
        float mi = load(m, mv_bf16, i), vi = load(v, mv_bf16, i);
        x *= decay;
        mi = mi + one_minus_b1 * (gi - mi);
        vi = vi * beta2 + one_minus_b2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        x = x - step_size * (mi / denom);
        uint32_t h = (sr_w || (mv_bf16 && sr_state)) ? mix32((uint32_t)i ^ key) : 0u;
        if (mv_bf16) {
            if (sr_state) {
                uint32_t h2 = mix32(h ^ 0x9e3779b9u);
                ((uint16_t *)m)[i] = f32_to_bf16_sr(mi, h2 & 0xFFFFu);
                ((uint16_t *)v)[i] = f32_to_bf16_sr(vi, h2 >> 16);
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
            ((uint16_t *)w)[i] = sr_w ? f32_to_bf16_sr(x, h & 0xFFFFu) : f32_to_bf16_rne(x);
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

/* Sum of squares of x[lo:hi]: fp32 sums over runs of 4096 elements (vectorised), added in double
 * (the clipping norm of a bf16 gradient without an fp32 copy). */
double lt_sumsq(int64_t lo, int64_t hi, const void *x, int bf16) {
    double s = 0.0;
    for (int64_t b = lo; b < hi; b += 4096) {
        const int64_t e = (hi - b) < 4096 ? hi : b + 4096;
        float acc = 0.0f;
        if (bf16) {
            const uint16_t *p = (const uint16_t *)x;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = b; i < e; i++) {
                float t = bf16_to_f32(p[i]);
                acc += t * t;
            }
        } else {
            const float *p = (const float *)x;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = b; i < e; i++) acc += p[i] * p[i];
        }
        s += acc;
    }
    return s;
}

/* torch.lerp's formula (two branches, for accuracy near either end). */
static inline float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

/* Adafactor, pass 1a over rows [r0, r1) of a (rows, cols) gradient: row_var[r] moves toward the
 * row's mean square by `beta` (torch's lerp). Returns the sum of squares of the weight's rows (for
 * the relative step size). Nothing is allocated: the row moments are updated where they are. */
double lt_adafactor_rows(int64_t r0, int64_t r1, int64_t cols, const void *g, int g_bf16, float gscale,
                         const void *w, int w_bf16, float *row_var, float beta) {
    double wsq = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        float rs = 0.0f, ws = 0.0f;
        const int64_t base = r * cols;
#pragma omp simd reduction(+ : rs, ws)
        for (int64_t c = 0; c < cols; c++) {
            float gi = load(g, g_bf16, base + c) * gscale;
            rs += gi * gi;
            float wi = load(w, w_bf16, base + c);
            ws += wi * wi;
        }
        row_var[r] = lerp(row_var[r], rs / (float)cols, beta);
        wsq += ws;
    }
    return wsq;
}

/* Adafactor, pass 1b over columns [c0, c1): col_var[c] moves toward the column's mean square,
 * COL_BLOCK columns at a time (their sums on the stack, 32 KB; each row's segment of the range read in
 * order, so a thread streams through its columns row after row). */
#define COL_BLOCK 8192
void lt_adafactor_cols(int64_t c0, int64_t c1, int64_t rows, int64_t cols, const void *g, int g_bf16,
                       float gscale, float *col_var, float beta) {
    float acc[COL_BLOCK];
    for (int64_t b = c0; b < c1; b += COL_BLOCK) {
        const int64_t n = (c1 - b) < COL_BLOCK ? (c1 - b) : COL_BLOCK;
        for (int64_t k = 0; k < n; k++) acc[k] = 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t base = r * cols + b;
            for (int64_t k = 0; k < n; k++) {
                float gi = load(g, g_bf16, base + k) * gscale;
                acc[k] += gi * gi;
            }
        }
        for (int64_t k = 0; k < n; k++) col_var[b + k] = lerp(col_var[b + k], acc[k] / (float)rows, beta);
    }
}

/* Adafactor, pass 2 (apply = 0): the sum of squares of the update u = g * rsqrt(max(rvar[r] *
 * cvar[c] * inv_rmean, eps1sq)) over rows [r0, r1), nothing written. Pass 3 (apply = 1):
 * w = w*decay - coef*u, rounded as in lt_adamw (bf16: stochastically with sr_w, else to nearest). */
static inline __attribute__((always_inline)) double adafactor_body(
        int64_t r0, int64_t r1, int64_t cols, const void *g, const int g_bf16, float gscale, void *w,
        const int w_bf16, const float *rvar, const float *cvar, float inv_rmean, float eps1sq, float decay,
        float coef, const int apply, const int sr_w, uint32_t key) {
    double total = 0.0;
    for (int64_t r = r0; r < r1; r++) {
        const float rv = rvar[r] * inv_rmean;
        const int64_t base = r * cols;
        float s = 0.0f;
        if (!apply) {
#pragma omp simd reduction(+ : s)
            for (int64_t c = 0; c < cols; c++) {
                float est = rv * cvar[c];
                est = est > eps1sq ? est : eps1sq;
                float u = load(g, g_bf16, base + c) * gscale / sqrtf(est);
                s += u * u;
            }
            total += s;
            continue;
        }
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = base + c;
            float est = rv * cvar[c];
            est = est > eps1sq ? est : eps1sq;
            float u = load(g, g_bf16, i) * gscale / sqrtf(est);
            float x = load(w, w_bf16, i) * decay - coef * u;
            if (w_bf16) {
                ((uint16_t *)w)[i] = sr_w ? f32_to_bf16_sr(x, mix32((uint32_t)i ^ key) & 0xFFFFu)
                                          : f32_to_bf16_rne(x);
            } else {
                ((float *)w)[i] = x;
            }
        }
    }
    return total;
}

#define ADAFACTOR_CASE(GB, WB, AP, SRW)                                                                 \
    if (g_bf16 == GB && w_bf16 == WB && apply == AP && sr_w == SRW)                                     \
        return adafactor_body(r0, r1, cols, g, GB, gscale, w, WB, rvar, cvar, inv_rmean, eps1sq, decay, \
                              coef, AP, SRW, key);

double lt_adafactor_update(int64_t r0, int64_t r1, int64_t cols, const void *g, int g_bf16, float gscale,
                           void *w, int w_bf16, const float *rvar, const float *cvar, float inv_rmean,
                           float eps1sq, float decay, float coef, int apply, int sr_w, uint32_t key) {
    ADAFACTOR_CASE(1, 1, 0, 0) ADAFACTOR_CASE(1, 1, 1, 1) ADAFACTOR_CASE(1, 1, 1, 0)
    ADAFACTOR_CASE(0, 0, 0, 0) ADAFACTOR_CASE(0, 0, 1, 0) ADAFACTOR_CASE(0, 1, 0, 0) ADAFACTOR_CASE(0, 1, 1, 1)
    ADAFACTOR_CASE(0, 1, 1, 0) ADAFACTOR_CASE(1, 0, 0, 0) ADAFACTOR_CASE(1, 0, 1, 0)
    return -1.0;
}
