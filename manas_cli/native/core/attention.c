/* Causal attention over each row's KV cache: a row's query heads against its own cached positions 0..position
   only (in a window layer its last `window` of them), softmax(q·k / √hs) · v (√attention_scalar where the model
   sets one); then the new key and value written
   into the cache. The queries that read the same
   cached keys (a prefill's rows of one head, a decode row's query heads of one key head) go through them
   ATTEND_ROWS at a time, each cached vector loaded once for them all, their sums held in registers.

   Part of the core's one translation unit (core.c includes it after functions.c). */

#define ATTEND_ROWS 4

/* How many positions ahead a pass over the cache asks for it, into L2: at a decode step the cache streams from
   memory beside the weights, and one position's 4 lines a head at a time do not wake the hardware's prefetcher
   (SmolLM2 shape, 2,048 positions, 1 thread, AMD host: int4 decode 52 tok/s without, 87–90 into L2, 62–65 with
   the non-temporal hint; float32 39–43 at 16 to 128 positions into L2, 34–35 into L1). */
#define ATTEND_PREFETCH_POSITIONS 64

/* Ask for the cache line ATTEND_PREFETCH_POSITIONS positions on from x, into L2. The address is computed as a
   number, not as a pointer (which may not pass the end of its array): a prefetch past the cache reads nothing and
   never faults. */
static inline void prefetch_ahead(const float *x, int kv_width) {
    size_t ahead = (size_t)ATTEND_PREFETCH_POSITIONS * kv_width * sizeof(float);
    __builtin_prefetch((const void *)((uintptr_t)x + ahead), 0, 2);
}

/* x[t] *= scale for t < n, and the largest result (a NaN never is): each lane keeps its own largest and the lanes
   meet at the end. The largest is the same in any order (up to a zero's sign, which e^(x − top) cannot tell), so
   this equals a loop one value at a time, which waited on each compare: a sixth of attention's time. */
static float scale_to_top(int n, float *x, float scale) {
    Lanes top = splat(-INFINITY), factor = splat(scale);
    int t = 0;
    for (; t + LANES <= n; t += LANES) {
        Lanes scaled = multiply(load_lanes(x + t), factor);
        store_lanes(x + t, scaled);
        top = larger(top, scaled);
    }
    float lanes[LANES], highest = -INFINITY;
    store_lanes(lanes, top);
    for (int l = 0; l < LANES; l++) highest = lanes[l] > highest ? lanes[l] : highest;
    for (; t < n; t++) {
        x[t] *= scale;
        highest = x[t] > highest ? x[t] : highest;
    }
    return highest;
}

/* q · the cached key at position t (keys: one head's key at position 0, a position kv_width floats on). */
static inline float one_score(int hs, const float *q, const float *keys, int kv_width, int t) {
    return dot(hs, q, keys + (size_t)t * kv_width);
}

/* scores[k][t .. t + 3] = q[k] · the keys at positions t .. t + 3, for QUERIES queries, hs a multiple of LANES:
   each key vector loaded once for them all; each product dot's arithmetic, the four met together (sum_lanes4). */
static inline __attribute__((always_inline)) void four_scores(int QUERIES, int hs, const float *const *q,
                                                              const float *keys, int kv_width, int t,
                                                              float *const *scores) {
    Lanes lanes[ATTEND_ROWS][4];
    const float *key[4];
    for (int p = 0; p < 4; p++) key[p] = keys + (size_t)(t + p) * kv_width;
    for (int k = 0; k < QUERIES; k++)
        for (int p = 0; p < 4; p++) lanes[k][p] = splat(0.0f);
    for (int i = 0; i < hs; i += LANES) {
        Lanes four[4];
        for (int p = 0; p < 4; p++) {
            prefetch_ahead(key[p] + i, kv_width);
            four[p] = in_registers(load_lanes(key[p] + i));
        }
        for (int k = 0; k < QUERIES; k++) {
            Lanes x = load_lanes(q[k] + i);
            for (int p = 0; p < 4; p++) lanes[k][p] = madd(lanes[k][p], x, four[p]);
        }
    }
    for (int k = 0; k < QUERIES; k++) sum_lanes4(lanes[k], scores[k] + t);
}

/* scores[k][t] = q[k] · key_t for positions t0 .. t1 − 1 and QUERIES queries (unscaled), four positions at a time
   while there are four; one at a time where a head size's tail past its last LANES needs dot's lanes (the code
   for four without that tail keeps its 16 sums in registers, where with it GCC kept them on the stack). */
