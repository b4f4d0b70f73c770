// The scheduler's KV blocks with a prefix cache (included by blink_sched.h; host and device builds).
// Same rules, same block ids as tests/gpu_backend/reference_scheduler.py (BlockManager).
//
// A block is free (on the FIFO free list), held (block_ref > 0 sequences have it in their tables) or
// evictable (no holder, but it keeps a published hash: on the LRU list). A block gets its hash when the
// sequence that computed it has it full: the request's own hash of that block (the gateway hashes the prompt),
// or, past those, the chain extended over the sequence's tokens with the gateway's function
// (blink_block_hash.h), so that decode blocks are published too and the next turn of a conversation finds
// its answer; a later request with the same hash chain takes the block instead of computing it.
// Allocation takes a free block first, else evicts the least recently used evictable one (its hash goes).
// A hashed block is never given another hash while referenced: only evictable blocks are evicted.
// Free and evictable blocks both count as available. With cfg.prefix_caching == 0 no block ever gets a
// hash, so the evictable list stays empty and every decision is the cache-less scheduler's.
//
// The GPU loop's speculation (spec_mode) works on a copy of the hot state over the shared cold arrays: a
// cache change there (a cached admission, an eviction, dropping a shared or hashed block) would outlive a
// dropped speculation, so it taints the step instead (the loop schedules it again from the real state).
// Publishing is allowed there: it depends only on what the step computed, so the real state's update, when
// the speculation is dropped, publishes the same blocks again and finds them already in the table.
#ifndef BLINK_PREFIX_CACHE_H
#define BLINK_PREFIX_CACHE_H

#include "blink_block_hash.h"

// ---- hash -> block: open addressing, linear probing, deletion by backward shift (no tombstones) ----------
BLINK_HD uint32_t blink_hash_home(const blink_sched* s, uint64_t hash) {
  hash ^= hash >> 33;  // the gateway's hashes are uniform; mixing keeps a crafted set from one long run
  hash *= 0xff51afd7ed558ccdULL;
  hash ^= hash >> 33;
  return (uint32_t)(hash & (uint64_t)(s->h->cfg.hash_slots - 1));
}

// The block holding `hash`, or -1. At most num_blocks cells are used of hash_slots > num_blocks: a probe
// always meets an empty cell.
BLINK_HD int32_t blink_cache_find(const blink_sched* s, uint64_t hash) {
  const uint32_t mask = (uint32_t)s->h->cfg.hash_slots - 1;
  for (uint32_t i = blink_hash_home(s, hash);; i = (i + 1) & mask) {
    const int32_t b = s->hash_table[i];
    if (b < 0) return -1;
    if (s->block_hash[b] == hash) return b;
  }
}

BLINK_HD void blink_cache_insert(blink_sched* s, int32_t block, uint64_t hash) {
  const uint32_t mask = (uint32_t)s->h->cfg.hash_slots - 1;
  uint32_t i = blink_hash_home(s, hash);
  while (s->hash_table[i] >= 0) i = (i + 1) & mask;
  s->hash_table[i] = block;
  s->block_hash[block] = hash;
  s->h->num_cached += 1;
}

BLINK_HD void blink_cache_erase(blink_sched* s, int32_t block) {
  const uint32_t mask = (uint32_t)s->h->cfg.hash_slots - 1;
  uint32_t hole = blink_hash_home(s, s->block_hash[block]);
  while (s->hash_table[hole] != block) hole = (hole + 1) & mask;
  for (uint32_t j = (hole + 1) & mask; s->hash_table[j] >= 0; j = (j + 1) & mask) {
    const int32_t b = s->hash_table[j];
    const uint32_t home = blink_hash_home(s, s->block_hash[b]);
    if (((j - home) & mask) >= ((j - hole) & mask)) {  // the hole lies on b's probe path: b moves into it
      s->hash_table[hole] = b;
      hole = j;
    }
  }
  s->hash_table[hole] = -1;
  s->block_hash[block] = 0;
  s->h->num_cached -= 1;
}

// ---- the evictable blocks, least recently used first -------------------------------------------------------
BLINK_HD void blink_lru_push(blink_sched* s, int32_t b) {
  blink_sched_header* h = s->h;
  s->lru_prev[b] = h->lru_tail;
  s->lru_next[b] = -1;
  if (h->lru_tail >= 0) s->lru_next[h->lru_tail] = b; else h->lru_head = b;
  h->lru_tail = b;
  h->num_evictable += 1;
}

BLINK_HD void blink_lru_remove(blink_sched* s, int32_t b) {
  blink_sched_header* h = s->h;
  const int32_t prev = s->lru_prev[b], next = s->lru_next[b];
  if (prev >= 0) s->lru_next[prev] = next; else h->lru_head = next;
  if (next >= 0) s->lru_prev[next] = prev; else h->lru_tail = prev;
  h->num_evictable -= 1;
}

// ---- blocks ------------------------------------------------------------------------------------------------
BLINK_HD int32_t blink_available(const blink_sched* s) { return s->h->num_free + s->h->num_evictable; }

// One block for a sequence (the caller checked blink_available): the oldest free one, else the least
// recently used evictable one, whose hash goes.
BLINK_HD int32_t blink_take_block(blink_sched* s) {
  blink_sched_header* h = s->h;
  int32_t b;
  if (h->num_free > 0) {
    b = s->free_blocks[h->free_head];
    h->free_head = (h->free_head + 1) % h->cfg.num_blocks;
    h->num_free -= 1;
  } else {
    b = h->lru_head;
    blink_lru_remove(s, b);
    blink_cache_erase(s, b);
  }
  s->block_ref[b] = 1;  // set, not incremented: a dropped speculation's stale count does not matter
  return b;
}

