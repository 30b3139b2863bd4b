/* gpt2lab's compiled GEMV (kernels.py's DecodeLinear: gemv, its panels, int8-gemv): y = scale * (W @ x)
 * + bias for weights W (N, K, row-major) held as int8 with one fp32 scale per row, or as bf16 (no
 * scale; row-major or in panels), and fp32 inputs x (M, K); products and sums in fp32.
 *
 * Decoding one row is bound by reading the weights: each weight row is read once, converted to fp32
 * in registers and multiplied there; the rows are shared among OpenMP threads. At four rows or more
 * two weight rows are converted in registers and multiplied with four input rows at a time (eight
 * sums in registers), so the weights are still read from memory once. The AVX2/FMA routines are
 * compiled for that instruction set alone (a target attribute) and used only where the CPU reports
 * both; the plain C loops serve elsewhere (kernels.py then leaves these kernels out: they would not be
 * faster). bf16 weights may ask for their inputs rounded to bf16 first (HELD_BF16_ROUNDED), multiplied
 * by the fp32 routines; where the CPU and the compiler have AVX512_BF16 such weights are held in panels
 * instead (HELD_BF16_PANELS, below) and every row count is multiplied by its dot products.
 *
 * Called from Python with tensors' data pointers; kernels.py checks dtypes, shapes and contiguity.
 * The GIL is released while it runs. Built at install by setup.py; optional (no compiler, no kernel). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMV_X86 1
#include <immintrin.h>
#endif

/* What a linear holds: int8 weights, bf16 weights, bf16 weights whose inputs are rounded to bf16 first,
 * or such weights in panels (the Python side's codes 0, 1, 2, 3; a hold on a CPU with native bf16 asks
 * for the last where the AVX512_BF16 routines run, else for the third). */
enum held { HELD_INT8, HELD_BF16, HELD_BF16_ROUNDED, HELD_BF16_PANELS };

/* bf16 weights in panels (kernels.py's pack_panels): a group of PANEL_OUT outputs (two panels of 16, one
 * 512-bit register each) holds, for each pair of inputs (2q, 2q + 1), the 32 bf16 weights of each panel,
 * output o's pair at 2o and 2o + 1: the layout VDPBF16PS multiplies against one pair of inputs broadcast
 * to every lane, 16 outputs' sums in one register, so no sum is reduced across lanes and each weight
 * register serves every input row of a tile. A group's pairs follow each other, so its weights are one
 * sequential stream; the outputs are padded with zero weights to a whole group, the inputs to an even
 * count (K odd is not held so). */
#define PANEL_OUT 32

/* The AVX512_BF16 routines, where the compiler knows the instruction set (GCC 11, clang 9 and later);
 * elsewhere inputs rounded to bf16 are multiplied by the fp32 routines. */
#if defined(GEMV_X86) && ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 11))
#define GEMV_DP 1
#endif

/* A bf16 value is the high half of the fp32 with the same sign, exponent and leading mantissa bits. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 to bf16, to nearest with ties to even (as PyTorch's conversion); a NaN stays a NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float dot_plain(enum held kind, const void *w, const float *x, Py_ssize_t k) {
    float acc = 0.f;
    if (kind == HELD_INT8)
        for (Py_ssize_t i = 0; i < k; i++) acc += (float)((const int8_t *)w)[i] * x[i];
    else
        for (Py_ssize_t i = 0; i < k; i++) acc += bf16_to_f32(((const uint16_t *)w)[i]) * x[i];
    return acc;
}

static float dot_f32_plain(const float *w, const float *x, Py_ssize_t k) {
    float acc = 0.f;
    for (Py_ssize_t i = 0; i < k; i++) acc += w[i] * x[i];
    return acc;
}

#ifdef GEMV_X86
__attribute__((target("avx2,fma"))) static float hsum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

/* Eight weights as eight floats. int8: the sign extension reads its 8 bytes straight from memory;
 * bf16: 16 bytes zero-extended to 32 bits a value and shifted into the high half. */
