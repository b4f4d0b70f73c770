// The scheduling step of the GPU-resident loop, written once for the device and the host.
// Same rules, same choices as gpu_backend/engine/scheduler.py (the reference): decode first in priority
// order (FCFS inside a class), then chunked prefill within the token budget; admission only when blocks
// exist; preemption by recompute of the latest, lowest-priority running sequence; a sequence with no room
// in its output buffer is skipped; finished and cancelled sequences free their blocks the same step.
// With the prefix cache (blink_prefix_cache.h), a waiting sequence starts on the cached blocks of its
// prompt, and blocks are reference-counted; free and evictable blocks both count as available.
// tests/gpu_backend/test_sched_native.py diffs this against the reference step by step; a change to one
// is made to both (as was the liveness rule: partial prefills holding every block preempt the latest one).
//
// All state lives in one caller-owned buffer (device memory in the loop, a numpy array on the host):
// a header (config + counters), then fixed arrays carved by blink_sched_bind. No allocation, no recursion.
// The serial parts run on one thread (tid 0 of the scheduler block); filling the step buffer is split
// over (tid, nthreads) and runs with nthreads = 1 on the host.
#ifndef BLINK_SCHED_H
#define BLINK_SCHED_H

#include <stdint.h>

#if defined(__CUDACC__)
#define BLINK_HD __host__ __device__ inline
#else
#define BLINK_HD static inline
#endif

// The config and header structs, the slot statuses, the error codes and the carved arrays (X-macro lists, hot
// then cold) are generated from kernels/sched_decl.py, the step buffer's arrays from kernels/step_decl.py
// (`python -m protocols.layout.gen`); gpu_backend/engine/sched_native.py and step_buffers.py read the same.
// STOPPING (the GPU loop's asynchronous take only, blink_loop_spec.cuh): the sequence sampled a stop token
// after step n+1, which holds it, was launched; its finish is published, and the next update drops its row of
// step n+1 and frees it. The host engines never set it.
#include "blink_sched_layout.h"
#include "blink_step_layout.h"

// The state's arrays, bound into one buffer by blink_sched_bind_split (shapes: blink_sched_layout.h).
typedef struct blink_sched {
  blink_sched_header* h;
#define BLINK_SCHED_POINTER(NAME, name, type, count) type* name;
  BLINK_SCHED_HOT_ARRAYS(BLINK_SCHED_POINTER)
  BLINK_SCHED_COLD_ARRAYS(BLINK_SCHED_POINTER)
#undef BLINK_SCHED_POINTER
} blink_sched;

BLINK_HD int32_t blink_max_blocks_per_seq(const blink_sched_config* c) {
  return (c->context_len + c->block_size - 1) / c->block_size;
}

BLINK_HD uint64_t blink_align8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

// Carve the arrays: those every step touches ("hot": the header, per-slot scalars, the lists and one
// step's batch) from `hot`, then the large ones (stop ids, block tables, tokens, the free list) from
// `cold`. With cold == 0 they follow the hot ones in the same buffer (the layout is the same either way:
// the loop kernel copies the hot prefix to shared memory and binds it there). Returns the bytes used;
// *hot_bytes (when given) gets the size of the hot prefix. hot may be 0 to size only.
BLINK_HD uint64_t blink_sched_bind_split(blink_sched* s, void* hot, void* cold, const blink_sched_config* c,
                                         uint64_t* hot_bytes) {
  uint8_t* base = (uint8_t*)hot;
  uint64_t off = blink_align8(sizeof(blink_sched_header));
  // the dimensions the generated lists count in
  const uint64_t N = (uint64_t)c->max_slots, STOP = (uint64_t)c->max_stop_ids, MB = (uint64_t)blink_max_blocks_per_seq(c),
                 CTX = (uint64_t)c->context_len, BLOCKS = (uint64_t)c->num_blocks, HT = (uint64_t)c->hash_slots;
#define BLINK_CARVE(NAME, field, type, count) \
  s->field = (type*)(base + off); off = blink_align8(off + sizeof(type) * (count));
  s->h = (blink_sched_header*)base;
  BLINK_SCHED_HOT_ARRAYS(BLINK_CARVE)
  if (hot_bytes) *hot_bytes = off;
  if (cold) base = (uint8_t*)cold - off;  // cold offsets continue where the hot prefix ends
  BLINK_SCHED_COLD_ARRAYS(BLINK_CARVE)
#undef BLINK_CARVE
  return off;
}

