// The sampling extensions of the GPU-resident loop (kernels/csrc/persistent_loop.cu): presence, frequency and
// repetition penalties, logit bias and logprobs, as the host and cpu engines apply them
// (gpu_backend/engine/sampler.py: LogitAdjustments, token_logprobs). Device code, and the host code that
// adds the extended branches to the loop graph. Present only when the engine enables them
// (blink_loop_args.ext != 0; gpu_backend/engine/persistent.py allocates everything below).
//
// Per slot, copied from the request at admission: the penalties, the logit bias, the logprob count, the
// prompt length, the output room (a logprobs request runs at most logprob_window tokens ahead of the reads),
// whether it is constrained (FLAG_CONSTRAINED: its token masks are read from the ring's mask area per step).
// Per step buffer, written by the fill: the sampled row -> slot map of the rows that use an extension, the
// slot -> row map for the publish, and whether the step needs the extended graph. A step where some sampled
// row uses an extension runs branch 4 * num_buckets + p (8 * num_buckets + p when no row asked for logprobs)
// instead of its plain branch p = 2 * (b * num_buckets + i) + greedy:
//   the bucket's LOGITS graph (float32 logits [S, V] into gpu_runner.logits_dev)
//   -> blink_ext_adjust: per extended row, bias, then repetition, then frequency/presence, then the token
//      mask of a constrained row (its mask from the ring, checked by mask_seq), in place
//   -> the bucket's POST graph, greedy or not (argmax or the sampler, as the plain graphs and the host
//      engine's extended step pick; then log-softmax and top-k per row into this buffer's logprob outputs)
//   -> (a ring with masks) blink_ext_mask_fix: TOKEN_WAIT / TOKEN_MASK_EMPTY for the rows that sample nothing.
// A step with a constrained row is not speculated past (blink_loop_spec): the full step's update applies its
// tokens, where a TOKEN_WAIT row is not advanced and runs its position again.
// The penalties need each row's token counts: the adjust kernel builds them per row from the scheduler's
// token history (prompt + output, device memory) in a zeroed scratch row, and every entry it sets it also
// claims and clears (atomicExch), so the scratch is zero again when the kernel ends: no per-slot [V] table,
// nothing to maintain at commit or to clear when a sequence finishes. The cost is O(history) per extended
// row per step (what the host engines pay on the CPU too). The last history token is read from the step's
// own input ids (the row it samples from): the commit of step n may write the history beside step n + 1.
#ifndef BLINK_LOOP_EXT_CUH
#define BLINK_LOOP_EXT_CUH

// Included by blink_loop.cuh after blink_loop_args and the ring accessors, before their users.

#define BLINK_EXT_THREADS 1024
#define BLINK_EXT_ADJUST 1u      // bias or a penalty
#define BLINK_EXT_PROMPT 2u      // repetition penalty: the prompt counts too
#define BLINK_EXT_OUTPUT 4u      // any penalty: the output's counts
#define BLINK_EXT_LOGPROBS 8u
#define BLINK_EXT_MASK 16u       // a constrained request: every token sampled under its token mask (ring version 3)
#define BLINK_EXT_BRANCH_LOGPROBS 1u  // blink_loop_ext.extended[b]: the extended branch whose POST has the logprobs
#define BLINK_EXT_BRANCH_SAMPLE 2u    // ... whose POST is the sampler alone
#define BLINK_EXT_MASK_CHUNK 2048u  // mask words staged in shared memory at a time (65,536 tokens)
#define BLINK_EXT_SEEN 0x80000000u  // scratch: the token occurs in the prompt (repetition penalty)

// struct blink_loop_ext (the per-slot and per-buffer tables above, the ring's areas, the loop's words):
// blink_loop_layout.h, generated from kernels/loop_decl.py.

// ---- admission ----------------------------------------------------------------------------------------------
// The admission checks (blink_admit.h) refuse what an engine without the extensions cannot serve and every
// out-of-range count, id or value before these run.
// The thread copying logit-bias entry j of `slot` (already checked): kept for the adjust kernel.
__device__ __forceinline__ void ext_keep_bias(blink_loop_args* a, uint32_t slot, uint32_t j, int32_t id, float bias) {
  blink_loop_ext* e = a->ext;
  if (!e) return;
  e->bias_ids[(uint64_t)slot * e->max_bias + j] = id;
  e->bias_vals[(uint64_t)slot * e->max_bias + j] = bias;
}

