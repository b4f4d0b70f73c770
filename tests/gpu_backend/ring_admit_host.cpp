// Host build of the GPU loop's admission checks (kernels/csrc/include/blink_admit.h), for
// tests/gpu_backend/test_ring_fuzz_admit.py, which diffs them against the host engines' checks. The array walk
// is blink_loop.cuh's copy_arrays without the copies: counts clipped to the geometry, each element through
// the same predicate.
#include <string.h>

#include "blink_admit.h"

static uint32_t clip(uint32_t n, uint32_t max) { return n < max ? n : max; }

static int arrays_ok(const blink_admit_limits* l, const blink_request_slot* w, const uint8_t* req,
                     uint64_t prompt_offset, const uint8_t* bias, uint64_t bias_bytes) {
  int ok = 1;
  const int32_t* prompt = (const int32_t*)(req + prompt_offset);
  for (uint32_t i = 0; i < clip(w->prompt_len, l->max_prompt_len); ++i)
    ok &= blink_admit_prompt_id_ok(prompt[i], l->vocab);
  const int32_t* stops = (const int32_t*)(req + sizeof(blink_request_slot));
  for (uint32_t i = 0; i < clip(w->num_stop_ids, l->max_stop_ids); ++i) ok &= blink_admit_stop_id_ok(stops[i]);
  const int32_t* ids = (const int32_t*)bias;
  const float* vals = (const float*)(bias + bias_bytes / 2);
  for (uint32_t j = 0; j < clip(w->num_logit_bias, l->max_logit_bias); ++j) ok &= blink_admit_bias_ok(ids[j], vals[j]);
  return ok;
}

extern "C" {

// The error the loop writes for the request in slot bytes `req` (logit-bias area `bias`), with the scheduler
// state at `sched_mem` (sched_native.NativeScheduler.state) and `has_ext`: the engine has the extensions.
int32_t blink_admit_host_error(void* sched_mem, const blink_admit_limits* l, const uint8_t* req, uint64_t prompt_offset,
                               const uint8_t* bias, uint64_t bias_bytes, int32_t has_ext) {
  blink_request_slot w;
  memcpy(&w, req, sizeof w);  // the snapshot, as the loop reads it
  blink_sched s;
  blink_sched_bind(&s, sched_mem, &((blink_sched_header*)sched_mem)->cfg);
  return blink_admit_error(&s, l, &w, arrays_ok(l, &w, req, prompt_offset, bias, bias_bytes), has_ext);
}

uint64_t blink_admit_host_first(uint64_t head, uint64_t tail, uint32_t num_slots) {
  return blink_admit_first(head, tail, num_slots);
}

uint64_t blink_admit_host_end(uint64_t head, uint64_t tail) { return blink_admit_end(head, tail); }

int32_t blink_admit_host_room(int32_t capacity, uint32_t produced, uint32_t consumed) {
  return blink_admit_room(capacity, produced, consumed);
}

}  // extern "C"
