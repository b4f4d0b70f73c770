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
// (LoopOptions(async_take=False), for measuring: the take waits for the tokens and a stop token also takes the
// full path.) How the loop is built is a blink_loop_options (kernels/persistent_loop.py, LoopOptions, which
// reads the environment); the benchmark probes are compiled only with -DBLINK_BENCH_PROBES
// (blink_loop_bench.cuh). The library's calls return 0 or blink_loop_error * 1000 + cudaError_t.
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
      if (threadIdx.x == 0) st_v(&a->ctl->error, (uint32_t)BLINK_LOOP_FAULT_NO_BUCKET_GRAPH);
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


#define BLINK_TRY(call, code)                                  \
  do {                                                         \
    cudaError_t e_ = (call);                                   \
    if (e_ != cudaSuccess) return (int)(code) * 1000 + (int)e_; \
  } while (0)
#define BLINK_FAIL(code) ((int)(code) * 1000)  // a failure that is not a CUDA call's

#ifdef BLINK_BENCH_PROBES
#include "blink_loop_bench.cuh"
#endif

static_assert(sizeof(((blink_loop_args*)nullptr)->eos_ids) == sizeof(int32_t) * BLINK_SCHED_MAX_EOS,
              "blink_loop_args.eos_ids holds the scheduler's eos ids");

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
// ---- blink_loop_create, step by step ----------------------------------------------------------------------
// Options that need the benchmark probes are refused by the product build.
static int check_options(const blink_loop_options* o) {
#ifndef BLINK_BENCH_PROBES
  if (o->stamps || o->spinner_ns || o->plain_edges) return BLINK_FAIL(BLINK_LOOP_E_NEEDS_BENCH_BUILD);
#else
  (void)o;
#endif
  return 0;
}

static int create_handles(blink_loop* L, uint32_t num_branches) {
  BLINK_TRY(cudaStreamCreateWithFlags(&L->stream, cudaStreamNonBlocking), BLINK_LOOP_E_STREAM);
  BLINK_TRY(cudaGraphCreate(&L->graph, 0), BLINK_LOOP_E_STREAM);
  L->num_branches = num_branches;
  L->graphs = (cudaGraph_t*)calloc(num_branches, sizeof(cudaGraph_t));
  L->execs = (cudaGraphExec_t*)calloc(num_branches, sizeof(cudaGraphExec_t));
  return L->graphs && L->execs ? 0 : BLINK_FAIL(BLINK_LOOP_E_HOST_ALLOC);
}

// The scheduler's hot prefix goes to shared memory when it fits, with the per-slot scratch after it.
static int place_state(blink_loop* L, blink_loop_args* args, const blink_loop_options* o, blink_sched_header* hdr) {
  BLINK_TRY(cudaMemcpy(hdr, args->sched_mem, sizeof(*hdr), cudaMemcpyDeviceToHost), BLINK_LOOP_E_SCHED_STATE);
  blink_sched sizing;
  blink_sched_bind_split(&sizing, nullptr, nullptr, &hdr->cfg, &args->hot_bytes);
  const uint64_t smem = args->hot_bytes + 29ull * args->num_slots + 16;  // room, order, par (5), cancel
  int device = 0, smem_max = 0;
  BLINK_TRY(cudaGetDevice(&device), BLINK_LOOP_E_SHARED_MEMORY);
  BLINK_TRY(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), BLINK_LOOP_E_SHARED_MEMORY);
  args->smem_bytes = smem + 1024 <= (uint64_t)smem_max ? (uint32_t)smem : 0;  // leave room for the static part
  if (!o->smem) args->smem_bytes = 0;  // (measuring) the state stays in global memory
  L->smem_bytes = args->smem_bytes;
  if (!args->smem_bytes) return 0;
  BLINK_TRY(cudaFuncSetAttribute(blink_loop_step, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)args->smem_bytes),
            BLINK_LOOP_E_SHARED_MEMORY);
  BLINK_TRY(cudaFuncSetAttribute(blink_loop_spec, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)args->smem_bytes),
            BLINK_LOOP_E_SHARED_MEMORY);
  return 0;
}

