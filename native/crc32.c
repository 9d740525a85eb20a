/* CRC-32 (zlib's: reflected, polynomial 0xEDB88320) with carry-less multiplication (PCLMULQDQ),
 * folding 64 bytes per step: the checksum of hpcpar's checkpoints at memory speed instead of
 * zlib's ~2-7 GB/s. The folding constants and steps are those of Intel's "Fast CRC Computation
 * for Generic Polynomials Using PCLMULQDQ" as used by Linux (crc32-pclmul) and Chromium's zlib.
 * Python (hpcpar/checkpoint/crc.py) checks it against zlib before using it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define HPCPAR_API __attribute__((visibility("default")))

static int wide_ok; /* set by hpcpar_crc32_supported: the CPU has VPCLMULQDQ and AVX-512 */

HPCPAR_API int hpcpar_crc32_supported(void) {
    __builtin_cpu_init();
    wide_ok = __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f");
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

/* Folding 256 bytes per step in four 512-bit registers (VPCLMULQDQ: four 128-bit carry-less
 * products per instruction), for long buffers: the four 128-bit lanes x[0..3] hold the state
 * of the bytes before *buf on entry, and of the bytes consumed (a multiple of 64) on return.
 * Each lane folds as in fold()'s loop, over 256 bytes instead of 64; the constants are
 * x^(2048+32) and x^(2048-32) mod P, bit-reflected, as k1k2 is for 512. */
/* One fold of the four lanes of z by k, xor-ed with data (0x96: a three-way xor). */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
static inline __m512i fold512(__m512i z, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00), _mm512_clmulepi64_epi128(z, k, 0x11),
                                     data, 0x96);
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
static void fold_wide(__m128i x[4], const unsigned char **bufp, size_t *lenp) {
    const unsigned char *buf = *bufp;
    size_t len = *lenp;
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01322d1430, 0x011542778a));
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01c6e41596, 0x0154442bd4));
    __m512i z0 = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
        _mm512_castsi128_si512(x[0]), x[1], 1), x[2], 2), x[3], 3);
    __m512i z1 = _mm512_loadu_si512((const void *)(buf + 0x00));
    __m512i z2 = _mm512_loadu_si512((const void *)(buf + 0x40));
    __m512i z3 = _mm512_loadu_si512((const void *)(buf + 0x80));
    buf += 192;
    len -= 192;
    while (len >= 256) {
        z0 = fold512(z0, k256, _mm512_loadu_si512((const void *)(buf + 0x00)));
        z1 = fold512(z1, k256, _mm512_loadu_si512((const void *)(buf + 0x40)));
        z2 = fold512(z2, k256, _mm512_loadu_si512((const void *)(buf + 0x80)));
        z3 = fold512(z3, k256, _mm512_loadu_si512((const void *)(buf + 0xc0)));
        buf += 256;
        len -= 256;
    }
    /* The four registers into the last, 64 bytes apart. */
    z1 = fold512(z0, k64, z1);
    z2 = fold512(z1, k64, z2);
    z3 = fold512(z2, k64, z3);
    x[0] = _mm512_castsi512_si128(z3);
    x[1] = _mm512_extracti32x4_epi32(z3, 1);
    x[2] = _mm512_extracti32x4_epi32(z3, 2);
    x[3] = _mm512_extracti32x4_epi32(z3, 3);
    *bufp = buf;
    *lenp = len;
}

/* The raw CRC state (no inversions) over len bytes, len >= 64 and a multiple of 16. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t fold(const unsigned char *buf, size_t len, uint32_t crc) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    buf += 64;
    len -= 64;
    if (wide_ok && len >= 192 + 256) {
        __m128i x[4] = {x1, x2, x3, x4};
        fold_wide(x, &buf, &len);
        x1 = x[0], x2 = x[1], x3 = x[2], x4 = x[3];
    }
    while (len >= 64) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00), x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00), x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(buf + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 0x30)));
        buf += 64;
        len -= 64;
    }
    /* Four 128-bit lanes into one, then the remaining 16-byte blocks. */
    __m128i lanes[3] = {x2, x3, x4};
    for (int i = 0; i < 3; i++) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, lanes[i]), x5);
    }
    while (len >= 16) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)buf)), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 bits to 64, then Barrett reduction to 32. */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k5k0, 0x00), x2);
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/* zlib's crc32(crc, buf, n) for the largest multiple of 16 bytes of buf (at least 64): returns
 * the running CRC; the caller continues with zlib over the n % 16 bytes left. */
HPCPAR_API uint32_t hpcpar_crc32_blocks(uint32_t crc, const unsigned char *buf, size_t len) {
    return ~fold(buf, len, ~crc);
}

