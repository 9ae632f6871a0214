/*
 * Fused CPU kernels of the eager correction pass (see native/__init__.py for how they are built
 * and when they run).
 *
 * Each kernel makes one streaming pass over a block of whole rows, computing every per-token
 * value and every per-row reduction that the ATen pass computes with a dozen separate
 * operations. Rows are independent, so a call splits its rows over threads.
 *
 * Determinism: a row is processed in chunks of CHUNK tokens; within a chunk the values are
 * computed in groups of LANES tokens padded with zeros (a padded token is an invalid token and
 * contributes nothing), so every token goes through the same vector code whatever its position,
 * and the order of every sum depends only on the row's length — never on the block, the thread or
 * the memory alignment. Sums are accumulated per lane in float32 within a chunk and in float64
 * across chunks; the moments of ``band`` (w², c²) are taken and summed in float64.
 *
 * Built with -ffp-contract=off (no multiply-add is fused unless written as one, so the vector loop
 * computes exactly the arithmetic written here) and -fno-trapping-math (lets the compiler turn the
 * selects below into vector blends).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 512
#define LANES 16
#define SENTINEL 1e30f
#define SAFETY 20.0f

enum { F32 = 0, BF16 = 1 };

/* ---- element loading ---------------------------------------------------------------------- */

static void load_float(float *dst, const void *src, int dtype, int64_t n) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    }
}

/* 1.0f where the mask element is non-zero (any dtype: floats compare their magnitude bits, so
 * -0.0 is zero and NaN is non-zero, as ``mask != 0``), else 0.0f. */
static void load_mask(float *dst, const void *src, int itemsize, int is_float, int64_t n) {
    if (itemsize == 1) {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i] != 0 ? 1.0f : 0.0f;
    } else if (itemsize == 2) {
        const uint16_t *s = (const uint16_t *)src;
        const uint16_t bits = is_float ? 0x7fff : 0xffff;
        for (int64_t i = 0; i < n; i++) dst[i] = (s[i] & bits) != 0 ? 1.0f : 0.0f;
    } else if (itemsize == 4) {
        const uint32_t *s = (const uint32_t *)src;
        const uint32_t bits = is_float ? 0x7fffffffu : 0xffffffffu;
        for (int64_t i = 0; i < n; i++) dst[i] = (s[i] & bits) != 0 ? 1.0f : 0.0f;
    } else {
        const uint64_t *s = (const uint64_t *)src;
        const uint64_t bits = is_float ? 0x7fffffffffffffffull : 0xffffffffffffffffull;
        for (int64_t i = 0; i < n; i++) dst[i] = (s[i] & bits) != 0 ? 1.0f : 0.0f;
    }
}

/* The 0/1 float mask m written as 0 / ``one`` (the bit pattern of 1 in a dtype of that size). */
static void store_mask(char *dst, const float *m, int itemsize, uint64_t one, int64_t n) {
    if (itemsize == 1) {
        uint8_t *d = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = m[i] != 0.0f ? (uint8_t)one : 0;
    } else if (itemsize == 2) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = m[i] != 0.0f ? (uint16_t)one : 0;
    } else if (itemsize == 4) {
        uint32_t *d = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = m[i] != 0.0f ? (uint32_t)one : 0;
    } else {
        uint64_t *d = (uint64_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = m[i] != 0.0f ? one : 0;
    }
}

/* ---- exp on [-20, 20] ------------------------------------------------------------------------
 * exp(x) = 2^n · exp(r), n = round(x / ln 2), r = x − n ln 2 (ln 2 split in two so that n·hi is
 * exact), exp(r) = 1 + r + r²·P(r) with P of degree 5 on |r| ≤ ln2/2 (within 2 ulp). Written in
 * plain arithmetic so that the compiler vectorises it and every lane computes the same bits. */
