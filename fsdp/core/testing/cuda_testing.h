// Ranks as threads on one CUDA device, for the GPU tests (testonly; links libtorch_cuda):
// the fake communicator (fsdp/comm/fake.h) with CUDA tensors, each rank thread on its
// own stream, as real ranks each have theirs.
//
//   TEST(MyGpuTest, Trains) {
//     FSDP_SKIP_WITHOUT_GPU();
//     fsdp::core_testing::on_cuda_ranks(4, [](std::shared_ptr<fsdp::Communicator> comm) {
//       at::Tensor t = at::full({2}, comm->rank(), at::Device("cuda:0"));  // this rank's stream
//       comm->all_reduce(t);
//     });
//   }
//
// Devices and streams: every rank computes on kCudaDevice (cuda:0). Each rank thread
// takes a stream from LibTorch's pool of the device (c10::cuda::getStreamFromPool, as
// torch.cuda.Stream()) and makes it current for the whole of `fn`, so FSDP's buffers,
// kernels and the fake collectives of that rank run on it (Note [Fake collectives on
// device buffers] in fsdp/comm/fake.cc). Each rank thread also switches off the autograd
// engine's device threads (PyTorch: torch.autograd.set_multithreading_enabled(False)):
// with them, every rank's CUDA backward would run on the engine's one thread for cuda:0,
// and the first collective a rank's backward hook issues there would wait for peers whose
// backward can no longer run. The calling thread's current stream is synchronized before
// `fn` returns. Threading: as FakeWorld::run (one thread per rank; rethrows the lowest
// failing rank's exception). Errors: as `fn` and FakeWorld; collectives time out after
// kCudaRankTimeout (one CUDA context and cuBLAS handle per process and thread are made
// on first use, which may take seconds).
#ifndef FSDP_CORE_TESTING_CUDA_TESTING_H_
#define FSDP_CORE_TESTING_CUDA_TESTING_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <c10/core/AutogradState.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/testing/gpu_testing.h"  // FSDP_SKIP_WITHOUT_GPU

namespace fsdp::core_testing {

inline const c10::Device kCudaDevice("cuda:0");
inline constexpr std::chrono::milliseconds kCudaRankTimeout = std::chrono::seconds(60);

// Runs fn on every rank of a fake world of `world_size` ranks, each a thread on
// kCudaDevice with its own current pool stream and autograd on the calling thread (see
// above).
inline void on_cuda_ranks(int world_size,
                          const std::function<void(std::shared_ptr<Communicator>)>& fn) {
  FakeWorld::run(FakeWorld::create(world_size, kCudaRankTimeout), [&](Communicator& comm) {
    c10::cuda::CUDAGuard device(kCudaDevice.index());
    c10::cuda::CUDAStreamGuard stream(
        c10::cuda::getStreamFromPool(/*isHighPriority=*/false, kCudaDevice.index()));
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
    fn(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    c10::cuda::getCurrentCUDAStream(kCudaDevice.index()).synchronize();
  });
}

}  // namespace fsdp::core_testing

#endif  // FSDP_CORE_TESTING_CUDA_TESTING_H_