BLINK_HD uint64_t blink_sched_bind(blink_sched* s, void* mem, const blink_sched_config* c) {
  return blink_sched_bind_split(s, mem, 0, c, 0);
}

#include "blink_prefix_cache.h"

// Every slot free, every block free, in id order (the reference's deque(range(num_blocks))), nothing cached.
BLINK_HD void blink_sched_init(blink_sched* s, const blink_sched_config* c) {
  blink_sched_header* h = s->h;
  h->cfg = *c;
  h->next_arrival = 0;
  h->free_head = 0;
  h->num_free = c->num_blocks;
  h->num_running = h->num_waiting = h->num_entries = h->num_preempted = h->num_new = h->num_finished = 0;
  h->bucket = h->num_tokens = h->num_sampled = 0;
  h->all_greedy = 1;
  h->spec_mode = h->spec_tainted = 0;
  h->lru_head = h->lru_tail = -1;
  h->num_evictable = h->num_cached = 0;
  h->prefix_queries = h->prefix_hits = 0;
  for (int32_t b = 0; b < c->num_blocks; ++b) {
    s->free_blocks[b] = b;
    s->block_hash[b] = 0;
    s->block_ref[b] = 0;
    s->block_mark[b] = 0;
  }
  for (int32_t i = 0; i < c->hash_slots; ++i) s->hash_table[i] = -1;
  for (int32_t i = 0; i < c->max_slots; ++i) {
    s->status[i] = BLINK_SEQ_FINISHED;
    s->num_table[i] = s->num_hashes[i] = s->num_published[i] = s->cached_tokens[i] = 0;
  }
}

// ---- blocks ------------------------------------------------------------------------------------------
BLINK_HD int32_t blink_blocks_for(const blink_sched* s, int64_t num_tokens) {
  const int32_t bs = s->h->cfg.block_size;
  return (int32_t)((num_tokens + bs - 1) / bs);
}

BLINK_HD int32_t blink_extra_blocks(const blink_sched* s, int32_t slot, int32_t num_tokens) {
  const int32_t need = blink_blocks_for(s, num_tokens) - s->num_table[slot];
  return need > 0 ? need : 0;
}

// Blocks for `slot` up to `num_tokens` (the caller checked blink_available). A speculation that would
// evict taints the step instead.
BLINK_HD void blink_grow(blink_sched* s, int32_t slot, int32_t num_tokens) {
  blink_sched_header* h = s->h;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg);
  if (h->spec_mode && blink_extra_blocks(s, slot, num_tokens) > h->num_free) {
    h->spec_tainted = 1;
    return;
  }
  for (int32_t k = blink_extra_blocks(s, slot, num_tokens); k > 0; --k)
    s->block_table[(int64_t)slot * mb + s->num_table[slot]++] = blink_take_block(s);
}

// Whether dropping `slot`'s blocks changes the cache (a shared or a hashed block): a speculation may not.
BLINK_HD int blink_drop_touches_cache(const blink_sched* s, int32_t slot) {
  const int32_t mb = blink_max_blocks_per_seq(&s->h->cfg);
  for (int32_t k = 0; k < s->num_table[slot]; ++k) {
    const int32_t b = s->block_table[(int64_t)slot * mb + k];
    if (s->block_ref[b] > 1 || s->block_hash[b]) return 1;
  }
  return 0;
}

// `slot` lets go of its blocks: last ones first with the cache on, so that a prompt's tail is evicted
// before its head (a shorter prefix is worth more: every longer one goes through it).
BLINK_HD void blink_free_blocks(blink_sched* s, int32_t slot) {
  blink_sched_header* h = s->h;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg), n = s->num_table[slot];
  const int32_t* table = s->block_table + (int64_t)slot * mb;
  if (h->spec_mode && h->cfg.prefix_caching && blink_drop_touches_cache(s, slot)) {
    h->spec_tainted = 1;
  } else if (h->cfg.prefix_caching) {
    for (int32_t k = n - 1; k >= 0; --k) blink_drop_block(s, table[k]);
  } else {
    for (int32_t k = 0; k < n; ++k) blink_drop_block(s, table[k]);
  }
  s->num_table[slot] = s->num_published[slot] = 0;
}