// Thread 0: the slot's extension parameters, from the checked snapshot `w` of its request (blink_admit_error
// refused a request that wants an extension, or a mask, this engine or ring lacks).
__device__ void ext_admit(blink_loop_args* a, uint32_t slot, const blink_request_slot* w) {
  blink_loop_ext* e = a->ext;
  if (!e) return;
  const float presence = w->presence_penalty, frequency = w->frequency_penalty, repetition = w->repetition_penalty;
  const bool logprobs = w->flags & BLINK_RING_FLAG_LOGPROBS, masked = w->flags & BLINK_RING_FLAG_CONSTRAINED;
  uint32_t f = masked ? BLINK_EXT_MASK : 0u;
  if (repetition != 1.0f) f |= BLINK_EXT_ADJUST | BLINK_EXT_PROMPT | BLINK_EXT_OUTPUT;
  if (presence != 0.0f || frequency != 0.0f) f |= BLINK_EXT_ADJUST | BLINK_EXT_OUTPUT;
  if (w->num_logit_bias != 0u) f |= BLINK_EXT_ADJUST;
  if (logprobs) f |= BLINK_EXT_LOGPROBS;
  e->flags[slot] = f;
  e->num_logprobs[slot] = (int32_t)(w->num_logprobs < e->max_logprobs ? w->num_logprobs : e->max_logprobs);
  e->prompt_len[slot] = (int32_t)w->prompt_len;
  e->num_bias[slot] = (int32_t)(w->num_logit_bias < e->max_bias ? w->num_logit_bias : e->max_bias);
  e->capacity[slot] = (int32_t)(logprobs ? e->window : a->max_output_len);
  e->penalties[3 * slot] = presence;
  e->penalties[3 * slot + 1] = frequency;
  e->penalties[3 * slot + 2] = repetition;
}

// Tokens a slot may run ahead of the gateway's reads (RingConsumer's capacity).
__device__ __forceinline__ int32_t ext_capacity(const blink_loop_args* a, uint32_t slot) {
  return a->ext ? a->ext->capacity[slot] : (int32_t)a->max_output_len;
}

// ---- the fill, the branch, the commit -----------------------------------------------------------------------
// All threads, after the step in buffer `b` was filled (token rows written): its row <-> slot maps and
// whether it needs the extended branch.
__device__ void ext_fill(blink_loop_args* a, const blink_sched* s, const uint8_t* buf, uint32_t b) {
  blink_loop_ext* e = a->ext;
  if (!e) return;
  const int32_t n = s->h->num_sampled;
  const int64_t* rows = (const int64_t*)(buf + e->off_sample_rows);
  const int32_t* seq_ids = (const int32_t*)(buf + e->off_seq_ids);
  int any = 0, masked = 0, logprobs = 0;
  for (int32_t k = threadIdx.x; k < n; k += blockDim.x) {
    const int32_t slot = s->entry_slot[seq_ids[rows[k]]];
    const int on = e->flags[slot] != 0u;
    e->row_slot[b * e->max_rows + k] = on ? slot : -1;
    e->slot_row[(uint64_t)b * a->num_slots + slot] = k;
    any |= on;
    masked |= (e->flags[slot] & BLINK_EXT_MASK) != 0u;
    logprobs |= (e->flags[slot] & BLINK_EXT_LOGPROBS) != 0u;
  }
  any = __syncthreads_or(any);
  masked = __syncthreads_or(masked);
  logprobs = __syncthreads_or(logprobs);
  if (threadIdx.x == 0) {
    e->num_rows[b] = (uint32_t)n;
    e->extended[b] = any ? (logprobs ? BLINK_EXT_BRANCH_LOGPROBS : BLINK_EXT_BRANCH_SAMPLE) : 0u;
    e->masked[b] = (uint32_t)masked;
  }
}

// Thread 0: the branch (bucket graph) of the step in buffer `b` whose plain branch is `plain` (branch_of): an
// extended step's POST computes the logprobs only when a row asked for them (4 * num_buckets + plain), else it
// is the sampler alone (8 * num_buckets + plain): the log-softmax and top-20 over every row cost 0.12-0.28 ms.
__device__ __forceinline__ uint32_t ext_branch(const blink_loop_args* a, uint32_t plain, uint32_t b) {
  const blink_loop_ext* e = a->ext;
  if (!e || !e->extended[b]) return plain;
  return (e->extended[b] == BLINK_EXT_BRANCH_LOGPROBS ? 4u : 8u) * e->num_buckets + plain;
}