/* zlib's crc32 of a few bytes, bit by bit: the tail of a span after its 16-byte blocks. */
static uint32_t crc32_bits(uint32_t crc, const unsigned char *buf, size_t len) {
    crc = ~crc;
    while (len--) {
        crc ^= *buf++;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* out[k] = zlib's crc32(0, base + offsets[k], lengths[k]) for k < n: a load's MiB chunks of one
 * file in one call (one ctypes call instead of one per chunk; the GIL released throughout). */
HPCPAR_API void hpcpar_crc32_spans(const unsigned char *base, size_t n, const uint64_t *offsets,
                                   const uint64_t *lengths, uint32_t *out) {
    for (size_t k = 0; k < n; k++) {
        const unsigned char *buf = base + offsets[k];
        size_t whole = lengths[k] >= 64 ? lengths[k] & ~(size_t)15 : 0;
        uint32_t crc = whole ? hpcpar_crc32_blocks(0, buf, whole) : 0;
        out[k] = crc32_bits(crc, buf + whole, lengths[k] - whole);
    }
}

/* zlib's crc32(crc, buf, len) for any length: 16-byte blocks folded, the tail bit by bit. */
static uint32_t crc32_update(uint32_t crc, const unsigned char *buf, size_t len) {
    size_t whole = len >= 64 ? len & ~(size_t)15 : 0;
    if (whole)
        crc = hpcpar_crc32_blocks(crc, buf, whole);
    return crc32_bits(crc, buf + whole, len - whole);
}

/* How many of the n floats of width bytes at p have every exponent bit set (inf or NaN):
 * (bits & mask) == mask, with mask their exponent field. memcpy: p need not be aligned. */
__attribute__((target_clones("avx2", "default")))
static uint64_t count_nonfinite(const unsigned char *p, size_t n, size_t width, uint64_t mask) {
    uint64_t bad = 0;
    if (width == 2) {
        uint16_t m = (uint16_t)mask, v;
        for (size_t i = 0; i < n; i++) { memcpy(&v, p + 2 * i, 2); bad += (v & m) == m; }
    } else if (width == 4) {
        uint32_t m = (uint32_t)mask, v;
        for (size_t i = 0; i < n; i++) { memcpy(&v, p + 4 * i, 4); bad += (v & m) == m; }
    } else {
        uint64_t v;
        for (size_t i = 0; i < n; i++) { memcpy(&v, p + 8 * i, 8); bad += (v & mask) == mask; }
    }
    return bad;
}

/* One pass over a checkpoint shard's bytes (base, size) for a save: crcs[c] = zlib's crc32 of
 * chunk c (chunk bytes each, a multiple of CHECK_BLOCK; the last one shorter) and, for each float
 * range q (counts[q] elements of widths[q] bytes from starts[q]; sorted by start, disjoint),
 * bad[q] = how many are inf or NaN. Both walk the bytes CHECK_BLOCK at a time, so each block is
 * checked while the CRC has just brought it into the cache: the check adds no pass over memory. */
#define CHECK_BLOCK ((size_t)64 * 1024)
HPCPAR_API void hpcpar_crc32_check(const unsigned char *base, size_t size, size_t chunk, uint32_t *crcs,
                                   size_t nranges, const uint64_t *starts, const uint64_t *counts,
                                   const uint64_t *widths, const uint64_t *masks, uint64_t *bad) {
    size_t r = 0;
    for (size_t lo = 0; lo < size; lo += CHECK_BLOCK) {
        size_t hi = lo + CHECK_BLOCK < size ? lo + CHECK_BLOCK : size, c = lo / chunk;
        crcs[c] = crc32_update(lo % chunk ? crcs[c] : 0, base + lo, hi - lo);
        while (r < nranges && starts[r] + counts[r] * widths[r] <= lo)
            r++;
        for (size_t q = r; q < nranges && starts[q] < hi; q++) { /* the elements that begin in [lo, hi) */
            size_t w = widths[q], s = starts[q];
            size_t first = lo > s ? (lo - s + w - 1) / w : 0, last = (hi - s + w - 1) / w;
            if (last > counts[q])
                last = counts[q];
            if (last > first)
                bad[q] += count_nonfinite(base + s + first * w, last - first, w, masks[q]);
        }
    }
}
#else
int hpcpar_crc32_supported(void) { return 0; }
uint32_t hpcpar_crc32_blocks(uint32_t crc, const unsigned char *buf, size_t len) {
    (void)buf; (void)len; return crc;
}
void hpcpar_crc32_spans(const unsigned char *base, size_t n, const uint64_t *offsets, const uint64_t *lengths,
                        uint32_t *out) {
    (void)base; (void)n; (void)offsets; (void)lengths; (void)out; /* never called: not supported here */
}
void hpcpar_crc32_check(const unsigned char *base, size_t size, size_t chunk, uint32_t *crcs, size_t nranges,
                        const uint64_t *starts, const uint64_t *counts, const uint64_t *widths,
                        const uint64_t *masks, uint64_t *bad) {
    (void)base; (void)size; (void)chunk; (void)crcs; (void)nranges; (void)starts; (void)counts; (void)widths;
    (void)masks; (void)bad; /* never called: not supported here */
}
#endif
