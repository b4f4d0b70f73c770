// The request/response ring as device (and host) code sees it.
// Mirrors protocols/ring.py, the single source of truth; tests/protocols/test_ring_layout.py compiles this
// header with the host compiler and compares every offset and size with the Python layout.
// Writers: lines 0-1 of the header by the creator, line 2 by the engine, line 3 by the gateway.
#ifndef BLINK_RING_H
#define BLINK_RING_H

#include <stdint.h>

#define BLINK_RING_MAGIC 0x474E49524B4E494CULL /* "LINKRING" */
#define BLINK_RING_VERSION 2u
#define BLINK_RING_HEADER_BYTES 256u
#define BLINK_RING_FLAG_HAS_SEED (1u << 0)
#define BLINK_RING_FLAG_IGNORE_EOS (1u << 1)
#define BLINK_RING_FLAG_LOGPROBS (1u << 2)

enum blink_finish_reason { BLINK_FINISH_NONE = 0, BLINK_FINISH_STOP = 1, BLINK_FINISH_LENGTH = 2,
                           BLINK_FINISH_CANCELLED = 3, BLINK_FINISH_ERROR = 4 };

typedef struct blink_ring_header {
  /* creator, written once; magic last */
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint32_t num_slots;
  uint32_t max_prompt_len;
  uint32_t max_output_len;
  uint32_t max_stop_ids;
  uint32_t request_bytes;
  uint32_t response_bytes;
  uint64_t sq_offset;
  uint64_t requests_offset;
  uint64_t responses_offset;
  uint64_t total_bytes;
  /* version 2 */
  uint32_t max_logit_bias;
  uint32_t max_logprobs;
  uint32_t logprob_window;
  uint32_t _pad0;
  uint64_t logit_bias_offset; /* logit-bias region; the logprobs region follows it */
  char fingerprint[32];
  /* engine */
  uint64_t heartbeat;
  uint32_t engine_state;
  uint32_t _pad1;
  uint64_t sq_head;
  uint32_t free_kv_blocks;
  uint32_t total_kv_blocks;
  uint32_t running;
  uint32_t waiting;
  uint64_t generated_tokens;
  uint8_t _pad2[16];
  /* gateway */
  uint64_t sq_tail;
  uint8_t _pad3[56];
} blink_ring_header;

/* Fixed part of a request slot (gateway writes; seq last). The prompt follows at prompt_offset. */
typedef struct blink_request_slot {
  uint64_t seq;
  uint64_t request_id;
  uint32_t prompt_len;
  uint32_t max_tokens;
  float temperature;
  float top_p;
  int32_t top_k;
  float min_p;
  uint64_t seed;
  uint32_t flags;
  uint32_t priority;
  uint32_t num_stop_ids;
  uint32_t _pad0;
  uint64_t cancel_seq;
  /* version 2 */
  float presence_penalty;   /* 0: off */
  float frequency_penalty;  /* 0: off */
  float repetition_penalty; /* 1: off */
  uint32_t num_logit_bias;  /* entries in the slot's logit-bias area */
  uint32_t num_logprobs;    /* alternatives per token when BLINK_RING_FLAG_LOGPROBS is set */
  uint8_t _pad1[36];
  int32_t stop_ids[]; /* [max_stop_ids] */
} blink_request_slot;

/* A response slot: line 0 and the tokens by the engine, line 1 by the gateway. */
typedef struct blink_response_slot {
  uint64_t seq;
  uint32_t produced;
  uint32_t finish_reason;
  uint64_t first_token_ns;
  uint64_t last_token_ns;
  uint32_t prompt_len;
  uint32_t error_code;
  uint8_t _pad0[24];
  uint32_t consumed;
  uint8_t _pad1[60];
  int32_t tokens[]; /* [max_output_len], a ring indexed by produced % max_output_len */
} blink_response_slot;

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

#endif /* BLINK_RING_H */
