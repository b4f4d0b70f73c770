// The GPU-resident loop: one CUDA graph, launched once, that serves the ring with no host CPU per token.
//
//   WHILE (loop_handle) {
//     step kernel       accept the speculation below when the step that just ran sampled no stop token and
//                       nothing new is queued (write its tokens where it left placeholders: a few stores);
//                       otherwise the full step: apply the sampled tokens, admit new requests from the ring,
//                       honour cancels, choose the next step and fill its step buffer (blink_sched.h, with
//                       the block-parallel parts of blink_sched_par.cuh) -- or, with nothing to run, spin
//                       (one block) until work comes. Then pick the bucket graph.
//     then, side by side:
//       SWITCH (branch) step buffer b, bucket i: branch 2 * (b * num_buckets + i) + greedy (child graphs
//                       captured by PyTorch over one of two step buffers)
//       publish kernel  the committed tokens and finishes to the response areas, with the ring's fences,
//       -> spec kernel  step n+1 scheduled while step n runs: the state copied (the per-slot arrays; the large
//                       ones are shared, written only where the real state does not look), step n's tokens
//                       applied as placeholders, the ring polled and admitted (errors and cancels deferred),
//                       the step chosen and filled into the other step buffer
//   }
// So the step's critical path between two bucket graphs is the short check, not the scheduler. A step that
// samples a stop token (or would preempt, or finds new requests queued after the speculation looked) takes
// the full path: the decisions are always those of the serial scheduler on the real state.
// The kernels keep the scheduler's hot state (header, per-slot scalars, lists) in shared memory for
// their serial parts: one thread walking global memory pays a cache miss per load.
//
// The ring lives in host memory (the shm transport's file), registered with cudaHostRegister: the loop reads
// it over PCIe with volatile loads (L1 would keep stale lines across slot reuse) and a system fence before
// it reads what a submission tail covers, and writes it
// with the ring's order: payload first, the validating word last with a release store at system scope.
// Scheduling state, the step buffers and the sampled tokens stay in device memory. The host thread only sets
// `ctl->stop` (pinned, mapped) and watches the stream; gpu_backend/engine/persistent.py drives this file.
// DESIGN.md "The GPU-resident loop" explains the choice of WHILE + SWITCH over device graph launch.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blink_ring.h"
#include "blink_sched.h"
#include "blink_sched_par.cuh"

#define BLINK_LOOP_THREADS 256
#define BLINK_LOOP_IDLE_SLEEP_MAX_NS 2000u
#define BLINK_LOOP_IDLE_BEAT_NS 1000000ull  // heartbeat while idle: every 1 ms
// ErrorCode values of protocols/ring.py beyond the scheduler's own (blink_sched_error)
#define BLINK_ERROR_ENGINE_STOPPING 4u
#define BLINK_ERROR_INTERNAL 5u

struct blink_loop_counters {
  uint64_t iterations;       // loop kernel runs
  uint64_t steps;            // model steps
  uint64_t tokens;           // tokens published
  uint64_t busy_ns;          // sum over back-to-back steps of commit-to-commit time
  uint64_t busy_steps;
  uint64_t sched_ns;         // sum over steps of the loop kernel's time (commit, admission, schedule, fill)
  uint64_t idle_polls;
  uint64_t commit_ns;        // parts of sched_ns: copy-in + applying the sampled tokens,
  uint64_t schedule_ns;      // ring poll + admission + scheduling (of the last attempt),
  uint64_t fill_ns;          // step buffer fill + picking the graph
  uint64_t spec_hits;        // steps whose speculation was taken
  uint64_t spec_misses;      // speculations dropped (a stop token, new requests, a preemption, nothing to run)
  uint64_t spec_ns;          // the spec kernel's time (beside the bucket graph)
};

// Shared with the host (pinned, mapped): the host writes `stop`; the loop only stores the rest (a read of
// host memory is a PCIe round trip, so the loop keeps its counters in device memory and mirrors them).
struct blink_loop_ctl {
  uint32_t stop;             // host: 1 = fail what is in flight, leave the loop
  uint32_t exited;           // loop: 1 once the last iteration ran
  blink_loop_counters c;
  uint32_t error;            // nonzero: the loop stopped on an internal error (a bucket it has no graph for)
  uint32_t _pad;
};

// What the step kernel needs about sampled row j of the running step to accept the speculation: where its
// token goes in the history and in the speculated step buffer, and how to tell a stop token.
struct spec_row {
  int64_t hist;                           // index into the token history
  int32_t input_row;                      // its input row in the speculated step, -1: none
  int32_t slot;
  int32_t num_stop;                       // the slot's stop ids (0: only EOS can stop it)
  int32_t ignore_eos;
};