// Thread 0, when the step in buffer a->buf is committed: the publish that follows writes its logprobs.
__device__ __forceinline__ void ext_commit(blink_loop_args* a) {
  if (a->ext) a->ext->pub_buf = a->buf;
}

// ---- publishing ------------------------------------------------------------------------------------------
// The thread publishing token `p` of `slot`: its logprob and alternatives into the slot's logprob area
// (before `produced`), as RingConsumer.publish writes them.
__device__ void ext_publish_logprob(const blink_loop_args* a, uint32_t slot, uint32_t p) {
  const blink_loop_ext* e = a->ext;
  if (!e || !(e->flags[slot] & BLINK_EXT_LOGPROBS)) return;
  const uint32_t b = e->pub_buf;
  const uint64_t row = (uint64_t)b * e->max_rows + (uint32_t)e->slot_row[(uint64_t)b * a->num_slots + slot];
  const uint32_t w = p % e->window, k = (uint32_t)e->num_logprobs[slot];
  uint8_t* area = a->ring + e->lp_offset + (uint64_t)slot * e->lp_bytes;
  st_v((float*)area + w, e->lp_chosen[row]);
  int32_t* ids = (int32_t*)(area + e->lp_ids_offset) + (uint64_t)w * e->max_logprobs;
  float* vals = (float*)(area + e->lp_top_offset) + (uint64_t)w * e->max_logprobs;
  for (uint32_t j = 0; j < k; ++j) {
    st_v(&ids[j], e->lp_ids[row * e->lp_k + j]);
    st_v(&vals[j], e->lp_vals[row * e->lp_k + j]);
  }
}

// ---- the extended branch's kernel ------------------------------------------------------------------------
// History token i of a row: the scheduler's token array, but the last one (the token the row samples
// after) from the step's input ids.
__device__ __forceinline__ int32_t ext_token(const int32_t* hist, int64_t i, int64_t last, int32_t last_id) {
  return i == last ? last_id : hist[i];
}

// One block per sampled row of the step in buffer `b` (grid: the bucket's rows): LogitAdjustments.apply_ on
// the rows that use bias or penalties, in its float32 order (bias added; seen tokens' positive logits divided
// by the repetition penalty, others multiplied; then frequency * count + presence subtracted), rounding
// each operation as torch's separate kernels do (no contraction into fma).
__device__ void ext_adjust_row(blink_loop_args* a, const blink_loop_ext* e, uint32_t b, uint32_t row, int32_t slot) {
  const uint32_t f = e->flags[slot], vocab = e->vocab;
  float* logits = e->logits + (uint64_t)row * vocab;
  uint32_t* marks = e->scratch + (uint64_t)row * vocab;
  const uint8_t* buf = step_buf_of(a, b);
  const int64_t sample_row = ((const int64_t*)(buf + e->off_sample_rows))[row];
  const int64_t len = ((const int64_t*)(buf + e->off_sample_pos))[row];  // prompt + output so far
  const int32_t last_id = ((const int32_t*)buf)[sample_row];
  const int32_t* hist = a->tokens + (int64_t)slot * e->context_len;
  // the history the penalties read: prompt + output for repetition, the output only otherwise
  const int64_t from = (f & BLINK_EXT_PROMPT) ? 0 : e->prompt_len[slot];
  const int64_t prompt_len = e->prompt_len[slot];
  const int64_t end = (f & BLINK_EXT_OUTPUT) ? len : from;  // bias only: no marks
  for (int64_t i = from + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t t = ext_token(hist, i, len - 1, last_id);
    if (t < 0 || (uint32_t)t >= vocab) continue;
    if (i < prompt_len) atomicOr(&marks[t], BLINK_EXT_SEEN);
    else atomicAdd(&marks[t], 1u);
  }
  const int32_t num_bias = e->num_bias[slot];
  for (int32_t j = threadIdx.x; j < num_bias; j += blockDim.x) {
    const int32_t t = e->bias_ids[(uint64_t)slot * e->max_bias + j];
    if (t >= 0 && (uint32_t)t < vocab) atomicAdd(&logits[t], e->bias_vals[(uint64_t)slot * e->max_bias + j]);
  }
  __syncthreads();
  if (!(f & BLINK_EXT_OUTPUT)) return;
  const float presence = e->penalties[3 * slot], frequency = e->penalties[3 * slot + 1];
  const float repetition = e->penalties[3 * slot + 2];
  for (int64_t i = from + threadIdx.x; i < len; i += blockDim.x) {
    const int32_t t = ext_token(hist, i, len - 1, last_id);
    if (t < 0 || (uint32_t)t >= vocab) continue;
    const uint32_t m = atomicExch(&marks[t], 0u);  // the one thread that finds it set owns token t
    if (m == 0u) continue;
    float x = logits[t];
    if (repetition != 1.0f) x = x > 0.0f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
    const uint32_t count = m & ~BLINK_EXT_SEEN;
    if (count) x = __fsub_rn(x, __fadd_rn(__fmul_rn(frequency, (float)count), presence));
    logits[t] = x;
  }
}

