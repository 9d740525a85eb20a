/* Copying a checkpoint's checked bytes into their destinations (hpcpar/checkpoint/fastcopy.py):
 * from the file's pages, mapped, into the parameters and optimizer states. A load writes far
 * more than the caches hold, so large pieces go with streaming (non-temporal) stores: the
 * destination's lines are written without being read first, a third less memory traffic
 * than memcpy's ordinary stores, which read each destination line before they write it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HPCPAR_API __attribute__((visibility("default")))
#define STREAM_MIN (256u << 10) /* smaller pieces stay in the cache for whoever reads them next */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* dst <- src, n bytes: SSE2 (every x86-64) streaming stores from the first 16-byte aligned byte. */
static void copy_stream(unsigned char *dst, const unsigned char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* the streamed lines are visible to other threads before the call returns */
    memcpy(dst + i, src + i, n - i);
}
#else
static void copy_stream(unsigned char *dst, const unsigned char *src, size_t n) { memcpy(dst, src, n); }
#endif

/* dst[k] <- src[k], len[k] bytes, for k < n (pieces that do not overlap each other). */
HPCPAR_API void hpcpar_copy_pieces(size_t n, unsigned char *const *dst, const unsigned char *const *src,
                                   const size_t *len) {
    for (size_t k = 0; k < n; k++) {
        if (len[k] >= STREAM_MIN)
            copy_stream(dst[k], src[k], len[k]);
        else
            memcpy(dst[k], src[k], len[k]);
    }
}