// Everything the kernels need, in device memory (written once by the host before the launch).
struct blink_loop_args {
  uint8_t* ring;                          // device address of the ring
  uint64_t sq_offset, requests_offset, responses_offset, request_bytes, response_bytes, prompt_offset;
  uint32_t num_slots, max_prompt_len, max_output_len, max_stop_ids;
  uint8_t* sched_mem;                     // blink_sched state (device)
  uint64_t hot_bytes;                     // its hot prefix (blink_sched_bind_split), set by blink_loop_create
  uint32_t smem_bytes;                    // 0: the hot prefix does not fit in shared memory, use it in place
  uint32_t _pad0;
  uint8_t* step_buf;                      // gpu_runner.StepBuffers.dev
  const int64_t* sampled;                 // gpu_runner.tokens_dev: the graphs' sampled tokens
  int32_t* sampled32;                     // [max_seqs] scratch
  uint64_t* slot_seq;                     // [num_slots] the request seq a slot serves
  uint32_t* slot_produced;                // [num_slots] tokens published (the response's `produced`)
  int32_t* room;                          // [num_slots] scratch (when not in shared memory)
  int32_t* order;                         // [num_slots] scratch of blink_sched_schedule (idem)
  uint8_t* cancel;                        // [num_slots] scratch (idem)
  int32_t* par;                           // [5 * num_slots] scratch of blink_sched_par.cuh (idem)
  blink_loop_ctl* ctl;                    // device address of the mapped control block
  cudaGraphConditionalHandle loop_handle, branch_handle;
  uint32_t num_branches;
  uint32_t check_tail;                    // 1: new requests queued after the speculation looked drop it
  int64_t clock_offset_ns;                // CLOCK_MONOTONIC = %globaltimer + offset (response timestamps)
  // the loop's own words (device memory, read and written only by the kernels)
  uint64_t sq_head, beats, generated, last_commit_ns;
  blink_loop_counters c;
  // speculation and the second step buffer; the pointers are set by blink_loop_create
  uint8_t* step_buf_alt;                  // the step buffer of the branches b = 1 (step_buf: b = 0)
  uint8_t* hot_alt;                       // the second copy of the scheduler's hot prefix
  int32_t* tokens;                        // the scheduler's token history (cold, shared by both copies)
  int32_t* stop_ids;                      // its stop ids (cold, shared)
  spec_row* rows;                             // [max_seqs] per sampled row of the running step (spec kernel)
  int32_t* err_slot;                      // [num_slots] admission errors the speculation found (deferred)
  int32_t* err_code;
  int32_t* new_token;                     // the speculated state's new_token (where placeholders go)
  uint64_t sq_head_alt;                   // the speculated state's submission head
  uint64_t spec_tail;                     // the submission tail the speculation saw
  uint32_t cur;                           // which hot copy is the real state (0: sched_mem, 1: hot_alt)
  uint32_t buf;                           // the step buffer of the step that runs now
  uint32_t spec_ok;                       // 1: the other copy holds step n+1, filled into the other buffer
  uint32_t spec_branch;                   // its SWITCH branch
  uint32_t spec_rows;                     // sampled rows of the running step
  uint32_t num_err;                       // deferred admission errors, published with the accepted step
  uint32_t exiting;                       // the loop is ending: nothing more to speculate
  uint32_t num_eos;
  int32_t eos_ids[BLINK_SCHED_MAX_EOS];
};


// ---- memory access to the ring ------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T ld_v(const T* p) { return *(const volatile T*)p; }
template <typename T>
__device__ __forceinline__ void st_v(T* p, T v) { *(volatile T*)p = v; }

__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

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

