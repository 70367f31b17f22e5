/* All-reduce (sum) among the ranks of one host through a shared-memory segment, for
   tprt.distributed.shm_allreduce (which creates the segment and calls this through ctypes).

   gloo's all-reduce goes through TCP loopback, about 0.2 ms per call even for the few KiB of a
   decode step's activations; here each rank copies its values into its own slot of the segment,
   announces it with a sequence number, waits for every peer's, and sums the slots itself in rank
   order (so every rank gets the same bits). Slots come in two sets used alternately: a rank can
   only reuse a set once every peer has announced the following call, by which time they have all
   finished reading it. Inputs larger than a slot go through in slot-sized chunks.

   A peer that dies mid-collective must not leave the others waiting forever: while waiting, each
   rank checks every ~50 ms that the peers it still waits for are alive (their pids, registered in
   the segment's header) and gives up after the timeout. */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef struct {
    _Atomic uint64_t announced;  /* the last sequence number whose values this rank has put in its slot */
    int64_t pid;
    char pad[48];                /* one cache line per rank */
} rank_line;

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
#define SPIN_NS 20000          /* pause-spin this long, then yield the core between checks */
#define SLEEP_AFTER_NS 2000000 /* after this long, sleep 20 us between checks */
#define LIVENESS_EVERY_NS 50000000

/* The segment's header is one 64-byte line per rank; the data slots follow it (the Python side
   sizes the segment with the same layout). */
_Static_assert(sizeof(rank_line) == 64, "one cache line per rank");

void tprt_shm_register(void *base, int64_t rank) {
    rank_line *line = (rank_line *)base + rank;
    line->pid = getpid();
    atomic_store(&line->announced, 0);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A process that no longer runs: gone, or a zombie its parent has not reaped yet. */
static int exited(int64_t pid) {
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char *paren = strrchr(text, ')'); /* the state follows the command name, which may hold spaces */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out[i] = sum over ranks r (in order) of slot r's element i; float32 sums, bf16 rounded once. */
static void sum_slots(char *const *slots, int64_t world, void *out, int64_t n, int64_t dtype) {
    if (dtype == DTYPE_F32) {
        float *o = out;
        const float *s0 = (const float *)slots[0];
        for (int64_t i = 0; i < n; i++) o[i] = s0[i];
        for (int64_t r = 1; r < world; r++) {
            const float *s = (const float *)slots[r];
            for (int64_t i = 0; i < n; i++) o[i] += s[i];
        }
        return;
    }
    uint16_t *o = out;
    float acc[256];
    for (int64_t b = 0; b < n; b += 256) {
        int64_t m = n - b < 256 ? n - b : 256;
        for (int64_t i = 0; i < m; i++) acc[i] = bf16_to_f32(((const uint16_t *)slots[0])[b + i]);
        for (int64_t r = 1; r < world; r++) {
            const uint16_t *s = (const uint16_t *)slots[r] + b;
            for (int64_t i = 0; i < m; i++) acc[i] += bf16_to_f32(s[i]);
        }
        for (int64_t i = 0; i < m; i++) o[b + i] = f32_to_bf16(acc[i]);
    }
}

/* Waits until every rank has announced `seq`. Returns 0, or 1 + r when rank r exited first, or
   -1 after timeout_ns. */
static int64_t wait_all(rank_line *lines, int64_t world, uint64_t seq, int64_t timeout_ns) {
    int64_t start = now_ns(), checked = start;
    for (unsigned spins = 0;; spins++) {
        int64_t r = 0;
        while (r < world && atomic_load_explicit(&lines[r].announced, memory_order_acquire) >= seq) r++;
        if (r == world) return 0;
        if ((spins & 63) != 63) {
#if defined(__x86_64__)
            _mm_pause();
#endif
            continue;
        }
        int64_t t = now_ns();
        if (t - checked > LIVENESS_EVERY_NS) {
            checked = t;
            for (int64_t p = 0; p < world; p++)
                if (atomic_load(&lines[p].announced) < seq && exited(lines[p].pid)) return 1 + p;
            if (t - start > timeout_ns) return -1;
        }
        if (t - start > SLEEP_AFTER_NS) {
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        } else if (t - start > SPIN_NS) {
            sched_yield();
        }
    }
}

/* Sums data [n] of `dtype` over the `world` ranks attached to the segment at `base` (slots of
   slot_bytes each), in place. *seq is this rank's count of chunks so far (the same on every rank);
   it is advanced. Returns 0, 1 + r when rank r exited mid-collective, or -1 on timeout. */
int64_t tprt_shm_all_reduce(void *base, int64_t rank, int64_t world, int64_t slot_bytes, uint64_t *seq,
                            void *data, int64_t n, int64_t dtype, double timeout_s) {
    rank_line *lines = base;
    char *slots0 = (char *)base + world * (int64_t)sizeof(rank_line);
    int64_t elem = dtype == DTYPE_F32 ? 4 : 2, per_chunk = slot_bytes / elem;
    int64_t timeout_ns = (int64_t)(timeout_s * 1e9);
    for (int64_t done = 0; done < n; done += per_chunk) {
        int64_t m = n - done < per_chunk ? n - done : per_chunk;
        uint64_t s = ++*seq;
        char *set = slots0 + (int64_t)(s & 1) * world * slot_bytes, *slots[world];
        for (int64_t r = 0; r < world; r++) slots[r] = set + r * slot_bytes;
        memcpy(slots[rank], (char *)data + done * elem, (size_t)(m * elem));
        atomic_store_explicit(&lines[rank].announced, s, memory_order_release);
        int64_t status = wait_all(lines, world, s, timeout_ns);
        if (status) return status;
        sum_slots(slots, world, (char *)data + done * elem, m, dtype);
    }
    return 0;
}

/* One rank's attachment, for C callers (tprt_decode_stack in tprt/cpu/native/kernels.c, given
   tprt_shm_all_reduce_group's address and a pointer to this): the arguments of
   tprt_shm_all_reduce that stay the same from call to call. */
typedef struct {
    void *base;
    int64_t rank, world, slot_bytes;
    uint64_t *seq;
    double timeout_s;
} shm_group;

int64_t tprt_shm_all_reduce_group(void *group, void *data, int64_t n, int64_t dtype) {
    const shm_group *g = group;
    return tprt_shm_all_reduce(g->base, g->rank, g->world, g->slot_bytes, g->seq, data, n, dtype, g->timeout_s);
}
