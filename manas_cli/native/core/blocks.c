/* GGUF's block types multiplied as the file stores them (llama.cpp's ggml types), read from the file's own mapping.

   A weight row is read in units: a block of 32 values for the types of blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
   IQ4_NL), a superblock of 256 for the K-quants and IQ4_XS. A unit is, whatever its type, small integers w (int8),
   an integer multiplier sc per 16 values, a float scale A, and for types with a minimum a float B and an integer
   multiplier mn per 16 values: value i = A·sc[i/16]·w[i] + B·mn[i/16]. The activations are quantized per unit as
   llama.cpp's q8_0 and q8_K are (d = max|x| / 127, codes q = round(x / d), quantize_block's rounding), with the
   code sum S of every 16 values. A row's product is then, unit after unit in order:

       f = d·A,   P_j = Σ_{k: sub-blocks of 32} sc[2k + j/4] · Σ_{i=4j}^{4j+3} w[32k + i]·q[32k + i]   (j < 8)
       acc_j = fma(f, float(P_j), acc_j)
       with a minimum:  g = d·B,  M_j = mn[2j]·S[2j] + mn[2j+1]·S[2j+1]  (a block of 32: M_0 alone, 0 past it)
                        acc_min_j = fma(g, float(M_j), acc_min_j)

   and the result tree(acc) + tree(acc_min), tree(a) = ((a_0 + a_1) + (a_2 + a_3)) + ((a_4 + a_5) + (a_6 + a_7)).
   P_j and M_j are integers, exact in int32 in any order of summation (|P_j| < 2^24, so float(P_j) is exact too):
   AVX2's byte products or C compute the same ones. Every float operation is written, so the bits are the same on
   every CPU (docs/native.md). This is llama.cpp's scheme: one float multiply-add per unit and lane, integers within
   it, the minimum's terms in lanes as its vector unit leaves them.

   F16 and BF16 rows multiply the activations unquantized: acc_(i mod 8) = fma(w[i], x[i], acc_(i mod 8)), the
   same tree. So do block rows with float activations (--float-activations), over their dequantized values.

   Part of the core's one translation unit (core.c includes it after products.c, whose Matmul it runs). */

enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20,
    GGML_IQ4_XS = 23, GGML_BF16 = 30
};
#define BLOCK_LANES 8  /* a row's sub-block products add into 8 lanes */
#define PREFETCH_BYTES 4096  /* how far ahead of its reads a decode step asks for a row's bytes (a hint) */

/* Byte vectors (GCC's and Clang's vector extensions): the unpacking below is lane-wise, so it compiles to the
   vector unit's byte operations on any target (AVX2, SSE, NEON) where a loop of bytes stayed scalar. */
#pragma GCC diagnostic ignored "-Wpsabi" /* static functions only: no ABI crosses a call the compiler cannot see */
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef uint8_t U8x32 __attribute__((vector_size(32)));
typedef int16_t I16x16 __attribute__((vector_size(32)));

/* Activations quantized per unit: d·q ≈ x, S the code sums of each 16 values. A block of 32 (40 bytes) for the
   types of blocks of 32, a superblock of 256 (292 bytes) for the K-quants. */
typedef struct {
    float d;
    int16_t sum[2];
    int8_t q[32];
} QuantizedBlock;

typedef struct {
    float d;
    int16_t sum[16];
    int8_t q[256];
} QuantizedSuper;

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
static inline size_t ggml_row_bytes(int type, int n) {
    return (size_t)n / ggml_block_values(type) * ggml_block_bytes(type);
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_float(h);
}

/* IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl). */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

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

/* A 16-byte run of nibbles as 32 values: byte j's low nibble is value j, its high one value j + 16 (ggml's
   layout of Q4_0, Q4_1, Q5_x and IQ4's blocks). */
