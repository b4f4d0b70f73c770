// The GPU-resident loop's state and its side of the ring, for kernels/csrc/persistent_loop.cu (device
// code; the file's head explains the loop). The arguments every kernel reads and the counters mirrored to the
// host (their structs generated: blink_loop_layout.h), the ring's memory order (payload first, the validating word last with a release store at system
// scope), publishing, admission, the look at the ring, shutdown.
#ifndef BLINK_LOOP_CUH
#define BLINK_LOOP_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "blink_admit.h"
#include "blink_ring.h"
#include "blink_sched.h"
#include "blink_sys_mem.cuh"

#define BLINK_LOOP_THREADS 256
#define BLINK_LOOP_IDLE_SLEEP_MAX_NS 2000u
#define BLINK_LOOP_IDLE_BEAT_NS 1000000ull  // heartbeat while idle: every 1 ms
// ErrorCode values beyond the scheduler's own (blink_sched_error): enum blink_error_code, blink_ring_layout.h

// blink_loop_counters, blink_loop_ctl (shared with the host: pinned, mapped), blink_loop_options,
// blink_loop_ext and blink_loop_args: generated from kernels/loop_decl.py (`python -m protocols.layout.gen`).
#include "blink_loop_layout.h"

// What blink_loop_take needs about sampled row j of the running step to accept the speculation: where its
// token goes in the history and in the speculated step buffer, and how to tell a stop token.
struct spec_row {
  int64_t hist;                           // index into the token history
  int32_t input_row;                      // its input row in the speculated step, -1: none
  int32_t slot;
  int32_t num_stop;                       // the slot's stop ids (0: only EOS can stop it)
  int32_t ignore_eos;
};

// ---- memory access to the ring (ld_v, st_release_*, now_ns: blink_sys_mem.cuh) --------------------------

__device__ __forceinline__ blink_ring_header* ring_header(const blink_loop_args* a) {
  return (blink_ring_header*)a->ring;
}
__device__ __forceinline__ blink_request_slot* request(const blink_loop_args* a, uint32_t slot) {
  return (blink_request_slot*)(a->ring + a->requests_offset + (uint64_t)slot * a->request_bytes);
}
__device__ __forceinline__ blink_response_slot* response(const blink_loop_args* a, uint32_t slot) {
  return (blink_response_slot*)(a->ring + a->responses_offset + (uint64_t)slot * a->response_bytes);
}

// The two copies of the scheduler's hot state, their submission heads, and the two step buffers.
__device__ __forceinline__ uint8_t* hot_of(const blink_loop_args* a, uint32_t state) {
  return state ? a->hot_alt : a->sched_mem;
}
__device__ __forceinline__ uint64_t* sq_head_of(blink_loop_args* a, uint32_t state) {
  return state ? &a->sq_head_alt : &a->sq_head;
}
__device__ __forceinline__ uint8_t* step_buf_of(const blink_loop_args* a, uint32_t b) {
  return b ? a->step_buf_alt : a->step_buf;
}

#include "blink_loop_ext.cuh"

// Response words as RingConsumer writes them: counters first, `seq` last (they now belong to `seq`).
__device__ void reset_response(const blink_loop_args* a, uint32_t slot, uint64_t seq, uint32_t prompt_len) {
  blink_response_slot* r = response(a, slot);
  st_v(&r->produced, 0u);
  st_v(&r->finish_reason, (uint32_t)BLINK_FINISH_NONE);
  st_v(&r->error_code, 0u);
  st_v(&r->prompt_len, prompt_len);
  st_v(&r->cached_tokens, 0u);
  st_v(&r->first_token_ns, (uint64_t)0);
  st_v(&r->last_token_ns, (uint64_t)0);
  st_release_u64(&r->seq, seq);
}

