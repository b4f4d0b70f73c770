// Host side of the GPU-resident loop: how blink_loop_create (kernels/csrc/persistent_loop.cu) builds the
// loop's graphs, step by step. Included by persistent_loop.cu after its kernels, BLINK_TRY and BLINK_FAIL;
// each step returns 0 or blink_loop_error * 1000 + cudaError_t (blink_loop_layout.h).
#ifndef BLINK_LOOP_BUILD_CUH
#define BLINK_LOOP_BUILD_CUH

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
  // a step with token-masked rows speculated past as well (unless measuring): the take kernel, which in such
  // a step starts after the masks' fix-up, takes it when every row sampled a token (blink_loop_spec.cuh)
  args->spec_masked = o->spec_masked ? 1u : 0u;
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

#endif  // BLINK_LOOP_BUILD_CUH
