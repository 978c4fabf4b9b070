/* manas's native CPU core: the forward pass of torch_engine/model.py's GPT over rows of (token, position, cache).

   One call runs every layer for a set of rows: a prefill is the rows of one prompt sharing one cache, a batched
   decode step is one row per sequence, each with its own cache. Every row's arithmetic is the same whichever
   rows share the call: products sum in a fixed order of lanes written in the code (dots below), attention reads
   exactly the positions up to the row's own, and nothing is fused across rows. So a decode step's logits equal,
   bit for bit, those of the same position in a prefill of the whole window: cached == crop-and-recompute.

   Python owns the tensors (the torch model's own memory), the caches and the scratch; the core allocates
   nothing per call and keeps no globals. Only the manas_ functions are exported. Build (see native/build.py):
   cc -O3 -march=native -ffp-contract=off -fPIC -shared -pthread -fvisibility=hidden core.c -lm */

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
#define MANAS_ABI_VERSION 7
#define MANAS_ARITHMETIC_VERSION 2 /* manas_arithmetic_version */
#define MAX_THREADS 256 /* engine/threads.py's MAX_THREADS: both engines take the same --threads */

/* ---- the model, as Python lays it out (native/binding.py mirrors these structs) ---- */

enum { WEIGHTS_F32 = 0, WEIGHTS_INT8 = 1, WEIGHTS_INT4 = 2 };
/* The products' own kinds for quantized weights times activations quantized per block, in integers
   (ManasModel.integer_products). */
enum { INT8_INTEGER = 3, INT4_INTEGER = 4 };
#define QBLOCK 32  /* activations are quantized per block of 32 values, one float scale each (llama.cpp's q8_0) */
#define INT4_BLOCK 32      /* int4 columns read as one block: 16 bytes, each column pair's low nibble first */
#define INT4_MIDDLE 8      /* the code a group's zero stands for */

typedef struct {
    int32_t kind, n_in, n_out;
    int32_t group;           /* int4: values per scale/zero group along a row, even, dividing n_in (else unused) */
    const void *weight;      /* float32 (out, in); int8 (out, in); int4: uint8 (out, in/2), column 2i low nibble */
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
} ManasModel;

/* One row's KV cache: k and v each [layer][capacity][kv head][head size], float32. */
typedef struct { float *k, *v; int32_t capacity; } ManasCache;

/* ---- threads: a small pool of its own (torch's OpenMP runtime must stay the only one in the process) ---- */

typedef void (*Task)(void *context, int begin, int end, int thread);

typedef struct ManasPool {
    int threads;
    int spin;  /* 0: more threads than cores; workers and the caller sleep between jobs instead of spinning */
    pthread_t workers[MAX_THREADS];
    pthread_mutex_t lock;
    pthread_cond_t wake, done;  /* a job for the workers; the last worker's share finished (spin == 0) */
    atomic_uint generation;  /* bumped for every job */
    atomic_int pending;      /* workers still running the current job */
    atomic_int sleepers;
    atomic_int stopping;
    Task task;
    void *context;
    int items;
} ManasPool;

typedef struct { ManasPool *pool; int index; } Worker;

/* Spinning hands the next product over in well under a microsecond, where waking a sleeping thread takes tens
   of microseconds (more in a virtual machine): a worker spins through the gap between two tokens (sampling, in
   Python), and sleeps after SPIN_NS without a job, so an idle pool (between requests) costs no CPU. With more
   threads than cores, a spinning thread would hold a core the thread it waits for needs, for a whole time slice
   (3 threads on 2 cores: a decode step 100× as long), so such a pool never spins: every wait sleeps. */
#define SPIN_NS 2000000L

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void slice(int items, int parts, int part, int *begin, int *end) {
    *begin = (int)((long)items * part / parts);
    *end = (int)((long)items * (part + 1) / parts);
}

static void *worker_main(void *argument) {
    ManasPool *pool = ((Worker *)argument)->pool;
    int index = ((Worker *)argument)->index;
    free(argument);
    unsigned seen = 0;
    for (;;) {
        for (long start = now_ns(), spin = 1; pool->spin && atomic_load(&pool->generation) == seen; spin++) {
            cpu_relax();
            if (spin % 256 == 0 && now_ns() - start > SPIN_NS) break;
        }
        if (atomic_load(&pool->generation) == seen) {
            pthread_mutex_lock(&pool->lock);
            atomic_fetch_add(&pool->sleepers, 1);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stopping))
                pthread_cond_wait(&pool->wake, &pool->lock);
            atomic_fetch_sub(&pool->sleepers, 1);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->stopping)) return NULL;
        seen = atomic_load(&pool->generation);
        int begin, end;
        slice(pool->items, pool->threads, index, &begin, &end);
        if (begin < end) pool->task(pool->context, begin, end, index);
        if (atomic_fetch_sub(&pool->pending, 1) == 1 && !pool->spin) {  /* the last share: wake the caller */
            pthread_mutex_lock(&pool->lock);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->lock);
        }
    }
}

