// Benchmark probes of the GPU-resident loop, compiled only into the bench build of its library
// (-DBLINK_BENCH_PROBES: kernels/persistent_loop.py, load(bench=True), used by bench/loop_ab.py and
// bench/gpu_host.py), never into the product's. Included by kernels/csrc/persistent_loop.cu after its kernels
// and BLINK_TRY; the options that use them (LoopOptions.stamps, spinner_ns, plain_edges) make the product
// build's blink_loop_create fail with BLINK_LOOP_E_NEEDS_BENCH_BUILD.
#ifndef BLINK_LOOP_BENCH_CUH
#define BLINK_LOOP_BENCH_CUH

#include "blink_graph_measure.cuh"

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


// (measuring: LoopOptions.spinner_ns) one more block beside the graph, after `root`, holding an SM for that long
// (what a resident block costs the graph, apart from the spec kernel's work)
static cudaError_t add_spinner(cudaGraph_t model, cudaGraphNode_t root, uint64_t spin_ns) {
  void* spin_args[] = {&spin_ns};
  cudaGraphNode_t spin_node;
  return add_one_block(&spin_node, model, &root, 1, (void*)bench_spinner, spin_args, 64);
}

extern "C" {

// For measuring (bench/gpu_host.py, bench/loop_ab.py): the graph `child` replayed `iterations` times; *ns_out: GPU
// time per iteration (CUDA events). mode 0: as the loop runs a step -- a graph of the child and a one-thread
// kernel after it that tail-launches the graph again, launched once (the loop's mechanism with no scheduling
// in it). mode 1: the child inside a graph instantiated as the loop's bucket graphs are (device-launchable,
// node priorities honoured), launched from the host back to back (the bare replay with the loop's
// instantiation, so that a comparison separates the loop's work from how its graphs are instantiated).
// Each part of that on its own, launched from the host back to back: mode 2, the child node in a plain
// graph; mode 3, device-launchable (no node priorities). mode 4: mode 0 instantiated as the loop's graphs
// (node priorities honoured, the relaunching kernel at the greatest priority, as the take kernel is).
// stamp_bucket >= 0: with the stamp kernels of that bucket (LoopOptions.stamps); plain_edges: the child's
// programmatic edges made plain first (LoopOptions.plain_edges).
int blink_loop_bench_mechanism(void* child, uint32_t iterations, uint32_t mode, int32_t stamp_bucket,
                               uint32_t plain_edges, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t graph;
  uint32_t* left = nullptr;
  BLINK_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaMalloc(&left, sizeof(uint32_t)), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaGraphCreate(&graph, 0), BLINK_LOOP_E_CUDA);
  cudaGraphNode_t count_node, child_node;
  BLINK_TRY(cudaGraphAddChildGraphNode(&child_node, graph, nullptr, 0, (cudaGraph_t)child), BLINK_LOOP_E_CUDA);
  size_t model_nodes = 0;
  BLINK_TRY(cudaGraphGetNodes((cudaGraph_t)child, nullptr, &model_nodes), BLINK_LOOP_E_CUDA);
  // (the same order as blink_loop_create's)
  if (plain_edges) BLINK_TRY(blink_plain_edges(child_node), BLINK_LOOP_E_CUDA);
  if (stamp_bucket >= 0) BLINK_TRY(add_stamps(child_node, stamp_bucket, model_nodes), BLINK_LOOP_E_CUDA);
  void* kernel_args[] = {&left};
  const bool relaunched = mode == 0 || mode == 4, prioritized = mode == 1 || mode == 4;
  if (relaunched) BLINK_TRY(add_one_block(&count_node, graph, &child_node, 1, (void*)bench_countdown, kernel_args, 1), BLINK_LOOP_E_CUDA);
  if (mode == 4) {
    int least = 0;
    cudaKernelNodeAttrValue priority = {};
    BLINK_TRY(cudaDeviceGetStreamPriorityRange(&least, &priority.priority), BLINK_LOOP_E_CUDA);
    BLINK_TRY(cudaGraphKernelNodeSetAttribute(count_node, cudaKernelNodeAttributePriority, &priority), BLINK_LOOP_E_CUDA);
  }
  const unsigned long long flags = (mode == 2 ? 0 : cudaGraphInstantiateFlagDeviceLaunch) |
                                   (prioritized ? cudaGraphInstantiateFlagUseNodePriority : 0);
  BLINK_TRY(blink_time_graph(graph, flags, stream, left, iterations, relaunched, ns_out), BLINK_LOOP_E_CUDA);
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
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_sum, sum, sizeof(sum)), BLINK_LOOP_E_CUDA);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_count, count, sizeof(count)), BLINK_LOOP_E_CUDA);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_khz_sum, &khz, sizeof(khz)), BLINK_LOOP_E_CUDA);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_khz_count, &khz, sizeof(khz)), BLINK_LOOP_E_CUDA);
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_t0, count, sizeof(count[0])), BLINK_LOOP_E_CUDA);  // 0: no point 0 seen yet
    BLINK_TRY(cudaMemcpyToSymbol(g_stamp_bucket, &bucket, sizeof(bucket)), BLINK_LOOP_E_CUDA);
    return 0;
  }
  BLINK_TRY(cudaMemcpyToSymbol(g_stamp_bucket, &none, sizeof(none)), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaMemcpyFromSymbol(sum, g_stamp_sum, sizeof(sum)), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaMemcpyFromSymbol(count, g_stamp_count, sizeof(count)), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaMemcpyFromSymbol(&khz, g_stamp_khz_sum, sizeof(khz)), BLINK_LOOP_E_CUDA);
  BLINK_TRY(cudaMemcpyFromSymbol(&khz_n, g_stamp_khz_count, sizeof(khz_n)), BLINK_LOOP_E_CUDA);
  for (int p = 0; p < BLINK_STAMP_POINTS; ++p) mean_ns_out[p] = count[p] ? (double)sum[p] / (double)count[p] : 0.0;
  mean_ns_out[0] = (double)count[BLINK_STAMP_POINTS - 1];
  mean_ns_out[BLINK_STAMP_POINTS] = khz_n ? (double)khz / (double)khz_n / 1e3 : 0.0;
  return 0;
}

}  // extern "C"

#endif  // BLINK_LOOP_BENCH_CUH
