// How much time does each way of running one graph after another put between them? (bench, issue 4)
//
// A synthetic step graph (a first kernel that stamps its start, `--kernels` spinning kernels of 132 blocks,
// a one-block last kernel that stamps its end, i.e. the "sampler") is run `--iters` times by each mechanism,
// and the gap from one step's last kernel ending to the next step's first kernel starting is recorded
// (%globaltimer, one clock for every kernel). The variants are the pieces of the persistent loop's graph
// (kernels/csrc/persistent_loop.cu), added one at a time:
//
//   host          cudaGraphLaunch back to back from the host (what "bare replay" means in bench/gpu_host.py)
//   ws            WHILE { SWITCH { G } }, the last kernel sets the handles
//   ws_take       WHILE { SWITCH { G, take } }: a take kernel (64 threads) starts before the last two
//                 kernels, waits for the last kernel's flag, sets the handles
//   wis_take      WHILE { IF(0) -> SWITCH { G, take } }  (the IF node of the full step, not taken)
//   wis_take_par  WHILE { IF(0) -> SWITCH { G, take } ; IF -> publish -> spec }  (the loop as it is)
//   ws_take_in    WHILE { SWITCH { G, take, publish -> spec } }  (publish and spec inside the branch)
//   dev_tail      G instantiated for device launch; its last kernel tail-launches G again
//   dev_take      the same launch from a take kernel (as above)
//   dev_take_par  + publish -> spec kernels beside G (as in the loop); _prio: + node priorities for take,
//                 publish and spec (cudaGraphInstantiateFlagUseNodePriority)
//   dev_side_after_first  publish -> spec after G's first kernel instead of beside it
//   dev_stamp_root        dev_take + one tiny root kernel (does a second root cost what publish -> spec does?)
//   dev_child             dev_take_par with G (and its take kernel) as a child graph node, as in the loop
//   dev_take_early        dev_take, but the take kernel launches as it starts, before the last kernel's flag
//                         (the loop's asynchronous take)
//   dev_sibling_gate      two instances of G, each headed by a one-block gate kernel; the take kernel launches
//                         the other instance at once as a sibling (cudaStreamGraphFireAndForgetAsSibling), whose
//                         gate spins until this take has seen the last kernel's flag: no graph end, no tail
//                         launch between the steps. Measured: it stops after 121 steps (the host's launch and
//                         120 siblings: device launches are limited per launch environment), so the loop
//                         cannot run on it; reported as steps_done
//   launch_call_us: the device-side cudaGraphLaunch call's own time
//
// Build and run (needs a GPU; nvcc 13, sm_90); dev_tail is a build of its own (host is measured in both):
//   nvcc -O2 -gencode arch=compute_90,code=sm_90 bench/loop_mechanism.cu -o /tmp/loop_mechanism
//   nvcc -O2 -rdc=true -DDEV_TAIL -gencode arch=compute_90,code=sm_90 bench/loop_mechanism.cu -o /tmp/loop_tail -lcudadevrt
//   /tmp/loop_mechanism [--kernels 40] [--iters 300] [--spin-ns 3000]   (prints one JSON object)
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

constexpr int kMaxIters = 4096;

struct Probe {
  uint64_t start[kMaxIters];  // first kernel of step i starts
  uint64_t end[kMaxIters];    // last kernel of step i ends
  uint32_t step;              // steps done
  uint32_t left;              // WHILE / tail launch: steps still to run
  uint32_t last_done;         // the last kernel's flag for the take kernel (step number + 1)
  uint32_t taken;             // steps seen by the take kernel
  uint64_t launch_ns;         // dev_*: time in the device-side cudaGraphLaunch calls
  uint32_t mode;              // 0: nothing, 1: the last kernel sets the handles, 2: the take kernel does,
                              // 3: the last kernel tail-launches `self`, 4: the take kernel does
  uint32_t has_full;          // the IF node's handle exists (a handle no node uses fails the instantiation)
  cudaGraphConditionalHandle loop, branch, full;
  cudaGraphExec_t self;       // dev_tail
  cudaGraphExec_t other[2];   // dev_sibling_gate: the two instances
  uint32_t go;                // dev_sibling_gate: steps whose last kernel the take kernels have seen
  uint32_t gated;             // dev_sibling_gate: gates passed
};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void spin(uint32_t ns) {
  const uint64_t until = now_ns() + ns;
  while (now_ns() < until) {
  }
}