// The speculation: a second copy of the hot state, per-row and deferred-error lists; the cold arrays'
// addresses from the same carving the kernels use; the loop's own words from zero.
static int prepare_speculation(blink_loop* L, blink_loop_args* args, const blink_sched_header* hdr,
                               const blink_loop_options* o) {
  blink_sched carve;
  blink_sched_bind_split(&carve, args->sched_mem, args->sched_mem + args->hot_bytes, &hdr->cfg, nullptr);
  args->tokens = carve.tokens;
  args->stop_ids = carve.stop_ids;
  BLINK_TRY(cudaMalloc(&L->owned[0], args->hot_bytes), BLINK_LOOP_E_SPEC_BUFFERS);
  BLINK_TRY(cudaMemcpy(L->owned[0], args->sched_mem, args->hot_bytes, cudaMemcpyDeviceToDevice), BLINK_LOOP_E_SPEC_BUFFERS);
  BLINK_TRY(cudaMalloc(&L->owned[1], sizeof(spec_row) * (uint64_t)hdr->cfg.step_max_seqs), BLINK_LOOP_E_SPEC_BUFFERS);
  BLINK_TRY(cudaMalloc(&L->owned[2], sizeof(int32_t) * (uint64_t)args->num_slots), BLINK_LOOP_E_SPEC_BUFFERS);
  BLINK_TRY(cudaMalloc(&L->owned[3], sizeof(int32_t) * (uint64_t)args->num_slots), BLINK_LOOP_E_SPEC_BUFFERS);
  args->hot_alt = (uint8_t*)L->owned[0];
  args->rows = (spec_row*)L->owned[1];
  args->err_slot = (int32_t*)L->owned[2];
  args->err_code = (int32_t*)L->owned[3];
  args->new_token_offset = (uint64_t)((uint8_t*)carve.new_token - (uint8_t*)carve.h);
  args->sq_head_alt = args->sq_head;
  args->spec_tail = 0;
  args->cur = args->buf = args->spec_ok = args->spec_branch = args->spec_rows = args->num_err = args->exiting = 0;
  // spec_tail_check off (measuring only): new requests wait for the next speculation
  args->check_tail = o->spec_tail_check ? 1u : 0u;
  // blink_loop_take launches the next bucket graph before the step's tokens come (a stop token then costs
  // the stopped sequence one dropped row in the next step; blink_loop_spec.cuh): 2.2 us less per step at
  // batch 1 (bench/loop_ab.py). async_take off (measuring) waits for the tokens first.
  args->async_take = o->async_take ? 1u : 0u;
  args->num_eos = (uint32_t)hdr->cfg.num_eos;
  for (int i = 0; i < BLINK_SCHED_MAX_EOS; ++i) args->eos_ids[i] = hdr->cfg.eos_ids[i];
  return 0;
}

// The sampling extensions' host copy (*has_ext: args->ext is set), and the branch count they and the buckets imply.
static int check_branches(const blink_loop_args* args, const blink_sched_header* hdr, uint32_t num_branches,
                          blink_loop_ext* ext_host, int* has_ext) {
  *has_ext = ext_read(args, ext_host);
  if (*has_ext < 0) return BLINK_FAIL(BLINK_LOOP_E_EXT);
  if (num_branches != ext_num_branches(*has_ext ? ext_host : nullptr, (uint32_t)hdr->cfg.num_buckets) ||
      !args->step_buf_alt)
    return BLINK_FAIL(BLINK_LOOP_E_BRANCH_COUNT);
  return 0;
}

