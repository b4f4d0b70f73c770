// The GPU-resident loop: a chain of CUDA graphs that launch each other on the GPU (device graph launch), started
// once by the host, that serves the ring with no host CPU per token. Each graph ends by tail-launching the
// next one (it starts when the running graph has ended):
//
//   full step graph   blink_loop_step: apply the sampled tokens, admit new requests from the ring, honour
//                     cancels, choose the next step and fill its step buffer (blink_sched.h, with the
//                     block-parallel parts of blink_sched_par.cuh) -- or, with nothing to run, spin (one
//                     block) until work comes. Then it launches that step's bucket graph.
//   bucket graph      branch 2 * (b * num_buckets + i) + greedy: bucket i over step buffer b, captured by
//                     PyTorch (a child graph), and beside it:
//       publish kernel  the committed tokens and finishes to the response areas, with the ring's fences,
//       -> spec kernel  step n+1 scheduled while step n runs: the state copied (the per-slot arrays; the large
//                       ones are shared, written only where the real state does not look), step n's tokens
//                       applied as placeholders, the ring polled and admitted (errors and cancels deferred),
//                       the step chosen and filled into the other step buffer
//     and after the graph's logits (beside its sampler):
//       take kernel     waits for the spec kernel; when nothing new is queued since it looked, launches the
//                       next bucket graph at once, before the tokens (else the full step); then waits for the
//                       sampled tokens and takes the speculation: writes them where it left placeholders
//                       (a few stores). A token that stops its sequence is not published; its finish is
//                       added to the speculated step's list, and that step computes the sequence's row,
//                       which the next update drops (status STOPPING), freeing the sequence.
// So between two bucket graphs there is only the take kernel's last stores and the start of a graph launched
// beforehand, not the scheduler nor the launch call. A step that would preempt, or finds new requests queued
// after the speculation looked, takes the full path: the serial scheduler's decisions on the real state.
// (BLINK_LOOP_ASYNC=0, for measuring: the take waits for the tokens and a stop token also takes the full path.)
// The loop ends when a graph launches nothing (shutdown) and the host sees its stream end.
// Why device graph launch and not a WHILE node over SWITCH/IF nodes (the earlier loop): the gap it leaves
// between two graphs, measured by bench/loop_mechanism.cu (DESIGN.md "The GPU-resident loop").
// The kernels keep the scheduler's hot state (header, per-slot scalars, lists) in shared memory for
// their serial parts: one thread walking global memory pays a cache miss per load.
//
// The ring lives in host memory (the shm transport's file), registered with cudaHostRegister: the loop reads
// it over PCIe with volatile loads (L1 would keep stale lines across slot reuse) and a system fence before
// it reads what a submission tail covers, and writes it
// with the ring's order: payload first, the validating word last with a release store at system scope.
// Scheduling state, the step buffers and the sampled tokens stay in device memory. The host thread only sets
// `ctl->stop` (pinned, mapped) and watches the stream; gpu_backend/engine/persistent.py drives this file.
// Built with -rdc=true and the device runtime (cudadevrt) for the device-side cudaGraphLaunch.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blink_graph_measure.cuh"
#include "blink_loop.cuh"  // and blink_loop_ext.cuh
#include "blink_loop_spec.cuh"
#include "blink_sched_par.cuh"

