/* Sampling over one row of logits: repetition, frequency and presence penalties, temperature, top-k, top-p,
   min-p, then the draw from a Philox counter keyed on (seed; position, row), so a seeded text never depends on
   batching or the platform; and the log-probabilities a request asks for.

   Part of the core's one translation unit (core.c includes it last). */

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the counter-based
   generator of Random123, cuRAND and JAX: ten rounds of a keyed bijection of a 128-bit counter. Keyed on the seed
   and counting (position, row), the number a token's draw uses depends on nothing else: not on what ran before it,
   how rows were batched, or the platform (integer arithmetic only). */
static void philox4x32(uint32_t counter[4], uint32_t key0, uint32_t key1) {
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * counter[0], p1 = (uint64_t)0xCD9E8D57u * counter[2];
        uint32_t next[4] = {(uint32_t)(p1 >> 32) ^ counter[1] ^ key0, (uint32_t)p1,
                            (uint32_t)(p0 >> 32) ^ counter[3] ^ key1, (uint32_t)p0};
        memcpy(counter, next, sizeof next);
        key0 += 0x9E3779B9u;  /* the golden ratio and √3 − 1, as 32-bit fractions: Weyl steps of the key */
        key1 += 0xBB67AE85u;
    }
}

/* Philox4x32-10's four words for (counter, key), as Random123's known-answer tests state them. */
EXPORT void manas_philox(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    memcpy(out, counter, 4 * sizeof *out);
    philox4x32(out, key[0], key[1]);
}

/* The uniform number in [0, 1) of a draw: the first 53 bits of Philox(seed; position, row), as a double. */
EXPORT double manas_uniform(uint64_t seed, uint64_t row, uint64_t position) {
    uint32_t counter[4] = {(uint32_t)position, (uint32_t)(position >> 32), (uint32_t)row, (uint32_t)(row >> 32)};
    philox4x32(counter, (uint32_t)seed, (uint32_t)(seed >> 32));
    return (double)((((uint64_t)counter[0] << 32) | counter[1]) >> 11) * 0x1p-53;
}

#define MAX_LOGPROBS 20

/* What engine/sampling.py's Sampler holds, as numbers: 0 top_k, 1 top_p, 0 min_p, 1 repetition mean "none". */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p, min_p;
    float repetition;
    int32_t last_n;  /* the window's last tokens the repetition penalty covers; −1 all of them */
    float frequency, presence;
    uint64_t seed;
    int32_t logprobs;  /* how many of the most likely tokens to report, up to MAX_LOGPROBS */
} ManasSampler;

/* One row's inputs to a draw: its logits, its context and counts, and where its uniform number comes from. */
typedef struct {
    const float *logits;    /* (vocab,); the first n are ids that may be drawn */
    const int32_t *window;  /* (window_len,): the token window the logits follow, the repetition penalty's context */
    int32_t window_len;
    int32_t *counts;        /* (n,): the row's generations per id (frequency, presence), NULL when unused */
    uint64_t row, position; /* the draw's uniform number is manas_uniform(seed, row, position) */
} ManasRow;

typedef struct {
    int32_t token;
    float logprob;  /* the token's, at temperature 1 over the adjusted logits */
    int32_t top_ids[MAX_LOGPROBS];
    float top_logprobs[MAX_LOGPROBS];
} ManasDraw;

/* The largest of n values (none a NaN): each lane keeps its own largest and the lanes meet at the end, as
   attention's scale_to_top does; the same value in any order (up to a zero's sign, which no caller can tell). */
static float largest(int n, const float *x) {
    Lanes top = splat(-INFINITY);
    int i = 0;
    for (; i + LANES <= n; i += LANES) top = larger(top, load_lanes(x + i));
    float lanes[LANES], highest = -INFINITY;
    store_lanes(lanes, top);
    for (int l = 0; l < LANES; l++) highest = lanes[l] > highest ? lanes[l] : highest;
    for (; i < n; i++) highest = x[i] > highest ? x[i] : highest;
    return highest;
}

/* The first id of the largest of n values (none a NaN): a pass for the largest, lane by lane, then one that stops
   at it; a single pass comparing one value at a time waits on each compare (a fifth of a 150,000-token draw). */
static int argmax(int n, const float *x) {
    float top = largest(n, x);
    int i = 0;
    while (i < n - 1 && x[i] != top) i++;
    return i;
}

/* Whether all n values are finite, in a pass that does not stop early (so the compiler vectorizes it). */
static int all_finite(int n, const float *x) {
    int finite = 1;
    for (int i = 0; i < n; i++) finite &= isfinite(x[i]) != 0;
    return finite;
}

/* The logits sampling starts from: undecodable ids −∞, then the repetition penalty over the window's last
   tokens (each distinct token once: divided when positive, multiplied when negative), then the frequency and
   presence penalties over the row's counts of generated tokens. `seen` is vocab bytes of zeros, left zero. */