static inline float exp_bounded(float x) {
    const float shifter = 12582912.0f; /* 1.5 · 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r;
    p = p + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

static inline float clampf(float x, float lo, float hi) {
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

/* ---- threads ------------------------------------------------------------------------------- */

typedef void (*row_fn)(const void *args, int64_t r0, int64_t r1);

typedef struct {
    row_fn fn;
    const void *args;
    int64_t r0, r1;
} task;

static void *run_task(void *p) {
    task *t = (task *)p;
    t->fn(t->args, t->r0, t->r1);
    return NULL;
}

#define MAX_THREADS 64

static void parallel_rows(row_fn fn, const void *args, int64_t rows, int threads) {
#ifdef _OPENMP
    /* The OpenMP runtime PyTorch's CPU kernels use (same soname, so the one already loaded): its
     * worker threads spin for a while after every parallel region, and threads of our own would
     * have to wait for them; sharing the pool avoids that. */
    if (threads > rows) threads = (int)rows;
    if (threads <= 1) {
        fn(args, 0, rows);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < threads; i++) fn(args, rows * i / threads, rows * (i + 1) / threads);
    return;
#endif
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = (int)rows;
    if (threads <= 1) {
        fn(args, 0, rows);
        return;
    }
    task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int i = 0; i < threads; i++) {
        tasks[i].fn = fn;
        tasks[i].args = args;
        tasks[i].r0 = rows * i / threads;
        tasks[i].r1 = rows * (i + 1) / threads;
    }
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&ids[i], NULL, run_task, &tasks[i]) == 0;
    fn(args, tasks[0].r0, tasks[0].r1);
    for (int i = 1; i < threads; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        else fn(args, tasks[i].r0, tasks[i].r1); /* could not start a thread: do its rows here */
    }
}

/* ---- the per-token pass ----------------------------------------------------------------------
 * Per row b, with m_t = 1[mask_t ≠ 0], s_t = old_t − rollout_t with NaN → 1e30 and ±inf (and any
 * |s| > 1e30) → ±1e30, lr_t = s_t·m_t, lrc_t = clamp(lr_t, ±20):
 *   outputs (B, T) float32: lr_t, m_t, ratio_t = exp(lrc_t)·m_t, k3_t = max(ratio_t − m_t − lrc_t, 0);
 *     and m_t once more in the caller's mask dtype (``keep``: the final mask when nothing rejects)
 *   sums (NSUM, B) float32: Σm, Σm (used), Σlr, Σ old_t·m_t, Σk3, Σratio, Σratio², Σlrc, Σk2
 *     (k2 = ½·lrc²), max k2, max k3
 *   good (B,) uint8: every valid |lr_t| < 1e30.
 * When drop_bad is set a row that is not good is dropped: its outputs are 0 and its sums other
 * than Σm (input) are 0. Otherwise (rows split across ranks: the group decides) nothing is dropped.
 */
enum { S_IN, S_USED, S_LR, S_OLD, S_K3, S_RATIO, S_RATIO2, S_LRC, S_K2, M_K2, M_K3, NSUM };

typedef struct {
    int64_t B, T;
    const char *old, *roll, *mask;
    int64_t old_stride, roll_stride, mask_stride; /* bytes between rows */
    int old_dtype, roll_dtype, mask_itemsize, mask_is_float;
    float *lr, *m, *ratio, *k3; /* (B, T) contiguous; NULL: not written */
    char *keep;                 /* (B, T) contiguous in the caller's mask dtype, or NULL */
    int keep_itemsize;
    uint64_t keep_one;          /* the bit pattern of 1 in that dtype */
    float *sums;                /* (NSUM, B) */
    uint8_t *good;              /* (B,) */
    int drop_bad;
} pass_args;

/* Ask for the next chunk of every input while this one is computed (the loop is compute-bound
 * on cached data; without this it also waits for memory at the start of every chunk). */