static inline U8x32 nibble_pairs(const uint8_t *qs) {
    U8x16 q = load16(qs), low = q & 15, high = q >> 4;
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                   21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Bit j of a 32-bit mask (little-endian bytes) as byte j: `value` where set, else 0. */
static inline U8x32 bits_as_bytes(const uint8_t *mask, uint8_t value) {
    typedef uint32_t U32x8 __attribute__((vector_size(32)));
    uint32_t bits;
    memcpy(&bits, mask, sizeof bits);
    U8x32 four = (U8x32)((U32x8){0} + bits);  /* the 4 bytes in every 4 (a broadcast) */
    U8x32 spread = __builtin_shufflevector(four, four, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18, 18, 18, 18,
                                           18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19);  /* byte j: byte j / 8 */
    const U8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                       1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (U8x32)((spread & bit) == bit) & value;
}

/* 32 IQ4 levels of a 16-byte run of nibbles (nibble_pairs' order): a table lookup (pshufb, tbl). */
static inline U8x32 iq4_levels(const uint8_t *qs) {
    U8x32 codes = nibble_pairs(qs), levels;
#if defined(__GNUC__) && !defined(__clang__)
    U8x16 table, halves[2];
    memcpy(&table, IQ4_LEVELS, sizeof table);
    memcpy(halves, &codes, sizeof halves);
    U8x16 low = __builtin_shuffle(table, halves[0]), high = __builtin_shuffle(table, halves[1]);
    levels = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                     20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
#else
    for (int j = 0; j < 32; j++) levels[j] = (uint8_t)IQ4_LEVELS[codes[j]];
#endif
    return levels;
}

/* Q4_K's and Q5_K's eight 6-bit scales (bytes 0–7) and minimums (8–15) from their 12 packed bytes (ggml's
   get_scale_min_k4 for all eight, as 32-bit masks): sub-blocks 0–3 keep both in bytes 0–7's low 6 bits; 4–7 take
   their low 4 bits from bytes 8–11's nibbles and their high 2 from bytes 0–7's top bits. */
static inline U8x16 six_bit_pairs(const uint8_t *packed) {
    uint32_t word[3], low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    memcpy(word, packed, sizeof word);
    uint32_t both[4] = {word[0] & low6, (word[2] & low4) | (((word[0] >> 6) & low2) << 4), word[1] & low6,
                        ((word[2] >> 4) & low4) | (((word[1] >> 6) & low2) << 4)};
    U8x16 out;
    memcpy(&out, both, sizeof out);
    return out;
}

/* Q3_K's sixteen 6-bit scales, each less 32, from their 12 packed bytes: scale k's low 4 bits are byte k mod 8's
   nibble (the low one for k < 8), its high 2 bits byte 8 + k mod 4's pair k / 4. */
static inline int q3k_scale(const uint8_t *packed, int k) {
    int low = k < 8 ? packed[k] & 15 : packed[k - 8] >> 4, high = (packed[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (low | high << 4) - 32;
}

/* A unit's scales, read once per unit (a K-quant's 16 are packed in a dozen bytes): A, B, and the multipliers
   of each 16 values (2 for a block of 32, 16 for a superblock). Inlined with a constant type, each case is that
   type's own code. */
typedef struct {
    int16_t sc[16], mn[16];
    float a, b;
} UnitScales;

static inline __attribute__((always_inline)) void unit_scales(int type, const uint8_t *block, UnitScales *out) {
    for (int h = 0; h < 16; h++) out->sc[h] = 1, out->mn[h] = 0;
    out->a = out->b = 0.0f;
    switch (type) {
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q5_0: case GGML_IQ4_NL: out->a = half_at(block); return;
    case GGML_Q4_1: case GGML_Q5_1:
        out->a = half_at(block), out->b = half_at(block + 2), out->mn[0] = out->mn[1] = 1;
        return;
    case GGML_Q2_K:  /* scales[16]: each 16 values' scale (low 4 bits) and minimum (high 4); then d, dmin */
        out->a = half_at(block + 80), out->b = -half_at(block + 82);
        for (int h = 0; h < 16; h++) out->sc[h] = block[h] & 15, out->mn[h] = block[h] >> 4;
        return;
    case GGML_Q3_K:
        out->a = half_at(block + 108);
        for (int h = 0; h < 16; h++) out->sc[h] = (int16_t)q3k_scale(block + 96, h);
        return;
    case GGML_Q4_K: case GGML_Q5_K: {  /* each 32 values' scale and minimum, for both its halves */
        U8x16 both = six_bit_pairs(block + 4);
        I16x16 scales = __builtin_convertvector(
            __builtin_shufflevector(both, both, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), I16x16);
        I16x16 mins = __builtin_convertvector(
            __builtin_shufflevector(both, both, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), I16x16);
        memcpy(out->sc, &scales, sizeof scales);
        memcpy(out->mn, &mins, sizeof mins);
        out->a = half_at(block), out->b = -half_at(block + 2);
        return;
    }
    case GGML_Q6_K: {  /* scales[16], int8 */
        typedef int8_t I8x16 __attribute__((vector_size(16)));
        I8x16 scales;
        memcpy(&scales, block + 192, sizeof scales);
        I16x16 wide = __builtin_convertvector(scales, I16x16);
        memcpy(out->sc, &wide, sizeof wide);
        out->a = half_at(block + 208);
        return;
    }
    case GGML_IQ4_XS: {
        uint16_t high;
        memcpy(&high, block + 2, sizeof high);
        out->a = half_at(block);
        for (int t = 0; t < 8; t++) {
            int scale = ((block[4 + t / 2] >> (4 * (t % 2))) & 15) | (((high >> (2 * t)) & 3) << 4);
            out->sc[2 * t] = out->sc[2 * t + 1] = (int16_t)(scale - 32);
        }
        return;
    }
    default: return;
    }
}

/* The 32 values w of sub-block t of a unit (t 0 for the types of blocks of 32), as int8 bytes. */
static inline __attribute__((always_inline)) U8x32 sub_values(int type, const uint8_t *block, int t) {
    switch (type) {
    case GGML_Q8_0: return load32(block + 2);
    case GGML_Q4_0: return nibble_pairs(block + 2) - 8;
    case GGML_Q4_1: return nibble_pairs(block + 4);
    case GGML_Q5_0: return (nibble_pairs(block + 6) | bits_as_bytes(block + 2, 16)) - 16;  /* qh bit j: value j's 5th */
    case GGML_Q5_1: return nibble_pairs(block + 8) | bits_as_bytes(block + 4, 16);
    case GGML_IQ4_NL: return iq4_levels(block + 2);
    case GGML_Q2_K:  /* qs[64] from byte 16: value 32t + l is qs[32 (t / 4) + l] >> 2 (t mod 4), 2 bits */
        return (load32(block + 16 + 32 * (t / 4)) >> (2 * (t % 4))) & 3;
    case GGML_Q3_K: {  /* hmask[32], qs[64]: 2 bits as Q2_K's, less 4 where hmask's bit t is clear */
        U8x32 low = (load32(block + 32 + 32 * (t / 4)) >> (2 * (t % 4))) & 3;
        return low - ((((load32(block) >> t) & 1) ^ 1) << 2);
    }
    case GGML_Q4_K: case GGML_Q5_K: {  /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128]: nibbles, Q5_K's 5th bits */
        int five = type == GGML_Q5_K;
        U8x32 q = load32(block + 16 + 32 * five + 32 * (t / 2));
        q = t % 2 ? q >> 4 : q & 15;
        return five ? q | ((load32(block + 16) >> t) & 1) << 4 : q;
    }
    case GGML_Q6_K: {  /* ql[128], qh[64]: 4 low bits from ql, 2 high from qh, less 32 */
        int half = t / 4, k = t % 4;
        U8x32 low = load32(block + 64 * half + 32 * (k % 2)), high = load32(block + 128 + 32 * half);
        low = k < 2 ? low & 15 : low >> 4;
        return (low | ((high >> (2 * k)) & 3) << 4) - 32;
    }
    case GGML_IQ4_XS: return iq4_levels(block + 8 + 16 * t);
    default: return (U8x32){0};
    }
}

/* A unit's sub-blocks of 32 values. */
static inline __attribute__((always_inline)) int unit_blocks(int type) {
    return ggml_block_values(type) == 256 ? 8 : 1;
}

/* A weight row's unit unpacked, for a prefill's rows to share (sub-blocks: 1 or 8). */
typedef struct {
    uint8_t w[256];
    UnitScales scales;
} Unit;

static inline __attribute__((always_inline)) void unpack_unit(int type, const uint8_t *row, int u, Unit *out) {
    const uint8_t *block = row + (size_t)u * ggml_block_bytes(type);
    unit_scales(type, block, &out->scales);
    for (int k = 0; k < unit_blocks(type); k++) {
        U8x32 w = sub_values(type, block, k);
        memcpy(out->w + 32 * k, &w, sizeof w);
    }
}

/* P_j, the integer lanes of a unit against its activation codes (see the top), summed a sub-block at a time, then
   acc_j += f·P_j. AVX2 multiplies |w| (unsigned) by q given w's sign into int16 pairs (at most 2 × 128 × 127: no
   saturation), the pairs by each half's multiplier into int32 lanes of 4 values, and adds the sub-blocks' lanes:
   the integers C sums. */
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 BlockLanes;
typedef __m256i UnitSums;
static inline BlockLanes block_lanes_zero(void) { return _mm256_setzero_ps(); }
static inline UnitSums unit_sums_zero(void) { return _mm256_setzero_si256(); }
static inline UnitSums sums_add(UnitSums sums, U8x32 w, const int16_t *sc, const int8_t *q, int is_signed,
                                int one_scale) {
    __m256i weights = (__m256i)w, codes = _mm256_loadu_si256((const __m256i *)q);
    __m256i pairs = is_signed
                        ? _mm256_maddubs_epi16(_mm256_sign_epi8(weights, weights), _mm256_sign_epi8(codes, weights))
                        : _mm256_maddubs_epi16(weights, codes);  /* unsigned w ≤ 31: 2 × 31 × 127, exact */
    __m256i multipliers = one_scale ? _mm256_set1_epi16(sc[0])  /* both halves' (the types of scales per 32) */
                                    : _mm256_setr_m128i(_mm_set1_epi16(sc[0]), _mm_set1_epi16(sc[1]));
    return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, multipliers));
}
static inline BlockLanes lanes_fma(float f, UnitSums sums, BlockLanes acc) {
    return _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(sums), acc);
}
static inline void store_block_lanes(float *out, BlockLanes acc) { _mm256_storeu_ps(out, acc); }
#else
typedef struct { float lane[BLOCK_LANES]; } BlockLanes;
typedef struct { int32_t lane[BLOCK_LANES]; } UnitSums;
static inline BlockLanes block_lanes_zero(void) { return (BlockLanes){{0}}; }
static inline UnitSums unit_sums_zero(void) { return (UnitSums){{0}}; }
static inline UnitSums sums_add(UnitSums sums, U8x32 w, const int16_t *sc, const int8_t *q, int is_signed,
                                int one_scale) {
    (void)one_scale;  /* sc[1] is sc[0] then: the same sums */
    for (int j = 0; j < BLOCK_LANES; j++) {
        int32_t sum = 0;
        for (int i = 4 * j; i < 4 * j + 4; i++) sum += (is_signed ? (int32_t)(int8_t)w[i] : (int32_t)w[i]) * q[i];
        sums.lane[j] += sc[j / 4] * sum;
    }
    return sums;
}
static inline BlockLanes lanes_fma(float f, UnitSums sums, BlockLanes acc) {
    for (int j = 0; j < BLOCK_LANES; j++) acc.lane[j] = fmaf(f, (float)sums.lane[j], acc.lane[j]);
    return acc;
}
static inline void store_block_lanes(float *out, BlockLanes acc) { memcpy(out, acc.lane, sizeof acc.lane); }
#endif

