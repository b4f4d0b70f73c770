// Tensor parallelism inside one process: the ranks' GPUs of one host, linked by peer access (NVLink), with no
// host work per step in either mode. gpu_backend/parallel/ drives this file through kernels/tp_comm.py.
//
// Three kernels go into the ranks' captured step graphs (so the same graphs serve host and persistent mode):
//   announce   (the leader, rank 0, first node of each model graph; set and bucket are capture-time constants)
//              pushes the used prefix of the step buffer the graph reads into every follower's step buffer of
//              the same set, then publishes {step number, set, bucket} in each follower's mailbox, release at
//              system scope, the word last (the ring's rule).
//   wait       (each follower, first node of each model graph) waits until its mailbox shows the next step.
//   all-reduce (every rank, after the attention output and the MLP's down projection) one-shot over peer
//              memory: each block copies its chunk of x into this rank's exchange buffer, raises its flag in
//              every peer, waits for theirs, and sums the ranks' chunks in rank order (float32), so that every
//              rank ends with the same bits. Two exchange buffers alternate by the block's epoch: a rank can
//              rewrite one only after the next barrier, which every peer passes only after its reads.
// In persistent mode each follower runs its own small device-launched chain: a dispatch kernel waits for the
// mailbox and tail-launches the branch of that (set, bucket): the follower's captured graph, then a kernel that
// tail-launches the dispatch again. The leader is the ordinary GPU-resident loop, whose graphs announce.
// No multicast objects: only peer access (cudaDeviceEnablePeerAccess) and plain loads and stores.
//
// Failure: a wait or a barrier longer than the timeout sets the shared fault word (host-mapped) to
// 1 + the waiting rank and returns; after that no kernel waits (the step's numbers are garbage and the host,
// which watches the word, stops the model and fails what is in flight). `live` 0 (start-up: sizing, warm-up,
// capture run each rank alone) makes the three kernels do nothing.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blink_sys_mem.cuh"  // ld_v, acquire/release at system scope, now_ns

#define BLINK_TP_MAX_RANKS 8
#define BLINK_TP_BLOCKS 32    // all-reduce blocks, each with its own flags and epoch
#define BLINK_TP_THREADS 512
#define BLINK_TP_COPY_THREADS 1024

struct blink_tp_ctl {           // host-mapped, shared by every rank; read by kernels only while they spin
  uint32_t fault, stop;
};
struct blink_tp_state {         // device memory of each rank: what every kernel reads as it starts (a read of
  uint32_t live, fault;         // host memory from 32 blocks at once costs tens of microseconds)
};

struct blink_tp_rank {          // device memory of its rank; every kernel gets its address
  uint32_t rank, world;
  uint64_t cap_elems;           // exchange buffer capacity per parity, in 16-bit elements
  uint64_t timeout_ns;
  uint16_t* bufs[BLINK_TP_MAX_RANKS][2];   // every rank's exchange buffers
  uint32_t* flags[BLINK_TP_MAX_RANKS];     // every rank's flags: [source rank][block]
  uint64_t* mailbox[BLINK_TP_MAX_RANKS];   // every rank's mailbox: step << 16 | set << 8 | bucket
  uint8_t* step_bufs[BLINK_TP_MAX_RANKS][2];  // every rank's step buffers (by set)
  uint64_t block_tables_offset, block_row_bytes, num_seqs_offset;  // the step buffer's layout
  blink_tp_ctl* ctl;
  blink_tp_state* state[BLINK_TP_MAX_RANKS];  // every rank's
  uint32_t epoch[BLINK_TP_BLOCKS];         // this rank's all-reduce count per block
  uint64_t announced;           // leader: steps announced
  uint64_t consumed;            // follower: steps waited for
  cudaGraphExec_t dispatch;     // follower loop (persistent mode)
  cudaGraphExec_t* branches;    // [2 * num_buckets] device array: set * num_buckets + bucket
  uint32_t num_buckets;
};