// The last word on a slot: error code, then the finish reason (release: after every token of the slot).
__device__ void finish_response(const blink_loop_args* a, uint32_t slot, uint32_t reason, uint32_t error) {
  blink_response_slot* r = response(a, slot);
  st_v(&r->error_code, error);
  st_release_u32(&r->finish_reason, reason);
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64's finalizer: seeds for unseeded requests
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Copy `bytes` (a multiple of 8; both ends 16-byte aligned) with every thread of the block.
__device__ void block_copy(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  for (uint64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) ((uint4*)dst)[i] = ((const uint4*)src)[i];
  if (bytes % 16 && threadIdx.x == 0) ((uint2*)dst)[bytes / 8 - 1] = ((const uint2*)src)[bytes / 8 - 1];
}

struct loop_scratch {  // per-slot scratch of one loop kernel: shared memory when it fits, else global
  int32_t* room;
  int32_t* order;
  int32_t* par;
  uint8_t* cancel;
};

// ---- publishing (RingConsumer.publish / finish / set_stats / beat) -----------------------------------------
// The header's KV words: evictable blocks count as free (an allocation takes them), then the prefix cache's.
__device__ void write_kv_stats(blink_ring_header* hdr, const blink_sched_header* h) {
  st_v(&hdr->free_kv_blocks, (uint32_t)(h->num_free + h->num_evictable));
  st_v(&hdr->cached_kv_blocks, (uint32_t)h->num_cached);
  st_v(&hdr->prefix_cache_queries, (uint64_t)h->prefix_queries);
  st_v(&hdr->prefix_cache_hits, (uint64_t)h->prefix_hits);
}

// All threads: the tokens of the last update, one per slot (its `produced` last, with release), then,
// after a system fence, the finishes. Thread 0: the header's counters and the heartbeat.
// A new-list entry -1 - slot (a STOPPING sequence's dropped row) has no token.
__device__ void publish(blink_loop_args* a, const blink_sched* s) {
  __shared__ int32_t sh_skipped;
  const blink_sched_header* h = s->h;
  const uint64_t now = now_ns() + (uint64_t)a->clock_offset_ns;
  const uint32_t cap = a->max_output_len;
  if (threadIdx.x == 0) sh_skipped = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < h->num_new; i += blockDim.x) {
    if (s->new_slot[i] < 0) {
      atomicAdd(&sh_skipped, 1);
      continue;
    }
    const uint32_t slot = (uint32_t)s->new_slot[i];
    blink_response_slot* r = response(a, slot);
    const uint32_t p = a->slot_produced[slot];
    st_v(&r->tokens[p % cap], s->new_token[i]);
    ext_publish_logprob(a, slot, p);
    if (p == 0) {
      st_v(&r->cached_tokens, (uint32_t)s->cached_tokens[slot]);  // before `produced`, like the tokens
      st_v(&r->first_token_ns, now);
    }
    st_v(&r->last_token_ns, now);
    st_release_u32(&r->produced, p + 1);
    a->slot_produced[slot] = p + 1;
  }
  __threadfence_system();
  __syncthreads();
  for (int32_t i = threadIdx.x; i < h->num_finished; i += blockDim.x)  // -1 - slot: dropped (drop_old_request);
    if (s->fin_slot[i] >= 0)  // an update's ERROR: an empty token mask
      finish_response(a, (uint32_t)s->fin_slot[i], (uint32_t)s->fin_reason[i],
                      s->fin_reason[i] == BLINK_FINISH_ERROR ? (uint32_t)BLINK_ERROR_INVALID_PARAMS : 0u);
  for (uint32_t i = threadIdx.x; i < a->num_err; i += blockDim.x)  // a speculation's admission errors
    finish_response(a, (uint32_t)a->err_slot[i], BLINK_FINISH_ERROR, (uint32_t)a->err_code[i]);
  __syncthreads();
  if (threadIdx.x == 0) {
    blink_ring_header* hdr = ring_header(a);
    a->num_err = 0;
    a->generated += h->num_new - sh_skipped;
    st_v(&hdr->generated_tokens, a->generated);
    write_kv_stats(hdr, h);
    st_v(&hdr->running, (uint32_t)h->num_running);
    st_v(&hdr->waiting, (uint32_t)h->num_waiting);
    a->beats += 1;
    st_v(&hdr->heartbeat, a->beats);
  }
}