// Response words as RingConsumer writes them: counters first, `seq` last (they now belong to `seq`).
__device__ void reset_response(const blink_loop_args* a, uint32_t slot, uint64_t seq, uint32_t prompt_len) {
  blink_response_slot* r = response(a, slot);
  st_v(&r->produced, 0u);
  st_v(&r->finish_reason, (uint32_t)BLINK_FINISH_NONE);
  st_v(&r->error_code, 0u);
  st_v(&r->prompt_len, prompt_len);
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
// All threads: the tokens of the last update, one per slot (its `produced` last, with release), then,
// after a system fence, the finishes. Thread 0: the header's counters and the heartbeat.
__device__ void publish(blink_loop_args* a, const blink_sched* s) {
  const blink_sched_header* h = s->h;
  const uint64_t now = now_ns() + (uint64_t)a->clock_offset_ns;
  const uint32_t cap = a->max_output_len;
  for (int32_t i = threadIdx.x; i < h->num_new; i += blockDim.x) {
    const uint32_t slot = (uint32_t)s->new_slot[i];
    blink_response_slot* r = response(a, slot);
    const uint32_t p = a->slot_produced[slot];
    st_v(&r->tokens[p % cap], s->new_token[i]);
    if (p == 0) st_v(&r->first_token_ns, now);
    st_v(&r->last_token_ns, now);
    st_release_u32(&r->produced, p + 1);
    a->slot_produced[slot] = p + 1;
  }
  __threadfence_system();
  __syncthreads();
  for (int32_t i = threadIdx.x; i < h->num_finished; i += blockDim.x)
    finish_response(a, (uint32_t)s->fin_slot[i], (uint32_t)s->fin_reason[i], 0);
  for (uint32_t i = threadIdx.x; i < a->num_err; i += blockDim.x)  // a speculation's admission errors
    finish_response(a, (uint32_t)a->err_slot[i], BLINK_FINISH_ERROR, (uint32_t)a->err_code[i]);
  __syncthreads();
  if (threadIdx.x == 0) {
    blink_ring_header* hdr = ring_header(a);
    a->num_err = 0;
    a->generated += h->num_new;
    st_v(&hdr->generated_tokens, a->generated);
    st_v(&hdr->free_kv_blocks, (uint32_t)h->num_free);
    st_v(&hdr->running, (uint32_t)h->num_running);
    st_v(&hdr->waiting, (uint32_t)h->num_waiting);
    a->beats += 1;
    st_v(&hdr->heartbeat, a->beats);
  }
}

// ---- admission (RingConsumer.take_new + EngineLoop._admit) ------------------------------------------------
// Thread 0: read the request's fixed part, reset its response, check it, queue it or fail it.
// Penalties, logit bias or logprobs: the host and cpu engines apply them, this loop not yet. The gateway
// refuses them for this mode; this answers a ring client that does not (INVALID_PARAMS, never ignored).
__device__ bool wants_sampling_extensions(const blink_request_slot* req, uint32_t flags) {
  return (flags & BLINK_RING_FLAG_LOGPROBS) || ld_v(&req->presence_penalty) != 0.0f ||
         ld_v(&req->frequency_penalty) != 0.0f || ld_v(&req->repetition_penalty) != 1.0f ||
         ld_v(&req->num_logit_bias) != 0u;
}

// With `spec` (the spec kernel) an error is deferred to the publish that follows the speculation's
// acceptance: a dropped speculation must leave no trace the gateway could act on. (The response reset is
// written at once: the slot is free in the real state too, and the full step writes the same words.)
__device__ void take_request(blink_loop_args* a, blink_sched* s, const loop_scratch& x, uint32_t slot,
                             int32_t prompt_len, bool spec) {
  const blink_request_slot* req = request(a, slot);
  const uint64_t seq = ld_v(&req->seq);
  const uint32_t flags = ld_v(&req->flags);
  const int64_t max_tokens = ld_v(&req->max_tokens);
  const float temperature = ld_v(&req->temperature), top_p = ld_v(&req->top_p), min_p = ld_v(&req->min_p);
  const int32_t top_k = ld_v(&req->top_k);
  const uint32_t priority = ld_v(&req->priority);
  uint32_t num_stop = ld_v(&req->num_stop_ids);
  if (num_stop > a->max_stop_ids) num_stop = a->max_stop_ids;
  int32_t* stops = s->stop_ids + (int64_t)slot * s->h->cfg.max_stop_ids;  // copied in, then added in place
  for (uint32_t i = 0; i < num_stop; ++i) stops[i] = ld_v(&req->stop_ids[i]);
  reset_response(a, slot, seq, (uint32_t)prompt_len);
  int32_t err = blink_sched_check(s, prompt_len, max_tokens, temperature, top_p, top_k, min_p);
  if (err == BLINK_ERR_NONE && wants_sampling_extensions(req, flags)) err = BLINK_ERR_INVALID_PARAMS;
  if (err != BLINK_ERR_NONE) {
    if (spec) {
      a->err_slot[a->num_err] = (int32_t)slot;
      a->err_code[a->num_err++] = err;
    } else {
      finish_response(a, slot, BLINK_FINISH_ERROR, (uint32_t)err);
    }
    return;
  }
  const uint64_t seed = flags & BLINK_RING_FLAG_HAS_SEED
                            ? ld_v(&req->seed)
                            : mix64(now_ns() ^ ((uint64_t)slot << 40) ^ ld_v(&req->request_id));
  const int32_t* prompt = s->tokens + (int64_t)slot * s->h->cfg.context_len;  // already copied there
  blink_sched_add(s, (int32_t)slot, prompt, prompt_len, max_tokens, priority, stops, (int32_t)num_stop,
                  (flags & BLINK_RING_FLAG_IGNORE_EOS) ? 1 : 0, temperature, top_k, top_p, min_p, seed);
  a->slot_seq[slot] = seq;
  a->slot_produced[slot] = 0;
  x.room[slot] = (int32_t)a->max_output_len;  // a new request's output area is empty
}

// All threads: take every request queued from `head` up to `tail`, in submission order; *head_out = tail.
// The ring's copy of the head is written here, or (spec) by the publish after the acceptance.
__device__ void admit(blink_loop_args* a, blink_sched* s, const loop_scratch& x, uint64_t head_in, uint64_t tail,
                      uint64_t* head_out, bool spec) {
  __shared__ uint32_t sh_slot;
  __shared__ int32_t sh_len;
  const uint32_t* sq = (const uint32_t*)(a->ring + a->sq_offset);
  const int32_t ctx = s->h->cfg.context_len;
  __threadfence_system();  // the tail was read relaxed: what it covers is read after it
  for (uint64_t head = head_in; head < tail; ++head) {
    if (threadIdx.x == 0) {
      const uint32_t slot = ld_v(&sq[head % a->num_slots]);
      uint32_t len = ld_v(&request(a, slot)->prompt_len);
      if (len > a->max_prompt_len) len = a->max_prompt_len;
      sh_slot = slot;
      sh_len = (int32_t)len;
    }
    __syncthreads();
    // the prompt goes straight to the scheduler's token array (at most context_len of it: longer is refused)
    const int32_t n = sh_len < ctx ? sh_len : ctx;
    const int32_t* src = (const int32_t*)((const uint8_t*)request(a, sh_slot) + a->prompt_offset);
    int32_t* dst = s->tokens + (int64_t)sh_slot * ctx;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = ld_v(&src[i]);
    __syncthreads();
    if (threadIdx.x == 0) take_request(a, s, x, sh_slot, sh_len, spec);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *head_out = tail;
    if (!spec) st_v(&ring_header(a)->sq_head, tail);
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
    x.room[slot] = (int32_t)a->max_output_len - (int32_t)(a->slot_produced[slot] - consumed);
  }
  x.cancel[slot] = cancelled;
  return cancelled;
}

// All threads: one look at the ring (with `ahead`, the words in `look`; else loaded now, all issued
// together: each is a PCIe round trip): the submission tail, the stop flag, and for each live slot its
// cancel word and the gateway's `consumed` (-> room). Thread 0 then finishes the cancelled sequences
// (EngineLoop._apply_cancels). Returns 1: stop, 0: go on; *tail gets the submission tail.
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
  if (__syncthreads_or(any) && threadIdx.x == 0) {
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
    st_v(&hdr->free_kv_blocks, (uint32_t)h->num_free);
    st_v(&hdr->running, 0u);
    st_v(&hdr->waiting, 0u);
    cudaGraphSetConditional(a->branch_handle, a->num_branches);  // no branch
    cudaGraphSetConditional(a->loop_handle, 0);
    a->exiting = 1;
    __threadfence_system();
    st_v(&a->ctl->exited, 1u);
  }
}

__device__ void mirror_counters(blink_loop_args* a) {  // thread 0: device counters -> the host's view
  const uint64_t* src = (const uint64_t*)&a->c;
  uint64_t* dst = (uint64_t*)&a->ctl->c;
  for (int i = 0; i < (int)(sizeof(blink_loop_counters) / 8); ++i) st_v(&dst[i], src[i]);
}