__global__ void first_kernel(Probe* p, uint32_t ns) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p->start[*(volatile uint32_t*)&p->step] = now_ns();
  spin(ns);
}

__global__ void work_kernel(uint32_t ns) { spin(ns); }

__device__ void set_handles(Probe* p, uint32_t left) {
  cudaGraphSetConditional(p->branch, 0);
  if (p->has_full) cudaGraphSetConditional(p->full, 0);
  cudaGraphSetConditional(p->loop, left > 0);
}

// the "sampler": one block, like the last kernels of a decode step
__device__ void last_common(Probe* p, uint32_t ns) {
  spin(ns);
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile Probe* q = p;
    const uint32_t step = q->step;
    const uint32_t left = q->left - 1;
    q->left = left;
    q->step = step + 1;
    if (p->mode == 1) set_handles(p, left);
    __threadfence();
    p->end[step] = now_ns();
    *(volatile uint32_t*)&p->last_done = step + 1;
  }
}

__global__ void last_kernel(Probe* p, uint32_t ns) { last_common(p, ns); }

#ifdef DEV_TAIL
// dev_tail's. A module built with -rdc for device launch cannot instantiate the conditional variants
// (invalid argument), and a kernel that may launch graphs slows host replays too (1.8 -> 5.1 us of gap),
// so dev_tail is a build of its own.
__device__ void launch_self(Probe* p) {
  const cudaGraphExec_t self = p->self;
  if (*(volatile uint32_t*)&p->left == 0) return;
  const uint64_t t = now_ns();
  cudaGraphLaunch(self, cudaStreamGraphTailLaunch);
  p->launch_ns += now_ns() - t;
}

__global__ void last_tail_kernel(Probe* p, uint32_t ns) {
  last_common(p, ns);
  if (threadIdx.x == 0 && p->mode == 3) launch_self(p);
}

// dev_take*: like take_kernel, then the tail launch
__global__ void take_tail_kernel(Probe* p) {
  if (threadIdx.x == 0) {
    const uint32_t want = ++p->taken;
    while (*(volatile uint32_t*)&p->last_done != want) {
    }
    launch_self(p);
  }
}
// dev_take_early: the launch first, then the wait (the flag still gates the kernel's end)
__global__ void take_early_kernel(Probe* p) {
  if (threadIdx.x == 0) {
    const uint32_t want = ++p->taken;
    if (*(volatile uint32_t*)&p->left > 1) {  // this step's last kernel takes `left` to left - 1
      const uint64_t t = now_ns();
      cudaGraphLaunch(p->self, cudaStreamGraphTailLaunch);
      p->launch_ns += now_ns() - t;
    }
    while (*(volatile uint32_t*)&p->last_done != want) {
    }
  }
}

// dev_sibling_gate: launch the other instance now, as a sibling; open its gate once the last kernel is done
__global__ void take_sibling_kernel(Probe* p) {
  if (threadIdx.x == 0) {
    const uint32_t want = ++p->taken;
    if (*(volatile uint32_t*)&p->left > 1) {
      const uint64_t t = now_ns();
      cudaGraphLaunch(p->other[want % 2], cudaStreamGraphFireAndForgetAsSibling);
      p->launch_ns += now_ns() - t;
    }
    while (*(volatile uint32_t*)&p->last_done != want) {
    }
    __threadfence();
    *(volatile uint32_t*)&p->go = want;
  }
}

__global__ void gate_kernel(Probe* p) {
  if (threadIdx.x == 0) {
    const uint32_t k = p->gated++;
    while (*(volatile uint32_t*)&p->go < k) {
    }
    __threadfence();
  }
}
#else
__global__ void last_tail_kernel(Probe*, uint32_t) {}
__global__ void take_tail_kernel(Probe*) {}
__global__ void take_early_kernel(Probe*) {}
__global__ void take_sibling_kernel(Probe*) {}
__global__ void gate_kernel(Probe*) {}
#endif