/* task(context, begin, end, thread) over items split evenly: the calling thread takes the first share. */
static void parallel_for(ManasPool *pool, Task task, void *context, int items) {
    if (!pool || pool->threads == 1 || items < 2) {
        task(context, 0, items, 0);
        return;
    }
    pool->task = task, pool->context = context, pool->items = items;
    atomic_store(&pool->pending, pool->threads - 1);
    atomic_fetch_add(&pool->generation, 1);
    if (atomic_load(&pool->sleepers)) {  /* seq_cst on both sides: a worker going to sleep now sees the new job */
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    int begin, end;
    slice(items, pool->threads, 0, &begin, &end);
    task(context, begin, end, 0);
    if (!pool->spin) {  /* the count is read under the lock the last worker signals under: no wake-up is lost */
        pthread_mutex_lock(&pool->lock);
        while (atomic_load(&pool->pending)) pthread_cond_wait(&pool->done, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
        return;
    }
    for (long spin = 1; atomic_load(&pool->pending); spin++)
        if (spin % 1024) cpu_relax(); else sched_yield();  /* a worker descheduled on a busy machine gets its turn */
}

/* A pool of `threads` (the caller one of them); `cores`: the cores this process may run on, to know whether
   its threads may spin. */
EXPORT ManasPool *manas_pool_new(int threads, int cores) {
    if (threads < 1 || threads > MAX_THREADS) return NULL;
    ManasPool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->threads = 1;
    pool->spin = threads <= cores;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    for (int i = 1; i < threads; i++) {
        Worker *worker = malloc(sizeof *worker);
        if (!worker) break;
        *worker = (Worker){pool, i};
        if (pthread_create(&pool->workers[i], NULL, worker_main, worker)) { free(worker); break; }
        pool->threads = i + 1;
    }
    return pool;
}

EXPORT void manas_pool_free(ManasPool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stopping, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->threads; i++) pthread_join(pool->workers[i], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool);
}

/* ---- arithmetic ---- */

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

/* The bytes of one weight row as stored: n_in float32 values, int8 codes, or int4 nibble pairs. */
static inline size_t row_bytes(const ManasLinear *linear) {
    size_t n = (size_t)linear->n_in;
    return linear->kind == WEIGHTS_F32 ? n * sizeof(float) : linear->kind == WEIGHTS_INT8 ? n : n / 2;
}

/* Where weight row o is read: byte b of it at start + b / PANEL_UNIT × stride + b % PANEL_UNIT. Every read of a
   row (a chunk, a block, a group) lies within one unit. */
typedef struct {
    const uint8_t *start;
    size_t stride;
} Row;

static inline Row weight_row(const ManasLinear *linear, size_t o) {
    size_t bytes = row_bytes(linear);
    if (linear->panels)
        return (Row){(const uint8_t *)linear->panels + o / TILE * TILE * bytes + o % TILE * PANEL_UNIT,
                     TILE * PANEL_UNIT};
    return (Row){(const uint8_t *)linear->weight + o * bytes, PANEL_UNIT};
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

/* A block of QBLOCK values, `count` of them x's (the rest zeros), quantized: codes q = round(x · 127 / max|x|) in
   [−127, 127], and its scale d = max|x| / 127 returned, d·q ≈ x. Written in loops of fixed length with no early
   exit, so they vectorize (a max and a rounding are exact in any order). A NaN or an infinity leaves the codes 0
   and the scale NaN or infinite, so the product is not finite and the logits' check still catches it. */
static float quantize_block(const float *x, int count, int8_t *codes) {
    float block[QBLOCK] = {0}, largest = 0.0f;
    memcpy(block, x, (size_t)count * sizeof *block);
    int not_a_number = 0;
    for (int j = 0; j < QBLOCK; j++) {
        float a = fabsf(block[j]);
        largest = a > largest ? a : largest;
        not_a_number |= a != a;
    }
    largest = not_a_number ? NAN : largest;
    float inverse = largest > 0.0f && largest <= FLT_MAX ? 127.0f / largest : 0.0f;
    for (int j = 0; j < QBLOCK; j++) codes[j] = (int8_t)nearbyintf(inverse > 0.0f ? block[j] * inverse : 0.0f);
    return largest / 127.0f;
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
   of count < QGROUP columns (int4 takes whole groups). `prefetch`: how far ahead to ask for the rows, or 0;
   `scales`: int4's (int4_groups). The tile's weight rows are unpacked first, then each row of x meets them all,
   so one row of x is live at a time: taken the other way round, GCC held all four rows of x and spilled a 4 × 4
   tile's lanes every group (GPT-2-shape int8 pp64 on AVX-512 +8% on 1 thread, +2% on 2). Every loop over the
   tile is unrolled by force: where GCC left one a loop, the tile's lanes lived in memory, each multiply-add
   between a load and a store (GPT-2-shape pp64 on an AVX-512 host, with int4's zeros apart: int4 +32%, int8
   +21%). */
static inline __attribute__((always_inline)) void group_dots(int kind, int RT, int OT, const Row *rows,
                                                             const float *const *x, size_t g, int count,
                                                             size_t prefetch, const uint16_t *scales,
                                                             Lanes lane[MAX_ROW_TILE][TILE]) {
    int int4 = kind == INT4_INTEGER;
    const int8_t *w[TILE];
    Bytes u[TILE];
    Lanes scale[TILE];
#pragma GCC unroll 8
    for (int o = 0; o < OT; o++) {
        w[o] = (const int8_t *)row_byte(rows[o], int4 ? g * QGROUP / 2 : g * QGROUP);
        if (prefetch) __builtin_prefetch(w[o] + prefetch);  /* that row, as far along */
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
       next tile, 10% more again for the one after; int4's shorter rows need the distance). A hint, not a read. */
    int ahead = o0 + (1 + PREFETCH_TILES) * OT <= linear->n_out;
    size_t prefetch = ahead ? PREFETCH_TILES * OT * row_bytes(linear) : 0;
    Row rows[TILE];
#pragma GCC unroll 8
    for (int o = 0; o < OT; o++) rows[o] = weight_row(linear, (size_t)(o0 + o));
    for (size_t g = 0; g < whole; g++) group_dots(kind, RT, OT, rows, x, g, 0, prefetch, scales, lane);
    if (whole * QGROUP < n)  /* int8 only: int4 takes whole groups */
        group_dots(kind, RT, OT, rows, x, whole, (int)(n - whole * QGROUP), 0, scales, lane);
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

/* dot(n, a, b[k]) for four vectors b, each the same arithmetic as dot's, reduced together (attention's q against
   four cached keys). */
static void dot4(int n, const float *a, const float *const *b, float *out) {
    Lanes lanes[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        Lanes x = load_lanes(a + i);
        for (int k = 0; k < 4; k++) lanes[k] = madd(lanes[k], x, load_lanes(b[k] + i));
    }
    for (int k = 0; k < 4 && i < n; k++) {
        float tail[LANES];
        store_lanes(tail, lanes[k]);
        for (int l = 0; i + l < n; l++) tail[l] = madd1(tail[l], a[i + l], b[k][i + l]);
        lanes[k] = load_lanes(tail);
    }
    sum_lanes4(lanes, out);
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
    float *y;        /* (rows, n_out) */
    int rows;
    float *tiles;    /* per thread, TILE rows of n_in floats: a tile of int4 weights dequantized (a float prefill),
                        or its rows' scales and zeros (int4_groups) where the layer has no panels */
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

/* Output features o0 .. o0 + count − 1 for rows r_begin .. r_end − 1, row_tile(kind) rows at a time, each weight
   load serving them all; the weights are read from rows w0.. of `weights` (the layer itself, or that tile of it
   dequantized). A short tile of rows repeats its last row to fill the tile and drops those outputs: each output is
   the same sum whatever tile computes it. */
static inline __attribute__((always_inline)) void matmul_tile(int kind, const Matmul *m, const ManasLinear *weights,
                                                              int w0, int o0, int count, const uint16_t *grouped,
                                                              int r_begin, int r_end, Ahead *ahead) {
    int n_out = m->linear->n_out, RT = row_tile(kind);
    for (int r0 = r_begin; r0 < r_end; r0 += RT) {
        if (ahead) ask_ahead(ahead);  /* tested here: tested inside, GCC spilled int8 float products' lanes */
        int rows = r_end - r0 < RT ? r_end - r0 : RT;
        const float *x[MAX_ROW_TILE];
        for (int r = 0; r < RT; r++) x[r] = m->x + (size_t)(r0 + (r < rows ? r : rows - 1)) * m->stride;
        float out[MAX_ROW_TILE][TILE];
        if (rows > 1 && count == TILE) {
            for (int c = 0; c < TILE; c += COLUMN_TILE) {
                float part[MAX_ROW_TILE][TILE];
                dots(kind, RT, COLUMN_TILE, weights, x, w0 + c, grouped, part);
                for (int r = 0; r < rows; r++)
                    for (int o = 0; o < COLUMN_TILE; o++) out[r][c + o] = part[r][o];
            }
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
                m->y[(size_t)(r0 + r) * n_out + o0 + o] = finish(m->linear, o0 + o, out[r][o]);
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
    return ((size_t)linear->n_out + TILE - 1) / TILE * TILE * row_bytes(linear);
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

/* A float32 decode step's tiles begin .. end − 1 from their panels: y[o] = x · w[o], each in dots' lane order
   (sum_lanes4 adds as sum_lanes does, so a last tile's rows past n_out, zeros in its panel, change no sum).
   Consecutive panels are one stream, read from one pointer with nothing between tiles but their sums, and asked
   for twice ahead of the reads, into L1 and into L2 (a hint, not a read). A layer has panels only where its rows
   are whole PANEL_UNITs (manas_panel_bytes), so n_in is a multiple of LANES and the chunks leave no tail. */
static __attribute__((noinline)) void float32_decode(const Matmul *m, int begin, int end) {
    const ManasLinear *linear = m->linear;
    int chunks = linear->n_in / LANES;
    const float *panel = (const float *)linear->panels + (size_t)begin * TILE * linear->n_in;  /* (TILE, n_in) */
    for (int tile = begin; tile < end; tile++) {
        Lanes lane[TILE];
        for (int o = 0; o < TILE; o++) lane[o] = splat(0.0f);
        for (int c = 0; c < chunks; c++, panel += TILE * LANES) {
            for (int o = 0; o < TILE; o++) {
                __builtin_prefetch(panel + (F32_NEAR_CHUNKS * TILE + o) * LANES, 0, 3);
                __builtin_prefetch(panel + (F32_FAR_CHUNKS * TILE + o) * LANES, 0, 2);
            }
            Lanes xs = load_lanes(m->x + c * LANES);
            for (int o = 0; o < TILE; o++) lane[o] = madd(lane[o], xs, load_lanes(panel + o * LANES));
        }
        float out[TILE];
        sum_lanes4(lane, out);
        for (int o = 0, o0 = tile * TILE; o < TILE && o0 + o < linear->n_out; o++)
            m->y[o0 + o] = finish(linear, o0 + o, out[o]);
    }
}

static void matmul_tiles(void *context, int begin, int end, int thread) {
    const Matmul *m = context;
    if (m->kind == WEIGHTS_F32 && m->rows == 1 && m->linear->panels) {
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
    float *gated;      /* (rows, F): SwiGLU's gate, before it multiplies hidden */
    float *reordered;  /* (rows, W): an int4 product's input in its blocks' column order (int4_input) */
    float *angles;     /* (rows, hs): the rotary angles of each row's position */
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

static void prepare_rows(void *context, int begin, int end, int thread) {
    (void)thread;
    const Prepare *p = context;
    int n = p->linear->n_in, int4 = p->linear->kind == WEIGHTS_INT4;
    for (size_t r = (size_t)begin; r < (size_t)end; r++) {
        const float *x = p->x + r * n;
        if (int4) {
            int4_input(n, x, p->reordered + r * n);
            x = p->reordered + r * n;
        }
        if (p->quantized)  /* offset: what makes the weights unsigned (int8_bytes, int4_bytes) */
            quantize_row(n, x, int4 ? INT4_MIDDLE : 128, p->quantized + r * quantized_floats(n));
    }
}

static void matmul(ManasPool *pool, const Scratch *s, const ManasLinear *linear, int integer, const float *x,
                   float *y, int rows) {
    int n = linear->n_in, kind = linear->kind;
    int in_integers = integer && (kind == WEIGHTS_INT8 || (kind == WEIGHTS_INT4 && int4_integer(linear)));
    if (kind == WEIGHTS_INT4 || in_integers) {
        Prepare prepare = {linear, x, s->reordered, in_integers ? s->quantized : NULL};
        parallel_for(pool, prepare_rows, &prepare, rows);
    }
    size_t stride = in_integers ? quantized_floats(n) : (size_t)n;
    if (in_integers) kind = kind == WEIGHTS_INT8 ? INT8_INTEGER : INT4_INTEGER;
    x = in_integers ? s->quantized : linear->kind == WEIGHTS_INT4 ? s->reordered : x;
    Matmul m = {linear, kind, x, stride, y, rows, s->tiles};
    parallel_for(pool, matmul_tiles, &m, (linear->n_out + TILE - 1) / TILE);
}

/* e^x to about 1 ulp without a call, so the loops over it (softmax, GELU) vectorize: x = k ln2 + r with
   |r| ≤ ln2/2 (ln2 split in two for an exact product), Cephes' polynomial for e^r, then 2^k in the exponent bits.
   Clamped to the range where 2^k is a normal float: e^EXP_FLOOR ≈ 1e-38 stands for 0. */
#define EXP_FLOOR -87.3f
#define EXP_CEILING 88.3f
static inline float exponential(float x) {
    x = x < EXP_FLOOR ? EXP_FLOOR : x > EXP_CEILING ? EXP_CEILING : x;
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (k == k ? (int32_t)k + 127 : 127) << 23;  /* a NaN x stays NaN (p is), never an integer */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* GPT-2's GELU, 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), with tanh(u) = 1 − 2 / (e^{2u} + 1): the error is
   absolute, about 1e-7, which is all 1 + tanh needs; or the exact GELU, 0.5 x (1 + erf(x / √2)). */
/* erf(x) for GELU's exact form, from the core's exponential: Numerical Recipes' erfc (a Chebyshev fit,
   fractional error below 1.2e-7 everywhere), erf = 1 − erfc, odd. Its absolute error (~1e-7) is what 1 + erf(x)
   needs; a libm's erff would differ from platform to platform in its last bits. */
static inline float own_erf(float x) {
    float z = fabsf(x), t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    float erfc = t * exponential(-z * z + p);
    return x < 0 ? erfc - 1.0f : 1.0f - erfc;
}

/* The rotary angles' functions in double, the core's own (their series in +, −, ×, ÷, each rounded as IEEE 754
   says on every CPU): e^x for |x| < 700 (x = k ln2 + r, ln2 in two parts, r's Taylor series to r^13, 2^k exact);
   ln x for x > 0 (x = m 2^e, ln m = 2 atanh((m − 1)/(m + 1)) by its series); cos and sin of an angle up to
   ~10^6 (π/2 in three parts, Cody and Waite, then Taylor series on |r| ≤ π/4). Each to about 1 ulp of double,
   far below the float32 the angles are stored in. */
static double own_exp(double x) {
    double k = nearbyint(x * 1.4426950408889634);
    double r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double term = 1.0, sum = 1.0;
    for (int i = 1; i <= 13; i++) term = term * r / i, sum += term;
    return ldexp(sum, (int)k);
}

static double own_log(double x) {
    if (!(x > 0) || x > DBL_MAX) return x == 0 ? -INFINITY : x > 0 ? x : NAN;  /* +inf stays; NaN and x < 0: NaN */
    int e;
    double m = frexp(x, &e);  /* m in [0.5, 1): exact */
    if (m < 0.70710678118654752) m *= 2.0, e -= 1;
    double s = (m - 1.0) / (m + 1.0), s2 = s * s, term = s, sum = 0.0;
    for (int k = 1; k <= 31; k += 2) sum += term / k, term *= s2;
    return 2.0 * sum + e * 6.93147180559945286227e-01;
}

static void own_sincos(double a, double *sine, double *cosine) {
    double k = nearbyint(a * 6.36619772367581382433e-01);  /* a / (π/2) */
    double r = ((a - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) - k * 2.02226624871116645580e-21;
    double r2 = r * r, s = r, c = 1.0, term_s = r, term_c = 1.0;
    for (int i = 1; i <= 10; i++) {
        term_s = -term_s * r2 / ((2 * i) * (2 * i + 1)), s += term_s;
        term_c = -term_c * r2 / ((2 * i - 1) * (2 * i)), c += term_c;
    }
    long quadrant = (long)fmod(k, 4.0);
    quadrant = quadrant < 0 ? quadrant + 4 : quadrant;
    *sine = quadrant == 0 ? s : quadrant == 1 ? c : quadrant == 2 ? -s : -c;
    *cosine = quadrant == 0 ? c : quadrant == 1 ? -s : quadrant == 2 ? -c : s;
}

/* e^(x[i] − top) for the count ≤ EXP_SPAN values x into out (which may be x), 0 below exponential's floor: a loop
   of fixed length, which vectorizes. */
#define EXP_SPAN 64
static void exp_span(int count, const float *x, float top, float *out) {
    float e[EXP_SPAN] = {0};
    memcpy(e, x, (size_t)count * sizeof *e);
    for (int j = 0; j < EXP_SPAN; j++) {
        float below = e[j] - top;
        e[j] = below < EXP_FLOOR ? 0.0f : exponential(below);
    }
    memcpy(out, e, (size_t)count * sizeof *e);
}

/* e^(x[i] − top) for i < n into out (out may be x; NULL: only summed) and their sum in double: softmax's numerator
   and denominator, and log-sum-exp's (top + log of the sum). top is the largest x. The exponentials are computed a
   span at a time; only the sum, in order, runs one value after another. */
static double exp_below(int n, const float *x, float top, float *out) {
    double total = 0;
    for (int i = 0; i < n; i += EXP_SPAN) {
        int count = n - i < EXP_SPAN ? n - i : EXP_SPAN;
        float e[EXP_SPAN], *span = out ? out + i : e;
        exp_span(count, x + i, top, span);
        for (int j = 0; j < count; j++) total += span[j];
    }
    return total;
}

static inline float gelu(float x, int tanh_approximation) {
    if (!tanh_approximation) return 0.5f * x * (1.0f + own_erf(x * 0.7071067811865476f));
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (2.0f - 2.0f / (exponential(2.0f * u) + 1.0f));
}

/* SiLU's x · sigmoid(x) = x / (1 + e^−x), over the core's exponential (clamped, so x far below zero gives a
   value within 1e-36 of 0, never a NaN). */
static inline float silu(float x) { return x / (1.0f + exponential(-x)); }

/* The MLP's activation in place over rows of its hidden features, split over the pool by rows: GELU, or with a
   gate (SwiGLU) silu(gate) · hidden. */
typedef struct { float *hidden; const float *gate; int width, tanh_approximation; } Activate;

static void activate_rows(void *context, int begin, int end, int thread) {
    const Activate *a = context;
    (void)thread;
    size_t first = (size_t)begin * a->width, n = (size_t)(end - begin) * a->width;
    float *hidden = a->hidden + first;
    if (a->gate) {
        const float *gate = a->gate + first;
        for (size_t i = 0; i < n; i++) hidden[i] = silu(gate[i]) * hidden[i];
    } else if (a->tanh_approximation) {  /* two loops, so the tanh one vectorizes */
        for (size_t i = 0; i < n; i++) hidden[i] = gelu(hidden[i], 1);
    } else {
        for (size_t i = 0; i < n; i++) hidden[i] = gelu(hidden[i], 0);
    }
}

/* LayerNorm over C features: (x − mean) / sqrt(var + eps) · weight + bias, the variance the biased one. */
static void layernorm(int C, float eps, const ManasNorm *norm, const float *x, float *out) {
    float mean = sum(C, x) / (float)C;
    for (int i = 0; i < C; i++) out[i] = (x[i] - mean) * (x[i] - mean);
    float rstd = 1.0f / sqrtf(sum(C, out) / (float)C + eps);
    for (int i = 0; i < C; i++) out[i] = (x[i] - mean) * rstd * norm->weight[i];
    if (norm->bias)
        for (int i = 0; i < C; i++) out[i] += norm->bias[i];
}

/* RMSNorm over C features: x / sqrt(mean(x²) + eps) · weight (no mean taken out, no bias). */
static void rmsnorm(int C, float eps, const ManasNorm *norm, const float *x, float *out) {
    for (int i = 0; i < C; i++) out[i] = x[i] * x[i];
    float rstd = 1.0f / sqrtf(sum(C, out) / (float)C + eps);
    for (int i = 0; i < C; i++) out[i] = x[i] * rstd * norm->weight[i];
}

/* The model's norm of `rows` rows of C features, x into out. */
static void normalize(const ManasModel *m, const ManasNorm *norm, int rows, const float *x, float *out) {
    size_t C = (size_t)m->n_embd;
    for (size_t r = 0; r < (size_t)rows; r++)
        (m->rms_norm ? rmsnorm : layernorm)((int)C, m->norm_eps, norm, x + r * C, out + r * C);
}

/* Each row's cos and sin of pos · base^(−2i/head_size), computed in double and rounded to float, as
   torch_engine/rotary.py's rope_tables. */
static void rope_angles(const ManasModel *m, int position, float *angles) {
    int half = m->head_size / 2;
    for (int i = 0; i < half; i++) {
        double angle = (double)position * own_exp(-(double)(2 * i) / (double)(2 * half) * own_log(m->rope_base));
        double sine, cosine;
        own_sincos(angle, &sine, &cosine);
        angles[i] = (float)cosine;
        angles[half + i] = (float)sine;
    }
}

/* Rotate each pair (a, b) = (x[2i], x[2i+1]) of one head: (a cos − b sin, b cos + a sin). */
static void rotate(int head_size, const float *angles, float *x) {
    int half = head_size / 2;
    for (int i = 0; i < half; i++) {
        float a = x[2 * i], b = x[2 * i + 1], c = angles[i], s = angles[half + i];
        x[2 * i] = a * c + b * -s;
        x[2 * i + 1] = b * c + a * s;
    }
}

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
    else
        dequantize_row(&m->lm_head, token, x);
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
        {&s->gated, m->swiglu ? R * F : 0},
        {&s->reordered, R * W},
        {&s->angles, R * hs},
        {&s->tiles, (size_t)threads * TILE * W},
        {&s->scores, (size_t)threads * score_rows(m) * (size_t)m->block_size},
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
            rope_angles(m, positions[r], s.angles + (size_t)r * hs);
        } else {
            const float *position = m->position_embedding + (size_t)positions[r] * C;
            for (int i = 0; i < C; i++) x[i] += position[i];
        }
    }
    for (int layer = 0; layer < m->n_layer; layer++) {
        const ManasLayer *block = &m->layers[layer];
        normalize(m, &block->ln_attention, rows, s.x, s.h);
        matmul(pool, &s, &block->qkv, m->integer_products, s.h, s.qkv, rows);
        for (int r = 0; r < rows; r++)
            cache_row(m, layer, &caches[r], positions[r], s.angles + (size_t)r * hs, s.qkv + (size_t)r * qkv_width);
        /* Past its keys and values (every row's, cached), the last layer feeds only the logits: it runs on the
           logit rows alone (a prefill's last), gathered to the front. */
        int last = layer == m->n_layer - 1, kept = last ? n_logits : rows;
        if (last) gather_rows(C, n_logits, logit_rows, s.x, s.h);
        Attend attend = {m, caches, positions, last ? logit_rows : NULL, s.qkv, s.attention, s.scores, layer, kept, 0};
        attend.alone = rows_alone(&attend);
        parallel_for(pool, attend_heads, &attend, kept * m->n_head);
        matmul(pool, &s, &block->output, m->integer_products, s.attention, s.h, kept);
        for (size_t i = 0; i < (size_t)kept * C; i++) s.x[i] += s.h[i];
        normalize(m, &block->ln_ffn, kept, s.x, s.h);
        matmul(pool, &s, &block->up, m->integer_products, s.h, s.hidden, kept);
        if (m->swiglu) matmul(pool, &s, &block->gate, m->integer_products, s.h, s.gated, kept);
        Activate activate = {s.hidden, m->swiglu ? s.gated : NULL, m->ffn_width, m->gelu_tanh};
        parallel_for(pool, activate_rows, &activate, kept);
        matmul(pool, &s, &block->down, m->integer_products, s.hidden, s.h, kept);
        for (size_t i = 0; i < (size_t)kept * C; i++) s.x[i] += s.h[i];
    }
    normalize(m, &m->final_norm, n_logits, s.x, s.h);
    matmul(pool, &s, &m->lm_head, m->integer_products, s.h, logits, n_logits);
}

/* ---- loading: the checkpoint's tensors as the core reads them (Python maps the file; the core checks it) ---- */

enum { STORED_F32 = 0, STORED_F16 = 1, STORED_BF16 = 2, STORED_F64 = 3 };

static float f16_to_float(uint16_t h) {
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
}

/* Element i of a stored float tensor (little-endian, maybe unaligned: memcpy) as float32, rounded to nearest. */
static float stored_float(const unsigned char *src, int dtype, int64_t i) {
    if (dtype == STORED_F64) {
        double d;
        memcpy(&d, src + 8 * i, 8);
        return (float)d;
    }
    if (dtype == STORED_F32) {
        float f;
        memcpy(&f, src + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, src + 2 * i, 2);
    return dtype == STORED_F16 ? f16_to_float(h) : bf16_to_float(h);
}

/* float32 to bfloat16 as torch rounds it: to nearest, ties to even; a NaN stays a (quiet) NaN. */
static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* n stored floats to float32 (out_bf16 0) or bfloat16 (1) in dst; the index of the first value that is not finite
   there (a float64 1e300 becomes infinite as float32), or −1. */
EXPORT int64_t manas_convert(const void *src, int dtype, int64_t n, int out_bf16, void *dst) {
    int64_t bad = -1;
    for (int64_t i = 0; i < n; i++) {
        float f = stored_float(src, dtype, i);
        if (out_bf16) {
            uint16_t h = float_to_bf16(f);
            ((uint16_t *)dst)[i] = h;
            f = bf16_to_float(h);
        } else {
            ((float *)dst)[i] = f;
        }
        if (bad < 0 && !isfinite(f)) bad = i;
    }
    return bad;
}

/* The index of the first value of a float32 tensor that is not finite, or −1. A float is NaN or infinite when
   its exponent bits are all ones: blocks of values are tested for that without a branch (so the loop vectorizes
   and a whole model's check costs about a read of it), and only a block that has one is searched. */
EXPORT int64_t manas_first_not_finite(const void *src, int64_t n) {
    const unsigned char *bytes = src;
    for (int64_t begin = 0; begin < n; begin += 4096) {
        int64_t end = begin + 4096 < n ? begin + 4096 : n;
        uint32_t found = 0;
        for (int64_t i = begin; i < end; i++) {
            uint32_t bits;
            memcpy(&bits, bytes + 4 * i, sizeof bits);
            found |= (bits & 0x7F800000u) == 0x7F800000u;
        }
        for (int64_t i = begin; found && i < end; i++)
            if (!isfinite(stored_float(src, STORED_F32, i))) return i;
    }
    return -1;
}

/* Which stored tensor of a quantized layer makes a dequantized weight infinite in float32 (torch_engine/quantize.py's
   overflowing_tensor): 1 its scales (int8: a row's scale × 127; int4: a group's scale × 8, the codes' reach),
   2 its zeros (int4: the zero plus that reach), 0 neither. */
EXPORT int manas_quantized_overflow(const ManasLinear *linear) {
    size_t groups = linear->kind == WEIGHTS_INT8 ? (size_t)linear->n_out
                                                 : (size_t)linear->n_out * (linear->n_in / linear->group);
    float reach = linear->kind == WEIGHTS_INT8 ? 127.0f : (float)INT4_MIDDLE;
    int overflow = 0;
    for (size_t g = 0; g < groups && overflow < 1; g++)
        if (!isfinite(fabsf(bf16_to_float(linear->scales[g])) * reach)) overflow = 1;
    for (size_t g = 0; linear->kind == WEIGHTS_INT4 && g < groups && !overflow; g++) {
        float spread = fabsf(bf16_to_float(linear->scales[g])) * reach;
        if (!isfinite(spread + fabsf(bf16_to_float(linear->zeros[g])))) overflow = 2;
    }
    return overflow;
}

/* Whether every dequantized row of a quantized layer is finite (the token embedding a quantized file implies). */
EXPORT int manas_dequantized_finite(const ManasLinear *linear, float *row) {
    for (int o = 0; o < linear->n_out; o++) {
        dequantize_row(linear, o, row);
        for (int i = 0; i < linear->n_in; i++)
            if (!isfinite(row[i])) return 0;
    }
    return 1;
}

/* The bytes of a layer's panels (see PANEL_UNIT), or 0 where it keeps its rows as stored: rows that are not whole
   units (a row's last unit would mix it with the next), or no layer. */
EXPORT size_t manas_panel_bytes(const ManasLinear *linear) {
    size_t bytes = row_bytes(linear);
    if (!linear->weight || bytes == 0 || bytes % PANEL_UNIT) return 0;
    size_t tiles = ((size_t)linear->n_out + TILE - 1) / TILE;
    return panel_weight_bytes(linear) + tiles * tile_group_scale_count(linear) * sizeof(uint16_t);
}

/* Writes the layer's panels to out, manas_panel_bytes of it: each row's units to their places (zeros in the last
   panel's rows past n_out), then an int4 integer product's scales and zeros, tile by tile. */
EXPORT void manas_pack(const ManasLinear *linear, void *out) {
    size_t bytes = row_bytes(linear), units = bytes / PANEL_UNIT, rows = (size_t)linear->n_out;
    size_t tiles = (rows + TILE - 1) / TILE;
    for (size_t o = 0; o < tiles * TILE; o++) {
        uint8_t *panel = (uint8_t *)out + o / TILE * TILE * bytes + o % TILE * PANEL_UNIT;
        const uint8_t *row = (const uint8_t *)linear->weight + o * bytes;
        for (size_t u = 0; u < units; u++) {
            if (o < rows) memcpy(panel + u * TILE * PANEL_UNIT, row + u * PANEL_UNIT, PANEL_UNIT);
            else memset(panel + u * TILE * PANEL_UNIT, 0, PANEL_UNIT);
        }
    }
    uint16_t *scales = (uint16_t *)((uint8_t *)out + panel_weight_bytes(linear));
    for (size_t t = 0; tile_group_scale_count(linear) && t < tiles; t++) {
        int o0 = (int)(t * TILE), count = (int)(rows - t * TILE < TILE ? rows - t * TILE : TILE);
        int4_groups(linear, o0, count, scales + t * tile_group_scale_count(linear));
    }
}

/* ---- sampling: penalties, temperature, top-k, top-p, min-p and the draw, over one row of logits ---- */

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
