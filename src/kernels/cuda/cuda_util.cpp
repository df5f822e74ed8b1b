#include "kernels/cuda/cuda_util.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

namespace dsx::cuda {

bool device_available() {
  static int cached = -1;
  if (cached < 0) {
    int n = 0;
    cached = (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) ? 1 : 0;
    if (!cached) cudaGetLastError();  // clear the sticky error of a failed query
  }
  return cached == 1;
}

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : dflt;
}

void* persistent_scratch(const void* owner, int tag, size_t bytes, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int>, void*> pool;
  int dev = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, owner, tag);
  std::lock_guard<std::mutex> lock(mu);
  auto it = pool.find(key);
  if (it != pool.end()) return it->second;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();  // (not sticky) e.g. the legacy stream while another captures
    return nullptr;
  }
  if (st != cudaStreamCaptureStatusNone) return nullptr;
  void* p = nullptr;
  DSX_CUDA_CHECK(cudaMalloc(&p, bytes));
  DSX_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));  // ordered before the first kernel
  pool.emplace(key, p);
  return p;
}

void DeviceBuffer::alloc(size_t bytes) {
  release();
  if (bytes == 0) return;
  DSX_CUDA_CHECK(cudaMalloc(&p_, bytes));
  n_ = bytes;
}

void DeviceBuffer::release() {
  if (p_) cudaFree(p_);
  p_ = nullptr;
  n_ = 0;
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  DSX_CHECK(offset + bytes <= n_, "DeviceBuffer::upload out of range");
  DSX_CUDA_CHECK(cudaMemcpy(static_cast<char*>(p_) + offset, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  DSX_CHECK(offset + bytes <= n_, "DeviceBuffer::download out of range");
  DSX_CUDA_CHECK(cudaMemcpy(host, static_cast<const char*>(p_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::zero() {
  if (p_) DSX_CUDA_CHECK(cudaMemset(p_, 0, n_));
}

}  // namespace dsx::cuda