// ---- admission (RingConsumer.take_new + EngineLoop._admit; the checks are blink_admit.h's) -----------------
// The ring is a trust boundary (over RDMA another machine writes it): every word is read once into a
// snapshot or a register, checked, and only then used; a bad request ends with FINISH_ERROR and its error
// code in its own response, exactly as the host engines write it, and the loop goes on.
#define BLINK_REQUEST_WORDS (sizeof(blink_request_slot) / 8)  // its fixed part, in 8-byte words
static_assert(BLINK_LOOP_THREADS >= BLINK_REQUEST_WORDS, "read_request: one thread per word of the fixed part");

__device__ __forceinline__ blink_admit_limits admit_limits(const blink_loop_args* a, const blink_sched* s) {
  return blink_admit_limits{a->max_prompt_len, a->max_stop_ids, a->max_logit_bias, a->max_logprobs, a->vocab,
                            a->max_block_hashes, (uint32_t)s->h->cfg.block_size, a->ext ? a->ext->mask_words : 0u};
}

// The first BLINK_REQUEST_WORDS threads: the request's fixed part into `snap`, one load per word (the only
// read of those words: what is checked is what is used, whatever a racing writer stores meanwhile).
__device__ __forceinline__ void read_request(const blink_loop_args* a, uint32_t slot, uint64_t* snap) {
  const uint64_t* src = (const uint64_t*)request(a, slot);
  if (threadIdx.x < BLINK_REQUEST_WORDS) snap[threadIdx.x] = ld_v(&src[threadIdx.x]);
}

// All threads (spec kernel): whether `slot` is still in use in the speculated state: live, or named by the
// running step's new or finish list, or by an error of this admission. Taking it now would write its token
// history and response under the running step, whose commit still writes them: the speculation is dropped
// instead, and the full step takes the request after that commit. Returns it to every thread.
__device__ int slot_in_use_spec(const blink_loop_args* a, const blink_sched* s, uint32_t slot) {
  const int32_t id = (int32_t)slot;
  int busy = 0;
  if (threadIdx.x == 0) {
    busy = s->status[slot] != BLINK_SEQ_FINISHED;
    for (uint32_t i = 0; i < a->num_err; ++i) busy |= a->err_slot[i] == id;
  }
  for (int32_t i = threadIdx.x; i < s->h->num_new; i += blockDim.x) busy |= s->new_slot[i] == id;
  for (int32_t i = threadIdx.x; i < s->h->num_finished; i += blockDim.x) busy |= s->fin_slot[i] == id;
  return __syncthreads_or(busy);
}

// All threads (full step): `slot` taken again while it still holds a request (a producer's error; the host
// engines drop that request too): the old sequence is freed with no finish (the response area is the new
// request's now), and its token and finish not yet published are dropped (-1 - slot: the publish skips them).
__device__ void drop_old_request(blink_sched* s, uint32_t slot) {
  const int32_t id = (int32_t)slot;
  for (int32_t i = threadIdx.x; i < s->h->num_new; i += blockDim.x)
    if (s->new_slot[i] == id) s->new_slot[i] = -1 - id;
  for (int32_t i = threadIdx.x; i < s->h->num_finished; i += blockDim.x)
    if (s->fin_slot[i] == id) s->fin_slot[i] = -1 - id;
  if (threadIdx.x == 0 && s->status[slot] != BLINK_SEQ_FINISHED) blink_sched_finish(s, id);
  __syncthreads();
}

// All threads: the request's arrays, each element checked as it is copied (the value kept is the value
// checked): the prompt into the scheduler's token history (its first context_len ids; a longer prompt is
// refused, but every id is checked, as the host engines check ids first), the stop ids into the scheduler's,
// the logit bias into the extension tables. No count is read past the geometry. Returns whether every element
// passed (to every thread).
// The block hashes of the request in snapshot `w` worth copying to the scheduler: none with the cache off, else
// up to one per full block of its (clipped) prompt and the slot's area (blink_sched_add checks them further).
__device__ uint32_t block_hashes_to_copy(const blink_loop_args* a, const blink_sched* s, const blink_request_slot* w) {
  const blink_sched_config* c = &s->h->cfg;
  if (!c->prefix_caching) return 0;
  const uint32_t n = w->num_block_hashes < a->max_block_hashes ? w->num_block_hashes : a->max_block_hashes;
  const uint32_t len = w->prompt_len < a->max_prompt_len ? w->prompt_len : a->max_prompt_len;
  const uint32_t full = (len < (uint32_t)c->context_len ? len : (uint32_t)c->context_len) / (uint32_t)c->block_size;
  return n < full ? n : full;
}