static void adjust(const ManasSampler *s, float *a, int n, const uint8_t *decodable, const int32_t *window,
                   int window_len, const int32_t *counts, uint8_t *seen) {
    if (decodable)
        for (int i = 0; i < n; i++)
            if (!decodable[i]) a[i] = -INFINITY;
    if (s->repetition != 1.0f && s->last_n != 0) {
        int start = s->last_n < 0 || s->last_n >= window_len ? 0 : window_len - s->last_n;
        for (int t = start; t < window_len; t++) {
            int id = window[t];
            if (id < 0 || id >= n || seen[id]) continue;
            seen[id] = 1;
            a[id] = a[id] > 0 ? a[id] / s->repetition : a[id] * s->repetition;
        }
        for (int t = start; t < window_len; t++)
            if (window[t] >= 0 && window[t] < n) seen[window[t]] = 0;
    }
    if (counts && (s->frequency != 0.0f || s->presence != 0.0f))
        for (int i = 0; i < n; i++)
            a[i] = (a[i] - s->frequency * (float)counts[i]) - s->presence * (float)(counts[i] > 0);
}

/* log-softmax at temperature 1: the chosen token's and the k most likely (ties: the lower id first). */
static void report_logprobs(int n, const float *a, int k, int token, ManasDraw *out) {
    float top = a[argmax(n, a)];
    float lse = top + (float)own_log(exp_below(n, a, top, NULL));
    out->logprob = a[token] - lse;
    int held = 0;  /* top_ids[0 .. held) in order, most likely first: each id goes in after its equals */
    for (int i = 0; i < n; i++) {
        if (held == k && !(a[i] > a[out->top_ids[k - 1]])) continue;
        int j = held < k ? held++ : k - 1;
        for (; j > 0 && a[out->top_ids[j - 1]] < a[i]; j--) out->top_ids[j] = out->top_ids[j - 1];
        out->top_ids[j] = i;
    }
    for (int j = 0; j < k; j++) out->top_logprobs[j] = a[out->top_ids[j]] - lse;
}

/* Restore the min-heap order of heap[0 .. k) below position i. */
static void sift_down(float *heap, int k, int i) {
    for (;;) {
        int smallest = i, left = 2 * i + 1, right = left + 1;
        if (left < k && heap[left] < heap[smallest]) smallest = left;
        if (right < k && heap[right] < heap[smallest]) smallest = right;
        if (smallest == i) return;
        float t = heap[i];
        heap[i] = heap[smallest];
        heap[smallest] = t;
        i = smallest;
    }
}

/* Probabilities sort by a key: the complement of the float's bits (non-negative floats order as their bits do)
   above the id, so ascending keys are descending probabilities, ties by ascending id. */
static int ascending(const void *x, const void *y) {
    uint64_t i = *(const uint64_t *)x, j = *(const uint64_t *)y;
    return (i > j) - (i < j);
}

/* The k-th largest of n values (1 ≤ k < n), in one pass: a min-heap of the k largest so far in `heap`, whose root
   each value is compared with (a value below it, almost all of a vocabulary, costs that one comparison). */
static float kth_largest(int n, const float *x, int k, float *heap) {
    memcpy(heap, x, k * sizeof *heap);
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    for (int i = k; i < n; i++)
        if (x[i] > heap[0]) {
            heap[0] = x[i];
            sift_down(heap, k, 0);
        }
    return heap[0];
}

