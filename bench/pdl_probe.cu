// BENCHMARK-ONLY (bench/pdl_probe.py, issue 22): a captured chain of kernels, with or without programmatic
// dependent launch, run the ways the project runs its bucket graphs. The graph (a PyTorch capture) goes into a
// graph of its own as a child node, as the persistent loop's bucket graphs do:
//
//   mode 0: the child, instantiated plainly, launched from the host back to back
//   mode 1: the child, instantiated with cudaGraphInstantiateFlagDeviceLaunch, launched from the host
//   mode 2: mode 1 plus a one-thread kernel after the child that tail-launches the graph again until a
//           countdown ends (the loop's relaunch from the device, without its work), launched once
//
// plain_edges: the child's programmatic edges made plain ones first (whether device launch refuses them, and
// what the PDL kernels cost without the edges). Built with -rdc (device graph launch) by bench/pdl_probe.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "blink_graph_measure.cuh"

// a failed step returns 1000 * its number + the CUDA error code (the error is the finding)
#define TRY(call, code)                                   \
  do {                                                    \
    cudaError_t err_ = (call);                            \
    if (err_ != cudaSuccess) return 1000 * (code) + err_; \
  } while (0)

__global__ void pdl_relaunch(uint32_t* left) {
  if (--*left != 0) cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
}

extern "C" {

// The edges of `graph` by type: *plain_out default edges, *programmatic_out the others (programmatic and
// programmatic-launch ports). Returns 0 or a CUDA error code.
int blink_pdl_edges(void* graph, uint64_t* plain_out, uint64_t* programmatic_out) {
  size_t n = 0;
  TRY(cudaGraphGetEdges((cudaGraph_t)graph, nullptr, nullptr, nullptr, &n), 0);
  *plain_out = *programmatic_out = 0;
  if (n == 0) return 0;
  cudaGraphNode_t* ends = new cudaGraphNode_t[2 * n];
  cudaGraphEdgeData* data = new cudaGraphEdgeData[n];
  cudaError_t err = cudaGraphGetEdges((cudaGraph_t)graph, ends, ends + n, data, &n);
  for (size_t i = 0; i < n && err == cudaSuccess; ++i) {
    const bool plain = data[i].type == cudaGraphDependencyTypeDefault && data[i].from_port == 0;
    ++*(plain ? plain_out : programmatic_out);
  }
  delete[] ends;
  delete[] data;
  return err;
}

// `child` (a cudaGraph_t) run as `mode` says, `iterations` times after a warm-up; *ns_out: GPU time per
// iteration (CUDA events). Returns 0, or 1000 * the failed step + the CUDA error code: step 3 building the
// graph, 4 instantiating, uploading or launching it (whether the graph is accepted as built), 5 (no CUDA
// error) the device relaunch stopped before the countdown ended.
int blink_pdl_time(void* child, uint32_t iterations, uint32_t mode, uint32_t plain_edges, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t graph;
  cudaGraphNode_t child_node, relaunch_node;
  uint32_t* left = nullptr;
  TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), 1);
  TRY(cudaMalloc(&left, sizeof(uint32_t)), 2);
  TRY(cudaGraphCreate(&graph, 0), 3);
  TRY(cudaGraphAddChildGraphNode(&child_node, graph, nullptr, 0, (cudaGraph_t)child), 3);
  if (plain_edges) TRY(blink_plain_edges(child_node), 3);
  const bool relaunched = mode == 2;
  if (relaunched) {
    cudaKernelNodeParams k = {};
    void* args[] = {&left};
    k.func = (void*)pdl_relaunch;
    k.gridDim = dim3(1);
    k.blockDim = dim3(1);
    k.kernelParams = args;
    TRY(cudaGraphAddKernelNode(&relaunch_node, graph, &child_node, 1, &k), 3);
  }
  const unsigned long long flags = mode == 0 ? 0 : cudaGraphInstantiateFlagDeviceLaunch;
  cudaError_t err = blink_time_graph(graph, flags, stream, left, iterations, relaunched, ns_out);
  uint32_t left_after = 0;  // a device launch that fails does so silently: the countdown stops short
  if (err == cudaSuccess) err = cudaMemcpy(&left_after, left, sizeof(left_after), cudaMemcpyDeviceToHost);
  cudaGraphDestroy(graph);
  cudaFree(left);
  cudaStreamDestroy(stream);
  if (err != cudaSuccess) return 1000 * 4 + err;
  return relaunched && left_after != 0 ? 1000 * 5 : 0;
}

// The driver's and this library's runtime's CUDA versions (1000 * major + 10 * minor); 0 or a CUDA error code.
int blink_pdl_versions(int* driver_out, int* runtime_out) {
  TRY(cudaDriverGetVersion(driver_out), 0);
  TRY(cudaRuntimeGetVersion(runtime_out), 0);
  return 0;
}

// cudaGetErrorName of a code from the functions above (the part below 1000)
const char* blink_pdl_error_name(int code) { return cudaGetErrorName((cudaError_t)(code % 1000)); }

}  // extern "C"
