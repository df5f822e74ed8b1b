// CUDA helpers shared by the kernels and the CUDA backend. Host-only header
// (includes the runtime API only), safe to include from .cpp files compiled
// by the host compiler when DSX_HAVE_CUDA is defined.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "util/error.h"

#define DSX_CUDA_CHECK(expr)                                                                   \
  do {                                                                                         \
    cudaError_t dsx_err_ = (expr);                                                             \
    if (dsx_err_ != cudaSuccess)                                                               \
      ::dsx::fail("CUDA error ", cudaGetErrorString(dsx_err_), " at ", __FILE__, ":", __LINE__, \
                  " (", #expr, ")");                                                           \
  } while (0)

namespace dsx::cuda {

// True when a CUDA device is present and usable (tests skip otherwise).
bool device_available();

// Kernel timeline, a development aid of builds configured with -DDSX_KERNEL_TRACE=ON (off by
// default; no cost otherwise): thread 0 of block 0 of every kernel that calls dev::pdl_wait
// records when it reached the wait and when the wait returned (%globaltimer ns), with its
// grid (x | y << 16) and block size, into a ring of kTraceCap records. DSX_TRACE=file makes
// a CUDA session enable it and write the ring when it ends (a u32 count of records
// written, then the kTraceCap records); tools/trace_timeline.py prints the timeline.
struct TraceRec {
  unsigned long long t_wait, t_done;
  unsigned grid, block;
};
constexpr unsigned kTraceCap = 1u << 15;
void trace_add_setter(void (*f)(TraceRec*, unsigned*));
bool trace_enable();  // false when the build records nothing
void trace_dump(const char* path);

// A zeroed device scratch of `bytes`, one per (device, owner, tag), kept for the life of
// the process: the state of kernels that leave it as they found it (the ticket counters
// of "the last block combines" reductions; calls for one owner are ordered on one
// stream). Allocated and zeroed (ordered on `stream`) on the first call; nullptr when that
// first call comes while `stream` is being captured (no allocation then).
void* persistent_scratch(const void* owner, int tag, size_t bytes, cudaStream_t stream);

// Owning device allocation (cudaMalloc), movable.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { alloc(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  void alloc(size_t bytes);
  void release();
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;
  void zero();
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace dsx::cuda
