// The speculation of the GPU-resident loop (kernels/csrc/persistent_loop.cu): step n+1 scheduled on a copy
// of the scheduler state while step n runs, and the kernel that takes it (blink_loop_take). Device code.
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

// The branch of a filled step: bucket graph `bucket` over step buffer `b`.
__device__ uint32_t branch_of(const blink_sched_header* h, int32_t bucket, uint32_t b) {
  uint32_t index = 0;
  while (h->cfg.buckets[index] != bucket) ++index;
  return 2 * (b * (uint32_t)h->cfg.num_buckets + index) + (h->all_greedy ? 1 : 0);
}

// ---- the fast path: take the speculation, beside the bucket graph --------------------------------------------
// Rows of the bucket graph that runs now: every one of them gets its token written exactly once (the
// sampler writes a greedy row in its softmax kernel, any other in its select kernel), over the -1 that the
// last reader of those tokens left there.
__device__ __forceinline__ uint32_t graph_rows(const blink_sched_header* h) {
  return (uint32_t)(h->bucket < h->cfg.step_max_seqs ? h->bucket : h->cfg.step_max_seqs);
}

#define BLINK_LOOP_TAKE_THREADS 64  // warp 0: the tokens, the check and the commit; one thread of warp 1: the tail
#define BLINK_LOOP_TAKE_ROWS 8      // rows per lane of warp 0 held in registers (graphs of up to 256 rows)

// The asynchronous take (the default; BLINK_LOOP_ASYNC=0 turns it off), lane of sampled row j: its sequence
// sampled a stop token after step n+1 was launched. Its finish goes to the speculated state's finish list (published with
// step n+1, where the full step would publish it), its token is not published, and the speculated state
// marks it STOPPING: step n+1 computes its row, the next update drops that row and frees the sequence
// (blink_sched_update_par). A sequence the speculation finished on its length finishes on the stop token
// instead, as blink_stop_reason ranks them.
__device__ void stop_async(blink_loop_args* a, uint32_t j, const spec_row& r, uint32_t next_state, uint32_t next_buf) {
  blink_sched s;
  uint8_t* hot = hot_of(a, next_state);
  blink_sched_bind_split(&s, hot, a->sched_mem + a->hot_bytes, &((blink_sched_header*)hot)->cfg, 0);
  s.new_slot[j] = -1 - r.slot;  // the publish skips it
  if (s.status[r.slot] == BLINK_SEQ_RUNNING) {
    s.status[r.slot] = BLINK_SEQ_STOPPING;
    const int32_t i = atomicAdd(&s.h->num_finished, 1);
    s.fin_slot[i] = r.slot;
    s.fin_reason[i] = BLINK_FINISH_STOP;
    blink_loop_ext* e = a->ext;  // its row of step n+1 is no one's: the penalties leave it alone
    if (e && r.input_row >= 0)
      e->row_slot[next_buf * e->max_rows + e->slot_row[(uint64_t)next_buf * a->num_slots + r.slot]] = -1;
  } else {
    for (int32_t i = 0; i < s.h->num_finished; ++i)
      if (s.fin_slot[i] == r.slot) s.fin_reason[i] = BLINK_FINISH_STOP;
  }
}

