/* A streaming read's speed, in GB/s: a sum over 1 GiB of float32 in 2 MiB pages (far more than the caches), best
   of 5, by one thread and by two (each summing its own half at the same time), read plainly and then asking
   ahead of the loads as a float32 decode step does (prefetcht0 `near` bytes ahead and prefetcht1 `far` bytes ahead,
   0 for none). It bounds what a float32 decode step could read on 1 and 2 threads; benchmarks/goal_kernels.py's
   goal 2 measures against the plain read (torch's sum), as the issue asks.

     gcc -O3 -march=native -pthread -o /tmp/read_bandwidth benchmarks/read_bandwidth.c
     chrt -f 1 /tmp/read_bandwidth                 # plain, then near 512 / far 3072 (the core's); 1 and 2 threads
     chrt -f 1 /tmp/read_bandwidth 1024 0          # another pair of distances

   Under `chrt -f 1` the kernel stops a real-time thread for the last 50 ms of every second
   (/proc/sys/kernel/sched_rt_runtime_us: 950000 of 1000000), as it does every command measured that way; a run
   here takes 35–90 ms, so the best of 5 is one the stop missed. A benchmark, not a test. */
#define _GNU_SOURCE
#include <pthread.h>
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

/* One thread's share: n floats (a multiple of STEP) from p, summed in STEP lanes, asking near / far bytes ahead of
   each line read; the threads start together at the barrier. */
typedef struct {
    const float *p;
    size_t n, near, far;
    pthread_barrier_t *start;
    float total;
} Share;

static void *read_share(void *argument) {
    Share *s = argument;
    pthread_barrier_wait(s->start);
    float lanes[STEP] = {0};
    const char *bytes = (const char *)s->p;
    for (size_t i = 0; i < s->n; i += STEP) {
        for (size_t line = 0; line < STEP * sizeof(float); line += 64) {
            if (s->near) __builtin_prefetch(bytes + i * sizeof(float) + s->near + line, 0, 3);
            if (s->far) __builtin_prefetch(bytes + i * sizeof(float) + s->far + line, 0, 2);
        }
        for (int l = 0; l < STEP; l++) lanes[l] += s->p[i + l];
    }
    for (int l = 0; l < STEP; l++) s->total += lanes[l];
    return NULL;
}

/* The n floats at p read by `threads` threads (1 or 2), each its own consecutive share, the caller one of them. */
static double read_all(const float *p, size_t n, size_t near, size_t far, int threads, float *total) {
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    Share shares[2];
    pthread_t other;
    for (int t = 0; t < threads; t++) shares[t] = (Share){p + t * (n / threads), n / threads, near, far, &start, 0};
    double begin = seconds();
    if (threads == 2 && pthread_create(&other, NULL, read_share, &shares[1])) abort();
    read_share(&shares[0]);
    if (threads == 2) pthread_join(other, NULL);
    double elapsed = seconds() - begin;
    pthread_barrier_destroy(&start);
    for (int t = 0; t < threads; t++) *total += shares[t].total;
    return elapsed;
}

static void time_read(const float *p, size_t n, size_t near, size_t far, int threads) {
    double best = 1e30;
    float total = 0;
    for (int run = 0; run < 5; run++) {
        double elapsed = read_all(p, n, near, far, threads, &total);
        best = elapsed < best ? elapsed : best;
    }
    printf("%d thread%s, ahead %zu / %zu bytes: %.1f GB/s (sum %g)\n", threads, threads > 1 ? "s" : "", near, far,
           (double)(n * sizeof(float)) / best / 1e9, (double)total);
}

int main(int argc, char **argv) {
    float *p = mmap(NULL, GIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    madvise(p, GIB, MADV_HUGEPAGE);
    size_t n = GIB / sizeof(float);
    for (size_t i = 0; i < n; i++) p[i] = (float)(i % 7);
    for (int threads = 1; threads <= 2; threads++) {
        if (argc > 2) {
            time_read(p, n, strtoul(argv[1], NULL, 10), strtoul(argv[2], NULL, 10), threads);
            continue;
        }
        time_read(p, n, 0, 0, threads);
        time_read(p, n, 512, 3072, threads);
    }
    return 0;
}