/* Whether a type's values w are signed (else 0 to 31: AVX2's byte products take them as they are). */
static inline int signed_values(int type) {
    return !(type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q2_K || type == GGML_Q4_K || type == GGML_Q5_K);
}

/* Whether a type's multipliers are one per 32 values (its halves' the same): all but Q2_K, Q3_K and Q6_K. */
static inline int one_scale(int type) { return !(type == GGML_Q2_K || type == GGML_Q3_K || type == GGML_Q6_K); }

/* Unit u of a quantized activation row (a block of 32, or a superblock): its scale, codes and code sums. */
typedef struct {
    float d;
    const int8_t *q;
    const int16_t *sums;
} UnitInput;

static inline UnitInput unit_input(int blocks, const float *x, int u) {
    if (blocks == 1) {
        const QuantizedBlock *block = (const QuantizedBlock *)x + u;
        return (UnitInput){block->d, block->q, block->sum};
    }
    const QuantizedSuper *super = (const QuantizedSuper *)x + u;
    return (UnitInput){super->d, super->q, super->sum};
}

/* A row's n activations quantized per unit of `values` (32 or 256) into the scratch's quantized rows (`quantized`:
   QuantizedBlock or QuantizedSuper records). */
static void quantize_units(int n, int values, const float *x, void *quantized) {
    for (int u = 0; u < n / values; u++) {
        QuantizedBlock *block = (QuantizedBlock *)quantized + u;
        QuantizedSuper *super = (QuantizedSuper *)quantized + u;
        int8_t *q = values == 32 ? block->q : super->q;
        int16_t *sums = values == 32 ? block->sum : super->sum;
        float d = values == 32 ? quantize_values(x + u * 32, 32, 32, q) : quantize_values(x + u * 256, 256, 256, q);
        for (int h = 0; h < values / 16; h++) {
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) sum += q[i];
            sums[h] = (int16_t)sum;
        }
        if (values == 32) block->d = d;
        else super->d = d;
    }
}