// ---- the scheduler state a kernel works on ----------------------------------------------------------------
// All threads: bind `s` to a copy of the hot state at `src`: in shared memory when it fits (then `x` gets
// its scratch there too; close_state writes it to `dst`), else in place at `dst` (copied from `src` first
// when they differ). The cold arrays are shared by both copies.
__device__ void open_state(blink_loop_args* a, blink_sched* s, loop_scratch* x, uint8_t* smem, const uint8_t* src,
                           uint8_t* dst) {
  uint8_t* hot = dst;
  *x = {a->room, a->order, a->par, a->cancel};
  if (a->smem_bytes) {
    block_copy(smem, src, a->hot_bytes);
    hot = smem;
    x->room = (int32_t*)(smem + a->hot_bytes);
    x->order = x->room + a->num_slots;
    x->par = x->order + a->num_slots;
    x->cancel = (uint8_t*)(x->par + 5 * a->num_slots);
  } else if (src != dst) {
    block_copy(dst, src, a->hot_bytes);
  }
  __syncthreads();
  if (threadIdx.x == 0)
    blink_sched_bind_split(s, hot, a->sched_mem + a->hot_bytes, &((blink_sched_header*)hot)->cfg, 0);
  __syncthreads();
}

__device__ void close_state(const blink_loop_args* a, const uint8_t* smem, uint8_t* dst) {
  __syncthreads();
  if (a->smem_bytes) block_copy(dst, smem, a->hot_bytes);
}

// The SWITCH branch of a filled step: bucket graph `bucket` over step buffer `b`.
__device__ uint32_t branch_of(const blink_sched_header* h, int32_t bucket, uint32_t b) {
  uint32_t index = 0;
  while (h->cfg.buckets[index] != bucket) ++index;
  return 2 * (b * (uint32_t)h->cfg.num_buckets + index) + (h->all_greedy ? 1 : 0);
}

// ---- the fast path: take the speculation -------------------------------------------------------------------
// All threads. The spec kernel scheduled step n+1 while step n ran, as if none of step n's sampled tokens
// stopped its sequence, and left placeholders where those tokens go. If none did and nothing was queued
// after the speculation looked, its decisions are the full step's: write the tokens in, swap the states.
// Returns 1 when taken (the step is chosen and its graph picked).
__device__ int take_speculation(blink_loop_args* a, uint64_t t0) {
  const uint32_t n = a->spec_rows;
  int bad = threadIdx.x == 0 && a->check_tail && ld_v(&ring_header(a)->sq_tail) != a->spec_tail;
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const spec_row r = a->rows[j];
    bad |= blink_is_stop_token(a->eos_ids, (int32_t)a->num_eos, a->stop_ids + (int64_t)r.slot * a->max_stop_ids,
                               r.num_stop, r.ignore_eos, (int32_t)a->sampled[j]);
  }
  if (__syncthreads_or(bad)) return 0;
  int32_t* input = (int32_t*)step_buf_of(a, 1 - a->buf);  // input_ids: the step buffer's first field
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const spec_row r = a->rows[j];
    const int32_t token = (int32_t)a->sampled[j];
    a->tokens[r.hist] = token;
    a->new_token[j] = token;
    if (r.input_row >= 0) input[r.input_row] = token;
  }
  if (threadIdx.x == 0) {
    cudaGraphSetConditional(a->branch_handle, a->spec_branch);
    a->cur ^= 1u;
    a->buf ^= 1u;
    a->spec_ok = 0;
    a->c.steps += 1;
    a->c.tokens += n;
    a->c.spec_hits += 1;
    a->c.iterations += 1;
    if (a->last_commit_ns) {
      a->c.busy_ns += t0 - a->last_commit_ns;
      a->c.busy_steps += 1;
    }
    a->last_commit_ns = t0;
    a->c.sched_ns += now_ns() - t0;
  }
  return 1;
}

