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

static int argmax(int n, const float *x) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
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

/* Probabilities sort by a key: the complement of the float's bits (non-negative floats order as their bits do)
   above the id, so ascending keys are descending probabilities, ties by ascending id. */
static int ascending(const void *x, const void *y) {
    uint64_t i = *(const uint64_t *)x, j = *(const uint64_t *)y;
    return (i > j) - (i < j);
}

/* The k-th largest of n values (k ≥ 1), by quickselect on a copy in `work`. */
static float kth_largest(int n, const float *x, int k, float *work) {
    memcpy(work, x, n * sizeof *work);
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = work[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (work[i] > pivot) i++;
            while (work[j] < pivot) j--;
            if (i <= j) {
                float t = work[i];
                work[i++] = work[j];
                work[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return work[want];
}

/* Probabilities of the tempered logits x (their max finite), in place: top-k drops what is below the k-th
   largest, top-p keeps the smallest prefix of the sorted probabilities whose mass reaches top_p (the most likely
   token always), min-p drops what is below min_p × the largest. Unnormalized: the draw divides by their sum. */
static void filtered_probabilities(const ManasSampler *s, int n, float *x, uint64_t *keys) {
    if (s->top_k > 0 && s->top_k < n) {
        float kth = kth_largest(n, x, s->top_k, (float *)keys);
        for (int i = 0; i < n; i++)
            if (x[i] < kth) x[i] = -INFINITY;
    }
    double total = exp_below(n, x, x[argmax(n, x)], x);
    if (s->top_p < 1.0f) {
        int kept = 0;
        for (int i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, &x[i], sizeof bits);
            if (x[i] > 0) keys[kept++] = (uint64_t)~bits << 32 | (uint32_t)i;
        }
        qsort(keys, kept, sizeof *keys, ascending);
        double before = 0;
        for (int j = 0; j < kept; j++) {
            uint32_t id = (uint32_t)keys[j];
            double p = x[id] / total;
            if (j > 0 && before >= s->top_p) x[id] = 0;
            before += p;
        }
    }
    if (s->min_p > 0) {
        float floor = s->min_p * x[argmax(n, x)];
        for (int i = 0; i < n; i++)
            if (x[i] < floor) x[i] = 0;
    }
}

/* Bytes of scratch manas_sample needs for a vocabulary of n. */
EXPORT size_t manas_sample_scratch_bytes(int n) { return (size_t)n * (2 * sizeof(float) + sizeof(uint64_t) + 1); }

/* The next token of row r (ManasRow: its vocab logits, of which the first n may be drawn), and with s->logprobs
   its log-probabilities; the drawn token is added to r->counts. Returns 0, or 1 when the logits are not all
   finite (nothing is drawn). */
EXPORT int manas_sample(const ManasSampler *s, const ManasRow *r, int vocab, int n, const uint8_t *decodable,
                        void *scratch, ManasDraw *out) {
    const float *logits = r->logits;
    int32_t *counts = r->counts;
    for (int i = 0; i < vocab; i++)
        if (!isfinite(logits[i])) return 1;
    uint64_t *keys = scratch;
    float *a = (float *)(keys + n), *x = a + n;
    uint8_t *seen = (uint8_t *)(x + n);
    memcpy(a, logits, n * sizeof *a);
    memset(seen, 0, n);
    adjust(s, a, n, decodable, r->window, r->window_len, counts, seen);
    int token = argmax(n, a);
    if (s->temperature > 0) {
        for (int i = 0; i < n; i++) x[i] = a[i] / s->temperature;
        if (isfinite(x[argmax(n, x)])) {  /* else too small a temperature to divide by: its limit, the argmax */
            filtered_probabilities(s, n, x, keys);
            double total = 0;
            for (int i = 0; i < n; i++) total += x[i];
            double target = manas_uniform(s->seed, r->row, r->position) * total, mass = 0;
            for (int i = 0; i < n; i++) {
                if (x[i] <= 0) continue;
                token = i;
                if ((mass += x[i]) > target) break;
            }
        }
    }
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