__device__ int copy_arrays(blink_loop_args* a, blink_sched* s, uint32_t slot, const blink_request_slot* w) {
  const blink_request_slot* req = request(a, slot);
  const uint32_t n_prompt = w->prompt_len < a->max_prompt_len ? w->prompt_len : a->max_prompt_len;
  const uint32_t n_stop = w->num_stop_ids < a->max_stop_ids ? w->num_stop_ids : a->max_stop_ids;
  const uint32_t n_bias = w->num_logit_bias < a->max_logit_bias ? w->num_logit_bias : a->max_logit_bias;
  const uint32_t ctx = (uint32_t)s->h->cfg.context_len;
  const int32_t* prompt = (const int32_t*)((const uint8_t*)req + a->prompt_offset);
  int32_t* tokens = s->tokens + (int64_t)slot * ctx;
  int ok = 1;
  for (uint32_t i = threadIdx.x; i < n_prompt; i += blockDim.x) {
    const int32_t id = ld_v(&prompt[i]);
    ok &= blink_admit_prompt_id_ok(id, a->vocab);
    if (i < ctx) tokens[i] = id;
  }
  int32_t* stops = s->stop_ids + (int64_t)slot * s->h->cfg.max_stop_ids;
  for (uint32_t i = threadIdx.x; i < n_stop; i += blockDim.x) {
    const int32_t id = ld_v(&req->stop_ids[i]);
    ok &= blink_admit_stop_id_ok(id);
    stops[i] = id;
  }
  const uint8_t* area = a->ring + a->bias_offset + (uint64_t)slot * a->bias_bytes;  // ids, then values
  for (uint32_t j = threadIdx.x; j < n_bias; j += blockDim.x) {
    const int32_t id = ld_v((const int32_t*)area + j);
    const float bias = ld_v((const float*)(area + a->bias_bytes / 2) + j);
    ok &= blink_admit_bias_ok(id, bias);
    ext_keep_bias(a, slot, j, id, bias);
  }
  const uint32_t n_hashes = block_hashes_to_copy(a, s, w);  // any 64-bit value is a hash: nothing to check
  const uint64_t* hsrc = (const uint64_t*)(a->ring + a->hash_offset + (uint64_t)slot * a->hash_bytes);
  uint64_t* hdst = s->seq_hashes + (int64_t)slot * blink_max_blocks_per_seq(&s->h->cfg);
  for (uint32_t i = threadIdx.x; i < n_hashes; i += blockDim.x) hdst[i] = ld_v(&hsrc[i]);
  return __syncthreads_and(ok);
}