/* The activation rows a ggml layer reads (a K-quant's superblocks, or blocks of 32). */
static void quantize_blocks(const ManasLinear *linear, const float *x, void *quantized) {
    quantize_units(linear->n_in, ggml_block_values(linear->group) == 256 ? 256 : 32, x, quantized);
}

/* The lanes' fixed tree. */
static inline float block_lanes_total(const float *lane) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* M_j = mn[2j]·S[2j] + mn[2j+1]·S[2j+1], a unit's halves of 16 in pairs (a block of 32 has one pair: lane 0, the
   others 0), as 8 integer lanes (|M_j| < 2^14). */
static inline __attribute__((always_inline)) UnitSums unit_minimums(int blocks, const UnitScales *scales,
                                                                    const int16_t *sums) {
#if defined(__AVX2__) && defined(__FMA__)
    if (blocks == 8)
        return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)scales->mn),
                                 _mm256_loadu_si256((const __m256i *)sums));
    return _mm256_setr_epi32(scales->mn[0] * sums[0] + scales->mn[1] * sums[1], 0, 0, 0, 0, 0, 0, 0);
#else
    UnitSums m = unit_sums_zero();
    for (int j = 0; j < blocks; j++)
        m.lane[j] = scales->mn[2 * j] * sums[2 * j] + scales->mn[2 * j + 1] * sums[2 * j + 1];
    return m;