__attribute__((target("avx2,fma"))) static inline __m256 widen8(enum held kind, const void *w, Py_ssize_t i) {
    if (kind == HELD_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* How far ahead of the one-row product the weights are asked for (software prefetch, into every
 * cache level). A thread streams its rows front to back; what keeps the memory busy is the lines in
 * flight, and this loop's out-of-order window holds fewer lines than the loads of a plain read would
 * (an AVX2 EPYC: its GEMV read 15-17% slower than a plain sum of the same bytes; asked for 1 KiB
 * ahead, the 124M's one-row step 3% (bf16) and 8% (int8) faster on huge pages, 5-10% on 4 KiB ones).
 * Why 1 KiB holds elsewhere: it is 1/32 of the smallest L1 data cache of the CPUs these kernels run
 * on (32 KiB), so nothing asked for is evicted before its use, and a prefetch of a line already on
 * its way costs one instruction a 64-byte line; where the hardware keeps enough lines in flight
 * without it, it changes nothing. */
#define PREFETCH_AHEAD 1024

/* 32 weights a step, multiplied into four accumulators (four independent chains keep the FMA units
 * busy). ``kind`` is a constant at each call site, so each routine is compiled once a kind. */
__attribute__((target("avx2,fma"))) static inline float dot_avx2(enum held kind, const void *w, const float *x,
                                                                 Py_ssize_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    const char *bytes = (const char *)w;
    Py_ssize_t es = kind == HELD_INT8 ? 1 : 2;
    for (; i + 32 <= k; i += 32) {
        _mm_prefetch(bytes + i * es + PREFETCH_AHEAD, _MM_HINT_T0); /* never faults, even past the end */
        a0 = _mm256_fmadd_ps(widen8(kind, w, i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(widen8(kind, w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(kind, w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(kind, w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    const void *rest = kind == HELD_INT8 ? (const void *)((const int8_t *)w + i) : (const void *)((const uint16_t *)w + i);
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + dot_plain(kind, rest, x + i, k - i);
}

__attribute__((target("avx2,fma"))) static float dot_i8_avx2(const void *w, const float *x, Py_ssize_t k) {
    return dot_avx2(HELD_INT8, w, x, k);
}

__attribute__((target("avx2,fma"))) static float dot_bf16_avx2(const void *w, const float *x, Py_ssize_t k) {
    return dot_avx2(HELD_BF16, w, x, k);
}

__attribute__((target("avx2,fma"))) static void widen_avx2(enum held kind, const void *w, float *out, Py_ssize_t k) {
    Py_ssize_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(out + i, widen8(kind, w, i));
    for (; i < k; i++)
        out[i] = kind == HELD_INT8 ? (float)((const int8_t *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

/* Four input rows against one widened weight row: each weight vector loaded once for four FMAs. */
__attribute__((target("avx2,fma"))) static void dot4_f32_avx2(const float *w, const float *x, Py_ssize_t k,
                                                               float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 v = _mm256_loadu_ps(w + i);
        a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + k + i), a1);
        a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + 2 * k + i), a2);
        a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + 3 * k + i), a3);
    }
    out[0] = hsum(a0) + dot_f32_plain(w + i, x + i, k - i);
    out[1] = hsum(a1) + dot_f32_plain(w + i, x + k + i, k - i);
    out[2] = hsum(a2) + dot_f32_plain(w + i, x + 2 * k + i, k - i);
    out[3] = hsum(a3) + dot_f32_plain(w + i, x + 3 * k + i, k - i);
}

/* Eight sums (a vector each) reduced together: lane j of the result is the sum of a[j]'s lanes. */
__attribute__((target("avx2,fma"))) static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight weights of rows w0 and w1 from i on, widened, against nr (2-4) input rows: into a[j], a[4 + j]. */
__attribute__((target("avx2,fma"), always_inline)) static inline void fma2xn(enum held kind, const void *w0,
                                                                             const void *w1, const float *x,
                                                                             Py_ssize_t k, Py_ssize_t i, int nr,
                                                                             __m256 *a) {
    __m256 v0 = widen8(kind, w0, i), v1 = widen8(kind, w1, i);
    for (int j = 0; j < nr; j++) {
        __m256 xv = _mm256_loadu_ps(x + j * k + i);
        a[j] = _mm256_fmadd_ps(v0, xv, a[j]);
        a[4 + j] = _mm256_fmadd_ps(v1, xv, a[4 + j]);
    }
}

/* Two held weight rows (w0, and w1 right after it) against nr input rows (2-4: a constant where it
 * is inlined, so each count is compiled apart: tile2x4, 2x3, 2x2), the weights widened in registers:
 * each weight vector loaded once for 2nr FMAs, each input vector once for two, 2nr independent sums.
 * out[j] = w0 . x_j, out[4 + j] = w1 . x_j.
 *
 * With four rows or more the product is bound by the FMAs, not by the read: while this pair is
 * multiplied, the next pair (the same offset two rows on, where a thread's rows continue) is asked
 * for, so its lines arrive during the work rather than in the loop's own loads. The distance is the
 * rows' own length, whatever the CPU; PREFETCH_AHEAD is the one-row product's, which the read bounds.
 * (The 124M's head at 4 and 8 rows on an AVX2 EPYC: 6.8 and 8.1 ms against 8.7 and 12.4 with 1 KiB.) */
__attribute__((target("avx2,fma"), always_inline)) static inline void tile2xn(enum held kind, const void *w0,
                                                                              const float *x, Py_ssize_t k, int nr,
                                                                              float *out) {
    const size_t es = kind == HELD_INT8 ? 1 : 2;
    const void *w1 = (const char *)w0 + (size_t)k * es;
    const char *next = (const char *)w0 + 2 * (size_t)k * es;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 32 <= k; i += 32) { /* 32 weights a row: a 64-byte line of bf16 (half one of int8) */
        _mm_prefetch(next + i * es, _MM_HINT_T0);
        _mm_prefetch(next + (k + i) * es, _MM_HINT_T0);
        for (int u = 0; u < 32; u += 8) fma2xn(kind, w0, w1, x, k, i + u, nr, a);
    }
    for (; i + 8 <= k; i += 8) fma2xn(kind, w0, w1, x, k, i, nr, a);
    _mm256_storeu_ps(out, hsum8(a));
    if (i < k) {
        const void *r0 = (const char *)w0 + i * es, *r1 = (const char *)w1 + i * es;
        for (int j = 0; j < nr; j++) {
            out[j] += dot_plain(kind, r0, x + j * k + i, k - i);
            out[4 + j] += dot_plain(kind, r1, x + j * k + i, k - i);
        }
    }
}

/* The three counts rows_pair asks for, each compiled apart. */
__attribute__((target("avx2,fma"))) static void tile2x4(enum held kind, const void *w0, const float *x, Py_ssize_t k,
                                                        float *out) {
    tile2xn(kind, w0, x, k, 4, out);
}

__attribute__((target("avx2,fma"))) static void tile2x3(enum held kind, const void *w0, const float *x, Py_ssize_t k,
                                                        float *out) {
    tile2xn(kind, w0, x, k, 3, out);
}

__attribute__((target("avx2,fma"))) static void tile2x2(enum held kind, const void *w0, const float *x, Py_ssize_t k,
                                                        float *out) {
    tile2xn(kind, w0, x, k, 2, out);
}

#ifdef GEMV_DP
#define DP_TARGET "avx512f,avx512bf16"
/* One group of panels (g: its first weights) against nr (1-8) input rows rounded to bf16 (xb, row j at
 * j * k; k even): a[j][p] += pair q of panel p times row j's inputs 2q, 2q + 1, for every pair in turn.
 * Each output's sum is a chain over the pairs in order whatever nr is, so a row's results are the same
 * alone, in a batch or in a prompt. Two weight registers and 2nr sums: at one row two chains of
 * VDPBF16PS are enough to stream the weights (each waits on its last for one 64-byte line), at eight the
 * registers are full (16 sums). The weights are asked for PREFETCH_AHEAD on, as the one-row product's. */
__attribute__((target(DP_TARGET), always_inline)) static inline void group_dp(const uint16_t *g, const uint16_t *xb,
                                                                              Py_ssize_t k, int nr, __m512 *a) {
    for (int j = 0; j < 2 * nr; j++) a[j] = _mm512_setzero_ps();
    for (Py_ssize_t q = 0; q < k / 2; q++) {
        const uint16_t *wq = g + q * 2 * PANEL_OUT;
        _mm_prefetch((const char *)wq + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)wq + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)wq);
        __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(wq + 32));
        for (int j = 0; j < nr; j++) {
            int32_t pair;
            memcpy(&pair, xb + j * k + 2 * q, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            a[2 * j] = _mm512_dpbf16_ps(a[2 * j], v0, xv);
            a[2 * j + 1] = _mm512_dpbf16_ps(a[2 * j + 1], v1, xv);
        }
    }
}

/* The row counts panel_rows asks for, each compiled apart (nr a constant: the sums stay in registers). */
#define GROUP_DP(NR)                                                                                              \
    __attribute__((target(DP_TARGET))) static void group_dp##NR(const uint16_t *g, const uint16_t *xb,        \
                                                                  Py_ssize_t k, float *out) {                 \
        __m512 a[2 * NR];                                                                                     \
        group_dp(g, xb, k, NR, a);                                                                            \
        for (int j = 0; j < 2 * NR; j++) _mm512_storeu_ps(out + 16 * j, a[j]);                               \
    }
GROUP_DP(1)
GROUP_DP(2)
GROUP_DP(3)
GROUP_DP(4)
GROUP_DP(5)
GROUP_DP(6)
GROUP_DP(7)
GROUP_DP(8)
static void (*const group_dp_rows[9])(const uint16_t *, const uint16_t *, Py_ssize_t, float *) = {
    NULL, group_dp1, group_dp2, group_dp3, group_dp4, group_dp5, group_dp6, group_dp7, group_dp8};
#endif
#endif

static int cpu_has_avx2(void) {
#ifdef GEMV_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Whether the AVX512_BF16 routines run here; set_bf16_dot can turn them off (tests: the other branch). */
static int bf16_dot_allowed = 1;

static int bf16_dot_runs(void) {
#ifdef GEMV_DP
    __builtin_cpu_init();
    return bf16_dot_allowed && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* What a row's result does to its place in y: set it, or add to it (a residual). */
enum epilogue { SET, ADD };

static inline void put(float *p, float v, enum epilogue e) {
    if (e == ADD)
        *p += v;
    else
        *p = v;
}

/* GELU (tanh form): 0.5 v (1 + tanh(u)) with u = sqrt(2/pi) (v + 0.044715 v^3), written v / (1 + exp(-2u)). */
#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */

static inline float gelu_tanh(float v) { return 0.5f * v * (1.f + tanhf(GELU_K * (v + 0.044715f * v * v * v))); }

#ifdef GEMV_X86
/* exp of eight floats: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its degree-6 Taylor-like
 * minimax polynomial (Cephes' expf coefficients, ~1 ulp), times 2^n built in the exponent bits. x is
 * clamped to [-87, 88], where every result is a normal float (e^-87 ~ 1.6e-38: a softmax or a GELU
 * treats it as the 0 it rounds to in the sums). */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) static void gelu_avx2(float *v, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(GELU_K),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
        __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), u)));
        _mm256_storeu_ps(v + i, _mm256_div_ps(x, d));
    }
    for (; i < n; i++) v[i] = gelu_tanh(v[i]);
}
#endif

