// Host build of the scheduling step (kernels/csrc/include/blink_sched.h) and of the ring's admission check
// (blink_admit.h): a C ABI over one state buffer, for ctypes (gpu_backend/engine/sched_native.py). Every call
// binds the arrays from the config stored in the buffer's header, so the caller holds only the buffer. No
// logic here beyond the headers'.
#include "blink_admit.h"
#include "blink_sched.h"

static blink_sched bound(void* mem) {
  blink_sched s;
  blink_sched_bind(&s, mem, &((blink_sched_header*)mem)->cfg);
  return s;
}

extern "C" {

uint64_t blink_sched_state_bytes(const blink_sched_config* c) {
  blink_sched s;
  return blink_sched_bind(&s, 0, c);
}

uint64_t blink_sched_step_layout(int32_t t, int32_t s, int32_t mb, uint64_t* offsets) {
  return blink_step_layout(t, s, mb, offsets);
}

void blink_sched_host_init(void* mem, const blink_sched_config* c) {
  blink_sched s;
  blink_sched_bind(&s, mem, c);
  blink_sched_init(&s, c);
}

int32_t blink_sched_host_check(void* mem, int32_t prompt_len, int64_t max_tokens, double temperature, double top_p,
                               int32_t top_k, double min_p) {
  blink_sched s = bound(mem);
  return blink_sched_check(&s, prompt_len, max_tokens, temperature, top_p, top_k, min_p);
}

// blink_admit_error for snapshot `w` of a request's fixed words and the engine's copies of its arrays (the
// slot's counts clipped to the geometry); `has_ext`: the engine applies penalties, logit bias and logprobs.
int32_t blink_admit_host_error(void* mem, const blink_admit_limits* l, const blink_request_slot* w,
                               const int32_t* prompt, uint32_t num_prompt, const int32_t* stop_ids,
                               uint32_t num_stop_ids, const int32_t* bias_ids, const float* bias_values,
                               uint32_t num_bias, int32_t has_ext) {
  blink_sched s = bound(mem);
  const int ok = blink_admit_arrays_ok(l, prompt, num_prompt, stop_ids, num_stop_ids, bias_ids, bias_values, num_bias);
  return blink_admit_error(&s, l, w, ok, has_ext);
}

uint64_t blink_admit_limits_bytes(void) { return sizeof(blink_admit_limits); }

void blink_sched_host_add(void* mem, int32_t slot, const int32_t* prompt, int32_t prompt_len, int64_t max_tokens,
                          int64_t priority, const int32_t* stop_ids, int32_t num_stop, int32_t ignore_eos,
                          float temperature, int32_t top_k, float top_p, float min_p, uint64_t seed,
                          const uint64_t* hashes, int32_t num_hashes) {
  blink_sched s = bound(mem);
  blink_sched_add(&s, slot, prompt, prompt_len, max_tokens, priority, stop_ids, num_stop, ignore_eos, temperature,
                  top_k, top_p, min_p, seed, hashes, num_hashes);
}

void blink_sched_host_finish(void* mem, int32_t slot) {
  blink_sched s = bound(mem);
  blink_sched_finish(&s, slot);
}

int32_t blink_sched_host_schedule(void* mem, const int32_t* room, int32_t* scratch) {
  blink_sched s = bound(mem);
  return blink_sched_schedule(&s, room, scratch);
}

// The step buffer, with the token loop split over `nthreads` run one after another (any split must agree).
int32_t blink_sched_host_fill(void* mem, uint8_t* buf, int32_t nthreads) {
  blink_sched s = bound(mem);
  const int32_t bucket = blink_fill_prologue(&s, buf);
  for (int32_t tid = 0; tid < nthreads; ++tid) blink_fill_tokens(&s, buf, tid, nthreads);
  return bucket;
}

void blink_sched_host_update(void* mem, const int32_t* sampled) {
  blink_sched s = bound(mem);
  blink_sched_update(&s, sampled);
}

}  // extern "C"

extern "C" void blink_sched_host_bind(void* mem, blink_sched* out) { *out = bound(mem); }
