/* The integer products of int8 and int4 weights: activations quantized per block of 32 (as llama.cpp's q8_0
   does), weights made unsigned by an offset, four-byte dot products in int32 (VNNI's, or AVX2's pairs), each
   group's sum exact before its scales turn it into a float in the lanes' order.

   Part of the core's one translation unit (core.c includes it after lanes.c, whose vectors it uses). */

/* The integer products of a group of QGROUP values (two blocks of QBLOCK): 64 unsigned weight bytes u (Bytes)
   against 64 int8 activation codes q. Lane l is correction[l] + Σ_k u[4l+k]·q[4l+k], k < 4, exact in int32, as a
   float (exact too): lanes 0–7 the first block's, 8–15 the second's. The weights are made unsigned by an offset
   (int8: w + 128, w xor 0x80; int4: the code, 0–15, stands for code − 8), and the row's correction,
   −offset·Σ q over the lane's four (quantize_row's), takes it back out: the lane is Σ q·(u − offset), exactly.
   AVX-512 VNNI computes it in one instruction (a 4-byte dot per lane, starting from the correction); AVX2
   multiplies u − offset itself (below); elsewhere C sums the four. */
#define QGROUP 64
#define PREFETCH_TILES 2  /* how many tiles of weight rows ahead integer_dots asks for */
typedef uint8_t BytePart __attribute__((vector_size(QGROUP / PARTS)));
typedef struct { BytePart part[PARTS]; } Bytes;  /* as Lanes: the CPU's own vectors */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline Lanes group_products(Bytes u, int offset, const int8_t *q, const int32_t *correction) {
    (void)offset;
    __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(correction), (__m512i)u.part[0], _mm512_loadu_si512(q));
    return (Lanes){{(Part)_mm512_cvtepi32_ps(sums)}};
}
#elif defined(__AVX2__)
/* AVX2 has no 4-byte dot. Its byte product (maddubs) multiplies unsigned by signed bytes into int16 pairs that
   saturate: int4's codes (u ≤ 15) multiply as they are, the pairs summed into fours (madd against ones) and the
   correction added, as above; int8's offset weights would overflow (2 × 255 × 127), so there the signed weight
   w = u − offset is multiplied instead, |w| against q given w's sign (at most 2 × 128 × 127 = 32,512, exact),
   which is Σ q·w itself, no correction needed. The same integers either way. */
static inline Lanes group_products(Bytes u, int offset, const int8_t *q, const int32_t *correction) {
    __m256i bytes[2];
    __m256 sums[2];
#if PARTS == 1  /* AVX-512 without VNNI: the group's halves of one register */
    bytes[0] = _mm512_castsi512_si256((__m512i)u.part[0]), bytes[1] = _mm512_extracti64x4_epi64((__m512i)u.part[0], 1);
#else
    bytes[0] = (__m256i)u.part[0], bytes[1] = (__m256i)u.part[1];
#endif
    for (int h = 0; h < 2; h++) {
        __m256i codes = _mm256_loadu_si256((const __m256i *)(q + 32 * h)), pairs;
        if (offset < 128) {  /* int4: u ≤ 15, so u against q is exact (2 × 15 × 127), and the correction goes on */
            pairs = _mm256_maddubs_epi16(bytes[h], codes);
        } else {
            __m256i w = _mm256_sub_epi8(bytes[h], _mm256_set1_epi8((char)offset));
            pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(codes, w));
        }
        __m256i fours = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        if (offset < 128) fours = _mm256_add_epi32(fours, _mm256_loadu_si256((const __m256i *)(correction + 8 * h)));
        sums[h] = _mm256_cvtepi32_ps(fours);
    }
#if PARTS == 1
    return (Lanes){{(Part)_mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)sums[0]), (__m256d)sums[1], 1)}};
#else
    return (Lanes){{(Part)sums[0], (Part)sums[1]}};
#endif
}
#else
static inline Lanes group_products(Bytes u, int offset, const int8_t *q, const int32_t *correction) {
    (void)offset;
    uint8_t bytes[QGROUP];
    memcpy(bytes, &u, sizeof bytes);
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) {
        int32_t sum = correction[l];
        for (int k = 0; k < 4; k++) sum += (int32_t)bytes[4 * l + k] * q[4 * l + k];
        lanes[l] = (float)sum;
    }
    return load_lanes(lanes);
}
#endif

