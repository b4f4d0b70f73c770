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

#include "blink_graph_measure.cuh"

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

// child: a cudaGraph_t (PyTorch's capture); *ns_out: GPU time per iteration (CUDA events), after a warm-up launch.
extern "C" int blink_bench_while(void* child, uint32_t iterations, uint32_t mode, double* ns_out) {
  cudaStream_t stream;
  cudaGraph_t top, body, inner;
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
  if (mode & 2) TRY(blink_plain_edges(child_node), 20);
  if (!with_switch) step_node = child_node;
  int set_branch = with_switch;
  void* args[] = {&loop, &branch, &left, &set_branch};
  cudaKernelNodeParams k = {};
  k.func = (void*)while_countdown;
  k.gridDim = dim3(1);
  k.blockDim = dim3(1);
  k.kernelParams = args;
  TRY(cudaGraphAddKernelNode(&count_node, body, &step_node, 1, &k), 9);
  TRY(blink_time_graph(top, 0, stream, left, iterations, true, ns_out), 10);
  cudaGraphDestroy(top);
  cudaFree(left);
  cudaStreamDestroy(stream);
  return 0;
}
