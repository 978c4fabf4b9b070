/* A layer's matrix product y = x · Wᵀ (+ b) over rows of x: tiles of weight rows against tiles of x so that a
   weight load serves several rows (a prefill, a batched step), a float32 decode step streaming its panels with
   the loads asked for ahead, the rows split over the pool, and the scratch every call carves its buffers from.

   Part of the core's one translation unit (core.c includes it after integer.c and lanes.c). */

/* out[r][o] = x[r] · w[o0 + o] for r < RT, o < OT (compile-time sizes after inlining): each pair in the lane
   order above, whatever the tile's shape. */
static inline __attribute__((always_inline)) void dots(int kind, int RT, int OT, const ManasLinear *linear,
                                                       const float *const *x, int o0, const uint16_t *grouped,
                                                       float out[MAX_ROW_TILE][TILE]) {
    if (kind == INT8_INTEGER || kind == INT4_INTEGER) {
        integer_dots(kind, RT, OT, linear, x, o0, grouped, out);
        return;
    }
    Lanes lane[MAX_ROW_TILE][TILE];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) lane[r][o] = splat(0.0f);
    int n = linear->n_in, chunks = whole_chunks(kind, n), step = kind == WEIGHTS_INT4 ? 2 : 1;
    Row rows[TILE];
    for (int o = 0; o < OT; o++) rows[o] = weight_row(linear, (size_t)(o0 + o));
    for (int c = 0; c < chunks; c += step) {
        Lanes ws[TILE][2];
        for (int o = 0; o < OT; o++) weight_lanes(kind, linear, rows[o], o0 + o, c, ws[o]);
        for (int k = 0; k < step; k++)
            for (int r = 0; r < RT; r++) {
                Lanes xs = load_lanes(x[r] + (c + k) * LANES);
                for (int o = 0; o < OT; o++) lane[r][o] = madd(lane[r][o], xs, ws[o][k]);
            }
    }
    for (int r = 0; r < RT; r++) {
        for (int o = 0; o < OT && chunks * LANES < n; o++) {
            float tail[LANES];
            store_lanes(tail, lane[r][o]);
            for (int i = chunks * LANES; i < n; i++)
                tail[i % LANES] = madd1(tail[i % LANES], x[r][i], weight_at(kind, linear, o0 + o, i));
            lane[r][o] = load_lanes(tail);
        }
        if (OT == 4) {
            sum_lanes4(lane[r], out[r]);
        } else {
            for (int o = 0; o < OT; o++) out[r][o] = sum_lanes(lane[r][o]);
        }
    }
}

/* A float32 dot product in the same lane order (attention's q · k). */
static float dot(int n, const float *a, const float *b) {
    Lanes lanes = splat(0.0f);
    int i = 0;
    for (; i + LANES <= n; i += LANES) lanes = madd(lanes, load_lanes(a + i), load_lanes(b + i));
    float tail[LANES];
    store_lanes(tail, lanes);
    for (int l = 0; i + l < n; l++) tail[l] = madd1(tail[l], a[i + l], b[i + l]);
    return sum_lanes(load_lanes(tail));
}

/* What a product's sum becomes: int8's times its row's scale, then the float bias. With float activations
   (float32 layers, int4 layers of other groups (int4_integer), and quantized ones when
   ManasModel.integer_products is 0) the core computes x · Wᵀ over W's dequantized values (exact in float32) to
   float32 rounding, where torch's engine rounds a quantized product's input and output to bfloat16 (its int8
   kernel's limit); the integer products quantize x per block instead (integer_dots). */
static inline float finish(const ManasLinear *linear, int o, float sum) {
    if (linear->kind == WEIGHTS_INT8) sum *= bf16_to_float(linear->scales[o]);
    return linear->bias ? linear->bias[o] + sum : sum;
}

/* y = x · Wᵀ + b for `rows` rows, split over the pool by tiles of output features. */
typedef struct {
    const ManasLinear *linear;
    int kind;        /* the products' kind: the weights', or INT8_INTEGER / INT4_INTEGER */
    const float *x;  /* (rows, stride): n_in floats, for int4 each block reordered (int4_input); for the integer
                        kinds, a quantize_row row (of the reordered values, for int4) */
    size_t stride;
    float *y;        /* (rows, y_stride): outputs 0 .. n_out − 1 of each row */
    size_t y_stride;
    int rows;
    float *tiles;    /* per thread, TILE rows of n_in floats: a tile of int4 weights dequantized (a float prefill),
                        or its rows' scales and zeros (int4_groups) where the layer has no panels */
    int quantized_x; /* ggml: x is quantize_blocks rows (else float rows) */
} Matmul;