/* GELU in place on n floats, shared among the threads of the enclosing region (a worksharing loop). */
static void gelu_shared(float *v, Py_ssize_t n, int avx2) {
    const Py_ssize_t chunk = 256;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t s = 0; s < n; s += chunk) {
        Py_ssize_t e = s + chunk < n ? s + chunk : n;
#ifdef GEMV_X86
        if (avx2) {
            gelu_avx2(v + s, e - s);
            continue;
        }
#endif
        for (Py_ssize_t i = s; i < e; i++) v[i] = gelu_tanh(v[i]);
    }
}

/* Weight row r against every input row: y[i, r] for i < m; buf is this thread's K-float buffer
 * (four rows or more, AVX2: the weight row widened once for all of them). */
static void rows(enum held kind, const float *x, const void *wts, const float *scale, const float *bias, float *y,
                 Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t r, float *buf, int avx2, enum epilogue e) {
    const void *wr = kind == HELD_INT8 ? (const void *)((const int8_t *)wts + r * k)
                                       : (const void *)((const uint16_t *)wts + r * k);
    float s = scale ? scale[r] : 1.f, b = bias ? bias[r] : 0.f;
#ifdef GEMV_X86
    if (avx2) {
        float (*dot)(const void *, const float *, Py_ssize_t) = kind == HELD_INT8 ? dot_i8_avx2 : dot_bf16_avx2;
        Py_ssize_t i = 0;
        if (m >= 4) {
            float four[4];
            widen_avx2(kind, wr, buf, k);
            for (; i + 4 <= m; i += 4) {
                dot4_f32_avx2(buf, x + i * k, k, four);
                for (int j = 0; j < 4; j++) put(y + (i + j) * n + r, s * four[j] + b, e);
            }
        }
        for (; i < m; i++) put(y + i * n + r, s * dot(wr, x + i * k, k) + b, e); /* one row, or the rows left */
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < m; i++) put(y + i * n + r, s * dot_plain(kind, wr, x + i * k, k) + b, e);
}

