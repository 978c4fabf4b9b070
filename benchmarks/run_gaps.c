/* The gaps in one thread's run: a loop that only reads the clock, for 10 s, counting every gap between two
   readings longer than 0.2 ms (the thread not running). Under `chrt -f 1`, as this project's benchmarks run, Linux
   stops a real-time thread for the rest of each second once it has run sched_rt_runtime_us of it (950000 of
   1000000 by default): a 50 ms gap every second, 5% of any measurement, manas's and llama.cpp's alike.

     gcc -O2 -o /tmp/run_gaps benchmarks/run_gaps.c
     chrt -f 1 /tmp/run_gaps     # a real-time thread: a gap of about 50 ms each second
     /tmp/run_gaps               # an ordinary one

   A benchmark, not a test. */
#include <stdio.h>
#include <time.h>

#define SECONDS 10.0
#define GAP 2e-4  /* seconds: far longer than a clock reading */
#define SHOWN 5   /* gaps listed; the rest only counted */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(void) {
    double start = seconds(), last = start, stopped = 0;
    int gaps = 0;
    for (double now = start; now - start < SECONDS; last = now) {
        now = seconds();
        if (now - last <= GAP) continue;
        if (gaps++ < SHOWN) printf("a gap of %.1f ms at %.3f s\n", (now - last) * 1e3, now - start);
        stopped += now - last;
    }
    printf("%d gaps over %.1f ms in %.0f s: %.2f%% of the time\n", gaps, GAP * 1e3, SECONDS,
           stopped / SECONDS * 100);
    return 0;
}