static int upload_args(blink_loop* L, const blink_loop_args* args, const blink_sched_header* hdr) {
  // every row's token is awaited by blink_loop_take: -1 until the graph writes it (int64: 0xff bytes)
  BLINK_TRY(cudaMemset(args->sampled, 0xff, sizeof(int64_t) * (uint64_t)hdr->cfg.step_max_seqs), BLINK_LOOP_E_ARGS_UPLOAD);
  BLINK_TRY(cudaMalloc(&L->dev_args, sizeof(blink_loop_args)), BLINK_LOOP_E_ARGS_UPLOAD);
  BLINK_TRY(cudaMemcpy(L->dev_args, args, sizeof(blink_loop_args), cudaMemcpyHostToDevice), BLINK_LOOP_E_ARGS_UPLOAD);
  return 0;
}

// What every branch is built with: the full step kernel's parameters (the side kernels' template), the side
// kernels' node priority, the instantiation flags.
struct branch_plan {
  blink_loop* L;
  const blink_loop_options* opt;
  const blink_sched_header* hdr;
  const blink_loop_ext* ext;  // host copy, or nullptr: no extended branches
  cudaKernelNodeParams k;
  cudaKernelNodeAttrValue priority;
  unsigned long long flags;
};

static int add_step_node(branch_plan* p, void** kernel_args) {
  p->k = {};
  p->k.gridDim = dim3(1);
  p->k.blockDim = dim3(BLINK_LOOP_THREADS);
  p->k.kernelParams = kernel_args;
  p->k.func = (void*)blink_loop_step;
  p->k.sharedMemBytes = p->L->smem_bytes;
  cudaGraphNode_t step_node;
  BLINK_TRY(cudaGraphAddKernelNode(&step_node, p->L->graph, nullptr, 0, &p->k), BLINK_LOOP_E_STEP_NODE);
  return 0;
}

// Beside the bucket graph, publish, spec and take go first whenever an SM frees up (spec_priority off leaves
// them at the default priority, for measuring).
static int plan_priority(branch_plan* p) {
  p->priority = {};
  p->flags = cudaGraphInstantiateFlagDeviceLaunch | (p->opt->spec_priority ? cudaGraphInstantiateFlagUseNodePriority : 0);
  if (!p->opt->spec_priority) return 0;
  int least = 0, greatest = 0;
  BLINK_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest), BLINK_LOOP_E_PRIORITY);
  p->priority.priority = greatest;
  return 0;
}

// The take kernel after the graph's logits: in an extended branch (children[i] is its LOGITS graph) after the
// POST graph, whose logprobs read the sampled tokens that the take kernel sets back to -1 (so an extended step
// pays its launch; plain steps do not); else after the node captured just before the sampler's nodes.
static int add_take(const branch_plan& p, uint32_t i, cudaGraph_t g, cudaGraphNode_t child, cudaGraph_t sampler,
                    cudaGraphNode_t* take) {
  cudaGraph_t inner = g;
  cudaGraphNode_t start_after = nullptr;
  if (i >= 4u * (uint32_t)p.hdr->cfg.num_buckets) {
    BLINK_TRY(ext_finish_branch(p.ext, p.L->dev_args, g, child, i, &p.hdr->cfg, &start_after), BLINK_LOOP_E_EXT);
  } else {
    size_t sampler_nodes = 0;
    BLINK_TRY(cudaGraphChildGraphNodeGetGraph(child, &inner), BLINK_LOOP_E_BRANCH_GRAPH);
    BLINK_TRY(cudaGraphGetNodes(sampler, nullptr, &sampler_nodes), BLINK_LOOP_E_BRANCH_GRAPH);
    start_after = node_before_tail(inner, sampler_nodes);
  }
  p.L->take_linked += start_after != nullptr;
  cudaKernelNodeParams t = p.k;
  t.func = (void*)blink_loop_take;
  t.blockDim = dim3(BLINK_LOOP_TAKE_THREADS);
  t.sharedMemBytes = 0;
  BLINK_TRY(cudaGraphAddKernelNode(take, inner, start_after ? &start_after : nullptr, start_after ? 1 : 0, &t),
            BLINK_LOOP_E_BRANCH_GRAPH);
  return 0;
}