// The row's token mask (sampler.apply_masks), after the bias and penalties: generated token i = len - prompt_len
// is sampled under mask i, valid when the slot's mask_seq (the gateway's word, stored last) is i + 1. Disallowed
// tokens, and any past the mask's words, go to -inf. A mask not there yet (the row waits: its logits as they
// are) or one that allows nothing (every logit -inf) marks the row: blink_ext_mask_fix replaces what is drawn
// for it. The words are read from the ring (mapped host memory) a chunk at a time into shared memory: one PCIe
// read per word, not per token (an earlier version read them twice, a pass to find an allowed token first).
__device__ void ext_mask_row(blink_loop_args* a, const blink_loop_ext* e, uint32_t b, uint32_t row, int32_t slot) {
  __shared__ uint32_t sh_words[BLINK_EXT_MASK_CHUNK];
  __shared__ int32_t sh_state;
  const uint8_t* area = a->ring + e->masks_offset + (uint64_t)slot * e->mask_bytes;
  const uint32_t* ring_words = (const uint32_t*)area;
  const int64_t len = ((const int64_t*)(step_buf_of(a, b) + e->off_sample_pos))[row];  // prompt + output so far
  if (threadIdx.x == 0) {
    const uint32_t seq = ld_v((const uint32_t*)(area + e->mask_seq_offset));
    sh_state = (int64_t)seq == len - e->prompt_len[slot] + 1 ? 0 : BLINK_TOKEN_WAIT;
    __threadfence_system();  // the words below are read after the word that validates them
  }
  __syncthreads();
  if (sh_state != 0) {
    if (threadIdx.x == 0) e->mask_state[b * e->max_rows + row] = sh_state;
    return;
  }
  const uint32_t vocab = e->vocab, vocab_words = (vocab + 31u) / 32u;
  const uint32_t words = e->mask_words < vocab_words ? e->mask_words : vocab_words;
  float* logits = e->logits + (uint64_t)row * vocab;
  int any = 0;  // some token allowed (the words past the vocabulary's last token do not count)
  for (uint32_t w0 = 0; w0 < vocab_words; w0 += BLINK_EXT_MASK_CHUNK) {  // each word read once over PCIe
    for (uint32_t w = w0 + threadIdx.x; w < w0 + BLINK_EXT_MASK_CHUNK; w += blockDim.x) {
      const uint32_t word = w < words ? ld_v(ring_words + w) : 0u, inside = vocab - 32u * w;
      if (w < vocab_words) any |= (word & (inside >= 32u ? 0xFFFFFFFFu : (1u << inside) - 1u)) != 0u;
      sh_words[w - w0] = word;
    }
    __syncthreads();
    for (uint32_t t = 32u * w0 + threadIdx.x; t < vocab && t < 32u * (w0 + BLINK_EXT_MASK_CHUNK); t += blockDim.x)
      if (!(sh_words[t / 32u - w0] >> (t % 32u) & 1u)) logits[t] = -INFINITY;
    __syncthreads();
  }
  // a mask that allows nothing left every logit at -inf: blink_ext_mask_fix replaces what the sampler drew
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) e->mask_state[b * e->max_rows + row] = any ? 0 : BLINK_TOKEN_MASK_EMPTY;
}