// A holder lets go: the last one puts a hashed block on the evictable list, any other on the free list.
// (A private block a dropped speculation let go of is let go of again by the real state: its count stays 0.)
BLINK_HD void blink_drop_block(blink_sched* s, int32_t b) {
  blink_sched_header* h = s->h;
  if (s->block_ref[b] > 0) s->block_ref[b] -= 1;
  if (s->block_ref[b] > 0) return;
  if (s->block_hash[b]) {
    blink_lru_push(s, b);
  } else {
    s->free_blocks[(h->free_head + h->num_free) % h->cfg.num_blocks] = b;
    h->num_free += 1;
  }
}

// ---- lookup and publication -----------------------------------------------------------------------------
// Leading prompt blocks of waiting `slot` found cached, at most (num_tokens - 1) / block_size of them so that
// at least one token is computed (a fully cached, block-aligned prompt recomputes its last block, as vLLM
// does). Their ids go to the slot's (empty) block table row as scratch; *idle gets how many of them are
// evictable now (taking them makes them unavailable). A hash met twice ends the run (a chain never repeats;
// a crafted one must not count one evictable block twice): block_mark flags the blocks met so far, and is
// all zero again when the call returns. It is cold memory, shared by the loop's speculation and its real
// state: a mark left behind by a dropped speculation (which works on a copy of the hot header) would read as
// a repeat to the full step that schedules again, and hide the cached prefix from it. No state changes.
BLINK_HD int32_t blink_cache_probe(blink_sched* s, int32_t slot, int32_t* idle) {
  blink_sched_header* h = s->h;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg);
  int32_t limit = (s->num_tokens[slot] - 1) / h->cfg.block_size, hits = 0;
  if (limit > s->num_hashes[slot]) limit = s->num_hashes[slot];
  *idle = 0;
  if (!h->cfg.prefix_caching || limit <= 0) return 0;
  int32_t* row = s->block_table + (int64_t)slot * mb;
  for (; hits < limit; ++hits) {
    const int32_t b = blink_cache_find(s, s->seq_hashes[(int64_t)slot * mb + hits]);
    if (b < 0 || s->block_mark[b]) break;
    s->block_mark[b] = 1;
    row[hits] = b;
    *idle += s->block_ref[b] == 0;
  }
  for (int32_t k = 0; k < hits; ++k) s->block_mark[row[k]] = 0;
  return hits;
}

// Admit `slot` over the `hits` blocks blink_cache_probe found: take references, skip their tokens.
BLINK_HD void blink_cache_take(blink_sched* s, int32_t slot, int32_t hits) {
  blink_sched_header* h = s->h;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg), bs = h->cfg.block_size;
  for (int32_t k = 0; k < hits; ++k) {
    const int32_t b = s->block_table[(int64_t)slot * mb + k];
    if (s->block_ref[b]++ == 0) blink_lru_remove(s, b);
  }
  s->num_table[slot] = s->num_published[slot] = hits;
  s->num_computed[slot] = hits * bs;
  if (s->num_preemptions[slot] == 0) s->cached_tokens[slot] = hits * bs;
  if (h->cfg.prefix_caching) {
    h->prefix_queries += s->num_tokens[slot];
    h->prefix_hits += (int64_t)hits * bs;
  }
}

// Extend `slot`'s hash chain over the blocks its tokens now fill in full past the request's hashes (none
// without a first hash: the chain's seed, model and salt, is the gateway's). Touches only the slot's row, so
// the loop runs it for every entry at once.
BLINK_HD void blink_cache_extend(blink_sched* s, int32_t slot) {
  const blink_sched_config* c = &s->h->cfg;
  const int32_t n = s->num_hashes[slot], full = s->num_computed[slot] / c->block_size;
  if (!c->prefix_caching || n == 0 || full <= n) return;
  uint64_t* hashes = s->seq_hashes + (int64_t)slot * blink_max_blocks_per_seq(c);
  const int32_t* tokens = s->tokens + (int64_t)slot * c->context_len;
  for (int32_t k = n; k < full; ++k) hashes[k] = blink_block_hash(hashes[k - 1], tokens + k * c->block_size, c->block_size);
  s->num_hashes[slot] = full;
}

// Publish `slot`'s hashed blocks that are now computed in full (in table order). A hash already held by
// another block stays with that one; this block then stays private and is freed, not cached. A block that
// already holds its hash was published by a dropped speculation: it is counted again (the count was dropped).
BLINK_HD void blink_cache_publish(blink_sched* s, int32_t slot) {
  blink_sched_header* h = s->h;
  const int32_t mb = blink_max_blocks_per_seq(&h->cfg);
  int32_t full = s->num_computed[slot] / h->cfg.block_size;
  if (full > s->num_hashes[slot]) full = s->num_hashes[slot];
  for (int32_t k = s->num_published[slot]; k < full; ++k) {
    const uint64_t hash = s->seq_hashes[(int64_t)slot * mb + k];
    const int32_t b = s->block_table[(int64_t)slot * mb + k];
    if (!hash) continue;
    if (s->block_hash[b] == hash) h->num_cached += 1;
    else if (!s->block_hash[b] && blink_cache_find(s, hash) < 0) blink_cache_insert(s, b, hash);
  }
  if (full > s->num_published[slot]) s->num_published[slot] = full;
}

#endif  // BLINK_PREFIX_CACHE_H