// started two kernels before the end: waits for the last kernel, then sets the handles (blink_loop_take)
__global__ void take_kernel(Probe* p) {
  if (threadIdx.x == 0) {
    const uint32_t want = ++p->taken;  // not step + 1: this kernel may start after the last one ended
    while (*(volatile uint32_t*)&p->last_done != want) {
    }
    set_handles(p, *(volatile uint32_t*)&p->left);
  }
}

__global__ void side_kernel(uint32_t ns) {
  if (threadIdx.x == 0) spin(ns);
}

struct Built {
  cudaGraph_t g;
  cudaGraphNode_t first;        // the first kernel
  cudaGraphNode_t before_tail;  // the node two before the last kernel
};

// G: [gate ->] first -> work x n -> last, in `g`
static Built add_step(cudaGraph_t g, Probe* p, int n, uint32_t ns, bool tail = false, bool gate = false) {
  Built b = {g, nullptr, nullptr};
  cudaKernelNodeParams k = {};
  void* args_p[] = {&p, &ns};
  void* args_w[] = {&ns};
  void* args_g[] = {&p};
  cudaGraphNode_t prev = nullptr, node;
  if (gate) {
    k.func = (void*)gate_kernel;
    k.gridDim = dim3(1);
    k.blockDim = dim3(32);
    k.kernelParams = args_g;
    CHECK(cudaGraphAddKernelNode(&prev, g, nullptr, 0, &k));
  }
  k.func = (void*)first_kernel;
  k.gridDim = dim3(132);
  k.blockDim = dim3(256);
  k.kernelParams = args_p;
  CHECK(cudaGraphAddKernelNode(&node, g, prev ? &prev : nullptr, prev ? 1 : 0, &k));
  prev = b.first = node;
  for (int i = 0; i < n; ++i) {
    k.func = (void*)work_kernel;
    k.kernelParams = args_w;
    CHECK(cudaGraphAddKernelNode(&node, g, &prev, 1, &k));
    if (i == n - 2) b.before_tail = node;
    prev = node;
  }
  k.func = tail ? (void*)last_tail_kernel : (void*)last_kernel;
  k.gridDim = dim3(1);
  k.kernelParams = args_p;
  CHECK(cudaGraphAddKernelNode(&node, g, &prev, 1, &k));
  return b;
}

static void add_kernel(cudaGraph_t g, const cudaGraphNode_t* dep, int ndep, void* func, void** args, int threads,
                       cudaGraphNode_t* out) {
  cudaKernelNodeParams k = {};
  k.func = func;
  k.gridDim = dim3(1);
  k.blockDim = dim3(threads);
  k.kernelParams = args;
  CHECK(cudaGraphAddKernelNode(out, g, dep, ndep, &k));
}

static cudaGraph_t add_conditional(cudaGraph_t g, const cudaGraphNode_t* dep, int ndep,
                                   cudaGraphConditionalHandle h, cudaGraphConditionalNodeType type,
                                   cudaGraphNode_t* out) {
  cudaGraphNodeParams c = {};
  c.type = cudaGraphNodeTypeConditional;
  c.conditional.handle = h;
  c.conditional.type = type;
  c.conditional.size = 1;
  CHECK(cudaGraphAddNode(out, g, dep, nullptr, ndep, &c));
  return c.conditional.phGraph_out[0];
}

struct Opts {
  int kernels = 40, iters = 300;
  uint32_t spin_ns = 3000, side_ns = 20000;
};