static inline __attribute__((always_inline)) void scores_of(int QUERIES, int hs, int t0, int t1,
                                                            const float *const *q, const float *keys, int kv_width,
                                                            float *const *scores) {
    int t = t0;
    if (hs % LANES == 0)
        for (; t + 4 <= t1; t += 4) four_scores(QUERIES, hs, q, keys, kv_width, t, scores);
    for (; t < t1; t++)
        for (int k = 0; k < QUERIES; k++) scores[k][t] = one_score(hs, q[k], keys, kv_width, t);
}

/* For QUERIES queries: out[k][i .. i + CHUNKS·LANES) += Σ weights[k][t] · v_t[i ..] over positions t0 .. t1 − 1 in
   order (values: a head's value at position 0, a position kv_width floats on), the sums held in registers from
   out and back, so each lane adds its positions in order however the positions are split between calls. */
static inline __attribute__((always_inline)) void mix_chunks(int QUERIES, int CHUNKS, int i, int t0, int t1,
                                                             const float *const *weights, const float *values,
                                                             int kv_width, float *const *out) {
    Lanes sum[ATTEND_ROWS][4];
    for (int k = 0; k < QUERIES; k++)
        for (int c = 0; c < CHUNKS; c++) sum[k][c] = load_lanes(out[k] + i + c * LANES);
    for (int t = t0; t < t1; t++) {
        const float *v = values + (size_t)t * kv_width + i;
        Lanes x[4];
        for (int c = 0; c < CHUNKS; c++) {
            prefetch_ahead(v + c * LANES, kv_width);
            x[c] = in_registers(load_lanes(v + c * LANES));
        }
        for (int k = 0; k < QUERIES; k++) {
            Lanes weight = splat(weights[k][t]);
            for (int c = 0; c < CHUNKS; c++) sum[k][c] = madd(sum[k][c], weight, x[c]);
        }
    }
    for (int k = 0; k < QUERIES; k++)
        for (int c = 0; c < CHUNKS; c++) store_lanes(out[k] + i + c * LANES, sum[k][c]);
}

/* out[k] += Σ weights[k][t] · v_t over positions t0 .. t1 − 1, for QUERIES queries: four vectors of each at a
   time (16 sums in registers), then two, then one, then a head size's tail lane by lane. */
static inline __attribute__((always_inline)) void mix_of(int QUERIES, int hs, int t0, int t1,
                                                         const float *const *weights, const float *values,
                                                         int kv_width, float *const *out) {
    int i = 0;
    for (; i + 4 * LANES <= hs; i += 4 * LANES) mix_chunks(QUERIES, 4, i, t0, t1, weights, values, kv_width, out);
    for (; i + 2 * LANES <= hs; i += 2 * LANES) mix_chunks(QUERIES, 2, i, t0, t1, weights, values, kv_width, out);
    for (; i + LANES <= hs; i += LANES) mix_chunks(QUERIES, 1, i, t0, t1, weights, values, kv_width, out);
    for (; i < hs; i++)
        for (int k = 0; k < QUERIES; k++) {
            float sum = out[k][i];
            for (int t = t0; t < t1; t++) sum = madd1(sum, weights[k][t], values[(size_t)t * kv_width + i]);
            out[k][i] = sum;
        }
}

/* Attention of one query head of one row over its cache's positions 0..position: softmax(q·k / √hs) · v. Tasks
   run head by head, every row of a head in turn: a prefill's later rows attend over more positions, so slicing
   tasks row by row would give the last thread the most work (on 2 threads, the first waited 15% of a re-prefill
   of the shipped model), and one head's rows read the same cached keys. */
typedef struct {
    const ManasModel *model;
    const ManasCache *caches;
    const int32_t *positions;
    const int32_t *sources;  /* row k attends as row sources[k] (its cache, position and query); NULL: as row k */
    const float *qkv;
    float *attention, *scores;
    int layer, rows;
    int alone;  /* rows_alone: set by the caller once the rest is */
} Attend;

static inline int source(const Attend *a, int row) { return a->sources ? a->sources[row] : row; }

/* The first position a query at `position` attends over: 0, or in a window layer the oldest of its last `window`
   positions. A window's positions are attended as a whole cache's are from its first: the same arithmetic over
   the keys and values from there, so a prefill's row and a decode step's agree. */
static inline int window_start(const ManasModel *m, int layer, int position) {
    int window = m->layers[layer].window;
    return window > 0 && position >= window ? position + 1 - window : 0;
}