/* A float32 prefill asks for the next block's panels (into L2), a share before each row tile of this block: its
   first pass over a block otherwise waits on memory for all the block's weights at once, then computes from cache,
   where spread over the block's products the reads overlap them (GPT-2-shape products of 64 rows, stand-alone on
   an AVX-512 host: 83 → 106 GFLOP/s where n_in is 768). A hint, not a read. A decode step (one row) asks for its
   weights in its own products; the integer kinds, whose weights are a quarter the bytes or less, gained nothing. */
typedef struct {
    const uint8_t *next;  /* the next block's first panel, or NULL: nothing to ask for */
    size_t bytes, share, asked;  /* its bytes, how many to ask for per row tile, how many asked for so far */
} Ahead;

static Ahead block_ahead(const Matmul *m, int last, int next_last, int products) {
    if (m->kind != WEIGHTS_F32 || !m->linear->panels || m->rows < 2 || next_last <= last) return (Ahead){NULL, 0, 0, 0};
    size_t bytes = (size_t)(next_last - last) * TILE * row_bytes(m->linear);
    return (Ahead){weight_row(m->linear, (size_t)last * TILE).start, bytes, (bytes / products + 63) / 64 * 64, 0};
}

static inline void ask_ahead(Ahead *ahead) {
    if (!ahead->next) return;
    size_t to = ahead->asked + ahead->share < ahead->bytes ? ahead->asked + ahead->share : ahead->bytes;
    for (; ahead->asked < to; ahead->asked += 64) __builtin_prefetch(ahead->next + ahead->asked, 0, 2);
}

/* Rows of x per tile: float32's are 6 on AVX-512, 24 sets of lanes, each weight load serving 6 rows (the integer
   kinds' weights unpack into more registers). Forced inline so that it folds to a constant: GCC 12 otherwise kept
   the 24 on the stack. */
static inline __attribute__((always_inline)) int row_tile(int kind) {
    return PARTS == 1 && kind == WEIGHTS_F32 ? MAX_ROW_TILE : ROW_TILE;
}

/* A whole tile's TILE outputs for `rows` ≤ RT rows of x (x[rows ..] repeat its last row), COLUMN_TILE outputs a
   dots call. */
static inline __attribute__((always_inline)) void tile_dots(int kind, int RT, const ManasLinear *weights,
                                                            const float *const *x, int w0, const uint16_t *grouped,
                                                            int rows, float out[MAX_ROW_TILE][TILE]) {
    for (int c = 0; c < TILE; c += COLUMN_TILE) {
        float part[MAX_ROW_TILE][TILE];
        dots(kind, RT, COLUMN_TILE, weights, x, w0 + c, grouped, part);
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < COLUMN_TILE; o++) out[r][c + o] = part[r][o];
    }
}

/* Output features o0 .. o0 + count − 1 for rows r_begin .. r_end − 1, row_tile(kind) rows at a time, each weight
   load serving them all; the weights are read from rows w0.. of `weights` (the layer itself, or that tile of it
   dequantized). A short tile of rows repeats its last row to fill the tile and drops those outputs: each output is
   the same sum whatever tile computes it. Float32's 6-row tiles leave 4 rows of 16 or 64 (a server's batch), which
   run as a tile of 4 rather than 6 with 2 repeated: 16 rows as 6, 6, 6 cost what 18 do (54 against 72 GFLOP/s). */
