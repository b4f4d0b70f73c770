/* The mask watcher's wait (gateway/structured/mask_watch.py): until constrained requests' responses hold tokens
 * their mask loops have not seen, with the GIL released (ctypes drops it for the call), so that watching the
 * ring costs the event loop nothing and wakes Python only when there is work.
 *
 * responses[i]: request i's response in the ring (the engine's words, only read here): its seq (u64 at
 * RESP_SEQ = 0) must be seqs[i], else the slot still holds an earlier request's counters; then its produced
 * counter (u32 at produced_offset) past seen[i] (the tokens the mask loop has) is news. The engine stores a
 * response's seq after resetting its counters and its tokens before `produced`; the caller reads the tokens,
 * validated by the seq again, after this returns.
 *
 * Nothing in the ring can wake a sleeper (the engine, a GPU loop too, only stores words), so this looks at the
 * words between naps, and the naps follow the engine's steps, when tokens come: fine (fine_nap_ns) while
 * now < fine_until_ns (just after news: the rest of a step's tokens) or now >= fine_from_ns (the next step's
 * tokens are due), coarse (coarse_nap_ns, cut short to land on fine_from_ns) in between. Each nap is a timer
 * wake, which costs tens of microseconds of a core on a VM: the fewer the better. */
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

static int64_t nap_ns(int64_t now, int64_t fine_from_ns, int64_t fine_until_ns, int64_t fine_nap_ns,
                      int64_t coarse_nap_ns) {
    if (now < fine_until_ns || now >= fine_from_ns - fine_nap_ns) {
        return fine_nap_ns;
    }
    const int64_t to_fine = fine_from_ns - now;
    return to_fine < coarse_nap_ns ? to_fine : coarse_nap_ns;
}

/* Writes the indices with news to ready[] (room for n) and returns how many (> 0); 0 once deadline_ns (CLOCK_MONOTONIC)
 * passed, -1 as soon as *version_word is no longer `version` (the watched set changed: the caller rebuilds). */
int32_t blink_mask_wait(const uint8_t *const *responses, const uint64_t *seqs, const uint32_t *seen, int32_t n,
                        uint32_t produced_offset, int32_t *ready, const uint64_t *version_word, uint64_t version,
                        int64_t fine_from_ns, int64_t fine_until_ns, int64_t fine_nap_ns, int64_t coarse_nap_ns,
                        int64_t deadline_ns) {
    for (;;) {
        int32_t count = 0;
        for (int32_t i = 0; i < n; i++) {
            if (has_news(responses[i], seqs[i], seen[i], produced_offset)) {
                ready[count++] = i;
            }
        }
        if (count > 0) {
            return count;
        }
        if (*(const volatile uint64_t *)version_word != version) {
            return -1;
        }
        const int64_t now = now_ns();
        if (now >= deadline_ns) {
            return 0;
        }
        int64_t nap = nap_ns(now, fine_from_ns, fine_until_ns, fine_nap_ns, coarse_nap_ns);
        if (nap > deadline_ns - now) {
            nap = deadline_ns - now;
        }
        const struct timespec ts = {(time_t)(nap / 1000000000LL), (long)(nap % 1000000000LL)};
        nanosleep(&ts, NULL);
    }
}
