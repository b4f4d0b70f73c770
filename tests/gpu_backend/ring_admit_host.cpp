// The GPU loop's admission as it reads a ring slot (kernels/csrc/include/blink_admit.h over the raw words), for
// tests/gpu_backend/test_ring_fuzz_admit.py, which diffs it against the host engines' admission (the same
// header through the host library, on the words and arrays the engine copied). The array walk is
// blink_loop.cuh's copy_arrays without the copies: counts clipped to the geometry, each element through the
// same predicate.
#include <string.h>

#include "blink_admit.h"

extern "C" {

// The error the loop writes for the request in slot bytes `req` (logit-bias area `bias`), with the scheduler
// state at `sched_mem` (sched_native.NativeScheduler.state) and `has_ext`: the engine has the extensions.
int32_t blink_admit_ring_error(void* sched_mem, const blink_admit_limits* l, const uint8_t* req, uint64_t prompt_offset,
                               const uint8_t* bias, uint64_t bias_bytes, int32_t has_ext) {
  blink_request_slot w;
  memcpy(&w, req, sizeof w);  // the snapshot, as the loop reads it
  blink_sched s;
  blink_sched_bind(&s, sched_mem, &((blink_sched_header*)sched_mem)->cfg);
  const int ok = blink_admit_arrays_ok(
      l, (const int32_t*)(req + prompt_offset), blink_admit_clip(w.prompt_len, l->max_prompt_len),
      (const int32_t*)(req + sizeof(blink_request_slot)), blink_admit_clip(w.num_stop_ids, l->max_stop_ids),
      (const int32_t*)bias, (const float*)(bias + bias_bytes / 2), blink_admit_clip(w.num_logit_bias, l->max_logit_bias));
  return blink_admit_error(&s, l, &w, ok, has_ext);
}

uint64_t blink_admit_host_first(uint64_t head, uint64_t tail, uint32_t num_slots) {
  return blink_admit_first(head, tail, num_slots);
}

uint64_t blink_admit_host_end(uint64_t head, uint64_t tail) { return blink_admit_end(head, tail); }

int32_t blink_admit_host_room(int32_t capacity, uint32_t produced, uint32_t consumed) {
  return blink_admit_room(capacity, produced, consumed);
}

}  // extern "C"