// ---- the full step's graph, and the kernels beside each bucket graph -------------------------------------------
// Runs when blink_loop_take did not take the speculation: commits the last step's tokens to the scheduler,
// takes new requests and cancels, chooses and fills the next step and picks its graph. With nothing to run
// it publishes what is pending itself, then polls (one block, short sleeps, a heartbeat every millisecond).
__global__ void __launch_bounds__(BLINK_LOOP_THREADS) blink_loop_step(blink_loop_args* a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ blink_sched s;
  const uint64_t t0 = now_ns();
  ring_look look;
  look_issue(a, look);
  const uint32_t cur = a->cur, next_buf = 1u - a->buf;
  uint8_t* hot = hot_of(a, cur);
  loop_scratch x;
  open_state(a, &s, &x, smem, hot, hot);
  blink_sched_header* h = s.h;
  if (h->num_entries > 0) {  // the step that just ran: its tokens into the scheduler (published below)
    for (int32_t i = threadIdx.x; i < h->num_sampled; i += blockDim.x) a->sampled32[i] = (int32_t)a->sampled[i];
    const int32_t rows = (int32_t)graph_rows(h);  // read: back to -1 for blink_loop_take (same thread, same row)
    for (int32_t i = threadIdx.x; i < rows; i += blockDim.x) a->sampled[i] = -1;
    __syncthreads();
    const int32_t dropped = blink_sched_update_par(&s, a->sampled32, x.par);
    if (threadIdx.x == 0) {
      h->num_entries = 0;
      ext_commit(a);
      count_step(a, t0, h->num_new - dropped);
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
      ext_fill(a, &s, buf, next_buf);
      if (threadIdx.x == 0) {
        run_next(a, ext_branch(a, branch_of(h, bucket, next_buf), next_buf));
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
    if (a->ready_ns) {  // launched with the bucket graph of the step after a taken speculation: the gap
      a->c.gap_ns += now_ns() - a->ready_ns;
      a->c.gap_steps += 1;
      a->ready_ns = 0;
    }
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

__global__ void read_globaltimer(uint64_t* out) { *out = now_ns(); }

// For measuring (BLINK_LOOP_STAMPS=1, bench/loop_ab.py --stamps): where in a step the loop's graph runs slower
// than the same graph replayed bare. One-thread kernels after the model graph's nodes at fractions 0, 1/7 .. 1
// of its nodes (capture order) sum, over the steps of one bucket, the time from point 0 to each point.
#define BLINK_STAMP_POINTS 8
__device__ unsigned long long g_stamp_sum[BLINK_STAMP_POINTS], g_stamp_count[BLINK_STAMP_POINTS], g_stamp_t0;
__device__ int32_t g_stamp_bucket = -1;  // only the graphs of this bucket count (-1: none)
__device__ unsigned long long g_stamp_khz_sum, g_stamp_khz_count;  // the SM clock, sampled at point 0

__global__ void bench_stamp(uint32_t point, int32_t bucket) {
  if (bucket != *(volatile int32_t*)&g_stamp_bucket) return;
  const unsigned long long t = now_ns();
  if (point == 0) {
    g_stamp_t0 = t;
    const long long c0 = clock64();  // this SM's clock over 2 us of %globaltimer (32 ns ticks)
    unsigned long long t1;
    do t1 = now_ns(); while (t1 - t < 2000);
    atomicAdd(&g_stamp_khz_sum, (unsigned long long)(clock64() - c0) * 1000000ull / (t1 - t));
    atomicAdd(&g_stamp_khz_count, 1ull);
    return;
  }
  const unsigned long long t0 = *(volatile unsigned long long*)&g_stamp_t0;
  if (t0 == 0 || t < t0) return;  // counting began in this step after its point 0
  atomicAdd(&g_stamp_sum[point], t - t0);
  atomicAdd(&g_stamp_count[point], 1ull);
}

// For measuring (BLINK_LOOP_SPINNER_NS, bench/loop_ab.py): one block that holds an SM for `ns` beside the graph.
__global__ void bench_spinner(uint64_t ns) {
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < ns) __nanosleep(200);
}

// For measuring (bench/gpu_host.py): the loop's mechanism with no scheduling in it (the graph relaunches
// itself until `left` runs out).
__global__ void bench_countdown(uint32_t* left) {
  if (--*left != 0) cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
}

// ---- host side: build, launch, watch ----------------------------------------------------------------------
struct blink_loop {
  cudaGraph_t graph;                 // the full step's graph
  cudaGraphExec_t exec;
  uint32_t num_branches;
  cudaGraph_t* graphs;               // [num_branches] the bucket graphs with their publish, spec and take kernels
  cudaGraphExec_t* execs;
  cudaGraphExec_t* dev_execs;        // the same handles in device memory (blink_loop_args.branch_execs)
  cudaStream_t stream;
  blink_loop_args* dev_args;
  uint32_t smem_bytes;  // the step kernel's dynamic shared memory (0: its state stays in global memory)
  uint32_t take_linked; // branches whose take kernel starts after the graph's logits (else with the graph)
  void* owned[4];       // the speculation's buffers (hot_alt, rows, err_slot, err_code)
};

// In `g` (one stream's capture, whose nodes come in capture order), the node captured just before its
// last `tail` nodes, if one of those depends on it; else nullptr. Only a start signal: what starts there
// waits for its data itself.
static cudaGraphNode_t node_before_tail(cudaGraph_t g, size_t tail) {
  size_t n = 0;
  if (cudaGraphGetNodes(g, nullptr, &n) != cudaSuccess || n <= tail) return nullptr;
  cudaGraphNode_t* nodes = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * n);
  cudaGraphNode_t found = nullptr;
  size_t count = 0;
  if (cudaGraphGetNodes(g, nodes, &n) == cudaSuccess &&
      cudaGraphNodeGetDependentNodes(nodes[n - tail - 1], nullptr, nullptr, &count) == cudaSuccess && count) {
    cudaGraphNode_t* next = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * count);
    if (cudaGraphNodeGetDependentNodes(nodes[n - tail - 1], next, nullptr, &count) == cudaSuccess)
      for (size_t j = 0; j < count && !found; ++j)
        for (size_t i = n - tail; i < n && !found; ++i)
          if (next[j] == nodes[i]) found = nodes[n - tail - 1];
    free(next);
  }
  free(nodes);
  return found;
}

// A kernel node of one block of `threads` threads running `func(args)`, after `deps` (the measuring kernels'
// and the mechanism's replay).
static cudaError_t add_one_block(cudaGraphNode_t* out, cudaGraph_t g, const cudaGraphNode_t* deps, size_t num_deps,
                                 void* func, void** args, unsigned threads) {
  cudaKernelNodeParams k = {};
  k.gridDim = dim3(1);
  k.blockDim = dim3(threads);
  k.kernelParams = args;
  k.func = func;
  return cudaGraphAddKernelNode(out, g, deps, num_deps, &k);
}

// 2 n node handles and n edge records (the caller frees both), or neither (false).
static bool alloc_lists(size_t n, cudaGraphNode_t** nodes, cudaGraphEdgeData** edges) {
  *nodes = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * 2 * n);
  *edges = (cudaGraphEdgeData*)malloc(sizeof(cudaGraphEdgeData) * n);
  if (*nodes && *edges) return true;
  free(*nodes);
  free(*edges);
  return false;
}

