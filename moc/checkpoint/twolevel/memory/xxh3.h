/* XXH3-64 with seed 0 and the default secret: the checksum of every tensor moc writes
   (docs/FORMAT.md, "Checksums"), for streamcopy.c.

   Written from the xxHash specification (github.com/Cyan4973/xxHash, doc/xxhash_spec.md,
   "XXH3 Algorithm Description"); the digests are bit-identical to the `xxhash` package's
   xxh3_64_intdigest, which the tests check size class by size class. Why not call that
   package: it takes one buffer per call and needs the GIL back after each, and the fused
   copy below needs XXH3's long-input loop in pieces (hash a chunk's blocks, then stream
   the chunk out) without a streaming state's buffering.

   Size classes: 0, 1-3, 4-8, 9-16, 17-128 and 129-240 bytes are plain C. Over 240 bytes
   the input goes through eight 64-bit accumulators in 1024-byte blocks of sixteen
   64-byte stripes, each block followed by a scramble; then the stripes of the last
   (partial or full) block, the input's last 64 bytes as one more stripe, and a merge.
   That loop is a kernel (xxh3_kernel): scalar everywhere, SSE2 on x86-64 (always
   there), AVX2 where the CPU has it (picked at run time). They are the same arithmetic
   on the same 64-bit lanes, so they give the same digest. */
#ifndef MOC_XXH3_H
#define MOC_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define MOC_XXH3_X86 1
#include <immintrin.h>
#else
#define MOC_XXH3_X86 0
#endif

#define XXH3_STRIPE_LEN 64
#define XXH3_SECRET_LEN 192
#define XXH3_STRIPES_PER_BLOCK ((XXH3_SECRET_LEN - XXH3_STRIPE_LEN) / 8) /* 16 */
#define XXH3_BLOCK_LEN (XXH3_STRIPE_LEN * XXH3_STRIPES_PER_BLOCK)         /* 1024 */
#define XXH3_MIDSIZE_MAX 240

static const uint64_t XXH3_PRIME32_1 = 0x9E3779B1U;
static const uint64_t XXH3_PRIME32_2 = 0x85EBCA77U;
static const uint64_t XXH3_PRIME32_3 = 0xC2B2AE3DU;
static const uint64_t XXH3_PRIME64_1 = 0x9E3779B185EBCA87ULL;
static const uint64_t XXH3_PRIME64_2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t XXH3_PRIME64_3 = 0x165667B19E3779F9ULL;
static const uint64_t XXH3_PRIME64_4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t XXH3_PRIME64_5 = 0x27D4EB2F165667C5ULL;
static const uint64_t XXH3_PRIME_MX1 = 0x165667919E3779F9ULL;
static const uint64_t XXH3_PRIME_MX2 = 0x9FB21C651E98DF25ULL;

/* The default secret (the specification's "defaultSecret"): data of the format. */
static const uint8_t xxh3_secret[XXH3_SECRET_LEN] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Secret offsets the specification fixes. */
#define XXH3_SCRAMBLE_OFFSET (XXH3_SECRET_LEN - XXH3_STRIPE_LEN)         /* 128 */
#define XXH3_LAST_STRIPE_OFFSET (XXH3_SECRET_LEN - XXH3_STRIPE_LEN - 7)  /* 121 */
#define XXH3_MERGE_OFFSET 11
#define XXH3_MIDSIZE_START_OFFSET 3
#define XXH3_MIDSIZE_LAST_OFFSET (136 - 17)                               /* 119 */

/* ---- little-endian reads (unaligned: any start offset is valid input) ---- */

static inline uint32_t xxh3_read32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t xxh3_read64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t xxh3_rotl64(uint64_t x, unsigned r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t xxh3_bswap64(uint64_t x)
{
    return __builtin_bswap64(x);
}

/* The 128-bit product of a and b, its two halves xored together. */
static inline uint64_t xxh3_mul128_fold64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    /* 32-bit targets: four 32x32 partial products. */
    uint64_t lo_lo = (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFF);
    uint64_t lo_hi = (a & 0xFFFFFFFF) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFF);
    return lower ^ upper;
#endif
}