// ---- ordered slot lists (the reference's running/waiting lists) ----------------------------------------
BLINK_HD int blink_before(const blink_sched* s, int32_t a, int32_t b) {  // (priority, arrival) order
  if (s->priority[a] != s->priority[b]) return s->priority[a] < s->priority[b];
  return s->arrival[a] < s->arrival[b];
}

BLINK_HD void blink_sort(const blink_sched* s, int32_t* list, int32_t n) {  // insertion sort: keys unique
  for (int32_t i = 1; i < n; ++i) {
    const int32_t x = list[i];
    int32_t j = i;
    for (; j > 0 && blink_before(s, x, list[j - 1]); --j) list[j] = list[j - 1];
    list[j] = x;
  }
}

BLINK_HD int blink_remove(int32_t* list, int32_t* n, int32_t slot) {
  for (int32_t i = 0; i < *n; ++i) {
    if (list[i] != slot) continue;
    for (int32_t j = i + 1; j < *n; ++j) list[j - 1] = list[j];
    *n -= 1;
    return 1;
  }
  return 0;
}

// ---- admission ---------------------------------------------------------------------------------------
// Why a request can never run (blink_sched_error), as Scheduler.check.
BLINK_HD int32_t blink_sched_check(const blink_sched* s, int32_t prompt_len, int64_t max_tokens, double temperature,
                                   double top_p, int32_t top_k, double min_p) {
  const blink_sched_config* c = &s->h->cfg;
  if (prompt_len >= c->context_len) return BLINK_ERR_PROMPT_TOO_LONG;
  // written so that a NaN fails each test (it compares false both ways) and an infinite temperature too:
  // the ring is written by another machine over RDMA, and nothing upstream of this check is trusted
  if (prompt_len < 1 || max_tokens < 1 || !(temperature >= 0 && temperature - temperature == 0) ||
      !(0 < top_p && top_p <= 1) || top_k < 0 || !(0 <= min_p && min_p <= 1))
    return BLINK_ERR_INVALID_PARAMS;
  int64_t final_len = prompt_len + max_tokens - 1;
  if (final_len > c->context_len) final_len = c->context_len;
  if (blink_blocks_for(s, final_len) > c->num_blocks) return BLINK_ERR_NO_KV_CAPACITY;
  return BLINK_ERR_NONE;
}

// The request's block hashes (`hashes` may be the ring's words): at most one per full prompt block, up to
// the first zero; none with the cache off.
BLINK_HD void blink_set_hashes(blink_sched* s, int32_t slot, const uint64_t* hashes, int32_t num_hashes,
                               int32_t prompt_len) {
  const blink_sched_config* c = &s->h->cfg;
  const int32_t mb = blink_max_blocks_per_seq(c), full = prompt_len / c->block_size;
  int32_t n = 0;
  if (c->prefix_caching)
    for (; n < num_hashes && n < full && hashes[n]; ++n) s->seq_hashes[(int64_t)slot * mb + n] = hashes[n];
  s->num_hashes[slot] = n;
}

// Queue a checked request in a free slot (Scheduler.add). Sampling parameters go to the step buffer.
BLINK_HD void blink_sched_add(blink_sched* s, int32_t slot, const int32_t* prompt, int32_t prompt_len,
                              int64_t max_tokens, int64_t priority, const int32_t* stop_ids, int32_t num_stop,
                              int32_t ignore_eos, float temperature, int32_t top_k, float top_p, float min_p,
                              uint64_t seed, const uint64_t* hashes, int32_t num_hashes) {
  blink_sched_header* h = s->h;
  const int64_t ctx = h->cfg.context_len;
  for (int32_t i = 0; i < prompt_len; ++i) s->tokens[slot * ctx + i] = prompt[i];
  blink_set_hashes(s, slot, hashes, num_hashes, prompt_len);
  s->num_published[slot] = s->cached_tokens[slot] = 0;
  for (int32_t i = 0; i < num_stop; ++i) s->stop_ids[(int64_t)slot * h->cfg.max_stop_ids + i] = stop_ids[i];
  s->prompt_len[slot] = s->num_tokens[slot] = prompt_len;
  s->num_computed[slot] = s->num_table[slot] = s->num_preemptions[slot] = 0;
  s->max_tokens[slot] = max_tokens;
  s->priority[slot] = priority;
  s->arrival[slot] = h->next_arrival++;
  s->num_stop[slot] = num_stop;
  s->ignore_eos[slot] = ignore_eos;
  s->temperature[slot] = temperature;
  s->top_k[slot] = top_k;
  s->top_p[slot] = top_p;
  s->min_p[slot] = min_p;
  s->seed[slot] = seed;
  s->status[slot] = BLINK_SEQ_WAITING;
  s->waiting[h->num_waiting++] = slot;
}