#endif
}

/* The result of a row's lanes: the tree of acc, then the tree of acc_min added. */
static inline float row_total(BlockLanes acc, BlockLanes minimum) {
    float lane[BLOCK_LANES], least[BLOCK_LANES];
    store_block_lanes(lane, acc);
    store_block_lanes(least, minimum);
    return block_lanes_total(lane) + block_lanes_total(least);
}

/* Whether a type's values carry a minimum (B, mn). */
static inline int has_minimum(int type) {
    return type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q2_K || type == GGML_Q4_K || type == GGML_Q5_K;
}

/* The P_j of one unpacked weight unit against RT rows of x, its sub-blocks summed in turn: each sub-block's values
   and multipliers are taken into registers once for all RT rows (the same integers, whatever RT). */
#define X_TILE 4
static inline __attribute__((always_inline)) void unit_sums_rows(int type, int RT, const Unit *w, const UnitInput *in,
                                                                 UnitSums *sums) {
    UnitSums acc[X_TILE];  /* locals, not `sums`: a store there could alias w, and would reload it */
    const int8_t *q[X_TILE];
    for (int r = 0; r < RT; r++) acc[r] = unit_sums_zero(), q[r] = in[r].q;
    for (int k = 0; k < unit_blocks(type); k++) {
        U8x32 values = load32(w->w + 32 * k);
        int16_t sc[2] = {w->scales.sc[2 * k], w->scales.sc[2 * k + 1]};
        for (int r = 0; r < RT; r++)
            acc[r] = sums_add(acc[r], values, sc, q[r] + 32 * k, signed_values(type), one_scale(type));
    }
    for (int r = 0; r < RT; r++) sums[r] = acc[r];
}

/* Whether a prefill multiplies a unit's sub-blocks into X_TILE rows of x at a time (else a row at a time, all OT
   weight rows): the superblocks whose values are signed or whose multipliers are per 16, where it saved 3–23%
   (Q6_K, Q3_K, IQ4_XS, Q2_K), not Q4_K and Q5_K (5% slower) nor blocks of 32 (a sub-block each: 5–35% slower). */
