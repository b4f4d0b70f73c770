// The request/response ring as device (and host) code sees it: the fixed layout (structs, flags, enums) is
// generated from protocols/ring_decl.py into blink_ring_layout.h (`python -m protocols.layout.gen`); this
// file adds the geometry, as protocols/ring.py does. tests/protocols/test_ring_layout.py compiles it with the
// host compiler and compares every offset and size with the Python layout.
// Writers: lines 0-1 of the header by the creator, line 2 by the engine, line 3 by the gateway.
#ifndef BLINK_RING_H
#define BLINK_RING_H

#include <stdint.h>

#include "blink_ring_layout.h"

static inline uint64_t blink_align64(uint64_t n) { return (n + 63u) & ~(uint64_t)63u; }
static inline uint64_t blink_prompt_offset(uint32_t max_stop_ids) {
  return blink_align64(sizeof(blink_request_slot) + 4ull * max_stop_ids);
}
static inline uint64_t blink_request_bytes(uint32_t max_stop_ids, uint32_t max_prompt_len) {
  return blink_prompt_offset(max_stop_ids) + blink_align64(4ull * max_prompt_len);
}
static inline uint64_t blink_response_bytes(uint32_t max_output_len) {
  return sizeof(blink_response_slot) + blink_align64(4ull * max_output_len);
}
static inline uint64_t blink_requests_offset(uint32_t num_slots) {
  return blink_align64(BLINK_RING_HEADER_BYTES + 4ull * num_slots);
}

/* Version 2 regions, after the responses (header.logit_bias_offset), one area per slot:
 * logit bias: int32_t ids[max_logit_bias] at 0, float bias[max_logit_bias] at align64(4 * max_logit_bias);
 *   written by the gateway before the slot's seq.
 * logprobs, indexed by w = token index % logprob_window, written by the engine before `produced`:
 *   float chosen[logprob_window] at 0; int32_t top_ids[logprob_window][max_logprobs] at
 *   blink_logprob_top_ids_offset; float top_logprobs[logprob_window][max_logprobs] at
 *   blink_logprob_top_offset. Alternatives are in descending order, num_logprobs of them. */
static inline uint64_t blink_logit_bias_bytes(uint32_t max_logit_bias) {
  return 2 * blink_align64(4ull * max_logit_bias);
}
static inline uint64_t blink_logprob_top_ids_offset(uint32_t logprob_window) {
  return blink_align64(4ull * logprob_window);
}
static inline uint64_t blink_logprob_top_offset(uint32_t logprob_window, uint32_t max_logprobs) {
  return blink_logprob_top_ids_offset(logprob_window) + blink_align64(4ull * logprob_window * max_logprobs);
}
static inline uint64_t blink_logprob_bytes(uint32_t logprob_window, uint32_t max_logprobs) {
  return blink_logprob_top_offset(logprob_window, max_logprobs) + blink_align64(4ull * logprob_window * max_logprobs);
}
static inline uint64_t blink_logprobs_offset(const blink_ring_header *h) {
  return h->logit_bias_offset + (uint64_t)h->num_slots * blink_logit_bias_bytes(h->max_logit_bias);
}

/* Version 3, after the logprobs: per slot the request's block hashes (gateway writes, before seq),
 * uint64_t[max_prompt_len / kv_block_size]; then per slot a token mask area (gateway writes, constrained requests only):
 * uint32_t words[mask_words] at 0 (bit t % 32 of word t / 32: token t allowed), then uint32_t mask_seq at
 * blink_mask_seq_offset (its own cache line), stored last: the generated token index the words are for, plus 1. */
static inline uint64_t blink_mask_seq_offset(uint32_t mask_words) { return blink_align64(4ull * mask_words); }
static inline uint64_t blink_mask_bytes(uint32_t mask_words) {
  return mask_words ? blink_mask_seq_offset(mask_words) + 64u : 0u;
}
static inline uint64_t blink_block_hash_bytes(uint32_t max_prompt_len, uint32_t kv_block_size) {
  return blink_align64(8ull * (max_prompt_len / kv_block_size));
}
static inline uint64_t blink_block_hashes_offset(const blink_ring_header *h) {
  return blink_logprobs_offset(h) +
         (uint64_t)h->num_slots * blink_logprob_bytes(h->logprob_window, h->max_logprobs);
}
static inline uint64_t blink_masks_offset(const blink_ring_header *h) {
  return blink_block_hashes_offset(h) +
         (uint64_t)h->num_slots * blink_block_hash_bytes(h->max_prompt_len, h->kv_block_size);
}

#endif /* BLINK_RING_H */