// (measuring: spec_at) the model graph's node at fraction f of its nodes in capture order.
static int node_at_fraction(cudaGraph_t model, double f, cudaGraphNode_t* node) {
  size_t n = 0;
  BLINK_TRY(cudaGraphGetNodes(model, nullptr, &n), BLINK_LOOP_E_BRANCH_GRAPH);
  cudaGraphNode_t* nodes = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * n);
  const cudaError_t got = nodes ? cudaGraphGetNodes(model, nodes, &n) : cudaErrorMemoryAllocation;
  if (got == cudaSuccess && n) *node = nodes[(size_t)((f > 1 ? 1.0 : f) * (double)(n - 1))];
  free(nodes);
  BLINK_TRY(got, BLINK_LOOP_E_BRANCH_GRAPH);
  return 0;
}

// publish -> spec start after the model graph's first node, inside it: a second root node costs about 1.1 us
// between two graphs (bench/loop_mechanism.cu; side_root keeps them a root, for measuring).
static int add_side(const branch_plan& p, cudaGraph_t g, cudaGraphNode_t child, cudaGraphNode_t* publish,
                    cudaGraphNode_t* spec) {
  cudaGraph_t model;
  BLINK_TRY(cudaGraphChildGraphNodeGetGraph(child, &model), BLINK_LOOP_E_BRANCH_GRAPH);
  cudaGraphNode_t root = nullptr;
  size_t num_roots = 1;  // the first root (a PyTorch capture on one stream has one)
  if (p.opt->side_root || cudaGraphGetRootNodes(model, &root, &num_roots) != cudaSuccess || num_roots == 0) root = nullptr;
  if (root && p.opt->spec_at >= 0) {
    const int rc = node_at_fraction(model, p.opt->spec_at, &root);
    if (rc) return rc;
  }
#ifdef BLINK_BENCH_PROBES
  if (root && p.opt->spinner_ns) BLINK_TRY(add_spinner(model, root, p.opt->spinner_ns), BLINK_LOOP_E_PROBES);
#endif
  cudaKernelNodeParams side = p.k;
  side.func = (void*)blink_loop_publish;
  side.sharedMemBytes = 0;
  BLINK_TRY(cudaGraphAddKernelNode(publish, root ? model : g, root ? &root : nullptr, root ? 1 : 0, &side),
            BLINK_LOOP_E_BRANCH_GRAPH);
  side.func = (void*)blink_loop_spec;
  side.sharedMemBytes = p.L->smem_bytes;
  BLINK_TRY(cudaGraphAddKernelNode(spec, root ? model : g, publish, 1, &side), BLINK_LOOP_E_BRANCH_GRAPH);
  return 0;
}

// Branch i: the bucket graph `child_graph` as a child node, its take kernel after the logits, publish -> spec
// beside it; instantiated for device launch and uploaded.
static int build_branch(const branch_plan& p, uint32_t i, cudaGraph_t child_graph, cudaGraph_t sampler) {
  blink_loop* L = p.L;
  cudaGraph_t g;
  cudaGraphNode_t child, take, publish_node, spec_node;
  BLINK_TRY(cudaGraphCreate(&g, 0), BLINK_LOOP_E_BRANCH_GRAPH);
  L->graphs[i] = g;
  BLINK_TRY(cudaGraphAddChildGraphNode(&child, g, nullptr, 0, child_graph), BLINK_LOOP_E_BRANCH_GRAPH);
#ifdef BLINK_BENCH_PROBES
  size_t model_nodes = 0;  // the captured graph's own nodes come first in its node list
  if (p.opt->stamps) BLINK_TRY(cudaGraphGetNodes(child_graph, nullptr, &model_nodes), BLINK_LOOP_E_PROBES);
  if (p.opt->plain_edges) BLINK_TRY(blink_plain_edges(child), BLINK_LOOP_E_PROBES);
#endif
  int rc = add_take(p, i, g, child, sampler, &take);
  if (!rc) rc = add_side(p, g, child, &publish_node, &spec_node);
  if (rc) return rc;
  if (p.opt->spec_priority)
    for (cudaGraphNode_t n : {take, publish_node, spec_node})
      BLINK_TRY(cudaGraphKernelNodeSetAttribute(n, cudaKernelNodeAttributePriority, &p.priority), BLINK_LOOP_E_PRIORITY);
#ifdef BLINK_BENCH_PROBES
  const uint32_t nb = (uint32_t)p.hdr->cfg.num_buckets;
  if (p.opt->stamps && i < 4u * nb)  // bench_stamp after the model's nodes
    BLINK_TRY(add_stamps(child, p.hdr->cfg.buckets[(i / 2) % nb], model_nodes), BLINK_LOOP_E_PROBES);
#endif
  BLINK_TRY(cudaGraphInstantiateWithFlags(&L->execs[i], g, p.flags), BLINK_LOOP_E_INSTANTIATE);
  BLINK_TRY(cudaGraphUpload(L->execs[i], L->stream), BLINK_LOOP_E_UPLOAD);
  return 0;
}

