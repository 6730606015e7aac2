/* Decode attention over a LayerStorage on the CPU, with the int4/int8 codes dequantized inside the
 * dot products (no float32 copy of the window): the C version of qsinkkv.decode.decode_attention_torch,
 * loaded by qsinkkv/decode_c.py. Absolute positions; one query token per sequence.
 *
 * One unit of work is (KV head h, sequence b): its G query heads attend together over the slots of
 * sequence b in slot_positions order (sinks, quantized ring, float ring), visible where bias[b, n] is
 * 0 (-inf: not seen; a block or row not seen is skipped, not read). Scores of a quantized block fold the
 * key scales into the query, once per block:  q . k_t = (q * s_blk) . codes_t + q . z_blk; a value row is
 * dequantized (codes * s + z per channel group, in float32 as the reference does) into a local row and
 * added with its probability. Every product runs over aligned local arrays in a fixed order, so a unit's
 * result does not depend on the batch it is in, nor on the thread that computes it.
 *
 * Why not PyTorch ops: the torch path writes the whole window as float32 into a buffer and reads it back
 * at every layer of every step (several passes over 4 bytes per element, ~80 ops a call); this reads each
 * code once, at 0.5 or 1 byte per element, in one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };  /* dtype codes, as decode_c.py passes them */
#define MAX_D 512
#define ALIGN __attribute__((aligned(64)))

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

/* n values of dtype `dt` at element offset `i` of `p`, as float32 into `out` */
static inline void load(const void *p, int dt, int64_t i, int n, float *restrict out) {
    if (dt == F32) {
        memcpy(out, (const float *)p + i, (size_t)n * 4);
    } else if (dt == BF16) {
        const uint16_t *src = (const uint16_t *)p + i;
        uint32_t *dst = (uint32_t *)out;
        for (int d = 0; d < n; d++) dst[d] = (uint32_t)src[d] << 16;
    } else {
        const uint16_t *src = (const uint16_t *)p + i;
        for (int d = 0; d < n; d++) out[d] = half_to_float(src[d]);
    }
}

/* codes of one token row (D channels; int4: byte j holds channel j low, channel j + D/2 high) */
static void unpack(const uint8_t *restrict c, int bits, int D, float *restrict out) {
    if (bits == 8) {
        for (int d = 0; d < D; d++) out[d] = (float)c[d];
    } else {
        int half = D / 2;
        for (int d = 0; d < half; d++) out[d] = (float)(c[d] & 15);
        for (int d = 0; d < half; d++) out[half + d] = (float)(c[d] >> 4);
    }
}

/* Rows of D floats are held as Dp = D rounded up to 8 floats, zero past D, in 8-float vectors (AVX2 with
 * -march=native on x86; two halves on 128-bit machines): every product runs over whole vectors. */
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

static inline float dot(const float *restrict a, const float *restrict b, int64_t Vn) {
    v8 s0 = {0}, s1 = {0};  /* two chains: half the latency of one */
    int64_t v = 0;
    for (; v + 1 < Vn; v += 2) {
        s0 += V(a)[v] * V(b)[v];
        s1 += V(a)[v + 1] * V(b)[v + 1];
    }
    if (v < Vn) s0 += V(a)[v] * V(b)[v];
    return hsum(s0 + s1);
}

static inline void axpy(float *restrict y, float p, const float *restrict x, int64_t Vn) {
    for (int64_t v = 0; v < Vn; v++) V(y)[v] += p * V(x)[v];
}

typedef struct {
    /* sizes */
    int64_t Hkv, B, G, D, S, bs, quant_slots, float_slots, bits, groups;
    /* pools [Hkv, blocks, ...], addressed through the strides `st` at the end */
    const void *sink_k, *sink_v, *float_k, *float_v, *key_scale, *key_zero, *value_scale, *value_zero;
    const uint8_t *key_codes, *value_codes;
    int64_t sink_dtype, window_dtype, scale_dtype;
    /* tables: sink [B], float [B, float_slots], quant [B, quant_slots] (int64, -1: none) */
    const int64_t *sink_table, *float_table, *quant_table;
    const float *q;            /* [B, Hkv * G, D] float32 */
    const float *bias;         /* [B, N] float32: 0 seen, -inf not */
    const float *sink_logits;  /* [Hkv * G] float32, or NULL */
    float scale;
    float *out;                /* [B, Hkv * G, D] float32 */
    /* (head, block) strides in elements of each pool, in the order of the pointers above: sink_k, sink_v,
     * float_k, float_v, key_scale, key_zero, value_scale, value_zero, key_codes, value_codes. Within a block a
     * pool is contiguous; the blocks need not be (an engine's pages hold every tensor of a block together) */
    int64_t st[10][2];
} Args;

