/* The core's thread pool: a small pool of POSIX threads of its own (torch's OpenMP runtime must stay the only one
   in the process), spinning between jobs so that a decode step's products are handed over in well under a
   microsecond. Every product, attention and activation splits its rows over it.

   Part of the core's one translation unit: core.c includes this file where its section stood, after the model's
   structs, so it reads core.c's types and defines no symbol outside it (static, or manas_ and exported). */

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
