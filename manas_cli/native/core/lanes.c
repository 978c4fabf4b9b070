/* How the core adds: every dot product in LANES interleaved partial sums, held as the CPU's own vectors and met in
   a fixed tree, so a sum's order is in the code and the same on every CPU (the bits of a seeded text depend on
   it); and how a product reads a weight row, float32, int8 or int4, from the panels it is regrouped into at load.

   Part of the core's one translation unit (core.c includes it after the pool): static throughout. */

/* Every dot product sums in LANES interleaved partial sums: lane l adds the products of elements l, l + LANES,
   l + 2 LANES ... in that order, then the lanes meet in a fixed tree. The order is in the code, so the compiler
   may vectorize the lanes (they are independent) but cannot reorder a sum; -ffp-contract=off fuses nothing
   behind the code's back, and where the CPU has FMA the code fuses each lane's multiply-add itself (madd). */
#define LANES 16
#define TILE 4  /* rows of W per tile (a panel's), and at most of x */
/* A prefill's tiles: TILE × TILE sets of lanes fit AVX-512's 32 registers; with 16 of half the width (AVX2) they
   would take 32, so there a tile is 3 rows of x by 2 weight rows at a time, 12 registers (GPT-2-shape float32 and
   int4 prefill +10-25% on an AMD EPYC with AVX2, interleaved A/B). */
#define ROW_TILE (PARTS == 1 ? TILE : 3)
#define COLUMN_TILE (PARTS == 1 ? TILE : 2)
#define MAX_ROW_TILE 6  /* float32's rows of x per tile on AVX-512 (row_tile) */

/* A set of LANES lanes, held as PARTS vectors of the CPU's own width: one 512-bit register with AVX-512, two 256-bit
   ones with AVX, four 128-bit ones elsewhere (SSE2, NEON). GCC keeps a vector wider than the CPU's in memory and
   moves it piece by piece through general registers (GPT-2-shape float32 prefill 9× slower on an AVX2 host), so
   a 16-float vector type serves only where the CPU has it. The lanes are the same whatever PARTS is: each part's
   operations are the lanes' own, so the bits do not change. */
#if defined(__AVX512F__)
#define PARTS 1
#elif defined(__AVX__)
#define PARTS 2
#else
#define PARTS 4
#endif
#define PART_LANES (LANES / PARTS)
typedef float Part __attribute__((vector_size(PART_LANES * sizeof(float))));  /* GCC/Clang vectors: lane-wise ops */
typedef struct { Part part[PARTS]; } Lanes;

/* Part by part, so each is one load (a copy of the whole would go through smaller pieces, and a store of pieces
   then a load of the whole waits for them). Unaligned. */
static inline Lanes load_lanes(const float *p) {
    Lanes v;
    for (int k = 0; k < PARTS; k++) memcpy(&v.part[k], p + k * PART_LANES, sizeof v.part[k]);
    return v;
}

static inline void store_lanes(float *p, Lanes v) {
    for (int k = 0; k < PARTS; k++) memcpy(p + k * PART_LANES, &v.part[k], sizeof v.part[k]);
}

/* x in every lane, as it is: x − 0 is x (even −0), so this compiles to a broadcast alone, where (Part){0} + x is an
   addition the compiler must keep (it turns −0 into +0). */
static inline Lanes splat(float x) {
    Lanes v;
    for (int p = 0; p < PARTS; p++) v.part[p] = x - (Part){0};
    return v;
}

static inline Lanes add(Lanes a, Lanes b) {
    for (int p = 0; p < PARTS; p++) a.part[p] += b.part[p];
    return a;
}

static inline Lanes multiply(Lanes a, Lanes b) {
    for (int p = 0; p < PARTS; p++) a.part[p] *= b.part[p];
    return a;
}

/* Lane by lane, b where b > a, else a: a NaN in b is never taken, as in the scalar `b > a ? b : a`. */
typedef int32_t PartMask __attribute__((vector_size(PART_LANES * sizeof(int32_t))));
static inline Lanes larger(Lanes a, Lanes b) {
    for (int p = 0; p < PARTS; p++) {
        PartMask take = b.part[p] > a.part[p];
        a.part[p] = (Part)((take & (PartMask)b.part[p]) | (~take & (PartMask)a.part[p]));
    }
    return a;
}

typedef float Half __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float Quarter __attribute__((vector_size(LANES / 4 * sizeof(float))));
typedef float Eighth __attribute__((vector_size(LANES / 8 * sizeof(float))));