static inline __attribute__((always_inline)) void matmul_tile(int kind, const Matmul *m, const ManasLinear *weights,
                                                              int w0, int o0, int count, const uint16_t *grouped,
                                                              int r_begin, int r_end, Ahead *ahead) {
    int RT = row_tile(kind);
    for (int r0 = r_begin; r0 < r_end; r0 += RT) {
        if (ahead) ask_ahead(ahead);  /* tested here: tested inside, GCC spilled int8 float products' lanes */
        int rows = r_end - r0 < RT ? r_end - r0 : RT;
        const float *x[MAX_ROW_TILE];
        for (int r = 0; r < RT; r++) x[r] = m->x + (size_t)(r0 + (r < rows ? r : rows - 1)) * m->stride;
        float out[MAX_ROW_TILE][TILE];
        if (rows > 1 && count == TILE) {
            if (RT > TILE && rows <= TILE) tile_dots(kind, TILE, weights, x, w0, grouped, rows, out);  /* 16's last 4 */
            else tile_dots(kind, RT, weights, x, w0, grouped, rows, out);
        } else if (rows == 1 && count == TILE) {
            dots(kind, 1, TILE, weights, x, w0, grouped, out);
        } else {
            for (int r = 0; r < rows; r++)
                for (int o = 0; o < count; o++) {
                    float one[MAX_ROW_TILE][TILE];
                    dots(kind, 1, 1, weights, x + r, w0 + o, grouped, one);
                    out[r][o] = one[0][0];
                }
        }
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < count; o++)
                m->y[(size_t)(r0 + r) * m->y_stride + o0 + o] = finish(m->linear, o0 + o, out[r][o]);
    }
}

/* Whether an int4 layer's products run in integers: whole groups of QGROUP columns, and weight groups of whole
   blocks, so each activation block meets one scale and one zero. Other int4 layers multiply in float32. */
static int int4_integer(const ManasLinear *linear) {
    return linear->n_in % QGROUP == 0 && linear->group % QBLOCK == 0;
}

/* The bytes of a layer's weight panels, and of the scales and zeros an int4 integer product reads that follow
   them (int4_groups' layout, tile after tile). */
static size_t panel_weight_bytes(const ManasLinear *linear) {
    return ((size_t)linear->n_out + TILE - 1) / TILE * TILE * panel_row_bytes(linear);
}

static size_t tile_group_scale_count(const ManasLinear *linear) {
    int int4 = linear->kind == WEIGHTS_INT4 && int4_integer(linear);
    return int4 ? tile_scales_count(linear->n_in) : 0;
}

/* Tile t's scales and zeros in the layer's panels, or NULL where it has none. */
static const uint16_t *tile_group_scales(const ManasLinear *linear, int t) {
    if (!linear->panels) return NULL;
    const uint16_t *all = (const uint16_t *)((const uint8_t *)linear->panels + panel_weight_bytes(linear));
    return all + (size_t)t * tile_group_scale_count(linear);
}

/* Rows o0 .. o0 + count − 1 of a quantized layer as float32, in the order of its chunks: the values weight_lanes
   gives, stored. */
static void dequantize_tile(const ManasLinear *linear, int o0, int count, float *buffer) {
    int n = linear->n_in, kind = linear->kind, step = kind == WEIGHTS_INT4 ? 2 : 1;
    int chunks = whole_chunks(kind, n);
    for (int k = 0; k < count; k++) {
        float *row = buffer + (size_t)k * n;
        Row at = weight_row(linear, (size_t)(o0 + k));
        for (int c = 0; c < chunks; c += step) {
            Lanes values[2];
            if (kind == WEIGHTS_INT8) weight_lanes(WEIGHTS_INT8, linear, at, o0 + k, c, values);
            else weight_lanes(WEIGHTS_INT4, linear, at, o0 + k, c, values);
            memcpy(row + (size_t)c * LANES, values, step * sizeof(Lanes));
        }
        for (int i = chunks * LANES; i < n; i++) row[i] = weight_at(kind, linear, o0 + k, i);
    }
}

/* A float32 prefill's tiles, a function of their own: among the other kinds' loops in tile_product, GCC 12 kept
   some of a tile's lanes on the stack (products of 64 rows, n_in 3072, stand-alone on an AVX-512 host: 85 against
   72-77 GFLOP/s). */
static __attribute__((noinline)) void float32_tiles(const Matmul *m, int o0, int count, int r_begin, int r_end,
                                                    Ahead *ahead) {
    matmul_tile(WEIGHTS_F32, m, m->linear, o0, o0, count, NULL, r_begin, r_end, ahead);
}