/* What the scores are multiplied by: 1/√hs, or 1/√attention_scalar where the model sets it (Gemma 3 27B). */
static inline float attention_scale(const ManasModel *m) {
    return 1.0f / sqrtf(m->attention_scalar != 0.0f ? m->attention_scalar : (float)m->head_size);
}

/* ROWS rows of one head sharing a cache, positions ascending: each row's weights softmax(q·k / √hs) (into
   weights[k]), then its mix of values (into out[k]). Each row's softmax is exp_below's: its exponentials, their
   sum in double in order, each divided by it; but the rows' sums run side by side, where one row's alone waits
   out each addition's latency, and so do their value mixes. Every row's arithmetic is its own. */
static inline __attribute__((always_inline)) void softmax_rows(int ROWS, const int *positions, const float *tops,
                                                               float *const *weights) {
    double total[ATTEND_ROWS] = {0};
    for (int k = 0; k < ROWS; k++)
        for (int i = 0; i < positions[k]; i += EXP_SPAN)
            exp_span(positions[k] - i < EXP_SPAN ? positions[k] - i : EXP_SPAN, weights[k] + i, tops[k],
                     weights[k] + i);
    for (int t = 0; t < positions[0]; t++)
        for (int k = 0; k < ROWS; k++) total[k] += weights[k][t];
    for (int k = 0; k < ROWS; k++) {
        for (int t = positions[0]; t < positions[k]; t++) total[k] += weights[k][t];
        float sum = (float)total[k];
        for (int t = 0; t < positions[k]; t++) weights[k][t] /= sum;
    }
}

/* ROWS rows of a prefill, one head, positions ascending: the positions they all attend together (from the cached
   keys and values each loaded once for all the rows), each row's later ones alone. */
static inline __attribute__((always_inline)) void attend_rows(int ROWS, int hs, float scale, const int *positions,
                                                              const float *const *q, const float *keys,
                                                              const float *values, int kv_width,
                                                              float *const *weights, float *const *out) {
    int shared = positions[0];
    float tops[ATTEND_ROWS];
    scores_of(ROWS, hs, 0, shared / 4 * 4, q, keys, kv_width, weights);
    for (int k = 0; k < ROWS; k++) {
        scores_of(1, hs, shared / 4 * 4, positions[k], q + k, keys, kv_width, weights + k);
        tops[k] = scale_to_top(positions[k], weights[k], scale);
    }
    softmax_rows(ROWS, positions, tops, weights);
    const float *const *w = (const float *const *)weights;
    for (int k = 0; k < ROWS; k++) memset(out[k], 0, (size_t)hs * sizeof(float));
    mix_of(ROWS, hs, 0, shared, w, values, kv_width, out);
    for (int k = 0; k < ROWS; k++) mix_of(1, hs, shared, positions[k], w + k, values, kv_width, out + k);
}

/* The query heads whose scores a thread holds at once: its share of a decode row's, or ATTEND_ROWS rows. */
static int score_rows(const ManasModel *m) { return m->n_head > ATTEND_ROWS ? m->n_head : ATTEND_ROWS; }

/* Floats from one head's scores to the next's: the window and a cache line. At a whole window apart (a power of
   two) every head's score at position t fell in the same set of the 8-way L1, and a decode step's 9 heads (SmolLM2)
   evicted each other's lines at every position. */
static size_t score_span(const ManasModel *m) { return (size_t)m->block_size + 64 / sizeof(float); }

/* A decode row goes through its cache ATTEND_BLOCK positions at a time, all its heads in each block (a key head's
   query heads ATTEND_ROWS at a time), so the cache is read a block of whole rows at a time, one stream: head by
   head it came in 256-byte pieces 3 KiB apart, at a third of the bandwidth. */
#define ATTEND_BLOCK 16

/* The query heads from h on (before h1) that share h's key head, at most ATTEND_ROWS. */
static int heads_sharing(int h, int h1, int group) {
    int next = (h / group + 1) * group, end = next < h1 ? next : h1;
    return end - h < ATTEND_ROWS ? end - h : ATTEND_ROWS;
}

/* QUERIES query heads sharing a key head over positions t0 .. t1 − 1 (keys, values: that head's at position 0; q,
   weights, out: each query head's): their scores into weights (unscaled), or with `mix` out += weights · v. */