__device__ __forceinline__ bool quiet(const blink_tp_rank* R) {
  const blink_tp_state* s = R->state[R->rank];
  return !ld_v(&s->live) || ld_v(&s->fault);
}
// A rank waited past the timeout: every rank's state and the host's word say so (first writer wins the host's).
__device__ void raise_fault(const blink_tp_rank* R) {
  for (uint32_t q = 0; q < R->world; ++q) *(volatile uint32_t*)&R->state[q]->fault = 1u + R->rank;
  atomicCAS((unsigned int*)&R->ctl->fault, 0u, 1u + R->rank);
  __threadfence_system();
}
// false on timeout (the fault word is set): the caller goes on without the peer
__device__ __forceinline__ bool timed_out(const blink_tp_rank* R, uint64_t start, uint32_t* spins) {
  if ((++*spins & 1023u) != 0) return false;
  if (ld_v(&R->state[R->rank]->fault)) return true;  // (not `stop`: no all-reduce is left waiting by a clean stop)
  if (now_ns() - start < R->timeout_ns) return false;
  raise_fault(R);
  return true;
}

// ---- the all-reduce ---------------------------------------------------------------------------------------
__device__ __forceinline__ void add8(float* acc, uint4 v, bool fp16) {
  const uint16_t* h = (const uint16_t*)&v;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (fp16) acc[k] += __half2float(*(const __half*)&h[k]);
    else acc[k] += __uint_as_float((uint32_t)h[k] << 16);
  }
}
__device__ __forceinline__ uint4 pack8(const float* acc, bool fp16) {
  uint4 out;
  uint16_t* h = (uint16_t*)&out;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (fp16) {
      __half v = __float2half_rn(acc[k]);
      h[k] = *(uint16_t*)&v;
    } else {  // round to nearest even, as torch does
      const uint32_t u = __float_as_uint(acc[k]);
      h[k] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  return out;
}

__global__ void __launch_bounds__(BLINK_TP_THREADS) blink_tp_allreduce_kernel(blink_tp_rank* R, uint4* x, uint64_t nvec,
                                                                             uint32_t fp16) {
  __shared__ uint32_t sh_epoch, sh_skip;
  const uint32_t b = blockIdx.x, me = R->rank, world = R->world;
  if (threadIdx.x == 0) {
    sh_skip = quiet(R);
    if (!sh_skip) sh_epoch = ++R->epoch[b];
  }
  __syncthreads();
  if (sh_skip) return;
  const uint32_t e = sh_epoch, par = e & 1u;
  const uint64_t per = (nvec + gridDim.x - 1) / gridDim.x, lo = b * per, hi = lo + per < nvec ? lo + per : nvec;
  uint4* mine = (uint4*)R->bufs[me][par];
  for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = x[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (uint32_t q = 0; q < world; ++q)
      if (q != me) st_release_u32(&R->flags[q][me * BLINK_TP_BLOCKS + b], e);
    const uint64_t start = now_ns();
    uint32_t spins = 0;
    for (uint32_t q = 0; q < world; ++q) {
      if (q == me) continue;
      const uint32_t* f = &R->flags[me][q * BLINK_TP_BLOCKS + b];
      while ((int32_t)(ld_acquire_u32(f) - e) < 0)
        if (timed_out(R, start, &spins)) break;
    }
  }
  __syncthreads();
  const bool half = fp16 != 0;
  for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (uint32_t q = 0; q < world; ++q)
      add8(acc, q == me ? mine[i] : __ldcg((const uint4*)R->bufs[q][par] + i), half);
    x[i] = pack8(acc, half);
  }
}