static inline void prefetch_stream(const char *base, int64_t stride, int64_t b, int64_t t, int64_t T, int itemsize) {
    if (t >= T) { /* the next row */
        b += 1;
        t = 0;
    }
    const char *p = base + b * stride + t * itemsize;
    const int64_t bytes = (T - t < CHUNK ? T - t : CHUNK) * itemsize;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static inline void prefetch_next(const pass_args *a, int64_t b, int64_t t0) {
    const int64_t t = t0 + CHUNK;
    if (t >= a->T && b + 1 >= a->B) return;
    prefetch_stream(a->old, a->old_stride, b, t, a->T, a->old_dtype == F32 ? 4 : 2);
    prefetch_stream(a->roll, a->roll_stride, b, t, a->T, a->roll_dtype == F32 ? 4 : 2);
    prefetch_stream(a->mask, a->mask_stride, b, t, a->T, a->mask_itemsize);
}

static void pass_rows(const void *p, int64_t r0, int64_t r1) {
    const pass_args *a = (const pass_args *)p;
    const int64_t T = a->T, B = a->B;
    float old[CHUNK], roll[CHUNK], m[CHUNK];
    float o_lr[CHUNK], o_ratio[CHUNK], o_k3[CHUNK];
    for (int64_t b = r0; b < r1; b++) {
        double tot[NSUM] = {0};
        float big = 0.0f; /* max |lr| over the row */
        float mx_k2 = 0.0f, mx_k3 = 0.0f;
        for (int64_t t0 = 0; t0 < T; t0 += CHUNK) {
            const int64_t n = T - t0 < CHUNK ? T - t0 : CHUNK;
            const int64_t padded = (n + LANES - 1) / LANES * LANES;
            prefetch_next(a, b, t0);
            load_float(old, a->old + b * a->old_stride + t0 * (a->old_dtype == F32 ? 4 : 2), a->old_dtype, n);
            load_float(roll, a->roll + b * a->roll_stride + t0 * (a->roll_dtype == F32 ? 4 : 2), a->roll_dtype, n);
            load_mask(m, a->mask + b * a->mask_stride + t0 * a->mask_itemsize, a->mask_itemsize, a->mask_is_float, n);
            for (int64_t i = n; i < padded; i++) old[i] = roll[i] = m[i] = 0.0f;
            float acc[8][LANES], mx[3][LANES];
            for (int j = 0; j < LANES; j++) {
                for (int k = 0; k < 8; k++) acc[k][j] = 0.0f;
                mx[0][j] = mx[1][j] = mx[2][j] = 0.0f;
            }
            for (int64_t i0 = 0; i0 < padded; i0 += LANES) {
                for (int j = 0; j < LANES; j++) {
                    const int64_t i = i0 + j;
                    const float mi = m[i], oi = old[i];
                    float s = oi - roll[i];
                    s = s != s ? SENTINEL : clampf(s, -SENTINEL, SENTINEL);
                    const float lr = s * mi;
                    const float lrc = clampf(lr, -SAFETY, SAFETY);
                    const float ratio = exp_bounded(lrc) * mi;
                    float k3 = (ratio - mi) - lrc;
                    k3 = k3 > 0.0f ? k3 : 0.0f;
                    const float k2 = (0.5f * lrc) * lrc;
                    const float used_old = mi != 0.0f ? oi : 0.0f;
                    const float mag = lr < 0.0f ? -lr : lr;
                    o_lr[i] = lr;
                    o_ratio[i] = ratio;
                    o_k3[i] = k3;
                    acc[0][j] += mi;
                    acc[1][j] += lr;
                    acc[2][j] += used_old;
                    acc[3][j] += k3;
                    acc[4][j] += ratio;
                    acc[5][j] += lrc;
                    acc[6][j] += k2;
                    acc[7][j] += ratio * ratio;
                    mx[0][j] = mag > mx[0][j] ? mag : mx[0][j];
                    mx[1][j] = k2 > mx[1][j] ? k2 : mx[1][j];
                    mx[2][j] = k3 > mx[2][j] ? k3 : mx[2][j];
                }
            }
            static const int slot[8] = {S_IN, S_LR, S_OLD, S_K3, S_RATIO, S_LRC, S_K2, S_RATIO2};
            for (int k = 0; k < 8; k++) {
                double c = 0.0;
                for (int j = 0; j < LANES; j++) c += acc[k][j];
                tot[slot[k]] += c;
            }
            for (int j = 0; j < LANES; j++) {
                big = mx[0][j] > big ? mx[0][j] : big;
                mx_k2 = mx[1][j] > mx_k2 ? mx[1][j] : mx_k2;
                mx_k3 = mx[2][j] > mx_k3 ? mx[2][j] : mx_k3;
            }
            const int64_t off = b * T + t0;
            if (a->lr) memcpy(a->lr + off, o_lr, (size_t)n * sizeof(float));
            if (a->m) memcpy(a->m + off, m, (size_t)n * sizeof(float));
            if (a->keep) store_mask(a->keep + off * a->keep_itemsize, m, a->keep_itemsize, a->keep_one, n);
            if (a->ratio) memcpy(a->ratio + off, o_ratio, (size_t)n * sizeof(float));
            if (a->k3) memcpy(a->k3 + off, o_k3, (size_t)n * sizeof(float));
        }
        const int good = big < SENTINEL;
        a->good[b] = (uint8_t)good;
        tot[S_USED] = tot[S_IN];
        tot[M_K2] = mx_k2;
        tot[M_K3] = mx_k3;
        if (!good && a->drop_bad) {
            const int64_t off = b * T;
            if (a->keep) memset(a->keep + off * a->keep_itemsize, 0, (size_t)(T * a->keep_itemsize));
            float *outs[4] = {a->lr, a->m, a->ratio, a->k3};
            for (int k = 0; k < 4; k++)
                if (outs[k]) memset(outs[k] + off, 0, (size_t)T * sizeof(float));
            for (int k = S_USED; k < NSUM; k++) tot[k] = 0.0;
        }
        for (int k = 0; k < NSUM; k++) a->sums[k * B + b] = (float)tot[k];
    }
}

/* 1 when built with OpenMP (rows are split over the OpenMP pool), else 0 (POSIX threads). */
int rc_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int rc_pass(int64_t B, int64_t T, const void *old, int64_t old_stride, int old_dtype, const void *roll,
            int64_t roll_stride, int roll_dtype, const void *mask, int64_t mask_stride, int mask_itemsize,
            int mask_is_float, float *lr, float *m, float *ratio, float *k3, char *keep, int keep_itemsize,
            uint64_t keep_one, float *sums, uint8_t *good, int drop_bad, int threads) {
    pass_args a = {B, T, (const char *)old, (const char *)roll, (const char *)mask, old_stride, roll_stride,
                   mask_stride, old_dtype, roll_dtype, mask_itemsize, mask_is_float, lr, m, ratio, k3, keep,
                   keep_itemsize, keep_one, sums, good, drop_bad};
    parallel_rows(pass_rows, &a, B, threads);
    return NSUM;
}

/* ---- band statistics of a per-token value ----------------------------------------------------
 * For x (B, T) float32 and the 0/1 mask m (both contiguous, x = 0 where m = 0), with a band
 * [lo, hi]: high_t = m_t·1[x_t > hi], low_t = m_t·1[x_t < lo], and a value v_t:
 *   mode KEEP:     v = x, and out = 1 − high − low (the keep indicator of a rejection criterion)
 *   mode TRUNCATE: v = out = min(x, whi)                       (bounded importance weights)
 *   mode CLIP:     v = out = clamp(x, wlo, whi)·m
 *   mode MASK:     v = out = x·1[wlo ≤ x ≤ whi]
 * stats (NSTAT, B) float64: Σv, Σv², max v, min v (over valid tokens; −1e30 / 1e30 for a row
 * without one), Σhigh, Σlow, Σz, Σz² with z = clamp(x, zlo, zhi)·m.
 * With transform K1 / K2 the input is log ρ and x = −clamp(log ρ, ±20) / ½·clamp(log ρ, ±20)²
 * (the divergence estimators k1 and k2).
 */
enum { B_SUM, B_SUM2, B_MAX, B_MIN, B_HIGH, B_LOW, B_ZSUM, B_ZSUM2, NSTAT };
enum { MODE_KEEP = 1, MODE_TRUNCATE = 2, MODE_CLIP = 3, MODE_MASK = 4 };
enum { T_NONE = 0, T_K1 = 1, T_K2 = 2 };

typedef struct {
    int64_t B, T;
    const float *x, *m;
    float *out;
    double *stats;
    float lo, hi, wlo, whi, zlo, zhi;
    int mode, transform;
} band_args;

/* (inlined once per mode, so that each copy of the token loop is branch-free and vectorised) */
static inline __attribute__((always_inline)) void band_rows_mode(const band_args *a, int64_t r0, int64_t r1,
                                                                 const int mode) {
    const int64_t T = a->T, B = a->B;
    const float lo = a->lo, hi = a->hi, wlo = a->wlo, whi = a->whi, zlo = a->zlo, zhi = a->zhi;
    float x[CHUNK], m[CHUNK], y[CHUNK];
    for (int64_t b = r0; b < r1; b++) {
        double tot[NSTAT] = {0};
        float vmax = -SENTINEL, vmin = SENTINEL;
        for (int64_t t0 = 0; t0 < T; t0 += CHUNK) {
            const int64_t n = T - t0 < CHUNK ? T - t0 : CHUNK;
            const int64_t padded = (n + LANES - 1) / LANES * LANES;
            memcpy(x, a->x + b * T + t0, (size_t)n * sizeof(float));
            memcpy(m, a->m + b * T + t0, (size_t)n * sizeof(float));
            if (a->transform == T_K1) {
                for (int64_t i = 0; i < n; i++) x[i] = -clampf(x[i], -SAFETY, SAFETY);
            } else if (a->transform == T_K2) {
                for (int64_t i = 0; i < n; i++) {
                    const float c = clampf(x[i], -SAFETY, SAFETY);
                    x[i] = (0.5f * c) * c;
                }
            }
            for (int64_t i = n; i < padded; i++) x[i] = m[i] = 0.0f;
            float hs[LANES], ls[LANES], mxv[LANES], mnv[LANES];
            double vs[LANES], vs2[LANES], zs[LANES], zs2[LANES];
            for (int j = 0; j < LANES; j++) {
                hs[j] = ls[j] = 0.0f;
                mxv[j] = -SENTINEL;
                mnv[j] = SENTINEL;
                vs[j] = vs2[j] = zs[j] = zs2[j] = 0.0;
            }
            for (int64_t i0 = 0; i0 < padded; i0 += LANES) {
                for (int j = 0; j < LANES; j++) {
                    const int64_t i = i0 + j;
                    const float xi = x[i], mi = m[i];
                    const float high = xi > hi ? mi : 0.0f;
                    const float low = xi < lo ? mi : 0.0f;
                    float v;
                    if (mode == MODE_TRUNCATE) {
                        v = xi < whi ? xi : whi;
                        y[i] = v;
                    } else if (mode == MODE_CLIP) {
                        v = clampf(xi, wlo, whi) * mi;
                        y[i] = v;
                    } else if (mode == MODE_MASK) {
                        v = (xi >= wlo && xi <= whi) ? xi : 0.0f;
                        y[i] = v;
                    } else {
                        v = xi;
                        y[i] = (1.0f - high) - low;
                    }
                    const float z = clampf(xi, zlo, zhi) * mi;
                    const float pad = (mi - 1.0f) * SENTINEL; /* 0 at valid tokens, −1e30 elsewhere */
                    const float up = v + pad, down = v - pad;
                    hs[j] += high;
                    ls[j] += low;
                    vs[j] += (double)v;
                    vs2[j] += (double)v * (double)v;
                    zs[j] += (double)z;
                    zs2[j] += (double)z * (double)z;
                    mxv[j] = up > mxv[j] ? up : mxv[j];
                    mnv[j] = down < mnv[j] ? down : mnv[j];
                }
            }
            for (int j = 0; j < LANES; j++) {
                tot[B_HIGH] += hs[j];
                tot[B_LOW] += ls[j];
                tot[B_SUM] += vs[j];
                tot[B_SUM2] += vs2[j];
                tot[B_ZSUM] += zs[j];
                tot[B_ZSUM2] += zs2[j];
                vmax = mxv[j] > vmax ? mxv[j] : vmax;
                vmin = mnv[j] < vmin ? mnv[j] : vmin;
            }
            if (a->out != NULL) memcpy(a->out + b * T + t0, y, (size_t)n * sizeof(float));
        }
        tot[B_MAX] = vmax;
        tot[B_MIN] = vmin;
        for (int k = 0; k < NSTAT; k++) a->stats[k * B + b] = tot[k];
    }
}

static void band_rows(const void *p, int64_t r0, int64_t r1) {
    const band_args *a = (const band_args *)p;
    switch (a->mode) {
    case MODE_TRUNCATE: band_rows_mode(a, r0, r1, MODE_TRUNCATE); break;
    case MODE_CLIP: band_rows_mode(a, r0, r1, MODE_CLIP); break;
    case MODE_MASK: band_rows_mode(a, r0, r1, MODE_MASK); break;
    default: band_rows_mode(a, r0, r1, MODE_KEEP); break;
    }
}

int rc_band(int64_t B, int64_t T, const float *x, const float *m, float *out, double *stats, float lo, float hi,
            float wlo, float whi, float zlo, float zhi, int mode, int transform, int threads) {
    band_args a = {B, T, x, m, out, stats, lo, hi, wlo, whi, zlo, zhi, mode, transform};
    parallel_rows(band_rows, &a, B, threads);
    return NSTAT;
}
