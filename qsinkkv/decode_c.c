/* Decode attention over a LayerStorage on the CPU, with the int4/int8 codes dequantized inside the
 * dot products (no float32 copy of the window): the C version of qsinkkv.decode.decode_attention_torch,
 * loaded by qsinkkv/decode_c.py. Absolute positions; one query token per sequence.
 *
 * One unit of work is (KV head h, sequence b): its G query heads attend together over the slots of
 * sequence b in slot_positions order (sinks, quantized ring, float ring), visible where bias[b, n] is
 * 0 (-inf: not seen; a block or row not seen is skipped, not read). The slots are taken a segment at a time
 * (the sinks, each quantized block, each float-ring block): the segment's seen rows are widened into a local
 * float32 array of rows, packed, and each query head's dot products run over them. Scores of a quantized
 * block fold the key scales into the query, once per block:  q . k_t = (q * s_blk) . codes_t + q . z_blk.
 * Values are added LANES channels at a time with the G heads' sums held in registers across the segment's
 * rows; a quantized value block folds its scales into the probabilities when a group is whole vectors,
 * sum_t p_t (codes_t * s_t + z_t) = sum_t (p_t * s_t) . codes_t + sum_t p_t z_t (the zeros' term per group,
 * added once per unit), else its rows are dequantized row by row first. Every product runs over aligned
 * local arrays in a fixed order, so a unit's result does not depend on the batch it is in, nor on the
 * thread that computes it.
 *
 * Why not PyTorch ops: the torch path writes the whole window as float32 into a buffer and reads it back
 * at every layer of every step (several passes over 4 bytes per element, ~80 ops a call); this reads each
 * code once, at 0.5 or 1 byte per element, in one call.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };  /* dtype codes, as decode_c.py passes them */

/* What every public entry point returns: 0, or why it refused, having read or written nothing (a table or an index
 * is input: an entry past what it names would read or write outside its buffer). decode_c.py's Status holds the
 * same names and values, compared with this table (qsinkkv_status) when the library is opened. */
#define QSK_STATUSES(X)                                                                                            \
    X(OK, 0)              /* done */                                                                               \
    X(TOO_LARGE, -1)      /* a size beyond this file's fixed arrays (head_dim > MAX_D ...) */                      \
    X(NO_MEMORY, -2)      /* a scratch allocation failed */                                                        \
    X(SCALE_OVERFLOW, -3) /* a block's scale or zero overflows the scale dtype */                                  \
    X(VALUE_REFUSED, -4)  /* q holds NaN/inf, or k, v a value the value checks refuse */                           \
    X(NO_BLOCK, -5)       /* a table names no block (-1) where a write goes or reads */                            \
    X(PAST_POOL, -6)      /* a table entry past its pool */                                                        \
    X(OUT_OF_RANGE, -7)   /* an index outside what it indexes (a token past x, a sequence past the batch ...) */   \
    X(NO_SINK_PAGE, -8)   /* a row whose sinks are visible (it holds tokens) has no sink page */
#define QSK_ENUM(name, value) QSK_##name = value,
enum { QSK_STATUSES(QSK_ENUM) };
#define MAX_D 512
#define ALIGN __attribute__((aligned(64)))

static inline int64_t elem_bytes(int64_t dt) { return dt == F32 ? 4 : 2; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n values of dtype `dt` at element offset `i` of `p`, as float32 into `out` (fp16 by the F16C instructions
 * where the machine has them: the same exact conversion, 8 at a time) */
static inline void load(const void *p, int dt, int64_t i, int n, float *restrict out) {
    if (dt == F32) {
        memcpy(out, (const float *)p + i, (size_t)n * 4);
    } else if (dt == BF16) {
        const uint16_t *src = (const uint16_t *)p + i;
        uint32_t *dst = (uint32_t *)out;
        int d = 0;
#ifdef __AVX2__
        for (; d + 8 <= n; d += 8)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d))), 16));
#endif
        for (; d < n; d++) dst[d] = (uint32_t)src[d] << 16;
    } else {
        const uint16_t *src = (const uint16_t *)p + i;
        int d = 0;
#ifdef __F16C__
        for (; d + 8 <= n; d += 8) _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
        for (; d < n; d++) out[d] = _cvtsh_ss(src[d]);
#endif
        for (; d < n; d++) out[d] = half_to_float(src[d]);
    }
}

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define V(x) ((v8 *)(x))

static inline float hsum(v8 s) {
    v4 lo, hi;
    memcpy(&lo, &s, 16);
    memcpy(&hi, (char *)&s + 16, 16);
    lo += hi;
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

/* e^x for x <= 0 (a softmax's x - max), 0 below -87 (and for -inf): Cephes' expf polynomial
 * on 8 lanes (tests/test_decode_c.py holds the whole decode to the float64 reference) (libm's expf is a call per element). n = round(x / ln 2) by the 1.5 * 2^23 trick. */
static inline v8 exp_nonpositive(v8 x) {
    const v8 lowest = (v8){0} - 87.0f;
    const v8i under = x < lowest;                                        /* lanes of -1 where true */
    const v8 xc = (v8)(((v8i)x & ~under) | ((v8i)lowest & under));
    const v8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v8 f = xc - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = f * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    const v8i two_n = (__builtin_convertvector(n, v8i) + 127) << 23;
    return (v8)((v8i)(p * (v8)two_n) & ~under);
}

/* A row's products run over vectors of LANES floats: 16 where the machine has AVX-512 (half the instructions
 * per row), else 8; rows are padded (with zeros) to a multiple of LANES */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vr __attribute__((vector_size(LANES * 4)));
#define VR(x) ((vr *)(x))

static inline vr splat(float f) {  /* (not `(vr){0} + f`: an add, since -0 + 0 is +0) */
#if LANES == 16
    return (vr)_mm512_set1_ps(f);
#elif LANES == 8 && defined(__AVX__)
    return (vr)_mm256_set1_ps(f);
#else
    vr v;
    for (int d = 0; d < LANES; d++) v[d] = f;
    return v;
#endif
}

static inline float hsum_r(vr s) {
#if LANES == 16
    v8 lo, hi;
    memcpy(&lo, &s, 32);
    memcpy(&hi, (char *)&s + 32, 32);
    return hsum(lo + hi);
#else
    return hsum(s);
#endif
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t Vn) {
    vr s0 = {0}, s1 = {0};  /* two chains: half the latency of one */
    int64_t v = 0;
    for (; v + 1 < Vn; v += 2) {
        s0 += VR(a)[v] * VR(b)[v];
        s1 += VR(a)[v + 1] * VR(b)[v + 1];
    }
    if (v < Vn) s0 += VR(a)[v] * VR(b)[v];
    return hsum_r(s0 + s1);
}

/* codes of one token row as D floats (int4: byte j holds channel j low, channel j + D/2 high), 8 at a time
 * where the row splits into whole vectors (AVX2: a zero-extend and a convert per 8 codes) */
static inline void widen(const uint8_t *restrict c, float *restrict out) {  /* 8 bytes -> 8 floats */
#ifdef __AVX2__
    _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c))));
#else
    for (int d = 0; d < 8; d++) out[d] = (float)c[d];
#endif
}

static inline void widen_nibbles(const uint8_t *restrict c, float *restrict lo, float *restrict hi) {
#ifdef __AVX2__
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)c), low = _mm_set1_epi8(15);
    _mm256_store_ps(lo, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, low))));
    _mm256_store_ps(hi, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low))));
#else
    for (int d = 0; d < 8; d++) {
        lo[d] = (float)(c[d] & 15);
        hi[d] = (float)(c[d] >> 4);
    }
#endif
}

/* out is 32-byte aligned */
static inline void unpack(const uint8_t *restrict c, int bits, int64_t D, float *restrict out) {
    int64_t d = 0;
    if (bits == 8) {
#ifdef __AVX512F__
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + d)))));
#endif
        for (; d + 8 <= D; d += 8) widen(c + d, out + d);
        for (; d < D; d++) out[d] = (float)c[d];
        return;
    }
    const int64_t half = D / 2;
    if (half % 8 == 0) {
#ifdef __AVX512F__
        const __m512i low = _mm512_set1_epi32(15);
        for (; d + 16 <= half; d += 16) {  /* 16 bytes -> 32 codes */
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + d)));
            _mm512_storeu_ps(out + d, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)));
            _mm512_storeu_ps(out + half + d, _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)));
        }
#endif
        for (; d < half; d += 8) widen_nibbles(c + d, out + d, out + half + d);
        return;
    }
    for (; d < half; d++) {
        out[d] = (float)(c[d] & 15);
        out[half + d] = (float)(c[d] >> 4);
    }
}

/* the offsets t < n where bias[t] is 0 (seen), in order, into idx; returns how many (no branch per row: a
 * block's seen rows are one run, but where it starts differs from block to block) */
static inline int64_t seen_rows(const float *bias, int64_t n, int64_t *restrict idx) {
    int all = 1;  /* the common case, every row seen, in a few vector compares */
    for (int64_t t = 0; t < n; t++) all &= bias[t] == 0.0f;
    if (all) {
        for (int64_t t = 0; t < n; t++) idx[t] = t;
        return n;
    }
    int64_t count = 0;
    for (int64_t t = 0; t < n; t++) {
        idx[count] = t;
        count += bias[t] == 0.0f;
    }
    return count;
}

#ifdef __AVX__
#if LANES == 16
/* hsum8's transposing tree over whole 512-bit vectors, in its three stages, so that a pass can reduce its rows as
 * they finish (score8_ng: the eight rows' sums need not all be live at once). pair_rows: lanes 0-7 a's halves added,
 * lanes 8-15 b's; quad_rows (of pair_rows of rows 0,1 and 2,3): 128-bit lane k holds four partial sums of row k;
 * eight_rows (of quad_rows of rows 0-3 and 4-7): lane j the sum of row j */
static inline __m512 pair_rows(vr a, vr b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x44),
                         _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xEE));
}

static inline __m512 quad_rows(__m512 t0, __m512 t1) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
}