// Remove a sequence wherever it is and free its blocks now (Scheduler.finish; cancels use this).
BLINK_HD void blink_sched_finish(blink_sched* s, int32_t slot) {
  blink_sched_header* h = s->h;
  blink_free_blocks(s, slot);
  blink_remove(s->running, &h->num_running, slot);
  blink_remove(s->waiting, &h->num_waiting, slot);
  s->status[slot] = BLINK_SEQ_FINISHED;
}

// ---- one step ----------------------------------------------------------------------------------------
BLINK_HD void blink_push_entry(blink_sched* s, int32_t slot, int32_t q_len, int32_t samples) {
  blink_sched_header* h = s->h;
  const int32_t e = h->num_entries++;
  s->entry_slot[e] = slot;
  s->entry_q_len[e] = q_len;
  s->entry_samples[e] = samples;
  s->entry_start[e] = s->num_computed[slot];
  s->scheduled[slot] = 1;
}

BLINK_HD void blink_preempt(blink_sched* s, int32_t slot) {
  blink_sched_header* h = s->h;
  blink_free_blocks(s, slot);
  s->num_computed[slot] = 0;
  s->num_preemptions[slot] += 1;
  s->status[slot] = BLINK_SEQ_WAITING;
  blink_remove(s->running, &h->num_running, slot);
  s->waiting[h->num_waiting++] = slot;
  blink_sort(s, s->waiting, h->num_waiting);
  s->preempted[h->num_preempted++] = slot;
}

// Grow `slot` to `num_tokens`, preempting the latest, lowest-priority unscheduled running sequence while
// blocks run out; with nothing else to take, the sequence itself gives way (Scheduler._reserve).
BLINK_HD int blink_reserve(blink_sched* s, int32_t slot, int32_t num_tokens) {
  blink_sched_header* h = s->h;
  if (h->spec_mode && blink_extra_blocks(s, slot, num_tokens) > h->num_free) {
    h->spec_tainted = 1;  // a speculative pass never preempts nor evicts (see spec_mode)
    return 0;
  }
  while (blink_extra_blocks(s, slot, num_tokens) > blink_available(s)) {
    int32_t victim = -1;
    for (int32_t i = 0; i < h->num_running; ++i) {
      const int32_t v = s->running[i];
      if (v == slot || s->scheduled[v]) continue;
      if (victim < 0 || blink_before(s, victim, v)) victim = v;
    }
    if (victim < 0) {
      blink_preempt(s, slot);
      return 0;
    }
    blink_preempt(s, victim);
  }
  blink_grow(s, slot, num_tokens);
  return 1;
}

// Tokens of `slot` to prefill this step, 0 for none (Scheduler._prefill_chunk), when it has `computed` tokens
// in `held` blocks and may take `avail` more blocks.
BLINK_HD int32_t blink_prefill_chunk(const blink_sched* s, int32_t slot, int32_t budget, const int32_t* room,
                                     int32_t computed, int32_t held, int32_t avail) {
  int32_t q_len = s->num_tokens[slot] - computed;
  if (budget < q_len) q_len = budget;
  const int32_t fits = (held + avail) * s->h->cfg.block_size - computed;
  if (fits < q_len) q_len = fits;
  if (q_len > 0 && computed + q_len == s->num_tokens[slot] && room[slot] <= 0) return 0;
  return q_len > 0 ? q_len : 0;
}