/* Weight rows r and r + 1 (r alone where it is the last) against every input row: by tile2xn (AVX2)
 * where there are four input rows or more, else (and for one row left) by rows(); buf (K floats) is
 * rows()'s, for a last weight row alone against four input rows or more. */
static void rows_pair(enum held kind, const float *x, const void *wts, const float *scale, const float *bias,
                      float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t r, float *buf, int avx2,
                      enum epilogue e) {
#ifdef GEMV_X86
    if (avx2 && m >= 4 && r + 1 < n) {
        size_t es = kind == HELD_INT8 ? 1 : 2;
        const char *w0 = (const char *)wts + (size_t)(r * k) * es;
        float s0 = scale ? scale[r] : 1.f, s1 = scale ? scale[r + 1] : 1.f;
        float b0 = bias ? bias[r] : 0.f, b1 = bias ? bias[r + 1] : 0.f, eight[8];
        Py_ssize_t i = 0;
        /* Four input rows at a time, then the two or three left, the weight rows now in cache. Two or
         * three rows alone go row by row (rows()): their product is still bound by the weights' read,
         * which the one-row kernel streams faster (the 124M's head at two rows: 6.1-6.5 ms against
         * 7.2-7.3 by a tile, an AVX2 EPYC), where the seven rows of a 4 + 3 batch gain (the step
         * 45.9 -> 37.4 ms). */
        while (m - i >= 4 || (i > 0 && m - i >= 2)) {
            int nr = m - i >= 4 ? 4 : (int)(m - i);
            (nr == 4 ? tile2x4 : nr == 3 ? tile2x3 : tile2x2)(kind, w0, x + i * k, k, eight);
            for (int j = 0; j < nr; j++) {
                put(y + (i + j) * n + r, s0 * eight[j] + b0, e);
                put(y + (i + j) * n + r + 1, s1 * eight[4 + j] + b1, e);
            }
            i += nr;
        }
        if (i < m) { /* one input row left */
            rows(kind, x + i * k, wts, scale, bias, y + i * n, 1, k, n, r, buf, avx2, e);
            rows(kind, x + i * k, wts, scale, bias, y + i * n, 1, k, n, r + 1, buf, avx2, e);
        }
        return;
    }
#endif
    rows(kind, x, wts, scale, bias, y, m, k, n, r, buf, avx2, e);
    if (r + 1 < n) rows(kind, x, wts, scale, bias, y, m, k, n, r + 1, buf, avx2, e);
}

struct linear {
    const void *w;      /* (n, k) int8 or bf16, row-major */
    const float *scale; /* int8: one a row; bf16: NULL */
    const float *bias;  /* NULL: none */
};


/* The inputs of a HELD_BF16_ROUNDED or HELD_BF16_PANELS linear rounded to bf16, shared by the threads (m
 * rows of the widest input): as bf16 for the panels (dp: by the AVX512_BF16 routines, which run here),
 * else as the fp32 values of those bf16s, which the fp32 routines multiply. */
struct rounded {
    uint16_t *xb;
    float *xr;
    int dp;
};

/* The same sums as group_dp in plain C, pair by pair, each pair's second product added first as
 * VDPBF16PS is specified to (where the AVX512_BF16 routines do not run: turned off after the hold, as a
 * test does, or a panel hold made where they do not run). */
static void group_plain(const uint16_t *g, const uint16_t *xb, Py_ssize_t k, int nr, float *out) {
    for (int j = 0; j < nr; j++) {
        float *acc = out + PANEL_OUT * j;
        for (int o = 0; o < PANEL_OUT; o++) acc[o] = 0.f;
        for (Py_ssize_t q = 0; q < k / 2; q++) {
            const uint16_t *w = g + q * 2 * PANEL_OUT;
            float x0 = bf16_to_f32(xb[j * k + 2 * q]), x1 = bf16_to_f32(xb[j * k + 2 * q + 1]);
            for (int o = 0; o < PANEL_OUT; o++) {
                acc[o] += bf16_to_f32(w[2 * o + 1]) * x1;
                acc[o] += bf16_to_f32(w[2 * o]) * x0;
            }
        }
    }
}

/* Group gi of a panel-held linear against every input row (xb, rounded; k even), up to eight rows at a
 * time (the rows past the first eight read the group again from the cache): out[i, o] for its outputs
 * o < n. */
static void panel_rows(const struct linear *l, const uint16_t *xb, float *y, Py_ssize_t m, Py_ssize_t k,
                       Py_ssize_t n, Py_ssize_t gi, int dp, enum epilogue e) {
    const uint16_t *g = (const uint16_t *)l->w + gi * k * PANEL_OUT;
    Py_ssize_t o0 = gi * PANEL_OUT, width = n - o0 < PANEL_OUT ? n - o0 : PANEL_OUT;
    float tile[8 * PANEL_OUT];
    for (Py_ssize_t i = 0; i < m; i += 8) {
        int nr = m - i >= 8 ? 8 : (int)(m - i);
#ifdef GEMV_DP
        if (dp)
            group_dp_rows[nr](g, xb + i * k, k, tile);
        else
#endif
            group_plain(g, xb + i * k, k, nr, tile);
        for (int j = 0; j < nr; j++)
            for (Py_ssize_t o = 0; o < width; o++)
                put(y + (i + j) * n + o0 + o, tile[PANEL_OUT * j + o] + (l->bias ? l->bias[o0 + o] : 0.f), e);
    }
}

/* The threads of the enclosing OpenMP region share the weight rows of one linear, two at a time:
 * out[i, r] for every input row i < m (orphaned worksharing loops: called from inside the region).
 * HELD_BF16_ROUNDED, HELD_BF16_PANELS: the inputs are rounded first (``rd``), a loop whose end every
 * thread waits at; panels are shared a group at a time. */
