/* A test driver for the native core, built beside it for each target CI checks (tests/test_one_seed.py): other
   instruction sets, compilers, and aarch64 under qemu-user, where Python cannot run cheaply. It reads a model and a
   run from a plain binary dump the Python test writes (write_dump there), runs the core's prefill over the
   prompt, then, per seed, a prefill of the seed's prompt and decode steps with the core's sampler, and prints
   every logit's bits and the drawn tokens: two targets agree when their outputs are equal, byte for byte.

   Build: cc -O3 -march=... -ffp-contract=off -pthread tests/native_driver.c -lm (core.c is included whole, so
   the driver sees its structs and entry points without a header). Usage: native_driver DUMP [THREADS] */

#include "../manas_cli/native/core.c"

#include <stdio.h>
#include <unistd.h>

typedef struct {
    const unsigned char *at, *end;
} Reader;

static void fail(const char *what) {
    fprintf(stderr, "native_driver: %s\n", what);
    exit(2);
}

static void take(Reader *r, void *out, size_t bytes) {
    if ((size_t)(r->end - r->at) < bytes) fail("the dump ends early");
    memcpy(out, r->at, bytes);
    r->at += bytes;
}

static int32_t take_int(Reader *r) {
    int32_t v;
    take(r, &v, sizeof v);
    return v;
}

/* An array: its byte count (int64), then its bytes, copied to aligned memory; NULL where the count is 0. */
static void *take_array(Reader *r) {
    int64_t bytes;
    take(r, &bytes, sizeof bytes);
    if (bytes < 0) fail("a negative array size");
    if (bytes == 0) return NULL;
    void *data = aligned_alloc(64, ((size_t)bytes + 63) & ~(size_t)63);
    if (!data) fail("out of memory");
    take(r, data, (size_t)bytes);
    return data;
}

static ManasNorm take_norm(Reader *r) {
    ManasNorm norm;
    norm.weight = take_array(r);
    norm.bias = take_array(r);
    return norm;
}

/* A linear layer, its weights regrouped into panels as the engine's loader does (native/model.py, pack_panels):
   every target runs the products manas runs. */
static ManasLinear take_linear(Reader *r) {
    ManasLinear linear = {0};
    linear.kind = take_int(r), linear.n_in = take_int(r), linear.n_out = take_int(r), linear.group = take_int(r);
    linear.weight = take_array(r);
    linear.scales = take_array(r);
    linear.zeros = take_array(r);
    linear.bias = take_array(r);
    size_t bytes = manas_panel_bytes(&linear);
    if (bytes) {
        void *panels = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
        if (!panels) fail("out of memory");
        manas_pack(&linear, panels);
        linear.panels = panels;
    }
    return linear;
}

/* Bits of each logit, in hex, one row a line. */
static void print_logits(const char *label, const float *logits, int rows, int vocab) {
    for (int r = 0; r < rows; r++) {
        printf("%s %d:", label, r);
        for (int i = 0; i < vocab; i++) {
            uint32_t bits;
            memcpy(&bits, logits + (size_t)r * vocab + i, sizeof bits);
            printf(" %08x", bits);
        }
        printf("\n");
    }
}

typedef struct {
    const ManasModel *model;
    ManasPool *pool;
    ManasCache cache;
    void *scratch;
} Run;

/* The forward pass of `count` tokens from position `first` of one sequence, the last row's logits (or all rows'
   when all_rows) into logits. */