/* acc + x·w, lane by lane, rounded once (fused) on every target: the same bits whatever the CPU (issue 35). */
#if defined(__AVX512F__)
/* Written as the instruction itself, operands in registers: with the intrinsic, GCC folds a vector's load into
   every FMA that uses it, so a 4×4 tile reloads each weight vector once per row (20 loads per 16 FMAs, the load
   ports the limit); here each is loaded once (8 per 16). float32 prefill at GPT-2's shape: 1.6× faster. */
static inline Lanes madd(Lanes acc, Lanes x, Lanes w) {
    __asm__("vfmadd231ps %2, %1, %0" : "+v"(acc.part[0]) : "v"(x.part[0]), "v"(w.part[0]));
    return acc;
}
#elif defined(__FMA__)
static inline Lanes madd(Lanes acc, Lanes x, Lanes w) {
    for (int p = 0; p < PARTS; p++)
        acc.part[p] = (Part)_mm256_fmadd_ps((__m256)x.part[p], (__m256)w.part[p], (__m256)acc.part[p]);
    return acc;
}
#else
/* Elsewhere fused too, lane by lane: C's fmaf rounds once (exactly what the instruction does; a CPU without it
   computes the same value in software, slower), and compilers turn the loop into the vector unit's fused
   instruction where there is one (aarch64's fmla). A separate multiply and add would round twice: other bits. */
static inline Lanes madd(Lanes acc, Lanes x, Lanes w) {
    for (int p = 0; p < PARTS; p++)
        for (int l = 0; l < PART_LANES; l++) acc.part[p][l] = fmaf(x.part[p][l], w.part[p][l], acc.part[p][l]);
    return acc;
}
#endif

/* v, held in registers from here on: where a vector serves several madds, GCC would otherwise load it again for
   each (madd takes its operands in registers), and the loads, not the multiply-adds, set the pace. */
static inline Lanes in_registers(Lanes v) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(v.part[0]));
#elif defined(__x86_64__) || defined(__i386__)
    for (int p = 0; p < PARTS; p++) __asm__("" : "+x"(v.part[p]));
#endif
    return v;
}

/* The same for one lane (a row's tail past its last whole chunk). */
static inline float madd1(float acc, float x, float w) { return fmaf(x, w, acc); }

/* The lanes' fixed tree: lane l += lane l + 8, then l + 4, l + 2, l + 1, as halves of the vector. */
static inline float sum_lanes(Lanes lanes) {
    Half h[2];
    Quarter q[2];
    Eighth e[2];
    memcpy(h, &lanes, sizeof h);
    h[0] += h[1];
    memcpy(q, &h[0], sizeof q);
    q[0] += q[1];
    memcpy(e, &q[0], sizeof e);
    e[0] += e[1];
    return e[0][0] + e[0][1];
}

/* sum_lanes of four vectors at once, the same additions of the same lanes (so the same four sums), done on
   shuffled vectors instead of one vector's halves: a tile's reductions cost a quarter of the instructions, which
   matters where rows are short (a 256-wide model spends a third of a product reducing otherwise). */
