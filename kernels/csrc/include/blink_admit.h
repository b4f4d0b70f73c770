// The ring as a trust boundary: what an engine checks in a request's words before it uses them, written once
// for every mode: the GPU loop's admission (blink_loop.cuh) and the host engines' (the host build,
// kernels/csrc/sched_host.cpp's blink_admit_host_error, which gpu_backend/engine/loop.py's EngineLoop calls
// through sched_native.NativeScheduler.admission_error). tests/gpu_backend/test_ring_fuzz_admit.py diffs the
// cpu engine's decisions against the loop's walk over the raw slot. Over RDMA the ring is written by another
// machine: nothing the gateway validated is taken on trust.
//
// The order: the counts and flags, then the ids (prompt ids in the vocabulary, stop and logit-bias ids not
// negative, biases finite), then blink_sched_check (PROMPT_TOO_LONG, NO_KV_CAPACITY or INVALID_PARAMS), then
// the penalties' ranges, then the extensions an engine lacks. Stop and logit-bias ids past the vocabulary are
// kept and never match or apply (every engine ignores them).
// The caller reads each ring word once (a snapshot: a writer racing the read cannot pass one value to the
// check and another to the engine) and checks array elements where it copies them (the *_ok predicates).
// Where the loop and the host engines differ, the outcome is the same: the host engines log a skipped queue
// entry and a slot taken again while live, the loop cannot log; such a slot's old request is dropped by both,
// the loop also drops the old request's token or finish not yet published (the host publishes before it
// takes), and its speculation leaves such a slot to the full step (blink_loop.cuh, slot_in_use_spec).
#ifndef BLINK_ADMIT_H
#define BLINK_ADMIT_H

#include <stdint.h>

#include "blink_ring.h"
#include "blink_sched.h"

#define BLINK_ADMIT_KNOWN_FLAGS \
  (BLINK_RING_FLAG_HAS_SEED | BLINK_RING_FLAG_IGNORE_EOS | BLINK_RING_FLAG_LOGPROBS | BLINK_RING_FLAG_CONSTRAINED)

// The ring's geometry and the model's vocabulary: trusted (the engine's own), never read from the ring.
typedef struct blink_admit_limits {
  uint32_t max_prompt_len;
  uint32_t max_stop_ids;
  uint32_t max_logit_bias;
  uint32_t max_logprobs;
  uint32_t vocab;
  uint32_t max_block_hashes;  // the slot's hash area (ring geometry)
  uint32_t kv_block_size;     // tokens per KV block: at most one hash per full prompt block
  uint32_t mask_words;        // the slot's token-mask words; 0: the ring takes no constrained request
} blink_admit_limits;

// ---- the submission queue ------------------------------------------------------------------------------
// The head after taking what the tail covers: a tail behind the head (a producer's error) moves nothing.
BLINK_HD uint64_t blink_admit_end(uint64_t head, uint64_t tail) { return tail > head ? tail : head; }

// The first entry to read: at most one lap behind the end (older entries were overwritten), so a runaway
// tail costs one pass over the queue, not a read of 2^64 entries.
BLINK_HD uint64_t blink_admit_first(uint64_t head, uint64_t tail, uint32_t num_slots) {
  const uint64_t end = blink_admit_end(head, tail);
  return end - head > num_slots ? end - num_slots : head;
}

// A queue entry names a request slot (else it is skipped: there is no response area to report an error in).
BLINK_HD int blink_admit_slot_ok(uint32_t slot, uint32_t num_slots) { return slot < num_slots; }

// ---- one request's words -------------------------------------------------------------------------------
// Counts within the geometry, known flags, a nonzero seq. num_logprobs is checked with or without
// FLAG_LOGPROBS.
BLINK_HD int blink_admit_counts_ok(const blink_admit_limits* l, const blink_request_slot* r) {
  return r->seq != 0 && r->prompt_len >= 1 && r->prompt_len <= l->max_prompt_len &&
         r->num_stop_ids <= l->max_stop_ids && r->num_logit_bias <= l->max_logit_bias &&
         r->num_logprobs <= l->max_logprobs && (r->flags & ~(uint32_t)BLINK_ADMIT_KNOWN_FLAGS) == 0 &&
         r->num_block_hashes <= l->max_block_hashes && r->num_block_hashes <= r->prompt_len / l->kv_block_size &&
         (l->mask_words != 0u || (r->flags & BLINK_RING_FLAG_CONSTRAINED) == 0u);
}