// The stamp kernels (bench_stamp) after the first `model_nodes` nodes of `child`'s graph (the captured ones,
// before anything the loop added), for `bucket`. Each goes into the chain: between its node and that node's
// dependents (a leaf may be started late; in the chain each adds a kernel boundary to the step, the same in
// the loop's graphs and in the bare replay it is compared with).
static cudaError_t add_stamps(cudaGraphNode_t child, int32_t bucket, size_t model_nodes) {
  cudaGraph_t g;
  size_t n = 0;
  cudaError_t err = cudaGraphChildGraphNodeGetGraph(child, &g);
  if (err == cudaSuccess) err = cudaGraphGetNodes(g, nullptr, &n);
  if (err != cudaSuccess || n == 0 || model_nodes == 0 || model_nodes > n) return err;
  cudaGraphNode_t* nodes;
  cudaGraphEdgeData* edges;
  if (!alloc_lists(n, &nodes, &edges)) return cudaErrorMemoryAllocation;
  cudaGraphNode_t* after = nodes + n;  // a node's dependents (at most n)
  err = cudaGraphGetNodes(g, nodes, &n);
  for (uint32_t point = 0; point < BLINK_STAMP_POINTS && err == cudaSuccess; ++point) {
    void* args[] = {&point, &bucket};
    // the node at that fraction, or the first after it whose outgoing edges are all plain ones (a stamp in a
    // programmatic edge would take away the overlap it gives)
    size_t i = (size_t)((double)point / (BLINK_STAMP_POINTS - 1) * (double)(model_nodes - 1)), count = 0;
    for (; i < model_nodes && err == cudaSuccess; ++i) {
      count = n;
      err = cudaGraphNodeGetDependentNodes(nodes[i], after, edges, &count);
      bool plain = true;
      for (size_t j = 0; j < count; ++j) plain = plain && edges[j].type == cudaGraphDependencyTypeDefault;
      if (plain) break;
    }
    if (err != cudaSuccess || i == model_nodes) break;
    cudaGraphNode_t stamp, at = nodes[i];
    for (size_t j = 0; j < count && err == cudaSuccess; ++j)
      err = cudaGraphRemoveDependencies(g, &at, &after[j], &edges[j], 1);
    if (err == cudaSuccess) err = add_one_block(&stamp, g, &at, 1, (void*)bench_stamp, args, 1);
    for (size_t j = 0; j < count && err == cudaSuccess; ++j)
      err = cudaGraphAddDependencies(g, &stamp, &after[j], &edges[j], 1);
  }
  free(nodes);
  free(edges);
  return err;
}