static void linear_rows(enum held kind, const struct linear *l, const float *in, float *out, Py_ssize_t m,
                        Py_ssize_t k, Py_ssize_t n, float *wb, int avx2, enum epilogue e, const struct rounded *rd) {
    if (kind == HELD_BF16_ROUNDED || kind == HELD_BF16_PANELS) {
        int panels = kind == HELD_BF16_PANELS; /* panels read bf16 inputs; the fp32 routines their values */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (Py_ssize_t s = 0; s < m * k; s += 256) {
            Py_ssize_t end = s + 256 < m * k ? s + 256 : m * k;
            for (Py_ssize_t j = s; j < end; j++) {
                uint16_t h = f32_to_bf16(in[j]);
                if (panels)
                    rd->xb[j] = h;
                else
                    rd->xr[j] = bf16_to_f32(h);
            }
        }
        if (panels) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (Py_ssize_t gi = 0; gi < (n + PANEL_OUT - 1) / PANEL_OUT; gi++)
                panel_rows(l, rd->xb, out, m, k, n, gi, rd->dp, e);
            return;
        }
        kind = HELD_BF16;
        in = rd->xr;
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t r = 0; r < n; r += 2) rows_pair(kind, in, l->w, l->scale, l->bias, out, m, k, n, r, wb, avx2, e);
}

/* Room for m rows of k inputs rounded (NULL where the kind does not round, or where malloc failed:
 * *ok then 0); filled in by linear_rows. */
static void *rounded_alloc(struct rounded *rd, enum held kind, Py_ssize_t m, Py_ssize_t k, int *ok) {
    rd->dp = bf16_dot_runs();
    *ok = 1;
    if (kind != HELD_BF16_ROUNDED && kind != HELD_BF16_PANELS) return NULL;
    void *buf = malloc((size_t)(m * k) * (sizeof(uint16_t) + sizeof(float)));
    *ok = buf != NULL;
    rd->xr = (float *)buf;
    rd->xb = buf ? (uint16_t *)(rd->xr + m * k) : NULL;
    return buf;
}

static PyObject *gemv(enum held kind, PyObject *args) {
    unsigned long long xp, wp, sp, bp, yp;
    Py_ssize_t m, k, n;
    int threads, round_inputs = 0;
    if (!PyArg_ParseTuple(args, "KKKKKnnni|p", &xp, &wp, &sp, &bp, &yp, &m, &k, &n, &threads, &round_inputs))
        return NULL;
    if (round_inputs && kind == HELD_BF16) kind = HELD_BF16_ROUNDED;
    if (m < 1 || k < 1 || n < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "gemv: m, k, n and threads must be positive");
        return NULL;
    }
    struct linear l = {(const void *)(uintptr_t)wp, (const float *)(uintptr_t)sp, (const float *)(uintptr_t)bp};
    const float *x = (const float *)(uintptr_t)xp;
    float *y = (float *)(uintptr_t)yp;
    int avx2 = cpu_has_avx2(), failed = 0, need = avx2 && m >= 4, ok;
    struct rounded rd;
    void *rbuf = rounded_alloc(&rd, kind, m, k, &ok);
    if (!ok) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        float *buf = need ? (float *)malloc((size_t)k * sizeof(float)) : NULL; /* one widened weight row */
        if (need && !buf) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        if (!failed) linear_rows(kind, &l, x, y, m, k, n, buf, avx2, SET, &rd);
        free(buf);
    }
    Py_END_ALLOW_THREADS
    free(rbuf);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- One GPT-2 block for one new token of each of m rows (model_step's, below) ----
 *
 * Each row of x (m x C floats, the residual stream) becomes x + attn(ln_1(x)), then + mlp(ln_2(x)), as
 * the model's Block computes it for one token with a KV cache: LayerNorm, the q/k/v linear, the token's
 * keys and values written into the row's cache slot at its position, attention of the query to the
 * position + 1 keys of its slot (scale 1/sqrt(head size), no mask: every one of them precedes it), the
 * output linear added to x, LayerNorm, the fc linear with GELU (tanh), the projection added to x. One
 * OpenMP region runs it all: the threads share each linear's weight rows (each read once for every
 * row of x) and the (row, head) pairs, with a barrier between the phases, so a block costs one call
 * from Python where the operators one by one cost ~25 calls and ~300 us. */

static void layernorm(const float *x, const float *g, const float *b, float eps, float *out, Py_ssize_t c) {
    double mean = 0., var = 0.;
    for (Py_ssize_t i = 0; i < c; i++) mean += x[i];
    mean /= (double)c;
    for (Py_ssize_t i = 0; i < c; i++) var += (x[i] - mean) * (x[i] - mean);
    float inv = (float)(1. / sqrt(var / (double)c + (double)eps)), m = (float)mean;
    for (Py_ssize_t i = 0; i < c; i++) out[i] = (x[i] - m) * inv * g[i] + (b ? b[i] : 0.f);
}

#ifdef GEMV_X86
/* Scores of q against keys j..j+7 (the last ones repeat key t - 1 where fewer are left) into the first
 * min(8, t - j) of sc[j..]: eight sums over the head's dimensions, reduced together (hsum8), so each
 * key's sum is reduced by the same tree wherever it falls. hs a multiple of 8. */
__attribute__((target("avx2,fma"))) static inline void scores8(const float *q, const float *kc, Py_ssize_t j,
                                                               Py_ssize_t t, Py_ssize_t hs, float scale,
                                                               float *sc) {
    const float *k[8];
    __m256 a[8];
    for (int u = 0; u < 8; u++) {
        k[u] = kc + (j + u < t ? j + u : t - 1) * hs;
        a[u] = _mm256_setzero_ps();
    }
    for (Py_ssize_t d = 0; d < hs; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[u] + d), a[u]);
    }
    float eight[8];
    _mm256_storeu_ps(eight, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
    for (int u = 0; u < 8 && j + u < t; u++) sc[j + u] = eight[u];
}

