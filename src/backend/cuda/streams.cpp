#include "backend/cuda/streams.h"

#include "kernels/cuda/cuda_util.h"
#include "util/switches.h"

namespace dsx::cuda {

Streams::Streams() {
  int prio_lo = 0, prio_hi = 0;
  DSX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&prio_lo, &prio_hi));
  side_prio = sw::on(sw::Id::SIDE_PRIO);
  const int prio = side_prio ? prio_hi : prio_lo;
  auto ev = [](cudaEvent_t& e) { DSX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); };
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));
  for (auto& s : side) DSX_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio));
  DSX_CUDA_CHECK(cudaStreamCreateWithPriority(&side_hc, cudaStreamNonBlocking, prio));
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  ev(ev_fork);
  ev(ev_kv_fork);
  for (auto& e : ev_join) ev(e);
  for (auto& e : ev_end) ev(e);
  ev(ev_hc_fork);
  ev(ev_hc_join);
  ev(ev_engram);
  ev(ev_pick);
  DSX_CUDA_CHECK(cudaEventCreate(&gt0));
  DSX_CUDA_CHECK(cudaEventCreate(&gt1));
  DSX_CUDA_CHECK(cudaEventCreate(&gt0_ahead));
}

Streams::~Streams() {
  if (main) cudaStreamSynchronize(main);
  for (cudaEvent_t e : {ev_fork, ev_kv_fork, ev_hc_fork, ev_hc_join, ev_engram, ev_pick, gt0, gt1, gt0_ahead})
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_join)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_end)
    if (e) cudaEventDestroy(e);
  for (cudaStream_t s : side)
    if (s) cudaStreamDestroy(s);
  for (cudaStream_t s : {side_hc, copy, main})
    if (s) cudaStreamDestroy(s);
}

}  // namespace dsx::cuda