// The switches read at build time, all for measuring (bench/loop_ab.py): BLINK_LOOP_SPEC_TAIL_CHECK=0,
// BLINK_LOOP_SPEC_PRIORITY=0, BLINK_LOOP_SIDE_ROOT=1, BLINK_LOOP_SMEM=0, BLINK_LOOP_SPEC_AT=<fraction>,
// BLINK_LOOP_SPINNER_NS=<ns>, BLINK_LOOP_ASYNC=0, BLINK_LOOP_STAMPS=1, BLINK_LOOP_PLAIN_EDGES=1 (each explained
// where it is read).
static bool env_is(const char* name, const char* value) {
  const char* v = getenv(name);
  return v && strcmp(v, value) == 0;
}

#define BLINK_TRY(call, code)               \
  do {                                      \
    cudaError_t e_ = (call);                \
    if (e_ != cudaSuccess) return (code) * 1000 + (int)e_; \
  } while (0)

extern "C" {

uint64_t blink_loop_args_bytes() { return sizeof(blink_loop_args); }
uint64_t blink_loop_ctl_bytes() { return sizeof(blink_loop_ctl); }
uint64_t blink_loop_ext_bytes() { return sizeof(blink_loop_ext); }

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

// Build the loop's graphs around `children` (num_branches cudaGraph_t: branch 2 * (b * num_buckets + i) + g =
// bucket i over step buffer b (step_buf, step_buf_alt), sampled (g = 0) or greedy (g = 1); with the sampling
// extensions (args->ext) then branch 4 * num_buckets + 2 * (b * num_buckets + i) + g: that bucket's LOGITS
// graph, to which blink_loop_ext.cuh adds the adjust kernel and the POST graph), with `args`
// (host copy; its handles and the speculation's buffers are filled here) copied to device memory.
// `samplers[i]` (i < 4 * num_buckets): the sampling part of children[i] captured alone (its node count says
// where the logits are done: blink_loop_take starts there; in an extended branch, after the POST graph).
int blink_loop_create(const blink_loop_args* args_in, void* const* children, void* const* samplers,
                      uint32_t num_branches, blink_loop** out) {
  blink_loop* L = new blink_loop();
  blink_loop_args args = *args_in;
  args.num_branches = num_branches;
  BLINK_TRY(cudaStreamCreateWithFlags(&L->stream, cudaStreamNonBlocking), 1);
  BLINK_TRY(cudaGraphCreate(&L->graph, 0), 2);
  L->num_branches = num_branches;
  L->graphs = (cudaGraph_t*)calloc(num_branches, sizeof(cudaGraph_t));
  L->execs = (cudaGraphExec_t*)calloc(num_branches, sizeof(cudaGraphExec_t));
  if (!L->graphs || !L->execs) return 3 * 1000;
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
  if (env_is("BLINK_LOOP_SMEM", "0")) args.smem_bytes = 0;  // (measuring) the state stays in global memory
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
  args.new_token_offset = (uint64_t)((uint8_t*)carve.new_token - (uint8_t*)carve.h);
  args.sq_head_alt = args.sq_head;
  args.spec_tail = 0;
  args.cur = args.buf = args.spec_ok = args.spec_branch = args.spec_rows = args.num_err = args.exiting = 0;
  // BLINK_LOOP_SPEC_TAIL_CHECK=0 (for measuring only): new requests wait for the next speculation
  args.check_tail = !env_is("BLINK_LOOP_SPEC_TAIL_CHECK", "0");
  // blink_loop_take launches the next bucket graph before the step's tokens come (a stop token then costs
  // the stopped sequence one dropped row in the next step; blink_loop_spec.cuh): 2.2 us less per step at
  // batch 1 (bench/loop_ab.py). BLINK_LOOP_ASYNC=0 (measuring) waits for the tokens first.
  args.async_take = !env_is("BLINK_LOOP_ASYNC", "0");
  args.num_eos = (uint32_t)hdr.cfg.num_eos;
  for (int i = 0; i < BLINK_SCHED_MAX_EOS; ++i) args.eos_ids[i] = hdr.cfg.eos_ids[i];
  blink_loop_ext ext_host;
  const int has_ext = ext_read(&args, &ext_host);
  if (has_ext < 0) return 30 * 1000;
  if (num_branches != ext_num_branches(has_ext ? &ext_host : nullptr, (uint32_t)hdr.cfg.num_buckets) ||
      !args.step_buf_alt)
    return 25 * 1000;
  // every row's token is awaited by blink_loop_take: -1 until the graph writes it (int64: 0xff bytes)
  BLINK_TRY(cudaMemset(args.sampled, 0xff, sizeof(int64_t) * (uint64_t)hdr.cfg.step_max_seqs), 31);
  BLINK_TRY(cudaMalloc(&L->dev_args, sizeof(blink_loop_args)), 6);
  BLINK_TRY(cudaMemcpy(L->dev_args, &args, sizeof(blink_loop_args), cudaMemcpyHostToDevice), 7);

  void* kernel_args[] = {&L->dev_args};
  cudaKernelNodeParams k = {};
  k.gridDim = dim3(1);
  k.blockDim = dim3(BLINK_LOOP_THREADS);
  k.kernelParams = kernel_args;
  k.func = (void*)blink_loop_step;
  k.sharedMemBytes = args.smem_bytes;
  cudaGraphNode_t step_node;
  BLINK_TRY(cudaGraphAddKernelNode(&step_node, L->graph, nullptr, 0, &k), 8);
  // beside the bucket graph, publish, spec and take go first whenever an SM frees up
  // (BLINK_LOOP_SPEC_PRIORITY=0 leaves them at the default priority, for measuring)
  const bool prioritize = !env_is("BLINK_LOOP_SPEC_PRIORITY", "0");
  cudaKernelNodeAttrValue priority = {};
  if (prioritize) {
    int least = 0, greatest = 0;
    BLINK_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest), 27);
    priority.priority = greatest;
  }
  const bool side_root = env_is("BLINK_LOOP_SIDE_ROOT", "1");
  const bool stamps = env_is("BLINK_LOOP_STAMPS", "1");
  const unsigned long long flags =
      cudaGraphInstantiateFlagDeviceLaunch | (prioritize ? cudaGraphInstantiateFlagUseNodePriority : 0);
  L->take_linked = 0;
  for (uint32_t i = 0; i < num_branches; ++i) {  // each branch: the bucket graph, its take kernel after the logits
    cudaGraph_t g, inner;
    cudaGraphNode_t child, take, publish_node, spec_node;
    size_t sampler_nodes = 0;
    BLINK_TRY(cudaGraphCreate(&g, 0), 9);
    L->graphs[i] = g;
    BLINK_TRY(cudaGraphAddChildGraphNode(&child, g, nullptr, 0, (cudaGraph_t)children[i]), 10);
    size_t model_nodes = 0;  // the captured graph's own nodes come first in its node list
    if (stamps) BLINK_TRY(cudaGraphGetNodes((cudaGraph_t)children[i], nullptr, &model_nodes), 47);
    if (env_is("BLINK_LOOP_PLAIN_EDGES", "1")) BLINK_TRY(blink_plain_edges(child), 49);
    cudaGraphNode_t start_after = nullptr;
    if (i >= 4u * (uint32_t)hdr.cfg.num_buckets) {  // an extended branch: children[i] is its LOGITS graph
      // the take kernel after the POST graph: its logprobs read the sampled tokens, which the take kernel
      // sets back to -1 (so an extended step pays its launch; plain steps do not)
      BLINK_TRY(ext_finish_branch(&ext_host, L->dev_args, g, child, i, &hdr.cfg, &start_after), 37);
      inner = g;
    } else {
      BLINK_TRY(cudaGraphChildGraphNodeGetGraph(child, &inner), 35);
      BLINK_TRY(cudaGraphGetNodes((cudaGraph_t)samplers[i], nullptr, &sampler_nodes), 36);
      start_after = node_before_tail(inner, sampler_nodes);
    }
    L->take_linked += start_after != nullptr;
    cudaKernelNodeParams t = k;
    t.func = (void*)blink_loop_take;
    t.blockDim = dim3(BLINK_LOOP_TAKE_THREADS);
    t.sharedMemBytes = 0;
    BLINK_TRY(cudaGraphAddKernelNode(&take, inner, start_after ? &start_after : nullptr, start_after ? 1 : 0, &t), 33);
    // publish -> spec start after the model graph's first node, inside it: a second root node costs about
    // 1.1 us between two graphs (bench/loop_mechanism.cu; BLINK_LOOP_SIDE_ROOT=1 keeps them a root, for measuring)
    cudaGraph_t model;
    BLINK_TRY(cudaGraphChildGraphNodeGetGraph(child, &model), 43);
    cudaGraphNode_t root = nullptr;
    size_t num_roots = 1;  // the first root (a PyTorch capture on one stream has one)
    if (side_root || cudaGraphGetRootNodes(model, &root, &num_roots) != cudaSuccess || num_roots == 0) root = nullptr;
    // BLINK_LOOP_SPEC_AT=f (measuring): publish -> spec after the model graph's node at fraction f of its
    // nodes in capture order, not after its first node
    if (root && getenv("BLINK_LOOP_SPEC_AT")) {
      size_t n = 0;
      BLINK_TRY(cudaGraphGetNodes(model, nullptr, &n), 44);
      cudaGraphNode_t* nodes = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * n);
      const cudaError_t got = nodes ? cudaGraphGetNodes(model, nodes, &n) : cudaErrorMemoryAllocation;
      const double f = atof(getenv("BLINK_LOOP_SPEC_AT"));
      if (got == cudaSuccess && n) root = nodes[(size_t)((f < 0 ? 0.0 : f > 1 ? 1.0 : f) * (double)(n - 1))];
      free(nodes);
      BLINK_TRY(got, 45);
    }
    // BLINK_LOOP_SPINNER_NS=ns (measuring): one more block beside the graph, after the same node, holding an
    // SM for that long (what a resident block costs the graph, apart from the spec kernel's work)
    if (root && getenv("BLINK_LOOP_SPINNER_NS")) {
      uint64_t spin_ns = strtoull(getenv("BLINK_LOOP_SPINNER_NS"), nullptr, 10);
      void* spin_args[] = {&spin_ns};
      cudaGraphNode_t spin_node;
      BLINK_TRY(add_one_block(&spin_node, model, &root, 1, (void*)bench_spinner, spin_args, 64), 46);
    }
    cudaKernelNodeParams side = k;
    side.func = (void*)blink_loop_publish;
    side.sharedMemBytes = 0;
    BLINK_TRY(cudaGraphAddKernelNode(&publish_node, root ? model : g, root ? &root : nullptr, root ? 1 : 0, &side), 11);
    side.func = (void*)blink_loop_spec;
    side.sharedMemBytes = args.smem_bytes;
    BLINK_TRY(cudaGraphAddKernelNode(&spec_node, root ? model : g, &publish_node, 1, &side), 26);
    if (prioritize)
      for (cudaGraphNode_t n : {take, publish_node, spec_node})
        BLINK_TRY(cudaGraphKernelNodeSetAttribute(n, cudaKernelNodeAttributePriority, &priority), 34);
    if (stamps && i < 4u * (uint32_t)hdr.cfg.num_buckets)  // (measuring) bench_stamp after the model's nodes
      BLINK_TRY(add_stamps(child, hdr.cfg.buckets[(i / 2) % (uint32_t)hdr.cfg.num_buckets], model_nodes), 48);
    BLINK_TRY(cudaGraphInstantiateWithFlags(&L->execs[i], g, flags), 12);
    BLINK_TRY(cudaGraphUpload(L->execs[i], L->stream), 13);
  }
  BLINK_TRY(cudaGraphInstantiateWithFlags(&L->exec, L->graph, cudaGraphInstantiateFlagDeviceLaunch), 38);
  BLINK_TRY(cudaGraphUpload(L->exec, L->stream), 39);
  // the handles where the kernels find them
  BLINK_TRY(cudaMalloc(&L->dev_execs, sizeof(cudaGraphExec_t) * num_branches), 40);
  BLINK_TRY(cudaMemcpy(L->dev_execs, L->execs, sizeof(cudaGraphExec_t) * num_branches, cudaMemcpyHostToDevice), 41);
  args.full_exec = L->exec;
  args.branch_execs = L->dev_execs;
  BLINK_TRY(cudaMemcpy(L->dev_args, &args, sizeof(blink_loop_args), cudaMemcpyHostToDevice), 42);
  BLINK_TRY(cudaStreamSynchronize(L->stream), 14);
  *out = L;
  return 0;
}

