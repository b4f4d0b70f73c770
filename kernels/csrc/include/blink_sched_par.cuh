// Block-parallel versions of blink_sched.h's per-step work, for the loop kernel (device only).
// One GPU thread walking a few hundred sequences pays a memory latency per load: at batch 256 the serial
// update + schedule + fill took ~600 us. These split the per-entry work over the block with prefix sums
// and leave to one thread only what is rare or inherently ordered (finishing sequences, preemption,
// chunked prefill). Each produces exactly the serial functions' state, byte for byte:
// tests/kernels/sched_device_check.cu runs them against the host build of blink_sched.h in lockstep.
// Call them with every thread of the block; `scratch` holds 5 * max_slots int32 (shared memory is best).
#ifndef BLINK_SCHED_PAR_CUH
#define BLINK_SCHED_PAR_CUH

#include "blink_sched.h"

// Exclusive prefix sum of v[0, n) in place; returns the total (to every thread). blockDim.x % 32 == 0.
__device__ inline int32_t blink_block_scan(int32_t* v, int32_t n) {
  __shared__ int32_t warp_sums[32];
  const int32_t per = (n + (int32_t)blockDim.x - 1) / (int32_t)blockDim.x;
  const int32_t lo = (int32_t)threadIdx.x * per, hi = lo + per < n ? lo + per : n;
  int32_t sum = 0;
  for (int32_t i = lo; i < hi; ++i) sum += v[i];
  const int32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  int32_t x = sum;
  for (int32_t d = 1; d < 32; d <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < num_warps ? warp_sums[lane] : 0;
    for (int32_t d = 1; d < 32; d <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < num_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  int32_t offset = x - sum + (warp ? warp_sums[warp - 1] : 0);
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t t = v[i];
    v[i] = offset;
    offset += t;
  }
  const int32_t total = warp_sums[num_warps - 1];
  __syncthreads();
  return total;
}

// blink_sched_update, in parallel over entries; finishing (list edits, freeing blocks) stays on thread 0,
// in entry order, after the rest: no other entry's work reads what a finish changes.
// A STOPPING sequence is handled as blink_sched_update handles it (its row keeps its place in the new list,
// so that entry k is still sampled row k's, with no token). Returns the number of such rows (to every thread).
__device__ inline int32_t blink_sched_update_par(blink_sched* s, const int32_t* sampled, int32_t* scratch) {
  blink_sched_header* h = s->h;
  const int32_t n = h->num_entries, slots = h->cfg.max_slots;
  const int64_t ctx = h->cfg.context_len;
  int32_t *k_of = scratch, *pub = scratch + slots, *fin = scratch + 2 * slots, *tok = scratch + 3 * slots,
          *why = scratch + 4 * slots;
  __shared__ int32_t sh_dropped;
  if (threadIdx.x == 0) sh_dropped = 0;
  int stopping = 0;
  for (int32_t i = threadIdx.x; i < slots; i += blockDim.x) stopping |= s->status[i] == BLINK_SEQ_STOPPING;
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) k_of[e] = s->entry_samples[e];
  stopping = __syncthreads_or(stopping);
  blink_block_scan(k_of, n);
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int32_t slot = s->entry_slot[e];
    s->num_computed[slot] += s->entry_q_len[e];
    if (s->status[slot] != BLINK_SEQ_STOPPING) blink_cache_extend(s, slot);  // per slot: all entries at once
    int32_t p = 0, f = 0, drop = 0;
    if (s->entry_samples[e] && s->status[slot] == BLINK_SEQ_STOPPING) {
      p = drop = 1;
      atomicAdd(&sh_dropped, 1);
    } else if (s->entry_samples[e]) {
      const int32_t token = sampled[k_of[e]];
      const int32_t reason = token == BLINK_TOKEN_WAIT ? 0 : blink_token_reason(s, slot, token);
      const int32_t keep = token != BLINK_TOKEN_WAIT && reason != 1 && reason != 4;  // as blink_sched_update
      if (token == BLINK_TOKEN_WAIT) s->num_computed[slot] -= 1;
      if (keep) s->tokens[slot * ctx + s->num_tokens[slot]++] = token;
      p = keep;
      f = reason != 0;
      tok[e] = token;
      why[e] = reason;
    }
    pub[e] = p;
    fin[e] = f;
    k_of[e] = p | (f << 1) | (drop << 2);  // the flags, kept through the scans below
  }
  __syncthreads();
  const int32_t num_new = blink_block_scan(pub, n);
  const int32_t num_finished = blink_block_scan(fin, n);
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int32_t slot = s->entry_slot[e];
    if (k_of[e] & 1) {
      s->new_slot[pub[e]] = (k_of[e] & 4) ? -1 - slot : slot;
      s->new_token[pub[e]] = (k_of[e] & 4) ? 0 : tok[e];
    }
    if (k_of[e] & 2) {
      s->fin_slot[fin[e]] = slot;
      s->fin_reason[fin[e]] = why[e];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    h->num_new = num_new;
    h->num_finished = num_finished;
    if (h->cfg.prefix_caching)  // before the finishes, in entry order: as blink_sched_update
      for (int32_t e = 0; e < n; ++e)
        if (s->status[s->entry_slot[e]] != BLINK_SEQ_STOPPING) blink_cache_publish(s, s->entry_slot[e]);
    for (int32_t i = 0; i < num_finished; ++i) blink_sched_finish(s, s->fin_slot[i]);
    if (stopping)
      for (int32_t slot = 0; slot < slots; ++slot)
        if (s->status[slot] == BLINK_SEQ_STOPPING) blink_sched_finish(s, slot);
  }
  __syncthreads();
  return sh_dropped;
}