static inline int x_tiled(int type) { return unit_blocks(type) == 8 && (signed_values(type) || !one_scale(type)); }

/* Weight rows o0 .. o0 + OT − 1 (OT ≤ TILE) against rows r_begin .. r_end − 1 (at most BLOCK_ROWS) of quantized
   x, `stride` floats apart: out[o][r − r_begin]. Each unit of the OT rows is unpacked once for all the rows of x
   (and for x_tiled types each sub-block multiplied into X_TILE rows while it is in a register); the lanes are
   independent chains the CPU overlaps (one row's lanes alone wait on each multiply-add in turn). Each output's
   arithmetic is its own whatever shares the call. */
#define BLOCK_ROWS 16
static inline __attribute__((always_inline)) void typed_products(int type, int OT, const ManasLinear *linear, int o0,
                                                                 const float *x, size_t stride, int r_begin,
                                                                 int r_end, float out[TILE][BLOCK_ROWS]) {
    int units = linear->n_in / ggml_block_values(type), rows = r_end - r_begin;
    int blocks = unit_blocks(type), RT = 1;
    size_t row_bytes = ggml_row_bytes(type, linear->n_in);
    BlockLanes lanes[TILE][BLOCK_ROWS];
    BlockLanes minimum[TILE][BLOCK_ROWS];
    for (int o = 0; o < OT; o++)
        for (int r = 0; r < rows; r++) lanes[o][r] = minimum[o][r] = block_lanes_zero();
    for (int u = 0; u < units; u++) {
        Unit w[TILE];
        UnitInput in[BLOCK_ROWS];
        for (int o = 0; o < OT; o++)
            unpack_unit(type, (const uint8_t *)linear->weight + (size_t)(o0 + o) * row_bytes, u, &w[o]);
        for (int r0 = 0; r0 < rows; r0 += RT) {
            RT = rows - r0 < X_TILE || !x_tiled(type) ? 1 : X_TILE;
            for (int r = r0; r < r0 + RT; r++) in[r] = unit_input(blocks, x + (size_t)(r_begin + r) * stride, u);
            for (int o = 0; o < OT; o++) {
                UnitSums p[X_TILE];
                if (RT == X_TILE) unit_sums_rows(type, X_TILE, &w[o], in + r0, p);  /* constant RT: in registers */
                else unit_sums_rows(type, 1, &w[o], in + r0, p);
                for (int r = r0; r < r0 + RT; r++) {
                    lanes[o][r] = lanes_fma(in[r].d * w[o].scales.a, p[r - r0], lanes[o][r]);
                    if (has_minimum(type))
                        minimum[o][r] = lanes_fma(in[r].d * w[o].scales.b,
                                                  unit_minimums(blocks, &w[o].scales, in[r].sums), minimum[o][r]);
                }
            }
        }
    }
    for (int o = 0; o < OT; o++)
        for (int r = 0; r < rows; r++) out[o][r] = row_total(lanes[o][r], minimum[o][r]);
}

/* Weight row o against one row of quantized x (a decode step): typed_products' arithmetic, each sub-block
   multiplied as it is unpacked, in registers. */
static inline __attribute__((always_inline)) float typed_product(int type, const ManasLinear *linear, int o,
                                                                 const float *x) {
    int units = linear->n_in / ggml_block_values(type), blocks = unit_blocks(type);
    const uint8_t *row = (const uint8_t *)linear->weight + (size_t)o * ggml_row_bytes(type, linear->n_in);
    BlockLanes lanes = block_lanes_zero();
    BlockLanes minimum = block_lanes_zero();
    for (int u = 0; u < units; u++) {
        for (size_t line = 0; line < ggml_block_bytes(type); line += 64)  /* a superblock spans up to 4 lines */
            __builtin_prefetch(row + (size_t)u * ggml_block_bytes(type) + PREFETCH_BYTES + line);
        UnitInput in = unit_input(blocks, x, u);
        const uint8_t *block = row + (size_t)u * ggml_block_bytes(type);
        UnitScales scales;
        unit_scales(type, block, &scales);
        UnitSums p = unit_sums_zero();
        for (int k = 0; k < blocks; k++)
            p = sums_add(p, sub_values(type, block, k), scales.sc + 2 * k, in.q + 32 * k, signed_values(type),
                         one_scale(type));
        lanes = lanes_fma(in.d * scales.a, p, lanes);
        if (has_minimum(type)) minimum = lanes_fma(in.d * scales.b, unit_minimums(blocks, &scales, in.sums), minimum);
    }
    return row_total(lanes, minimum);
}

