/* One thread's streaming read, in GB/s: a sum over 1 GiB of float32 in 2 MiB pages (far more than the caches),
   best of 5, read plainly and then asking ahead of the loads as a float32 decode step does (prefetcht0 `near`
   bytes ahead and prefetcht1 `far` bytes ahead, 0 for none). It bounds what a float32 decode could read;
   benchmarks/goal_kernels.py's goal 2 measures against the plain read (torch's sum), as the issue asks.

     gcc -O3 -march=native -o /tmp/read_bandwidth benchmarks/read_bandwidth.c
     chrt -f 1 /tmp/read_bandwidth                 # plain, then near 512 / far 3072 (the core's)
     chrt -f 1 /tmp/read_bandwidth 1024 0          # another pair of distances

   A benchmark, not a test. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define GIB ((size_t)1 << 30)
#define STEP 64  /* floats per iteration: four 64-byte lines, as a decode step's tile reads a chunk */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The sum of n floats (a multiple of STEP) in STEP lanes, asking near / far bytes ahead of each line read. */
static float read_all(const float *p, size_t n, size_t near, size_t far) {
    float lanes[STEP] = {0};
    const char *bytes = (const char *)p;
    for (size_t i = 0; i < n; i += STEP) {
        for (size_t line = 0; line < STEP * sizeof(float); line += 64) {
            if (near) __builtin_prefetch(bytes + i * sizeof(float) + near + line, 0, 3);
            if (far) __builtin_prefetch(bytes + i * sizeof(float) + far + line, 0, 2);
        }
        for (int l = 0; l < STEP; l++) lanes[l] += p[i + l];
    }
    float total = 0;
    for (int l = 0; l < STEP; l++) total += lanes[l];
    return total;
}

static void time_read(const float *p, size_t n, size_t near, size_t far) {
    double best = 1e30;
    float total = 0;
    for (int run = 0; run < 5; run++) {
        double start = seconds();
        total += read_all(p, n, near, far);
        double elapsed = seconds() - start;
        best = elapsed < best ? elapsed : best;
    }
    printf("ahead %zu / %zu bytes: %.1f GB/s (sum %g)\n", near, far, (double)(n * sizeof(float)) / best / 1e9,
           (double)total);
}

int main(int argc, char **argv) {
    float *p = mmap(NULL, GIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    madvise(p, GIB, MADV_HUGEPAGE);
    size_t n = GIB / sizeof(float);
    for (size_t i = 0; i < n; i++) p[i] = (float)(i % 7);
    if (argc > 2) {
        time_read(p, n, strtoul(argv[1], NULL, 10), strtoul(argv[2], NULL, 10));
        return 0;
    }
    time_read(p, n, 0, 0);
    time_read(p, n, 512, 3072);
    return 0;
}