uint32_t blink_loop_smem_bytes(const blink_loop* L) { return L->smem_bytes; }
uint32_t blink_loop_take_linked(const blink_loop* L) { return L->take_linked; }

int blink_loop_launch(blink_loop* L) {
  BLINK_TRY(cudaGraphLaunch(L->exec, L->stream), 1);
  return 0;
}

// For measuring (bench/gpu_host.py, bench/loop_ab.py): the graph `child` replayed `iterations` times; *ns_out: GPU
// time per iteration (CUDA events). mode 0: as the loop runs a step -- a graph of the child and a one-thread
// kernel after it that tail-launches the graph again, launched once (the loop's mechanism with no scheduling
// in it). mode 1: the child inside a graph instantiated as the loop's bucket graphs are (device-launchable,
// node priorities honoured), launched from the host back to back (the bare replay with the loop's
// instantiation, so that a comparison separates the loop's work from how its graphs are instantiated).
// Each part of that on its own, launched from the host back to back: mode 2, the child node in a plain
// graph; mode 3, device-launchable (no node priorities). mode 4: mode 0 instantiated as the loop's graphs
// (node priorities honoured, the relaunching kernel at the greatest priority, as the take kernel is).
// stamp_bucket >= 0: with the stamp kernels of that bucket (BLINK_LOOP_STAMPS).
int blink_loop_bench_mechanism(void* child, uint32_t iterations, uint32_t mode, int32_t stamp_bucket, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t graph;
  uint32_t* left = nullptr;
  BLINK_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), 1);
  BLINK_TRY(cudaMalloc(&left, sizeof(uint32_t)), 2);
  BLINK_TRY(cudaGraphCreate(&graph, 0), 3);
  cudaGraphNode_t count_node, child_node;
  BLINK_TRY(cudaGraphAddChildGraphNode(&child_node, graph, nullptr, 0, (cudaGraph_t)child), 4);
  size_t model_nodes = 0;
  BLINK_TRY(cudaGraphGetNodes((cudaGraph_t)child, nullptr, &model_nodes), 20);
  // (the same order as blink_loop_create's)
  if (env_is("BLINK_LOOP_PLAIN_EDGES", "1")) BLINK_TRY(blink_plain_edges(child_node), 22);
  if (stamp_bucket >= 0) BLINK_TRY(add_stamps(child_node, stamp_bucket, model_nodes), 21);
  void* kernel_args[] = {&left};
  const bool relaunched = mode == 0 || mode == 4, prioritized = mode == 1 || mode == 4;
  if (relaunched) BLINK_TRY(add_one_block(&count_node, graph, &child_node, 1, (void*)bench_countdown, kernel_args, 1), 5);
  if (mode == 4) {
    int least = 0;
    cudaKernelNodeAttrValue priority = {};
    BLINK_TRY(cudaDeviceGetStreamPriorityRange(&least, &priority.priority), 23);
    BLINK_TRY(cudaGraphKernelNodeSetAttribute(count_node, cudaKernelNodeAttributePriority, &priority), 24);
  }
  const unsigned long long flags = (mode == 2 ? 0 : cudaGraphInstantiateFlagDeviceLaunch) |
                                   (prioritized ? cudaGraphInstantiateFlagUseNodePriority : 0);
  BLINK_TRY(blink_time_graph(graph, flags, stream, left, iterations, relaunched, ns_out), 10);
  cudaGraphDestroy(graph);
  cudaFree(left);
  cudaStreamDestroy(stream);
  return 0;
}