static inline v8 eight_rows(__m512 u0, __m512 u1) {
    /* lane k: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] of rows k (x) and k + 4 (y), then their halves added */
    const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
    const __m512 s = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  /* lane k: [s_k, s_k+4, s_k, s_k+4] */
    const __m512 order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), s);
    return (v8)_mm512_castps512_ps256(order);
}
#else
/* lane j: the sum of a[j]'s lanes (eight rows' dot products reduced together: a fraction of eight hsums) */
static inline v8 hsum8(const vr *a) {
    __m256 f[8];
    for (int j = 0; j < 8; j++) f[j] = (__m256)a[j];
    /* hadd pairs within 128-bit halves: u0 = [sums of f0..f3 over lanes 0-3 | over lanes 4-7], u1 for f4..f7 */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[1]), _mm256_hadd_ps(f[2], f[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(f[4], f[5]), _mm256_hadd_ps(f[6], f[7]));
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#endif

/* Chunk v (LANES channels) of one row of codes as floats, in registers: the floats `unpack` writes, without the trip
 * through memory. `half` 0: int8 codes (needs D a multiple of LANES); else int4, `half` the chunks of a row's low
 * nibbles (D / 2 / LANES: byte j holds channel j low, j + D / 2 high, so chunk v >= half is the high nibbles of the
 * bytes chunk v - half reads; needs D a multiple of 2 * LANES). See `codes_in_registers`. */
static inline __attribute__((always_inline)) vr code_chunk(const uint8_t *row, int64_t v, int64_t half) {
    const int high = half && v >= half;
    const uint8_t *at = row + (high ? v - half : v) * LANES;
#if LANES == 16
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
    if (!half) return (vr)_mm512_cvtepi32_ps(x);
    /* a nibble's float from a 16-entry table (the same floats): the permute reads an index's low 4 bits alone, so
     * the low nibbles take no mask, and no conversion */
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (vr)_mm512_permutexvar_ps(high ? _mm512_srli_epi32(x, 4) : x, nibbles);
#elif defined(__AVX2__)
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
    if (!half) return (vr)_mm256_cvtepi32_ps(x);
    return (vr)_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(x, 4) : _mm256_and_si256(x, _mm256_set1_epi32(15)));
#else
    vr out;
    for (int d = 0; d < LANES; d++) out[d] = (float)(!half ? at[d] : high ? at[d] >> 4 : at[d] & 15);
    return out;
#endif
}

/* How many query heads one pass keeps in registers: a pass over eight rows holds 8 x SCORE_HEADS score sums, a
 * pass over a tile of VALUE_TILE chunks VALUE_HEADS x VALUE_TILE value sums (AVX-512 has 32 vector registers,
 * AVX2 16). Each row vector is loaded once per pass and used by every head of it: with one head per pass the
 * loads, not the multiply-adds, set the pace */
#if LANES == 16
#define SCORE_HEADS 3
#define VALUE_TILE 4
#else
#define SCORE_HEADS 1
#define VALUE_TILE 2
#endif
#define VALUE_HEADS 3

#ifdef __AVX__
#if LANES == 16
/* r[g] = qx[g] . (the codes of row j), for NG heads, over the chunks in order (code_chunk); for int4 (`half`) chunk
 * v (low nibbles) and v + half (high) from one load of the bytes, as in score8_ng's other loop */
static inline __attribute__((always_inline)) void score_code_row(const int64_t NG, int j, float (*restrict qx)[MAX_D],
                                                                 int64_t Vn, const uint8_t *const *code_rows,
                                                                 int64_t half, vr *r) {
    for (int64_t g = 0; g < NG; g++) r[g] = (vr){0};
    if (half) {
        for (int64_t v = 0; v < half; v++) {
            const vr lo = code_chunk(code_rows[j], v, half), hi = code_chunk(code_rows[j], v + half, half);
            for (int64_t g = 0; g < NG; g++) {
                r[g] += VR(qx[g])[v] * lo;
                r[g] += VR(qx[g])[v + half] * hi;
            }
        }
        return;
    }
    for (int64_t v = 0; v < Vn; v++) {
        const vr x = code_chunk(code_rows[j], v, 0);
        for (int64_t g = 0; g < NG; g++) r[g] += VR(qx[g])[v] * x;
    }
}
#endif

/* sc[g * Ns + j] = qx[g] . rows[j] (+ qz[g]) for eight rows and NG heads: the 8 x NG sums are independent
 * chains (not one chain of Vn multiply-adds per row, whose latency held the loop), reduced eight at a time
 * (a transposing tree: pair_rows, quad_rows, eight_rows; hsum8 without AVX-512). With `code_rows` the rows are
 * codes widened in registers (code_chunk), and with AVX-512 a pass takes them row by row, reducing a pair of rows
 * as it finishes: all eight rows' sums beside the query's chunks outnumber the registers, and the compiler would
 * keep the sums in memory (docs/benchmarks.md, "Decisions in the code"). Float rows go a chunk at a time over the
 * eight, each chunk of the query loaded once for them. Each row's sum runs over the chunks in order either way: the same bits */
static inline __attribute__((always_inline)) void score8_ng(const int64_t NG, const float *restrict rows, int64_t Dp,
                                                            float (*restrict qx)[MAX_D], const float *qz, float *sc,
                                                            int64_t Ns, int64_t Vn, const uint8_t *const *code_rows,
                                                            int64_t half) {
#if LANES == 16
    __m512 t[SCORE_HEADS][2], u[SCORE_HEADS][2];
    if (code_rows) {
#pragma GCC unroll 4
        for (int pair = 0; pair < 4; pair++) {  /* (unrolled: t and u stay in registers) */
            vr a[SCORE_HEADS], b[SCORE_HEADS];
            score_code_row(NG, 2 * pair, qx, Vn, code_rows, half, a);
            score_code_row(NG, 2 * pair + 1, qx, Vn, code_rows, half, b);
            for (int64_t g = 0; g < NG; g++) t[g][pair & 1] = pair_rows(a[g], b[g]);
            if (pair & 1)
                for (int64_t g = 0; g < NG; g++) u[g][pair >> 1] = quad_rows(t[g][0], t[g][1]);
        }
    } else {
        vr p[SCORE_HEADS][8];
        for (int64_t g = 0; g < NG; g++)
            for (int j = 0; j < 8; j++) p[g][j] = (vr){0};
        for (int64_t v = 0; v < Vn; v++)
            for (int j = 0; j < 8; j++)
                for (int64_t g = 0; g < NG; g++) p[g][j] += VR(qx[g])[v] * VR(rows + j * Dp)[v];
        for (int64_t g = 0; g < NG; g++) {
            u[g][0] = quad_rows(pair_rows(p[g][0], p[g][1]), pair_rows(p[g][2], p[g][3]));
            u[g][1] = quad_rows(pair_rows(p[g][4], p[g][5]), pair_rows(p[g][6], p[g][7]));
        }
    }
    for (int64_t g = 0; g < NG; g++) {  /* (one vector store: lane by lane, the stores took 7% of this loop) */
        const v8 s8 = qz ? eight_rows(u[g][0], u[g][1]) + qz[g] : eight_rows(u[g][0], u[g][1]);
        memcpy(sc + g * Ns, &s8, sizeof s8);
    }
#else
    vr p[SCORE_HEADS][8];
    for (int64_t g = 0; g < NG; g++)
        for (int j = 0; j < 8; j++) p[g][j] = (vr){0};
    for (int64_t v = 0; v < Vn; v++)
        for (int j = 0; j < 8; j++) {  /* rows[j], or with code_rows the codes of row j (code_chunk) */
            const vr x = code_rows ? code_chunk(code_rows[j], v, half) : VR(rows + j * Dp)[v];
            for (int64_t g = 0; g < NG; g++) p[g][j] += VR(qx[g])[v] * x;
        }
    for (int64_t g = 0; g < NG; g++) {
        const v8 s8 = qz ? hsum8(p[g]) + qz[g] : hsum8(p[g]);
        memcpy(sc + g * Ns, &s8, sizeof s8);
    }
#endif
}
#endif

/* sc[g * Ns + i] = qx[g] . rows[i] (+ qz[g]) for the n packed rows (Dp floats apart): eight rows at a time
 * where the machine has AVX (their sums reduced together), the rest one by one. Each sum runs over the channels
 * in order whichever way it goes, and which rows go which way depends on n alone, so a sequence's scores do not
 * depend on its batch. With `code_rows` (n rows of int8 codes, `codes_in_registers`) the rows are the codes, widened
 * in registers; a row left over from the eights is unpacked into rows[i] first (the same floats). */
static inline void score_rows(int64_t ng, int64_t n, float *rows, int64_t Dp, float (*qx)[MAX_D],
                              const float *qz, float *sc, int64_t Ns, int64_t Vn,
                              const uint8_t *const *code_rows, int64_t half, int64_t D) {
    int64_t i = 0;
#ifdef __AVX__
    for (; i + 8 <= n; i += 8)
        for (int64_t g = 0; g < ng; g += SCORE_HEADS) {
            const float *r = rows + i * Dp, *z = qz ? qz + g : NULL;
            const uint8_t *const *cr = code_rows ? code_rows + i : NULL;
            float *out = sc + g * Ns + i;
            /* (each source its own inlined copy: the float rows' loop keeps no test of code_rows) */
            switch (ng - g < SCORE_HEADS ? ng - g : SCORE_HEADS) {
            case 1: cr && half ? score8_ng(1, r, Dp, qx + g, z, out, Ns, Vn, cr, half)
                  : cr ? score8_ng(1, r, Dp, qx + g, z, out, Ns, Vn, cr, 0)
                       : score8_ng(1, r, Dp, qx + g, z, out, Ns, Vn, NULL, 0); break;
#if SCORE_HEADS == 3
            case 2: cr && half ? score8_ng(2, r, Dp, qx + g, z, out, Ns, Vn, cr, half)
                  : cr ? score8_ng(2, r, Dp, qx + g, z, out, Ns, Vn, cr, 0)
                       : score8_ng(2, r, Dp, qx + g, z, out, Ns, Vn, NULL, 0); break;
            case 3: cr && half ? score8_ng(3, r, Dp, qx + g, z, out, Ns, Vn, cr, half)
                  : cr ? score8_ng(3, r, Dp, qx + g, z, out, Ns, Vn, cr, 0)
                       : score8_ng(3, r, Dp, qx + g, z, out, Ns, Vn, NULL, 0); break;
#endif
            }
        }
#endif
    for (; i < n; i++) {
        if (code_rows) unpack(code_rows[i], half ? 4 : 8, D, rows + i * Dp);
        for (int64_t g = 0; g < ng; g++) {
            const float s = dot(qx[g], rows + i * Dp, Vn);
            sc[g * Ns + i] = qz ? s + qz[g] : s;
        }
    }
}

