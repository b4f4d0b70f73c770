// Measuring helpers shared by the loop's library (kernels/csrc/persistent_loop.cu: BLINK_LOOP_PLAIN_EDGES,
// blink_loop_bench_mechanism) and the benchmark's WHILE replay (bench/while_mechanism.cu), which are built
// apart (with and without -rdc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

// The programmatic edges of a child graph node's graph (the node's own copy) made plain ones (measuring:
// BLINK_LOOP_PLAIN_EDGES, and conditional bodies that might refuse them).
static inline cudaError_t blink_plain_edges(cudaGraphNode_t child) {
  cudaGraph_t g;
  size_t n = 0;
  cudaError_t err = cudaGraphChildGraphNodeGetGraph(child, &g);
  if (err == cudaSuccess) err = cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n);
  if (err != cudaSuccess || n == 0) return err;
  cudaGraphNode_t* from = (cudaGraphNode_t*)malloc(sizeof(cudaGraphNode_t) * 2 * n);
  cudaGraphEdgeData* data = (cudaGraphEdgeData*)malloc(sizeof(cudaGraphEdgeData) * n);
  if (!from || !data) {
    free(from);
    free(data);
    return cudaErrorMemoryAllocation;
  }
  cudaGraphNode_t* to = from + n;
  err = cudaGraphGetEdges(g, from, to, data, &n);
  for (size_t i = 0; i < n && err == cudaSuccess; ++i) {
    if (data[i].type == cudaGraphDependencyTypeDefault) continue;
    err = cudaGraphRemoveDependencies(g, &from[i], &to[i], &data[i], 1);
    if (err == cudaSuccess) err = cudaGraphAddDependencies(g, &from[i], &to[i], nullptr, 1);
  }
  free(from);
  free(data);
  return err;
}

// GPU time per iteration (CUDA events) of `graph`, instantiated with `flags` and uploaded to `stream`, after a
// warm-up round of 3: each round stores the round's iteration count in *left (device memory, for a kernel in
// the graph that counts down and relaunches or ends the loop) and launches the graph once (`once`: it repeats
// itself) or that many times. The instance is destroyed after; the graph stays the caller's.
static inline cudaError_t blink_time_graph(cudaGraph_t graph, unsigned long long flags, cudaStream_t stream,
                                           uint32_t* left, uint32_t iterations, bool once, double* ns_out) {
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  cudaError_t err = cudaGraphInstantiateWithFlags(&exec, graph, flags);
  if (err == cudaSuccess) err = cudaGraphUpload(exec, stream);
  if (err == cudaSuccess) err = cudaEventCreate(&a);
  if (err == cudaSuccess) err = cudaEventCreate(&b);
  float ms = 0.0f;
  for (int round = 0; round < 2 && err == cudaSuccess; ++round) {  // the first round warms up
    const uint32_t n = round ? iterations : 3;
    err = cudaMemcpyAsync(left, &n, sizeof(n), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) err = cudaEventRecord(a, stream);
    for (uint32_t i = 0; i < (once ? 1u : n) && err == cudaSuccess; ++i) err = cudaGraphLaunch(exec, stream);
    if (err == cudaSuccess) err = cudaEventRecord(b, stream);
    if (err == cudaSuccess) err = cudaEventSynchronize(b);
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, a, b);
  }
  if (err == cudaSuccess) *ns_out = 1e6 * (double)ms / iterations;
  if (a) cudaEventDestroy(a);
  if (b) cudaEventDestroy(b);
  if (exec) cudaGraphExecDestroy(exec);
  return err;
}