/* int8 weights as group_products' unsigned bytes: w + 128. */
static inline Bytes int8_bytes(const int8_t *w) {
    Bytes u;
    for (int p = 0; p < PARTS; p++) {
        memcpy(&u.part[p], w + p * sizeof u.part[p], sizeof u.part[p]);  /* part by part: as load_lanes */
        u.part[p] ^= 0x80;
    }
    return u;
}

/* A group of 64 int4 columns (two INT4_BLOCKs, 32 bytes) as group_products' unsigned bytes: each block's low
   nibbles (its even columns), then its high nibbles (its odd columns), the order int4_input gives x in. */
static inline Bytes int4_bytes(const uint8_t *w) {
#if defined(__AVX512F__)
    /* [b0 b1] → [b0 b0 b1 b1] by 128-bit quarters, the second copy of each shifted by a nibble, then masked */
    __m512i both = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)w)));
    both = _mm512_srlv_epi64(both, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return (Bytes){{(BytePart)_mm512_and_si512(both, _mm512_set1_epi8(15))}};
#elif defined(__AVX2__)
    /* [b0 | b1] by 128-bit halves: their low nibbles, their high nibbles, then each block's two side by side */
    __m256i bytes = _mm256_loadu_si256((const __m256i *)w), mask = _mm256_set1_epi8(15);
    __m256i low = _mm256_and_si256(bytes, mask), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    return (Bytes){{(BytePart)_mm256_permute2x128_si256(low, high, 0x20),
                    (BytePart)_mm256_permute2x128_si256(low, high, 0x31)}};
#else
    uint8_t bytes[QGROUP];
    for (int b = 0; b < 2; b++)
        for (int j = 0; j < INT4_BLOCK / 2; j++) {
            bytes[32 * b + j] = w[16 * b + j] & 15;
            bytes[32 * b + 16 + j] = w[16 * b + j] >> 4;
        }
    Bytes u;
    memcpy(&u, bytes, sizeof u);
    return u;
#endif
}

/* A row's last, partial group of int8 products (count < QGROUP values), in C, reading no weight past the row. */
static inline Lanes partial_group_products(const int8_t *q, const int8_t *w, int count) {
    float lanes[LANES] = {0};
    for (int l = 0; 4 * l < count; l++) {
        int32_t sum = 0;
        for (int k = 0; k < 4 && 4 * l + k < count; k++) sum += (int32_t)q[4 * l + k] * w[4 * l + k];
        lanes[l] = (float)sum;
    }
    return load_lanes(lanes);
}

/* A row of n activations quantized for the integer products, as quantize_row lays it out in the scratch: per
   group of QGROUP values, its lanes' scales d (16 floats: the first block's 8 times, then the second's), its codes
   (QGROUP int8, zero past n) and its lanes' corrections (16 int32); after the groups, each block's d·Σ q (int4's
   zeros multiply them: zero_terms), zeros to a whole number of lanes. The floats one group takes, the block sums'
   count, and a row's length in floats. */
#define QUANTIZED_SPAN (LANES + QGROUP / 4 + LANES)
static inline size_t block_sum_floats(int n) { return ((size_t)n + QBLOCK * LANES - 1) / (QBLOCK * LANES) * LANES; }
static inline size_t quantized_floats(int n) {
    return ((size_t)n + QGROUP - 1) / QGROUP * QUANTIZED_SPAN + block_sum_floats(n);
}

/* Where a quantized row's block sums begin. */
static inline float *block_sums(const float *row, int n) {
    return (float *)row + ((size_t)n + QGROUP - 1) / QGROUP * QUANTIZED_SPAN;
}

/* A block of `size` values (QBLOCK; a GGUF superblock's 256), `count` of them x's (the rest zeros), quantized:
   codes q = round(x · 127 / max|x|) in [−127, 127], and its scale d = max|x| / 127 returned, d·q ≈ x. Written in
   loops of fixed length with no early exit, so they vectorize (a max and a rounding are exact in any order). A NaN
   or an infinity leaves the codes 0 and the scale NaN or infinite, so the product is not finite and the logits'
   check still catches it. */