// ---- the loop body: this kernel, then SWITCH (the bucket graph) beside publish -> spec ----------------------
// Takes the speculation when it holds; else the full step: commits the last step's tokens to the scheduler,
// takes new requests and cancels, chooses and fills the next step and picks its graph. With nothing to run
// it publishes what is pending itself, then polls (one block, short sleeps, a heartbeat every millisecond).
__global__ void __launch_bounds__(BLINK_LOOP_THREADS) blink_loop_step(blink_loop_args* a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ blink_sched s;
  const uint64_t t0 = now_ns();
  if (a->spec_ok) {
    if (take_speculation(a, t0)) return;
    if (threadIdx.x == 0) {
      a->spec_ok = 0;
      a->num_err = 0;  // the full step below admits those requests again
      a->c.spec_misses += 1;
    }
    __syncthreads();
  }
  ring_look look;
  look_issue(a, look);
  const uint32_t cur = a->cur, next_buf = 1u - a->buf;
  uint8_t* hot = hot_of(a, cur);
  loop_scratch x;
  open_state(a, &s, &x, smem, hot, hot);
  blink_sched_header* h = s.h;
  if (h->num_entries > 0) {  // the step that just ran: its tokens into the scheduler (published below)
    for (int32_t i = threadIdx.x; i < h->num_sampled; i += blockDim.x) a->sampled32[i] = (int32_t)a->sampled[i];
    __syncthreads();
    blink_sched_update_par(&s, a->sampled32, x.par);
    if (threadIdx.x == 0) {
      h->num_entries = 0;
      a->c.steps += 1;
      a->c.tokens += h->num_new;
      if (a->last_commit_ns) {
        a->c.busy_ns += t0 - a->last_commit_ns;
        a->c.busy_steps += 1;
      }
      a->last_commit_ns = t0;
    }
    __syncthreads();
  }
  const uint64_t t_commit = now_ns();
  uint64_t last_beat = t0, t_attempt = t_commit;
  uint32_t sleep_ns = 0;
  int go;  // 1: run a step, -1: stop; the same in every thread
  for (int attempt = 0;; ++attempt) {
    t_attempt = now_ns();
    uint64_t tail;
    const int stop = poll_ring(a, &s, x, &tail, look, attempt == 0, false);
    const uint64_t head = *sq_head_of(a, cur);
    if (tail != head) admit(a, &s, x, head, tail, sq_head_of(a, cur), false);
    go = stop ? -1 : (blink_sched_schedule_par(&s, x.room, x.order, x.par) > 0 ? 1 : 0);
    if (go != 0) break;
    if (attempt == 0) {  // idle from here on: publish what is pending now, not when work comes back
      publish(a, &s);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      if (attempt == 0) {
        h->num_new = h->num_finished = 0;
        mirror_counters(a);
      }
      a->c.idle_polls += 1;
      a->last_commit_ns = 0;  // the next step does not follow a step back to back
      const uint64_t t = now_ns();
      if (t - last_beat > BLINK_LOOP_IDLE_BEAT_NS) {
        blink_ring_header* hdr = ring_header(a);
        st_v(&hdr->free_kv_blocks, (uint32_t)h->num_free);
        st_v(&hdr->running, (uint32_t)h->num_running);
        st_v(&hdr->waiting, (uint32_t)h->num_waiting);
        a->beats += 1;
        st_v(&hdr->heartbeat, a->beats);
        mirror_counters(a);
        last_beat = t;
      }
    }
    sleep_ns = sleep_ns ? (2 * sleep_ns > BLINK_LOOP_IDLE_SLEEP_MAX_NS ? BLINK_LOOP_IDLE_SLEEP_MAX_NS : 2 * sleep_ns) : 100;
    __nanosleep(sleep_ns);
    __syncthreads();
  }
  if (go < 0) {
    shut_down(a, &s, BLINK_ERROR_ENGINE_STOPPING);
  } else {
    const uint64_t t_fill = now_ns();
    uint8_t* buf = step_buf_of(a, next_buf);
    const int32_t bucket = blink_fill_prologue_par(&s, buf, x.par);
    if (bucket < 0) {  // cannot happen with a budget <= the largest bucket; stop loudly rather than hang
      if (threadIdx.x == 0) st_v(&a->ctl->error, 1u);
      shut_down(a, &s, BLINK_ERROR_INTERNAL);
    } else {
      blink_fill_token_rows(&s, buf, threadIdx.x, blockDim.x);
      blink_fill_block_tables_par(&s, buf, x.par);
      if (threadIdx.x == 0) {
        cudaGraphSetConditional(a->branch_handle, branch_of(h, bucket, next_buf));
        a->buf = next_buf;
        const uint64_t t_end = now_ns();
        a->c.sched_ns += t_end - t0;
        a->c.commit_ns += t_commit - t0;
        a->c.schedule_ns += t_fill - t_attempt;
        a->c.fill_ns += t_end - t_fill;
      }
    }
  }
  if (threadIdx.x == 0) {
    a->c.iterations += 1;
    mirror_counters(a);
  }
  close_state(a, smem, hot);
  __syncthreads();
  if (a->exiting && cur) {  // the host reads the final state from sched_mem
    block_copy(a->sched_mem, a->smem_bytes ? smem : hot, a->hot_bytes);
    if (threadIdx.x == 0) a->cur = 0;
  }
}

// Beside the bucket graph: publish the tokens and finishes that blink_loop_step committed (from the
// scheduler state in device memory), so that the ring's fences are off the step's critical path.
__global__ void __launch_bounds__(BLINK_LOOP_THREADS) blink_loop_publish(blink_loop_args* a) {
  __shared__ blink_sched s;
  if (threadIdx.x == 0) {
    uint8_t* hot = hot_of(a, a->cur);
    blink_sched_bind_split(&s, hot, a->sched_mem + a->hot_bytes, &((blink_sched_header*)hot)->cfg, 0);
  }
  __syncthreads();
  if (s.h->num_new != 0 || s.h->num_finished != 0 || a->num_err != 0) publish(a, &s);
  if (threadIdx.x == 0) {
    st_v(&ring_header(a)->sq_head, *sq_head_of(a, a->cur));  // a taken speculation's admissions
    mirror_counters(a);
  }
}