/* One head's attention: scores of q against keys 0..t-1, softmax, the weighted sum of the values. Where
 * the head size is a multiple of 8 the keys are scored eight at a time, and where it is one of 64 the
 * values are summed 64 dimensions at a time in registers (GPT-2's heads: one pass), each dimension's sum
 * over the keys in order as the plain loop does it. */
__attribute__((target("avx2,fma"))) static void attend_avx2(const float *q, const float *kc, const float *vc,
                                                             Py_ssize_t t, Py_ssize_t hs, float scale,
                                                             float *sc, float *out) {
    float top = -INFINITY, sum = 0.f;
    if (hs % 8 == 0)
        for (Py_ssize_t j = 0; j < t; j += 8) scores8(q, kc, j, t, hs, scale, sc);
    else
        for (Py_ssize_t j = 0; j < t; j++) {
            const float *kj = kc + j * hs;
            __m256 a = _mm256_setzero_ps();
            Py_ssize_t d = 0;
            for (; d + 8 <= hs; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), a);
            sc[j] = (hsum(a) + dot_f32_plain(q + d, kj + d, hs - d)) * scale;
        }
    for (Py_ssize_t j = 0; j < t; j++)
        if (sc[j] > top) top = sc[j];
    Py_ssize_t j = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= t; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(sc + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum(acc);
    for (; j < t; j++) sum += (sc[j] = expf(sc[j] - top));
    if (hs % 64 == 0) {
        for (Py_ssize_t d0 = 0; d0 < hs; d0 += 64) {
            __m256 o[8];
            for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();
            for (Py_ssize_t j = 0; j < t; j++) {
                const float *vj = vc + j * hs + d0;
                __m256 p = _mm256_set1_ps(sc[j] / sum);
                for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), o[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + d0 + 8 * i, o[i]);
        }
        return;
    }
    for (Py_ssize_t d = 0; d < hs; d++) out[d] = 0.f;
    for (Py_ssize_t j = 0; j < t; j++) {
        const float *vj = vc + j * hs;
        __m256 p = _mm256_set1_ps(sc[j] / sum);
        Py_ssize_t d = 0;
        for (; d + 8 <= hs; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(out + d)));
        for (; d < hs; d++) out[d] += sc[j] / sum * vj[d];
    }
}
#endif

static void attend_plain(const float *q, const float *kc, const float *vc, Py_ssize_t t, Py_ssize_t hs,
                         float scale, float *sc, float *out) {
    float top = -INFINITY, sum = 0.f;
    for (Py_ssize_t j = 0; j < t; j++) {
        sc[j] = dot_f32_plain(q, kc + j * hs, hs) * scale;
        if (sc[j] > top) top = sc[j];
    }
    for (Py_ssize_t j = 0; j < t; j++) sum += (sc[j] = expf(sc[j] - top));
    for (Py_ssize_t d = 0; d < hs; d++) out[d] = 0.f;
    for (Py_ssize_t j = 0; j < t; j++)
        for (Py_ssize_t d = 0; d < hs; d++) out[d] += sc[j] / sum * vc[j * hs + d];
}

/* One block's weights and cache: the norms, the four linears (q/k/v, output, fc, projection) and the
 * layer's key and value buffers (slots, heads, max_len, head size). */
struct block {
    const float *ln1g, *ln1b, *ln2g, *ln2b;
    struct linear lin[4];
    float *kc, *vc;
};

/* Scratch for m rows: a norm's output (C); qkv (3C); the heads' output (C); the MLP's hidden (4C); the
 * scores of each (row, head) for up to tmax keys. */
struct scratch {
    float *h, *qkv, *y, *f, *sc;
};

static float *scratch_alloc(struct scratch *s, Py_ssize_t m, Py_ssize_t c, Py_ssize_t nh, Py_ssize_t tmax) {
    float *buf = (float *)malloc(sizeof(float) * (size_t)(m * (9 * c + nh * tmax)));
    if (buf) {
        s->h = buf;
        s->qkv = s->h + m * c;
        s->y = s->qkv + m * 3 * c;
        s->f = s->y + m * c;
        s->sc = s->f + m * 4 * c;
    }
    return buf;
}

/* The block on x, run by every thread of the enclosing OpenMP region (worksharing loops, each ending
 * in a barrier); wb: this thread's widened weight row (4C floats) where m >= 4 (AVX2). Row i is the
 * token at position pos[i] of cache slot slot[i] (slot NULL: slot i); every row's key and value are
 * written before any row attends, so rows of one slot at consecutive positions (a prompt's tokens in
 * the step) each see the ones before them. */
static void block_body(enum held kind, const struct block *bl, float *x, Py_ssize_t m, Py_ssize_t c, Py_ssize_t nh,
                       float eps, const int64_t *pos, const int64_t *slot, Py_ssize_t max_len, Py_ssize_t tmax,
                       const struct scratch *s, float *wb, int avx2, const struct rounded *rd) {
    Py_ssize_t hs = c / nh;
    float scale = 1.f / sqrtf((float)hs);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t i = 0; i < m; i++) layernorm(x + i * c, bl->ln1g, bl->ln1b, eps, s->h + i * c, c);
    linear_rows(kind, &bl->lin[0], s->h, s->qkv, m, c, 3 * c, wb, avx2, SET, rd);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t task = 0; task < m * nh; task++) {
        Py_ssize_t i = task / nh, hd = task % nh, p = (Py_ssize_t)pos[i], sl = slot ? (Py_ssize_t)slot[i] : i;
        float *kh = bl->kc + (sl * nh + hd) * max_len * hs, *vh = bl->vc + (sl * nh + hd) * max_len * hs;
        const float *q = s->qkv + i * 3 * c + hd * hs;
        memcpy(kh + p * hs, q + c, sizeof(float) * (size_t)hs);
        memcpy(vh + p * hs, q + 2 * c, sizeof(float) * (size_t)hs);
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t task = 0; task < m * nh; task++) {
        Py_ssize_t i = task / nh, hd = task % nh, p = (Py_ssize_t)pos[i], sl = slot ? (Py_ssize_t)slot[i] : i;
        const float *kh = bl->kc + (sl * nh + hd) * max_len * hs, *vh = bl->vc + (sl * nh + hd) * max_len * hs;
        const float *q = s->qkv + i * 3 * c + hd * hs;
#ifdef GEMV_X86
        if (avx2)
            attend_avx2(q, kh, vh, p + 1, hs, scale, s->sc + task * tmax, s->y + i * c + hd * hs);
        else
#endif
            attend_plain(q, kh, vh, p + 1, hs, scale, s->sc + task * tmax, s->y + i * c + hd * hs);
    }
    linear_rows(kind, &bl->lin[1], s->y, x, m, c, c, wb, avx2, ADD, rd);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (Py_ssize_t i = 0; i < m; i++) layernorm(x + i * c, bl->ln2g, bl->ln2b, eps, s->h + i * c, c);
    linear_rows(kind, &bl->lin[2], s->h, s->f, m, c, 4 * c, wb, avx2, SET, rd);
    gelu_shared(s->f, m * 4 * c, avx2);
    linear_rows(kind, &bl->lin[3], s->f, x, m, 4 * c, c, wb, avx2, ADD, rd);
}