// Thread 0: reset the response of the request in snapshot `w`, check it, queue it or fail it.
// With `spec` (the spec kernel) an error is deferred to the publish that follows the speculation's
// acceptance: a dropped speculation must leave no trace the gateway could act on. (The response reset is
// written at once: the slot is free in the real state too, and the full step writes the same words.)
__device__ void take_request(blink_loop_args* a, blink_sched* s, const loop_scratch& x, uint32_t slot,
                             const blink_request_slot* w, int arrays_ok, bool spec) {
  const int32_t prompt_len = (int32_t)(w->prompt_len < a->max_prompt_len ? w->prompt_len : a->max_prompt_len);
  reset_response(a, slot, w->seq, (uint32_t)prompt_len);
  const blink_admit_limits limits = admit_limits(a, s);
  const int32_t err = blink_admit_error(s, &limits, w, arrays_ok, a->ext != nullptr);
  if (err != BLINK_ERR_NONE) {
    if (spec) {  // at most num_slots entries per admission (blink_admit_first): the list holds them
      a->err_slot[a->num_err] = (int32_t)slot;
      a->err_code[a->num_err++] = err;
    } else {
      finish_response(a, slot, BLINK_FINISH_ERROR, (uint32_t)err);
    }
    return;
  }
  ext_admit(a, slot, w);
  const uint64_t seed = w->flags & BLINK_RING_FLAG_HAS_SEED ? w->seed
                                                             : mix64(now_ns() ^ ((uint64_t)slot << 40) ^ w->request_id);
  const int64_t ctx = s->h->cfg.context_len;
  const int32_t* prompt = s->tokens + (int64_t)slot * ctx;  // copied and checked there by copy_arrays
  const int32_t* stops = s->stop_ids + (int64_t)slot * s->h->cfg.max_stop_ids;
  const uint64_t* hashes = s->seq_hashes + (int64_t)slot * blink_max_blocks_per_seq(&s->h->cfg);  // copy_arrays
  blink_sched_add(s, (int32_t)slot, prompt, prompt_len, (int64_t)w->max_tokens, w->priority, stops,
                  (int32_t)w->num_stop_ids, (w->flags & BLINK_RING_FLAG_IGNORE_EOS) ? 1 : 0, w->temperature, w->top_k,
                  w->top_p, w->min_p, seed, hashes, (int32_t)block_hashes_to_copy(a, s, w));
  a->slot_seq[slot] = w->seq;
  a->slot_produced[slot] = 0;
  x.room[slot] = ext_capacity(a, slot);  // a new request's output area is empty
}

// All threads: take the requests queued from `head_in` up to `tail`, in submission order: at most one lap
// (older entries were overwritten), entries that name no slot skipped, a tail behind the head taking nothing.
// *head_out = the new head. The ring's copy of the head is written here, or (spec) by the publish after the
// acceptance. The spec kernel stops at a slot still in use (slot_in_use_spec) and taints its speculation.
__device__ void admit(blink_loop_args* a, blink_sched* s, const loop_scratch& x, uint64_t head_in, uint64_t tail,
                      uint64_t* head_out, bool spec) {
  __shared__ __align__(16) uint64_t sh_req[BLINK_REQUEST_WORDS];
  __shared__ uint32_t sh_slot;
  const blink_request_slot* w = (const blink_request_slot*)sh_req;
  const uint32_t* sq = (const uint32_t*)(a->ring + a->sq_offset);
  const uint64_t end = blink_admit_end(head_in, tail);
  uint64_t head = blink_admit_first(head_in, tail, a->num_slots);
  __threadfence_system();  // the tail was read relaxed: what it covers is read after it
  for (; head < end; ++head) {
    if (threadIdx.x == 0) sh_slot = ld_v(&sq[head % a->num_slots]);
    __syncthreads();
    const uint32_t slot = sh_slot;
    if (!blink_admit_slot_ok(slot, a->num_slots)) {  // no response area to report an error in
      __syncthreads();
      continue;
    }
    if (spec && slot_in_use_spec(a, s, slot)) {
      if (threadIdx.x == 0) s->h->spec_tainted = 1;
      break;
    }
    read_request(a, slot, sh_req);
    if (spec) __syncthreads();
    else drop_old_request(s, slot);  // ends with a barrier
    const int arrays_ok = copy_arrays(a, s, slot, w);
    if (threadIdx.x == 0) take_request(a, s, x, slot, w, arrays_ok, spec);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *head_out = head;
    if (!spec) st_v(&ring_header(a)->sq_head, head);
  }
  __syncthreads();
}

// The ring words a poll needs, loaded into registers at the start of the step kernel and used after the
// commit: their PCIe round trips overlap the commit's work (a load in flight does not hold a barrier up).
#define BLINK_LOOP_PREFETCH 4  // slots per thread (up to 4 x the block's threads)
struct ring_look {
  uint64_t tail;
  uint32_t stop;
  uint64_t cancel_seq[BLINK_LOOP_PREFETCH];
  uint32_t consumed[BLINK_LOOP_PREFETCH];
};