/* Weight tile `tile` against rows r_begin .. r_end − 1, in the products' kind (one copy of the loops per kind). */
static void tile_product(const Matmul *m, int tile, int r_begin, int r_end, float *buffer, Ahead *ahead) {
    int o0 = tile * TILE, count = m->linear->n_out - o0 < TILE ? m->linear->n_out - o0 : TILE;
    switch (m->kind) {
    case WEIGHTS_F32:
        if (r_end - r_begin > 1) float32_tiles(m, o0, count, r_begin, r_end, ahead);
        else matmul_tile(WEIGHTS_F32, m, m->linear, o0, o0, count, NULL, r_begin, r_end, NULL);
        break;
    case WEIGHTS_INT8: matmul_tile(WEIGHTS_INT8, m, m->linear, o0, o0, count, NULL, r_begin, r_end, NULL); break;
    case INT8_INTEGER: matmul_tile(INT8_INTEGER, m, m->linear, o0, o0, count, NULL, r_begin, r_end, NULL); break;
    case INT4_INTEGER: {
        const uint16_t *grouped = tile_group_scales(m->linear, tile);
        if (!grouped) int4_groups(m->linear, o0, count, (uint16_t *)buffer);
        grouped = grouped ? grouped : (const uint16_t *)buffer;
        matmul_tile(INT4_INTEGER, m, m->linear, o0, o0, count, grouped, r_begin, r_end, NULL);
        break;
    }
    default: matmul_tile(WEIGHTS_INT4, m, m->linear, o0, o0, count, NULL, r_begin, r_end, NULL); break;
    }
}

/* A prefill takes the weights a block of tiles at a time past 8 row tiles of x at a time, so a tile's loads of x,
   most of its loads, find them in L1 or near it rather than streaming every row of x from L2 again for each tile
   (GPT-2-shape pp64 on an AVX2 host, interleaved A/B: float32 +8%, int8 +14%, int4 +20%; rows of 4 row tiles
   gained less, 16 lost). A block is 16 tiles, or float32's 48 KiB of panels: with the next block asked for ahead
   (Ahead), 16 float32 tiles of n_in 3072 (768 KiB) pushed out of L2 what they were still to read (stand-alone, 64
   rows: 72 against 85 GFLOP/s). Each output's products are still one dots call: the blocking orders the calls,
   never a sum. */
#define TILE_BLOCK 16
#define FLOAT32_BLOCK_BYTES (48 << 10)

static int tile_block(const Matmul *m) {
    if (m->kind != WEIGHTS_F32) return TILE_BLOCK;
    int tiles = FLOAT32_BLOCK_BYTES / (TILE * (int)row_bytes(m->linear));
    return tiles < 1 ? 1 : tiles > TILE_BLOCK ? TILE_BLOCK : tiles;
}

/* One row x against a tile's panel (TILE, n_in) of `chunks` chunks: out[o] = x · w[o], in dots' lane order
   (sum_lanes4 adds as sum_lanes does, so a last tile's rows past n_out, zeros in its panel, change no sum). The
   panel is one stream read from one pointer; where it comes from memory (`ask`), it is asked for twice ahead of
   the reads, into L1 and into L2 (a hint, not a read). */
static inline __attribute__((always_inline)) void panel_dots(const float *panel, const float *x, int chunks, int ask,
                                                             float out[TILE]) {
    Lanes lane[TILE];
    for (int o = 0; o < TILE; o++) lane[o] = splat(0.0f);
    for (int c = 0; c < chunks; c++, panel += TILE * LANES) {
        if (ask)
            for (int o = 0; o < TILE; o++) {
                __builtin_prefetch(panel + (F32_NEAR_CHUNKS * TILE + o) * LANES, 0, 3);
                __builtin_prefetch(panel + (F32_FAR_CHUNKS * TILE + o) * LANES, 0, 2);
            }
        Lanes xs = load_lanes(x + c * LANES);
        for (int o = 0; o < TILE; o++) lane[o] = madd(lane[o], xs, load_lanes(panel + o * LANES));
    }
    sum_lanes4(lane, out);
}