/* This thread's widened weight row (4C floats: the widest input), where m >= 4 (AVX2);
 * on failure sets *failed; every thread then meets at a barrier, so all see it before any work. */
static float *thread_rows(int need, Py_ssize_t c, int *failed) {
    float *wb = need ? (float *)malloc(sizeof(float) * (size_t)(4 * c)) : NULL;
    if (need && !wb) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *failed = 1;
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    return wb;
}

/* The longest row's key count (position + 1), or -1 where a position is outside [0, limit). */
static Py_ssize_t keys_needed(const int64_t *pos, Py_ssize_t m, Py_ssize_t limit) {
    Py_ssize_t tmax = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (pos[i] < 0 || pos[i] >= limit) return -1;
        if (pos[i] + 1 > tmax) tmax = pos[i] + 1;
    }
    return tmax;
}

/* ---- A whole decode step of a GPT-2 model for one new token of each of m rows ----
 *
 * The token's embedding plus its position's, every block as block_body computes it, the final
 * LayerNorm and the vocabulary projection (the head): one OpenMP region a token, so the
 * threads wake once where block by block they wake 13 times and Python runs between them. The layers'
 * pointers come in one int64 array, LAYER_FIELDS a layer (the order fused.py writes). Row i is cache slot
 * slots[i] (slots 0: slot i; each below n_slots) at its position; the head runs on the rows listed in
 * wanted (n_wanted of them, in that order, out holding one row of logits each; wanted 0: every row).
 * Returns False, having done nothing, where a token id, a position or a slot is outside its table (the
 * caller then runs the model's own code, which says so). */
#define LAYER_FIELDS 18

static PyObject *model_step(PyObject *self, PyObject *args) {
    int bf16, head_bf16, threads;
    unsigned long long idp, wtep, wpep, tp, pp, op, gfp, bfp, hwp, hsp, hbp, slp, wnp;
    Py_ssize_t m, c, nh, n_layer, vocab, n_pos, max_len, pos0, n_out, n_slots, n_wanted;
    float eps, eps_f;
    if (!PyArg_ParseTuple(args, "innnnKKKnnKnKnKfKKfiKKKniKnKn", &bf16, &m, &c, &nh, &n_layer, &idp, &wtep, &wpep,
                          &vocab, &n_pos, &tp, &max_len, &pp, &pos0, &op, &eps, &gfp, &bfp, &eps_f, &head_bf16, &hwp,
                          &hsp, &hbp, &n_out, &threads, &slp, &n_slots, &wnp, &n_wanted))
        return NULL;
    if (m < 1 || c < 1 || nh < 1 || c % nh || n_layer < 1 || threads < 1 || vocab < 1 || n_pos < 1 || n_out < 1 ||
        !hwp || bf16 < HELD_INT8 || bf16 > HELD_BF16_PANELS || head_bf16 < HELD_INT8 || head_bf16 > HELD_BF16_PANELS) {
        PyErr_SetString(PyExc_ValueError, "model_step: bad kinds, rows, width, heads, layers, tables, head or threads");
        return NULL;
    }
    const int64_t *ids = (const int64_t *)(uintptr_t)idp, *table = (const int64_t *)(uintptr_t)tp;
    const int64_t *slots = (const int64_t *)(uintptr_t)slp, *wanted = (const int64_t *)(uintptr_t)wnp;
    if (!wanted) n_wanted = m;
    int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)m);
    if (!pos) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < m; i++) pos[i] = pp ? ((const int64_t *)(uintptr_t)pp)[i] : pos0;
    Py_ssize_t tmax = keys_needed(pos, m, max_len < n_pos ? max_len : n_pos);
    for (Py_ssize_t i = 0; i < m && tmax >= 0; i++)
        if (ids[i] < 0 || ids[i] >= vocab || (slots && (slots[i] < 0 || slots[i] >= n_slots))) tmax = -1;
    for (Py_ssize_t i = 0; wanted && i < n_wanted && tmax >= 0; i++)
        if (wanted[i] < 0 || wanted[i] >= m) tmax = -1;
    if (tmax < 0) {
        free(pos);
        Py_RETURN_FALSE;
    }
    struct block *bl = (struct block *)malloc(sizeof(struct block) * (size_t)n_layer);
    struct scratch s;
    float *buf = bl ? scratch_alloc(&s, m, c, nh, tmax) : NULL, *x = bl ? (float *)malloc(sizeof(float) * (size_t)(m * c)) : NULL;
    if (!buf || !x) {
        free(x);
        free(buf);
        free(bl);
        free(pos);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t l = 0; l < n_layer; l++) {
        const int64_t *t = table + l * LAYER_FIELDS;
        bl[l].ln1g = (const float *)(uintptr_t)t[0];
        bl[l].ln1b = (const float *)(uintptr_t)t[1];
        bl[l].ln2g = (const float *)(uintptr_t)t[2];
        bl[l].ln2b = (const float *)(uintptr_t)t[3];
        for (int i = 0; i < 4; i++)
            bl[l].lin[i] = (struct linear){(const void *)(uintptr_t)t[4 + 3 * i],
                                           (const float *)(uintptr_t)t[5 + 3 * i],
                                           (const float *)(uintptr_t)t[6 + 3 * i]};
        bl[l].kc = (float *)(uintptr_t)t[16];
        bl[l].vc = (float *)(uintptr_t)t[17];
    }
    const float *wte = (const float *)(uintptr_t)wtep, *wpe = (const float *)(uintptr_t)wpep;
    const float *gf = (const float *)(uintptr_t)gfp, *bf = (const float *)(uintptr_t)bfp;
    struct linear head = {(const void *)(uintptr_t)hwp, (const float *)(uintptr_t)hsp, (const float *)(uintptr_t)hbp};
    float *out = (float *)(uintptr_t)op; /* the logits (m x n_out) */
    enum held kind = (enum held)bf16, head_kind = (enum held)head_bf16;
    int avx2 = cpu_has_avx2(), failed = 0, need = avx2 && m >= 4, ok;
    struct rounded rd; /* room for the blocks' inputs (4C wide at most) and the head's (C) */
    void *rbuf = rounded_alloc(&rd, kind >= HELD_BF16_ROUNDED ? kind : head_kind, m, 4 * c, &ok);
    if (!ok) {
        free(x);
        free(buf);
        free(bl);
        free(pos);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        float *wb = thread_rows(need, c, &failed);
        if (!failed) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (Py_ssize_t i = 0; i < m; i++)
                for (Py_ssize_t j = 0; j < c; j++) x[i * c + j] = wte[ids[i] * c + j] + wpe[pos[i] * c + j];
            for (Py_ssize_t l = 0; l < n_layer; l++)
                block_body(kind, &bl[l], x, m, c, nh, eps, pos, slots, max_len, tmax, &s, wb, avx2, &rd);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (Py_ssize_t i = 0; i < n_wanted; i++)
                layernorm(x + (wanted ? wanted[i] : i) * c, gf, bf, eps_f, s.h + i * c, c);
            linear_rows(head_kind, &head, s.h, out, n_wanted, c, n_out, wb, avx2, SET, &rd);
        }
        free(wb);
    }
    Py_END_ALLOW_THREADS
    free(rbuf);
    free(x);
    free(buf);
    free(bl);
    free(pos);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