// For measuring (BLINK_LOOP_STAMPS): on = 1 zeroes the stamp sums and counts the steps of graphs of `bucket`
// from now; on = 0 stops counting and writes mean_ns_out[BLINK_STAMP_POINTS + 1] (point 0 -> each point, ns;
// mean_ns_out[0] gets the number of steps counted, the last entry the mean SM clock in MHz).
int blink_loop_stamps(int32_t bucket, uint32_t on, double* mean_ns_out) {
  unsigned long long sum[BLINK_STAMP_POINTS] = {}, count[BLINK_STAMP_POINTS] = {}, khz = 0, khz_n = 0;
  const int32_t none = -1;
  if (on) {
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_sum, sum, sizeof(sum)), 1);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_count, count, sizeof(count)), 2);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_khz_sum, &khz, sizeof(khz)), 8);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_khz_count, &khz, sizeof(khz)), 9);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_t0, count, sizeof(count[0])), 7);  // 0: no point 0 seen yet
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_bucket, &bucket, sizeof(bucket)), 3);
    return 0;
  }
  BLINK_TRY(cudaMemcpyToSymbol(g_stamp_bucket, &none, sizeof(none)), 4);
  BLINK_TRY(cudaMemcpyFromSymbol(sum, g_stamp_sum, sizeof(sum)), 5);
  BLINK_TRY(cudaMemcpyFromSymbol(count, g_stamp_count, sizeof(count)), 6);
  BLINK_TRY(cudaMemcpyFromSymbol(&khz, g_stamp_khz_sum, sizeof(khz)), 10);
  BLINK_TRY(cudaMemcpyFromSymbol(&khz_n, g_stamp_khz_count, sizeof(khz_n)), 11);
  for (int p = 0; p < BLINK_STAMP_POINTS; ++p) mean_ns_out[p] = count[p] ? (double)sum[p] / (double)count[p] : 0.0;
  mean_ns_out[0] = (double)count[BLINK_STAMP_POINTS - 1];
  mean_ns_out[BLINK_STAMP_POINTS] = khz_n ? (double)khz / (double)khz_n / 1e3 : 0.0;
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
  for (uint32_t i = 0; i < L->num_branches; ++i) {
    if (L->execs[i]) BLINK_TRY(cudaGraphExecDestroy(L->execs[i]), 6);
    if (L->graphs[i]) BLINK_TRY(cudaGraphDestroy(L->graphs[i]), 7);
  }
  free(L->execs);
  free(L->graphs);
  BLINK_TRY(cudaFree(L->dev_execs), 8);
  BLINK_TRY(cudaFree(L->dev_args), 3);
  BLINK_TRY(cudaStreamDestroy(L->stream), 4);
  for (void* p : L->owned) BLINK_TRY(cudaFree(p), 5);
  delete L;
  return 0;
}

}  // extern "C"