/* acc[g][chunk c] += sum_i w[g * R + i * K + c / cpk] * x_i over the n packed rows, for NG heads, the chunks of one
 * tile: CT chunks from c0, or for int4 codes (`half`) CT / 2 low-nibble chunks from c0 and their high-nibble partners
 * from c0 + half (one load of the bytes for both). x_i = rows[i], or with `code_rows` row i's codes widened in
 * registers (code_chunk). A row's weight depends on the chunk's group c / cpk (K groups a row): a quantized block's
 * weights come with its value scales folded in (its zeros' term is added apart: `fold_value_scales`); other rows
 * have K = 1, cpk = Vn. The NG x CT sums stay in registers across the rows (NG, CT constants) */
static inline __attribute__((always_inline)) void accumulate_tile(
        const int64_t NG, const int64_t CT, int64_t c0, int64_t n, const float *restrict rows, int64_t Dp,
        const float *restrict w, int64_t R, int64_t K, int64_t cpk, float (*restrict acc)[MAX_D],
        const uint8_t *const *code_rows, int64_t half) {
    const int pairs = code_rows && half && CT % 2 == 0;  /* (int4 tiles: chunks c0.., c0 + half..) */
    vr r[VALUE_HEADS][VALUE_TILE];
    int64_t ch[VALUE_TILE], k[VALUE_TILE];
    for (int64_t t = 0; t < CT; t++) {
        ch[t] = pairs && t >= CT / 2 ? c0 + t - CT / 2 + half : c0 + t;
        k[t] = K == 1 ? 0 : ch[t] / cpk;
        for (int64_t g = 0; g < NG; g++) r[g][t] = (vr){0};
    }
    for (int64_t i = 0; i < n; i++) {
        vr x[VALUE_TILE];
#if LANES == 16
        if (pairs)
            for (int64_t t = 0; t < CT / 2; t++) {
                const __m128i row_bytes = _mm_loadu_si128((const __m128i *)(code_rows[i] + ch[t] * LANES));
                const __m512i bytes = _mm512_cvtepu8_epi32(row_bytes);
                const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                x[t] = (vr)_mm512_permutexvar_ps(bytes, nibbles);  /* (code_chunk's table, as there) */
                x[t + CT / 2] = (vr)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), nibbles);
            }
        else
#endif
            for (int64_t t = 0; t < CT; t++)
                x[t] = code_rows ? code_chunk(code_rows[i], ch[t], half) : VR(rows + i * Dp)[ch[t]];
        const float *wi = w + i * K;
        for (int64_t t = 0; t < CT; t++)
            for (int64_t g = 0; g < NG; g++) r[g][t] += splat(wi[g * R + k[t]]) * x[t];
    }
    for (int64_t t = 0; t < CT; t++)
        for (int64_t g = 0; g < NG; g++) VR(acc[g])[ch[t]] += r[g][t];
}

static inline __attribute__((always_inline)) void accumulate_ng(
        const int64_t NG, int64_t n, const float *rows, int64_t Dp, const float *w, int64_t R, int64_t K,
        int64_t cpk, int64_t Vn, float (*acc)[MAX_D], const uint8_t *const *code_rows, int64_t half) {
    int64_t c = 0;
    if (code_rows && half) {  /* int4 codes: tiles of low chunks and their high partners */
        for (; c + VALUE_TILE / 2 <= half; c += VALUE_TILE / 2)
            accumulate_tile(NG, VALUE_TILE, c, n, rows, Dp, w, R, K, cpk, acc, code_rows, half);
        for (; c < half; c++) accumulate_tile(NG, 2, c, n, rows, Dp, w, R, K, cpk, acc, code_rows, half);
        return;
    }
    for (; c + VALUE_TILE <= Vn; c += VALUE_TILE)
        accumulate_tile(NG, VALUE_TILE, c, n, rows, Dp, w, R, K, cpk, acc, code_rows, half);
    for (; c < Vn; c++) accumulate_tile(NG, 1, c, n, rows, Dp, w, R, K, cpk, acc, code_rows, half);
}

/* acc[g] += sum_i w[g * R + i * K + k] * x_i for the ng heads, VALUE_HEADS at a time (each sum the same whatever the
 * pass: over the rows in order, from zero, then added to acc); k a chunk's group (cpk chunks each; K = 1, cpk = Vn:
 * one weight a row). With `code_rows` the rows are codes widened in registers (code_chunk) */
static void accumulate(int64_t ng, int64_t n, const float *rows, int64_t Dp, const float *w, int64_t R, int64_t K,
                       int64_t cpk, int64_t Vn, float (*acc)[MAX_D], const uint8_t *const *code_rows, int64_t half) {
    for (int64_t g = 0; g < ng; g += VALUE_HEADS) {
        const float *wg = w + g * R;
        switch (ng - g < VALUE_HEADS ? ng - g : VALUE_HEADS) {
/* (each source its own inlined copy, and one weight a row (K 1) its own: its weight broadcast once a row) */
#define CASE(NG) \
        case NG: \
            if (code_rows && half && K == 1) accumulate_ng(NG, n, rows, Dp, wg, R, 1, cpk, Vn, acc + g, code_rows, half); \
            else if (code_rows && half) accumulate_ng(NG, n, rows, Dp, wg, R, K, cpk, Vn, acc + g, code_rows, half); \
            else if (code_rows && K == 1) accumulate_ng(NG, n, rows, Dp, wg, R, 1, cpk, Vn, acc + g, code_rows, 0); \
            else if (code_rows) accumulate_ng(NG, n, rows, Dp, wg, R, K, cpk, Vn, acc + g, code_rows, 0); \
            else if (K > 1) accumulate_ng(NG, n, rows, Dp, wg, R, K, cpk, Vn, acc + g, NULL, 0); \
            else accumulate_ng(NG, n, rows, Dp, wg, R, 1, Vn, Vn, acc + g, NULL, 0); \
            break;
            CASE(1) CASE(2) CASE(3)
#undef CASE
        }
    }
}

/* A quantized block's values x_i = codes_i * s_ik + z_ik (k the channel's group) weighed by p_gi: sum_i p_gi x_i =
 * sum_i (p_gi s_ik) codes_i + sum_i p_gi z_ik. Writes ws[g * R + i * K + k] = p_gi s_ik (accumulate's weights) and
 * adds the zeros' term to zt[g][k] (p [ng, Ns] the n rows' probabilities, s, z [n, K]). Over the rows LANES at a
 * time (their sums reduced by a tree; a chain of n scalar adds held the loop), the rest one by one */
static void fold_value_scales(int64_t ng, int64_t n, const float *restrict p, int64_t Ns, const float *restrict s,
                              const float *restrict z, int64_t K, int64_t R, float *restrict ws,
                              float (*restrict zt)[MAX_D]) {
    for (int64_t g = 0; g < ng; g++) {
        const float *pg = p + g * Ns;
        float *wg = ws + g * R;
        for (int64_t k = 0; k < K; k++) {
            vr zv = {0};
            int64_t i = 0;
            if (K == 1)
                for (; i + LANES <= n; i += LANES) {
                    vr pv, sv, zz;
                    memcpy(&pv, pg + i, sizeof pv);
                    memcpy(&sv, s + i, sizeof sv);
                    memcpy(&zz, z + i, sizeof zz);
                    const vr w = pv * sv;
                    memcpy(wg + i, &w, sizeof w);
                    zv += pv * zz;
                }
            float zs = hsum_r(zv);
            for (; i < n; i++) {
                wg[i * K + k] = pg[i] * s[i * K + k];
                zs += pg[i] * z[i * K + k];
            }
            zt[g][k] += zs;
        }
    }
}

typedef struct {
    /* sizes */
    int64_t Hkv, B, G, D, S, bs, quant_slots, float_slots, bits, groups;
    /* the float ring: float_rows rows (its bias columns), in blocks of fr rows (a pool's own blocks: fr = bs; an
     * engine's pages: the rows a page holds), float_slots blocks a sequence: ring row r is row r % fr of block
     * float_table[b, r / fr] */
    int64_t float_rows, fr;
    /* blocks of the sink, float and quantized pools: every table entry a call reads is checked against them first */
    int64_t sink_blocks, float_blocks, quant_blocks;
    /* pools [Hkv, blocks, ...], addressed through the strides `st` at the end */
    const void *sink_k, *sink_v, *float_k, *float_v, *key_scale, *key_zero, *value_scale, *value_zero;
    const uint8_t *key_codes, *value_codes;
    int64_t sink_dtype, window_dtype, scale_dtype;
    /* tables: sink [B], float [B, float_slots], quant [B, quant_slots] (int64, -1: none; checked by tables_fit) */
    const int64_t *sink_table, *float_table, *quant_table;
    const void *q;             /* [B, Hkv * G, D] of q_dtype, rows of D contiguous, tokens q_stride elements apart */
    const float *bias;         /* [B, N] float32: 0 seen, -inf not */
    const float *sink_logits;  /* [Hkv * G] float32, or NULL */
    float scale;
    void *out;                 /* [B, Hkv * G, D] contiguous, of out_dtype (rounded as torch's .to() rounds) */
    /* (head, block) strides in elements of each pool, in the order of the pointers above: sink_k, sink_v,
     * float_k, float_v, key_scale, key_zero, value_scale, value_zero, key_codes, value_codes. Within a block a
     * pool is contiguous; the blocks need not be (an engine's pages hold every tensor of a block together) */
    int64_t st[10][2];
    int64_t q_dtype, q_stride, out_dtype;
} Args;

static inline void store_scalar(void *p, int dt, int64_t i, float x);

