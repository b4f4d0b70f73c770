// The request/response ring as device (and host) code sees it.
// Mirrors protocols/ring.py, the single source of truth; tests/protocols/test_ring_layout.py compiles this
// header with the host compiler and compares every offset and size with the Python layout.
// Writers: lines 0-1 of the header by the creator, line 2 by the engine, line 3 by the gateway.
#ifndef BLINK_RING_H
#define BLINK_RING_H

#include <stdint.h>

#define BLINK_RING_MAGIC 0x474E49524B4E494CULL /* "LINKRING" */
#define BLINK_RING_VERSION 1u
#define BLINK_RING_HEADER_BYTES 256u
#define BLINK_RING_FLAG_HAS_SEED (1u << 0)
#define BLINK_RING_FLAG_IGNORE_EOS (1u << 1)

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
  uint8_t _pad0[24];
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
  uint8_t _pad1[56];
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

#endif /* BLINK_RING_H */