__device__ __forceinline__ void look_issue(const blink_loop_args* a, ring_look& r) {
#pragma unroll
  for (uint32_t k = 0; k < BLINK_LOOP_PREFETCH; ++k) {  // unrolled: the words stay in registers
    const uint32_t slot = threadIdx.x + k * blockDim.x;
    if (slot < a->num_slots) {
      r.cancel_seq[k] = ld_v(&request(a, slot)->cancel_seq);
      r.consumed[k] = ld_v(&response(a, slot)->consumed);
    }
  }
  // relaxed, not acquire: an acquire would hold this thread's next memory accesses (the commit's) until
  // it completes; admission fences before it reads what the tail covers
  if (threadIdx.x == 0) r.tail = ld_v(&ring_header(a)->sq_tail);
  if (threadIdx.x == 32 % blockDim.x) r.stop = ld_v(&a->ctl->stop);
}

// One slot's part of a look: whether it is cancelled, and its output room (live slots only).
__device__ __forceinline__ int look_slot(blink_loop_args* a, const blink_sched* s, const loop_scratch& x,
                                         uint32_t slot, uint64_t cancel_seq, uint32_t consumed) {
  uint8_t cancelled = 0;
  if (s->status[slot] != BLINK_SEQ_FINISHED) {
    cancelled = cancel_seq == a->slot_seq[slot];
    x.room[slot] = blink_admit_room(ext_capacity(a, slot), a->slot_produced[slot], consumed);
  }
  x.cancel[slot] = cancelled;
  return cancelled;
}

// All threads, after the look's barrier: the new list's tokens are in the scheduler but not yet in the ring
// (the publish kernel beside the next bucket graph writes them, or the idle full step's first attempt), and
// each takes one place of its slot's room, which was read from `produced` as published. Both the full step
// (step n's tokens, just applied) and the speculation (step n's placeholders) schedule with such a list: a
// slot one token short of consumed + capacity would get a step, and its token would overwrite an unread one.
// (The host engines publish a step's tokens before they read the room: theirs is right as read.)
__device__ __forceinline__ void count_unpublished(const blink_sched* s, const loop_scratch& x) {
  for (int32_t j = threadIdx.x; j < s->h->num_new; j += blockDim.x) {
    const int32_t slot = s->new_slot[j];  // -1 - slot: a dropped row, no token
    if (slot >= 0 && x.room[slot] > 0) x.room[slot] -= 1;
  }
}

// All threads: one look at the ring (with `ahead`, the words in `look`; else loaded now, all issued
// together: each is a PCIe round trip): the submission tail, the stop flag, and for each live slot its
// cancel word and the gateway's `consumed` (-> room, less the tokens not yet published: count_unpublished).
// Thread 0 then finishes the cancelled sequences (EngineLoop._apply_cancels). Returns 1: stop, 0: go on;
// *tail gets the submission tail.
// With `spec`, a cancel's finish goes to the finish list (published if the speculation is taken).
__device__ __forceinline__ int poll_ring(blink_loop_args* a, blink_sched* s, const loop_scratch& x,
                                         uint64_t* tail, const ring_look& look, bool ahead, bool spec) {
  __shared__ uint64_t sh_tail;
  __shared__ uint32_t sh_stop;
  if (threadIdx.x == 0) sh_tail = ahead ? look.tail : ld_v(&ring_header(a)->sq_tail);
  if (threadIdx.x == 32 % blockDim.x) sh_stop = ahead ? look.stop : ld_v(&a->ctl->stop);
  int any = 0;
#pragma unroll
  for (uint32_t k = 0; k < BLINK_LOOP_PREFETCH; ++k) {  // the slots whose words may have been loaded ahead
    const uint32_t slot = threadIdx.x + k * blockDim.x;
    if (slot < a->num_slots) {
      any |= look_slot(a, s, x, slot, ahead ? look.cancel_seq[k] : ld_v(&request(a, slot)->cancel_seq),
                       ahead ? look.consumed[k] : ld_v(&response(a, slot)->consumed));
    }
  }
  for (uint32_t slot = threadIdx.x + BLINK_LOOP_PREFETCH * blockDim.x; slot < a->num_slots; slot += blockDim.x)
    any |= look_slot(a, s, x, slot, ld_v(&request(a, slot)->cancel_seq), ld_v(&response(a, slot)->consumed));
  const int cancels = __syncthreads_or(any);
  count_unpublished(s, x);
  if (cancels && threadIdx.x == 0) {
    for (uint32_t slot = 0; slot < a->num_slots; ++slot) {
      if (!x.cancel[slot]) continue;
      blink_sched_finish(s, (int32_t)slot);
      if (spec) {
        s->fin_slot[s->h->num_finished] = (int32_t)slot;
        s->fin_reason[s->h->num_finished++] = BLINK_FINISH_CANCELLED;
      } else {
        finish_response(a, slot, BLINK_FINISH_CANCELLED, 0);
      }
    }
  }
  __syncthreads();
  *tail = sh_tail;
  return sh_stop != 0;
}