enum { SINK_K, SINK_V, FLOAT_K, FLOAT_V, KEY_SCALE, KEY_ZERO, VALUE_SCALE, VALUE_ZERO, KEY_CODES, VALUE_CODES };
/* element offset of block `blk` of head `h` in pool `p` */
#define AT(p, h, blk) ((h) * a->st[p][0] + (blk) * a->st[p][1])

/* Ask for the bytes one unit reads (its sink rows, its quantized blocks' codes and scales, its float-ring rows), a
 * cache line at a time, so that they arrive while the unit before it computes. Between an engine's layers the
 * pages fall out of the caches (the model's weights pass through them), and a unit's reads are a dozen short
 * streams, too short for the hardware prefetcher: waiting on them cost about a third of a layer's decode. */
static inline void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) {
#if defined(__x86_64__) || defined(__i386__)  /* (gcc -O1 and up deletes a loop of __builtin_prefetch alone) */
        __asm__ volatile("prefetcht1 %0" : : "m"(*((const char *)p + i)));
#else
        __builtin_prefetch((const char *)p + i, 0, 2);
#endif
    }
}

/* quantized block j of unit u: its codes and scales */
static void prefetch_block(const Args *a, int64_t u, int64_t j) {
    const int64_t h = u / a->B, b = u % a->B, D = a->D, bs = a->bs, blk = a->quant_table[b * a->quant_slots + j];
    const int64_t Dc = a->bits == 4 ? D / 2 : D, se = elem_bytes(a->scale_dtype), groups = a->groups;
    if (blk < 0) return;
    prefetch_bytes(a->key_codes + AT(KEY_CODES, h, blk), bs * Dc);
    prefetch_bytes(a->value_codes + AT(VALUE_CODES, h, blk), bs * Dc);
    prefetch_bytes((const char *)a->key_scale + AT(KEY_SCALE, h, blk) * se, D * se);
    prefetch_bytes((const char *)a->key_zero + AT(KEY_ZERO, h, blk) * se, D * se);
    prefetch_bytes((const char *)a->value_scale + AT(VALUE_SCALE, h, blk) * se, bs * groups * se);
    prefetch_bytes((const char *)a->value_zero + AT(VALUE_ZERO, h, blk) * se, bs * groups * se);
}

/* unit u's sink rows and float-ring rows */
static void prefetch_edges(const Args *a, int64_t u) {
    const int64_t h = u / a->B, b = u % a->B, D = a->D, S = a->S;
    if (S) {
        const int64_t page = a->sink_table[b], n = S * D * elem_bytes(a->sink_dtype);
        prefetch_bytes((const char *)a->sink_k + AT(SINK_K, h, page) * elem_bytes(a->sink_dtype), n);
        prefetch_bytes((const char *)a->sink_v + AT(SINK_V, h, page) * elem_bytes(a->sink_dtype), n);
    }
    const int64_t we = elem_bytes(a->window_dtype);
    for (int64_t f = 0; f < a->float_slots; f++) {
        const int64_t blk = a->float_table[b * a->float_slots + f];
        if (blk < 0) continue;
        prefetch_bytes((const char *)a->float_k + AT(FLOAT_K, h, blk) * we, a->fr * D * we);
        prefetch_bytes((const char *)a->float_v + AT(FLOAT_V, h, blk) * we, a->fr * D * we);
    }
}

/* The seen rows among the float ring's rows [r0, r0 + m) (``bias`` their columns): how many, and for each its float
 * block in fblk[i] and its row there in idx[i], leaving out rows whose block is none. A run of block_size ring rows
 * is one segment of the sums whatever blocks hold it (the pool's own blocks of bs rows, or an engine's pages of fr
 * rows each), so both give the same bits. */
static int64_t float_seen(const Args *a, int64_t b, const float *bias, int64_t r0, int64_t m, int64_t *idx,
                          int64_t *fblk) {
    const int64_t n = seen_rows(bias, m, idx), fr = a->fr, *table = a->float_table + b * a->float_slots;
    int64_t kept = 0, slot = r0 / fr, start = slot * fr;  /* the rows ascend: one division, not two a row */
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = r0 + idx[i];
        while (r >= start + fr) slot++, start += fr;
        const int64_t blk = table[slot];
        if (blk < 0) continue;
        fblk[kept] = blk;
        idx[kept++] = r - start;
    }
    return kept;
}

/* units [u0, u1) of h * B + b. Scratch: `scores` 8 rows of Ns floats, each row 64-byte aligned (so that the
 * vectorized softmax splits every row the same way, whatever the call): row g holds head g's scores of the seen
 * rows only, packed in slot order (the sinks, the quantized ring, the float ring), so that the softmax runs over
 * what the query sees and each segment's probabilities lie together for its values; `rows` R rows of Dp floats
 * (zero past D), the seen rows of one segment (the sinks, a quantized block, a float-ring block) as float32;
 * `vs`, `vz` [R, groups] a quantized block's value scales and zeros (of its seen rows, or of all its rows when
 * every one is seen: one load); `ws` [8, bs, groups] their probabilities times the scales (fold_value_scales);
 * `idx` [R] the seen rows' offsets in the segment */
