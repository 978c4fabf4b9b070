/* manas's native CPU core: the forward pass of torch_engine/model.py's GPT over rows of (token, position, cache).

   One call runs every layer for a set of rows: a prefill is the rows of one prompt sharing one cache, a batched
   decode step is one row per sequence, each with its own cache. Every row's arithmetic is the same whichever
   rows share the call: products sum in a fixed order of lanes written in the code (dots below), attention reads
   exactly the positions up to the row's own, and nothing is fused across rows. So a decode step's logits equal,
   bit for bit, those of the same position in a prefill of the whole window: cached == crop-and-recompute.

   Python owns the tensors (the torch model's own memory), the caches and the scratch; the core allocates
   nothing per call and keeps no globals. Only the manas_ functions are exported. Build (see native/build.py):
   cc -O3 -march=native -ffp-contract=off -fPIC -shared -pthread -fvisibility=hidden core.c -lm

   This file holds the model's structs and its forward pass; the rest is in rooms that it includes, in this
   order, into one translation unit (so every function can inline into its callers, as one file allowed):
     core/pool.c        the thread pool every product, attention and activation splits its rows over
     core/lanes.c       how the core adds (lanes in a fixed order) and reads a weight row from its panels
     core/integer.c     int8 and int4 products in integers over activations quantized per block
     core/products.c    a layer's matrix product: tiles, the float32 decode stream, the scratch
     core/functions.c   the exponential, GELU, SiLU, the norms, the rotary angles
     core/attention.c   causal attention over each row's cache, and writing the cache
     (the forward pass, here)
     core/weights.c     loading: conversions, finiteness, quantized rows' checks, the panels
     core/sampling.c    penalties, temperature, top-k/p, min-p, the Philox draw, log-probabilities */

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h> /* the vector unit's own widening loads and fused multiply-add, where it has them */
#endif

#define EXPORT __attribute__((visibility("default")))
#define MANAS_ABI_VERSION 10
#define MANAS_ARITHMETIC_VERSION 2 /* manas_arithmetic_version */
#define MAX_THREADS 256 /* engine/threads.py's MAX_THREADS: both engines take the same --threads */

/* ---- the model, as Python lays it out (native/binding.py mirrors these structs) ---- */

enum { WEIGHTS_F32 = 0, WEIGHTS_INT8 = 1, WEIGHTS_INT4 = 2, WEIGHTS_GGML = 5 };
/* The products' own kinds for quantized weights times activations quantized per block, in integers
   (ManasModel.integer_products). */
enum { INT8_INTEGER = 3, INT4_INTEGER = 4 };
#define QBLOCK 32  /* activations are quantized per block of 32 values, one float scale each (llama.cpp's q8_0) */
#define INT4_BLOCK 32      /* int4 columns read as one block: 16 bytes, each column pair's low nibble first */
#define INT4_MIDDLE 8      /* the code a group's zero stands for */

typedef struct {
    int32_t kind, n_in, n_out;
    int32_t group;           /* int4: values per scale/zero group along a row, even, dividing n_in; ggml: the
                                block type (core/blocks.c) */
    const void *weight;      /* float32 (out, in); int8 (out, in); int4: uint8 (out, in/2), column 2i low nibble;
                                ggml: (out, in / block values) blocks as a GGUF file stores them */
    const uint16_t *scales;  /* bfloat16: one per row (int8); int4 (out, in/group) */
    const uint16_t *zeros;   /* bfloat16, int4 (out, in/group): the value of code 8 */
    const float *bias;       /* (out,) or NULL */
    const void *panels;      /* the weight rows regrouped for streaming (manas_pack), or NULL: read as stored */
} ManasLinear;

typedef struct { const float *weight, *bias; } ManasNorm;  /* bias may be NULL */

typedef struct {
    ManasNorm ln_attention;
    ManasLinear qkv, output;
    ManasNorm ln_ffn;
    ManasLinear gate, up, down;  /* gate: SwiGLU's (n_out 0 in a GELU MLP) */
    ManasLinear key, value;      /* a GGUF file's own keys and values (qkv then holds the queries), else n_out 0 */
    ManasNorm q_norm, k_norm;    /* (hs): RMSNorm of each query and key head before rope (Qwen3), else weight NULL */
    int32_t no_rope;             /* 1: this layer's queries and keys are not rotated (SmolLM3's every fourth layer) */
    ManasNorm ln_attention_out, ln_ffn_out; /* (C): norms of the attention's and MLP's outputs (Gemma), else NULL */
    int32_t window;              /* > 0: a query attends over its last `window` positions only (Gemma 3's local layers) */
} ManasLayer;

