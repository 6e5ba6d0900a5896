/* pool.c - the CPU backend's worker threads.
 *
 * One pool per backend: n - 1 pthreads plus the calling thread run the tasks
 * of one parallel op at a time. lethe_cpu_parallel publishes the job (a
 * function, its context, n_tasks) under a new generation number, takes tasks
 * itself and returns when every task has run. Tasks are handed out one at a
 * time from an atomic counter, so a worker that the OS delays (a loaded
 * machine) just takes fewer of them.
 *
 * Waiting: a worker with no job spins for at most SPIN_NS checking the
 * generation (decode issues a parallel op every few microseconds, and a
 * sleeping worker takes tens of microseconds to wake), then sleeps on a
 * futex until the next job. The caller waits for stragglers the same way.
 * So an idle or busy-elsewhere machine sees no spinning threads after
 * SPIN_NS; OpenMP's default (spin for ~100 ms+) cost 5-11x decode speed when
 * other processes wanted the cores.
 *
 * Results never depend on which thread ran a task: every task writes its own
 * outputs (the ops' determinism contract, cpu_ops.h). `worker` (0 = the
 * caller) only selects per-thread scratch. */
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define SPIN_NS 50000 /* 50 us */
#define MAX_WORKERS (LETHE_CPU_MAX_THREADS - 1)

struct lethe_cpu_pool {
    pthread_mutex_t submit; /* one job at a time per backend */
    int n_workers;          /* spawned pthreads (worker ids 1 .. n_workers) */
    pthread_t tid[MAX_WORKERS];
    /* the job */
    lethe_cpu_task_fn fn;
    void *ctx;
    int n_tasks, n_part;         /* tasks; threads taking part (caller included) */
    atomic_int next;             /* next task to hand out */
    atomic_uint gen;             /* job generation: workers wait for it to change (futex word) */
    atomic_uint pending;         /* workers that have not finished this job (futex word) */
    atomic_int gen_sleepers;     /* workers asleep on gen: the caller wakes only if > 0 */
    atomic_int pending_sleepers; /* 1 while the caller sleeps on pending */
    atomic_int stop;
};

static long futex(atomic_uint *addr, int op, unsigned val) {
    return syscall(SYS_futex, (unsigned *)addr, op, val, NULL, NULL, 0);
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* waits until *w != old: bounded spin, then futex sleep, counted in *sleepers
 * (seq_cst: a waker that changes *w and then reads *sleepers == 0 is sure
 * the sleeper's FUTEX_WAIT sees the new value and does not block) */
static void wait_change(atomic_uint *w, unsigned old, atomic_int *sleepers) {
    if (atomic_load_explicit(w, memory_order_acquire) != old) return;
    const double t0 = now_ns();
    for (int i = 1;; i++) {
        cpu_relax();
        if (atomic_load_explicit(w, memory_order_acquire) != old) return;
        if (!(i & 63) && now_ns() - t0 > SPIN_NS) break;
    }
    atomic_fetch_add(sleepers, 1);
    while (atomic_load(w) == old) futex(w, FUTEX_WAIT_PRIVATE, old);
    atomic_fetch_sub(sleepers, 1);
}

/* after changing *w: wakes its sleepers, a syscall only when there are any */
static void wake(atomic_uint *w, atomic_int *sleepers, int n) {
    if (atomic_load(sleepers) > 0) futex(w, FUTEX_WAKE_PRIVATE, (unsigned)n);
}

static void run_tasks(lethe_cpu_pool *p, int worker) {
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= p->n_tasks) return;
        p->fn(p->ctx, t, worker);
    }
}

typedef struct worker_arg {
    lethe_cpu_pool *p;
    int id;
    unsigned gen; /* the generation at spawn: the worker's first job is the next one */
} worker_arg;

static _Thread_local int g_in_pool; /* set inside a task: nested parallel calls run inline */

static void *worker_main(void *arg_) {
    worker_arg a = *(worker_arg *)arg_;
    free(arg_);
    lethe_cpu_pool *p = a.p;
    g_in_pool = 1;
    unsigned seen = a.gen;
    for (;;) {
        /* one generation at a time: the caller publishes job k+1 only after
         * every worker has acknowledged job k (pending), so the job fields
         * read here are job `seen`'s */
        wait_change(&p->gen, seen, &p->gen_sleepers);
        seen++;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
        if (a.id < p->n_part) run_tasks(p, a.id); /* else: not needed, just acknowledge */
        if (atomic_fetch_sub(&p->pending, 1) == 1) wake(&p->pending, &p->pending_sleepers, 1);
    }
}

lethe_cpu_pool *lethe_cpu_pool_create(void) {
    lethe_cpu_pool *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    pthread_mutex_init(&p->submit, NULL);
    return p;
}

void lethe_cpu_pool_destroy(lethe_cpu_pool *p) {
    if (!p) return;
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    atomic_fetch_add(&p->gen, 1);
    futex(&p->gen, FUTEX_WAKE_PRIVATE, MAX_WORKERS);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->tid[i], NULL);
    pthread_mutex_destroy(&p->submit);
    free(p);
}

/* spawns workers up to n - 1 (fewer when the OS refuses: the jobs then use fewer threads) */
static void grow(lethe_cpu_pool *p, int n) {
    while (p->n_workers < n - 1 && p->n_workers < MAX_WORKERS) {
        worker_arg *a = malloc(sizeof(*a));
        if (!a) return;
        *a = (worker_arg){p, p->n_workers + 1, atomic_load(&p->gen)};
        if (pthread_create(&p->tid[p->n_workers], NULL, worker_main, a)) {
            free(a);
            return;
        }
        p->n_workers++;
    }
}

void lethe_cpu_pool_run(lethe_cpu_pool *p, int n_threads, int n_tasks, lethe_cpu_task_fn fn,
                        void *ctx) {
    if (n_tasks <= 0) return;
    if (n_threads > n_tasks) n_threads = n_tasks;
    if (n_threads <= 1 || g_in_pool) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&p->submit);
    grow(p, n_threads);
    const int n_part = LETHE_MIN(n_threads, p->n_workers + 1);
    p->fn = fn, p->ctx = ctx, p->n_tasks = n_tasks, p->n_part = n_part;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->pending, (unsigned)p->n_workers, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); /* publishes the job */
    wake(&p->gen, &p->gen_sleepers, MAX_WORKERS);
    g_in_pool = 1;
    run_tasks(p, 0);
    g_in_pool = 0;
    for (;;) { /* the stragglers: bounded spin, then sleep until the last one wakes us */
        unsigned left = atomic_load(&p->pending);
        if (!left) break;
        wait_change(&p->pending, left, &p->pending_sleepers);
    }
    pthread_mutex_unlock(&p->submit);
}
