// BENCHMARK-ONLY (bench/loop_ab.py): the bare bucket graph repeated by a conditional WHILE node of a graph
// launched once from the host, the GPU-resident loop's other mechanism (the loop used it before device graph
// launch). Nothing here is device-launchable: a module built with -rdc cannot instantiate conditional nodes,
// so this file is built on its own, without it (kernels/csrc/persistent_loop.cu is built with it).
//
//   mode 0: WHILE { child -> countdown }                 (the mechanism alone)
//   mode 1: WHILE { SWITCH { child } -> countdown }      (the loop's former shape: the kernel after the step
//                                                         sets the next step's branch)
//   mode 2, 3: modes 0, 1 with the child's programmatic edges made plain ones (if a body refuses them)
//
// The countdown kernel, one thread, ends the loop after `iterations` bodies; in mode 1 it also sets the
// SWITCH's branch each time, as the take kernel set the next bucket.
#include <cuda_runtime.h>

#include <cstdint>

// a failed step returns 1000 * its number + the CUDA error code
#define TRY(call, code)                                  \
  do {                                                   \
    cudaError_t err_ = (call);                           \
    if (err_ != cudaSuccess) return 1000 * (code) + err_; \
  } while (0)

__global__ void while_countdown(cudaGraphConditionalHandle loop, cudaGraphConditionalHandle branch, uint32_t* left,
                                int set_branch) {
  if (set_branch) cudaGraphSetConditional(branch, 0);
  if (--*left == 0) cudaGraphSetConditional(loop, 0);
}

static cudaError_t add_conditional(cudaGraphNode_t* node, cudaGraph_t g, cudaGraphConditionalHandle h,
                                   cudaGraphConditionalNodeType type, cudaGraph_t* body) {
  cudaGraphNodeParams p = {};
  p.type = cudaGraphNodeTypeConditional;
  p.conditional.handle = h;
  p.conditional.type = type;
  p.conditional.size = 1;
  cudaError_t err = cudaGraphAddNode(node, g, nullptr, nullptr, 0, &p);
  if (err == cudaSuccess) *body = p.conditional.phGraph_out[0];
  return err;
}

// The programmatic edges of the child node's graph (its own copy) made plain ones.
static cudaError_t plain_edges(cudaGraphNode_t child) {
  cudaGraph_t g;
  size_t n = 0;
  cudaError_t err = cudaGraphChildGraphNodeGetGraph(child, &g);
  if (err == cudaSuccess) err = cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n);
  if (err != cudaSuccess || n == 0) return err;
  cudaGraphNode_t* from = new cudaGraphNode_t[2 * n];
  cudaGraphNode_t* to = from + n;
  cudaGraphEdgeData* data = new cudaGraphEdgeData[n];
  err = cudaGraphGetEdges(g, from, to, data, &n);
  for (size_t i = 0; i < n && err == cudaSuccess; ++i) {
    if (data[i].type == cudaGraphDependencyTypeDefault) continue;
    err = cudaGraphRemoveDependencies(g, &from[i], &to[i], &data[i], 1);
    if (err == cudaSuccess) err = cudaGraphAddDependencies(g, &from[i], &to[i], nullptr, 1);
  }
  delete[] from;
  delete[] data;
  return err;
}

// child: a cudaGraph_t (PyTorch's capture); *ns_out: GPU time per iteration (CUDA events), after a warm-up launch.
extern "C" int blink_bench_while(void* child, uint32_t iterations, uint32_t mode, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t top, body, inner;
  cudaGraphExec_t exec;
  cudaGraphConditionalHandle loop, branch;
  cudaGraphNode_t while_node, step_node, count_node;
  uint32_t* left = nullptr;
  TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), 1);
  TRY(cudaMalloc(&left, sizeof(uint32_t)), 2);
  TRY(cudaGraphCreate(&top, 0), 3);
  TRY(cudaGraphConditionalHandleCreate(&loop, top, 1, cudaGraphCondAssignDefault), 4);
  TRY(cudaGraphConditionalHandleCreate(&branch, top, 0, cudaGraphCondAssignDefault), 5);
  TRY(add_conditional(&while_node, top, loop, cudaGraphCondTypeWhile, &body), 6);
  const bool with_switch = mode & 1;
  if (with_switch) {
    TRY(add_conditional(&step_node, body, branch, cudaGraphCondTypeSwitch, &inner), 7);
  } else {
    inner = body;
  }
  cudaGraphNode_t child_node;
  TRY(cudaGraphAddChildGraphNode(&child_node, inner, nullptr, 0, (cudaGraph_t)child), 8);
  if (mode & 2) TRY(plain_edges(child_node), 20);
  if (!with_switch) step_node = child_node;
  int set_branch = with_switch;
  void* args[] = {&loop, &branch, &left, &set_branch};
  cudaKernelNodeParams k = {};
  k.func = (void*)while_countdown;
  k.gridDim = dim3(1);
  k.blockDim = dim3(1);
  k.kernelParams = args;
  TRY(cudaGraphAddKernelNode(&count_node, body, &step_node, 1, &k), 9);
  TRY(cudaGraphInstantiateWithFlags(&exec, top, 0), 10);
  TRY(cudaGraphUpload(exec, stream), 11);
  cudaEvent_t a, b;
  TRY(cudaEventCreate(&a), 12);
  TRY(cudaEventCreate(&b), 13);
  float ms = 0.0f;
  for (int round = 0; round < 2; ++round) {  // the first round warms up
    const uint32_t n = round ? iterations : 3;
    TRY(cudaMemcpyAsync(left, &n, sizeof(n), cudaMemcpyHostToDevice, stream), 14);
    TRY(cudaEventRecord(a, stream), 15);
    TRY(cudaGraphLaunch(exec, stream), 16);
    TRY(cudaEventRecord(b, stream), 17);
    TRY(cudaEventSynchronize(b), 18);
    TRY(cudaEventElapsedTime(&ms, a, b), 19);
  }
  *ns_out = 1e6 * (double)ms / iterations;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(top);
  cudaFree(left);
  cudaStreamDestroy(stream);
  return 0;
}