#if LANES == 16 && PARTS == 1 && (defined(__clang__) || __GNUC__ >= 12)
#define SHUFFLE __builtin_shufflevector
static inline void sum_lanes4(const Lanes *lanes, float *out) {
    Part v[4] = {lanes[0].part[0], lanes[1].part[0], lanes[2].part[0], lanes[3].part[0]};
    Part ab = SHUFFLE(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    Part cd = SHUFFLE(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    Part abcd = SHUFFLE(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 SHUFFLE(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    Half pairs = SHUFFLE(abcd, abcd, 0, 1, 4, 5, 8, 9, 12, 13) + SHUFFLE(abcd, abcd, 2, 3, 6, 7, 10, 11, 14, 15);
    Quarter sums = SHUFFLE(pairs, pairs, 0, 2, 4, 6) + SHUFFLE(pairs, pairs, 1, 3, 5, 7);
    memcpy(out, &sums, sizeof sums);
}
#else
static inline void sum_lanes4(const Lanes *v, float *out) {
    for (int k = 0; k < 4; k++) out[k] = sum_lanes(v[k]);
}
#endif

/* The sum of n values in the lane order of dots. */
static float sum(int n, const float *x) {
    Lanes lanes = splat(0.0f);
    int i = 0;
    for (; i + LANES <= n; i += LANES) lanes = add(lanes, load_lanes(x + i));
    float tail[LANES];
    store_lanes(tail, lanes);
    for (int l = 0; i + l < n; l++) tail[l] += x[i + l];
    return sum_lanes(load_lanes(tail));
}

/* IEEE half precision to float32, exactly (every half is a float32). */
static inline float f16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);  /* the CPU's own conversion: the same exact value (a GGUF's scales are read per block) */
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 31) {
        bits = sign | 0x7F800000 | mantissa << 13;  /* infinity, or NaN */
    } else if (exponent) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else if (mantissa) {  /* subnormal: shift the mantissa up until it is normal */
        int shift = 0;
        while (!(mantissa & 1024)) mantissa <<= 1, shift++;
        bits = sign | (uint32_t)(113 - shift) << 23 | (mantissa & 1023) << 13;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 int8 codes, or the low (high) nibbles of 16 bytes, as float lanes. Written with the vector unit's own
   widening loads where there is one: GCC 12 turns the portable loop (or __builtin_convertvector) into scalar
   conversions, 4× slower than the whole int8 product. Exact either way: these are small integers. */
#if defined(__AVX512F__)
static inline Lanes int8_lanes(const int8_t *p) {
    return (Lanes){{(Part)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)))}};
}
static inline Lanes nibble_lanes(const uint8_t *p, int high) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    bytes = high ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    return (Lanes){{(Part)_mm512_cvtepi32_ps(bytes)}};
}
#elif defined(__AVX2__)
static inline Lanes int8_lanes(const int8_t *p) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return (Lanes){{(Part)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                    (Part)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))}};
}
static inline Lanes nibble_lanes(const uint8_t *p, int high) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    bytes = high ? _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15)) : _mm_and_si128(bytes, _mm_set1_epi8(15));
    return (Lanes){{(Part)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                    (Part)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))}};
}
#else
static inline Lanes int8_lanes(const int8_t *p) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = (float)p[l];
    return load_lanes(lanes);
}
static inline Lanes nibble_lanes(const uint8_t *p, int high) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = (float)(high ? p[l] >> 4 : p[l] & 15);
    return load_lanes(lanes);
}
#endif

/* The index of the scale and zero of column i of int4 weight row o: groups tile the rows (group divides n_in), so
   it is the flat column's group, one division. */
static inline size_t int4_group(const ManasLinear *linear, size_t o, size_t i) {
    return (o * (size_t)linear->n_in + i) / (size_t)linear->group;
}

/* The value int4 code q stands for in a group of this scale and zero, as torch_engine/quantize.py's
   dequantize_groups computes it: one formula for a single value (weight_at) and for lanes (int4_values). */
#define INT4_VALUE(q, scale, zero) (((q) - (float)INT4_MIDDLE) * (scale) + (zero))

static inline Lanes int4_values(Lanes codes, Lanes scale, Lanes zero) {
    for (int p = 0; p < PARTS; p++) codes.part[p] = INT4_VALUE(codes.part[p], scale.part[p], zero.part[p]);
    return codes;
}

/* How many whole chunks of LANES values a row of n is read in: the rest, its tail, is read value by value. An
   int4 row is read in whole blocks of INT4_BLOCK (two chunks each), whatever its group size. */
static inline int whole_chunks(int kind, int n) { return kind == WEIGHTS_INT4 ? n / INT4_BLOCK * 2 : n / LANES; }

/* Panels: a layer's weight rows regrouped once at load (manas_pack) in the order the products read them. A tile
   reads its TILE rows a PANEL_UNIT of each at a time; stored, those units lie a row apart, TILE streams through
   memory, and one thread's loads then wait on memory: GPT-2-shape float32 products read 24 GB/s of this host's
   32 (a streaming read's). In a panel a tile's units lie side by side, each tile's weights one stream: 31 GB/s.
   Panel t holds rows TILE t .. TILE t + TILE − 1 (zeros past n_out), unit u of each row in turn. */
#define PANEL_UNIT 64
/* How far ahead of its reads a float32 decode step asks for its panels: into L1 2 chunks ahead, into L2 12. With
   one distance alone (any of 512 bytes to 8 KiB) its products read 12.5-13.5 GB/s on the Intel host, with both
   14-15 (stand-alone; a read of memory that asks ahead gets 15.5): GPT-2-shape decode +2-6%. */
#define F32_NEAR_CHUNKS 2
#define F32_FAR_CHUNKS 12
/* The same distances in bytes of a panel's stream (a float32 chunk of a tile is TILE units): the integer kinds'. */
#define DECODE_NEAR_BYTES (F32_NEAR_CHUNKS * TILE * PANEL_UNIT)
#define DECODE_FAR_BYTES (F32_FAR_CHUNKS * TILE * PANEL_UNIT)