// The prefill chunk of `slot` this step, and for a waiting one its admission over its cached blocks (the
// lookup runs each time a waiting sequence is considered; a speculation with hits taints the step).
BLINK_HD int32_t blink_prefill_admit(blink_sched* s, int32_t slot, int32_t budget, const int32_t* room) {
  blink_sched_header* h = s->h;
  const int waiting = s->status[slot] == BLINK_SEQ_WAITING;
  if (waiting && h->num_running >= h->cfg.max_num_seqs) return 0;
  int32_t idle = 0;
  const int32_t hits = waiting ? blink_cache_probe(s, slot, &idle) : 0;
  const int32_t computed = waiting ? hits * h->cfg.block_size : s->num_computed[slot];
  const int32_t held = waiting ? hits : s->num_table[slot];
  const int32_t q_len = blink_prefill_chunk(s, slot, budget, room, computed, held, blink_available(s) - idle);
  if (q_len == 0 || !waiting) return q_len;
  if (hits > 0 && h->spec_mode) {
    h->spec_tainted = 1;
    return 0;
  }
  blink_cache_take(s, slot, hits);
  return q_len;
}

BLINK_HD int32_t blink_decode_phase(blink_sched* s, const int32_t* room, int32_t* order, int32_t budget) {
  blink_sched_header* h = s->h;
  const int32_t n = h->num_running;
  for (int32_t i = 0; i < n; ++i) order[i] = s->running[i];  // a snapshot: preemption edits the list
  for (int32_t i = 0; i < n && budget > 0; ++i) {
    const int32_t slot = order[i];
    if (s->status[slot] != BLINK_SEQ_RUNNING || s->num_tokens[slot] - s->num_computed[slot] != 1 || room[slot] <= 0)
      continue;
    if (!blink_reserve(s, slot, s->num_computed[slot] + 1)) continue;
    blink_push_entry(s, slot, 1, 1);
    budget -= 1;
  }
  return budget;
}

BLINK_HD void blink_prefill_phase(blink_sched* s, const int32_t* room, int32_t* order, int32_t budget) {
  blink_sched_header* h = s->h;
  int32_t n = 0;
  for (int32_t i = 0; i < h->num_running; ++i) {
    const int32_t slot = s->running[i];
    if (s->num_tokens[slot] - s->num_computed[slot] > 1) order[n++] = slot;
  }
  for (int32_t i = 0; i < h->num_waiting; ++i) order[n++] = s->waiting[i];
  for (int32_t i = 0; i < n && budget > 0; ++i) {
    const int32_t slot = order[i];
    if (s->scheduled[slot] || s->status[slot] == BLINK_SEQ_FINISHED) continue;
    const int32_t q_len = blink_prefill_admit(s, slot, budget, room);
    if (q_len == 0) {
      if (s->status[slot] == BLINK_SEQ_WAITING) break;  // FCFS within strict priority: nobody overtakes a waiting head
      continue;
    }
    blink_grow(s, slot, s->num_computed[slot] + q_len);
    if (s->status[slot] == BLINK_SEQ_WAITING) {
      blink_remove(s->waiting, &h->num_waiting, slot);
      s->running[h->num_running++] = slot;
      s->status[slot] = BLINK_SEQ_RUNNING;
    }
    blink_push_entry(s, slot, q_len, s->num_computed[slot] + q_len == s->num_tokens[slot]);
    budget -= q_len;
  }
}

// Choose this step's entries (Scheduler.schedule). room[slot]: free space in the slot's output buffer.
// `order` is scratch of max_slots ints (shared memory on the device). Serial: one thread.
BLINK_HD void blink_schedule_pass(blink_sched* s, const int32_t* room, int32_t* order) {
  blink_sched_header* h = s->h;
  h->num_entries = 0;
  for (int32_t i = 0; i < h->cfg.max_slots; ++i) s->scheduled[i] = 0;
  blink_sort(s, s->running, h->num_running);
  blink_sort(s, s->waiting, h->num_waiting);
  const int32_t budget = blink_decode_phase(s, room, order, h->cfg.budget);
  blink_prefill_phase(s, room, order, budget);
}

// Liveness (as Scheduler.schedule): when a pass chose nothing and partial prefills hold every block, the
// latest, lowest-priority running sequence gives its blocks back and the step is chosen again.
BLINK_HD void blink_liveness(blink_sched* s, const int32_t* room, int32_t* order) {
  blink_sched_header* h = s->h;
  if (h->num_entries != 0 || blink_available(s) != 0) return;
  int32_t victim = -1, partial = 0;
  for (int32_t i = 0; i < h->num_running; ++i) {
    const int32_t v = s->running[i];
    if (s->num_tokens[v] - s->num_computed[v] > 1) partial = 1;
    if (victim < 0 || blink_before(s, victim, v)) victim = v;
  }
  if (partial && h->spec_mode) {
    h->spec_tainted = 1;
  } else if (partial) {
    blink_preempt(s, victim);
    blink_schedule_pass(s, room, order);
  }
}

