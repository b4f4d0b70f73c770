// Lockstep check of blink_sched.h on the GPU against the same header on the host: one pseudo-random
// trace (arrivals, cancels, full output buffers, sampled tokens with EOS and stop ids, a pool small enough
// to preempt) applied to a device copy and a host copy of the state; after every step the whole state
// buffer and the step buffer must be equal byte for byte. The device runs what the loop kernel runs: the
// block-parallel schedule, fill and update of blink_sched_par.cuh over 256 threads; the host runs the
// serial functions of blink_sched.h. Two shapes: a small one that preempts often, and one with 300
// slots, so that the prefix sums span several warps and batches reach 256 sequences. Now and then a running
// sequence is marked STOPPING before an update (the loop's asynchronous take), in both copies. A third shape
// turns the prefix cache on: prompts often start with a shared document and carry a hash chain of their
// blocks, so that admissions hit cached blocks, blocks are published at updates and evicted when short.
// Built and run by tests/kernels/test_sched_device.py (marked gpu). Prints "OK <steps> ..." on success.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "blink_sched.h"
#include "blink_sched_par.cuh"

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); std::exit(2); } } while (0)

static const int kMaxPrompt = 40;
static int kSlots = 16;  // per shape
static int32_t kDoc[kMaxPrompt];  // the shared document of the caching shape

__device__ blink_sched bind_dev(uint8_t* mem) {
  blink_sched s;
  blink_sched_bind(&s, mem, &((blink_sched_header*)mem)->cfg);
  return s;
}

__global__ void k_add(uint8_t* mem, int32_t slot, const int32_t* prompt, int32_t len, int64_t max_tokens,
                      int64_t prio, const int32_t* stops, int32_t num_stop, int32_t ignore_eos, uint64_t seed,
                      const uint64_t* hashes, int32_t num_hashes) {
  blink_sched s = bind_dev(mem);
  blink_sched_add(&s, slot, prompt, len, max_tokens, prio, stops, num_stop, ignore_eos, 0.7f, 5, 0.9f, 0.0f, seed,
                  hashes, num_hashes);
}

// A chain over the prompt's full blocks (FNV-1a, never 0): equal prefixes, equal hashes (the gateway's role).
static int32_t chain_hashes(const int32_t* prompt, int32_t len, int32_t block_size, uint64_t* out) {
  uint64_t h = 1469598103934665603ull;
  const int32_t n = len / block_size;
  for (int32_t k = 0; k < n; ++k) {
    for (int32_t i = 0; i < block_size; ++i) h = (h ^ (uint32_t)prompt[k * block_size + i]) * 1099511628211ull;
    out[k] = h ? h : 1;
  }
  return n;
}

__global__ void k_finish(uint8_t* mem, int32_t slot) {
  blink_sched s = bind_dev(mem);
  blink_sched_finish(&s, slot);
}

__global__ void k_step(uint8_t* mem, uint8_t* buf, const int32_t* room, int32_t* order, int32_t* scratch) {
  blink_sched s = bind_dev(mem);
  if (blink_sched_schedule_par(&s, room, order, scratch)) {
    blink_fill_prologue_par(&s, buf, scratch);
    blink_fill_token_rows(&s, buf, threadIdx.x, blockDim.x);
    blink_fill_block_tables_par(&s, buf, scratch);
  }
}

__global__ void k_update(uint8_t* mem, const int32_t* sampled, int32_t* scratch, int32_t* dropped) {
  blink_sched s = bind_dev(mem);
  const int32_t n = blink_sched_update_par(&s, sampled, scratch);
  if (threadIdx.x == 0) *dropped = n;
}

__global__ void k_stopping(uint8_t* mem, int32_t slot) {
  blink_sched s = bind_dev(mem);
  s.status[slot] = BLINK_SEQ_STOPPING;
}

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {  // xorshift64
  rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state % n);
}

struct Pair {
  blink_sched host;
  std::vector<uint64_t> host_mem, host_buf;
  uint8_t *dev_mem, *dev_buf;
  int32_t* dev_args;  // scratch for prompts, rooms, sampled tokens
  int32_t *dev_order, *dev_scratch;
  size_t mem_bytes, buf_bytes;
};

