/* The chunk loop of the shared-memory all-reduce (hpcpar/runtime/shm.py) in C: one rank's slice of
 * the node's buffers summed in MPICH's order, divided for a mean, and written into every buffer,
 * block by block while the block is in L1, with no Python between blocks and no GIL (ctypes lets
 * it go). hpcpar/runtime/shm_kernel.py loads it and checks it against NumPy before using it; where
 * it is not built the same loop runs in NumPy (hpcpar/runtime/shm_reduce.py).
 *
 * The order of the sum is the one documented in shm_reduce.py: with n operands and p the largest
 * power of two <= n, the first 2(n - p) are added in neighbour pairs, the rest are taken as they
 * are, and the p values are added as a balanced tree over neighbours. Each element's sum is the
 * same sequence of IEEE additions as NumPy's, so the results are equal bit for bit: the file is
 * compiled without -ffast-math (no reassociation) and additions have nothing to contract.
 * Integers add modulo 2^bits, as NumPy's do (unsigned arithmetic: signed overflow is undefined). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HPCPAR_API __attribute__((visibility("default")))

/* The loops in AVX2 where the CPU has it (chosen when the library loads): 15-25 % faster at
 * 8-64 MiB on two ranks here, though the loop waits on memory; prefetching made it slower. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_LOOP
#endif

enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3 };
#define BLOCK_BYTES 4096 /* one block of every partial sum stays in L1 */
#define MAX_OPERANDS 1024

typedef void (*add_fn)(const void *a, const void *b, void *out, size_t count);
typedef void (*divide_fn)(void *x, size_t count, double divisor);

/* out may be a or b (element by element: each out[i] is written after a[i] and b[i] are read). */
#define DEFINE_ADD(name, type)                                                             \
    VECTOR_LOOP static void name(const void *a_, const void *b_, void *out_, size_t count) {           \
        const type *a = a_, *b = b_;                                                        \
        type *out = out_;                                                                   \
        for (size_t i = 0; i < count; i++) out[i] = a[i] + b[i];                           \
    }
DEFINE_ADD(add_f32, float)
DEFINE_ADD(add_f64, double)
DEFINE_ADD(add_u32, uint32_t)
DEFINE_ADD(add_u64, uint64_t)

/* NumPy's `x /= size` on a float array: division by the divisor converted to the array's type. */
VECTOR_LOOP static void divide_f32(void *x_, size_t count, double divisor) {
    float *x = x_, d = (float)divisor;
    for (size_t i = 0; i < count; i++) x[i] /= d;
}
VECTOR_LOOP static void divide_f64(void *x_, size_t count, double divisor) {
    double *x = x_;
    for (size_t i = 0; i < count; i++) x[i] /= divisor;
}

static const add_fn ADD[] = {add_f32, add_f64, add_u32, add_u64};
static const size_t ITEMSIZE[] = {4, 8, 4, 8};

/* The sum of n blocks of `count` elements in MPICH's order; partial sums go to temps (p blocks
 * of BLOCK_BYTES each). Returns where the sum is: temps[0], or the one source when n == 1. */
static const char *tree(add_fn add, const char *const *sources, int n, size_t offset, size_t count,
                        char *temps) {
    const char *values[MAX_OPERANDS];
    int pof2 = 1;
    while (pof2 * 2 <= n) pof2 *= 2;
    int rem = n - pof2;
    for (int i = 0; i < pof2; i++) {
        if (i < rem) {
            char *t = temps + (size_t)i * BLOCK_BYTES;
            add(sources[2 * i] + offset, sources[2 * i + 1] + offset, t, count);
            values[i] = t;
        } else {
            values[i] = sources[i + rem] + offset;
        }
    }
    for (int width = pof2; width > 1; width /= 2) {
        for (int i = 0; i < width / 2; i++) {  /* writes temps[i] after temps[2i], temps[2i + 1] were read */
            char *t = temps + (size_t)i * BLOCK_BYTES;
            add(values[2 * i], values[2 * i + 1], t, count);
            values[i] = t;
        }
    }
    return values[0];
}

/* The usual case, two ranks' buffers summed into both, in one pass: each element is read once and
 * written twice while its cache line is held, with no scratch block in between. */
#define DEFINE_SUM_INTO_BOTH(name, type)                                                     \
    VECTOR_LOOP static void name(char *a_, char *b_, size_t count, double divisor) {                    \
        type *restrict a = (type *)a_, *restrict b = (type *)b_;                             \
        if (divisor == 0.0) {                                                                \
            for (size_t i = 0; i < count; i++) a[i] = b[i] = a[i] + b[i];                    \
        } else {                                                                             \
            const type d = (type)divisor;                                                    \
            for (size_t i = 0; i < count; i++) a[i] = b[i] = (type)(a[i] + b[i]) / d;        \
        }                                                                                    \
    }
DEFINE_SUM_INTO_BOTH(both_f32, float)
DEFINE_SUM_INTO_BOTH(both_f64, double)
DEFINE_SUM_INTO_BOTH(both_u32, uint32_t)
DEFINE_SUM_INTO_BOTH(both_u64, uint64_t)

typedef void (*both_fn)(char *a, char *b, size_t count, double divisor);
static const both_fn BOTH[] = {both_f32, both_f64, both_u32, both_u64};

/*
 * Reduce elements [0, count) of the n `sources` (each already offset to this rank's slice) with
 * a sum in MPICH's order, divide by `divisor` when it is not 0 (floats only: a mean), and write
 * the result into each of the `ntargets` targets (a source among them is fine: every block of
 * every source is read before that block is written). Sources and targets are distinct buffers
 * or the very same one; none overlaps another in part.
 *
 * n == 1 copies sources[0] (divided, if asked) into the targets: the write-out after the
 * inter-node step. Returns 0, or -1 on bad arguments, -2 when scratch memory is short.
 */
HPCPAR_API int hpcpar_shm_sum(char *const *sources, int n, char *const *targets, int ntargets, size_t count,
                              int dtype, double divisor) {
    if (n < 1 || n > MAX_OPERANDS || ntargets < 0 || dtype < F32 || dtype > I64 ||
        (divisor != 0.0 && dtype >= I32))
        return -1;
    if (n == 2 && ntargets == 2 && sources[0] != sources[1] &&
        ((targets[0] == sources[0] && targets[1] == sources[1]) ||
         (targets[0] == sources[1] && targets[1] == sources[0]))) {
        BOTH[dtype](sources[0], sources[1], count, divisor);
        return 0;
    }
    size_t itemsize = ITEMSIZE[dtype], block = BLOCK_BYTES / itemsize;
    divide_fn divide = dtype == F32 ? divide_f32 : divide_f64;
    int pof2 = 1;
    while (pof2 * 2 <= n) pof2 *= 2;
    char *temps = malloc((size_t)pof2 * BLOCK_BYTES);
    if (temps == NULL) return -2;
    for (size_t first = 0; first < count; first += block) {
        size_t m = count - first < block ? count - first : block, offset = first * itemsize, nbytes = m * itemsize;
        const char *sum = tree(ADD[dtype], (const char *const *)sources, n, offset, m, temps);
        if (divisor != 0.0) {
            if (sum != temps) memcpy(temps, sum, nbytes);
            divide(temps, m, divisor);
            sum = temps;
        }
        for (int t = 0; t < ntargets; t++)
            if (targets[t] + offset != sum) memcpy(targets[t] + offset, sum, nbytes);
    }
    free(temps);
    return 0;
}