BLINK_HD int32_t blink_sched_schedule(blink_sched* s, const int32_t* room, int32_t* order) {
  s->h->num_preempted = 0;
  blink_schedule_pass(s, room, order);
  blink_liveness(s, room, order);
  return s->h->num_entries;
}

// ---- the step buffer (step_buffers.StepBuffers / fill_step) -------------------------------------------------
// Byte offsets of the fields (T tokens, S sequences, MB blocks per sequence); returns the total bytes.
BLINK_HD uint64_t blink_step_layout(int32_t t, int32_t s, int32_t mb, uint64_t* offsets) {
  const uint64_t T = (uint64_t)t, S = (uint64_t)s, MB = (uint64_t)mb;  // the generated list counts in these
#define BLINK_STEP_BYTES(NAME, name, type, count) sizeof(type) * (count),
  const uint64_t bytes[BLINK_STEP_NUM_ARRAYS] = {BLINK_STEP_ARRAYS(BLINK_STEP_BYTES)};
#undef BLINK_STEP_BYTES
  uint64_t off = 0;
  for (int32_t f = 0; f < BLINK_STEP_NUM_ARRAYS; ++f) {
    off = blink_align8(off);
    offsets[f] = off;
    off += bytes[f];
  }
  return blink_align8(off);
}

BLINK_HD int32_t blink_bucket_for(const blink_sched_config* c, int32_t num_tokens) {
  for (int32_t i = 0; i < c->num_buckets; ++i)
    if (c->buckets[i] >= num_tokens) return c->buckets[i];
  return -1;  // the scheduler's budget never exceeds the largest bucket
}

#define BLINK_FIELD(buf, offs, f, type) ((type*)((buf) + (offs)[f]))

// Sampled row k's parameters, from sequence `slot`; returns whether the row samples greedily.
BLINK_HD int blink_fill_sample_row(const blink_sched* s, uint8_t* buf, const uint64_t* offs, int32_t k, int32_t slot) {
  BLINK_FIELD(buf, offs, BLINK_F_TEMPERATURE, float)[k] = s->temperature[slot];
  BLINK_FIELD(buf, offs, BLINK_F_TOP_K, int32_t)[k] = s->top_k[slot];
  BLINK_FIELD(buf, offs, BLINK_F_TOP_P, float)[k] = s->top_p[slot];
  BLINK_FIELD(buf, offs, BLINK_F_MIN_P, float)[k] = s->min_p[slot];
  BLINK_FIELD(buf, offs, BLINK_F_SEEDS, uint64_t)[k] = s->seed[slot];
  BLINK_FIELD(buf, offs, BLINK_F_SAMPLE_POS, int64_t)[k] = s->num_tokens[slot];
  return s->temperature[slot] <= 0.0f || s->top_k[slot] == 1;
}

// Serial part of filling the step buffer: q_start, ctx_lens, num_seqs, sample rows and parameters,
// the bucket. Returns the bucket; h->num_sampled and h->all_greedy say which graph to launch.
BLINK_HD int32_t blink_fill_prologue(blink_sched* s, uint8_t* buf) {
  blink_sched_header* h = s->h;
  const blink_sched_config* c = &h->cfg;
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  blink_step_layout(c->step_max_tokens, c->step_max_seqs, blink_max_blocks_per_seq(c), offs);
  int32_t* q_start = BLINK_FIELD(buf, offs, BLINK_F_Q_START, int32_t);
  int64_t* rows = BLINK_FIELD(buf, offs, BLINK_F_SAMPLE_ROWS, int64_t);
  int32_t n = 0, k = 0, greedy = 1;
  for (int32_t e = 0; e < h->num_entries; ++e) {
    const int32_t slot = s->entry_slot[e];
    s->entry_q_start[e] = q_start[e] = n;
    n += s->entry_q_len[e];
    BLINK_FIELD(buf, offs, BLINK_F_CTX_LENS, int32_t)[e] = s->entry_start[e] + s->entry_q_len[e];
    if (!s->entry_samples[e]) continue;
    rows[k] = n - 1;
    greedy = blink_fill_sample_row(s, buf, offs, k, slot) && greedy;
    ++k;
  }
  s->entry_q_start[h->num_entries] = n;
  const int32_t bucket = blink_bucket_for(c, n);
  const int32_t rows_in_graph = bucket < c->step_max_seqs ? bucket : c->step_max_seqs;
  for (int32_t e = h->num_entries; e <= rows_in_graph; ++e) q_start[e] = n;
  for (int32_t r = k; r < rows_in_graph; ++r) rows[r] = 0;
  *BLINK_FIELD(buf, offs, BLINK_F_NUM_SEQS, int32_t) = h->num_entries;
  h->bucket = bucket;
  h->num_tokens = n;
  h->num_sampled = k;
  h->all_greedy = greedy;
  return bucket;
}