// In each bucket graph, started when the graph's logits are done (beside its sampler): waits for the spec
// kernel (which runs beside the graph) and for the sampled tokens and, if none of them stops its sequence
// and no request was queued after the speculation looked, takes the speculation: writes the tokens where it
// left placeholders, swaps the two states and launches the next bucket graph, so between two bucket graphs
// there is only this kernel's tail end and a device graph launch. Otherwise it launches the full step.
// It starts after the logits, not with the graph, because a resident block, however small, keeps
// cuBLAS's largest-shared-memory GEMM blocks off its SM (measured: +210 us per step at batch 64).
// The submission tail is read over PCIe again and again while the tokens are awaited, so its round
// trip is not on the critical path: the check uses the last value read (a request queued in that last
// microsecond waits for the next speculation, as one queued just after the check would).
// Asynchronous (a->async_take, the default): the submission tail is read once as the kernel starts, and the
// next bucket graph is launched before the tokens come (the launch call is off the critical path); a stop
// token then does not drop the speculation: stop_async. (A request queued after that read waits for the
// next speculation: a window of the sampler's few microseconds.)
__global__ void __launch_bounds__(BLINK_LOOP_TAKE_THREADS) blink_loop_take(blink_loop_args* a) {
  __shared__ uint64_t sh_tail;
  __shared__ uint32_t sh_ready;
  // a step with token-masked rows (speculated only with spec_masked): this kernel starts after the masks' fix-up
  // (blink_ext_mask_fix: add_take), so the tokens are final, and a row that sampled nothing (TOKEN_WAIT, or
  // TOKEN_MASK_EMPTY, both negative) drops the speculation. Never asynchronous: there is nothing to wait for.
  const uint32_t masked = a->ext && a->ext->masked[a->buf];
  const uint32_t async = a->async_take && !masked;
  const uint64_t tail_now = async && threadIdx.x == 0 && a->check_tail ? ld_v(&ring_header(a)->sq_tail) : 0;
  if (threadIdx.x == 0) {
    while (!ld_v(&a->spec_done)) __nanosleep(100);
    a->spec_done = 0;  // for the next iteration's spec kernel (which starts after this kernel ends)
    __threadfence();
  }
  __syncthreads();
  if (!a->spec_ok) {  // nothing speculated (or it would have preempted): the full step, after the graph
    if (threadIdx.x == 0) run_next(a, a->num_branches);
    return;
  }
  const uint32_t rows = graph_rows((const blink_sched_header*)hot_of(a, a->cur));
  const uint64_t t_start = now_ns();
  if (threadIdx.x == 0) {
    sh_tail = a->spec_tail;
    sh_ready = 0;
  }
  __syncthreads();
  if (threadIdx.x >= 32) {  // the submission tail, read again and again until shortly before the tokens are
    // expected (the last wait, less 3 us): a read in flight when they come would hold the kernel's end
    if (threadIdx.x == 32 && a->check_tail && !async) {
      const uint64_t* tail = &ring_header(a)->sq_tail;
      const uint64_t wait = a->take_wait_ns, stop_at = t_start + (wait > 3000 ? wait - 3000 : 0);
      while (!ld_v(&sh_ready) && now_ns() < stop_at) st_v(&sh_tail, ld_v(tail));
    }
    return;
  }
  // warp 0. While the tokens are awaited, everything the commit needs goes into registers (the rows'
  // spec_row, the EOS ids, the addresses and, in thread 0, the counters and the state words), so that
  // after the last token only the stop check's compares and the stores remain.
  volatile int64_t* sampled = a->sampled;
  const uint32_t n = a->spec_rows, lane = threadIdx.x, next_state = 1u - a->cur, next_buf = 1u - a->buf;
  spec_row r[BLINK_LOOP_TAKE_ROWS];
  int64_t token[BLINK_LOOP_TAKE_ROWS];
#pragma unroll
  for (int k = 0; k < BLINK_LOOP_TAKE_ROWS; ++k)
    if (lane + 32 * k < n) r[k] = a->rows[lane + 32 * k];
  int32_t eos[BLINK_SCHED_MAX_EOS];
  const uint32_t num_eos = a->num_eos;
#pragma unroll
  for (int i = 0; i < BLINK_SCHED_MAX_EOS; ++i) eos[i] = i < (int)num_eos ? a->eos_ids[i] : -1;  // -1: no token
  const int32_t* stop_ids = a->stop_ids;
  const int64_t max_stop = a->max_stop_ids;
  int32_t* hist = a->tokens;
  int32_t* input = (int32_t*)step_buf_of(a, next_buf);  // input_ids: the step buffer's first field
  int32_t* new_token = (int32_t*)(hot_of(a, next_state) + a->new_token_offset);  // the speculated state's
  const uint64_t spec_tail = a->spec_tail;
  blink_loop_ext* ext = a->ext;
  blink_loop_counters c;
  uint64_t last_commit = 0;
  uint32_t cur = 0, buf = 0;
  cudaGraphExec_t hit = nullptr, miss = nullptr;  // the graphs to launch, loaded now: the launch call after
  if (lane == 0) {                                 // the tokens is then the call alone (1.6 us; 3.3 with the loads)
    c = a->c;
    last_commit = a->last_commit_ns;
    cur = a->cur;
    buf = a->buf;
    hit = exec_of(a, a->spec_branch);
    miss = a->full_exec;
  }
  if (async) {  // decided now: new requests since the speculation looked go to the full step, which admits them
    if (__shfl_sync(0xffffffffu, lane == 0 && a->check_tail && tail_now != spec_tail, 0)) {
      if (lane == 0) {
        a->spec_ok = 0;
        a->num_err = 0;
        a->c.spec_misses = c.spec_misses + 1;
        launch_next(a, miss);
      }
      return;
    }
    if (lane == 0) launch_next(a, hit);
  }
  for (;;) {
    int in = 1;
#pragma unroll
    for (int k = 0; k < BLINK_LOOP_TAKE_ROWS; ++k)
      if (lane + 32 * k < rows) {
        token[k] = sampled[lane + 32 * k];
        in &= masked ? token[k] != -1 : token[k] >= 0;  // masked: final already (a negative one: no token)
      }
    for (uint32_t j = lane + 32 * BLINK_LOOP_TAKE_ROWS; j < rows; j += 32) in &= masked ? sampled[j] != -1 : sampled[j] >= 0;
    if (__all_sync(0xffffffffu, in)) break;
  }
  const uint64_t t0 = now_ns();
  if (lane == 0) st_v(&sh_ready, 1u);
  // the stop check: a dropped row (hist < 0: a STOPPING sequence's) has no token to check
  uint32_t stop = 0;  // bit k: row lane + 32 k stops its sequence
#pragma unroll
  for (int k = 0; k < BLINK_LOOP_TAKE_ROWS; ++k)
    if (lane + 32 * k < n && r[k].hist >= 0) {
      const int32_t t = (int32_t)token[k];
      int is = 0;
      if (!r[k].ignore_eos)
#pragma unroll
        for (int i = 0; i < BLINK_SCHED_MAX_EOS; ++i) is |= t == eos[i];
      if (r[k].num_stop) is |= blink_is_stop_token(eos, 0, stop_ids + r[k].slot * max_stop, r[k].num_stop, 1, t);
      stop |= (uint32_t)is << k;
    }
  int far_stop = 0;  // rows past the registers' (graphs of more than 256 rows; the asynchronous commit checks them)
  for (uint32_t j = lane + 32 * BLINK_LOOP_TAKE_ROWS; j < n && !async; j += 32) {
    const spec_row q = a->rows[j];
    far_stop |= q.hist >= 0 && (sampled[j] < 0 ||  // (masked) no token
                                blink_is_stop_token(a->eos_ids, (int32_t)num_eos, stop_ids + q.slot * max_stop,
                                                    q.num_stop, q.ignore_eos, (int32_t)sampled[j]));
  }
  int no_token = 0;  // (masked) a row that sampled nothing: the full step runs its position again
#pragma unroll
  for (int k = 0; k < BLINK_LOOP_TAKE_ROWS; ++k) no_token |= lane + 32 * k < n && r[k].hist >= 0 && token[k] < 0;
  if (!async) {
    const int bad = (lane == 0 && ld_v(&sh_tail) != spec_tail) || stop || far_stop || no_token;
    if (__any_sync(0xffffffffu, bad)) {  // the full step commits these tokens (and sets them back to -1)
      if (lane == 0) {
        a->spec_ok = 0;
        a->num_err = 0;  // the full step admits those requests again
        a->c.spec_misses = c.spec_misses + 1;
        a->take_wait_ns = t0 - t_start;
        launch_next(a, miss);
      }
      return;
    }
    if (lane == 0) launch_next(a, hit);  // first: the call overlaps the stores (the graph starts after them)
  }
  // the commit: each token to the history, the speculated state's new list and step n+1's input row (a stop
  // token to the input row only: step n+1 computes that row, whose token no one takes)
  int published = 0;
#pragma unroll
  for (int k = 0; k < BLINK_LOOP_TAKE_ROWS; ++k)
    if (lane + 32 * k < n && r[k].hist >= 0) {
      const int32_t t = (int32_t)token[k];
      if (r[k].input_row >= 0) input[r[k].input_row] = t;
      if (stop >> k & 1u) {
        stop_async(a, lane + 32 * k, r[k], next_state, next_buf);
        continue;
      }
      hist[r[k].hist] = t;
      new_token[lane + 32 * k] = t;
      ++published;
    }
  for (uint32_t j = lane + 32 * BLINK_LOOP_TAKE_ROWS; j < n; j += 32) {
    const spec_row q = a->rows[j];
    if (q.hist < 0) continue;
    const int32_t t = (int32_t)sampled[j];
    if (q.input_row >= 0) input[q.input_row] = t;
    if (blink_is_stop_token(a->eos_ids, (int32_t)num_eos, stop_ids + q.slot * max_stop, q.num_stop, q.ignore_eos, t)) {
      stop_async(a, j, q, next_state, next_buf);
      continue;
    }
    hist[q.hist] = t;
    new_token[j] = t;
    ++published;
  }
  published = __reduce_add_sync(0xffffffffu, published);
  __syncwarp();
  for (uint32_t j = lane; j < rows; j += 32) sampled[j] = -1;
  if (lane == 0) {  // count_step's bookkeeping, from the registers
    if (ext) ext->pub_buf = buf;  // ext_commit: the publish that follows writes this step's logprobs
    a->cur = cur ^ 1u;
    a->buf = buf ^ 1u;
    a->spec_ok = 0;
    a->ready_ns = t0;
    a->last_commit_ns = t0;
    a->take_wait_ns = t0 - t_start;
    c.steps += 1;
    c.tokens += published;
    if (last_commit) {
      c.busy_ns += t0 - last_commit;
      c.busy_steps += 1;
    }
    c.spec_hits += 1;
    c.iterations += 1;
    c.sched_ns += now_ns() - t0;
    a->c = c;
  }
}