static void attend_units(const Args *a, int64_t u0, int64_t u1, float *scores, float *rows, float *vs, float *vz,
                         float *ws, int64_t *idx, int64_t *fblk, const uint8_t **crow) {
    const int64_t G = a->G, D = a->D, S = a->S, bs = a->bs, nq = a->quant_slots;
    const int64_t F = a->float_rows, N = S + nq * bs + F, Ns = (N + 15) / 16 * 16, Dc = a->bits == 4 ? D / 2 : D;
    const int64_t Vn = (D + LANES - 1) / LANES, Dp = Vn * LANES, groups = a->groups, gsz = groups ? D / groups : D;
    /* value groups of whole vectors fold their scales into the probabilities (fold_value_scales); others are
     * dequantized row by row first */
    const int in_registers = groups && gsz % LANES == 0;
    /* codes of whole vectors are widened in registers as they are used (code_chunk); others unpacked into rows. int4
     * only where one pass covers the query heads: each pass widens the codes again, and a nibble takes a mask or a
     * shift more than a byte, so with more heads than a pass holds unpacking once is as fast (docs/benchmarks.md,
     * "Decisions in the code") */
    const int bits = (int)a->bits;
    const int codes_in_registers = bits == 8 ? D % LANES == 0
                                             : bits == 4 && D % (2 * LANES) == 0 && G <= SCORE_HEADS && G <= VALUE_HEADS;
    const int64_t half = bits == 4 ? Vn / 2 : 0;  /* code_chunk's: the chunks of an int4 row's low nibbles */
    /* zeroed once: nothing below writes past D, so the padding stays 0 */
    float ALIGN qg[8][MAX_D] = {{0}}, ALIGN qs[8][MAX_D] = {{0}}, ALIGN acc[8][MAX_D], zt[8][MAX_D], ALIGN kz[MAX_D] = {0}, ks[MAX_D],
          qz[8];
    if (u0 < u1) {
        prefetch_edges(a, u0);
        for (int64_t j = 0; j < nq; j++) prefetch_block(a, u0, j);
    }
    for (int64_t u = u0; u < u1; u++) {
        const int64_t h = u / a->B, b = u % a->B;
        const float *bias = a->bias + b * N;
        /* the next unit's bytes are asked for a block at a time as this unit's keys go (all at once, the requests
         * queued up and stalled the loop that issued them) */
        const int ahead = u + 1 < u1;
        if (ahead) prefetch_edges(a, u + 1);
        for (int64_t g0 = 0; g0 < G; g0 += 8) {  /* query heads 8 at a time */
            const int64_t ng = G - g0 < 8 ? G - g0 : 8;
            for (int64_t g = 0; g < ng; g++) {
                load(a->q, (int)a->q_dtype, b * a->q_stride + (h * G + g0 + g) * D, (int)D, qg[g]);
                for (int64_t d = 0; d < D; d++) qg[g][d] *= a->scale;
            }
            float *sc = scores;  /* [ng, Ns]: the seen rows' scores, packed */
            int64_t c = 0;       /* how many so far */
            for (int64_t g = 0; g < ng; g++) {
                memset(acc[g], 0, (size_t)Dp * sizeof(float));
                memset(zt[g], 0, (size_t)(groups ? groups : 1) * sizeof(float));  /* the zeros' terms, per group */
            }
            /* keys: sinks */
            const int64_t page = S ? a->sink_table[b] : 0;
            int64_t n = seen_rows(bias, S, idx);
            for (int64_t i = 0; i < n; i++) load(a->sink_k, a->sink_dtype, AT(SINK_K, h, page) + idx[i] * D, D, rows + i * Dp);
            score_rows(ng, n, rows, Dp, qg, NULL, sc + c, Ns, Vn, NULL, 0, D);
            c += n;
            /* keys: quantized ring, the scales folded into the query once per block */
            for (int64_t j = 0; j < nq; j++) {
                if (ahead && g0 == 0) prefetch_block(a, u + 1, j);
                const int64_t blk = a->quant_table[b * nq + j];
                if (blk < 0 || !(n = seen_rows(bias + S + j * bs, bs, idx))) continue;
                load(a->key_scale, a->scale_dtype, AT(KEY_SCALE, h, blk), D, ks);
                load(a->key_zero, a->scale_dtype, AT(KEY_ZERO, h, blk), D, kz);
                for (int64_t g = 0; g < ng; g++) {
                    for (int64_t d = 0; d < D; d++) qs[g][d] = qg[g][d] * ks[d];
                    qz[g] = dot(qg[g], kz, Vn);
                }
                const uint8_t *codes = a->key_codes + AT(KEY_CODES, h, blk);
                if (codes_in_registers) {
                    for (int64_t i = 0; i < n; i++) crow[i] = codes + idx[i] * Dc;
                    score_rows(ng, n, rows, Dp, qs, qz, sc + c, Ns, Vn, crow, half, D);
                } else {
                    for (int64_t i = 0; i < n; i++) unpack(codes + idx[i] * Dc, bits, D, rows + i * Dp);
                    score_rows(ng, n, rows, Dp, qs, qz, sc + c, Ns, Vn, NULL, 0, D);
                }
                c += n;
            }
            /* keys: float ring, block_size rows at a time */
            for (int64_t r0 = 0; r0 < F; r0 += bs) {
                if (!(n = float_seen(a, b, bias + S + nq * bs + r0, r0, F - r0 < bs ? F - r0 : bs, idx, fblk)))
                    continue;
                for (int64_t i = 0; i < n; i++)
                    load(a->float_k, a->window_dtype, AT(FLOAT_K, h, fblk[i]) + idx[i] * D, D, rows + i * Dp);
                score_rows(ng, n, rows, Dp, qg, NULL, sc + c, Ns, Vn, NULL, 0, D);
                c += n;
            }
            /* softmax over the c seen scores (unnormalized; a learned sink logit adds a term with no value) */
            const int64_t cv = (c + 7) / 8 * 8;  /* whole vectors: the padding is -inf, its e^x 0 */
            float sum[8];
            for (int64_t g = 0; g < ng; g++) {
                float *x = sc + g * Ns, m = -INFINITY;
                const float sl = a->sink_logits ? a->sink_logits[h * G + g0 + g] : -INFINITY;
                for (int64_t t = c; t < cv; t++) x[t] = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < c; t++) m = x[t] > m ? x[t] : m;
                m = sl > m ? sl : m;
                if (m == -INFINITY) {  /* nothing visible (a sequence with no token): output 0 */
                    sum[g] = 0.0f;
                    continue;
                }
                v8 t = {0};
                for (int64_t v = 0; v < cv / 8; v++) {
                    V(x)[v] = exp_nonpositive(V(x)[v] - m);
                    t += V(x)[v];
                }
                sum[g] = hsum(t) + (a->sink_logits ? expf(sl - m) : 0.0f);
            }
            /* values: the same segments in the same order (each one's probabilities at sc + c), packed rows */
            c = 0;
            n = seen_rows(bias, S, idx);
            for (int64_t i = 0; i < n; i++) load(a->sink_v, a->sink_dtype, AT(SINK_V, h, page) + idx[i] * D, D, rows + i * Dp);
            accumulate(ng, n, rows, Dp, sc + c, Ns, 1, Vn, Vn, acc, NULL, 0);
            c += n;
            for (int64_t j = 0; j < nq; j++) {
                const int64_t blk = a->quant_table[b * nq + j];
                if (blk < 0 || !(n = seen_rows(bias + S + j * bs, bs, idx))) continue;
                const uint8_t *codes = a->value_codes + AT(VALUE_CODES, h, blk);
                const int whole = n == bs;  /* every row seen: idx[i] == i */
                if (whole) {
                    load(a->value_scale, a->scale_dtype, AT(VALUE_SCALE, h, blk), bs * groups, vs);
                    load(a->value_zero, a->scale_dtype, AT(VALUE_ZERO, h, blk), bs * groups, vz);
                }
                const int widen_there = in_registers && codes_in_registers;  /* the codes read where they lie */
                for (int64_t i = 0; i < n; i++) {
                    const int64_t t = idx[i];
                    float *row = rows + i * Dp, *s = vs + i * groups, *z = vz + i * groups;
                    crow[i] = codes + t * Dc;
                    if (!widen_there) unpack(crow[i], bits, D, row);
                    if (!whole) {
                        load(a->value_scale, a->scale_dtype, AT(VALUE_SCALE, h, blk) + t * groups, groups, s);
                        load(a->value_zero, a->scale_dtype, AT(VALUE_ZERO, h, blk) + t * groups, groups, z);
                    }
                    if (!in_registers)  /* the token's values, dequantized */
                        for (int64_t k = 0; k < groups; k++)
                            for (int64_t d = k * gsz; d < (k + 1) * gsz; d++) row[d] = row[d] * s[k] + z[k];
                }
                if (in_registers) {
                    fold_value_scales(ng, n, sc + c, Ns, vs, vz, groups, bs * groups, ws, zt);
                    accumulate(ng, n, rows, Dp, ws, bs * groups, groups, gsz / LANES, Vn, acc,
                               widen_there ? crow : NULL, half);
                }
                else accumulate(ng, n, rows, Dp, sc + c, Ns, 1, Vn, Vn, acc, NULL, 0);
                c += n;
            }
            for (int64_t r0 = 0; r0 < F; r0 += bs) {
                if (!(n = float_seen(a, b, bias + S + nq * bs + r0, r0, F - r0 < bs ? F - r0 : bs, idx, fblk)))
                    continue;
                for (int64_t i = 0; i < n; i++)
                    load(a->float_v, a->window_dtype, AT(FLOAT_V, h, fblk[i]) + idx[i] * D, D, rows + i * Dp);
                accumulate(ng, n, rows, Dp, sc + c, Ns, 1, Vn, Vn, acc, NULL, 0);
                c += n;
            }
            for (int64_t g = 0; g < ng; g++) {
                const int64_t at = (b * a->Hkv * G + h * G + g0 + g) * D;
                /* sum is 0 only where nothing is visible (else its max term is 1): output 0 there. A NaN sum (a score
                 * that overflowed: inf - inf) gives NaN, as the reference does: a NaN is never turned into 0 */
                const int none = sum[g] == 0.0f;
                const float inv = none ? 0.0f : 1.0f / sum[g];
                if (in_registers)  /* the quantized blocks' zeros (fold_value_scales) */
                    for (int64_t k = 0; k < groups; k++)
                        for (int64_t d = k * gsz; d < (k + 1) * gsz; d++) acc[g][d] += zt[g][k];
                for (int64_t d = 0; d < D; d++)
                    store_scalar(a->out, (int)a->out_dtype, at + d, none ? 0.0f : acc[g][d] * inv);
            }
        }
    }
}

/* Every table entry a call may read names a block of its pool or -1 (none): else QSK_PAST_POOL, before any pool is
 * touched; QSK_NO_SINK_PAGE where a row whose sinks are visible has no sink page (-1). */
static int tables_fit(const Args *a) {
    const int64_t N = a->S + a->quant_slots * a->bs + a->float_rows;
    for (int64_t b = 0; b < a->B; b++) {
        if (a->S > 0 && (a->sink_table[b] < -1 || a->sink_table[b] >= a->sink_blocks)) return QSK_PAST_POOL;
        /* a row that holds tokens sees its first sink: it must have a sink page (the sinks are read without a skip) */
        if (a->S > 0 && a->sink_table[b] < 0 && a->bias && a->bias[b * N] == 0.0f) return QSK_NO_SINK_PAGE;
        for (int64_t j = 0; j < a->float_slots; j++) {
            const int64_t blk = a->float_table[b * a->float_slots + j];
            if (blk < -1 || blk >= a->float_blocks) return QSK_PAST_POOL;
        }
        for (int64_t j = 0; j < a->quant_slots; j++) {
            const int64_t blk = a->quant_table[b * a->quant_slots + j];
            if (blk < -1 || blk >= a->quant_blocks) return QSK_PAST_POOL;
        }
    }
    return QSK_OK;
}

/* Returns QSK_OK, QSK_TOO_LARGE, QSK_NO_MEMORY, or (nothing read) QSK_PAST_POOL / QSK_NO_SINK_PAGE (tables_fit). */
int qsinkkv_decode(const Args *a, int64_t u0, int64_t u1) {
    if (a->D > MAX_D || a->D < 1 || (a->groups && a->groups > MAX_D)) return QSK_TOO_LARGE;
    const int fit = tables_fit(a);
    if (fit) return fit;
    const int64_t N = a->S + a->quant_slots * a->bs + a->float_rows, Ns = (N + 15) / 16 * 16;
    if (a->fr < 1 || a->float_slots * a->fr < a->float_rows) return QSK_TOO_LARGE;
    const int64_t Dp = (a->D + LANES - 1) / LANES * LANES, R = a->S > a->bs ? a->S : a->bs, K = a->groups > 1 ? a->groups : 1;
    const size_t rows_bytes = (size_t)(R * Dp) * sizeof(float);
    float *scores = aligned_alloc(64, (size_t)(8 * Ns) * sizeof(float));
    float *rows = aligned_alloc(64, (rows_bytes + 63) / 64 * 64);
    float *vs = malloc((size_t)(R * K) * sizeof(float)), *vz = malloc((size_t)(R * K) * sizeof(float));
    float *ws = malloc((size_t)(8 * a->bs * K) * sizeof(float));  /* fold_value_scales' weights: 8 heads x bs x K */
    int64_t *idx = malloc((size_t)R * sizeof(int64_t)), *fblk = malloc((size_t)R * sizeof(int64_t));
    const uint8_t **crow = malloc((size_t)R * sizeof(*crow));
    int code = QSK_OK;
    if (scores && rows && vs && vz && ws && idx && fblk && crow) {
        memset(rows, 0, rows_bytes);
        attend_units(a, u0, u1, scores, rows, vs, vz, ws, idx, fblk, crow);
    } else {
        code = QSK_NO_MEMORY;
    }
    free(scores);
    free(rows);
    free(vs);
    free(vz);
    free(ws);
    free(idx);
    free(fblk);
    free(crow);
    return code;
}

int64_t qsinkkv_args_size(void) { return (int64_t)sizeof(Args); }

/* ---- the row write (write.store_rows's C version): new K and V rows into their pools' blocks ---- */