BLINK_HD int32_t blink_entry_of_token(const blink_sched* s, int32_t i) {  // last e with q_start[e] <= i
  int32_t lo = 0, hi = s->h->num_entries - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (s->entry_q_start[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Parallel part: token rows [0, bucket) (padding: id 0, position 0, KV slot -1, seq id -1) and the
// block-table rows of the batch. Runs after blink_fill_prologue (a barrier between them on the device).
BLINK_HD void blink_fill_token_rows(const blink_sched* s, uint8_t* buf, int32_t tid, int32_t nthreads) {
  const blink_sched_header* h = s->h;
  const blink_sched_config* c = &h->cfg;
  const int32_t mb = blink_max_blocks_per_seq(c), bs = c->block_size;
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  blink_step_layout(c->step_max_tokens, c->step_max_seqs, mb, offs);
  for (int32_t i = tid; i < h->bucket; i += nthreads) {
    int32_t id = 0, seq_id = -1;
    int64_t pos = 0, kv = -1;
    if (i < h->num_tokens) {
      seq_id = blink_entry_of_token(s, i);
      const int32_t slot = s->entry_slot[seq_id];
      pos = s->entry_start[seq_id] + (i - s->entry_q_start[seq_id]);
      id = s->tokens[(int64_t)slot * c->context_len + pos];
      kv = (int64_t)s->block_table[(int64_t)slot * mb + pos / bs] * bs + pos % bs;
    }
    BLINK_FIELD(buf, offs, BLINK_F_INPUT_IDS, int32_t)[i] = id;
    BLINK_FIELD(buf, offs, BLINK_F_POSITIONS, int64_t)[i] = pos;
    BLINK_FIELD(buf, offs, BLINK_F_SLOT_MAPPING, int64_t)[i] = kv;
    BLINK_FIELD(buf, offs, BLINK_F_SEQ_IDS, int32_t)[i] = seq_id;
  }
}

// The batch's block-table rows (blink_sched_par.cuh has the loop kernel's version over valid cells only).
BLINK_HD void blink_fill_block_tables(const blink_sched* s, uint8_t* buf, int32_t tid, int32_t nthreads) {
  const blink_sched_header* h = s->h;
  const blink_sched_config* c = &h->cfg;
  const int32_t mb = blink_max_blocks_per_seq(c);
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  blink_step_layout(c->step_max_tokens, c->step_max_seqs, mb, offs);
  // the [entries, MB] rectangle, flattened, in runs of 8 cells per thread: the 8 loads are issued before
  // any store (a load may not pass a store to memory that could alias it), so a thread waits for one
  // memory latency per run instead of one per cell
  int32_t* tables = BLINK_FIELD(buf, offs, BLINK_F_BLOCK_TABLES, int32_t);
  const int32_t cells = h->num_entries * mb;
  for (int32_t base = tid * 8; base < cells; base += nthreads * 8) {
    int32_t value[8], cell[8];
    for (int32_t j = 0; j < 8; ++j) {
      const int32_t i = base + j, e = i / mb, b = i % mb;
      const int32_t slot = i < cells ? s->entry_slot[e] : 0;
      cell[j] = i < cells && b < s->num_table[slot] ? i : -1;
      value[j] = cell[j] >= 0 ? s->block_table[(int64_t)slot * mb + b] : 0;
    }
    for (int32_t j = 0; j < 8; ++j)
      if (cell[j] >= 0) tables[cell[j]] = value[j];
  }
}

BLINK_HD void blink_fill_tokens(const blink_sched* s, uint8_t* buf, int32_t tid, int32_t nthreads) {
  blink_fill_token_rows(s, buf, tid, nthreads);
  blink_fill_block_tables(s, buf, tid, nthreads);
}

// ---- after the model ran -------------------------------------------------------------------------------
// Whether `token` ends the sequence in `slot` by itself: an EOS id (unless ignored) or one of its stop ids.
BLINK_HD int blink_is_stop_token(const int32_t* eos_ids, int32_t num_eos, const int32_t* stop_ids, int32_t num_stop,
                                 int32_t ignore_eos, int32_t token) {
  int is_stop = 0;
  if (!ignore_eos)
    for (int32_t i = 0; i < num_eos; ++i) is_stop |= token == eos_ids[i];
  for (int32_t i = 0; i < num_stop; ++i) is_stop |= token == stop_ids[i];
  return is_stop;
}

BLINK_HD int32_t blink_stop_reason(const blink_sched* s, int32_t slot, int32_t token) {
  const blink_sched_config* c = &s->h->cfg;
  if (blink_is_stop_token(c->eos_ids, c->num_eos, s->stop_ids + (int64_t)slot * c->max_stop_ids, s->num_stop[slot],
                          s->ignore_eos[slot], token))
    return 1;  // FinishReason.STOP
  const int64_t generated = s->num_tokens[slot] - s->prompt_len[slot];
  if (generated + 1 >= s->max_tokens[slot] || s->num_tokens[slot] + 1 >= c->context_len) return 2;  // LENGTH
  return 0;
}

// The FinishReason a sampled `token` gives the sequence in `slot` (0: it goes on); BLINK_TOKEN_MASK_EMPTY
// (its token mask allowed nothing) ends it with ERROR (4; the engine reports INVALID_PARAMS).
BLINK_HD int32_t blink_token_reason(const blink_sched* s, int32_t slot, int32_t token) {
  return token == BLINK_TOKEN_MASK_EMPTY ? 4 : blink_stop_reason(s, slot, token);
}

// Apply a step's sampled tokens (one per sampling entry, in entry order), as Scheduler.update: tokens to
// publish go to new_slot/new_token (stop tokens are not published), finishes to fin_slot/fin_reason,
// with their blocks already free. Serial: one thread.
// BLINK_TOKEN_WAIT (a constrained row whose mask had not come) is no token: the sequence is not advanced,
// its last position runs again next step (writing the same KV), nothing is published.
// A STOPPING sequence (only the GPU loop's asynchronous take sets it; its finish is already published)
// keeps its row's place in the new list as -1 - slot with token 0, and is freed after the step's finishes,
// in slot order, wherever it is.
BLINK_HD void blink_sched_update(blink_sched* s, const int32_t* sampled) {
  blink_sched_header* h = s->h;
  const int64_t ctx = h->cfg.context_len;
  int32_t k = 0;
  h->num_new = h->num_finished = 0;
  for (int32_t e = 0; e < h->num_entries; ++e) {
    const int32_t slot = s->entry_slot[e];
    s->num_computed[slot] += s->entry_q_len[e];
    if (s->status[slot] != BLINK_SEQ_STOPPING) {  // its last row holds a token it will not keep
      blink_cache_extend(s, slot);
      blink_cache_publish(s, slot);
    }
    if (!s->entry_samples[e]) continue;
    const int32_t token = sampled[k++];
    if (s->status[slot] == BLINK_SEQ_STOPPING) {
      s->new_slot[h->num_new] = -1 - slot;
      s->new_token[h->num_new++] = 0;
      continue;
    }
    if (token == BLINK_TOKEN_WAIT) {
      s->num_computed[slot] -= 1;
      continue;
    }
    const int32_t reason = blink_token_reason(s, slot, token);
    if (reason != 1 && reason != 4) {
      s->tokens[slot * ctx + s->num_tokens[slot]++] = token;
      s->new_slot[h->num_new] = slot;
      s->new_token[h->num_new++] = token;
    }
    if (reason == 0) continue;
    blink_sched_finish(s, slot);
    s->fin_slot[h->num_finished] = slot;
    s->fin_reason[h->num_finished++] = reason;
  }
  for (int32_t slot = 0; slot < h->cfg.max_slots; ++slot)
    if (s->status[slot] == BLINK_SEQ_STOPPING) blink_sched_finish(s, slot);
}

#endif  // BLINK_SCHED_H