enum { SINK_K, SINK_V, FLOAT_K, FLOAT_V, KEY_SCALE, KEY_ZERO, VALUE_SCALE, VALUE_ZERO, KEY_CODES, VALUE_CODES };
/* element offset of block `blk` of head `h` in pool `p` */
#define AT(p, h, blk) ((h) * a->st[p][0] + (blk) * a->st[p][1])

/* units [u0, u1) of h * B + b; `scores` holds 8 rows of N floats, each row 64-byte aligned (so that the
 * vectorized softmax splits every row the same way, whatever the call) */
static void attend_units(const Args *a, int64_t u0, int64_t u1, float *scores) {
    const int64_t G = a->G, D = a->D, S = a->S, bs = a->bs, nq = a->quant_slots, F = a->float_slots * bs;
    const int64_t N = S + nq * bs + F, Ns = (N + 15) / 16 * 16, Dc = a->bits == 4 ? D / 2 : D;
    const int64_t Vn = (D + 7) / 8, groups = a->groups, gsz = groups ? D / groups : D;
    /* zeroed once: nothing below writes past D, so the padding stays 0 */
    float ALIGN qg[8][MAX_D] = {{0}}, ALIGN qs[8][MAX_D] = {{0}}, ALIGN acc[8][MAX_D], ALIGN row[MAX_D] = {0},
        ALIGN ks[MAX_D], ALIGN kz[MAX_D], qz[8], vs[MAX_D], vz[MAX_D];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t h = u / a->B, b = u % a->B;
        const float *bias = a->bias + b * N;
        for (int64_t g0 = 0; g0 < G; g0 += 8) {  /* query heads 8 at a time */
            const int64_t ng = G - g0 < 8 ? G - g0 : 8;
            for (int64_t g = 0; g < ng; g++) {
                const float *src = a->q + (b * a->Hkv * G + h * G + g0 + g) * D;
                for (int64_t d = 0; d < D; d++) qg[g][d] = src[d] * a->scale;
            }
            float *sc = scores;  /* [ng, Ns] */
            for (int64_t i = 0; i < ng * Ns; i++) sc[i] = -INFINITY;
            for (int64_t g = 0; g < ng; g++) memset(acc[g], 0, sizeof acc[g]);
            /* keys: sinks */
            const int64_t page = S ? a->sink_table[b] : 0;
            for (int64_t s = 0; s < S; s++) {
                if (bias[s] != 0.0f) continue;
                load(a->sink_k, a->sink_dtype, AT(SINK_K, h, page) + s * D, D, row);
                for (int64_t g = 0; g < ng; g++) sc[g * Ns + s] = dot(qg[g], row, Vn);
            }
            /* keys: quantized ring, the scales folded into the query once per block */
            for (int64_t j = 0; j < nq; j++) {
                const int64_t blk = a->quant_table[b * nq + j], n0 = S + j * bs;
                int seen = 0;
                for (int64_t t = 0; t < bs && !seen; t++) seen = bias[n0 + t] == 0.0f;
                if (blk < 0 || !seen) continue;
                load(a->key_scale, a->scale_dtype, AT(KEY_SCALE, h, blk), D, ks);
                load(a->key_zero, a->scale_dtype, AT(KEY_ZERO, h, blk), D, kz);
                for (int64_t g = 0; g < ng; g++) {
                    for (int64_t d = 0; d < D; d++) qs[g][d] = qg[g][d] * ks[d];
                    float z = 0.0f;  /* (kz is not padded: a plain loop) */
                    for (int64_t d = 0; d < D; d++) z += qg[g][d] * kz[d];
                    qz[g] = z;
                }
                const uint8_t *codes = a->key_codes + AT(KEY_CODES, h, blk);
                for (int64_t t = 0; t < bs; t++) {
                    if (bias[n0 + t] != 0.0f) continue;
                    unpack(codes + t * Dc, a->bits, D, row);
                    for (int64_t g = 0; g < ng; g++) sc[g * Ns + n0 + t] = dot(qs[g], row, Vn) + qz[g];
                }
            }
            /* keys: float ring */
            for (int64_t r = 0; r < F; r++) {
                const int64_t n = S + nq * bs + r, blk = a->float_table[b * a->float_slots + r / bs];
                if (blk < 0 || bias[n] != 0.0f) continue;
                load(a->float_k, a->window_dtype, AT(FLOAT_K, h, blk) + r % bs * D, D, row);
                for (int64_t g = 0; g < ng; g++) sc[g * Ns + n] = dot(qg[g], row, Vn);
            }
            /* softmax (unnormalized; a learned sink logit adds a term with no value) */
            float sum[8];
            for (int64_t g = 0; g < ng; g++) {
                float *x = sc + g * Ns, m = -INFINITY, total = 0.0f;
                const float sl = a->sink_logits ? a->sink_logits[h * G + g0 + g] : -INFINITY;
#pragma omp simd reduction(max : m)
                for (int64_t n = 0; n < N; n++) m = x[n] > m ? x[n] : m;
                m = sl > m ? sl : m;
                if (m == -INFINITY) {  /* nothing visible (a sequence with no token): output 0 */
                    sum[g] = 0.0f;
                    continue;
                }
                v8 t = {0};  /* over whole vectors: the row's padding is -inf, its e^x 0 */
                for (int64_t v = 0; v < Ns / 8; v++) {
                    V(x)[v] = exp_nonpositive(V(x)[v] - m);
                    t += V(x)[v];
                }
                total = hsum(t);
                sum[g] = total + (a->sink_logits ? expf(sl - m) : 0.0f);
            }
            /* values */
            for (int64_t s = 0; s < S; s++) {
                if (bias[s] != 0.0f) continue;
                load(a->sink_v, a->sink_dtype, AT(SINK_V, h, page) + s * D, D, row);
                for (int64_t g = 0; g < ng; g++) axpy(acc[g], sc[g * Ns + s], row, Vn);
            }
            for (int64_t j = 0; j < nq; j++) {
                const int64_t blk = a->quant_table[b * nq + j], n0 = S + j * bs;
                if (blk < 0) continue;
                const uint8_t *codes = a->value_codes + AT(VALUE_CODES, h, blk);
                for (int64_t t = 0; t < bs; t++) {
                    if (bias[n0 + t] != 0.0f) continue;
                    unpack(codes + t * Dc, a->bits, D, row);
                    load(a->value_scale, a->scale_dtype, AT(VALUE_SCALE, h, blk) + t * groups, groups, vs);
                    load(a->value_zero, a->scale_dtype, AT(VALUE_ZERO, h, blk) + t * groups, groups, vz);
                    for (int64_t k = 0; k < groups; k++)  /* the token's values, dequantized */
                        for (int64_t d = k * gsz; d < (k + 1) * gsz; d++) row[d] = row[d] * vs[k] + vz[k];
                    for (int64_t g = 0; g < ng; g++) axpy(acc[g], sc[g * Ns + n0 + t], row, Vn);
                }
            }
            for (int64_t r = 0; r < F; r++) {
                const int64_t n = S + nq * bs + r, blk = a->float_table[b * a->float_slots + r / bs];
                if (blk < 0 || bias[n] != 0.0f) continue;
                load(a->float_v, a->window_dtype, AT(FLOAT_V, h, blk) + r % bs * D, D, row);
                for (int64_t g = 0; g < ng; g++) axpy(acc[g], sc[g * Ns + n], row, Vn);
            }
            for (int64_t g = 0; g < ng; g++) {
                float *dst = a->out + (b * a->Hkv * G + h * G + g0 + g) * D;
                const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
                for (int64_t d = 0; d < D; d++) dst[d] = sum[g] > 0.0f ? acc[g][d] * inv : 0.0f;
            }
        }
    }
}

/* Returns 0, or -1 when a size is beyond this file's fixed arrays, or -2 when out of memory. */
int qsinkkv_decode(const Args *a, int64_t u0, int64_t u1) {
    if (a->D > MAX_D || a->D < 1 || (a->groups && a->groups > MAX_D)) return -1;
    const int64_t N = a->S + a->quant_slots * a->bs + a->float_slots * a->bs, Ns = (N + 15) / 16 * 16;
    float *scores = aligned_alloc(64, (size_t)(8 * Ns) * sizeof(float));
    if (!scores) return -2;
    attend_units(a, u0, u1, scores);
    free(scores);
    return 0;
}

int64_t qsinkkv_args_size(void) { return (int64_t)sizeof(Args); }