// After publish, beside the bucket graph: step n+1 scheduled on a copy of the state (see the file's head).
// Nothing it does is visible unless the step kernel takes it: its ring writes are the response resets of
// the requests it admits (the full step writes the same words), the rest waits in the copy and the lists.
__global__ void __launch_bounds__(BLINK_LOOP_THREADS) blink_loop_spec(blink_loop_args* a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ blink_sched s;
  const uint64_t t0 = now_ns();
  const uint32_t cur = a->cur, next_buf = 1u - a->buf;
  if (a->exiting || ((const blink_sched_header*)hot_of(a, cur))->num_entries == 0) return;  // no step runs
  loop_scratch x;
  uint8_t* dst = hot_of(a, 1u - cur);
  open_state(a, &s, &x, smem, hot_of(a, cur), dst);
  blink_sched_header* h = s.h;
  const int32_t n = h->num_sampled;
  const int64_t ctx = h->cfg.context_len;
  // step n's tokens as placeholders -(j + 1): never an EOS or stop id, so only lengths finish sequences
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) a->sampled32[j] = -(j + 1);
  if (threadIdx.x == 0) {
    h->spec_mode = 1;
    h->spec_tainted = 0;
    a->num_err = 0;
  }
  __syncthreads();
  blink_sched_update_par(&s, a->sampled32, x.par);  // every sampled row is published: new_slot[j] is row j's
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const int32_t slot = s.new_slot[j];
    a->rows[j] = {slot * ctx + s.num_tokens[slot] - 1, -1, slot, s.num_stop[slot], s.ignore_eos[slot]};
  }
  __syncthreads();
  uint64_t tail;
  ring_look unused;
  int ok = !poll_ring(a, &s, x, &tail, unused, false, true);
  if (ok) {
    const uint64_t head = *sq_head_of(a, cur);
    if (tail != head) admit(a, &s, x, head, tail, sq_head_of(a, 1u - cur), true);
    else if (threadIdx.x == 0) *sq_head_of(a, 1u - cur) = head;
    ok = blink_sched_schedule_par(&s, x.room, x.order, x.par) > 0 && !h->spec_tainted;
  }
  int32_t bucket = -1;
  uint8_t* buf = step_buf_of(a, next_buf);
  if (ok) bucket = blink_fill_prologue_par(&s, buf, x.par);
  if (bucket >= 0) {
    blink_fill_token_rows(&s, buf, threadIdx.x, blockDim.x);
    blink_fill_block_tables_par(&s, buf, x.par);  // ends with a barrier: the token rows are written
    const int32_t* input = (const int32_t*)buf;
    for (int32_t i = threadIdx.x; i < h->num_tokens; i += blockDim.x) {
      const int32_t id = input[i];
      if (id < 0) a->rows[-id - 1].input_row = i;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    h->spec_mode = h->spec_tainted = 0;
    if (bucket >= 0) {
      a->spec_branch = branch_of(h, bucket, next_buf);
      a->spec_tail = tail;
      a->spec_rows = (uint32_t)n;
      a->new_token = (int32_t*)(dst + ((uint8_t*)s.new_token - (uint8_t*)s.h));
      a->spec_ok = 1;
    } else {
      a->c.spec_misses += 1;
    }
    a->c.spec_ns += now_ns() - t0;
  }
  if (bucket >= 0) close_state(a, smem, dst);
}

__global__ void read_globaltimer(uint64_t* out) { *out = now_ns(); }

// For measuring (bench/gpu_host.py): the loop's mechanism with no scheduling in it.
__global__ void bench_countdown(uint32_t* left, cudaGraphConditionalHandle loop, cudaGraphConditionalHandle branch) {
  cudaGraphSetConditional(branch, 0);
  if (--*left == 0) cudaGraphSetConditional(loop, 0);
}

// ---- host side: build, launch, watch ----------------------------------------------------------------------
struct blink_loop {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaStream_t stream;
  blink_loop_args* dev_args;
  uint32_t smem_bytes;  // the step kernel's dynamic shared memory (0: its state stays in global memory)
  void* owned[4];       // the speculation's buffers (hot_alt, rows, err_slot, err_code)
};

#define BLINK_TRY(call, code)               \
  do {                                      \
    cudaError_t e_ = (call);                \
    if (e_ != cudaSuccess) return (code) * 1000 + (int)e_; \
  } while (0)

extern "C" {

uint64_t blink_loop_args_bytes() { return sizeof(blink_loop_args); }
uint64_t blink_loop_ctl_bytes() { return sizeof(blink_loop_ctl); }

// Pin and map host memory (the ring's mmap) for the GPU; *dev_out is its device address.
int blink_loop_register(void* host, uint64_t bytes, void** dev_out) {
  BLINK_TRY(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), 1);
  BLINK_TRY(cudaHostGetDevicePointer(dev_out, host, 0), 2);
  return 0;
}

int blink_loop_unregister(void* host) {
  BLINK_TRY(cudaHostUnregister(host), 1);
  return 0;
}

// The control block: pinned, mapped host memory (zeroed).
int blink_loop_alloc_ctl(void** host_out, void** dev_out) {
  BLINK_TRY(cudaHostAlloc(host_out, sizeof(blink_loop_ctl), cudaHostAllocMapped), 1);
  memset(*host_out, 0, sizeof(blink_loop_ctl));
  BLINK_TRY(cudaHostGetDevicePointer(dev_out, *host_out, 0), 2);
  return 0;
}

// CLOCK_MONOTONIC minus %globaltimer: the caller brackets this call with two clock reads.
int blink_loop_read_globaltimer(uint64_t* out) {
  uint64_t* dev = nullptr;
  BLINK_TRY(cudaMalloc(&dev, sizeof(uint64_t)), 1);
  read_globaltimer<<<1, 1>>>(dev);
  BLINK_TRY(cudaMemcpy(out, dev, sizeof(uint64_t), cudaMemcpyDeviceToHost), 2);
  BLINK_TRY(cudaFree(dev), 3);
  return 0;
}

