/* The native core's products alone, in GFLOP/s (a multiply-add two operations): a GPT-2 MLP's two shapes (C → 4C,
   4C → C; C 768 for GPT-2-124M, 1024 for GPT-2-medium), `rows` rows of x against `layers` copies of each layer's
   panels (more copies than the caches hold make the weights come from memory, as in a model's forward pass), on
   `threads` threads (1 unless given), best of 5. float32, or int8 / int4 weights multiplied in integers as a
   model's are by default (x quantized once, outside the timing). It compiles core.c into itself to call its static
   matmul_tiles directly, through the core's own pool (parallel_for) as a model's products split over threads:

     gcc -O3 -march=native -ffp-contract=off -pthread -o /tmp/core_products benchmarks/core_products.c -lm
     chrt -f 1 /tmp/core_products 64 24            # rows, layers: a 64-token prefill at GPT-2-124M's width
     chrt -f 1 /tmp/core_products 64 16 1024       # GPT-2-medium's
     chrt -f 1 /tmp/core_products 1 48 768 int4   # a decode step, int4 weights (f32, int8, int4)
     chrt -f 1 /tmp/core_products 1 8 2048 f32 2  # a decode step's float32 products on 2 threads

   A benchmark, not a test: the products' correctness is tests/test_native.py's. */
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../manas_cli/native/core.c"

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float *random_floats(size_t count) {
    float *values = aligned_alloc(64, (count * sizeof(float) + 63) / 64 * 64);
    for (size_t i = 0; i < count; i++) values[i] = (float)(rand() % 100) / 100.0f;
    return values;
}

static uint16_t *small_bf16s(size_t count) {
    uint16_t *values = malloc(count * sizeof *values);
    for (size_t i = 0; i < count; i++) values[i] = (uint16_t)(0x3C00 + rand() % 64);  /* 0.0078–0.015 */
    return values;
}

static int8_t *random_bytes(size_t count) {
    int8_t *values = malloc(count);
    for (size_t i = 0; i < count; i++) values[i] = (int8_t)(rand() % 256 - 128);
    return values;
}

/* Memory for a layer's panels in 2 MiB pages where Linux gives them, as the model maps its panels
   (native/model.py's anonymous_memory): on 4 KiB pages a decode step's products read about 5% less. */
static void *huge_pages(size_t bytes) {
    void *memory = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) abort();
    madvise(memory, bytes, MADV_HUGEPAGE);
    return memory;
}

/* A layer of the kind: float32 (f32), int8 or int4 weights (groups of 32), the quantized ones multiplied in
   integers as the model does by default. */
static ManasLinear random_layer(int kind, int n_in, int n_out) {
    size_t count = (size_t)n_out * n_in;
    if (kind == WEIGHTS_F32)
        return (ManasLinear){.kind = kind, .n_in = n_in, .n_out = n_out, .weight = random_floats(count)};
    if (kind == WEIGHTS_INT8)
        return (ManasLinear){.kind = kind, .n_in = n_in, .n_out = n_out, .weight = random_bytes(count),
                             .scales = small_bf16s((size_t)n_out)};
    return (ManasLinear){.kind = kind, .n_in = n_in, .n_out = n_out, .group = 32, .weight = random_bytes(count / 2),
                         .scales = small_bf16s(count / 32), .zeros = small_bf16s(count / 32)};
}

static void time_shape(ManasPool *pool, int kind, int n_in, int n_out, int rows, int layers) {
    float *x = random_floats((size_t)rows * n_in), *y = random_floats((size_t)rows * n_out);
    float *tiles = random_floats((size_t)pool->threads * TILE * n_in);  /* each thread's (Matmul.tiles) */
    ManasLinear *linear = calloc((size_t)layers, sizeof *linear);
    for (int l = 0; l < layers; l++) {
        linear[l] = random_layer(kind, n_in, n_out);
        void *panels = huge_pages(manas_panel_bytes(&linear[l]));
        manas_pack(&linear[l], panels);
        linear[l].panels = panels;
    }
    int products = kind == WEIGHTS_F32 ? kind : kind == WEIGHTS_INT8 ? INT8_INTEGER : INT4_INTEGER;
    size_t stride = (size_t)n_in;
    if (kind != WEIGHTS_F32) {  /* x as matmul gives it to the integer products: once, outside the timing */
        stride = quantized_floats(n_in);
        float *reordered = random_floats((size_t)rows * n_in), *quantized = random_floats((size_t)rows * stride);
        Prepare prepare = {&linear[0], x, reordered, quantized};
        prepare_rows(&prepare, 0, rows, 0);
        x = quantized;
    }
    double best = 1e30;
    for (int run = 0; run < 5; run++) {
        double start = seconds();
        for (int l = 0; l < layers; l++) {
            Matmul m = {&linear[l], products, x, stride, y, (size_t)n_out, rows, tiles, 0};
            parallel_for(pool, matmul_tiles, &m, (n_out + TILE - 1) / TILE);
        }
        double elapsed = seconds() - start;
        best = elapsed < best ? elapsed : best;
    }
    printf("%d -> %d, %d rows: %.1f GFLOP/s\n", n_in, n_out, rows, 2.0 * layers * rows * n_in * n_out / best / 1e9);
}

int main(int argc, char **argv) {
    int rows = argc > 1 ? atoi(argv[1]) : 64, layers = argc > 2 ? atoi(argv[2]) : 24;
    int width = argc > 3 ? atoi(argv[3]) : 768, threads = argc > 5 ? atoi(argv[5]) : 1;
    const char *name = argc > 4 ? argv[4] : "f32";
    int kind = !strcmp(name, "f32")    ? WEIGHTS_F32
               : !strcmp(name, "int8") ? WEIGHTS_INT8
               : !strcmp(name, "int4") ? WEIGHTS_INT4
                                       : -1;
    if (rows < 1 || layers < 1 || width < 64 || width % 64 || kind < 0 || threads < 1 || threads > MAX_THREADS) {
        fprintf(stderr, "usage: %s [rows] [layers] [width, a multiple of 64] [f32|int8|int4] [threads]\n", argv[0]);
        return 2;
    }
    ManasPool *pool = manas_pool_new(threads, (int)sysconf(_SC_NPROCESSORS_ONLN));
    if (!pool || pool->threads != threads) return 1;
    time_shape(pool, kind, width, 4 * width, rows, layers);
    time_shape(pool, kind, 4 * width, width, rows, layers);
    manas_pool_free(pool);
    return 0;
}