// The array elements, each checked as the caller copies it (the value it keeps is the value checked).
BLINK_HD int blink_admit_prompt_id_ok(int32_t id, uint32_t vocab) { return id >= 0 && (uint32_t)id < vocab; }
BLINK_HD int blink_admit_stop_id_ok(int32_t id) { return id >= 0; }
BLINK_HD int blink_admit_bias_ok(int32_t id, float bias) { return id >= 0 && bias - bias == 0.0f; }  // NaN, inf fail

// A count word clipped to its area: what a caller copies (a count past it is refused by blink_admit_counts_ok).
BLINK_HD uint32_t blink_admit_clip(uint32_t count, uint32_t max) { return count < max ? count : max; }

// Every element of a request's arrays as one thread copied them (the host engines; the loop checks its own
// copies with its threads, blink_loop.cuh's copy_arrays): the copies hold the slot's counts clipped to the
// geometry (blink_admit_clip), and what is checked here is what the engine keeps.
BLINK_HD int blink_admit_arrays_ok(const blink_admit_limits* l, const int32_t* prompt, uint32_t num_prompt,
                                   const int32_t* stop_ids, uint32_t num_stop_ids, const int32_t* bias_ids,
                                   const float* bias_values, uint32_t num_bias) {
  int ok = 1;
  for (uint32_t i = 0; i < num_prompt; ++i) ok &= blink_admit_prompt_id_ok(prompt[i], l->vocab);
  for (uint32_t i = 0; i < num_stop_ids; ++i) ok &= blink_admit_stop_id_ok(stop_ids[i]);
  for (uint32_t j = 0; j < num_bias; ++j) ok &= blink_admit_bias_ok(bias_ids[j], bias_values[j]);
  return ok;
}

// Presence and frequency in [-2, 2], repetition in (0, inf); NaN fails each (the sampler reads them).
BLINK_HD int blink_admit_penalties_ok(const blink_request_slot* r) {
  const float p = r->presence_penalty, f = r->frequency_penalty, rep = r->repetition_penalty;
  return -2.0f <= p && p <= 2.0f && -2.0f <= f && f <= 2.0f && 0.0f < rep && rep - rep == 0.0f;
}

// Penalties, logit bias, logprobs or a token mask (RequestSpec.uses_sampling_extensions).
BLINK_HD int blink_admit_uses_ext(const blink_request_slot* r) {
  return r->presence_penalty != 0.0f || r->frequency_penalty != 0.0f || r->repetition_penalty != 1.0f ||
         r->num_logit_bias != 0u || (r->flags & (BLINK_RING_FLAG_LOGPROBS | BLINK_RING_FLAG_CONSTRAINED)) != 0u;
}

// Why the request in snapshot `r` can never run (blink_sched_error / the ring's ErrorCode), or 0.
// `arrays_ok`: every prompt, stop and logit-bias element passed its predicate (only read when the counts
// are in range); `has_ext`: the engine implements penalties, logit bias and logprobs.
BLINK_HD int32_t blink_admit_error(const blink_sched* s, const blink_admit_limits* l, const blink_request_slot* r,
                                   int arrays_ok, int has_ext) {
  if (!blink_admit_counts_ok(l, r) || !arrays_ok) return BLINK_ERR_INVALID_PARAMS;
  const int32_t err = blink_sched_check(s, (int32_t)r->prompt_len, (int64_t)r->max_tokens, r->temperature,
                                        r->top_p, r->top_k, r->min_p);
  if (err != BLINK_ERR_NONE) return err;
  if (!blink_admit_penalties_ok(r) || (!has_ext && blink_admit_uses_ext(r))) return BLINK_ERR_INVALID_PARAMS;
  return BLINK_ERR_NONE;
}

// ---- output room ---------------------------------------------------------------------------------------
// Tokens a slot may publish now without overwriting unread ones, in 0..capacity (RingConsumer.room, diffed in
// test_ring_fuzz_admit): a `consumed` word past `produced` is the producer's error and buys no room beyond the
// buffer.
BLINK_HD int32_t blink_admit_room(int32_t capacity, uint32_t produced, uint32_t consumed) {
  const int64_t room = (int64_t)capacity - ((int64_t)produced - (int64_t)consumed);
  return room < 0 ? 0 : (room > capacity ? capacity : (int32_t)room);
}

#endif  // BLINK_ADMIT_H
