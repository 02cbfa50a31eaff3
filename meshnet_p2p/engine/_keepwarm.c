/*
 * Keep-warm: threads that hold this machine's CPUs out of their idle state
 * while a session's next step is due (engine/keepwarm.py says why and when).
 *
 * Why C: the spin must not hold Python's GIL (a Python loop would take it from
 * the threads that read the next step off the network), and it must run at
 * SCHED_IDLE, a per-thread policy: any other runnable thread of the machine,
 * ours or not, preempts it at once, so it spends only time nothing else wants.
 *
 * Loaded with ctypes from __file__, like _llama_hooks; links against nothing
 * but libpthread.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int64_t until_ns;   /* CLOCK_MONOTONIC: spin until then (atomic reads outside mu) */
static int started;        /* threads started (under mu) */
static int ready;          /* threads that have set their policy (under mu) */
static int idle_policy;    /* 1 if every thread got SCHED_IDLE, -1 if one could not */
static int64_t spun_ns;    /* total time spent spinning, all threads (atomic) */
static int64_t wakes;      /* times a sleeping thread was woken to spin (atomic) */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *spin_main(void *arg) {
    (void)arg;
    struct sched_param p = {0};
    int ok = pthread_setschedparam(pthread_self(), SCHED_IDLE, &p) == 0;
    pthread_mutex_lock(&mu);
    if (!ok) {
        idle_policy = -1;
    } else if (idle_policy == 0) {
        idle_policy = 1;
    }
    ready++;
    pthread_cond_broadcast(&cv); /* meshnet_keepwarm_start waits for every thread's policy */
    for (;;) {
        while (now_ns() >= __atomic_load_n(&until_ns, __ATOMIC_ACQUIRE)) {
            pthread_cond_wait(&cv, &mu);
        }
        pthread_mutex_unlock(&mu);
        __atomic_add_fetch(&wakes, 1, __ATOMIC_RELAXED);
        int64_t t0 = now_ns(), t = t0;
        while (t < __atomic_load_n(&until_ns, __ATOMIC_ACQUIRE)) {
            t = now_ns();
        }
        __atomic_add_fetch(&spun_ns, t - t0, __ATOMIC_RELAXED);
        pthread_mutex_lock(&mu);
    }
    return NULL;
}

/* Start threads until `n` run (at most MAX_THREADS); returns how many run,
 * once each has its scheduling policy (so stats() tells whether it is idle). */
__attribute__((visibility("default")))
int meshnet_keepwarm_start(int n) {
    pthread_mutex_lock(&mu);
    if (n > MAX_THREADS) {
        n = MAX_THREADS;
    }
    while (started < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int rc = pthread_create(&t, &attr, spin_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            break;
        }
        started++;
    }
    while (ready < started) {
        pthread_cond_wait(&cv, &mu);
    }
    int out = started;
    pthread_mutex_unlock(&mu);
    return out;
}

/* Spin until `deadline_ns` (CLOCK_MONOTONIC) at least. Cheap while the threads
 * already spin: one atomic compare-and-swap, no lock, no wake-up. */
__attribute__((visibility("default")))
void meshnet_keepwarm_until(int64_t deadline_ns) {
    int64_t cur = __atomic_load_n(&until_ns, __ATOMIC_ACQUIRE);
    int64_t now = now_ns();
    while (deadline_ns > cur) {
        if (__atomic_compare_exchange_n(&until_ns, &cur, deadline_ns, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            if (cur <= now) { /* the threads may be asleep: wake them */
                pthread_mutex_lock(&mu);
                pthread_cond_broadcast(&cv);
                pthread_mutex_unlock(&mu);
            }
            return;
        }
    }
}

__attribute__((visibility("default")))
int64_t meshnet_keepwarm_deadline_ns(void) {
    return __atomic_load_n(&until_ns, __ATOMIC_ACQUIRE);
}

/* Stop spinning now (the deadline passes at once; threads go back to sleep). */
__attribute__((visibility("default")))
void meshnet_keepwarm_stop(void) {
    __atomic_store_n(&until_ns, 0, __ATOMIC_RELEASE);
}

__attribute__((visibility("default")))
int64_t meshnet_keepwarm_now_ns(void) {
    return now_ns();
}

/* [threads started, SCHED_IDLE (1) / refused (-1) / unknown (0), ns spun, wakes] */
__attribute__((visibility("default")))
void meshnet_keepwarm_stats(int64_t *out) {
    pthread_mutex_lock(&mu);
    out[0] = started;
    out[1] = idle_policy;
    pthread_mutex_unlock(&mu);
    out[2] = __atomic_load_n(&spun_ns, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&wakes, __ATOMIC_RELAXED);
}

static struct PyModuleDef keepwarm_module = {
    PyModuleDef_HEAD_INIT, "_keepwarm",
    "Idle-priority spinning threads that keep CPUs awake (load with ctypes from __file__).", -1, NULL,
};

PyMODINIT_FUNC PyInit__keepwarm(void) {
    return PyModule_Create(&keepwarm_module);
}