/* keys[0 .. count) reordered so that its m smallest come first, in no order (quickselect; the keys are distinct). */
static void smallest_first(uint64_t *keys, int count, int m) {
    int lo = 0, hi = count - 1, want = m - 1;
    while (lo < hi) {
        uint64_t pivot = keys[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (keys[i] < pivot) i++;
            while (keys[j] > pivot) j--;
            if (i <= j) {
                uint64_t t = keys[i];
                keys[i++] = keys[j];
                keys[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
}

/* Top-p over the kept ids' keys: zero every probability past the smallest prefix of the sorted probabilities
   whose mass (each p = x / total, summed in that order) reaches top_p; the most likely is always kept. The order
   is a whole sort's, found a block at a time (the block's keys selected, then sorted): a peaked distribution
   stops within its first 64 tokens instead of sorting a vocabulary of 150,000. */
static void keep_top_p(uint64_t *keys, int kept, float *x, double total, float top_p) {
    double before = 0;
    for (int start = 0, block = 64; start < kept; start += block, block *= 4) {
        int count = kept - start < block ? kept - start : block;
        smallest_first(keys + start, kept - start, count);
        qsort(keys + start, count, sizeof *keys, ascending);
        for (int j = start; j < start + count; j++) {
            if (j > 0 && before >= top_p) {
                for (; j < kept; j++) x[(uint32_t)keys[j]] = 0;
                return;
            }
            before += x[(uint32_t)keys[j]] / total;
        }
    }
}

/* e^(x − top), 0 below the exponential's floor: one value of exp_span's. */
static inline float exp_one(float x, float top) {
    float below = x - top;
    return below < EXP_FLOOR ? 0.0f : exponential(below);
}

/* Probabilities of the tempered logits x (their max finite), in place, and the ids that may be drawn: top-k drops
   what is below the k-th largest, top-p keeps the smallest prefix of the sorted probabilities whose mass reaches
   top_p (the most likely token always), min-p drops what is below min_p × the largest. Unnormalized: the draw
   divides by their sum. Returns how many ids top-k keeps, those ids ascending in `ids` (all n without top-k); x
   is 0 at every other id. Only the kept ids' exponentials are computed, each as exp_below computes it, and sums
   run over them in id order: the other terms are exact zeros, so every sum has a whole pass's bits. */
static int filtered_probabilities(const ManasSampler *s, int n, float *x, uint64_t *keys, int32_t *ids) {
    int m = 0;
    if (s->top_k > 0 && s->top_k < n) {
        float kth = kth_largest(n, x, s->top_k, (float *)keys);
        for (int i = 0; i < n; i++) {
            if (x[i] < kth) x[i] = 0;
            else ids[m++] = i;
        }
    } else {
        for (int i = 0; i < n; i++) ids[m++] = i;
    }
    double total = 0;
    if (m == n) {
        total = exp_below(n, x, largest(n, x), x);
    } else {
        float top = x[ids[0]];
        for (int j = 1; j < m; j++) top = x[ids[j]] > top ? x[ids[j]] : top;
        for (int j = 0; j < m; j++) total += x[ids[j]] = exp_one(x[ids[j]], top);
    }
    if (s->top_p < 1.0f) {
        int kept = 0;
        for (int j = 0; j < m; j++) {
            uint32_t bits;
            memcpy(&bits, &x[ids[j]], sizeof bits);
            if (x[ids[j]] > 0) keys[kept++] = (uint64_t)~bits << 32 | (uint32_t)ids[j];
        }
        keep_top_p(keys, kept, x, total, s->top_p);
    }
    if (s->min_p > 0) {
        float largest = 0;
        for (int j = 0; j < m; j++)
            if (x[ids[j]] > largest) largest = x[ids[j]];
        float floor = s->min_p * largest;
        for (int j = 0; j < m; j++)
            if (x[ids[j]] < floor) x[ids[j]] = 0;
    }
    return m;
}

/* Bytes of scratch manas_sample needs for a vocabulary of n. */
EXPORT size_t manas_sample_scratch_bytes(int n) {
    return (size_t)n * (2 * sizeof(float) + sizeof(uint64_t) + sizeof(int32_t) + 1);
}

/* The next token of row r (ManasRow: its vocab logits, of which the first n may be drawn), and with s->logprobs
   its log-probabilities; the drawn token is added to r->counts. Returns 0, or 1 when the logits are not all
   finite (nothing is drawn). */
EXPORT int manas_sample(const ManasSampler *s, const ManasRow *r, int vocab, int n, const uint8_t *decodable,
                        void *scratch, ManasDraw *out) {
    const float *logits = r->logits;
    int32_t *counts = r->counts;
    if (!all_finite(vocab, logits)) return 1;
    uint64_t *keys = scratch;                    /* (n,) top-p's sort keys; top-k's copy of the logits first */
    float *a = (float *)(keys + n), *x = a + n;  /* (n,) each: the adjusted logits; the probabilities */
    int32_t *ids = (int32_t *)(x + n);           /* (n,) the ids top-k keeps */
    uint8_t *seen = (uint8_t *)(ids + n);        /* (n,) the repetition penalty's marks */
    memcpy(a, logits, n * sizeof *a);
    memset(seen, 0, n);
    adjust(s, a, n, decodable, r->window, r->window_len, counts, seen);
    int token = -1;  /* greedy's argmax, found only where it is the answer */
    if (s->temperature > 0) {
        for (int i = 0; i < n; i++) x[i] = a[i] / s->temperature;
        if (isfinite(largest(n, x))) {  /* else too small a temperature to divide by: its limit, the argmax */
            int m = filtered_probabilities(s, n, x, keys, ids);
            double total = 0;
            for (int j = 0; j < m; j++) total += x[ids[j]];
            double target = manas_uniform(s->seed, r->row, r->position) * total, mass = 0;
            for (int j = 0; j < m; j++) {
                if (x[ids[j]] <= 0) continue;
                token = ids[j];
                if ((mass += x[ids[j]]) > target) break;
            }
        }
    }
    if (token < 0) token = argmax(n, a);
    out->token = token;
    int k = s->logprobs < n ? s->logprobs : n;  /* no more alternatives than ids */
    if (k > 0) report_logprobs(n, a, k > MAX_LOGPROBS ? MAX_LOGPROBS : k, token, out);
    if (counts) counts[token]++;
    return 0;
}

/* Each row's log-probability of its target, log softmax(logits)[target], for scoring: `out` doubles. Returns
   the first row whose logits are not all finite, or −1. */
EXPORT int manas_target_logprobs(const float *logits, int rows, int vocab, const int32_t *targets, double *out) {
    for (int r = 0; r < rows; r++) {
        const float *row = logits + (size_t)r * vocab;
        for (int i = 0; i < vocab; i++)
            if (!isfinite(row[i])) return r;
        float top = row[argmax(vocab, row)];
        out[r] = (double)row[targets[r]] - top - own_log(exp_below(vocab, row, top, NULL));
    }
    return -1;
}