static inline uint64_t xxh3_avalanche_xxh64(uint64_t h)
{
    h ^= h >> 33;
    h *= XXH3_PRIME64_2;
    h ^= h >> 29;
    h *= XXH3_PRIME64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t xxh3_avalanche(uint64_t h)
{
    h ^= h >> 37;
    h *= XXH3_PRIME_MX1;
    h ^= h >> 32;
    return h;
}

/* ---- up to 240 bytes ---- */

static uint64_t xxh3_len_0to16(const uint8_t *in, size_t len)
{
    const uint8_t *s = xxh3_secret;
    if (len > 8) {
        uint64_t lo = (xxh3_read64(s + 24) ^ xxh3_read64(s + 32)) ^ xxh3_read64(in);
        uint64_t hi = (xxh3_read64(s + 40) ^ xxh3_read64(s + 48)) ^ xxh3_read64(in + len - 8);
        return xxh3_avalanche(len + xxh3_bswap64(lo) + hi + xxh3_mul128_fold64(lo, hi));
    }
    if (len >= 4) {
        uint64_t combined = (uint64_t)xxh3_read32(in + len - 4)
                            | ((uint64_t)xxh3_read32(in) << 32);
        uint64_t h = (xxh3_read64(s + 8) ^ xxh3_read64(s + 16)) ^ combined;
        h ^= xxh3_rotl64(h, 49) ^ xxh3_rotl64(h, 24);
        h *= XXH3_PRIME_MX2;
        h ^= (h >> 35) + len;
        h *= XXH3_PRIME_MX2;
        return h ^ (h >> 28);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)in[len - 1] | ((uint32_t)len << 8)
                            | ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24);
        uint64_t key = (uint64_t)(xxh3_read32(s) ^ xxh3_read32(s + 4));
        return xxh3_avalanche_xxh64(key ^ combined);
    }
    return xxh3_avalanche_xxh64(xxh3_read64(s + 56) ^ xxh3_read64(s + 64));
}

/* One 16-byte piece of input against 16 bytes of secret (the specification's mixStep). */
static inline uint64_t xxh3_mix16(const uint8_t *in, const uint8_t *s)
{
    return xxh3_mul128_fold64(xxh3_read64(in) ^ xxh3_read64(s),
                              xxh3_read64(in + 8) ^ xxh3_read64(s + 8));
}

static uint64_t xxh3_len_17to128(const uint8_t *in, size_t len)
{
    /* Pairs of 16-byte pieces, one from the front and one from the back, until they
       cover the input; rounds = 1 for 17-32 bytes, ..., 4 for 97-128. */
    uint64_t acc = len * XXH3_PRIME64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = 0; i < rounds; i++) {
        acc += xxh3_mix16(in + 16 * i, xxh3_secret + 32 * i);
        acc += xxh3_mix16(in + len - 16 * i - 16, xxh3_secret + 32 * i + 16);
    }
    return xxh3_avalanche(acc);
}

static uint64_t xxh3_len_129to240(const uint8_t *in, size_t len)
{
    uint64_t acc = len * XXH3_PRIME64_1;
    size_t pieces = len >> 4;
    for (size_t i = 0; i < 8; i++)
        acc += xxh3_mix16(in + 16 * i, xxh3_secret + 16 * i);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < pieces; i++)
        acc += xxh3_mix16(in + 16 * i, xxh3_secret + 16 * (i - 8) + XXH3_MIDSIZE_START_OFFSET);
    acc += xxh3_mix16(in + len - 16, xxh3_secret + XXH3_MIDSIZE_LAST_OFFSET);
    return xxh3_avalanche(acc);
}

/* ---- over 240 bytes: the kernels ----

   accumulate (one stripe, eight lanes i): acc[i ^ 1] += lane; acc[i] += lo32(lane ^ key)
   * hi32(lane ^ key), the key 64 bytes of the secret that move 8 bytes a stripe.
   scramble (after each full block): acc ^= acc >> 47; acc ^= key; acc *= PRIME32_1. */

typedef struct {
    const char *name;
    /* nblocks full blocks from in: sixteen stripes then a scramble each. */
    void (*blocks)(uint64_t acc[8], const uint8_t *in, size_t nblocks);
    /* nstripes stripes from in, the first against secret, each next 8 bytes further. */
    void (*stripes)(uint64_t acc[8], const uint8_t *in, size_t nstripes,
                    const uint8_t *secret);
} xxh3_kernel;

static inline void xxh3_accumulate_scalar(uint64_t acc[8], const uint8_t *in,
                                          const uint8_t *secret)
{
    for (int i = 0; i < 8; i++) {
        uint64_t lane = xxh3_read64(in + 8 * i);
        uint64_t keyed = lane ^ xxh3_read64(secret + 8 * i);
        acc[i ^ 1] += lane;
        acc[i] += (keyed & 0xFFFFFFFF) * (keyed >> 32);
    }
}

static void xxh3_stripes_scalar(uint64_t acc[8], const uint8_t *in, size_t nstripes,
                                const uint8_t *secret)
{
    for (size_t n = 0; n < nstripes; n++)
        xxh3_accumulate_scalar(acc, in + n * XXH3_STRIPE_LEN, secret + 8 * n);
}