/* typed_products compiled once per type: a whole tile of rows, one row (a tile's last, short), and each for one row
   of x or several. */
static inline __attribute__((always_inline)) void typed_tile(int type, const ManasLinear *linear, int o0, int count,
                                                             const float *x, size_t stride, int r_begin, int r_end,
                                                             float out[TILE][BLOCK_ROWS]) {
    int one = r_end - r_begin == 1;
    if (one)
        for (int o = 0; o < count; o++) out[o][0] = typed_product(type, linear, o0 + o, x + (size_t)r_begin * stride);
    else if (count == TILE) typed_products(type, TILE, linear, o0, x, stride, r_begin, r_end, out);
    else
        for (int o = 0; o < count; o++) typed_products(type, 1, linear, o0 + o, x, stride, r_begin, r_end, out + o);
}

#define TYPED(T) case T: typed_tile(T, linear, o0, count, x, stride, r_begin, r_end, out); return
static void block_products(const ManasLinear *linear, int o0, int count, const float *x, size_t stride, int r_begin,
                           int r_end, float out[TILE][BLOCK_ROWS]) {
    switch (linear->group) {
    TYPED(GGML_Q8_0); TYPED(GGML_Q4_0); TYPED(GGML_Q4_1); TYPED(GGML_Q5_0); TYPED(GGML_Q5_1); TYPED(GGML_IQ4_NL);
    TYPED(GGML_Q2_K); TYPED(GGML_Q3_K); TYPED(GGML_Q4_K); TYPED(GGML_Q5_K); TYPED(GGML_Q6_K); TYPED(GGML_IQ4_XS);
    default: return;
    }
}
#undef TYPED

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

/* Weight row o of a ggml layer as float32: A·(sc·w) + B·mn, or the stored float. */
static void ggml_dequantize_row(const ManasLinear *linear, int o, float *out) {
    int type = linear->group, n = linear->n_in;
    const uint8_t *row = (const uint8_t *)linear->weight + (size_t)o * ggml_row_bytes(type, n);
    if (ggml_float_type(type)) {
        for (int i = 0; i < n; i++) out[i] = stored_value(type, row, i);
        return;
    }
    for (int u = 0; u < n / ggml_block_values(type); u++) {
        Unit w;
        unpack_unit(type, row, u, &w);
        for (int i = 0; i < ggml_block_values(type); i++) {
            int h = i / 16, value = w.scales.sc[h] * (int8_t)w.w[i];
            out[u * ggml_block_values(type) + i] = fmaf(w.scales.a, (float)value, w.scales.b * (float)w.scales.mn[h]);
        }
    }
}

/* Weight tiles begin .. end − 1 of a ggml layer against all the product's rows, BLOCK_ROWS at a time; `row`: the
   thread's n_in floats for a row dequantized (float activations, float types). */
static void ggml_tiles(const Matmul *m, int begin, int end, float *row) {
    const ManasLinear *linear = m->linear;
    for (int tile = begin; tile < end; tile++) {
        int o0 = tile * TILE, count = linear->n_out - o0 < TILE ? linear->n_out - o0 : TILE;
        for (int r0 = 0; r0 < m->rows; r0 += BLOCK_ROWS) {
            int r1 = r0 + BLOCK_ROWS < m->rows ? r0 + BLOCK_ROWS : m->rows;
            float out[TILE][BLOCK_ROWS];
            if (m->quantized_x) {
                block_products(linear, o0, count, m->x, m->stride, r0, r1, out);
            } else {
                for (int o = 0; o < count; o++) {
                    ggml_dequantize_row(linear, o0 + o, row);
                    float_row_products(linear->n_in, row, m->x, m->stride, r0, r1, out[o]);
                }
            }
            for (int o = 0; o < count; o++)
                for (int r = r0; r < r1; r++)
                    m->y[(size_t)r * m->y_stride + o0 + o] = finish(linear, o0 + o, out[o][r - r0]);
        }
    }
}