// ---- announce and wait: the step buffer from the leader to the followers -----------------------------------
__global__ void __launch_bounds__(BLINK_TP_COPY_THREADS) blink_tp_announce_kernel(blink_tp_rank* R, uint32_t set,
                                                                                 uint32_t bucket) {
  __shared__ uint32_t sh_skip;
  if (threadIdx.x == 0) sh_skip = quiet(R);
  __syncthreads();
  if (sh_skip) return;
  const uint8_t* src = R->step_bufs[0][set];
  const int32_t num_seqs = *(const int32_t*)(src + R->num_seqs_offset);
  const uint64_t bytes = R->block_tables_offset + (uint64_t)(num_seqs > 0 ? num_seqs : 0) * R->block_row_bytes;
  const uint64_t nvec = bytes / 16;  // the layout is 16-byte aligned (STEP_ALIGN)
  for (uint32_t q = 1; q < R->world; ++q) {
    uint4* dst = (uint4*)R->step_bufs[q][set];
    for (uint64_t i = threadIdx.x; i < nvec; i += blockDim.x) dst[i] = ((const uint4*)src)[i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint64_t step = ++R->announced;
    for (uint32_t q = 1; q < R->world; ++q) st_release_u64(R->mailbox[q], step << 16 | (uint64_t)set << 8 | bucket);
  }
}

// the follower's: until the mailbox shows the step after the last one waited for (or the loop stops)
__device__ uint64_t wait_mailbox(blink_tp_rank* R, bool consume) {
  const uint64_t* box = R->mailbox[R->rank];
  const uint64_t start = now_ns();
  uint32_t spins = 0;
  uint64_t word = ld_acquire_u64(box);
  while ((word >> 16) <= R->consumed) {
    if (ld_v(&R->ctl->stop)) return 0;
    if (consume && timed_out(R, start, &spins)) return 0;
    __nanosleep(200);
    word = ld_acquire_u64(box);
  }
  if (consume) R->consumed = word >> 16;
  return word;
}

__global__ void blink_tp_wait_kernel(blink_tp_rank* R) {
  if (quiet(R)) return;
  wait_mailbox(R, true);
}

// ---- the follower's loop (persistent mode) ------------------------------------------------------------------
__global__ void blink_tp_dispatch_kernel(blink_tp_rank* R) {
  const uint64_t word = wait_mailbox(R, false);  // idle waits have no timeout: the leader may have no work
  if (!word) return;                             // stop: launch nothing, the chain ends
  const uint32_t set = (uint32_t)(word >> 8) & 0xffu, bucket = (uint32_t)word & 0xffu;
  if (set > 1 || bucket >= R->num_buckets) {
    raise_fault(R);
    return;
  }
  if (cudaGraphLaunch(R->branches[set * R->num_buckets + bucket], cudaStreamGraphTailLaunch) != cudaSuccess)
    raise_fault(R);
}

__global__ void blink_tp_relaunch_kernel(blink_tp_rank* R) {
  if (cudaGraphLaunch(R->dispatch, cudaStreamGraphTailLaunch) != cudaSuccess) raise_fault(R);
}

// ---- host side --------------------------------------------------------------------------------------------
struct blink_tp {
  uint32_t world;
  int32_t devices[BLINK_TP_MAX_RANKS];
  blink_tp_rank host[BLINK_TP_MAX_RANKS];   // host copies, uploaded by sync_rank
  blink_tp_rank* dev[BLINK_TP_MAX_RANKS];
  blink_tp_ctl* ctl;                         // host-mapped
  void* owned[BLINK_TP_MAX_RANKS][5];        // bufs (2 parities in one), flags, mailbox, branches, state
};

struct blink_tp_follower {
  cudaStream_t stream;
  cudaGraph_t dispatch_graph;
  cudaGraphExec_t dispatch;
  uint32_t num_branches;
  cudaGraph_t* graphs;
  cudaGraphExec_t* execs;
  int32_t device;
};

#define TP_TRY(call)                         \
  do {                                       \
    cudaError_t err_ = (call);               \
    if (err_ != cudaSuccess) return (int)err_; \
  } while (0)

// The caller's current device, back as it was when a host function returns (torch reads it as its own).
struct device_guard {
  int saved = 0;
  device_guard() { cudaGetDevice(&saved); }
  ~device_guard() { cudaSetDevice(saved); }
};

static int sync_rank(blink_tp* T, uint32_t r) {
  TP_TRY(cudaSetDevice(T->devices[r]));
  TP_TRY(cudaMemcpy(T->dev[r], &T->host[r], sizeof(blink_tp_rank), cudaMemcpyHostToDevice));
  return 0;
}

extern "C" {

uint64_t blink_tp_rank_bytes(void) { return sizeof(blink_tp_rank); }

// Peer access between every pair, the ranks' buffers and flags; `cap_elems`: 16-bit elements an all-reduce
// may carry (max tokens x hidden). Returns 0 or a cudaError_t.
int blink_tp_create(uint32_t world, const int32_t* devices, uint64_t cap_elems, uint64_t timeout_ns, blink_tp** out) {
  device_guard guard;
  if (world < 2 || world > BLINK_TP_MAX_RANKS) return (int)cudaErrorInvalidValue;
  blink_tp* T = (blink_tp*)calloc(1, sizeof(blink_tp));
  if (!T) return (int)cudaErrorMemoryAllocation;
  *out = T;
  T->world = world;
  memcpy(T->devices, devices, sizeof(int32_t) * world);
  for (uint32_t i = 0; i < world; ++i) {
    TP_TRY(cudaSetDevice(devices[i]));
    for (uint32_t j = 0; j < world; ++j) {
      if (i == j) continue;
      int can = 0;
      TP_TRY(cudaDeviceCanAccessPeer(&can, devices[i], devices[j]));
      if (!can) return (int)cudaErrorPeerAccessUnsupported;
      cudaError_t e = cudaDeviceEnablePeerAccess(devices[j], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else TP_TRY(e);
    }
  }
  TP_TRY(cudaHostAlloc((void**)&T->ctl, sizeof(blink_tp_ctl), cudaHostAllocMapped | cudaHostAllocPortable));
  memset(T->ctl, 0, sizeof(blink_tp_ctl));
  cap_elems = (cap_elems + 7) / 8 * 8;
  for (uint32_t r = 0; r < world; ++r) {
    TP_TRY(cudaSetDevice(devices[r]));
    TP_TRY(cudaMalloc(&T->owned[r][0], 2 * cap_elems * sizeof(uint16_t)));
    TP_TRY(cudaMalloc(&T->owned[r][1], sizeof(uint32_t) * BLINK_TP_MAX_RANKS * BLINK_TP_BLOCKS));
    TP_TRY(cudaMemset(T->owned[r][1], 0, sizeof(uint32_t) * BLINK_TP_MAX_RANKS * BLINK_TP_BLOCKS));
    TP_TRY(cudaMalloc(&T->owned[r][2], sizeof(uint64_t)));
    TP_TRY(cudaMemset(T->owned[r][2], 0, sizeof(uint64_t)));
    TP_TRY(cudaMalloc(&T->owned[r][4], sizeof(blink_tp_state)));
    TP_TRY(cudaMemset(T->owned[r][4], 0, sizeof(blink_tp_state)));
    TP_TRY(cudaMalloc((void**)&T->dev[r], sizeof(blink_tp_rank)));
  }
  for (uint32_t r = 0; r < world; ++r) {
    blink_tp_rank* h = &T->host[r];
    h->rank = r;
    h->world = world;
    h->cap_elems = cap_elems;
    h->timeout_ns = timeout_ns;
    h->ctl = T->ctl;  // portable, mapped: with unified addressing the host pointer is the device pointer
    for (uint32_t q = 0; q < world; ++q) {
      h->bufs[q][0] = (uint16_t*)T->owned[q][0];
      h->bufs[q][1] = (uint16_t*)T->owned[q][0] + cap_elems;
      h->flags[q] = (uint32_t*)T->owned[q][1];
      h->mailbox[q] = (uint64_t*)T->owned[q][2];
      h->state[q] = (blink_tp_state*)T->owned[q][4];
    }
    int e = sync_rank(T, r);
    if (e) return e;
  }
  return 0;
}

void* blink_tp_rank_ptr(blink_tp* T, uint32_t rank) { return rank < T->world ? T->dev[rank] : nullptr; }

// Rank `rank`'s step buffer of `set` (0 or 1), and the layout the announce copies by; call for every rank and
// set before the first step (and before capture: nothing, kernels read the struct at run time).
int blink_tp_set_step_buffer(blink_tp* T, uint32_t rank, uint32_t set, void* buf, uint64_t block_tables_offset,
                             uint64_t block_row_bytes, uint64_t num_seqs_offset) {
  if (rank >= T->world || set > 1) return (int)cudaErrorInvalidValue;
  device_guard guard;
  for (uint32_t r = 0; r < T->world; ++r) {
    T->host[r].step_bufs[rank][set] = (uint8_t*)buf;
    T->host[r].block_tables_offset = block_tables_offset;
    T->host[r].block_row_bytes = block_row_bytes;
    T->host[r].num_seqs_offset = num_seqs_offset;
    int e = sync_rank(T, r);
    if (e) return e;
  }
  return 0;
}

// Between steps only (start-up): a plain copy into every rank's state, device-synchronous.
int blink_tp_set_live(blink_tp* T, uint32_t on) {
  device_guard guard;
  for (uint32_t r = 0; r < T->world; ++r) {
    TP_TRY(cudaSetDevice(T->devices[r]));
    TP_TRY(cudaMemcpy(&((blink_tp_state*)T->owned[r][4])->live, &on, sizeof(on), cudaMemcpyHostToDevice));
  }
  return 0;
}
void blink_tp_set_stop(blink_tp* T, uint32_t on) { ((volatile blink_tp_ctl*)T->ctl)->stop = on; }
uint32_t blink_tp_fault(blink_tp* T) { return ((volatile blink_tp_ctl*)T->ctl)->fault; }

// The launches, on `stream` (captured when it is capturing); the caller's current device is the rank's.
int blink_tp_allreduce(void* rank_dev, void* x, uint64_t num_elems, uint32_t fp16, void* stream) {
  if (num_elems % 8) return (int)cudaErrorInvalidValue;
  blink_tp_allreduce_kernel<<<BLINK_TP_BLOCKS, BLINK_TP_THREADS, 0, (cudaStream_t)stream>>>(
      (blink_tp_rank*)rank_dev, (uint4*)x, num_elems / 8, fp16);
  return (int)cudaGetLastError();
}
int blink_tp_announce(void* rank_dev, uint32_t set, uint32_t bucket, void* stream) {
  blink_tp_announce_kernel<<<1, BLINK_TP_COPY_THREADS, 0, (cudaStream_t)stream>>>((blink_tp_rank*)rank_dev, set, bucket);
  return (int)cudaGetLastError();
}
int blink_tp_wait(void* rank_dev, void* stream) {
  blink_tp_wait_kernel<<<1, 1, 0, (cudaStream_t)stream>>>((blink_tp_rank*)rank_dev);
  return (int)cudaGetLastError();
}

// A follower's loop over its captured graphs `graphs` ([2 * num_buckets]: set * num_buckets + bucket, torch's
// raw cudaGraph_t, kept alive by the caller): each becomes a branch (the graph as a child, then the relaunch),
// instantiated for device launch; the dispatch graph is one kernel.
int blink_tp_follower_create(blink_tp* T, uint32_t rank, void** graphs, uint32_t num_buckets, blink_tp_follower** out) {
  if (rank == 0 || rank >= T->world || num_buckets == 0 || num_buckets > 256) return (int)cudaErrorInvalidValue;
  device_guard guard;
  blink_tp_follower* F = (blink_tp_follower*)calloc(1, sizeof(blink_tp_follower));
  if (!F) return (int)cudaErrorMemoryAllocation;
  *out = F;
  F->device = T->devices[rank];
  F->num_branches = 2 * num_buckets;
  F->graphs = (cudaGraph_t*)calloc(F->num_branches, sizeof(cudaGraph_t));
  F->execs = (cudaGraphExec_t*)calloc(F->num_branches, sizeof(cudaGraphExec_t));
  if (!F->graphs || !F->execs) return (int)cudaErrorMemoryAllocation;
  TP_TRY(cudaSetDevice(F->device));
  TP_TRY(cudaStreamCreateWithFlags(&F->stream, cudaStreamNonBlocking));
  blink_tp_rank* R = T->dev[rank];
  void* args[] = {&R};
  cudaKernelNodeParams kp = {};
  kp.blockDim = dim3(1);
  kp.gridDim = dim3(1);
  kp.kernelParams = args;
  cudaGraphNode_t node;
  TP_TRY(cudaGraphCreate(&F->dispatch_graph, 0));
  kp.func = (void*)blink_tp_dispatch_kernel;
  TP_TRY(cudaGraphAddKernelNode(&node, F->dispatch_graph, nullptr, 0, &kp));
  TP_TRY(cudaGraphInstantiate(&F->dispatch, F->dispatch_graph, cudaGraphInstantiateFlagDeviceLaunch));
  TP_TRY(cudaGraphUpload(F->dispatch, F->stream));
  kp.func = (void*)blink_tp_relaunch_kernel;
  for (uint32_t i = 0; i < F->num_branches; ++i) {
    cudaGraphNode_t child;
    TP_TRY(cudaGraphCreate(&F->graphs[i], 0));
    TP_TRY(cudaGraphAddChildGraphNode(&child, F->graphs[i], nullptr, 0, (cudaGraph_t)graphs[i]));
    TP_TRY(cudaGraphAddKernelNode(&node, F->graphs[i], &child, 1, &kp));
    TP_TRY(cudaGraphInstantiate(&F->execs[i], F->graphs[i], cudaGraphInstantiateFlagDeviceLaunch));
    TP_TRY(cudaGraphUpload(F->execs[i], F->stream));
  }
  TP_TRY(cudaMalloc(&T->owned[rank][3], sizeof(cudaGraphExec_t) * F->num_branches));
  TP_TRY(cudaMemcpy(T->owned[rank][3], F->execs, sizeof(cudaGraphExec_t) * F->num_branches, cudaMemcpyHostToDevice));
  T->host[rank].dispatch = F->dispatch;
  T->host[rank].branches = (cudaGraphExec_t*)T->owned[rank][3];
  T->host[rank].num_buckets = num_buckets;
  // the loop starts from the steps already waited for in host-driven warm-ups
  TP_TRY(cudaMemcpy(&T->host[rank].consumed, &R->consumed, sizeof(uint64_t), cudaMemcpyDeviceToHost));
  TP_TRY(cudaMemcpy(T->host[rank].epoch, R->epoch, sizeof(T->host[rank].epoch), cudaMemcpyDeviceToHost));
  TP_TRY(cudaMemcpy(&T->host[rank].announced, &R->announced, sizeof(uint64_t), cudaMemcpyDeviceToHost));
  return sync_rank(T, rank);
}

int blink_tp_follower_launch(blink_tp_follower* F) {
  device_guard guard;
  TP_TRY(cudaSetDevice(F->device));
  TP_TRY(cudaGraphLaunch(F->dispatch, F->stream));
  return 0;
}

// 0: running; 1: ended; else the stream's cudaError_t (the follower died)
int blink_tp_follower_poll(blink_tp_follower* F) {
  device_guard guard;
  cudaSetDevice(F->device);
  cudaError_t e = cudaStreamQuery(F->stream);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  return (int)e;
}

int blink_tp_follower_destroy(blink_tp_follower* F) {
  if (!F) return 0;
  device_guard guard;
  cudaSetDevice(F->device);
  for (uint32_t i = 0; i < F->num_branches; ++i) {
    if (F->execs && F->execs[i]) cudaGraphExecDestroy(F->execs[i]);
    if (F->graphs && F->graphs[i]) cudaGraphDestroy(F->graphs[i]);
  }
  if (F->dispatch) cudaGraphExecDestroy(F->dispatch);
  if (F->dispatch_graph) cudaGraphDestroy(F->dispatch_graph);
  if (F->stream) cudaStreamDestroy(F->stream);
  free(F->graphs);
  free(F->execs);
  free(F);
  return 0;
}

int blink_tp_destroy(blink_tp* T) {
  if (!T) return 0;
  device_guard guard;
  for (uint32_t r = 0; r < T->world; ++r) {
    cudaSetDevice(T->devices[r]);
    for (int k = 0; k < 5; ++k)
      if (T->owned[r][k]) cudaFree(T->owned[r][k]);
    if (T->dev[r]) cudaFree(T->dev[r]);
  }
  if (T->ctl) cudaFreeHost(T->ctl);
  free(T);
  return 0;
}

}  // extern "C"
