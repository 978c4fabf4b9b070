/* GGUF's block types multiplied as the file stores them (llama.cpp's ggml types), read from the file's own mapping.

   Every type is read as sub-blocks of 32 values. Sub-block s of a weight row is, whatever its type, 32 small
   integers w (int8), two integer multipliers sc for its halves of 16, a float scale A, and for types with a
   minimum a float B and two integer multipliers mn: value i = A·sc[i/16]·w[i] + B·mn[i/16]. The activations are
   quantized per block of 32 as the int8 and int4 products' are (quantize_block: d = max|x| / 127, codes q), with
   each half's code sum S[h]. So a sub-block's product is, exactly,

       d · (A · D + B · M),   D = Σ_h sc[h] Σ_{i in half h} w[i] q[i],   M = Σ_h mn[h] S[h]

   with D and M integers summed in int32 (exact, in any order: any CPU's vector unit may compute them), then
   float32: t = fma(A, float(D), B·float(M)), and lane s mod 8 += d·t, fused; the 8 lanes meet in a fixed tree
   ((0+1)+(2+3))+((4+5)+(6+7)). Each operation is written, so the bits are the same on every CPU (docs/native.md).

   F16 and BF16 rows multiply the activations unquantized: lane i mod 8 += w[i]·x[i], fused, the same tree.

   Part of the core's one translation unit (core.c includes it after integer.c, before products.c). */

enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20,
    GGML_IQ4_XS = 23, GGML_BF16 = 30
};
#define BLOCK_LANES 8  /* a row's sub-block products add into 8 lanes */

/* A sub-block of a weight row as the products read it (see above). */
typedef struct {
    int8_t w[32];
    int16_t sc[2], mn[2];
    float a, b;
} SubBlock;

/* An activation block: d·q ≈ x over 32 values, S the halves' code sums. 40 bytes. */
typedef struct {
    float d;
    int16_t sum[2];
    int8_t q[32];
} QuantizedBlock;

/* The values a ggml type holds per block, and its bytes; 0 for a type the core cannot multiply. */
static int ggml_block_values(int type) {
    switch (type) {
    case GGML_F32: case GGML_F16: case GGML_BF16: return 1;
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: case GGML_IQ4_NL: return 32;
    case GGML_Q2_K: case GGML_Q3_K: case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: case GGML_IQ4_XS: return 256;
    default: return 0;
    }
}

static size_t ggml_block_bytes(int type) {
    switch (type) {
    case GGML_F32: return 4;
    case GGML_F16: case GGML_BF16: return 2;
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_IQ4_NL: return 18;
    case GGML_Q2_K: return 84;
    case GGML_Q3_K: return 110;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    case GGML_IQ4_XS: return 136;
    default: return 0;
    }
}

/* The bytes of one row of n values of a ggml type. */
static inline size_t ggml_row_bytes(int type, int n) { return (size_t)n / ggml_block_values(type) * ggml_block_bytes(type); }

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_float(h);
}

/* IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl). */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Byte vectors (GCC's and Clang's vector extensions): the unpacking below is lane-wise, so it compiles to the
   vector unit's byte operations on any target (AVX2, SSE, NEON) where a loop of bytes stayed scalar. */
#pragma GCC diagnostic ignored "-Wpsabi" /* static functions only: no ABI crosses a call the compiler cannot see */
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef uint8_t U8x32 __attribute__((vector_size(32)));
typedef int8_t I8x32 __attribute__((vector_size(32)));