// 1 when `list` is already in (priority, arrival) order: insertion sort would leave it as it is.
__device__ inline int blink_sorted_par(const blink_sched* s, const int32_t* list, int32_t n) {
  int ok = 1;
  for (int32_t i = threadIdx.x; i + 1 < n; i += blockDim.x) ok &= !blink_before(s, list[i + 1], list[i]);
  return __syncthreads_and(ok);
}

// The decode phase when nobody has to be preempted: the first `budget` running sequences that decode and
// have room, their blocks popped from the free list in that order. Returns the budget left, or -1 when the
// blocks do not suffice (thread 0 then runs the serial phase, which preempts).
__device__ inline int32_t blink_decode_phase_par(blink_sched* s, const int32_t* room, int32_t budget, int32_t* scratch) {
  blink_sched_header* h = s->h;
  const int32_t n = h->num_running, slots = h->cfg.max_slots, nb = h->cfg.num_blocks;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg);
  int32_t *idx = scratch, *need = scratch + slots, *flag = scratch + 2 * slots;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t slot = s->running[i];
    const int e = s->status[slot] == BLINK_SEQ_RUNNING && s->num_tokens[slot] - s->num_computed[slot] == 1 &&
                  room[slot] > 0;
    idx[i] = flag[i] = e;
  }
  __syncthreads();
  const int32_t eligible = blink_block_scan(idx, n);
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    flag[i] = flag[i] && idx[i] < budget;
    need[i] = flag[i] ? blink_extra_blocks(s, s->running[i], s->num_computed[s->running[i]] + 1) : 0;
  }
  __syncthreads();
  const int32_t total_need = blink_block_scan(need, n);
  if (total_need > h->num_free) return -1;  // uniform: every thread read the same words
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!flag[i]) continue;
    const int32_t slot = s->running[i], e = idx[i];
    const int32_t grow = blink_extra_blocks(s, slot, s->num_computed[slot] + 1);
    for (int32_t j = 0; j < grow; ++j) {
      const int32_t b = s->free_blocks[(h->free_head + need[i] + j) % nb];
      s->block_table[(int64_t)slot * mb + s->num_table[slot] + j] = b;
      s->block_ref[b] = 1;  // as blink_take_block
    }
    s->num_table[slot] += grow;
    s->entry_slot[e] = slot;
    s->entry_q_len[e] = 1;
    s->entry_samples[e] = 1;
    s->entry_start[e] = s->num_computed[slot];
    s->scheduled[slot] = 1;
  }
  const int32_t taken = eligible < budget ? eligible : budget;
  __syncthreads();
  if (threadIdx.x == 0) {
    h->free_head = (h->free_head + total_need) % nb;
    h->num_free -= total_need;
    h->num_entries = taken;
  }
  __syncthreads();
  return budget - taken;
}

// blink_sched_schedule with the common parts in parallel: clearing the step's marks, checking the lists'
// order, the decode phase without preemption, and skipping the prefill phase when nothing prefills.
// Everything else (sorting, preemption, prefill chunks, the liveness retry) runs on thread 0 as written.
// Returns the number of entries (to every thread).
__device__ inline int32_t blink_sched_schedule_par(blink_sched* s, const int32_t* room, int32_t* order, int32_t* scratch) {
  __shared__ int32_t sh_budget, sh_entries;
  blink_sched_header* h = s->h;
  for (int32_t i = threadIdx.x; i < h->cfg.max_slots; i += blockDim.x) s->scheduled[i] = 0;
  const int running_sorted = blink_sorted_par(s, s->running, h->num_running);
  const int waiting_sorted = blink_sorted_par(s, s->waiting, h->num_waiting);
  if (threadIdx.x == 0) {
    h->num_preempted = 0;
    h->num_entries = 0;
    if (!running_sorted) blink_sort(s, s->running, h->num_running);
    if (!waiting_sorted) blink_sort(s, s->waiting, h->num_waiting);
  }
  __syncthreads();
  int32_t budget = blink_decode_phase_par(s, room, h->cfg.budget, scratch);
  if (budget < 0) {  // blocks are short: the serial phase, which preempts (the parallel one wrote nothing)
    if (threadIdx.x == 0) sh_budget = blink_decode_phase(s, room, order, h->cfg.budget);
    __syncthreads();
    budget = sh_budget;
  }
  int prefills = h->num_waiting > 0;
  for (int32_t i = threadIdx.x; i < h->num_running && !prefills; i += blockDim.x) {
    const int32_t slot = s->running[i];
    prefills = s->num_tokens[slot] - s->num_computed[slot] > 1;
  }
  prefills = __syncthreads_or(prefills);
  if (threadIdx.x == 0) {
    if (prefills) blink_prefill_phase(s, room, order, budget);
    blink_liveness(s, room, order);  // serial, rare: the step chosen again after a preemption
    sh_entries = h->num_entries;
  }
  __syncthreads();
  return sh_entries;
}

