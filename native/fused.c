/* Fused elementwise passes of the training step (hpcpar/autograd/fused.py loads them with ctypes):
 * each loop does in one pass over memory what NumPy does in several, with the same IEEE
 * operations in the same order on every element, so the results are NumPy's bit for bit. That
 * needs no reassociation and no contraction into fused multiply-adds: the file is compiled
 * with -ffp-contract=off and without -ffast-math (CMakeLists.txt); float scalars are rounded to
 * the array's type first, as NumPy rounds a Python float against a float32 array.
 * fused.py checks every loop against its NumPy sequence when the library loads and uses NumPy
 * where the library is not built or does not agree.
 *
 * The loops are compiled for AVX-512, AVX2 and the baseline; the loader picks one per CPU. */
#include <math.h>
#include <stddef.h>

#define HPCPAR_API __attribute__((visibility("default")))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_LOOP
#endif

/* GELU (tanh form), before the tanh: u = c x (1 + a x^2), computed as ((x x) a + 1) x c,
 * NumPy's order in elementwise._gelu_tanh. The caller takes tanh(u) in place (NumPy's SIMD tanh). */
#define DEFINE_GELU_INNER(name, type)                                                            \
    VECTOR_LOOP static void name(const type *x, type *u, size_t n, double a_, double c_) {        \
        const type a = (type)a_, c = (type)c_;                                                   \
        for (size_t i = 0; i < n; i++) {                                                         \
            type t = x[i] * x[i];                                                                \
            t = t * a;                                                                           \
            t = t + (type)1;                                                                     \
            t = t * x[i];                                                                        \
            u[i] = t * c;                                                                        \
        }                                                                                        \
    }

/* GELU after the tanh t: out = ((t + 1) x) 0.5. */
#define DEFINE_GELU_OUTER(name, type)                                                            \
    VECTOR_LOOP static void name(const type *x, const type *t, type *out, size_t n) {            \
        for (size_t i = 0; i < n; i++) out[i] = ((t[i] + (type)1) * x[i]) * (type)0.5;           \
    }

/* GELU's gradient: grad (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)), in Gelu.backward's order:
 * g = (((x x) 3a + 1) c) x; g = g (1 - t t); g = ((g + t) + 1) 0.5; g = g grad. */
#define DEFINE_GELU_BACKWARD(name, type)                                                         \
    VECTOR_LOOP static void name(const type *x, const type *t, const type *grad, type *out,      \
                                 size_t n, double a3_, double c_) {                              \
        const type a3 = (type)a3_, c = (type)c_;                                                 \
        for (size_t i = 0; i < n; i++) {                                                         \
            type g = x[i] * x[i];                                                                \
            g = g * a3;                                                                          \
            g = g + (type)1;                                                                     \
            g = g * c;                                                                           \
            g = g * x[i];                                                                        \
            g = g * ((type)1 - t[i] * t[i]);                                                     \
            g = g + t[i];                                                                        \
            g = g + (type)1;                                                                     \
            g = g * (type)0.5;                                                                   \
            out[i] = g * grad[i];                                                                \
        }                                                                                        \
    }

/* One Adam(W) step in place, in optim/adam.py's order:
 *   p = p decay;  m = m b1 + g (1 - b1);  v = v b2 + (g g)(1 - b2);
 *   p = p - (m / (sqrt(v) + eps_hat)) step_size
 * with decay = 1 - lr wd (1 for Adam's L2 form, applied to g by the caller), eps_hat and
 * step_size the bias-corrected constants adam.py computes in double. */
#define DEFINE_ADAM(name, type, SQRT)                                                                \
    VECTOR_LOOP static void name(type *p, const type *g, type *m, type *v, size_t n, double decay_, \
                                 double b1_, double one_minus_b1_, double b2_, double one_minus_b2_, \
                                 double eps_hat_, double step_size_, int decays) {               \
        const type decay = (type)decay_, b1 = (type)b1_, c1 = (type)one_minus_b1_;               \
        const type b2 = (type)b2_, c2 = (type)one_minus_b2_;                                     \
        const type eps_hat = (type)eps_hat_, step_size = (type)step_size_;                       \
        for (size_t i = 0; i < n; i++) {                                                         \
            type param = decays ? p[i] * decay : p[i];                                           \
            type mi = m[i] * b1 + g[i] * c1;                                                     \
            type vi = v[i] * b2 + (g[i] * g[i]) * c2;                                            \
            m[i] = mi;                                                                           \
            v[i] = vi;                                                                           \
            p[i] = param - (mi / (SQRT(vi) + eps_hat)) * step_size;                              \
        }                                                                                        \
    }

DEFINE_GELU_INNER(gelu_inner_f32, float)
DEFINE_GELU_INNER(gelu_inner_f64, double)
DEFINE_GELU_OUTER(gelu_outer_f32, float)
DEFINE_GELU_OUTER(gelu_outer_f64, double)
DEFINE_GELU_BACKWARD(gelu_backward_f32, float)
DEFINE_GELU_BACKWARD(gelu_backward_f64, double)
DEFINE_ADAM(adam_f32, float, sqrtf)
DEFINE_ADAM(adam_f64, double, sqrt)

/* The exported entry points: dtype 0 is float32, 1 float64; anything else returns -1. */
HPCPAR_API int hpcpar_gelu_inner(const void *x, void *u, size_t n, int dtype, double a, double c) {
    if (dtype == 0) gelu_inner_f32(x, u, n, a, c);
    else if (dtype == 1) gelu_inner_f64(x, u, n, a, c);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_gelu_outer(const void *x, const void *t, void *out, size_t n, int dtype) {
    if (dtype == 0) gelu_outer_f32(x, t, out, n);
    else if (dtype == 1) gelu_outer_f64(x, t, out, n);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_gelu_backward(const void *x, const void *t, const void *grad, void *out, size_t n,
                                    int dtype, double a3, double c) {
    if (dtype == 0) gelu_backward_f32(x, t, grad, out, n, a3, c);
    else if (dtype == 1) gelu_backward_f64(x, t, grad, out, n, a3, c);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_adam(void *p, const void *g, void *m, void *v, size_t n, int dtype, double decay,
                           double b1, double one_minus_b1, double b2, double one_minus_b2, double eps_hat,
                           double step_size, int decays) {
    if (dtype == 0) adam_f32(p, g, m, v, n, decay, b1, one_minus_b1, b2, one_minus_b2, eps_hat, step_size, decays);
    else if (dtype == 1) adam_f64(p, g, m, v, n, decay, b1, one_minus_b1, b2, one_minus_b2, eps_hat, step_size, decays);
    else return -1;
    return 0;
}