static PyObject *int8_gemv(PyObject *self, PyObject *args) { return gemv(HELD_INT8, args); }

static PyObject *bf16_gemv(PyObject *self, PyObject *args) { return gemv(HELD_BF16, args); }

static PyObject *panels_gemv(PyObject *self, PyObject *args) { return gemv(HELD_BF16_PANELS, args); }

static PyObject *has_avx2(PyObject *self, PyObject *unused) { return PyBool_FromLong(cpu_has_avx2()); }

static PyObject *has_bf16_dot(PyObject *self, PyObject *unused) { return PyBool_FromLong(bf16_dot_runs()); }

static PyObject *set_bf16_dot(PyObject *self, PyObject *args) {
    int allowed;
    if (!PyArg_ParseTuple(args, "p", &allowed)) return NULL;
    bf16_dot_allowed = allowed;
    Py_RETURN_NONE;
}

static PyObject *has_openmp(PyObject *self, PyObject *unused) {
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"int8_gemv", int8_gemv, METH_VARARGS,
     "int8_gemv(x, q, scale, bias, y, m, k, n, threads): y = scale * (q @ x) + bias, data pointers (bias 0: none)"},
    {"bf16_gemv", bf16_gemv, METH_VARARGS,
     "bf16_gemv(x, w, 0, bias, y, m, k, n, threads[, round_inputs]): y = w @ x + bias for bf16 w, data pointers "
     "(bias 0: none); round_inputs: x rounded to bf16 first"},
    {"panels_gemv", panels_gemv, METH_VARARGS,
     "panels_gemv(x, panels, 0, bias, y, m, k, n, threads): y = w @ x + bias for bf16 w held in panels "
     "(kernels.pack_panels; k even), x rounded to bf16 first, data pointers (bias 0: none)"},
    {"model_step", model_step, METH_VARARGS,
     "model_step(kind, m, C, n_head, n_layer, ids, wte, wpe, vocab, n_pos, layers, max_len, positions, pos0, out, "
     "eps, ln_f g, b, eps, head kind, head w, scale, bias, n_out, threads, slots, n_slots, wanted, n_wanted): a "
     "GPT-2 step for one token of each of m rows (row i in cache slot slots[i]; 0: slot i) into out (the logits "
     "of the rows in wanted, in order; 0: every row); pointers (0: none; the head's weight is needed); False "
     "(nothing done) where an id, position or slot is outside its table"},
    {"has_avx2", has_avx2, METH_NOARGS, "whether this CPU runs the AVX2/FMA routines"},
    {"has_bf16_dot", has_bf16_dot, METH_NOARGS,
     "whether bf16 weights in panels are multiplied by the AVX512_BF16 routines here (the CPU has them, allowed)"},
    {"set_bf16_dot", set_bf16_dot, METH_VARARGS,
     "set_bf16_dot(allowed): allow the AVX512_BF16 routines where the CPU has them (else panels are multiplied "
     "by plain C loops; the same products)"},
    {"has_openmp", has_openmp, METH_NOARGS, "whether the kernels were built with OpenMP (threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gemv(void) { return PyModule_Create(&module); }
