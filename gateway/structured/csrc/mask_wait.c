/* The mask watcher's wait (gateway/structured/mask_watch.py): until a constrained request's response holds a
 * token its mask loop has not seen, with the GIL released (ctypes drops it for the call), so that watching
 * the ring costs the event loop nothing and wakes Python only when there is work.
 *
 * responses[i]: request i's response in the ring (the engine's words, only read here): its seq (u64 at
 * RESP_SEQ = 0) must be seqs[i], else the slot still holds an earlier request's counters; then its produced
 * counter (u32 at produced_offset) past seen[i] (the tokens the mask loop has) is news. Returns the first i
 * with news, or -1 once timeout_ns has passed; checks every period_ns. The engine stores a response's seq
 * after resetting its counters and its tokens before `produced`; the caller reads the tokens, validated by
 * the seq again, after this returns. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int has_news(const uint8_t *response, uint64_t seq, uint32_t seen, uint32_t produced_offset) {
    if (*(const volatile uint64_t *)response != seq) {
        return 0;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return *(const volatile uint32_t *)(response + produced_offset) > seen;
}

int32_t blink_mask_wait(const uint8_t *const *responses, const uint64_t *seqs, const uint32_t *seen, int32_t n,
                        uint32_t produced_offset, int64_t period_ns, int64_t timeout_ns) {
    const int64_t deadline = now_ns() + timeout_ns;
    const struct timespec nap = {0, (long)period_ns};
    for (;;) {
        for (int32_t i = 0; i < n; i++) {
            if (has_news(responses[i], seqs[i], seen[i], produced_offset)) {
                return i;
            }
        }
        if (now_ns() >= deadline) {
            return -1;
        }
        nanosleep(&nap, NULL);
    }
}