static void report(const char* name, const Probe* h, int iters, bool first) {
  const double launch_us = h->launch_ns / 1e3 / (iters - 1);
  std::vector<double> gap, step;
  for (int i = 1; i < iters; ++i) {
    gap.push_back((double)(h->start[i] - h->end[i - 1]) / 1e3);
    step.push_back((double)(h->start[i] - h->start[i - 1]) / 1e3);
  }
  std::sort(gap.begin(), gap.end());
  std::sort(step.begin(), step.end());
  auto q = [](const std::vector<double>& v, double f) { return v[(size_t)(f * (v.size() - 1))]; };
  printf("%s\"%s\": {\"gap_us_p10\": %.2f, \"gap_us_p50\": %.2f, \"gap_us_p90\": %.2f, \"step_us_p50\": %.2f, "
         "\"launch_call_us\": %.2f}",
         first ? "" : ", ", name, q(gap, 0.1), q(gap, 0.5), q(gap, 0.9), q(step, 0.5), launch_us);
  fflush(stdout);
}

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--kernels")) o.kernels = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--iters")) o.iters = std::min(atoi(argv[i + 1]), kMaxIters);
    if (!strcmp(argv[i], "--spin-ns")) o.spin_ns = (uint32_t)atoi(argv[i + 1]);
  }
  Probe* p = nullptr;
  CHECK(cudaMalloc(&p, sizeof(Probe)));
  Probe* h = (Probe*)malloc(sizeof(Probe));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int least = 0, greatest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const char* names[] = {"host",     "ws",       "ws_take",      "wis_take",          "wis_take_par",
                         "ws_take_in", "dev_tail", "dev_take", "dev_take_par", "dev_take_par_prio",
                         "dev_side_after_first", "dev_stamp_root", "dev_child", "dev_take_early",
                         "dev_sibling_gate"};
  printf("{\"kernels\": %d, \"iters\": %d, \"spin_ns\": %u, ", o.kernels, o.iters, o.spin_ns);
#ifdef DEV_TAIL
  const int variants[] = {0, 6, 7, 8, 9, 10, 11, 12, 13, 14};
#else
  const int variants[] = {0, 1, 2, 3, 4, 5};
