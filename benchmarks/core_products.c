/* The native core's float32 products alone, in GFLOP/s: a GPT-2 MLP's two shapes (C → 4C, 4C → C; C 768 for
   GPT-2-124M, 1024 for GPT-2-medium), `rows` rows of x against `layers` copies of each layer's panels (more copies
   than the caches hold make the weights come from memory, as in a model's forward pass), one thread, best of 5.
   It compiles core.c into itself to call its static matmul_tiles directly:

     gcc -O3 -march=native -ffp-contract=off -pthread -o /tmp/core_products benchmarks/core_products.c -lm
     chrt -f 1 /tmp/core_products 64 24        # rows, layers: a 64-token prefill at GPT-2-124M's width
     chrt -f 1 /tmp/core_products 64 16 1024   # GPT-2-medium's
     chrt -f 1 /tmp/core_products 1 48         # a decode step

   A benchmark, not a test: the products' correctness is tests/test_native.py's. */
#include <stdio.h>
#include <time.h>

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

static void time_shape(int n_in, int n_out, int rows, int layers) {
    float *x = random_floats((size_t)rows * n_in), *y = random_floats((size_t)rows * n_out);
    float *tiles = random_floats((size_t)TILE * n_in);
    ManasLinear *linear = calloc((size_t)layers, sizeof *linear);
    for (int l = 0; l < layers; l++) {
        linear[l] = (ManasLinear){.kind = WEIGHTS_F32, .n_in = n_in, .n_out = n_out,
                                  .weight = random_floats((size_t)n_out * n_in)};
        void *panels = aligned_alloc(4096, (manas_panel_bytes(&linear[l]) + 4095) / 4096 * 4096);
        manas_pack(&linear[l], panels);
        linear[l].panels = panels;
    }
    double best = 1e30;
    for (int run = 0; run < 5; run++) {
        double start = seconds();
        for (int l = 0; l < layers; l++) {
            Matmul m = {&linear[l], WEIGHTS_F32, x, (size_t)n_in, y, rows, tiles};
            matmul_tiles(&m, 0, (n_out + TILE - 1) / TILE, 0);
        }
        double elapsed = seconds() - start;
        best = elapsed < best ? elapsed : best;
    }
    printf("%d -> %d, %d rows: %.1f GFLOP/s\n", n_in, n_out, rows, 2.0 * layers * rows * n_in * n_out / best / 1e9);
}

int main(int argc, char **argv) {
    int rows = argc > 1 ? atoi(argv[1]) : 64, layers = argc > 2 ? atoi(argv[2]) : 24;
    int width = argc > 3 ? atoi(argv[3]) : 768;
    if (rows < 1 || layers < 1 || width < 16 || width % 16) {
        fprintf(stderr, "usage: %s [rows] [layers] [width, a multiple of 16]\n", argv[0]);
        return 2;
    }
    time_shape(width, 4 * width, rows, layers);
    time_shape(4 * width, width, rows, layers);
    return 0;
}