// One block per sampled row of the step in buffer `b` (grid: the bucket's rows): the bias and penalties of the
// rows that have them, then the token masks of the constrained rows.
__global__ void __launch_bounds__(BLINK_EXT_THREADS) blink_ext_adjust(blink_loop_args* a, uint32_t b) {
  const blink_loop_ext* e = a->ext;
  const uint32_t row = blockIdx.x;
  if (row >= e->num_rows[b]) return;
  const int32_t slot = e->row_slot[b * e->max_rows + row];
  if (slot < 0) return;
  if (e->flags[slot] & BLINK_EXT_ADJUST) ext_adjust_row(a, e, b, row, slot);
  if (!(e->flags[slot] & BLINK_EXT_MASK)) return;
  __syncthreads();  // every thread's adjusted logits, before the mask
  ext_mask_row(a, e, b, row, slot);
}

// After the POST graph of a step in buffer `b` with masked rows: the rows that sample no token get their
// TOKEN_WAIT / TOKEN_MASK_EMPTY in place of what was drawn (the full step's update reads them; such a step
// is never speculated past: blink_loop_spec). One block.
__global__ void blink_ext_mask_fix(blink_loop_args* a, uint32_t b) {
  const blink_loop_ext* e = a->ext;
  if (!e->masked[b]) return;
  for (uint32_t row = threadIdx.x; row < e->num_rows[b]; row += blockDim.x) {
    const int32_t slot = e->row_slot[b * e->max_rows + row];
    if (slot < 0 || !(e->flags[slot] & BLINK_EXT_MASK)) continue;
    const int32_t state = e->mask_state[b * e->max_rows + row];
    if (state != 0) a->sampled[row] = state;
  }
}

// ---- host: the loop graph's extended branches ---------------------------------------------------------------
// Branches 4 * num_buckets + p and 8 * num_buckets + p (p: a plain branch; their POST with and without the
// logprobs) exist when a->ext is set.
static uint32_t ext_num_branches(const blink_loop_ext* host_ext, uint32_t num_buckets) {
  return host_ext ? 12u * num_buckets : 4u * num_buckets;
}

// The host's copy of the extension block (0 when there is none): host_ext receives it.
static int ext_read(const blink_loop_args* args, blink_loop_ext* host_ext) {
  if (!args->ext) return 0;
  return cudaMemcpy(host_ext, args->ext, sizeof(blink_loop_ext), cudaMemcpyDeviceToHost) == cudaSuccess ? 1 : -1;
}

// Branch `branch` (>= 4 * num_buckets) already holds its LOGITS graph as node `logits_node`: after it, the
// adjust kernel (one block per row of the bucket's graph), then the POST graph (*post_out): post_graphs[j],
// j = branch - 4 * num_buckets (the first 4 * num_buckets with the logprobs, the next without).
static cudaError_t ext_finish_branch(const blink_loop_ext* host_ext, blink_loop_args* dev_args, cudaGraph_t body,
                                     cudaGraphNode_t logits_node, uint32_t branch, const blink_sched_config* cfg,
                                     cudaGraphNode_t* post_out) {
  const uint32_t nb = host_ext->num_buckets, j = branch - 4u * nb, p = j % (4u * nb), b = p / (2u * nb);
  const uint32_t bucket = (uint32_t)cfg->buckets[(p / 2u) % nb];
  const uint32_t rows = bucket < host_ext->max_rows ? bucket : host_ext->max_rows;
  void* params[] = {&dev_args, (void*)&b};
  cudaKernelNodeParams k = {};
  k.gridDim = dim3(rows);
  k.blockDim = dim3(BLINK_EXT_THREADS);
  k.kernelParams = params;
  k.func = (void*)blink_ext_adjust;
  cudaGraphNode_t adjust, post;
  cudaError_t err = cudaGraphAddKernelNode(&adjust, body, &logits_node, 1, &k);
  if (err != cudaSuccess) return err;
  err = cudaGraphAddChildGraphNode(&post, body, &adjust, 1, (cudaGraph_t)host_ext->post_graphs[j]);
  if (err != cudaSuccess || !host_ext->mask_words) {
    *post_out = post;
    return err;
  }
  cudaKernelNodeParams fix = k;  // the token masks' rows that sample nothing, after the sampler
  fix.gridDim = dim3(1);
  fix.blockDim = dim3(256);
  fix.func = (void*)blink_ext_mask_fix;
  return cudaGraphAddKernelNode(post_out, body, &post, 1, &fix);
}

#endif  // BLINK_LOOP_EXT_CUH