#endif
  bool first = true;
  for (int v : variants) {
    for (int round = 0; round < 2; ++round) {  // the first round warms up
      memset(h, 0, sizeof(Probe));
      h->left = (uint32_t)o.iters;
      h->mode = v == 0 ? 0 : v == 1 ? 1 : v == 6 ? 3 : v >= 7 ? 4 : 2;
      cudaGraph_t top;
      CHECK(cudaGraphCreate(&top, 0));
      cudaGraphExec_t exec;
      if (v == 0 || v >= 6) {
        cudaGraph_t g = top;
        if (v == 12) CHECK(cudaGraphCreate(&g, 0));
        Built b = add_step(g, p, o.kernels, o.spin_ns, v >= 6, v == 14);
        unsigned long long flags = v >= 6 ? cudaGraphInstantiateFlagDeviceLaunch : 0;
        if (v >= 7) {  // the take kernel launches; publish -> spec beside the graph; node priorities
          Probe* pp = p;
          void* ta[] = {&pp};
          void* sa[] = {&o.side_ns};
          uint32_t zero = 0;
          void* za[] = {&zero};
          cudaGraphNode_t take, pub, spec, child;
          void* take_func = v == 13 ? (void*)take_early_kernel : v == 14 ? (void*)take_sibling_kernel
                                                                         : (void*)take_tail_kernel;
          add_kernel(g, &b.before_tail, 1, take_func, ta, 64, &take);
          if (v == 12) CHECK(cudaGraphAddChildGraphNode(&child, top, nullptr, 0, g));
          if (v == 8 || v == 9 || v == 12) {
            add_kernel(top, nullptr, 0, (void*)side_kernel, sa, 256, &pub);
            add_kernel(top, &pub, 1, (void*)side_kernel, sa, 256, &spec);
          }
          if (v == 10) {
            add_kernel(top, &b.first, 1, (void*)side_kernel, sa, 256, &pub);
            add_kernel(top, &pub, 1, (void*)side_kernel, sa, 256, &spec);
          }
          if (v == 11) add_kernel(top, nullptr, 0, (void*)side_kernel, za, 32, &pub);
          if (v == 9) {
            cudaKernelNodeAttrValue pr = {};
            pr.priority = greatest;
            for (cudaGraphNode_t n : {take, pub, spec})
              CHECK(cudaGraphKernelNodeSetAttribute(n, cudaKernelNodeAttributePriority, &pr));
            flags |= cudaGraphInstantiateFlagUseNodePriority;
          }
        }
        CHECK(cudaGraphInstantiateWithFlags(&exec, top, flags));
        if (v == 12) CHECK(cudaGraphDestroy(g));
        h->self = h->other[0] = h->other[1] = exec;
        if (v == 14) {
          CHECK(cudaGraphInstantiateWithFlags(&h->other[1], top, flags));
          CHECK(cudaGraphUpload(h->other[1], s));
        }
      } else {
        CHECK(cudaGraphConditionalHandleCreate(&h->loop, top, 1, cudaGraphCondAssignDefault));
        CHECK(cudaGraphConditionalHandleCreate(&h->branch, top, 0, cudaGraphCondAssignDefault));
        cudaGraphNode_t w, iff = nullptr, sw, take, pub, spec;
        cudaGraph_t body = add_conditional(top, nullptr, 0, h->loop, cudaGraphCondTypeWhile, &w);
        h->has_full = v == 3 || v == 4;
        if (h->has_full) {
          CHECK(cudaGraphConditionalHandleCreate(&h->full, top, 0, cudaGraphCondAssignDefault));
          cudaGraph_t then = add_conditional(body, nullptr, 0, h->full, cudaGraphCondTypeIf, &iff);
          uint32_t ns = 1000;
          void* a[] = {&ns};
          cudaGraphNode_t n;
          add_kernel(then, nullptr, 0, (void*)side_kernel, a, 64, &n);
        }
        cudaGraph_t branch = add_conditional(body, iff ? &iff : nullptr, iff ? 1 : 0, h->branch,
                                             cudaGraphCondTypeSwitch, &sw);
        Built b = add_step(branch, p, o.kernels, o.spin_ns);
        Probe* pp = p;
        void* ta[] = {&pp};
        if (v >= 2) {
          add_kernel(branch, &b.before_tail, 1, (void*)take_kernel, ta, 64, &take);
          cudaKernelNodeAttrValue pr = {};
          pr.priority = greatest;
          CHECK(cudaGraphKernelNodeSetAttribute(take, cudaKernelNodeAttributePriority, &pr));
        }
        void* sa[] = {&o.side_ns};
        if (v == 4) {
          add_kernel(body, &iff, 1, (void*)side_kernel, sa, 256, &pub);
          add_kernel(body, &pub, 1, (void*)side_kernel, sa, 256, &spec);
        }
        if (v == 5) {
          add_kernel(branch, nullptr, 0, (void*)side_kernel, sa, 256, &pub);
          add_kernel(branch, &pub, 1, (void*)side_kernel, sa, 256, &spec);
        }
        CHECK(cudaGraphInstantiateWithFlags(&exec, top, 0));
      }
      CHECK(cudaMemcpy(p, h, sizeof(Probe), cudaMemcpyHostToDevice));
      CHECK(cudaGraphUpload(exec, s));
      CHECK(cudaStreamSynchronize(s));
      if (v == 0) {
        for (int i = 0; i < o.iters; ++i) CHECK(cudaGraphLaunch(exec, s));
      } else {
        CHECK(cudaGraphLaunch(exec, s));
      }
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaMemcpy(h, p, sizeof(Probe), cudaMemcpyDeviceToHost));
      const bool short_run = h->step != (uint32_t)o.iters;
      if (short_run) {
        fprintf(stderr, "%s (round %d): %u steps of %d\n", names[v], round, h->step, o.iters);
        if (round == 1 && v != 14) exit(1);
      }
      if (round == 1 && short_run) {  // dev_sibling_gate: the launches stop being made (a limit per environment)
        printf("%s\"%s\": {\"steps_done\": %u}", first ? "" : ", ", names[v], h->step);
        first = false;
      } else if (round == 1) {
        report(names[v], h, o.iters, first);
        first = false;
      }
      CHECK(cudaGraphExecDestroy(exec));
      if (h->other[1] && h->other[1] != exec) CHECK(cudaGraphExecDestroy(h->other[1]));
      CHECK(cudaGraphDestroy(top));
    }
  }
  printf("}\n");
  return 0;
}