// After publish, beside the bucket graph: step n+1 scheduled on a copy of the state (see the file's head).
// Nothing it does is visible unless blink_loop_take takes it: its ring writes are the response resets of
// the requests it admits (the full step writes the same words), the rest waits in the copy and the lists.
__global__ void __launch_bounds__(BLINK_LOOP_THREADS) blink_loop_spec(blink_loop_args* a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ blink_sched s;
  const uint64_t t0 = now_ns();
  const uint32_t cur = a->cur, next_buf = 1u - a->buf;
  // no step runs, or (unless spec_masked) one with a token mask whose rows may sample nothing: with spec_masked the
  // take kernel drops the speculation when one of them did (a WAIT row does not advance; the full step knows)
  if (a->exiting || ((const blink_sched_header*)hot_of(a, cur))->num_entries == 0 ||
      (a->ext && a->ext->masked[a->buf] && !a->spec_masked)) {
    if (threadIdx.x == 0) st_v(&a->spec_done, 1u);  // it wrote nothing
    return;
  }
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
  blink_sched_update_par(&s, a->sampled32, x.par);  // every sampled row has its new-list entry j
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const int32_t slot = s.new_slot[j];  // -1 - slot: a STOPPING sequence's row, which has no token
    a->rows[j] = slot < 0 ? spec_row{-1, -1, -1 - slot, 0, 1}
                          : spec_row{slot * ctx + s.num_tokens[slot] - 1, -1, slot, s.num_stop[slot], s.ignore_eos[slot]};
  }
  __syncthreads();
  uint64_t tail;
  ring_look unused;
  int ok = !poll_ring(a, &s, x, &tail, unused, false, true);  // room less step n's token (count_unpublished)
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
  __threadfence();  // every thread's writes, then the flag
  __syncthreads();
  if (threadIdx.x == 0) st_v(&a->spec_done, 1u);
}

#endif  // BLINK_LOOP_SPEC_CUH