static void compare(Pair& p, int step, const char* what) {
  std::vector<uint8_t> m(p.mem_bytes), b(p.buf_bytes);
  CHECK(cudaMemcpy(m.data(), p.dev_mem, p.mem_bytes, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(b.data(), p.dev_buf, p.buf_bytes, cudaMemcpyDeviceToHost));
  if (std::memcmp(m.data(), p.host_mem.data(), p.mem_bytes) || std::memcmp(b.data(), p.host_buf.data(), p.buf_bytes)) {
    std::printf("MISMATCH at step %d after %s\n", step, what);
    std::exit(1);
  }
}

static void run(const blink_sched_config& c, int num_steps, int arrival_odds);

int main(int argc, char** argv) {
  const int num_steps = argc > 1 ? std::atoi(argv[1]) : 20000;
  blink_sched_config c = {};
  c.max_slots = 16; c.num_blocks = 12; c.block_size = 2; c.context_len = 48; c.budget = 16;
  c.max_num_seqs = 6; c.max_stop_ids = 2; c.num_eos = 1; c.eos_ids[0] = 0;
  c.step_max_tokens = 16; c.step_max_seqs = 8; c.num_buckets = 5; c.hash_slots = 1;
  for (int i = 0; i < 5; ++i) c.buckets[i] = 1 << i;
  run(c, num_steps, 3);
  blink_sched_config big = c;  // many sequences: scans over several warps, blocks short now and then
  big.max_slots = 300; big.num_blocks = 1400; big.budget = 512; big.max_num_seqs = 256;
  big.step_max_tokens = 512; big.step_max_seqs = 256; big.num_buckets = 10;
  for (int i = 0; i < 10; ++i) big.buckets[i] = 1 << i;
  run(big, num_steps / 4, 1);
  blink_sched_config cached = c;  // the prefix cache: hits, publication, eviction
  cached.num_blocks = 24; cached.prefix_caching = 1; cached.hash_slots = 64;
  for (int i = 0; i < kMaxPrompt; ++i) kDoc[i] = 2 + rnd(50);
  run(cached, num_steps, 2);
  return 0;
}

static void run(const blink_sched_config& c, int num_steps, int arrival_odds) {
  kSlots = c.max_slots;
  Pair p;
  p.mem_bytes = blink_sched_bind(&p.host, 0, &c);
  uint64_t offs[BLINK_STEP_NUM_ARRAYS];
  p.buf_bytes = blink_step_layout(c.step_max_tokens, c.step_max_seqs, blink_max_blocks_per_seq(&c), offs);
  p.host_mem.assign(p.mem_bytes / 8, 0);
  p.host_buf.assign(p.buf_bytes / 8, 0);
  blink_sched_bind(&p.host, p.host_mem.data(), &c);
  blink_sched_init(&p.host, &c);
  CHECK(cudaMalloc(&p.dev_mem, p.mem_bytes));
  CHECK(cudaMalloc(&p.dev_buf, p.buf_bytes));
  CHECK(cudaMalloc(&p.dev_args, 4 * (kSlots + kMaxPrompt + 2)));
  int32_t* dev_dropped = nullptr;
  CHECK(cudaMalloc(&dev_dropped, 4));
  uint64_t hashes[kMaxPrompt], *dev_hashes = nullptr;
  CHECK(cudaMalloc(&dev_hashes, 8 * kMaxPrompt));
  CHECK(cudaMalloc(&p.dev_order, 4 * kSlots));
  CHECK(cudaMalloc(&p.dev_scratch, 4 * 5 * kSlots));
  CHECK(cudaMemcpy(p.dev_mem, p.host_mem.data(), p.mem_bytes, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(p.dev_buf, 0, p.buf_bytes));
  long entries = 0, preemptions = 0, finishes = 0, stopping = 0;
  std::vector<int32_t> arg_store(kSlots + kMaxPrompt + 2);
  int32_t* args = arg_store.data();
  for (int step = 0; step < num_steps; ++step) {
    for (int arrivals = rnd(arrival_odds == 1 ? 16 : 1) + (arrival_odds == 1 || rnd(arrival_odds) == 0);
         arrivals > 0; --arrivals) {  // arrivals, each in the first free slot
      int32_t slot = -1, len = 1 + rnd(kMaxPrompt), stops[2] = {(int32_t)(2 + rnd(50)), (int32_t)(2 + rnd(50))};
      const int64_t max_tokens = 1 + rnd(20);
      for (int32_t i = 0; i < kSlots && slot < 0; ++i) if (p.host.status[i] == BLINK_SEQ_FINISHED) slot = i;
      if (slot >= 0 && blink_sched_check(&p.host, len, max_tokens, 0.7, 0.9, 5, 0.0) == BLINK_ERR_NONE) {
        const int32_t shared = c.prefix_caching && rnd(3) ? rnd(len + 1) : 0;  // a prefix of the document
        for (int i = 0; i < len; ++i) args[i] = i < shared ? kDoc[i] : 2 + rnd(50);
        const int32_t num_hashes = c.prefix_caching ? chain_hashes(args, len, c.block_size, hashes) : 0;
        CHECK(cudaMemcpy(dev_hashes, hashes, 8 * kMaxPrompt, cudaMemcpyHostToDevice));
        args[kMaxPrompt] = stops[0]; args[kMaxPrompt + 1] = stops[1];
        const int32_t num_stop = rnd(3), ignore_eos = rnd(5) == 0;
        const int64_t prio = rnd(3);
        const uint64_t seed = rng_state;
        blink_sched_add(&p.host, slot, args, len, max_tokens, prio, stops, num_stop, ignore_eos, 0.7f, 5, 0.9f, 0.0f, seed,
                        hashes, num_hashes);
        CHECK(cudaMemcpy(p.dev_args, args, 4 * (kMaxPrompt + 2), cudaMemcpyHostToDevice));
        k_add<<<1, 1>>>(p.dev_mem, slot, p.dev_args, len, max_tokens, prio, p.dev_args + kMaxPrompt, num_stop,
                        ignore_eos, seed, dev_hashes, num_hashes);
      }
    }
    if (rnd(25) == 0) {  // a cancel
      const int32_t slot = rnd(kSlots);
      if (p.host.status[slot] != BLINK_SEQ_FINISHED) {
        blink_sched_finish(&p.host, slot);
        k_finish<<<1, 1>>>(p.dev_mem, slot);
        ++finishes;
      }
    }
    for (int i = 0; i < kSlots; ++i) args[i] = rnd(7) == 0 ? 0 : 1 + rnd(50);
    CHECK(cudaMemcpy(p.dev_args, args, 4 * kSlots, cudaMemcpyHostToDevice));
    std::vector<int32_t> scratch(kSlots);
    blink_sched_schedule(&p.host, args, scratch.data());
    if (p.host.h->num_entries) {
      blink_fill_prologue(&p.host, (uint8_t*)p.host_buf.data());
      blink_fill_tokens(&p.host, (uint8_t*)p.host_buf.data(), 0, 1);
    }
    k_step<<<1, 256>>>(p.dev_mem, p.dev_buf, p.dev_args, p.dev_order, p.dev_scratch);
    CHECK(cudaGetLastError());
    compare(p, step, "schedule + fill");
    entries += p.host.h->num_entries;
    preemptions += p.host.h->num_preempted;
    int marked = 0;  // STOPPING: running sequences, in this step's batch or not
    for (int tries = rnd(4) == 0 ? 1 + rnd(3) : 0; tries > 0; --tries) {
      const int32_t slot = rnd(kSlots);
      if (p.host.status[slot] != BLINK_SEQ_RUNNING) continue;
      p.host.status[slot] = BLINK_SEQ_STOPPING;
      k_stopping<<<1, 1>>>(p.dev_mem, slot);
      ++marked;
    }
    for (int i = 0; i < p.host.h->num_sampled; ++i) args[i] = rnd(12) == 0 ? 0 : 2 + rnd(50);
    CHECK(cudaMemcpy(p.dev_args, args, 4 * kSlots, cudaMemcpyHostToDevice));
    int32_t want_dropped = 0, got_dropped = 0;
    blink_sched_update(&p.host, args);
    for (int i = 0; i < p.host.h->num_new; ++i) want_dropped += p.host.new_slot[i] < 0;
    k_update<<<1, 256>>>(p.dev_mem, p.dev_args, p.dev_scratch, dev_dropped);
    CHECK(cudaMemcpy(&got_dropped, dev_dropped, 4, cudaMemcpyDeviceToHost));
    compare(p, step, "update");
    if (got_dropped != want_dropped) {
      std::printf("MISMATCH at step %d: %d dropped rows, %d expected\n", step, got_dropped, want_dropped);
      std::exit(1);
    }
    stopping += marked;
    finishes += p.host.h->num_finished;
  }
  std::printf("OK %d slots: %d steps, %ld entries, %ld preemptions, %ld finishes, %ld stopping, %d blocks free of %d, "
              "%lld of %lld tokens cached\n", kSlots, num_steps, entries, preemptions, finishes, stopping,
              p.host.h->num_free, c.num_blocks, (long long)p.host.h->prefix_hits, (long long)p.host.h->prefix_queries);
  CHECK(cudaFree(p.dev_mem)); CHECK(cudaFree(p.dev_buf)); CHECK(cudaFree(p.dev_args));
  CHECK(cudaFree(p.dev_order)); CHECK(cudaFree(p.dev_scratch)); CHECK(cudaFree(dev_dropped)); CHECK(cudaFree(dev_hashes));
}
