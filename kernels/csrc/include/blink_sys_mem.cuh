// Memory shared with other agents (the host through the ring, peer GPUs through NVLink), for the GPU-resident
// loop (blink_loop.cuh) and tensor parallelism's kernels (tp_comm.cu): volatile loads and stores that bypass the
// L1 (a stale line would hide a peer's write), release stores and acquire loads at system scope (payload first,
// the validating word last), and the GPU's nanosecond clock.
#ifndef BLINK_SYS_MEM_CUH
#define BLINK_SYS_MEM_CUH

#include <stdint.h>

template <typename T>
__device__ __forceinline__ T ld_v(const T* p) { return *(const volatile T*)p; }
template <typename T>
__device__ __forceinline__ void st_v(T* p, T v) { *(volatile T*)p = v; }

__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#endif  // BLINK_SYS_MEM_CUH