/* f32 -> f16, rounded to nearest even (the FP16 library's fp16_ieee_from_fp32_value, what torch's .to() gives) */
static uint16_t float_to_half(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero, bias_f;
    uint32_t w, bias, bits;
    memcpy(&w, &f, 4);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u;
    memcpy(&bias_f, &bias, 4);
    base = bias_f + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/* f32 -> bf16, rounded to nearest even (c10::BFloat16's rule; NaN -> 0x7FC0) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n values at p (dtype dt) -> the same n values at out (dtype odt), through float32: exact into float32, rounded
 * to nearest even into bf16 / fp16, as torch's .to() converts */
static void convert(const void *p, int dt, int64_t n, void *restrict out, int odt) {
    float ALIGN tmp[MAX_D];
    if (dt == odt) {
        memcpy(out, p, (size_t)(n * elem_bytes(dt)));
        return;
    }
    float *f = odt == F32 ? (float *)out : tmp;
    load(p, dt, 0, (int)n, f);
    if (odt == BF16)
        for (int64_t d = 0; d < n; d++) ((uint16_t *)out)[d] = float_to_bf16(f[d]);
    else if (odt == F16)
        for (int64_t d = 0; d < n; d++) ((uint16_t *)out)[d] = float_to_half(f[d]);
}

typedef struct {
    int64_t n, H, D;             /* tokens written, KV heads, head_dim */
    const void *x_k, *x_v;       /* [tokens, H, D] of x_dtype: rows D apart, tokens x_stride apart */
    int64_t x_dtype, x_stride;
    void *pool_k, *pool_v;       /* [H, blocks, rows_per_block, D] of pool_dtype, each block's rows D apart */
    int64_t pool_dtype, head_stride, block_stride, rows_per_block;  /* strides in elements (the two pools alike) */
    int64_t num_blocks;          /* blocks of each pool: a table entry past them is refused */
    const int64_t *table;        /* table[seq * table_st0 + (r / rows_per_block) * table_st1]: the block */
    int64_t table_st0, table_st1;
    const int64_t *at, *seqs, *ring_rows;  /* [n]: token i is x[at[i]], goes to row ring_rows[i] of sequence seqs[i] */
    int64_t x_rows, table_rows, table_cols;  /* tokens in x, the table's rows and columns: each index is checked */
} Store;

/* Returns QSK_OK, QSK_TOO_LARGE, or (nothing written) QSK_OUT_OF_RANGE for an index outside what it indexes (a token
 * past x, a sequence or ring row past the table), QSK_NO_BLOCK where the table names no block (-1) for a row,
 * QSK_PAST_POOL where it names one past the pools. */
int qsinkkv_store_rows(const Store *s) {
    if (s->D > MAX_D || s->D < 1 || s->rows_per_block < 1) return QSK_TOO_LARGE;
    const int64_t xe = elem_bytes(s->x_dtype), pe = elem_bytes(s->pool_dtype);
    for (int64_t i = 0; i < s->n; i++)  /* every index checked before any table entry is read */
        if (s->at[i] < 0 || s->at[i] >= s->x_rows || s->seqs[i] < 0 || s->seqs[i] >= s->table_rows
            || s->ring_rows[i] < 0 || s->ring_rows[i] / s->rows_per_block >= s->table_cols) return QSK_OUT_OF_RANGE;
    for (int64_t i = 0; i < s->n; i++) {  /* every row's block checked before anything is written */
        const int64_t blk = s->table[s->seqs[i] * s->table_st0 + (s->ring_rows[i] / s->rows_per_block) * s->table_st1];
        if (blk < 0) return QSK_NO_BLOCK;
        if (blk >= s->num_blocks) return QSK_PAST_POOL;
    }
    for (int64_t i = 0; i < s->n; i++) {
        const int64_t r = s->ring_rows[i], rpb = s->rows_per_block;
        const int64_t blk = s->table[s->seqs[i] * s->table_st0 + (r / rpb) * s->table_st1];
        for (int64_t h = 0; h < s->H; h++) {
            const int64_t src = s->at[i] * s->x_stride + h * s->D, dst = h * s->head_stride + blk * s->block_stride
                                                                     + (r % rpb) * s->D;
            convert((const char *)s->x_k + src * xe, (int)s->x_dtype, s->D, (char *)s->pool_k + dst * pe,
                    (int)s->pool_dtype);
            convert((const char *)s->x_v + src * xe, (int)s->x_dtype, s->D, (char *)s->pool_v + dst * pe,
                    (int)s->pool_dtype);
        }
    }
    return QSK_OK;
}

int64_t qsinkkv_store_size(void) { return (int64_t)sizeof(Store); }

/* ---- blocks that complete in a step (write.complete_blocks's C version): quantized once, to their pages ---- */

static inline float round_to(float x, int dt) {  /* x as stored in dtype dt, back in float32 */
    float out;
    uint16_t h;
    if (dt == F32) return x;
    h = dt == BF16 ? float_to_bf16(x) : float_to_half(x);
    load(&h, dt, 0, 1, &out);
    return out;
}

static inline void store_scalar(void *p, int dt, int64_t i, float x) {
    if (dt == F32) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = dt == BF16 ? float_to_bf16(x) : float_to_half(x);
}

/* n float32 values, each replaced by itself as stored in dtype dt (round_to's answer): bf16 by the integer
 * rounding of float_to_bf16 (finite and inf inputs; a NaN becomes its 0x7FC0, as there), fp16 eight at a time by the F16C
 * instructions where the machine has them (the same rounding as float_to_half), so that the loops vectorize */
static void round_n(float *restrict x, int64_t n, int dt) {
    if (dt == F32) return;
    int64_t i = 0;
    if (dt == BF16) {
        uint32_t *u = (uint32_t *)x;
        for (; i < n; i++)
            u[i] = (u[i] & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (u[i] + 0x7FFFu + ((u[i] >> 16) & 1u)) & 0xFFFF0000u;
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; i < n; i++) x[i] = round_to(x[i], dt);
}

/* n float32 values, each already a value of dtype dt (round_n's), stored as dt at p (exact) */
static void store_n(void *restrict p, int dt, const float *restrict x, int64_t n) {
    if (dt == F32) {
        memcpy(p, x, (size_t)n * 4);
    } else if (dt == BF16) {
        const uint32_t *u = (const uint32_t *)x;
        for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i] = (uint16_t)(u[i] >> 16);
    } else {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[i] = float_to_half(x[i]);
    }
}

/* quant.py's rule, for n groups at once: scale = (max - min) / qmax and zero = min, each rounded to the scale dtype;
 * code = floor((x - zero) / scale + 0.5) clamped (scale 0: divide by 1), from the stored values (finite: the step's
 * checks refused the rest). Every loop runs along contiguous floats so that it vectorizes (min and max of finite
 * values, each scale and each code do not depend on the order): lo, hi [n] in, scale, zero, div, inv [n] out (inv:
 * 1 / div rounded, or NaN where that is not a normal float: codes8_fast's mark to divide); 0, or -1 if a stored scale
 * or zero is not finite. */
static int scale_zero_n(const float *restrict lo, const float *restrict hi, int64_t n, int qmax, int sdt,
                        float *restrict scale, float *restrict zero, float *restrict div, float *restrict inv) {
    for (int64_t i = 0; i < n; i++) {
        /* + 0: a zero is +0 whichever sign the min or max of equal zeros has (quant.py's rule) */
        scale[i] = (hi[i] - lo[i]) / (float)qmax + 0.0f;
        zero[i] = lo[i] + 0.0f;
    }
    round_n(scale, n, sdt);
    round_n(zero, n, sdt);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= !(fabsf(scale[i]) <= 3.40282347e38f) | !(fabsf(zero[i]) <= 3.40282347e38f);  /* isfinite */
        div[i] = scale[i] == 0.0f ? 1.0f : scale[i];
        const float r = 1.0f / div[i];
        inv[i] = fabsf(r) >= 1.17549435e-38f && fabsf(r) <= 3.40282347e38f ? r : NAN;
    }
    return bad ? -1 : 0;
}

/* clamp(floor(y), 0, qmax) for y = (x - zero) / div + 0.5, as floor(clamp(y, 0, qmax + 1)) capped at qmax: the
 * same code (below 0 both give 0, at or past qmax + 1 both qmax), with floor a truncation of a value >= 0 -- which
 * vectorizes, where floorf did not */
static inline uint8_t code_of(float x, float zero, float div, float qmax) {
    float y = (x - zero) / div + 0.5f;
    y = y < 0.0f ? 0.0f : y > qmax + 1.0f ? qmax + 1.0f : y;
    const int32_t q = (int32_t)y;
    return (uint8_t)(q > (int32_t)qmax ? (int32_t)qmax : q);
}

/* code_of's codes without its division (a vector division cost as much as the rest of the block's quantization),
 * 8 at a time: y = (x - zero) * inv + 0.5, inv = 1 / div rounded, lies within 2^-13 of code_of's y wherever |y| <=
 * qmax + 2 (a relative error of 2^-24 in inv, one rounding each in the product and in code_of's quotient, y < 2^9),
 * so the two floors agree unless y is within 2^-12 of an integer in [0, qmax + 1]; below 0 or past qmax + 1 by more
 * than that both clamp alike. Writes the 8 codes of x[0..8) (zero, inv: 8 lanes) and returns 1 when one is unsure
 * (such a y, ~5 values in 10^4, or a NaN: scale_zero_n's mark): the caller recomputes those codes with code_of.
 * (Intrinsics: GCC 12 would not vectorize this loop in C, a compare reduction beside the clamps.) */
#ifdef __AVX2__
#define CODE_MARGIN 2.44140625e-4f /* 2^-12 */
static inline int codes8_fast(const float *x, __m256 zero, __m256 inv, float qmax, uint8_t *out) {
    const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), zero), inv), _mm256_set1_ps(0.5f));
    /* (max_ps gives its second operand for a NaN: c 0, then f NaN, unsure) */
    const __m256 c = _mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), _mm256_set1_ps(qmax + 1.0f));
    const __m256i q = _mm256_cvttps_epi32(c);  /* floor: c >= 0 */
    const __m256 f = _mm256_sub_ps(y, _mm256_cvtepi32_ps(q));
    const __m256 sure = _mm256_or_ps(
        _mm256_and_ps(_mm256_cmp_ps(f, _mm256_set1_ps(CODE_MARGIN), _CMP_GE_OQ),
                      _mm256_cmp_ps(f, _mm256_set1_ps(1.0f - CODE_MARGIN), _CMP_LE_OQ)),
        _mm256_or_ps(_mm256_cmp_ps(y, _mm256_set1_ps(-CODE_MARGIN), _CMP_LT_OQ),
                     _mm256_cmp_ps(y, _mm256_set1_ps(qmax + 1.0f + CODE_MARGIN), _CMP_GT_OQ)));
    const __m256i code = _mm256_min_epi32(q, _mm256_set1_epi32((int)qmax));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(w, w));
    return _mm256_movemask_ps(sure) != 0xFF;
}
#endif