/* The bytes of one weight row as stored: n_in float32 values, int8 codes, or int4 nibble pairs. */
static inline size_t row_bytes(const ManasLinear *linear) {
    size_t n = (size_t)linear->n_in;
    return linear->kind == WEIGHTS_F32 ? n * sizeof(float) : linear->kind == WEIGHTS_INT8 ? n : n / 2;
}

/* The bytes of one weight row in a layer's panels: its bytes as stored, up to a whole PANEL_UNIT, the rest zeros.
   Only an int4 row of whole groups of 64 columns (32 bytes each) ends part-way through a unit (SmolLM2's 576
   columns are 288 bytes, four units and a half); a group never straddles two. */
static inline size_t panel_row_bytes(const ManasLinear *linear) {
    return (row_bytes(linear) + PANEL_UNIT - 1) / PANEL_UNIT * PANEL_UNIT;
}

/* Where weight row o is read: byte b of it at start + b / PANEL_UNIT × stride + b % PANEL_UNIT. Every read of a
   row (a chunk, a block, a group) lies within one unit. */
typedef struct {
    const uint8_t *start;
    size_t stride;
} Row;

static inline Row weight_row(const ManasLinear *linear, size_t o) {
    if (linear->panels) {
        size_t tile = o / TILE * TILE * panel_row_bytes(linear);  /* the bytes of the panels before row o's */
        return (Row){(const uint8_t *)linear->panels + tile + o % TILE * PANEL_UNIT, TILE * PANEL_UNIT};
    }
    return (Row){(const uint8_t *)linear->weight + o * row_bytes(linear), PANEL_UNIT};
}

static inline const uint8_t *row_byte(Row row, size_t b) {
    return row.start + b / PANEL_UNIT * row.stride + b % PANEL_UNIT;
}

/* Chunks c .. c + step − 1 of weight row o (read at `row`) as float32 lanes (chunk c: values 16c .. 16c + 15 in
   the order the products use), step 1 for float32 and int8, 2 for int4: float32 as stored; int8 codes as they are
   (the row's scale multiplies the sum, in finish); int4 dequantized by INT4_VALUE, zero + (code − 8) × scale, a
   block of 32 columns at a time: its 16 bytes' low nibbles (the block's even columns) are chunk c,
   their high nibbles (its odd columns) chunk c + 1, and x is reordered to match (int4_input). A block lies in one
   group when the group size is a multiple of 32 (one scale for all lanes); else each lane takes its own. */
static inline __attribute__((always_inline)) void weight_lanes(int kind, const ManasLinear *linear, Row row, int o,
                                                               int c, Lanes *chunks) {
    if (kind == WEIGHTS_F32) {
        chunks[0] = load_lanes((const float *)row_byte(row, (size_t)c * LANES * sizeof(float)));
    } else if (kind == WEIGHTS_INT8) {
        chunks[0] = int8_lanes((const int8_t *)row_byte(row, (size_t)c * LANES));
    } else {
        size_t first = (size_t)c / 2 * INT4_BLOCK;  /* the block's first column */
        const uint8_t *bytes = row_byte(row, first / 2);
        int one_group = linear->group % INT4_BLOCK == 0;
        Lanes scale = splat(0.0f), zero = scale;
        if (one_group) {
            size_t g = int4_group(linear, o, first);
            scale = splat(bf16_to_float(linear->scales[g])), zero = splat(bf16_to_float(linear->zeros[g]));
        }
        for (int half = 0; half < 2; half++) {
            if (!one_group) {
                float scales[LANES], zeros[LANES];
                for (int l = 0; l < LANES; l++) {
                    size_t g = int4_group(linear, o, first + 2 * l + half);
                    scales[l] = bf16_to_float(linear->scales[g]), zeros[l] = bf16_to_float(linear->zeros[g]);
                }
                scale = load_lanes(scales), zero = load_lanes(zeros);
            }
            chunks[half] = int4_values(nibble_lanes(bytes, half), scale, zero);
        }
    }
}

/* Element i of weight row o, for the tail of a row past its whole chunks (int8: the code; int4: its value). */
static inline float weight_at(int kind, const ManasLinear *linear, int o, int i) {
    size_t at = (size_t)o * linear->n_in + i;
    if (kind == WEIGHTS_F32) return ((const float *)linear->weight)[at];
    if (kind == WEIGHTS_INT8) return (float)((const int8_t *)linear->weight)[at];
    uint8_t byte = ((const uint8_t *)linear->weight)[at / 2];  /* rows are even, so column i is byte at/2's */
    size_t g = int4_group(linear, o, i);
    return INT4_VALUE((float)(i % 2 ? byte >> 4 : byte & 15), bf16_to_float(linear->scales[g]),
                      bf16_to_float(linear->zeros[g]));
}
