// For tests with cases that need a CUDA device (testonly): FSDP_SKIP_WITHOUT_GPU() skips
// the current test, naming why, when this process sees no CUDA device (the reason comes
// from the CUDA runtime, e.g. "cudaGetDeviceCount: no CUDA-capable device is detected").
#ifndef FSDP_COMM_TESTING_GPU_TESTING_H_
#define FSDP_COMM_TESTING_GPU_TESTING_H_

#include <string>

#include <gtest/gtest.h>

#include "fsdp/comm/nccl.h"  // cuda_device_count

#define FSDP_SKIP_WITHOUT_GPU()                                \
  do {                                                         \
    std::string fsdp_why_no_gpu;                               \
    if (::fsdp::cuda_device_count(&fsdp_why_no_gpu) == 0) {    \
      GTEST_SKIP() << "needs a CUDA GPU: " << fsdp_why_no_gpu; \
    }                                                          \
  } while (false)

#endif  // FSDP_COMM_TESTING_GPU_TESTING_H_