static inline __attribute__((always_inline)) float quantize_values(const float *x, int count, int size,
                                                                   int8_t *codes) {
    float block[256], largest = 0.0f;  /* size ≤ 256: a GGUF superblock's (core/blocks.c) */
    memcpy(block, x, (size_t)count * sizeof *block);
    memset(block + count, 0, (size_t)(size - count) * sizeof *block);
    int not_a_number = 0;
    for (int j = 0; j < size; j++) {
        float a = fabsf(block[j]);
        largest = a > largest ? a : largest;
        not_a_number |= a != a;
    }
    largest = not_a_number ? NAN : largest;
    float inverse = largest > 0.0f && largest <= FLT_MAX ? 127.0f / largest : 0.0f;
    for (int j = 0; j < size; j++) codes[j] = (int8_t)nearbyintf(inverse > 0.0f ? block[j] * inverse : 0.0f);
    return largest / 127.0f;
}

static float quantize_block(const float *x, int count, int8_t *codes) {
    return quantize_values(x, count, QBLOCK, codes);
}

/* x (n values) quantized per block of QBLOCK (quantize_block), each lane's correction −offset·Σ q
   (group_products) and each block's d·Σ q, laid out as QUANTIZED_SPAN describes. */
static void quantize_row(int n, const float *x, int offset, float *out) {
    int groups = (n + QGROUP - 1) / QGROUP;
    float *sums = block_sums(out, n);
    memset(sums, 0, block_sum_floats(n) * sizeof *sums);
    for (int g = 0; g < groups; g++) {
        float *scales = out + (size_t)g * QUANTIZED_SPAN;
        int8_t *codes = (int8_t *)(scales + LANES);
        int32_t *correction = (int32_t *)(scales + LANES + QGROUP / 4);
        for (int half = 0; half < 2; half++) {
            int first = g * QGROUP + half * QBLOCK, count = n - first < 0 ? 0 : n - first < QBLOCK ? n - first : QBLOCK;
            float d = quantize_block(x + (count ? first : 0), count, codes + half * QBLOCK);
            for (int l = 0; l < LANES / 2; l++) scales[half * LANES / 2 + l] = d;
            int32_t sum = 0;
            for (int j = 0; j < QBLOCK; j++) sum += codes[half * QBLOCK + j];
            sums[2 * g + half] = d * (float)sum;  /* a block past n: 0 (d is 0) */
        }
        for (int l = 0; l < LANES; l++)
            correction[l] = -offset * (codes[4 * l] + codes[4 * l + 1] + codes[4 * l + 2] + codes[4 * l + 3]);
    }
}

/* Lanes 0–7 a, lanes 8–15 b: a weight group's scale (or zero) for each block of a group. */
static inline Lanes halves(float a, float b) {
#if defined(__AVX512F__)
    return (Lanes){{(Part)_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b))}};
#else
    Lanes lanes;
    for (int p = 0; p < PARTS; p++) lanes.part[p] = (Part){0} + (p < PARTS / 2 ? a : b);
    return lanes;
#endif
}

/* An int4 integer product reads a tile's zeros and scales (bfloat16s): the zeros first, (TILE rows, n_in / QBLOCK),
   a row's zeros one a block, for zero_terms at the tile's start; then the scales as (n_in / QGROUP groups, TILE
   rows, 2), each group's first block's then its second's, for the group loop. Tile after tile, that is one stream
   in the order a product reads it (zeros after the scales, a decode step of n_in 3072 lost 10%: each tile's
   first reads jumped ahead of the stream). A layer with panels holds them so from load (manas_pack); else
   int4_groups lays out each tile's. */
#define GROUP_SCALES 2
static inline size_t tile_zeros_count(int n_in) { return TILE * (size_t)n_in / QBLOCK; }
static inline size_t tile_scales_count(int n_in) {
    return tile_zeros_count(n_in) + (size_t)n_in / QGROUP * TILE * GROUP_SCALES;
}

/* The scales and zeros of int4 weight rows o0 .. o0 + count − 1 (zeros past n_out) as integer_dots reads them. */
static void int4_groups(const ManasLinear *linear, int o0, int count, uint16_t *out) {
    size_t row_groups = (size_t)(linear->n_in / linear->group), blocks = (size_t)linear->n_in / QBLOCK;
    uint16_t *zeros = out, *scales = out + tile_zeros_count(linear->n_in);
    memset(out, 0, tile_scales_count(linear->n_in) * sizeof *out);
    for (size_t k = 0; k < (size_t)count; k++)
        for (size_t b = 0; b < blocks; b++) {
            size_t at = (size_t)(o0 + k) * row_groups + b * QBLOCK / linear->group;
            scales[(b / 2 * TILE + k) * GROUP_SCALES + b % 2] = linear->scales[at];
            zeros[k * blocks + b] = linear->zeros[at];
        }
}

