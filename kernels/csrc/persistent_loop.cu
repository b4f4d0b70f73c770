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
    int waits = 0;  // constrained rows whose mask had not come (only a step with masked rows has them)
    for (int32_t i = threadIdx.x; i < h->num_sampled; i += blockDim.x) {
      a->sampled32[i] = (int32_t)a->sampled[i];
      waits += a->sampled32[i] == BLINK_TOKEN_WAIT;
    }
    const int32_t rows = (int32_t)graph_rows(h);  // read: back to -1 for blink_loop_take (same thread, same row)
    for (int32_t i = threadIdx.x; i < rows; i += blockDim.x) a->sampled[i] = -1;
    if (a->ext && a->ext->masked[a->buf]) {  // the same for every thread
      __shared__ int sh_waits;
      if (threadIdx.x == 0) sh_waits = 0;
      __syncthreads();
      if (waits) atomicAdd(&sh_waits, waits);
      __syncthreads();
      if (threadIdx.x == 0) a->c.mask_waits += (uint64_t)sh_waits;
    }
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

// ---- host side: build (blink_loop_build.cuh), launch, watch -----------------------------------------------------
#include "blink_loop_build.cuh"

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
