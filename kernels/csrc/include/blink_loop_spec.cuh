// The speculation of the GPU-resident loop (kernels/csrc/persistent_loop.cu): step n+1 scheduled on a copy
// of the scheduler state while step n runs, and the step kernel's fast path that takes it. Device code.
#ifndef BLINK_LOOP_SPEC_CUH
#define BLINK_LOOP_SPEC_CUH

#include "blink_loop.cuh"
#include "blink_sched_par.cuh"

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
  int32_t* new_token = (int32_t*)(hot_of(a, 1 - a->cur) + a->new_token_offset);  // the speculated state's
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const spec_row r = a->rows[j];
    const int32_t token = (int32_t)a->sampled[j];
    a->tokens[r.hist] = token;
    new_token[j] = token;
    if (r.input_row >= 0) input[r.input_row] = token;
  }
  if (threadIdx.x == 0) {
    ext_commit(a);
    cudaGraphSetConditional(a->branch_handle, a->spec_branch);
    a->cur ^= 1u;
    a->buf ^= 1u;
    a->spec_ok = 0;
    count_step(a, t0, (int32_t)n);
    a->c.spec_hits += 1;
    a->c.iterations += 1;
    a->c.sched_ns += now_ns() - t0;
  }
  return 1;
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
    ext_fill(a, &s, buf, next_buf);
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
      a->spec_branch = ext_branch(a, branch_of(h, bucket, next_buf), next_buf);
      a->spec_tail = tail;
      a->spec_rows = (uint32_t)n;
      a->spec_ok = 1;
    } else {
      a->c.spec_misses += 1;
    }
    a->c.spec_ns += now_ns() - t0;
  }
  if (bucket >= 0) close_state(a, smem, dst);
}

#endif  // BLINK_LOOP_SPEC_CUH