/* A float32 decode step's tiles begin .. end − 1 from their panels, for its one row or the few rows of a
   speculative check (FEW_ROWS at most): consecutive panels are one stream, with nothing between tiles but their
   sums; a check's later rows find the tile's panel in cache (n_in 1536: 24 KiB), so each costs its arithmetic,
   not another read of the layer, where the prefill's row tiles read from panel rows laid out for many rows
   (SmolLM2-135M, 1 thread, AVX2: a check of 5 positions cost 2.0 decode steps that way). Each output is the one
   row's sum, bit for bit. A layer has panels only where its rows are whole PANEL_UNITs (manas_panel_bytes), so
   n_in is a multiple of LANES and the chunks leave no tail. (The integer kinds gain nothing so: their rows cost
   their arithmetic either way, int8's 0.55 of a decode step each, int4's 0.75, on the same host.) */
#define FEW_ROWS 8
static __attribute__((noinline)) void float32_decode(const Matmul *m, int begin, int end) {
    const ManasLinear *linear = m->linear;
    int chunks = linear->n_in / LANES;
    for (int tile = begin; tile < end; tile++) {
        const float *panel = (const float *)linear->panels + (size_t)tile * TILE * linear->n_in;  /* (TILE, n_in) */
        for (int r = 0; r < m->rows; r++) {
            float out[TILE];
            if (r == 0) panel_dots(panel, m->x, chunks, 1, out);
            else panel_dots(panel, m->x + (size_t)r * m->stride, chunks, 0, out);
            for (int o = 0, o0 = tile * TILE; o < TILE && o0 + o < linear->n_out; o++)
                m->y[(size_t)r * m->y_stride + o0 + o] = finish(linear, o0 + o, out[o]);
        }
    }
}

static void ggml_tiles(const Matmul *m, int begin, int end, float *row);  /* core/blocks.c */

static void matmul_tiles(void *context, int begin, int end, int thread) {
    const Matmul *m = context;
    if (m->kind == WEIGHTS_GGML) {
        ggml_tiles(m, begin, end, m->tiles + (size_t)thread * TILE * m->linear->n_in);
        return;
    }
    if (m->kind == WEIGHTS_F32 && m->rows <= FEW_ROWS && m->linear->panels) {
        float32_decode(m, begin, end);
        return;
    }
    float *buffer = m->tiles + (size_t)thread * TILE * m->linear->n_in;
    if (m->kind == WEIGHTS_INT4 && m->rows > TILE) {  /* a float prefill of int4: dequantize once for all its rows */
        for (int tile = begin; tile < end; tile++) {
            int o0 = tile * TILE, count = m->linear->n_out - o0 < TILE ? m->linear->n_out - o0 : TILE;
            dequantize_tile(m->linear, o0, count, buffer);
            ManasLinear dequantized = {.kind = WEIGHTS_F32, .n_in = m->linear->n_in, .n_out = count, .weight = buffer};
            matmul_tile(WEIGHTS_F32, m, &dequantized, 0, o0, count, NULL, 0, m->rows, NULL);
        }
        return;
    }
    int row_tile_rows = row_tile(m->kind), row_block = 8 * row_tile_rows;
    int row_tiles = (m->rows + row_tile_rows - 1) / row_tile_rows, block = tile_block(m);
    for (int first = begin; first < end; first += block) {
        int last = first + block < end ? first + block : end;
        Ahead ahead = block_ahead(m, last, last + block < end ? last + block : end, row_tiles * (last - first));
        for (int r0 = 0; r0 < m->rows; r0 += row_block)
            for (int tile = first; tile < last; tile++)
                tile_product(m, tile, r0, r0 + row_block < m->rows ? r0 + row_block : m->rows, buffer, &ahead);
    }
}

/* A row x with each whole block of 32 reordered to its even columns, then its odd ones, the tail as it is: the
   order weight_lanes and weight_at give an int4 row's values in. */
static void int4_input(int n, const float *x, float *out) {
    int blocked = n / INT4_BLOCK * INT4_BLOCK;
    for (int i = 0; i < n; i++) {
        int j = i % INT4_BLOCK;
        out[i < blocked ? i - j + (j % 2 ? INT4_BLOCK / 2 : 0) + j / 2 : i] = x[i];
    }
}

/* The scratch every call shares, carved from the caller's buffer (manas_scratch_bytes sizes it, carve lays it
   out). C is n_embd, hs the head size, A = n_head hs the heads' width, F the MLP's, W the widest of C, A and F. */
