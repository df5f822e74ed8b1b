#include "kernels/cuda/cuda_util.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

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

namespace {
std::vector<void (*)(TraceRec*, unsigned*)>& trace_setters() {
  static std::vector<void (*)(TraceRec*, unsigned*)> v;
  return v;
}
TraceRec* g_trace_buf = nullptr;
unsigned* g_trace_n = nullptr;
}  // namespace

void trace_add_setter(void (*f)(TraceRec*, unsigned*)) { trace_setters().push_back(f); }

bool trace_enable() {
  if (trace_setters().empty()) return false;
  if (!g_trace_buf) {
    DSX_CUDA_CHECK(cudaMalloc(&g_trace_buf, sizeof(TraceRec) * kTraceCap));
    DSX_CUDA_CHECK(cudaMalloc(&g_trace_n, sizeof(unsigned)));
    DSX_CUDA_CHECK(cudaMemset(g_trace_buf, 0, sizeof(TraceRec) * kTraceCap));
    DSX_CUDA_CHECK(cudaMemset(g_trace_n, 0, sizeof(unsigned)));
    for (auto f : trace_setters()) f(g_trace_buf, g_trace_n);
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return true;
}

void trace_dump(const char* path) {
  if (!g_trace_buf) return;
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<TraceRec> recs(kTraceCap);
  unsigned n = 0;
  DSX_CUDA_CHECK(cudaMemcpy(recs.data(), g_trace_buf, sizeof(TraceRec) * kTraceCap, cudaMemcpyDeviceToHost));
  DSX_CUDA_CHECK(cudaMemcpy(&n, g_trace_n, sizeof n, cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path, "wb");
  DSX_CHECK(f, "DSX_TRACE: cannot write ", path);
  const bool ok = std::fwrite(&n, sizeof n, 1, f) == 1 && std::fwrite(recs.data(), sizeof(TraceRec), recs.size(), f) == recs.size();
  std::fclose(f);
  DSX_CHECK(ok, "DSX_TRACE: short write to ", path);
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