typedef struct {
    int32_t vocab_size, block_size, n_layer, n_head, n_kv_head, n_embd;
    int32_t head_size;   /* hs: n_embd / n_head, unless the model says otherwise (the heads are n_head hs wide) */
    int32_t ffn_width;   /* the MLP's hidden features (4 n_embd in GPT-2) */
    int32_t rope;        /* 1: rotary positions; 0: learned (position_embedding) */
    int32_t gelu_tanh;   /* 1: GPT-2's tanh GELU; 0: the exact erf GELU */
    int32_t rms_norm;    /* 1: RMSNorm (Llama); 0: LayerNorm (GPT-2) */
    int32_t swiglu;      /* 1: down(silu(gate x) · up x) (Llama); 0: down(gelu(up x)) (GPT-2) */
    float norm_eps;
    double rope_base;
    const float *token_embedding, *position_embedding;  /* (vocab, C); (block_size, C) or NULL */
    const ManasLayer *layers;
    ManasNorm final_norm;
    ManasLinear lm_head;
    int32_t integer_products;  /* 1: int8 and int4 weights multiply activations quantized per QBLOCK, in integers */
    int32_t rope_halves;       /* 1: rope pairs x[i] with x[i + hs/2] (a GGUF qwen2's layout); 0: x[2i], x[2i+1] */
    ManasLinear token_table;   /* a GGUF file's token embedding as stored (ggml), when token_embedding is NULL */
    const float *rope_factors; /* (hs / 2): each rope pair's frequency divisor (Llama 3's scaled rope; Gemma 3's
                                  global layers'), or NULL */
    int32_t geglu;             /* 1: down(gelu(gate x) · up x) (Gemma), with swiglu 0 */
    float embedding_scale;     /* the token embedding multiplied by it (Gemma's √C); 0: not scaled */
    double local_rope_base;    /* the rope base of window layers (Gemma 3's 10,000); 0: rope_base */
    int32_t rotary_dims;       /* the first dimensions of each head that rope turns (Phi-4-mini's 96 of 128); 0: all */
    double rope_scale;         /* cos and sin multiplied by it (LongRoPE's attention factor); 0: 1 */
    float attention_scalar;    /* scores scaled by 1/√ of it (Gemma 3 27B's query_pre_attn_scalar, 168); 0: hs */
} ManasModel;

/* One row's KV cache: k and v each [layer][capacity][kv head][head size], float32. */
typedef struct { float *k, *v; int32_t capacity; } ManasCache;

#include "core/pool.c"
#include "core/lanes.c"
#include "core/integer.c"
#include "core/products.c"
#include "core/blocks.c"
#include "core/functions.c"
#include "core/attention.c"

/* ---- the forward pass: embed, then each layer (norm, q|k|v, attention, output, norm, MLP), the last norm
   and the logits ---- */

/* Weight row o of a quantized layer as the float32 values dequantize_rows / dequantize_groups give: q × scale;
   zero + (code − 8) × scale, column 2j in byte j's low nibble, 2j + 1 in its high one. */
static void dequantize_row(const ManasLinear *linear, int o, float *out) {
    for (int i = 0; i < linear->n_in; i++)
        out[i] = linear->kind == WEIGHTS_INT8 ? weight_at(WEIGHTS_INT8, linear, o, i) * bf16_to_float(linear->scales[o])
                                              : weight_at(WEIGHTS_INT4, linear, o, i);
}

/* A token's embedding. A quantized checkpoint stores the tied matrix once, as the output layer's codes: without a
   float table (token_embedding NULL) the row is dequantized from them, the values a float table would hold. */