static void xxh3_blocks_scalar(uint64_t acc[8], const uint8_t *in, size_t nblocks)
{
    uint64_t a[8];
    memcpy(a, acc, sizeof a);
    for (size_t b = 0; b < nblocks; b++, in += XXH3_BLOCK_LEN) {
        for (size_t n = 0; n < XXH3_STRIPES_PER_BLOCK; n++)
            xxh3_accumulate_scalar(a, in + n * XXH3_STRIPE_LEN, xxh3_secret + 8 * n);
        for (int i = 0; i < 8; i++) {
            uint64_t x = a[i] ^ (a[i] >> 47);
            x ^= xxh3_read64(xxh3_secret + XXH3_SCRAMBLE_OFFSET + 8 * i);
            a[i] = x * XXH3_PRIME32_1;
        }
    }
    memcpy(acc, a, sizeof a);
}

static const xxh3_kernel xxh3_kernel_scalar = {"scalar", xxh3_blocks_scalar,
                                               xxh3_stripes_scalar};

#if MOC_XXH3_X86
/* Two 64-bit lanes a register. mul_epu32 multiplies the low 32 bits of each 64-bit lane:
   keyed times keyed >> 32 is lo32 * hi32. The lane added to its neighbour (i ^ 1) is the
   stripe with its two 64-bit halves swapped. */
static inline void xxh3_accumulate_sse2(__m128i acc[4], const uint8_t *in,
                                        const uint8_t *secret)
{
    for (int i = 0; i < 4; i++) {
        __m128i lanes = _mm_loadu_si128((const __m128i *)(in + 16 * i));
        __m128i keyed = _mm_xor_si128(lanes,
                                      _mm_loadu_si128((const __m128i *)(secret + 16 * i)));
        __m128i product = _mm_mul_epu32(keyed, _mm_srli_epi64(keyed, 32));
        __m128i swapped = _mm_shuffle_epi32(lanes, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm_add_epi64(acc[i], _mm_add_epi64(product, swapped));
    }
}

static void xxh3_stripes_sse2(uint64_t acc[8], const uint8_t *in, size_t nstripes,
                              const uint8_t *secret)
{
    __m128i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
    for (size_t n = 0; n < nstripes; n++)
        xxh3_accumulate_sse2(a, in + n * XXH3_STRIPE_LEN, secret + 8 * n);
    for (int i = 0; i < 4; i++)
        _mm_storeu_si128((__m128i *)(acc + 2 * i), a[i]);
}

static void xxh3_blocks_sse2(uint64_t acc[8], const uint8_t *in, size_t nblocks)
{
    /* PRIME32_1 fits 32 bits: x * p = lo32(x) * p + (hi32(x) * p << 32) modulo 2^64. */
    const __m128i prime = _mm_set1_epi32((int)XXH3_PRIME32_1);
    __m128i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
    for (size_t b = 0; b < nblocks; b++, in += XXH3_BLOCK_LEN) {
        for (size_t n = 0; n < XXH3_STRIPES_PER_BLOCK; n++)
            xxh3_accumulate_sse2(a, in + n * XXH3_STRIPE_LEN, xxh3_secret + 8 * n);
        for (int i = 0; i < 4; i++) {
            __m128i x = _mm_xor_si128(a[i], _mm_srli_epi64(a[i], 47));
            x = _mm_xor_si128(x, _mm_loadu_si128(
                (const __m128i *)(xxh3_secret + XXH3_SCRAMBLE_OFFSET + 16 * i)));
            __m128i lo = _mm_mul_epu32(x, prime);
            __m128i hi = _mm_mul_epu32(_mm_srli_epi64(x, 32), prime);
            a[i] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
        }
    }
    for (int i = 0; i < 4; i++)
        _mm_storeu_si128((__m128i *)(acc + 2 * i), a[i]);
}

static const xxh3_kernel xxh3_kernel_sse2 = {"sse2", xxh3_blocks_sse2, xxh3_stripes_sse2};

/* The SSE2 kernel on four lanes a register, compiled for AVX2 whatever the build's
   -march; used only where __builtin_cpu_supports("avx2") (streamcopy.c's init). The
   swap of neighbouring lanes stays inside each 128-bit half, as shuffle_epi32 does. */
#define MOC_AVX2 __attribute__((target("avx2")))

static inline MOC_AVX2 void xxh3_accumulate_avx2(__m256i acc[2], const uint8_t *in,
                                                 const uint8_t *secret)
{
    for (int i = 0; i < 2; i++) {
        __m256i lanes = _mm256_loadu_si256((const __m256i *)(in + 32 * i));
        __m256i keyed = _mm256_xor_si256(
            lanes, _mm256_loadu_si256((const __m256i *)(secret + 32 * i)));
        __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
        __m256i swapped = _mm256_shuffle_epi32(lanes, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, swapped));
    }
}