// The full step's graph instantiated, every graph handle where the kernels find them, the arguments final.
static int finish_graphs(blink_loop* L, blink_loop_args* args) {
  BLINK_TRY(cudaGraphInstantiateWithFlags(&L->exec, L->graph, cudaGraphInstantiateFlagDeviceLaunch), BLINK_LOOP_E_INSTANTIATE);
  BLINK_TRY(cudaGraphUpload(L->exec, L->stream), BLINK_LOOP_E_UPLOAD);
  BLINK_TRY(cudaMalloc(&L->dev_execs, sizeof(cudaGraphExec_t) * L->num_branches), BLINK_LOOP_E_UPLOAD);
  BLINK_TRY(cudaMemcpy(L->dev_execs, L->execs, sizeof(cudaGraphExec_t) * L->num_branches, cudaMemcpyHostToDevice),
            BLINK_LOOP_E_UPLOAD);
  args->full_exec = L->exec;
  args->branch_execs = L->dev_execs;
  BLINK_TRY(cudaMemcpy(L->dev_args, args, sizeof(blink_loop_args), cudaMemcpyHostToDevice), BLINK_LOOP_E_ARGS_UPLOAD);
  BLINK_TRY(cudaStreamSynchronize(L->stream), BLINK_LOOP_E_UPLOAD);
  return 0;
}