static void embed(const ManasModel *m, int token, float *x) {
    if (m->token_embedding)
        memcpy(x, m->token_embedding + (size_t)token * m->n_embd, m->n_embd * sizeof *x);
    else if (m->token_table.weight)
        ggml_dequantize_row(&m->token_table, token, x);
    else
        dequantize_row(&m->lm_head, token, x);
    if (m->embedding_scale != 0.0f)
        for (int i = 0; i < m->n_embd; i++) x[i] *= m->embedding_scale;
}

/* out (rows of C) added to x; normed first with `norm` where the layer has one (Gemma's post norms), through
   normed (rows of C). */
static void add_output(const ManasModel *m, const ManasNorm *norm, int rows, const float *out, float *normed,
                       float *x) {
    if (norm->weight) {
        normalize(m, norm, rows, out, normed);
        out = normed;
    }
    for (size_t i = 0; i < (size_t)rows * m->n_embd; i++) x[i] += out[i];
}

/* Rows sources[0..n) of x (rows of C) moved to x's first n rows, through spare (n rows): a source may be any row,
   and each row's values are kept as they are, so a row's arithmetic after the move is what it would have been. */
static void gather_rows(int C, int n, const int32_t *sources, float *x, float *spare) {
    for (int k = 0; k < n; k++) memcpy(spare + (size_t)k * C, x + (size_t)sources[k] * C, (size_t)C * sizeof(float));
    memcpy(x, spare, (size_t)n * C * sizeof(float));
}

/* Lays Scratch's parts out from base's first cache line, one after the other, each on its own lines; their bytes in
   all, with room to reach that first line. With base NULL, only counts them. The caller's buffer (ctypes') starts
   16 bytes past a line, and there every 64-byte load of a row read two lines (float32 pp64 on the Intel host:
   GPT-2-124M shape +9-21%, GPT-2-medium +17-21%). */
static size_t carve(Scratch *s, const ManasModel *m, int rows, int threads, char *base) {
    size_t R = (size_t)rows, C = (size_t)m->n_embd, hs = (size_t)m->head_size, A = (size_t)m->n_head * hs;
    size_t F = (size_t)m->ffn_width, W = C > A ? C : A;
    W = W > F ? W : F;
    struct { float **part; size_t floats; } table[] = {
        {&s->x, R * C},
        {&s->h, R * C},
        {&s->qkv, R * (A + 2 * (size_t)m->n_kv_head * hs)},
        {&s->attention, R * A},
        {&s->hidden, R * F},
        {&s->gated, m->swiglu || m->geglu ? R * F : 0},
        {&s->reordered, R * W},
        {&s->angles, R * hs},
        {&s->local_angles, m->local_rope_base != 0.0 ? R * hs : 0},
        {&s->normed, R * C},
        {&s->squares, hs},
        {&s->tiles, (size_t)threads * TILE * W},
        {&s->scores, (size_t)threads * score_rows(m) * score_span(m)},
        {&s->quantized, R * quantized_floats((int)W)},
    };
    char *first = base ? (char *)(((uintptr_t)base + 63) & ~(uintptr_t)63) : NULL;
    size_t offset = 0;
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        if (base) *table[i].part = (float *)(first + offset);
        offset += (table[i].floats * sizeof(float) + 63) & ~(size_t)63;
    }
    return 63 + offset;
}

EXPORT int manas_abi_version(void) { return MANAS_ABI_VERSION; }

/* The version of the core's arithmetic: what a seeded text depends on besides the model, the prompt and the
   settings. Any change to how a value is computed (an operation's order, a function's polynomial) bumps it, and
   changes seeded texts (docs/native.md). */
EXPORT int manas_arithmetic_version(void) { return MANAS_ARITHMETIC_VERSION; }

/* x·y + z as two roundings, as the core is compiled (-ffp-contract=off): the self-test checks that the compiler
   did not fuse it (native/build.py), which would change products the code writes unfused. */
EXPORT float manas_contraction_probe(float x, float y, float z) { return x * y + z; }

/* Bytes of scratch manas_forward needs for `rows` rows on a pool of `threads`. */
EXPORT size_t manas_scratch_bytes(const ManasModel *m, int rows, int threads) {
    Scratch s;
    return carve(&s, m, rows, threads, NULL);
}

/* The forward pass of `rows` rows: row r is token tokens[r] at position positions[r], attending over
   caches[r]'s positions up to its own (earlier positions must be cached already, or be earlier rows of this
   call); each row's key and value are written into its cache. The logits of rows logit_rows[0..n_logits) go to
   logits (n_logits, vocab), n_logits ≤ rows; past its keys and values, the last layer runs those rows alone. */