// Build the loop graph around `children` (num_branches cudaGraph_t: branch 2 * (b * num_buckets + i) + g =
// bucket i over step buffer b (step_buf, step_buf_alt), sampled (g = 0) or greedy (g = 1)), with `args`
// (host copy; its handles and the speculation's buffers are filled here) copied to device memory.
int blink_loop_create(const blink_loop_args* args_in, void* const* children, uint32_t num_branches,
                      blink_loop** out) {
  blink_loop* L = new blink_loop();
  blink_loop_args args = *args_in;
  args.num_branches = num_branches;
  BLINK_TRY(cudaStreamCreateWithFlags(&L->stream, cudaStreamNonBlocking), 1);
  BLINK_TRY(cudaGraphCreate(&L->graph, 0), 2);
  BLINK_TRY(cudaGraphConditionalHandleCreate(&args.loop_handle, L->graph, 1, cudaGraphCondAssignDefault), 3);

  cudaGraphNodeParams loop_params = {};
  loop_params.type = cudaGraphNodeTypeConditional;
  loop_params.conditional.handle = args.loop_handle;
  loop_params.conditional.type = cudaGraphCondTypeWhile;
  loop_params.conditional.size = 1;
  cudaGraphNode_t loop_node;
  BLINK_TRY(cudaGraphAddNode(&loop_node, L->graph, nullptr, nullptr, 0, &loop_params), 4);
  cudaGraph_t body = loop_params.conditional.phGraph_out[0];

  BLINK_TRY(cudaGraphConditionalHandleCreate(&args.branch_handle, body, num_branches, cudaGraphCondAssignDefault), 5);
  // the scheduler's hot prefix goes to shared memory when it fits, with the per-slot scratch after it
  blink_sched_header hdr;
  BLINK_TRY(cudaMemcpy(&hdr, args.sched_mem, sizeof(hdr), cudaMemcpyDeviceToHost), 15);
  blink_sched sizing;
  blink_sched_bind_split(&sizing, nullptr, nullptr, &hdr.cfg, &args.hot_bytes);
  const uint64_t smem = args.hot_bytes + 29ull * args.num_slots + 16;  // room, order, par (5), cancel
  int device = 0, smem_max = 0;
  BLINK_TRY(cudaGetDevice(&device), 16);
  BLINK_TRY(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), 17);
  args.smem_bytes = smem + 1024 <= (uint64_t)smem_max ? (uint32_t)smem : 0;  // leave room for the static part
  if (args.smem_bytes)
    BLINK_TRY(cudaFuncSetAttribute(blink_loop_step, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)args.smem_bytes), 18);
  L->smem_bytes = args.smem_bytes;
  if (args.smem_bytes)
    BLINK_TRY(cudaFuncSetAttribute(blink_loop_spec, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)args.smem_bytes), 19);
  // the speculation: a second copy of the hot state, per-row and deferred-error lists; the cold arrays'
  // addresses from the same carving the kernels use
  blink_sched carve;
  blink_sched_bind_split(&carve, args.sched_mem, args.sched_mem + args.hot_bytes, &hdr.cfg, nullptr);
  args.tokens = carve.tokens;
  args.stop_ids = carve.stop_ids;
  BLINK_TRY(cudaMalloc(&L->owned[0], args.hot_bytes), 20);
  BLINK_TRY(cudaMemcpy(L->owned[0], args.sched_mem, args.hot_bytes, cudaMemcpyDeviceToDevice), 21);
  BLINK_TRY(cudaMalloc(&L->owned[1], sizeof(spec_row) * (uint64_t)hdr.cfg.step_max_seqs), 22);
  BLINK_TRY(cudaMalloc(&L->owned[2], sizeof(int32_t) * (uint64_t)args.num_slots), 23);
  BLINK_TRY(cudaMalloc(&L->owned[3], sizeof(int32_t) * (uint64_t)args.num_slots), 24);
  args.hot_alt = (uint8_t*)L->owned[0];
  args.rows = (spec_row*)L->owned[1];
  args.err_slot = (int32_t*)L->owned[2];
  args.err_code = (int32_t*)L->owned[3];
  args.new_token = nullptr;
  args.sq_head_alt = args.sq_head;
  args.spec_tail = 0;
  args.cur = args.buf = args.spec_ok = args.spec_branch = args.spec_rows = args.num_err = args.exiting = 0;
  // BLINK_LOOP_SPEC_TAIL_CHECK=0 (for measuring only): new requests wait for the next speculation
  const char* tail_check = getenv("BLINK_LOOP_SPEC_TAIL_CHECK");
  args.check_tail = !(tail_check && strcmp(tail_check, "0") == 0);
  args.num_eos = (uint32_t)hdr.cfg.num_eos;
  for (int i = 0; i < BLINK_SCHED_MAX_EOS; ++i) args.eos_ids[i] = hdr.cfg.eos_ids[i];
  if (num_branches != 4u * (uint32_t)hdr.cfg.num_buckets || !args.step_buf_alt) return 25 * 1000;
  BLINK_TRY(cudaMalloc(&L->dev_args, sizeof(blink_loop_args)), 6);
  BLINK_TRY(cudaMemcpy(L->dev_args, &args, sizeof(blink_loop_args), cudaMemcpyHostToDevice), 7);

  void* kernel_args[] = {&L->dev_args};
  cudaKernelNodeParams k = {};
  k.gridDim = dim3(1);
  k.blockDim = dim3(BLINK_LOOP_THREADS);
  k.kernelParams = kernel_args;
  k.func = (void*)blink_loop_step;
  k.sharedMemBytes = args.smem_bytes;
  cudaGraphNode_t step_node, switch_node, publish_node;
  BLINK_TRY(cudaGraphAddKernelNode(&step_node, body, nullptr, 0, &k), 8);

  cudaGraphNodeParams sw = {};
  sw.type = cudaGraphNodeTypeConditional;
  sw.conditional.handle = args.branch_handle;
  sw.conditional.type = cudaGraphCondTypeSwitch;
  sw.conditional.size = num_branches;
  BLINK_TRY(cudaGraphAddNode(&switch_node, body, &step_node, nullptr, 1, &sw), 9);
  for (uint32_t i = 0; i < num_branches; ++i) {
    cudaGraphNode_t child;
    BLINK_TRY(cudaGraphAddChildGraphNode(&child, sw.conditional.phGraph_out[i], nullptr, 0, (cudaGraph_t)children[i]), 10);
  }
  k.func = (void*)blink_loop_publish;
  k.sharedMemBytes = 0;
  BLINK_TRY(cudaGraphAddKernelNode(&publish_node, body, &step_node, 1, &k), 11);
  k.func = (void*)blink_loop_spec;
  k.sharedMemBytes = args.smem_bytes;
  cudaGraphNode_t spec_node;
  BLINK_TRY(cudaGraphAddKernelNode(&spec_node, body, &publish_node, 1, &k), 26);
  // beside the bucket graph, publish and spec go first whenever an SM frees up
  // (BLINK_LOOP_SPEC_PRIORITY=0 leaves them at the default priority, for measuring)
  const char* want = getenv("BLINK_LOOP_SPEC_PRIORITY");
  if (!want || strcmp(want, "0") != 0) {
    int least = 0, greatest = 0;
    BLINK_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest), 27);
    cudaKernelNodeAttrValue priority = {};
    priority.priority = greatest;
    BLINK_TRY(cudaGraphKernelNodeSetAttribute(publish_node, cudaKernelNodeAttributePriority, &priority), 28);
    BLINK_TRY(cudaGraphKernelNodeSetAttribute(spec_node, cudaKernelNodeAttributePriority, &priority), 29);
  }

  BLINK_TRY(cudaGraphInstantiateWithFlags(&L->exec, L->graph, 0), 12);
  BLINK_TRY(cudaGraphUpload(L->exec, L->stream), 13);
  BLINK_TRY(cudaStreamSynchronize(L->stream), 14);
  *out = L;
  return 0;
}