// Thread 0: the loop ends with the running graph; the host sees `exited` (and the stream end).
__device__ __forceinline__ void end_loop(blink_loop_args* a) {
  a->exiting = 1;
  __threadfence_system();
  st_v(&a->ctl->exited, 1u);
}

// All threads, on `stop`: the last tokens published, every live sequence reported failed (never dropped
// silently), the loop told to end.
__device__ void shut_down(blink_loop_args* a, blink_sched* s, uint32_t error) {
  publish(a, s);
  __syncthreads();
  if (threadIdx.x == 0) {
    blink_sched_header* h = s->h;
    h->num_new = h->num_finished = 0;  // published: the publish kernel of this iteration does nothing
    for (uint32_t slot = 0; slot < a->num_slots; ++slot) {
      if (s->status[slot] == BLINK_SEQ_FINISHED) continue;
      blink_sched_finish(s, (int32_t)slot);
      finish_response(a, slot, BLINK_FINISH_ERROR, error);
    }
    h->num_entries = 0;
    blink_ring_header* hdr = ring_header(a);
    write_kv_stats(hdr, h);
    st_v(&hdr->running, 0u);
    st_v(&hdr->waiting, 0u);
    end_loop(a);  // no graph is launched after this one
  }
}

// Thread 0: the graph that runs after this one: bucket graph `branch`, or the full step when `branch` is
// num_branches. A tail launch: it starts once every node of the running graph has ended, so what this
// graph's kernels wrote is visible to it. A failed launch ends the loop (the host sees the stream end and
// ctl->error, and fails what is in flight).
__device__ __forceinline__ void launch_next(blink_loop_args* a, cudaGraphExec_t next) {
  if (cudaGraphLaunch(next, cudaStreamGraphTailLaunch) != cudaSuccess) {
    st_v(&a->ctl->error, (uint32_t)BLINK_LOOP_FAULT_GRAPH_LAUNCH);
    end_loop(a);
  }
}

__device__ __forceinline__ cudaGraphExec_t exec_of(const blink_loop_args* a, uint32_t branch) {
  return branch < a->num_branches ? a->branch_execs[branch] : a->full_exec;
}

__device__ __forceinline__ void run_next(blink_loop_args* a, uint32_t branch) { launch_next(a, exec_of(a, branch)); }

// Thread 0: a model step was committed at t0 with `tokens` new tokens (busy time: back-to-back steps only).
__device__ void count_step(blink_loop_args* a, uint64_t t0, int32_t tokens) {
  a->c.steps += 1;
  a->c.tokens += tokens;
  if (a->last_commit_ns) {
    a->c.busy_ns += t0 - a->last_commit_ns;
    a->c.busy_steps += 1;
  }
  a->last_commit_ns = t0;
}

__device__ void mirror_counters(blink_loop_args* a) {  // thread 0: device counters -> the host's view
  const uint64_t* src = (const uint64_t*)&a->c;
  uint64_t* dst = (uint64_t*)&a->ctl->c;
  for (int i = 0; i < (int)(sizeof(blink_loop_counters) / 8); ++i) st_v(&dst[i], src[i]);
}

#endif  // BLINK_LOOP_CUH