EXPORT void manas_forward(const ManasModel *m, ManasPool *pool, int rows, const int32_t *tokens,
                         const int32_t *positions, const ManasCache *caches, int n_logits,
                         const int32_t *logit_rows, float *logits, void *scratch) {
    Scratch s;
    carve(&s, m, rows, pool ? pool->threads : 1, scratch);
    int C = m->n_embd, hs = m->head_size, qkv_width = (m->n_head + 2 * m->n_kv_head) * hs;
    for (int r = 0; r < rows; r++) {
        float *x = s.x + (size_t)r * C;
        embed(m, tokens[r], x);
        if (m->rope) {
            rope_angles(m, m->rope_base, m->rope_factors, positions[r], s.angles + (size_t)r * hs);
            if (m->local_rope_base != 0.0)  /* a window layer's own rope, unscaled (Gemma 3's local layers) */
                rope_angles(m, m->local_rope_base, NULL, positions[r], s.local_angles + (size_t)r * hs);
        } else {
            const float *position = m->position_embedding + (size_t)positions[r] * C;
            for (int i = 0; i < C; i++) x[i] += position[i];
        }
    }
    for (int layer = 0; layer < m->n_layer; layer++) {
        const ManasLayer *block = &m->layers[layer];
        normalize(m, &block->ln_attention, rows, s.x, s.h);
        if (block->key.n_out) {  /* a GGUF file's queries, keys and values, each its own type, side by side */
            int A = m->n_head * hs, kv = m->n_kv_head * hs;
            matmul(pool, &s, &block->qkv, m->integer_products, s.h, s.qkv, qkv_width, rows);
            matmul(pool, &s, &block->key, m->integer_products, s.h, s.qkv + A, qkv_width, rows);
            matmul(pool, &s, &block->value, m->integer_products, s.h, s.qkv + A + kv, qkv_width, rows);
        } else {
            matmul(pool, &s, &block->qkv, m->integer_products, s.h, s.qkv, qkv_width, rows);
        }
        const float *angles = block->window && m->local_rope_base != 0.0 ? s.local_angles : s.angles;
        for (int r = 0; r < rows; r++)
            cache_row(m, layer, &caches[r], positions[r], angles + (size_t)r * hs, s.qkv + (size_t)r * qkv_width,
                      s.squares);
        /* Past its keys and values (every row's, cached), the last layer feeds only the logits: it runs on the
           logit rows alone (a prefill's last), gathered to the front. */
        int last = layer == m->n_layer - 1, kept = last ? n_logits : rows;
        if (last) gather_rows(C, n_logits, logit_rows, s.x, s.h);
        Attend attend = {m, caches, positions, last ? logit_rows : NULL, s.qkv, s.attention, s.scores, layer, kept, 0};
        attend.alone = rows_alone(&attend);
        parallel_for(pool, attend_heads, &attend, kept * m->n_head);
        matmul(pool, &s, &block->output, m->integer_products, s.attention, s.h, C, kept);
        add_output(m, &block->ln_attention_out, kept, s.h, s.normed, s.x);
        normalize(m, &block->ln_ffn, kept, s.x, s.h);
        matmul(pool, &s, &block->up, m->integer_products, s.h, s.hidden, m->ffn_width, kept);
        int gated = m->swiglu || m->geglu;
        if (gated) matmul(pool, &s, &block->gate, m->integer_products, s.h, s.gated, m->ffn_width, kept);
        Activate activate = {s.hidden, gated ? s.gated : NULL, m->ffn_width, m->gelu_tanh, m->geglu};
        parallel_for(pool, activate_rows, &activate, kept);
        matmul(pool, &s, &block->down, m->integer_products, s.hidden, s.h, C, kept);
        add_output(m, &block->ln_ffn_out, kept, s.h, s.normed, s.x);
    }
    normalize(m, &m->final_norm, n_logits, s.x, s.h);
    matmul(pool, &s, &m->lm_head, m->integer_products, s.h, logits, m->vocab_size, n_logits);
}

#include "core/weights.c"
#include "core/sampling.c"