static MOC_AVX2 void xxh3_stripes_avx2(uint64_t acc[8], const uint8_t *in, size_t nstripes,
                                       const uint8_t *secret)
{
    __m256i a[2];
    for (int i = 0; i < 2; i++)
        a[i] = _mm256_loadu_si256((const __m256i *)(acc + 4 * i));
    for (size_t n = 0; n < nstripes; n++)
        xxh3_accumulate_avx2(a, in + n * XXH3_STRIPE_LEN, secret + 8 * n);
    for (int i = 0; i < 2; i++)
        _mm256_storeu_si256((__m256i *)(acc + 4 * i), a[i]);
}

static MOC_AVX2 void xxh3_blocks_avx2(uint64_t acc[8], const uint8_t *in, size_t nblocks)
{
    const __m256i prime = _mm256_set1_epi32((int)XXH3_PRIME32_1);
    __m256i a[2];
    for (int i = 0; i < 2; i++)
        a[i] = _mm256_loadu_si256((const __m256i *)(acc + 4 * i));
    for (size_t b = 0; b < nblocks; b++, in += XXH3_BLOCK_LEN) {
        for (size_t n = 0; n < XXH3_STRIPES_PER_BLOCK; n++)
            xxh3_accumulate_avx2(a, in + n * XXH3_STRIPE_LEN, xxh3_secret + 8 * n);
        for (int i = 0; i < 2; i++) {
            __m256i x = _mm256_xor_si256(a[i], _mm256_srli_epi64(a[i], 47));
            x = _mm256_xor_si256(x, _mm256_loadu_si256(
                (const __m256i *)(xxh3_secret + XXH3_SCRAMBLE_OFFSET + 32 * i)));
            __m256i lo = _mm256_mul_epu32(x, prime);
            __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
            a[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
        }
    }
    for (int i = 0; i < 2; i++)
        _mm256_storeu_si256((__m256i *)(acc + 4 * i), a[i]);
}

static const xxh3_kernel xxh3_kernel_avx2 = {"avx2", xxh3_blocks_avx2, xxh3_stripes_avx2};
#endif /* MOC_XXH3_X86 */

/* ---- over 240 bytes: the loop around a kernel, in two halves so that a caller can
   run the full blocks a piece at a time (the fused copy in streamcopy.c) ---- */

static inline void xxh3_long_init(uint64_t acc[8])
{
    acc[0] = XXH3_PRIME32_3;
    acc[1] = XXH3_PRIME64_1;
    acc[2] = XXH3_PRIME64_2;
    acc[3] = XXH3_PRIME64_3;
    acc[4] = XXH3_PRIME64_4;
    acc[5] = XXH3_PRIME32_2;
    acc[6] = XXH3_PRIME64_5;
    acc[7] = XXH3_PRIME32_1;
}

/* The full blocks that precede the last block: the last one (1 to 1024 bytes, a full
   block too when len is a multiple of 1024) is xxh3_long_finish's. */
static inline size_t xxh3_long_blocks(size_t len)
{
    return (len - 1) / XXH3_BLOCK_LEN;
}

/* The digest of in[0:len], len > 240, from acc after exactly xxh3_long_blocks(len) full
   blocks: the last block's stripes, the last 64 bytes (which may reach back into the
   block before), the merge. */
static uint64_t xxh3_long_finish(uint64_t acc[8], const uint8_t *in, size_t len,
                                 const xxh3_kernel *kernel)
{
    size_t done = xxh3_long_blocks(len) * XXH3_BLOCK_LEN;
    kernel->stripes(acc, in + done, (len - 1 - done) / XXH3_STRIPE_LEN, xxh3_secret);
    kernel->stripes(acc, in + len - XXH3_STRIPE_LEN, 1,
                    xxh3_secret + XXH3_LAST_STRIPE_OFFSET);
    uint64_t h = len * XXH3_PRIME64_1;
    const uint8_t *s = xxh3_secret + XXH3_MERGE_OFFSET;
    for (int i = 0; i < 4; i++)
        h += xxh3_mul128_fold64(acc[2 * i] ^ xxh3_read64(s + 16 * i),
                                acc[2 * i + 1] ^ xxh3_read64(s + 16 * i + 8));
    return xxh3_avalanche(h);
}

/* XXH3-64, seed 0, of in[0:len]: xxhash's xxh3_64_intdigest. */
static uint64_t xxh3_64(const void *input, size_t len, const xxh3_kernel *kernel)
{
    const uint8_t *in = (const uint8_t *)input;
    if (len <= 16)
        return xxh3_len_0to16(in, len);
    if (len <= 128)
        return xxh3_len_17to128(in, len);
    if (len <= XXH3_MIDSIZE_MAX)
        return xxh3_len_129to240(in, len);
    uint64_t acc[8];
    xxh3_long_init(acc);
    kernel->blocks(acc, in, xxh3_long_blocks(len));
    return xxh3_long_finish(acc, in, len, kernel);
}

#endif /* MOC_XXH3_H */