static inline __attribute__((always_inline)) void block_of_heads(int QUERIES, int hs, int mix, int t0, int t1,
                                                                 const float *const *q, const float *keys,
                                                                 const float *values, int kv_width,
                                                                 float *const *weights, float *const *out) {
    if (mix) mix_of(QUERIES, hs, t0, t1, (const float *const *)weights, values, kv_width, out);
    else scores_of(QUERIES, hs, t0, t1, q, keys, kv_width, weights);
}

/* One pass of a decode row over its cache for its heads h0 .. h1 − 1, block by block: their scores, or with `mix`
   their values' sums. */
static void attend_pass(const ManasModel *m, int mix, int positions, const float *q, const float *keys,
                        const float *values, int h0, int h1, float *scores, float *out) {
    int hs = m->head_size, group = m->n_head / m->n_kv_head, kv_width = m->n_kv_head * hs;
    size_t span = score_span(m);
    for (int t0 = 0; t0 < positions; t0 += ATTEND_BLOCK) {
        int t1 = t0 + ATTEND_BLOCK < positions ? t0 + ATTEND_BLOCK : positions;
        for (int h = h0, heads; h < h1; h += heads) {
            heads = heads_sharing(h, h1, group);
            size_t kv = (size_t)(h / group) * hs;
            const float *qs[ATTEND_ROWS];
            float *weights[ATTEND_ROWS], *sums[ATTEND_ROWS];
            for (int k = 0; k < heads; k++) {
                qs[k] = q + (h + k) * hs;
                weights[k] = scores + (h + k - h0) * span;
                sums[k] = out + (h + k) * hs;
            }
            switch (heads) {  /* each count its own code, its sums in registers */
            case 4: block_of_heads(4, hs, mix, t0, t1, qs, keys + kv, values + kv, kv_width, weights, sums); break;
            case 3: block_of_heads(3, hs, mix, t0, t1, qs, keys + kv, values + kv, kv_width, weights, sums); break;
            case 2: block_of_heads(2, hs, mix, t0, t1, qs, keys + kv, values + kv, kv_width, weights, sums); break;
            default: block_of_heads(1, hs, mix, t0, t1, qs, keys + kv, values + kv, kv_width, weights, sums);
            }
        }
    }
}

/* One row's attention for query heads h0 .. h1 − 1 (a decode step's), the same arithmetic as attend_rows' head by
   head: the scores' pass, each head's softmax, the values' pass. keys, values: the layer's cache at position 0;
   q: the row's queries; out: its heads' outputs; scores: (h1 − h0, score_span). */
static void attend_row_by_position(const ManasModel *m, int positions, const float *q, const float *keys,
                                   const float *values, int h0, int h1, float *scores, float *out) {
    int hs = m->head_size;
    size_t span = score_span(m);
    attend_pass(m, 0, positions, q, keys, values, h0, h1, scores, out);
    int same[ATTEND_ROWS];  /* every head's positions: the row's */
    for (int k = 0; k < ATTEND_ROWS; k++) same[k] = positions;
    for (int h = h0; h < h1;) {
        int heads = h1 - h < ATTEND_ROWS ? 1 : ATTEND_ROWS;
        float tops[ATTEND_ROWS], *weights[ATTEND_ROWS];
        for (int k = 0; k < heads; k++) {
            weights[k] = scores + (h + k - h0) * span;
            tops[k] = scale_to_top(positions, weights[k], attention_scale(m));
        }
        if (heads == ATTEND_ROWS) softmax_rows(ATTEND_ROWS, same, tops, weights);
        else softmax_rows(1, same, tops, weights);
        h += heads;
    }
    memset(out + h0 * hs, 0, (size_t)(h1 - h0) * hs * sizeof(float));
    attend_pass(m, 1, positions, q, keys, values, h0, h1, scores, out);
}

/* Whether every row of the call has its cache to itself (a decode step's rows, one or batched, each its own
   sequence's), so none has another row to share a head's keys with. */
static int rows_alone(const Attend *a) {
    for (int row = 1; row < a->rows; row++)
        if (a->caches[source(a, row)].k == a->caches[source(a, row - 1)].k) return 0;
    return 1;
}

/* Tasks are (head, row) pairs, head-major. Where every row has its cache to itself, each row's heads among the
   thread's tasks attend position by position (attend_row_by_position). Otherwise up to ATTEND_ROWS consecutive
   rows of one head that share a cache (a prefill's rows) attend together (attend_rows); fewer, one at a time. */