typedef struct {
    float *x;          /* (rows, C): the residual stream */
    float *h;          /* (rows, C): a normed row, or a projection's output before it is added */
    float *qkv;        /* (rows, A + 2 n_kv_head hs): queries, keys and values */
    float *attention;  /* (rows, A): the heads' outputs side by side */
    float *hidden;     /* (rows, F): the feed-forward's inner width */
    float *gated;      /* (rows, F): a gated MLP's gate (SwiGLU's, GeGLU's), before it multiplies hidden */
    float *reordered;  /* (rows, W): an int4 product's input in its blocks' column order (int4_input) */
    float *angles;     /* (rows, hs): the rotary angles of each row's position */
    float *local_angles; /* (rows, hs): the same at a window layer's own rope base (local_rope_base), if any */
    float *normed;     /* (rows, C): an attention's or MLP's output normed before it is added (post norms) */
    float *squares;    /* (hs): a query or key head's squares while it is normed (qk_norm) */
    float *tiles;      /* (threads, TILE, W): each thread's dequantized weight rows (an int4 prefill) */
    float *scores;     /* (threads, score_rows, block_size): each thread's attention weights */
    float *quantized;  /* (rows, quantized_floats(W)): an integer product's input rows (quantize_row) */
} Scratch;

/* A product's input rows as its kind reads them: int4's reordered (int4_input), the integer kinds' quantized
   (quantize_row), row by row, so a prefill's rows split over the pool. */
typedef struct {
    const ManasLinear *linear;
    const float *x;       /* (rows, n_in) */
    float *reordered;     /* (rows, n_in): int4's */
    float *quantized;     /* (rows, quantized_floats(n_in)), or NULL: float products */
} Prepare;

static int ggml_quantized(const ManasLinear *linear, int integer);            /* core/blocks.c */
static void quantize_blocks(const ManasLinear *linear, const float *x, void *quantized);

static void prepare_rows(void *context, int begin, int end, int thread) {
    (void)thread;
    const Prepare *p = context;
    int n = p->linear->n_in, int4 = p->linear->kind == WEIGHTS_INT4;
    for (size_t r = (size_t)begin; r < (size_t)end; r++) {
        const float *x = p->x + r * n;
        if (p->linear->kind == WEIGHTS_GGML) {  /* per block of 32, as core/blocks.c reads them */
            quantize_blocks(p->linear, x, p->quantized + r * quantized_floats(n));
            continue;
        }
        if (int4) {
            int4_input(n, x, p->reordered + r * n);
            x = p->reordered + r * n;
        }
        if (p->quantized)  /* offset: what makes the weights unsigned (int8_bytes, int4_bytes) */
            quantize_row(n, x, int4 ? INT4_MIDDLE : 128, p->quantized + r * quantized_floats(n));
    }
}

/* y = x · Wᵀ + b for `rows` rows of x (n_in each), y's rows y_stride apart. */
static void matmul(ManasPool *pool, const Scratch *s, const ManasLinear *linear, int integer, const float *x,
                   float *y, size_t y_stride, int rows) {
    int n = linear->n_in, kind = linear->kind;
    int in_integers = integer && (kind == WEIGHTS_INT8 || (kind == WEIGHTS_INT4 && int4_integer(linear)));
    in_integers = kind == WEIGHTS_GGML ? ggml_quantized(linear, integer) : in_integers;
    if (kind == WEIGHTS_INT4 || in_integers) {
        Prepare prepare = {linear, x, s->reordered, in_integers ? s->quantized : NULL};
        parallel_for(pool, prepare_rows, &prepare, rows);
    }
    size_t stride = in_integers ? quantized_floats(n) : (size_t)n;
    if (in_integers && kind != WEIGHTS_GGML) kind = kind == WEIGHTS_INT8 ? INT8_INTEGER : INT4_INTEGER;
    x = in_integers ? s->quantized : linear->kind == WEIGHTS_INT4 ? s->reordered : x;
    Matmul m = {linear, kind, x, stride, y, y_stride, rows, s->tiles, in_integers};
    parallel_for(pool, matmul_tiles, &m, (linear->n_out + TILE - 1) / TILE);
}