/* codes[i] = code_of(x[i], zero[i or 0], div[..], qmax) for i < n (`each`: zero, div, inv per element, else one
 * for all): by codes8_fast where the machine has AVX2, a run of 8 divided again where it is unsure */
static void codes_of(const float *restrict x, int64_t n, const float *restrict zero, const float *restrict div,
                     const float *restrict inv, int each, float qmax, uint8_t *restrict codes) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        const __m256 z = each ? _mm256_loadu_ps(zero + i) : _mm256_set1_ps(zero[0]);
        const __m256 r = each ? _mm256_loadu_ps(inv + i) : _mm256_set1_ps(inv[0]);
        if (codes8_fast(x + i, z, r, qmax, codes + i))
            for (int64_t t = i; t < i + 8; t++) codes[t] = code_of(x[t], zero[each ? t : 0], div[each ? t : 0], qmax);
    }
#else
    (void)inv;
#endif
    for (; i < n; i++) codes[i] = code_of(x[i], zero[each ? i : 0], div[each ? i : 0], qmax);
}

/* Keys, per channel over a block's tokens: x [bs, D] -> scale, zero [D], codes [bs, D]. */
static int quantize_keys(const float *restrict x, int64_t bs, int64_t D, int qmax, int sdt, float *restrict scale,
                         float *restrict zero, uint8_t *restrict codes) {
    float lo[MAX_D], hi[MAX_D], div[MAX_D], inv[MAX_D];
    for (int64_t d = 0; d < D; d++) lo[d] = hi[d] = x[d];
    for (int64_t t = 1; t < bs; t++)
        for (int64_t d = 0; d < D; d++) {
            const float v = x[t * D + d];
            lo[d] = v < lo[d] ? v : lo[d];
            hi[d] = v > hi[d] ? v : hi[d];
        }
    if (scale_zero_n(lo, hi, D, qmax, sdt, scale, zero, div, inv)) return -1;
    for (int64_t t = 0; t < bs; t++) codes_of(x + t * D, D, zero, div, inv, 1, (float)qmax, codes + t * D);
    return 0;
}

/* Values, per token over each group of gsz channels: x [n, gsz] (a block's [bs, D] as its n = bs * D / gsz groups,
 * each contiguous) -> scale, zero [n], codes [n, gsz]; lo, hi, div, inv: the caller's scratch [n]. */
static int quantize_values(const float *restrict x, int64_t n, int64_t gsz, int qmax, int sdt, float *restrict scale,
                           float *restrict zero, uint8_t *restrict codes, float *restrict lo, float *restrict hi,
                           float *restrict div, float *restrict inv) {
    for (int64_t e = 0; e < n; e++) {
        const float *g = x + e * gsz;
        float l = g[0], h = g[0];
        int64_t i = 1;
#ifdef __AVX__
        if (gsz % 8 == 0) {  /* eight lanes (min/max of finite values: any order), then across them: a scalar
                              * compare chain is 2 x gsz dependent steps, which the compiler cannot reorder */
            __m256 l8 = _mm256_loadu_ps(g), h8 = l8;
            for (i = 8; i < gsz; i += 8) {
                const __m256 v = _mm256_loadu_ps(g + i);
                l8 = _mm256_min_ps(v, l8);
                h8 = _mm256_max_ps(v, h8);
            }
            float ls[8], hs[8];
            _mm256_storeu_ps(ls, l8);
            _mm256_storeu_ps(hs, h8);
            for (int j = 0; j < 8; j++) {
                l = ls[j] < l ? ls[j] : l;
                h = hs[j] > h ? hs[j] : h;
            }
            i = gsz;
        }
#endif
        for (; i < gsz; i++) {
            l = g[i] < l ? g[i] : l;
            h = g[i] > h ? g[i] : h;
        }
        lo[e] = l;
        hi[e] = h;
    }
    if (scale_zero_n(lo, hi, n, qmax, sdt, scale, zero, div, inv)) return -1;
    for (int64_t e = 0; e < n; e++)
        codes_of(x + e * gsz, gsz, zero + e, div + e, inv + e, 0, (float)qmax, codes + e * gsz);
    return 0;
}

typedef struct {
    int64_t n;                   /* blocks completing */
    const void *x_k, *x_v;       /* [tokens, Hkv, D] of x_dtype (rows D apart, tokens x_stride): the new tokens */
    int64_t x_dtype, x_stride;
    const int64_t *at, *seqs, *blocks, *first_new;  /* [n]: recent block blocks[i] of sequence seqs[i] completes;
                                                     * its tokens from recent index first_new[i] on are x[at[i]] on */
    int64_t float_rows;          /* the float ring's rows (0: none; the block is the new token alone) */
    int64_t x_rows;              /* tokens in x: every token a block reads is checked against it */
} Complete;

/* Gather each completing block (its older rows from the float ring, the step's cast to the window dtype),
 * quantize keys per channel and values per token and channel group, then write codes and scales to the block's
 * page (quant_table[seq, block % quant_slots]). All blocks are quantized before any is written. Returns QSK_OK,
 * QSK_TOO_LARGE, QSK_NO_MEMORY, or (nothing written) QSK_NO_BLOCK where the table names no page (-1) for a block,
 * QSK_PAST_POOL for a table entry past its pool, QSK_OUT_OF_RANGE for an index outside what it indexes (a sequence
 * past the batch, a token past x), QSK_SCALE_OVERFLOW where a scale or zero overflows the scale dtype. */
int qsinkkv_complete_blocks(const Args *a, const Complete *c) {
    const int64_t H = a->Hkv, D = a->D, bs = a->bs, F = c->float_rows, nf = a->float_slots, nq = a->quant_slots;
    const int64_t fr = a->fr;
    const int64_t K = a->groups, gsz = K ? D / K : D, Dc = a->bits == 4 ? D / 2 : D, xe = elem_bytes(c->x_dtype);
    const int64_t we = elem_bytes(a->window_dtype), se = elem_bytes(a->scale_dtype);
    const int qmax = (1 << a->bits) - 1, sdt = (int)a->scale_dtype;
    if (D > MAX_D || D < 1 || K < 1 || nq < 1 || fr < 1) return QSK_TOO_LARGE;
    if (tables_fit(a) == QSK_PAST_POOL) return QSK_PAST_POOL;  /* (no sink is read here: a missing sink page is not
                                                                 * this call's) */
    for (int64_t i = 0; i < c->n; i++) {  /* every index inside what it indexes: the sequence, and the tokens of x the
                                           * gather below reads (rows t0.. of the block: x[at + t - fresh]) */
        const int64_t b = c->seqs[i], blk = c->blocks[i], fresh = c->first_new[i] - blk * bs;
        const int64_t t0 = F ? (fresh > 0 ? fresh : 0) : 0, first = c->at[i] + t0 - fresh, last = c->at[i] + bs - 1 - fresh;
        if (b < 0 || b >= a->B || blk < 0 || (t0 < bs && (first < 0 || last >= c->x_rows))) return QSK_OUT_OF_RANGE;
    }
    const int64_t per = H * bs * D;  /* one block, all heads: [H, bs, D] */
    float *x = malloc((size_t)(2 * per) * sizeof(float));
    uint8_t *codes = malloc((size_t)(c->n * 2 * per));
    float *ks = malloc((size_t)(c->n * H * D * 2) * sizeof(float));       /* key scale, zero [n, H, D] */
    float *vsz = malloc((size_t)(c->n * H * bs * K * 2) * sizeof(float));  /* value scale, zero [n, H, bs, K] */
    float *groups = malloc((size_t)(4 * bs * K) * sizeof(float));     /* a head's value groups: lo, hi, div, inv */
    int code = x && codes && ks && vsz && groups ? QSK_OK : QSK_NO_MEMORY;
    for (int64_t i = 0; i < c->n && !code; i++) {  /* a page or float block the tables do not give */
        const int64_t b = c->seqs[i], blk = c->blocks[i], fresh = c->first_new[i] - blk * bs;
        if (a->quant_table[b * nq + blk % nq] < 0) code = QSK_NO_BLOCK;
        for (int64_t t = 0; t < fresh && F && !code; t++)
            if (a->float_table[b * nf + ((blk * bs + t) % F) / fr] < 0) code = QSK_NO_BLOCK;
    }
    for (int64_t i = 0; i < c->n && !code; i++) {
        const int64_t b = c->seqs[i], blk = c->blocks[i], fresh = c->first_new[i] - blk * bs;
        for (int kv = 0; kv < 2; kv++) {  /* gather: [H, bs, D] float32 of the window dtype's values */
            const void *pool = kv ? a->float_v : a->float_k;
            const void *src = kv ? c->x_v : c->x_k;
            for (int64_t h = 0; h < H; h++)
                for (int64_t t = 0; t < bs; t++) {
                    float *row = x + kv * per + (h * bs + t) * D;
                    if (t >= fresh || !F) {
                        const int64_t tok = c->at[i] + t - fresh;
                        load((const char *)src + (tok * c->x_stride + h * D) * xe, (int)c->x_dtype, 0, (int)D, row);
                        if (c->x_dtype != a->window_dtype)
                            for (int64_t d = 0; d < D; d++) row[d] = round_to(row[d], (int)a->window_dtype);
                    } else {
                        const int64_t ring = (blk * bs + t) % F, fblk = a->float_table[b * nf + ring / fr];
                        const int64_t off = h * a->st[kv ? FLOAT_V : FLOAT_K][0] + fblk * a->st[kv ? FLOAT_V : FLOAT_K][1]
                                            + (ring % fr) * D;
                        load((const char *)pool + off * we, (int)a->window_dtype, 0, (int)D, row);
                    }
                }
        }
        uint8_t *kc = codes + i * 2 * per, *vc = kc + per;
        float *kscale = ks + i * H * D * 2, *kzero = kscale + H * D;
        float *vscale = vsz + i * H * bs * K * 2, *vzero = vscale + H * bs * K;
        for (int64_t h = 0; h < H && !code; h++) {
            code = quantize_keys(x + h * bs * D, bs, D, qmax, sdt, kscale + h * D, kzero + h * D, kc + h * bs * D)
                   || quantize_values(x + per + h * bs * D, bs * K, gsz, qmax, sdt, vscale + h * bs * K,
                                      vzero + h * bs * K, vc + h * bs * D, groups, groups + bs * K,
                                      groups + 2 * bs * K, groups + 3 * bs * K) ? QSK_SCALE_OVERFLOW : QSK_OK;
        }
    }
    for (int64_t i = 0; i < c->n && !code; i++) {  /* every block quantized: write them */
        const int64_t page = a->quant_table[c->seqs[i] * nq + c->blocks[i] % nq];
        const uint8_t *kc = codes + i * 2 * per, *vc = kc + per;
        const float *kscale = ks + i * H * D * 2, *kzero = kscale + H * D;
        const float *vscale = vsz + i * H * bs * K * 2, *vzero = vscale + H * bs * K;
        for (int64_t h = 0; h < H; h++) {
            for (int kv = 0; kv < 2; kv++) {  /* codes, packed: int4 byte j = channel j | channel j + D/2 << 4 */
                uint8_t *dst = (uint8_t *)(kv ? a->value_codes : a->key_codes) + AT(kv ? VALUE_CODES : KEY_CODES, h, page);
                const uint8_t *src = (kv ? vc : kc) + h * bs * D;
                for (int64_t t = 0; t < bs; t++)
                    for (int64_t j = 0; j < Dc; j++)
                        dst[t * Dc + j] = a->bits == 4 ? (uint8_t)(src[t * D + j] | src[t * D + j + D / 2] << 4)
                                                       : src[t * D + j];
            }
            store_n((char *)a->key_scale + AT(KEY_SCALE, h, page) * se, sdt, kscale + h * D, D);
            store_n((char *)a->key_zero + AT(KEY_ZERO, h, page) * se, sdt, kzero + h * D, D);
            store_n((char *)a->value_scale + AT(VALUE_SCALE, h, page) * se, sdt, vscale + h * bs * K, bs * K);
            store_n((char *)a->value_zero + AT(VALUE_ZERO, h, page) * se, sdt, vzero + h * bs * K, bs * K);
        }
    }
    free(x);
    free(codes);
    free(ks);
    free(vsz);
    free(groups);
    return code;
}