static void attend_heads(void *context, int begin, int end, int thread) {
    const Attend *a = context;
    const ManasModel *m = a->model;
    int hs = m->head_size, group = m->n_head / m->n_kv_head, kv_width = m->n_kv_head * hs;
    int width = m->n_head * hs, qkv_width = width + 2 * kv_width;
    float *scores = a->scores + (size_t)thread * score_rows(m) * score_span(m);
    if (a->alone) {
        for (int row = 0; row < a->rows && row < end; row++) {
            int h0 = begin > row ? (begin - row + a->rows - 1) / a->rows : 0, h1 = (end - 1 - row) / a->rows + 1;
            if (h0 >= h1) continue;  /* tasks h * rows + row in begin .. end − 1: heads h0 .. h1 − 1 */
            const ManasCache *cache = &a->caches[source(a, row)];
            int position = a->positions[source(a, row)], first = window_start(m, a->layer, position);
            size_t layer_offset = ((size_t)a->layer * cache->capacity + first) * kv_width;
            attend_row_by_position(m, position + 1 - first, a->qkv + (size_t)source(a, row) * qkv_width,
                                   cache->k + layer_offset, cache->v + layer_offset, h0, h1, scores,
                                   a->attention + (size_t)row * width);
        }
        return;
    }
    for (int task = begin; task < end;) {
        int row = task % a->rows, head = task / a->rows, kv_head = head / group, rows = 1;
        const ManasCache *cache = &a->caches[source(a, row)];
        /* rows attend together over positions from 0; a row whose window starts later attends alone, from there */
        int first = window_start(m, a->layer, a->positions[source(a, row)]);
        while (first == 0 && rows < ATTEND_ROWS && task + rows < end && row + rows < a->rows &&
               a->caches[source(a, row + rows)].k == cache->k &&
               a->positions[source(a, row + rows)] >= a->positions[source(a, row + rows - 1)] &&
               window_start(m, a->layer, a->positions[source(a, row + rows)]) == 0)
            rows++;
        size_t layer_offset = ((size_t)a->layer * cache->capacity + first) * kv_width + (size_t)kv_head * hs;
        const float *keys = cache->k + layer_offset, *values = cache->v + layer_offset, *q[ATTEND_ROWS];
        int positions[ATTEND_ROWS];
        float *weights[ATTEND_ROWS], *out[ATTEND_ROWS];
        for (int k = 0; k < rows; k++) {
            positions[k] = a->positions[source(a, row + k)] + 1 - first;
            weights[k] = scores + (size_t)k * score_span(m);
            out[k] = a->attention + (size_t)(row + k) * width + head * hs;
            q[k] = a->qkv + (size_t)source(a, row + k) * qkv_width + head * hs;
        }
        if (rows == ATTEND_ROWS)
            attend_rows(ATTEND_ROWS, hs, attention_scale(m), positions, q, keys, values, kv_width, weights, out);
        else
            for (int k = 0; k < rows; k++)
                attend_rows(1, hs, attention_scale(m), positions + k, q + k, keys, values, kv_width, weights + k,
                            out + k);
        task += rows;
    }
}

/* One head's hs values RMS-normed in place (Qwen3's q_norm and k_norm): rmsnorm's arithmetic, through `squares`. */
static void norm_head(const ManasModel *m, const ManasNorm *norm, float *head, float *squares) {
    rmsnorm(m->head_size, m->norm_eps, norm, head, squares);
    memcpy(head, squares, (size_t)m->head_size * sizeof *head);
}

/* Norm (qk_norm) and rotate (rope) the row's queries and keys, then write its key and value into its cache at its
   position. squares: (hs) scratch. */
static void cache_row(const ManasModel *m, int layer, const ManasCache *cache, int position, const float *angles,
                      float *qkv, float *squares) {
    int hs = m->head_size, kv_width = m->n_kv_head * hs, width = m->n_head * hs;
    const ManasLayer *block = &m->layers[layer];
    if (block->q_norm.weight)
        for (int head = 0; head < m->n_head + m->n_kv_head; head++)
            norm_head(m, head < m->n_head ? &block->q_norm : &block->k_norm, qkv + head * hs, squares);
    if (m->rope && !block->no_rope)
        for (int head = 0; head < m->n_head + m->n_kv_head; head++)
            rotate(rotary_dims(m), m->rope_halves, angles, qkv + head * hs);
    size_t offset = ((size_t)layer * cache->capacity + position) * kv_width;
    memcpy(cache->k + offset, qkv + width, kv_width * sizeof(float));
    memcpy(cache->v + offset, qkv + width + kv_width, kv_width * sizeof(float));
}
