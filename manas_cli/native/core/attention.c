/* Causal attention over each row's KV cache: a row's query heads against its own cached positions 0..position
   only, softmax(q·k / √hs) · v, rows that share a cache (a prefill) taken ATTEND_ROWS at a time so a cached key
   serves several queries, a decode row's heads by position with its cache asked for ahead; then the new key and
   value written into the cache.

   Part of the core's one translation unit (core.c includes it after functions.c). */

/* For each of ROWS rows k sharing the cached values (rows `stride` apart), in ascending order of their
   positions: out[k] = Σ_t weights[k][t] · v_t over its own positions, LANES features at a time in registers, the
   positions summed in order: the same sums whichever rows share the call. */
#define ATTEND_ROWS 4
static inline __attribute__((always_inline)) void mix_values(int ROWS, int hs, const int *positions,
                                                             const float *const *weights, const float *values,
                                                             int stride, float *const *out) {
    int shared = positions[0];  /* the positions every row attends: its rows are in ascending order */
    int i = 0;
    for (; i + LANES <= hs; i += LANES) {
        Lanes sum[ATTEND_ROWS];
        for (int k = 0; k < ROWS; k++) sum[k] = splat(0.0f);
        for (int t = 0; t < shared; t++) {
            Lanes v = load_lanes(values + (size_t)t * stride + i);
            for (int k = 0; k < ROWS; k++) sum[k] = madd(sum[k], splat(weights[k][t]), v);
        }
        for (int k = 0; k < ROWS; k++) {
            for (int t = shared; t < positions[k]; t++)
                sum[k] = madd(sum[k], splat(weights[k][t]), load_lanes(values + (size_t)t * stride + i));
            store_lanes(out[k] + i, sum[k]);
        }
    }
    for (; i < hs; i++)
        for (int k = 0; k < ROWS; k++) {
            float sum = 0.0f;
            for (int t = 0; t < positions[k]; t++) sum = madd1(sum, weights[k][t], values[(size_t)t * stride + i]);
            out[k][i] = sum;
        }
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

/* q·k against the cached keys at positions t .. t + 3 (keys: one head's key at position 0, a position kv_width
   floats on), into scores[t ..]: four at once from a multiple of 4, one at a time past the last whole four. */
static inline void four_scores(int hs, const float *q, const float *keys, int kv_width, int t, float *scores) {
    const float *four[4];
    for (int k = 0; k < 4; k++) four[k] = keys + (size_t)(t + k) * kv_width;
    dot4(hs, q, four, scores + t);
}

static inline float one_score(int hs, const float *q, const float *keys, int kv_width, int t) {
    return dot(hs, q, keys + (size_t)t * kv_width);
}

/* One row's scaled scores over its positions for one head, q·k / √hs, into scores; returns the largest. */
static float attention_scores(int hs, int positions, const float *q, const float *keys, int kv_width, float *scores) {
    int t = 0;
    for (; t + 4 <= positions; t += 4) four_scores(hs, q, keys, kv_width, t, scores);
    for (; t < positions; t++) scores[t] = one_score(hs, q, keys, kv_width, t);
    return scale_to_top(positions, scores, 1.0f / sqrtf((float)hs));
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

static inline __attribute__((always_inline)) void attend_rows(int ROWS, int hs, const int *positions,
                                                              const float *const *q, const float *keys,
                                                              const float *values, int kv_width,
                                                              float *const *weights, float *const *out) {
    float tops[ATTEND_ROWS];
    for (int k = 0; k < ROWS; k++) tops[k] = attention_scores(hs, positions[k], q[k], keys, kv_width, weights[k]);
    softmax_rows(ROWS, positions, tops, weights);
    mix_values(ROWS, hs, positions, (const float *const *)weights, values, kv_width, out);
}

/* How many positions ahead a decode step's attention asks for the cache: the hardware's prefetcher follows one
   stream of whole rows, but not far enough ahead at a row's 3 KiB (GPT-2 shape, int8, 544 positions, 1 thread,
   AMD host: 166 tok/s without, 185–200 at 8 positions, 191 at 4, 170 at 16; 206 at 8 with dot4 inlined). */
#define ATTEND_PREFETCH_POSITIONS 8

/* Ask for the cache lines of x[0 .. n − 1] (a head's keys or values a few positions on). */
static inline void prefetch_floats(const float *x, int n) {
    for (int i = 0; i < n; i += 64 / (int)sizeof(float)) __builtin_prefetch(x + i);
}

/* One row's attention for query heads h0 .. h1 − 1 (a decode step's), the same arithmetic as attend_rows' head by
   head, but each pass over the cache goes position by position through all those heads: the cache is read a
   position's whole row at a time, one stream, where head by head it came in 256-byte pieces 3 KiB apart, at a
   third of the bandwidth (GPT-2-shape int8 decode at 544 positions: 12 GB/s). keys, values: the layer's cache at
   position 0; q: the row's queries; out: its heads' outputs; scores: (h1 − h0, block_size). The values are
   summed into out, which stays in L1: each output lane still adds its positions in order. */
static void attend_row_by_position(const ManasModel *m, int positions, const float *q, const float *keys,
                                   const float *values, int h0, int h1, float *scores, float *out) {
    int hs = m->head_size, group = m->n_head / m->n_kv_head, kv_width = m->n_kv_head * hs, t = 0;
    size_t span = (size_t)m->block_size;
    for (; t + 4 <= positions; t += 4)
        for (int h = h0; h < h1; h++) {
            if (t + 4 + ATTEND_PREFETCH_POSITIONS <= positions)
                for (int k = 0; k < 4; k++)
                    prefetch_floats(keys + (size_t)(t + k + ATTEND_PREFETCH_POSITIONS) * kv_width + h / group * hs, hs);
            four_scores(hs, q + h * hs, keys + h / group * hs, kv_width, t, scores + (h - h0) * span);
        }
    for (; t < positions; t++)
        for (int h = h0; h < h1; h++)
            scores[(h - h0) * span + t] = one_score(hs, q + h * hs, keys + h / group * hs, kv_width, t);
    int same[ATTEND_ROWS];  /* every head's positions: the row's */
    for (int k = 0; k < ATTEND_ROWS; k++) same[k] = positions;
    for (int h = h0; h < h1;) {
        int heads = h1 - h < ATTEND_ROWS ? 1 : ATTEND_ROWS;
        float tops[ATTEND_ROWS], *weights[ATTEND_ROWS];
        for (int k = 0; k < heads; k++) {
            weights[k] = scores + (h + k - h0) * span;
            tops[k] = scale_to_top(positions, weights[k], 1.0f / sqrtf((float)hs));
        }
        if (heads == ATTEND_ROWS) softmax_rows(ATTEND_ROWS, same, tops, weights);
        else softmax_rows(1, same, tops, weights);
        h += heads;
    }
    memset(out + h0 * hs, 0, (size_t)(h1 - h0) * hs * sizeof(float));
    for (t = 0; t < positions; t++)
        for (int h = h0; h < h1; h++) {
            float weight = scores[(h - h0) * span + t], *sum = out + h * hs;
            const float *v = values + (size_t)t * kv_width + h / group * hs;
            if (t + ATTEND_PREFETCH_POSITIONS < positions)
                prefetch_floats(v + (size_t)ATTEND_PREFETCH_POSITIONS * kv_width, hs);
            int i = 0;
            for (; i + LANES <= hs; i += LANES)
                store_lanes(sum + i, madd(load_lanes(sum + i), splat(weight), load_lanes(v + i)));
            for (; i < hs; i++) sum[i] = madd1(sum[i], weight, v[i]);
        }
}

/* The query heads whose scores a thread holds at once: its share of a decode row's, or ATTEND_ROWS rows. */
static int score_rows(const ManasModel *m) { return m->n_head > ATTEND_ROWS ? m->n_head : ATTEND_ROWS; }

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
    float *scores = a->scores + (size_t)thread * score_rows(m) * m->block_size;
    if (a->alone) {
        for (int row = 0; row < a->rows && row < end; row++) {
            int h0 = begin > row ? (begin - row + a->rows - 1) / a->rows : 0, h1 = (end - 1 - row) / a->rows + 1;
            if (h0 >= h1) continue;  /* tasks h * rows + row in begin .. end − 1: heads h0 .. h1 − 1 */
            const ManasCache *cache = &a->caches[source(a, row)];
            size_t layer_offset = (size_t)a->layer * cache->capacity * kv_width;
            attend_row_by_position(m, a->positions[source(a, row)] + 1, a->qkv + (size_t)source(a, row) * qkv_width,
                                   cache->k + layer_offset, cache->v + layer_offset, h0, h1, scores,
                                   a->attention + (size_t)row * width);
        }
        return;
    }
    for (int task = begin; task < end;) {
        int row = task % a->rows, head = task / a->rows, kv_head = head / group, rows = 1;
        const ManasCache *cache = &a->caches[source(a, row)];
        while (rows < ATTEND_ROWS && task + rows < end && row + rows < a->rows &&
               a->caches[source(a, row + rows)].k == cache->k &&
               a->positions[source(a, row + rows)] >= a->positions[source(a, row + rows - 1)])
            rows++;
        size_t layer_offset = (size_t)a->layer * cache->capacity * kv_width + (size_t)kv_head * hs;
        const float *keys = cache->k + layer_offset, *values = cache->v + layer_offset, *q[ATTEND_ROWS];
        int positions[ATTEND_ROWS];
        float *weights[ATTEND_ROWS], *out[ATTEND_ROWS];
        for (int k = 0; k < rows; k++) {
            positions[k] = a->positions[source(a, row + k)] + 1;
            weights[k] = scores + (size_t)k * m->block_size;
            out[k] = a->attention + (size_t)(row + k) * width + head * hs;
            q[k] = a->qkv + (size_t)source(a, row + k) * qkv_width + head * hs;
        }
        if (rows == ATTEND_ROWS)
            attend_rows(ATTEND_ROWS, hs, positions, q, keys, values, kv_width, weights, out);
        else
            for (int k = 0; k < rows; k++)
                attend_rows(1, hs, positions + k, q + k, keys, values, kv_width, weights + k, out + k);
        task += rows;
    }
}

/* Rotate (rope) the row's queries and keys, then write its key and value into its cache at its position. */
static void cache_row(const ManasModel *m, int layer, const ManasCache *cache, int position, const float *angles,
                      float *qkv) {
    int hs = m->head_size, kv_width = m->n_kv_head * hs, width = m->n_head * hs;
    if (m->rope)
        for (int head = 0; head < m->n_head + m->n_kv_head; head++) rotate(hs, angles, qkv + head * hs);
    size_t offset = ((size_t)layer * cache->capacity + position) * kv_width;
    memcpy(cache->k + offset, qkv + width, kv_width * sizeof(float));
    memcpy(cache->v + offset, qkv + width + kv_width, kv_width * sizeof(float));
}