int64_t qsinkkv_complete_size(void) { return (int64_t)sizeof(Complete); }

/* ---- the value checks' reduction (checks.peaks_torch's C version): max |x| of a step's q, k, v ---- */

/* max |x| over n rows of `width` values (dtype dt, rows `stride` elements apart), as float32: exact (a value of x),
 * NaN where any is NaN. An IEEE value's magnitude orders as its bits do once the sign is cleared (inf above every
 * finite value, NaN above inf), so the max is taken on those integers: no conversion, and the loops vectorize as
 * unsigned max reductions (32 bf16/fp16 or 16 float32 lanes an instruction). */
float qsinkkv_peak(const void *x, int64_t dt, int64_t n, int64_t width, int64_t stride) {
    float out;
    if (dt == F32) {
        uint32_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t *row = (const uint32_t *)x + i * stride;
            for (int64_t d = 0; d < width; d++) {
                const uint32_t b = row[d] & 0x7FFFFFFFu;
                m = b > m ? b : m;
            }
        }
        memcpy(&out, &m, 4);
        return out;
    }
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *row = (const uint16_t *)x + i * stride;
        for (int64_t d = 0; d < width; d++) {
            const uint16_t b = row[d] & 0x7FFFu;
            m = b > m ? b : m;
        }
    }
    if (dt == BF16) {
        const uint32_t w = (uint32_t)m << 16;
        memcpy(&out, &w, 4);
        return out;
    }
    return half_to_float(m);
}

/* ---- the structs' layout, field by field: decode_c.py checks its ctypes mirror of each against these at load ---- */

typedef struct { const char *name; int64_t offset, size, kind; } Field;
/* kind: 'i' int64, 'f' float, 'a' the strides' int64[][2], 'p' any pointer (_Generic reads the declared type) */
#define KIND(x) _Generic((x), int64_t: 'i', float: 'f', int64_t(*)[2]: 'a', default: 'p')
#define FIELD(T, m) {#m, (int64_t)offsetof(T, m), (int64_t)sizeof(((T *)0)->m), KIND(((T *)0)->m)}
static const Field ARGS_FIELDS[] = {
    FIELD(Args, Hkv), FIELD(Args, B), FIELD(Args, G), FIELD(Args, D), FIELD(Args, S), FIELD(Args, bs),
    FIELD(Args, quant_slots), FIELD(Args, float_slots), FIELD(Args, bits), FIELD(Args, groups),
    FIELD(Args, float_rows), FIELD(Args, fr), FIELD(Args, sink_blocks), FIELD(Args, float_blocks),
    FIELD(Args, quant_blocks), FIELD(Args, sink_k), FIELD(Args, sink_v), FIELD(Args, float_k),
    FIELD(Args, float_v), FIELD(Args, key_scale), FIELD(Args, key_zero), FIELD(Args, value_scale),
    FIELD(Args, value_zero), FIELD(Args, key_codes), FIELD(Args, value_codes), FIELD(Args, sink_dtype),
    FIELD(Args, window_dtype), FIELD(Args, scale_dtype), FIELD(Args, sink_table), FIELD(Args, float_table),
    FIELD(Args, quant_table), FIELD(Args, q), FIELD(Args, bias), FIELD(Args, sink_logits), FIELD(Args, scale),
    FIELD(Args, out), FIELD(Args, st), FIELD(Args, q_dtype), FIELD(Args, q_stride), FIELD(Args, out_dtype)};
static const Field STORE_FIELDS[] = {
    FIELD(Store, n), FIELD(Store, H), FIELD(Store, D), FIELD(Store, x_k), FIELD(Store, x_v), FIELD(Store, x_dtype),
    FIELD(Store, x_stride), FIELD(Store, pool_k), FIELD(Store, pool_v), FIELD(Store, pool_dtype),
    FIELD(Store, head_stride), FIELD(Store, block_stride), FIELD(Store, rows_per_block), FIELD(Store, num_blocks),
    FIELD(Store, table),
    FIELD(Store, table_st0), FIELD(Store, table_st1), FIELD(Store, at), FIELD(Store, seqs), FIELD(Store, ring_rows),
    FIELD(Store, x_rows), FIELD(Store, table_rows), FIELD(Store, table_cols)};
static const Field COMPLETE_FIELDS[] = {
    FIELD(Complete, n), FIELD(Complete, x_k), FIELD(Complete, x_v), FIELD(Complete, x_dtype),
    FIELD(Complete, x_stride), FIELD(Complete, at), FIELD(Complete, seqs), FIELD(Complete, blocks),
    FIELD(Complete, first_new), FIELD(Complete, float_rows), FIELD(Complete, x_rows)};
#undef FIELD
#undef KIND

/* Field i of struct `which` (0 Args, 1 Store, 2 Complete): its name, with offset_size_kind = {offsetof, sizeof,
 * kind}; NULL past the last field (or for an unknown struct). */
const char *qsinkkv_field(int64_t which, int64_t i, int64_t *offset_size_kind) {
    static const Field *const tables[] = {ARGS_FIELDS, STORE_FIELDS, COMPLETE_FIELDS};
    static const int64_t counts[] = {sizeof ARGS_FIELDS / sizeof(Field), sizeof STORE_FIELDS / sizeof(Field),
                                     sizeof COMPLETE_FIELDS / sizeof(Field)};
    if (which < 0 || which > 2 || i < 0 || i >= counts[which]) return NULL;
    offset_size_kind[0] = tables[which][i].offset;
    offset_size_kind[1] = tables[which][i].size;
    offset_size_kind[2] = tables[which][i].kind;
    return tables[which][i].name;
}

/* The instruction set this build's vector paths use, fixed by the compiler's target (-march, QSINKKV_MARCH):
 * "avx512" (16-lane products), "avx2" (8 lanes, AVX2 widening and FMA), "avx" (8 lanes), else "scalar" (the portable
 * bodies, which the compiler may still vectorize: every other target, aarch64 included). decode_c.isa(). */
const char *qsinkkv_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#elif defined(__AVX__)
    return "avx";
#else
    return "scalar";
#endif
}

/* Status i (0, 1, ...): its name, with *value its value; NULL past the last (decode_c.py compares the table with
 * its Status when it opens the library). */
const char *qsinkkv_status(int64_t i, int64_t *value) {
#define QSK_ROW(name, v) {#name, v},
    static const struct { const char *name; int64_t value; } table[] = {QSK_STATUSES(QSK_ROW)};
    if (i < 0 || i >= (int64_t)(sizeof table / sizeof table[0])) return NULL;
    *value = table[i].value;
    return table[i].name;
}

/* ---- a whole decode step of one layer in an engine (every row one new token, past its sinks) ---- */

/* The checks (checks.values: q, k, v) and the write (the blocks that complete, then the float rows) of a decode
 * step, each only after the one before succeeded: returns (nothing written) QSK_VALUE_REFUSED when q (a->q) holds
 * NaN/inf or k, v a value |x| >= kv_bound, qsinkkv_complete_blocks' and qsinkkv_store_rows' refusals, else QSK_OK. Row b's new token
 * is token b of k, v (`floats`' x_k, x_v; `complete` reads the same). */
int qsinkkv_engine_write(const Args *a, const Complete *complete, const Store *floats, float kv_bound) {
    const int64_t B = a->B, Hkv = a->Hkv, D = a->D;
    /* (each a max |x| on the values' bits, qsinkkv_peak: NaN compares below nothing) */
    if (!(qsinkkv_peak(a->q, a->q_dtype, B, Hkv * a->G * D, a->q_stride) < INFINITY)) return QSK_VALUE_REFUSED;
    for (int kv = 0; kv < 2; kv++)
        if (!(qsinkkv_peak(kv ? floats->x_v : floats->x_k, floats->x_dtype, B, Hkv * D, floats->x_stride) < kv_bound))
            return QSK_VALUE_REFUSED;
    int code = complete->n ? qsinkkv_complete_blocks(a, complete) : QSK_OK;
    if (code) return code;
    return floats->n ? qsinkkv_store_rows(floats) : QSK_OK;
}
