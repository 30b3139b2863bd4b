/* The int8-gemv kernel (kernels.py's Int8GemvLinear): y = scale * (q @ x) + bias for int8 weights q
 * (N, K, row-major, one fp32 scale per row) and fp32 inputs x (M, K), products and sums in fp32.
 *
 * Decoding one row is bound by reading the weights: at one byte a weight, each weight row is read
 * once, converted to fp32 in registers and multiplied there; the rows are shared among OpenMP
 * threads. At several rows a weight row is converted once into a per-thread buffer and every input
 * row is multiplied by it, so the weights are still read once. The AVX2/FMA routine is compiled for
 * that instruction set alone (a target attribute) and used only where the CPU reports both; the
 * plain C loop serves elsewhere (kernels.py then leaves this kernel out: it would not be faster).
 *
 * Called from Python with tensors' data pointers; kernels.py checks dtypes, shapes and contiguity.
 * The GIL is released while it runs. Built at install by setup.py; optional (no compiler, no kernel). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMV_X86 1
#include <immintrin.h>
#endif

static float dot_i8_plain(const int8_t *q, const float *x, Py_ssize_t k) {
    float acc = 0.f;
    for (Py_ssize_t i = 0; i < k; i++) acc += (float)q[i] * x[i];
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

/* Eight int8 weights as eight floats: the sign extension reads its 8 bytes straight from memory. */
__attribute__((target("avx2,fma"))) static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* 32 weights a step: four groups of 8 bytes sign-extended to int32, converted, multiplied into four
 * accumulators (four independent chains keep the FMA units busy). */
__attribute__((target("avx2,fma"))) static float dot_i8_avx2(const int8_t *q, const float *x, Py_ssize_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(widen8(q + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(widen8(q + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(q + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(q + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    float tail = dot_i8_plain(q + i, x + i, k - i);
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

__attribute__((target("avx2,fma"))) static void widen_avx2(const int8_t *q, float *w, Py_ssize_t k) {
    Py_ssize_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(w + i, widen8(q + i));
    for (; i < k; i++) w[i] = (float)q[i];
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
#endif

static int cpu_has_avx2(void) {
#ifdef GEMV_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Weight row r against every input row: y[i, r] for i < m; w is this thread's K-float buffer
 * (several rows, AVX2: the weight row widened once for all of them). */
static void rows(const float *x, const int8_t *q, const float *scale, const float *bias, float *y, Py_ssize_t m,
                 Py_ssize_t k, Py_ssize_t n, Py_ssize_t r, float *w, int avx2) {
    const int8_t *qr = q + r * k;
    float b = bias ? bias[r] : 0.f;
#ifdef GEMV_X86
    if (avx2 && m == 1) {
        y[r] = scale[r] * dot_i8_avx2(qr, x, k) + b;
        return;
    }
    if (avx2) {
        float four[4];
        Py_ssize_t i = 0;
        widen_avx2(qr, w, k);
        for (; i + 4 <= m; i += 4) {
            dot4_f32_avx2(w, x + i * k, k, four);
            for (int j = 0; j < 4; j++) y[(i + j) * n + r] = scale[r] * four[j] + b;
        }
        for (; i < m; i++) y[i * n + r] = scale[r] * dot_i8_avx2(qr, x + i * k, k) + b;  /* the rows left */
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < m; i++) y[i * n + r] = scale[r] * dot_i8_plain(qr, x + i * k, k) + b;
}

static PyObject *int8_gemv(PyObject *self, PyObject *args) {
    unsigned long long xp, qp, sp, bp, yp;
    Py_ssize_t m, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKnnni", &xp, &qp, &sp, &bp, &yp, &m, &k, &n, &threads)) return NULL;
    if (m < 1 || k < 1 || n < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "int8_gemv: m, k, n and threads must be positive");
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)xp, *scale = (const float *)(uintptr_t)sp;
    const float *bias = (const float *)(uintptr_t)bp;
    const int8_t *q = (const int8_t *)(uintptr_t)qp;
    float *y = (float *)(uintptr_t)yp;
    int avx2 = cpu_has_avx2(), failed = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        float *w = m > 1 && avx2 ? (float *)malloc((size_t)k * sizeof(float)) : NULL;
        if (m > 1 && avx2 && !w) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (Py_ssize_t r = 0; r < n; r++)
            if (w || m == 1 || !avx2) rows(x, q, scale, bias, y, m, k, n, r, w, avx2);
        free(w);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *has_avx2(PyObject *self, PyObject *unused) { return PyBool_FromLong(cpu_has_avx2()); }

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
    {"has_avx2", has_avx2, METH_NOARGS, "whether this CPU runs the AVX2/FMA routine"},
    {"has_openmp", has_openmp, METH_NOARGS, "whether the kernel was built with OpenMP (threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__int8gemv(void) { return PyModule_Create(&module); }