uint32_t blink_loop_smem_bytes(const blink_loop* L) { return L->smem_bytes; }

int blink_loop_launch(blink_loop* L) {
  BLINK_TRY(cudaGraphLaunch(L->exec, L->stream), 1);
  return 0;
}

// The graph `child` replayed `iterations` times as the loop runs a step: WHILE { a one-thread kernel ->
// SWITCH (one branch: child) }, launched once. *ns_out: GPU time per iteration (CUDA events), so the
// loop's step can be compared with the same replay inside the same conditional nodes.
int blink_loop_bench_mechanism(void* child, uint32_t iterations, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaGraphConditionalHandle loop, branch;
  uint32_t* left = nullptr;
  BLINK_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), 1);
  BLINK_TRY(cudaMalloc(&left, sizeof(uint32_t)), 2);
  BLINK_TRY(cudaGraphCreate(&graph, 0), 3);
  BLINK_TRY(cudaGraphConditionalHandleCreate(&loop, graph, 1, cudaGraphCondAssignDefault), 4);
  cudaGraphNodeParams w = {};
  w.type = cudaGraphNodeTypeConditional;
  w.conditional.handle = loop;
  w.conditional.type = cudaGraphCondTypeWhile;
  w.conditional.size = 1;
  cudaGraphNode_t while_node, count_node, switch_node, child_node;
  BLINK_TRY(cudaGraphAddNode(&while_node, graph, nullptr, nullptr, 0, &w), 5);
  cudaGraph_t body = w.conditional.phGraph_out[0];
  BLINK_TRY(cudaGraphConditionalHandleCreate(&branch, body, 1, cudaGraphCondAssignDefault), 6);
  void* kernel_args[] = {&left, &loop, &branch};
  cudaKernelNodeParams k = {};
  k.gridDim = dim3(1);
  k.blockDim = dim3(1);
  k.kernelParams = kernel_args;
  k.func = (void*)bench_countdown;
  BLINK_TRY(cudaGraphAddKernelNode(&count_node, body, nullptr, 0, &k), 7);
  cudaGraphNodeParams sw = {};
  sw.type = cudaGraphNodeTypeConditional;
  sw.conditional.handle = branch;
  sw.conditional.type = cudaGraphCondTypeSwitch;
  sw.conditional.size = 1;
  BLINK_TRY(cudaGraphAddNode(&switch_node, body, &count_node, nullptr, 1, &sw), 8);
  BLINK_TRY(cudaGraphAddChildGraphNode(&child_node, sw.conditional.phGraph_out[0], nullptr, 0, (cudaGraph_t)child), 9);
  BLINK_TRY(cudaGraphInstantiateWithFlags(&exec, graph, 0), 10);
  BLINK_TRY(cudaGraphUpload(exec, stream), 11);
  cudaEvent_t a, b;
  BLINK_TRY(cudaEventCreate(&a), 12);
  BLINK_TRY(cudaEventCreate(&b), 13);
  float ms = 0.0f;
  for (int round = 0; round < 2; ++round) {  // the first round warms up
    const uint32_t n = round ? iterations : 3;
    BLINK_TRY(cudaMemcpyAsync(left, &n, sizeof(n), cudaMemcpyHostToDevice, stream), 14);
    BLINK_TRY(cudaEventRecord(a, stream), 15);
    BLINK_TRY(cudaGraphLaunch(exec, stream), 16);
    BLINK_TRY(cudaEventRecord(b, stream), 17);
    BLINK_TRY(cudaEventSynchronize(b), 18);
    BLINK_TRY(cudaEventElapsedTime(&ms, a, b), 19);
  }
  *ns_out = 1e6 * (double)ms / iterations;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(left);
  cudaStreamDestroy(stream);
  return 0;
}

// 0: the loop ended; 1: still running; other: the CUDA error that ended it (cudaError_t).
int blink_loop_poll(blink_loop* L) {
  const cudaError_t e = cudaStreamQuery(L->stream);
  if (e == cudaSuccess) return 0;
  if (e == cudaErrorNotReady) return 1;
  return (int)e;
}

int blink_loop_destroy(blink_loop* L) {
  BLINK_TRY(cudaGraphExecDestroy(L->exec), 1);
  BLINK_TRY(cudaGraphDestroy(L->graph), 2);
  BLINK_TRY(cudaFree(L->dev_args), 3);
  BLINK_TRY(cudaStreamDestroy(L->stream), 4);
  for (void* p : L->owned) BLINK_TRY(cudaFree(p), 5);
  delete L;
  return 0;
}

}  // extern "C"