/* A group's two blocks' scales (int4_groups' pair of bfloat16s) as lanes: 0–7 the first block's, 8–15 the
   second's. AVX-512 places each bfloat16 in its lanes' high halves with one permutation (the low halves zeroed:
   exactly the float32 bf16_to_float gives). */
static inline Lanes group_scales(const uint16_t *pair) {
#if defined(__AVX512BW__)
    int32_t both;
    memcpy(&both, pair, sizeof both);
    __m512i two = _mm512_castsi128_si512(_mm_cvtsi32_si128(both));
    __m512i which = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16,
                                      1 << 16, 1 << 16);
    return (Lanes){{(Part)_mm512_maskz_permutexvar_epi16(0xAAAAAAAA, which, two)}};
#else
    return halves(bf16_to_float(pair[0]), bf16_to_float(pair[1]));
#endif
}

/* count ≤ LANES bfloat16s as float32 lanes, bf16_to_float's values, zeros past count (none read there). */
static inline Lanes bf16_lanes(const uint16_t *p, int count) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1), p));
    return (Lanes){{(Part)_mm512_slli_epi32(wide, 16)}};
#else
    float values[LANES];
    for (int l = 0; l < LANES; l++) values[l] = l < count ? bf16_to_float(p[l]) : 0.0f;
    return load_lanes(values);
#endif
}

/* An int4 tile's zeros' part of its sums, the lanes it starts from: a group's values are (code − 8)·scale + zero,
   so each block adds zero × d·Σ q (quantize_row's block sums, zeros past the row's blocks), 16 blocks to a set of
   lanes: n_in / 512 products where in the group loop they took one a group of 64 columns. */
static inline __attribute__((always_inline)) void zero_terms(int RT, int OT, int n_in, const float *const *x,
                                                             const uint16_t *zeros, Lanes lane[MAX_ROW_TILE][TILE]) {
    int blocks = n_in / QBLOCK;
    for (int b = 0; b < blocks; b += LANES)
#pragma GCC unroll 8
        for (int o = 0; o < OT; o++) {
            Lanes zero = bf16_lanes(zeros + (size_t)o * blocks + b, blocks - b < LANES ? blocks - b : LANES);
#pragma GCC unroll 8
            for (int r = 0; r < RT; r++) lane[r][o] = madd(lane[r][o], zero, load_lanes(block_sums(x[r], n_in) + b));
        }
}

/* Group g of a tile's integer products added to its lanes: whole (count 0), or an int8 row's last, partial group
   of count < QGROUP columns (int4 takes whole groups). `prefetch`, `far`: how far ahead to ask for the rows (into
   L1, into L2), or 0; `scales`: int4's (int4_groups). The tile's weight rows are unpacked first, then each row of
   x meets them all, so one row of x is live at a time: taken the other way round, GCC held all four rows of x and
   spilled a 4 × 4 tile's lanes every group (GPT-2-shape int8 pp64 on AVX-512 +8% on 1 thread, +2% on 2). Every
   loop over the tile is unrolled by force: where GCC left one a loop, the tile's lanes lived in memory, each
   multiply-add between a load and a store (GPT-2-shape pp64 on an AVX-512 host, with int4's zeros apart: int4
   +32%, int8 +21%). */
