// Cross-stream signals inside a decode graph: a kernel on a side stream tells a kernel
// on the session stream that its outputs are written, without a graph edge.
//
// Why: a graph kernel node that also has a full edge (an event join from a side stream)
// is launched only after all its predecessors complete, so it loses the programmatic
// early launch (PDL) that the session stream's kernels rely on (docs/gpu.md). With a
// signal the consumer keeps its one programmatic edge and waits for the side producer
// in the kernel, where that producer has normally long finished.
//
// A slot is two 32-bit words in device memory, zero at rest: [0] the count of producer
// signals, [1] the count of consumer blocks that passed. The producer's block adds 1 to
// [0] after its writes (signal_block); every block of the consumer grid waits until
// [0] reaches `need` and counts itself in [1]; the last block to pass zeroes both
// (signal_wait_block), so the slot is at rest again before the consumer completes. The
// host must order every signal after the previous consumer of the slot (the side
// stream is forked from the session stream after it) and launch the consumer only
// where the producers run in the same forward pass (CudaSession::hc_site_finish).
//
// Deadlock: a consumer block spins while holding its SM resources. The producers here
// are small kernels on the highest-priority streams, launched long before; the consumer
// grids are small. A wait that exceeds kSignalTimeoutNs traps (the launch fails with an
// error) instead of hanging.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/pdl_device.cuh"  // global_ns

namespace dsx::cuda::dev {

inline constexpr unsigned long long kSignalTimeoutNs = 2000000000ull;  // 2 s

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Producer: called by every thread of the block after its last global write of what the
// consumer reads.
__device__ __forceinline__ void signal_block(unsigned* slot) {
  __syncthreads();
  if ((threadIdx.x | threadIdx.y | threadIdx.z) == 0) {
    __threadfence();
    atomicAdd(slot, 1u);
  }
}

// Consumer: called by every thread of every block of the grid before it reads what the
// producers wrote (or writes what they read).
__device__ __forceinline__ void signal_wait_block(unsigned* slot, unsigned need) {
  if ((threadIdx.x | threadIdx.y | threadIdx.z) == 0) {
    if (ld_acquire_gpu(slot) < need) {
      const unsigned long long t0 = global_ns();
      while (ld_acquire_gpu(slot) < need) {
        __nanosleep(100);
        if (global_ns() - t0 > kSignalTimeoutNs) __trap();
      }
    }
    __threadfence();
    const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd(slot + 1, 1u) == blocks - 1) {  // every block has passed: back to rest
      slot[1] = 0;
      slot[0] = 0;
    }
  }
  __syncthreads();
}

// "Last block done" (a grid's blocks publish results, the last to arrive reads them all):
// thread 0 of each block calls it after a __syncthreads() that follows the block's
// writes; true in the block that arrives last, whose threads (after the next
// __syncthreads()) see every block's writes. One acquire-release atomic instead of a
// fence, a relaxed atomic and another fence (sequentially consistent fences wait longer:
// the router's selection starts ~0.5 us earlier, s16). The last block puts the counter
// back to zero; the next launch must touch it only after its grid-dependency wait.
__device__ __forceinline__ bool last_block_arrive(unsigned* counter, unsigned nblocks) {
  unsigned t;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(t) : "l"(counter) : "memory");
  const bool last = t == nblocks - 1;
  if (last) asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(counter) : "memory");
  return last;
}

}  // namespace dsx::cuda::dev