// blink_fill_prologue, in parallel over entries; returns the bucket (to every thread).
__device__ inline int32_t blink_fill_prologue_par(blink_sched* s, uint8_t* buf, int32_t* scratch) {
  __shared__ int32_t sh_bucket;
  blink_sched_header* h = s->h;
  const blink_sched_config* c = &h->cfg;
  const int32_t n = h->num_entries, slots = c->max_slots;
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  blink_step_layout(c->step_max_tokens, c->step_max_seqs, blink_max_blocks_per_seq(c), offs);
  int32_t* q_start = BLINK_FIELD(buf, offs, BLINK_F_Q_START, int32_t);
  int64_t* rows = BLINK_FIELD(buf, offs, BLINK_F_SAMPLE_ROWS, int64_t);
  int32_t *qs = scratch, *ks = scratch + slots;
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
    qs[e] = s->entry_q_len[e];
    ks[e] = s->entry_samples[e];
  }
  __syncthreads();
  const int32_t num_tokens = blink_block_scan(qs, n);
  const int32_t num_sampled = blink_block_scan(ks, n);
  int greedy = 1;
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int32_t slot = s->entry_slot[e];
    s->entry_q_start[e] = q_start[e] = qs[e];
    BLINK_FIELD(buf, offs, BLINK_F_CTX_LENS, int32_t)[e] = s->entry_start[e] + s->entry_q_len[e];
    if (!s->entry_samples[e]) continue;
    const int32_t k = ks[e];
    rows[k] = qs[e] + s->entry_q_len[e] - 1;
    greedy = blink_fill_sample_row(s, buf, offs, k, slot) && greedy;
  }
  greedy = __syncthreads_and(greedy);
  const int32_t bucket = blink_bucket_for(c, num_tokens);
  const int32_t rows_in_graph = bucket < c->step_max_seqs ? bucket : c->step_max_seqs;
  for (int32_t e = n + threadIdx.x; e <= rows_in_graph; e += blockDim.x) q_start[e] = num_tokens;
  for (int32_t r = num_sampled + threadIdx.x; r < rows_in_graph; r += blockDim.x) rows[r] = 0;
  if (threadIdx.x == 0) {
    s->entry_q_start[n] = num_tokens;
    *BLINK_FIELD(buf, offs, BLINK_F_NUM_SEQS, int32_t) = n;
    h->bucket = bucket;
    h->num_tokens = num_tokens;
    h->num_sampled = num_sampled;
    h->all_greedy = greedy;
    sh_bucket = bucket;
  }
  __syncthreads();
  return sh_bucket;
}

// The batch's block-table rows over the valid cells only (entry e's first num_table blocks), numbered
// with a prefix sum, in runs of 8 cells per thread whose loads are in flight together (the rectangle of
// blink_fill_block_tables walks [entries, MB]: 256 x 256 cells for 256 sequences of a 4k context).
__device__ inline void blink_fill_block_tables_par(const blink_sched* s, uint8_t* buf, int32_t* scratch) {
  const blink_sched_header* h = s->h;
  const blink_sched_config* c = &h->cfg;
  const int32_t n = h->num_entries, mb = blink_max_blocks_per_seq(c);
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  blink_step_layout(c->step_max_tokens, c->step_max_seqs, mb, offs);
  int32_t* tables = BLINK_FIELD(buf, offs, BLINK_F_BLOCK_TABLES, int32_t);
  int32_t* first = scratch;  // entry e's first cell; every entry holds at least one block
  for (int32_t e = threadIdx.x; e < n; e += blockDim.x) first[e] = s->num_table[s->entry_slot[e]];
  __syncthreads();
  const int32_t cells = blink_block_scan(first, n);
  for (int32_t base = threadIdx.x * 8; base < cells; base += blockDim.x * 8) {
    int32_t value[8], cell[8];
#pragma unroll
    for (int32_t j = 0; j < 8; ++j) {
      const int32_t i = base + j;
      cell[j] = -1;
      value[j] = 0;
      if (i < cells) {
        int32_t lo = 0, hi = n - 1;  // the last entry whose first cell is <= i
        while (lo < hi) {
          const int32_t mid = (lo + hi + 1) / 2;
          if (first[mid] <= i) lo = mid; else hi = mid - 1;
        }
        const int32_t b = i - first[lo];
        cell[j] = lo * mb + b;
        value[j] = s->block_table[(int64_t)s->entry_slot[lo] * mb + b];
      }
    }
#pragma unroll
    for (int32_t j = 0; j < 8; ++j)
      if (cell[j] >= 0) tables[cell[j]] = value[j];
  }
  __syncthreads();
}

#endif  // BLINK_SCHED_PAR_CUH