extern "C" {

uint64_t blink_loop_args_bytes() { return sizeof(blink_loop_args); }
uint64_t blink_loop_ctl_bytes() { return sizeof(blink_loop_ctl); }
uint64_t blink_loop_ext_bytes() { return sizeof(blink_loop_ext); }
uint64_t blink_loop_options_bytes() { return sizeof(blink_loop_options); }
uint32_t blink_loop_has_bench_probes() {
#ifdef BLINK_BENCH_PROBES
  return 1;
#else
  return 0;
#endif
}

// Pin and map host memory (the ring's mmap) for the GPU; *dev_out is its device address.
int blink_loop_register(void* host, uint64_t bytes, void** dev_out) {
  BLINK_TRY(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaHostGetDevicePointer(dev_out, host, 0), BLINK_LOOP_E_CUDA);
  return 0;
}

int blink_loop_unregister(void* host) {
  BLINK_TRY(cudaHostUnregister(host), BLINK_LOOP_E_CUDA);
  return 0;
}

// The control block: pinned, mapped host memory (zeroed).
int blink_loop_alloc_ctl(void** host_out, void** dev_out) {
  BLINK_TRY(cudaHostAlloc(host_out, sizeof(blink_loop_ctl), cudaHostAllocMapped), BLINK_LOOP_E_CUDA);
  memset(*host_out, 0, sizeof(blink_loop_ctl));
  BLINK_TRY(cudaHostGetDevicePointer(dev_out, *host_out, 0), BLINK_LOOP_E_CUDA);
  return 0;
}

// CLOCK_MONOTONIC minus %globaltimer: the caller brackets this call with two clock reads.
int blink_loop_read_globaltimer(uint64_t* out) {
  uint64_t* dev = nullptr;
  BLINK_TRY(cudaMalloc(&dev, sizeof(uint64_t)), BLINK_LOOP_E_CUDA);
  read_globaltimer<<<1, 1>>>(dev);
  BLINK_TRY(cudaMemcpy(out, dev, sizeof(uint64_t), cudaMemcpyDeviceToHost), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaFree(dev), BLINK_LOOP_E_CUDA);
  return 0;
}

// Build the loop's graphs around `children` (num_branches cudaGraph_t: branch 2 * (b * num_buckets + i) + g =
// bucket i over step buffer b (step_buf, step_buf_alt), sampled (g = 0) or greedy (g = 1); with the sampling
// extensions (args->ext) then branch 4 * num_buckets + 2 * (b * num_buckets + i) + g: that bucket's LOGITS
// graph, to which blink_loop_ext.cuh adds the adjust kernel and the POST graph), with `args`
// (host copy; its handles and the speculation's buffers are filled here) copied to device memory, as `opt` says.
// `samplers[i]` (i < 4 * num_buckets): the sampling part of children[i] captured alone (its node count says
// where the logits are done: blink_loop_take starts there; in an extended branch, after the POST graph).
int blink_loop_create(const blink_loop_args* args_in, const blink_loop_options* opt, void* const* children,
                      void* const* samplers, uint32_t num_branches, blink_loop** out) {
  int rc = check_options(opt);
  if (rc) return rc;
  blink_loop* L = new blink_loop();
  blink_loop_args args = *args_in;
  args.num_branches = num_branches;
  blink_sched_header hdr;
  blink_loop_ext ext_host;
  int has_ext = 0;
  branch_plan plan = {L, opt, &hdr, nullptr, {}, {}, 0};
  void* kernel_args[] = {&L->dev_args};
  if ((rc = create_handles(L, num_branches)) || (rc = place_state(L, &args, opt, &hdr)) ||
      (rc = prepare_speculation(L, &args, &hdr, opt)) ||
      (rc = check_branches(&args, &hdr, num_branches, &ext_host, &has_ext)) || (rc = upload_args(L, &args, &hdr)) ||
      (rc = add_step_node(&plan, kernel_args)) || (rc = plan_priority(&plan)))
    return rc;
  plan.ext = has_ext ? &ext_host : nullptr;
  const uint32_t plain = 4u * (uint32_t)hdr.cfg.num_buckets;
  L->take_linked = 0;
  for (uint32_t i = 0; i < num_branches && !rc; ++i)
    rc = build_branch(plan, i, (cudaGraph_t)children[i], i < plain ? (cudaGraph_t)samplers[i] : nullptr);
  if (rc || (rc = finish_graphs(L, &args))) return rc;
  *out = L;
  return 0;
}

uint32_t blink_loop_smem_bytes(const blink_loop* L) { return L->smem_bytes; }
uint32_t blink_loop_take_linked(const blink_loop* L) { return L->take_linked; }

int blink_loop_launch(blink_loop* L) {
  BLINK_TRY(cudaGraphLaunch(L->exec, L->stream), BLINK_LOOP_E_CUDA);
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
  BLINK_TRY(cudaGraphExecDestroy(L->exec), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaGraphDestroy(L->graph), BLINK_LOOP_E_CUDA);
  for (uint32_t i = 0; i < L->num_branches; ++i) {
    if (L->execs[i]) BLINK_TRY(cudaGraphExecDestroy(L->execs[i]), BLINK_LOOP_E_CUDA);
    if (L->graphs[i]) BLINK_TRY(cudaGraphDestroy(L->graphs[i]), BLINK_LOOP_E_CUDA);
  }
  free(L->execs);
  free(L->graphs);
  BLINK_TRY(cudaFree(L->dev_execs), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaFree(L->dev_args), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaStreamDestroy(L->stream), BLINK_LOOP_E_CUDA);
  for (void* p : L->owned) BLINK_TRY(cudaFree(p), BLINK_LOOP_E_CUDA);
  delete L;
  return 0;
}

}  // extern "C"