static inline __attribute__((always_inline)) void group_dots(int kind, int RT, int OT, const Row *rows,
                                                             const float *const *x, size_t g, int count,
                                                             size_t prefetch, size_t far, const uint16_t *scales,
                                                             Lanes lane[MAX_ROW_TILE][TILE]) {
    int int4 = kind == INT4_INTEGER;
    const int8_t *w[TILE];
    Bytes u[TILE];
    Lanes scale[TILE];
#pragma GCC unroll 8
    for (int o = 0; o < OT; o++) {
        w[o] = (const int8_t *)row_byte(rows[o], int4 ? g * QGROUP / 2 : g * QGROUP);
        if (prefetch) __builtin_prefetch(w[o] + prefetch);  /* that row, as far along */
        if (far) __builtin_prefetch((const void *)((uintptr_t)w[o] + far), 0, 2);  /* a number: maybe past the layer */
        if (int4) scale[o] = group_scales(scales + (g * TILE + o) * GROUP_SCALES);
        if (!count) u[o] = int4 ? int4_bytes((const uint8_t *)w[o]) : int8_bytes(w[o]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++) {
        const float *d = x[r] + g * QUANTIZED_SPAN;
        const int8_t *q = (const int8_t *)(d + LANES);
#pragma GCC unroll 8
        for (int o = 0; o < OT; o++) {
            Lanes products = count ? partial_group_products(q, w[o], count)
                                   : group_products(u[o], int4 ? INT4_MIDDLE : 128, q,
                                                    (const int32_t *)(d + LANES + QGROUP / 4));
            lane[r][o] = madd(lane[r][o], products, int4 ? multiply(load_lanes(d), scale[o]) : load_lanes(d));
        }
    }
}

/* The integer products of a tile: out[r][o] = the lanes' sum over groups of d × group_products (int8: the row's
   scale comes last, in finish) or, for int4, of d·scale × group_products after the zeros' terms (zero_terms), the
   groups added in order (madd), then the lanes in sum_lanes' tree: the same bits whatever shares the call, on any
   CPU with the same madd. x[r] is a quantize_row row. int4 takes whole groups of 64 and weight groups of whole
   blocks (int4_integer), so each block has one scale and one zero; `grouped` holds the scales and zeros of the
   tile that weight row o0 is in (int4_groups). */
static inline __attribute__((always_inline)) void integer_dots(int kind, int RT, int OT, const ManasLinear *linear,
                                                               const float *const *x, int o0, const uint16_t *grouped,
                                                               float out[MAX_ROW_TILE][TILE]) {
    Lanes lane[MAX_ROW_TILE][TILE];
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 8
        for (int o = 0; o < OT; o++) lane[r][o] = splat(0.0f);
    size_t n = (size_t)linear->n_in, whole = n / QGROUP;
    const uint16_t *scales = NULL;
    if (kind == INT4_INTEGER) {  /* row o0's place in its tile's scales and zeros */
        scales = grouped + tile_zeros_count((int)n) + o0 % TILE * GROUP_SCALES;
        zero_terms(RT, OT, (int)n, x, grouped + o0 % TILE * (n / QBLOCK), lane);
    }
    /* Fetching the rows of the tile after next while these are read keeps the loads from waiting: a decode step,
       one row of x, is otherwise latency-bound on them (int8 at GPT-2 size here: 136 against 105 tok/s for the
       next tile, 10% more again for the one after; int4's shorter rows need the distance). A hint, not a read.
       An int8 decode step over panels, one stream, asks for it as float32's does instead, a little ahead into L1
       and further into L2: two tiles ahead was 8–32 KiB into L1 at GPT-2-medium's widths (its int8 products
       alone, 1 thread, medians of 8 on the AVX-512 host: 4096 → 1024 33 → 49 GFLOP/s, 1024 → 4096 level; the
       SmolLM2 shape's decode +7% on 1 thread, +10% on 2). int4's, whose unpacking bounds it more than memory
       does, lost 5% so and keeps the tiles. */
    int ahead = o0 + (1 + PREFETCH_TILES) * OT <= linear->n_out;
    size_t stride = linear->panels ? panel_row_bytes(linear) : row_bytes(linear);  /* from a row to the next's */
    size_t prefetch = ahead ? PREFETCH_TILES * OT * stride : 0, far = 0;
    if (ahead && RT == 1 && kind == INT8_INTEGER && linear->panels)
        prefetch = DECODE_NEAR_BYTES, far = DECODE_FAR_BYTES;
    Row rows[TILE];
#pragma GCC unroll 8
    for (int o = 0; o < OT; o++) rows[o] = weight_row(linear, (size_t)(o0 + o));
    for (size_t g = 0; g < whole; g++) group_dots(kind, RT, OT, rows, x, g, 0, prefetch, far, scales, lane);
    if (whole * QGROUP < n)  /* int8 only: int4 takes whole groups */
        group_dots(kind, RT, OT, rows, x, whole, (int)(n - whole * QGROUP), 0, 0, scales, lane);
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++) {
        if (OT == 4) {
            sum_lanes4(lane[r], out[r]);
        } else {
#pragma GCC unroll 8
            for (int o = 0; o < OT; o++) out[r][o] = sum_lanes(lane[r][o]);
        }
    }
}