static inline U8x16 load16(const uint8_t *p) {
    U8x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline U8x32 load32(const uint8_t *p) {
    U8x32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_w(int8_t *w, U8x32 v) { memcpy(w, &v, sizeof v); }

/* A 16-byte run of nibbles as 32 values: byte j's low nibble is value j, its high one value j + 16 (ggml's
   layout of Q4_0, Q4_1, Q5_x and IQ4's blocks). */
static inline U8x32 nibble_pairs(const uint8_t *qs) {
    U8x16 q = load16(qs), low = q & 15, high = q >> 4;
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                   21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Bit j of a 32-bit mask (little-endian bytes) as byte j: `value` where set, else 0. */
static inline U8x32 bits_as_bytes(const uint8_t *mask, uint8_t value) {
    U8x32 spread = {mask[0], mask[0], mask[0], mask[0], mask[0], mask[0], mask[0], mask[0],
                    mask[1], mask[1], mask[1], mask[1], mask[1], mask[1], mask[1], mask[1],
                    mask[2], mask[2], mask[2], mask[2], mask[2], mask[2], mask[2], mask[2],
                    mask[3], mask[3], mask[3], mask[3], mask[3], mask[3], mask[3], mask[3]};
    const U8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                       1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (U8x32)((spread & bit) != 0) & value;
}

/* 32 IQ4 levels of a 16-byte run of nibbles (nibble_pairs' order). */
static inline void iq4_levels(const uint8_t *qs, int8_t *w) {
    U8x32 codes = nibble_pairs(qs);
#if defined(__GNUC__) && !defined(__clang__)
    typedef int8_t I8x16 __attribute__((vector_size(16)));
    I8x16 table;
    memcpy(&table, IQ4_LEVELS, sizeof table);
    U8x16 halves[2];
    memcpy(halves, &codes, sizeof halves);
    for (int h = 0; h < 2; h++) {
        I8x16 levels = __builtin_shuffle(table, (I8x16)halves[h]);  /* a table lookup (pshufb, tbl) */
        memcpy(w + 16 * h, &levels, sizeof levels);
    }
#else
    for (int j = 0; j < 32; j++) w[j] = IQ4_LEVELS[codes[j]];
#endif
}

/* Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j from their 12 packed bytes (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63, *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K's sixteen 6-bit scales, each less 32, from their 12 packed bytes: scale k's low 4 bits are byte k mod 8's
   nibble (the low one for k < 8), its high 2 bits byte 8 + k mod 4's pair k / 4. */
static inline int q3k_scale(const uint8_t *packed, int k) {
    int low = k < 8 ? packed[k] & 15 : packed[k - 8] >> 4, high = (packed[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (low | high << 4) - 32;
}

/* Sub-block s (values 32s .. 32s + 31) of a row of type `type` starting at `row`. Inlined with a constant type
   (block_row_products), each case is that type's own code. */
static inline __attribute__((always_inline)) void sub_block(int type, const uint8_t *row, int s, SubBlock *out) {
    out->sc[0] = out->sc[1] = 1, out->mn[0] = out->mn[1] = 0, out->a = out->b = 0.0f;
    const uint8_t *block;
    switch (type) {
    case GGML_Q8_0:
        block = row + (size_t)s * 34;
        out->a = half_at(block);
        memcpy(out->w, block + 2, 32);
        return;
    case GGML_Q4_0:
        block = row + (size_t)s * 18;
        out->a = half_at(block);
        store_w(out->w, nibble_pairs(block + 2) - 8);
        return;
    case GGML_Q4_1:
        block = row + (size_t)s * 20;
        out->a = half_at(block), out->b = half_at(block + 2), out->mn[0] = out->mn[1] = 1;
        store_w(out->w, nibble_pairs(block + 4));
        return;
    case GGML_Q5_0:  /* d, qh (bit j: value j's fifth bit), qs: values 0–31 less 16 */
        block = row + (size_t)s * 22;
        out->a = half_at(block);
        store_w(out->w, (nibble_pairs(block + 6) | bits_as_bytes(block + 2, 16)) - 16);
        return;
    case GGML_Q5_1:
        block = row + (size_t)s * 24;
        out->a = half_at(block), out->b = half_at(block + 2), out->mn[0] = out->mn[1] = 1;
        store_w(out->w, nibble_pairs(block + 8) | bits_as_bytes(block + 4, 16));
        return;
    case GGML_IQ4_NL:
        block = row + (size_t)s * 18;
        out->a = half_at(block);
        iq4_levels(block + 2, out->w);
        return;
    default: break;
    }
    /* the K-quants: superblocks of 256, sub-block t of 8 in superblock s / 8 */
    int t = s % 8;
    block = row + (size_t)(s / 8) * ggml_block_bytes(type);
    switch (type) {
    case GGML_Q2_K: {  /* scales[16], qs[64], d, dmin: value 32t + l is qs[32 (t / 4) + l] >> 2 (t mod 4), 2 bits */
        const uint8_t *scales = block;
        out->a = half_at(block + 80), out->b = -half_at(block + 82);
        for (int h = 0; h < 2; h++) out->sc[h] = scales[2 * t + h] & 15, out->mn[h] = scales[2 * t + h] >> 4;
        store_w(out->w, (load32(block + 16 + 32 * (t / 4)) >> (2 * (t % 4))) & 3);
        return;
    }
    case GGML_Q3_K: {  /* hmask[32], qs[64], scales[12], d: 2 bits as Q2_K's, less 4 where hmask's bit t is clear */
        out->a = half_at(block + 108);
        for (int h = 0; h < 2; h++) out->sc[h] = (int16_t)q3k_scale(block + 96, 2 * t + h);
        U8x32 low = (load32(block + 32 + 32 * (t / 4)) >> (2 * (t % 4))) & 3;
        U8x32 clear = ((load32(block) >> t) & 1) ^ 1;
        store_w(out->w, low - (clear << 2));
        return;
    }
    case GGML_Q4_K: case GGML_Q5_K: {  /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
        int five = type == GGML_Q5_K, scale, min;
        U8x32 q = load32(block + 16 + 32 * five + 32 * (t / 2));
        scale_min_k4(t, block + 4, &scale, &min);
        out->a = half_at(block), out->b = -half_at(block + 2);
        out->sc[0] = out->sc[1] = (int16_t)scale, out->mn[0] = out->mn[1] = (int16_t)min;
        q = t % 2 ? q >> 4 : q & 15;
        if (five) q |= ((load32(block + 16) >> t) & 1) << 4;
        store_w(out->w, q);
        return;
    }
    case GGML_Q6_K: {  /* ql[128], qh[64], scales[16] (int8), d: 4 low bits from ql, 2 high from qh, less 32 */
        int half = t / 4, k = t % 4;
        U8x32 low = load32(block + 64 * half + 32 * (k % 2)), high = load32(block + 128 + 32 * half);
        out->a = half_at(block + 208);
        for (int h = 0; h < 2; h++) out->sc[h] = (int8_t)block[192 + 8 * half + 2 * k + h];
        low = k < 2 ? low & 15 : low >> 4;
        store_w(out->w, (low | ((high >> (2 * k)) & 3) << 4) - 32);
        return;
    }
    case GGML_IQ4_XS: {  /* d, scales_h (16 bits), scales_l[4], qs[128]: a 6-bit scale less 32 per sub-block */
        uint16_t high;
        memcpy(&high, block + 2, sizeof high);
        int scale = ((block[4 + t / 2] >> (4 * (t % 2))) & 15) | (((high >> (2 * t)) & 3) << 4);
        out->a = half_at(block);
        out->sc[0] = out->sc[1] = (int16_t)(scale - 32);
        iq4_levels(block + 8 + 16 * t, out->w);
        return;
    }
    default: return;
    }
}

/* D for one sub-block against one activation block: Σ_h sc[h] Σ_{i in h} w[i]·q[i], exact in int32 (|w| ≤ 128,
   |q| ≤ 127, |sc| ≤ 128: at most 2^26). AVX2 multiplies |w| (unsigned) by q given w's sign into int16 pairs (at
   most 2 × 128 × 127, no saturation), then the pairs by each half's multiplier into int32: the same integers. */
#if defined(__AVX2__)
static inline __m256i sub_block_sums(const SubBlock *w, const int8_t *q) {
    __m256i weights = _mm256_loadu_si256((const __m256i *)w->w), codes = _mm256_loadu_si256((const __m256i *)q);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(weights, weights), _mm256_sign_epi8(codes, weights));
    __m256i multipliers = _mm256_setr_m128i(_mm_set1_epi16(w->sc[0]), _mm_set1_epi16(w->sc[1]));
    return _mm256_madd_epi16(pairs, multipliers);  /* 8 int32 partial sums whose total is D */
}

/* The totals of eight vectors of partial sums, as floats, in one vector. */
static inline __m256 eight_totals(__m256i v[BLOCK_LANES]) {
    __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    a = _mm256_hadd_epi32(a, b), c = _mm256_hadd_epi32(c, d);
    __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
    return _mm256_cvtepi32_ps(sums);
}
#endif

static inline int32_t sub_block_dot(const SubBlock *w, const int8_t *q) {
    int32_t total = 0;
    for (int h = 0; h < 2; h++) {
        int32_t sum = 0;
        for (int i = 16 * h; i < 16 * h + 16; i++) sum += (int32_t)w->w[i] * q[i];
        total += w->sc[h] * sum;
    }
    return total;
}

/* The float D's of `count` ≤ 8 sub-blocks against their activation blocks (zeros past count). */
static inline void block_dots(const SubBlock *w, const QuantizedBlock *x, int count, float *out) {
#if defined(__AVX2__)
    __m256i partial[BLOCK_LANES];
    for (int k = 0; k < BLOCK_LANES; k++) partial[k] = k < count ? sub_block_sums(&w[k], x[k].q) : _mm256_setzero_si256();
    _mm256_storeu_ps(out, eight_totals(partial));
#else
    for (int k = 0; k < BLOCK_LANES; k++) out[k] = k < count ? (float)sub_block_dot(&w[k], x[k].q) : 0.0f;
#endif
}

/* A row's n activations quantized per block of 32 (quantize_block's codes and scale), each half's code sum, into
   the scratch's quantized rows (QuantizedBlock is 10 floats; quantized_floats(n) holds n / 32 of them). */
static void quantize_blocks(int n, const float *x, void *quantized) {
    QuantizedBlock *out = quantized;
    for (int b = 0; b < n / 32; b++) {
        out[b].d = quantize_block(x + 32 * b, 32, out[b].q);
        for (int h = 0; h < 2; h++) {
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) sum += out[b].q[i];
            out[b].sum[h] = (int16_t)sum;
        }
    }
}

/* The lanes' fixed tree. */
static inline float block_lanes_total(const float *lane) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* Rows r_begin .. r_end − 1 (at most BLOCK_ROWS) of quantized x against weight row o: out[r − r_begin]. Each of
   the row's chunks of 8 sub-blocks is unpacked once for all the rows. */
#define BLOCK_ROWS 64
static inline __attribute__((always_inline)) void typed_row_products(int type, const ManasLinear *linear, int o,
                                                                     const float *x, size_t stride, int r_begin,
                                                                     int r_end, float *out) {
    int blocks = linear->n_in / 32;
    const uint8_t *row = (const uint8_t *)linear->weight + (size_t)o * ggml_row_bytes(type, linear->n_in);
    float lane[BLOCK_ROWS][BLOCK_LANES];
    memset(lane, 0, (size_t)(r_end - r_begin) * sizeof lane[0]);  /* the rows used: a decode step's one */
    for (int s0 = 0; s0 < blocks; s0 += BLOCK_LANES) {
        int count = blocks - s0 < BLOCK_LANES ? blocks - s0 : BLOCK_LANES;
        SubBlock w[BLOCK_LANES];
        float a[BLOCK_LANES] = {0}, b[BLOCK_LANES] = {0};
        for (int k = 0; k < count; k++) sub_block(type, row, s0 + k, &w[k]), a[k] = w[k].a, b[k] = w[k].b;
        for (int r = r_begin; r < r_end; r++) {
            const QuantizedBlock *xs = (const QuantizedBlock *)(x + (size_t)r * stride) + s0;  /* row r: stride floats on */
            float dots[BLOCK_LANES], mins[BLOCK_LANES] = {0}, d[BLOCK_LANES] = {0};
            block_dots(w, xs, count, dots);
            for (int k = 0; k < count; k++) {
                d[k] = xs[k].d;
                mins[k] = (float)(w[k].mn[0] * xs[k].sum[0] + w[k].mn[1] * xs[k].sum[1]);
            }
            float *acc = lane[r - r_begin];
            for (int k = 0; k < BLOCK_LANES; k++) acc[k] = fmaf(d[k], fmaf(a[k], dots[k], b[k] * mins[k]), acc[k]);
        }
    }
    for (int r = r_begin; r < r_end; r++) out[r - r_begin] = block_lanes_total(lane[r - r_begin]);
}

/* typed_row_products compiled once per type. */
#define TYPED(T) case T: typed_row_products(T, linear, o, x, stride, r_begin, r_end, out); return
static void block_row_products(const ManasLinear *linear, int o, const float *x, size_t stride, int r_begin,
                               int r_end, float *out) {
    switch (linear->group) {
    TYPED(GGML_Q8_0); TYPED(GGML_Q4_0); TYPED(GGML_Q4_1); TYPED(GGML_Q5_0); TYPED(GGML_Q5_1); TYPED(GGML_IQ4_NL);
    TYPED(GGML_Q2_K); TYPED(GGML_Q3_K); TYPED(GGML_Q4_K); TYPED(GGML_Q5_K); TYPED(GGML_Q6_K); TYPED(GGML_IQ4_XS);
    default: return;
    }
}
#undef TYPED

/* A float row's value i (F16, BF16 or F32 as stored). */
static inline float stored_value(int type, const uint8_t *row, int i) {
    uint16_t h;
    if (type == GGML_F32) {
        float f;
        memcpy(&f, row + 4 * (size_t)i, sizeof f);
        return f;
    }
    memcpy(&h, row + 2 * (size_t)i, sizeof h);
    return type == GGML_F16 ? f16_to_float(h) : bf16_to_float(h);
}

/* Rows r_begin .. r_end − 1 of float x against a weight row as float32 values (lane i mod 8, fused, then the
   tree): F16, BF16 and F32 rows, and with float activations a block row's dequantized values. */
static void float_row_products(int n, const float *w, const float *x, size_t stride, int r_begin, int r_end,
                               float *out) {
    for (int r = r_begin; r < r_end; r++) {
        const float *xs = x + (size_t)r * stride;
        float lane[BLOCK_LANES] = {0};
        for (int i = 0; i < n; i += BLOCK_LANES)
            for (int k = 0; k < BLOCK_LANES && i + k < n; k++) lane[k] = fmaf(w[i + k], xs[i + k], lane[k]);
        out[r - r_begin] = block_lanes_total(lane);
    }
}

static inline int ggml_float_type(int type) { return type == GGML_F32 || type == GGML_F16 || type == GGML_BF16; }

/* Whether a ggml layer multiplies quantized activations (its blocks, unless `integer` is 0: float activations) or
   float ones (F16, BF16, F32 rows). */
static int ggml_quantized(const ManasLinear *linear, int integer) { return integer && !ggml_float_type(linear->group); }

/* Weight row o of a ggml layer as float32: A·(sc·w) + B·mn, or the stored float. */
static void ggml_dequantize_row(const ManasLinear *linear, int o, float *out) {
    int type = linear->group, n = linear->n_in;
    const uint8_t *row = (const uint8_t *)linear->weight + (size_t)o * ggml_row_bytes(type, n);
    if (ggml_float_type(type)) {
        for (int i = 0; i < n; i++) out[i] = stored_value(type, row, i);
        return;
    }
    for (int s = 0; s < n / 32; s++) {
        SubBlock w;
        sub_block(type, row, s, &w);
        for (int i = 0; i < 32; i++)
            out[32 * s + i] = fmaf(w.a, (float)(w.sc[i / 16] * w.w[i]), w.b * (float)w.mn[i / 16]);
    }
}

/* Weight tiles begin .. end − 1 of a ggml layer against all the product's rows, BLOCK_ROWS at a time; `row`: the
   thread's n_in floats for a row dequantized (float activations, float types). */
static void ggml_tiles(const Matmul *m, int begin, int end, float *row) {
    const ManasLinear *linear = m->linear;
    for (int o = begin * TILE; o < end * TILE && o < linear->n_out; o++) {
        if (!m->quantized_x) ggml_dequantize_row(linear, o, row);
        for (int r0 = 0; r0 < m->rows; r0 += BLOCK_ROWS) {
            int r1 = r0 + BLOCK_ROWS < m->rows ? r0 + BLOCK_ROWS : m->rows;
            float out[BLOCK_ROWS];
            if (m->quantized_x)
                block_row_products(linear, o, m->x, m->stride, r0, r1, out);
            else
                float_row_products(linear->n_in, row, m->x, m->stride, r0, r1, out);
            for (int r = r0; r < r1; r++) m->y[(size_t)r * m->y_stride + o] = finish(linear, o, out[r - r0]);
        }
    }
}