static void forward(Run *run, const int32_t *tokens, int first, int count, int all_rows, float *logits) {
    int32_t *positions = malloc(sizeof(int32_t) * count), *rows = malloc(sizeof(int32_t) * count);
    ManasCache *caches = malloc(sizeof(ManasCache) * count);
    for (int i = 0; i < count; i++) positions[i] = first + i, rows[i] = i, caches[i] = run->cache;
    int n_logits = all_rows ? count : 1;
    manas_forward(run->model, run->pool, count, tokens, positions, caches, n_logits, all_rows ? rows : rows + count - 1,
                  logits, run->scratch);
    free(positions), free(rows), free(caches);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("usage: native_driver DUMP [THREADS]");
    FILE *file = fopen(argv[1], "rb");
    if (!file) fail("cannot open the dump");
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    unsigned char *bytes = malloc((size_t)size);
    if (!bytes || fread(bytes, 1, (size_t)size, file) != (size_t)size) fail("cannot read the dump");
    fclose(file);
    Reader r = {bytes, bytes + size};
    char magic[8];
    take(&r, magic, sizeof magic);
    if (memcmp(magic, "MANASDMP", 8)) fail("not a dump");

    ManasModel m;
    memset(&m, 0, sizeof m);
    m.vocab_size = take_int(&r), m.block_size = take_int(&r), m.n_layer = take_int(&r), m.n_head = take_int(&r);
    m.n_kv_head = take_int(&r), m.n_embd = take_int(&r), m.head_size = take_int(&r), m.ffn_width = take_int(&r);
    m.rope = take_int(&r), m.gelu_tanh = take_int(&r), m.rms_norm = take_int(&r), m.swiglu = take_int(&r);
    m.integer_products = take_int(&r);
    take(&r, &m.norm_eps, sizeof m.norm_eps);
    take(&r, &m.rope_base, sizeof m.rope_base);
    m.token_embedding = take_array(&r);
    m.position_embedding = take_array(&r);
    ManasLayer *layers = calloc((size_t)m.n_layer, sizeof *layers);
    for (int l = 0; l < m.n_layer; l++) {
        layers[l].ln_attention = take_norm(&r);
        layers[l].qkv = take_linear(&r);
        layers[l].output = take_linear(&r);
        layers[l].ln_ffn = take_norm(&r);
        layers[l].gate = take_linear(&r);
        layers[l].up = take_linear(&r);
        layers[l].down = take_linear(&r);
    }
    m.layers = layers;
    m.final_norm = take_norm(&r);
    m.lm_head = take_linear(&r);
    m.rope_halves = take_int(&r);  /* a GGUF file's: rope pairs, its own token table, keys and values apart */
    m.token_table = take_linear(&r);
    for (int l = 0; l < m.n_layer; l++) layers[l].key = take_linear(&r), layers[l].value = take_linear(&r);
    m.rope_factors = take_array(&r);  /* Llama 3's scaled rope, or NULL; then Qwen3's head norms */
    for (int l = 0; l < m.n_layer; l++) layers[l].q_norm = take_norm(&r), layers[l].k_norm = take_norm(&r);

    int n_prompt = take_int(&r);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    take(&r, prompt, sizeof(int32_t) * (size_t)n_prompt);
    int n_seed_prompt = take_int(&r);
    int32_t *seed_prompt = malloc(sizeof(int32_t) * (size_t)(n_seed_prompt + 1));
    take(&r, seed_prompt, sizeof(int32_t) * (size_t)n_seed_prompt);
    int n_new = take_int(&r);
    ManasSampler sampler = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .repetition = 1.0f};
    take(&r, &sampler.temperature, sizeof sampler.temperature);
    sampler.top_k = take_int(&r);
    take(&r, &sampler.top_p, sizeof sampler.top_p);
    int n_seeds = take_int(&r);
    uint64_t *seeds = malloc(sizeof(uint64_t) * (size_t)n_seeds);
    take(&r, seeds, sizeof(uint64_t) * (size_t)n_seeds);
    if (r.at != r.end) fail("bytes past the run");
    if (n_prompt > m.block_size || n_seed_prompt + n_new > m.block_size) fail("a run past the window");

    int threads = argc > 2 ? atoi(argv[2]) : 1;
    Run run = {&m, threads > 1 ? manas_pool_new(threads, (int)sysconf(_SC_NPROCESSORS_ONLN)) : NULL, {0}, NULL};
    size_t kv = (size_t)m.n_layer * m.block_size * m.n_kv_head * m.head_size;
    run.cache = (ManasCache){calloc(kv, sizeof(float)), calloc(kv, sizeof(float)), m.block_size};
    run.scratch = aligned_alloc(64, (manas_scratch_bytes(&m, m.block_size, threads) + 63) & ~(size_t)63);
    float *logits = malloc(sizeof(float) * (size_t)m.block_size * m.vocab_size);
    void *sample_scratch = malloc(manas_sample_scratch_bytes(m.vocab_size));

    forward(&run, prompt, 0, n_prompt, 1, logits);
    print_logits("prefill", logits, n_prompt, m.vocab_size);

    for (int s = 0; s < n_seeds; s++) {
        sampler.seed = seeds[s];
        int32_t *tokens = malloc(sizeof(int32_t) * (size_t)(n_seed_prompt + n_new));
        memcpy(tokens, seed_prompt, sizeof(int32_t) * (size_t)n_seed_prompt);
        forward(&run, tokens, 0, n_seed_prompt, 0, logits);
        printf("seed %llu:", (unsigned long long)seeds[s]);
        uint64_t hash = 1469598103934665603ull;  /* FNV-1a of every decode step's logits' bits */
        for (int step = 0; step < n_new; step++) {
            ManasRow row = {logits, NULL, 0, NULL, 0, (uint64_t)step};
            ManasDraw draw;
            if (manas_sample(&sampler, &row, m.vocab_size, m.vocab_size, NULL, sample_scratch, &draw))
                fail("logits not finite");
            printf(" %d", draw.token);
            int position = n_seed_prompt + step;
            tokens[position] = draw.token;
            if (step + 1 < n_new) forward(&run, tokens + position, position, 1, 0, logits);
            const unsigned char *b = (const unsigned char *)logits;
            for (size_t i = 0; i < sizeof(float) * (size_t)m.vocab_size; i++) hash = (hash ^ b[i]) * 1099511628211ull;
        }
        printf(" | %016llx\n", (unsigned long long)hash);
        free(tokens);
    }
    return 0;
}
