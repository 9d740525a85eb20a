/* Fused elementwise passes of the training step (hpcpar/autograd/fused.py loads them with ctypes):
 * each loop does in one pass over memory what NumPy does in several, with the same IEEE
 * operations in the same order on every element, so the results are NumPy's bit for bit. That
 * needs no reassociation and no contraction into fused multiply-adds: the file is compiled
 * with -ffp-contract=off and without -ffast-math (CMakeLists.txt); float scalars are rounded to
 * the array's type first, as NumPy rounds a Python float against a float32 array.
 * fused.py checks every loop against its NumPy sequence when the library loads and uses NumPy
 * where the library is not built or does not agree.
 *
 * The loops are compiled for AVX-512, AVX2 and the baseline; the loader picks one per CPU. No two
 * arrays of a call overlap (restrict): fused.py passes distinct arrays. */
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
    VECTOR_LOOP static void name(const type *restrict x, type *restrict u, size_t n, double a_, double c_) {        \
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
    VECTOR_LOOP static void name(const type *restrict x, const type *restrict t, type *restrict out, size_t n) {            \
        for (size_t i = 0; i < n; i++) out[i] = ((t[i] + (type)1) * x[i]) * (type)0.5;           \
    }

/* GELU's gradient: grad (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)), in Gelu.backward's order:
 * g = (((x x) 3a + 1) c) x; g = g (1 - t t); g = ((g + t) + 1) 0.5; g = g grad. */
#define DEFINE_GELU_BACKWARD(name, type)                                                         \
    VECTOR_LOOP static void name(const type *restrict x, const type *restrict t,                 \
                                 const type *restrict grad, type *restrict out, size_t n,        \
                                 double a3_, double c_) {                                        \
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
    VECTOR_LOOP static void name(type *restrict p, const type *restrict g, type *restrict m,     \
                                 type *restrict v, size_t n, double decay_,                      \
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

/* NumPy's pairwise sum of n contiguous values (numpy/_core/src/umath/loops_utils.h.src): below 8
 * a plain loop, up to 128 eight accumulators, above that the halves (cut at a multiple of 8).
 * A row's sum and mean are then NumPy's bits (a mean is the sum divided by n). */
#define DEFINE_PAIRWISE(name, type)                                                              \
    static type name(const type *restrict a, size_t n) {                                         \
        if (n < 8) {                                                                             \
            type res = 0;                                                                        \
            for (size_t i = 0; i < n; i++) res += a[i];                                          \
            return res;                                                                          \
        }                                                                                        \
        if (n <= 128) {                                                                          \
            type r[8];                                                                           \
            size_t i;                                                                            \
            for (int j = 0; j < 8; j++) r[j] = a[j];                                             \
            for (i = 8; i < n - (n % 8); i += 8)                                                 \
                for (int j = 0; j < 8; j++) r[j] += a[i + j];                                    \
            type res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));        \
            for (; i < n; i++) res += a[i];                                                      \
            return res;                                                                          \
        }                                                                                        \
        size_t n2 = n / 2;                                                                       \
        n2 -= n2 % 8;                                                                            \
        return name(a, n2) + name(a + n2, n - n2);                                               \
    }

/* LayerNorm forward over rows of dim values, in LayerNorm.forward's order: mean = sum / dim;
 * xhat = x - mean; rstd = 1 / sqrt(sum(xhat xhat) / dim + eps); xhat = xhat rstd;
 * out = xhat w + b (without w or b: their terms left out). Keeps xhat, and mean and rstd per row. */
#define DEFINE_LAYER_NORM(name, type, SUM, SQRT)                                                 \
    VECTOR_LOOP static void name(const type *restrict x, const type *restrict w,                 \
                                 const type *restrict b, type *restrict out, type *restrict xhat, \
                                 type *restrict mean_, type *restrict rstd, size_t rows, size_t dim, \
                                 double eps_) {                                                  \
        const type eps = (type)eps_, n = (type)dim;                                              \
        for (size_t r = 0; r < rows; r++) {                                                      \
            const type *xr = x + r * dim;                                                        \
            type *hr = xhat + r * dim, *outr = out + r * dim;                                    \
            const type mean = SUM(xr, dim) / n;                                                  \
            mean_[r] = mean;                                                                     \
            for (size_t j = 0; j < dim; j++) {                                                   \
                hr[j] = xr[j] - mean;                                                            \
                outr[j] = hr[j] * hr[j];                                                         \
            }                                                                                    \
            type s = SUM(outr, dim) / n;                                                         \
            s = s + eps;                                                                         \
            s = (type)1 / SQRT(s);                                                               \
            rstd[r] = s;                                                                         \
            for (size_t j = 0; j < dim; j++) {                                                   \
                hr[j] = hr[j] * s;                                                               \
                type o = w ? hr[j] * w[j] : hr[j];                                               \
                outr[j] = b ? o + b[j] : o;                                                      \
            }                                                                                    \
        }                                                                                        \
    }

/* LayerNorm backward in LayerNorm.backward's order, gx = g w (g without w):
 *   dw += g xhat and db += g, row after row (NumPy's sum over axis 0 adds the rows in order);
 *   proj = sum(gx xhat) / dim; mg = sum(gx) / dim; dx = ((gx - mg) - xhat proj) rstd.
 * dw and db (zeroed by the caller) may be NULL; scratch holds two rows. */
#define DEFINE_LAYER_NORM_BACKWARD(name, type, SUM)                                              \
    VECTOR_LOOP static void name(const type *restrict g, const type *restrict xhat,              \
                                 const type *restrict rstd, const type *restrict w,              \
                                 type *restrict dx, type *restrict dw, type *restrict db,        \
                                 type *restrict scratch, size_t rows, size_t dim) {              \
        const type n = (type)dim;                                                                \
        type *restrict gx = scratch, *restrict prod = scratch + dim;                             \
        for (size_t r = 0; r < rows; r++) {                                                      \
            const type *restrict gr = g + r * dim, *restrict hr = xhat + r * dim;                \
            type *restrict dxr = dx + r * dim;                                                   \
            for (size_t j = 0; j < dim; j++) prod[j] = gr[j] * hr[j];                            \
            if (dw)                                                                              \
                for (size_t j = 0; j < dim; j++) dw[j] += prod[j];                               \
            if (db)                                                                              \
                for (size_t j = 0; j < dim; j++) db[j] += gr[j];                                 \
            if (w) {                                                                             \
                for (size_t j = 0; j < dim; j++) {                                               \
                    gx[j] = gr[j] * w[j];                                                        \
                    prod[j] = prod[j] * w[j];                                                    \
                }                                                                                \
            } else {                                                                             \
                for (size_t j = 0; j < dim; j++) gx[j] = gr[j];                                  \
            }                                                                                    \
            const type proj = SUM(prod, dim) / n, mg = SUM(gx, dim) / n, s = rstd[r];            \
            for (size_t j = 0; j < dim; j++) dxr[j] = ((gx[j] - mg) - hr[j] * proj) * s;        \
        }                                                                                        \
    }

/* Attention's softmax over rows of t scores, before the exp (the caller takes NumPy's exp in
 * place): causal, row i of each (t, t) block keeps columns j <= i as x + 0 (NumPy adds a mask of
 * 0 and -inf) and -inf above; then every row minus its maximum (a NaN anywhere stays NaN). */
#define DEFINE_SOFTMAX_SHIFT(name, type)                                                         \
    VECTOR_LOOP static void name(type *restrict x, size_t rows, size_t t, int causal) {          \
        for (size_t r = 0; r < rows; r++) {                                                      \
            type *restrict xr = x + r * t;                                                       \
            const size_t keep = causal ? r % t + 1 : t;                                          \
            type peak = -(type)INFINITY;                                                         \
            for (size_t j = 0; j < keep; j++) {                                                  \
                const type v = causal ? xr[j] + (type)0 : xr[j];                                 \
                peak = (v > peak || v != v) && peak == peak ? v : peak;                          \
            }                                                                                    \
            for (size_t j = 0; j < keep; j++) xr[j] = (causal ? xr[j] + (type)0 : xr[j]) - peak; \
            for (size_t j = keep; j < t; j++) xr[j] = -(type)INFINITY;                           \
        }                                                                                        \
    }

/* After the exp: each row times 1 / (its pairwise sum), NumPy's reciprocal then multiply. */
#define DEFINE_SOFTMAX_SCALE(name, type, SUM)                                                    \
    VECTOR_LOOP static void name(type *restrict x, size_t rows, size_t t) {                      \
        for (size_t r = 0; r < rows; r++) {                                                      \
            type *restrict xr = x + r * t;                                                       \
            const type inverse = (type)1 / SUM(xr, t);                                           \
            for (size_t j = 0; j < t; j++) xr[j] = xr[j] * inverse;                              \
        }                                                                                        \
    }

DEFINE_GELU_INNER(gelu_inner_f32, float)
DEFINE_GELU_INNER(gelu_inner_f64, double)
DEFINE_GELU_OUTER(gelu_outer_f32, float)
DEFINE_GELU_OUTER(gelu_outer_f64, double)
DEFINE_GELU_BACKWARD(gelu_backward_f32, float)
DEFINE_GELU_BACKWARD(gelu_backward_f64, double)
DEFINE_ADAM(adam_f32, float, sqrtf)
DEFINE_PAIRWISE(pairwise_f32, float)
DEFINE_PAIRWISE(pairwise_f64, double)
DEFINE_LAYER_NORM(layer_norm_f32, float, pairwise_f32, sqrtf)
DEFINE_LAYER_NORM(layer_norm_f64, double, pairwise_f64, sqrt)
DEFINE_LAYER_NORM_BACKWARD(layer_norm_backward_f32, float, pairwise_f32)
DEFINE_LAYER_NORM_BACKWARD(layer_norm_backward_f64, double, pairwise_f64)
DEFINE_SOFTMAX_SHIFT(softmax_shift_f32, float)
DEFINE_SOFTMAX_SHIFT(softmax_shift_f64, double)
DEFINE_SOFTMAX_SCALE(softmax_scale_f32, float, pairwise_f32)
DEFINE_SOFTMAX_SCALE(softmax_scale_f64, double, pairwise_f64)
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

HPCPAR_API int hpcpar_layer_norm(const void *x, const void *w, const void *b, void *out, void *xhat, void *mean,
                                 void *rstd, size_t rows, size_t dim, int dtype, double eps) {
    if (dtype == 0) layer_norm_f32(x, w, b, out, xhat, mean, rstd, rows, dim, eps);
    else if (dtype == 1) layer_norm_f64(x, w, b, out, xhat, mean, rstd, rows, dim, eps);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_layer_norm_backward(const void *g, const void *xhat, const void *rstd, const void *w, void *dx,
                                          void *dw, void *db, void *scratch, size_t rows, size_t dim, int dtype) {
    if (dtype == 0) layer_norm_backward_f32(g, xhat, rstd, w, dx, dw, db, scratch, rows, dim);
    else if (dtype == 1) layer_norm_backward_f64(g, xhat, rstd, w, dx, dw, db, scratch, rows, dim);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_softmax_shift(void *x, size_t rows, size_t t, int causal, int dtype) {
    if (dtype == 0) softmax_shift_f32(x, rows, t, causal);
    else if (dtype == 1) softmax_shift_f64(x, rows, t, causal);
    else return -1;
    return 0;
}

HPCPAR_API int hpcpar_softmax_scale(void *x, size_t rows, size_t t, int dtype) {
    if (dtype == 0) softmax_scale_f32(x, rows, t);
    else if (dtype == 1) softmax_scale_f64(x, rows, t);
    else return -1;
    return 0;
}
