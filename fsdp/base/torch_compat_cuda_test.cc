// load_torch_cuda in a binary that links libc10_cuda but not libtorch_cuda (as the
// trainers do): LibTorch's CUDA kernels and hooks appear only once it is called, and a
// CUDA query made before the load is named. Needs no GPU.
#include "fsdp/base/torch_compat_cuda.h"

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace fsdp::compat {
namespace {

bool libtorch_cuda_mapped() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str().find("/libtorch_cuda.so") != std::string::npos;
}

bool add_has_cuda_kernel() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("aten::add", "Tensor")
      .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

// Runs first (tests run in the order written): this process has not loaded it yet.
TEST(LoadTorchCuda, LoadsTheCudaKernelsAndHooksOnlyWhenCalled) {
  ASSERT_FALSE(libtorch_cuda_mapped()) << "this test must not link @libtorch//:torch_cuda";
  EXPECT_FALSE(add_has_cuda_kernel());
  load_torch_cuda();
  EXPECT_TRUE(libtorch_cuda_mapped());
  EXPECT_TRUE(add_has_cuda_kernel());
  EXPECT_TRUE(at::detail::getCUDAHooks().hasCUDART());
  EXPECT_EQ(at::detail::getCUDAHooks().versionCUDART(), CUDART_VERSION);
  load_torch_cuda();  // once: a second call changes nothing
  EXPECT_TRUE(add_has_cuda_kernel());
}

// In a fresh process (threadsafe death tests re-run the binary): LibTorch answers a CUDA
// query from its CPU-only stub hooks, keeps that answer, and the load says so.
TEST(LoadTorchCuda, NamesACudaQueryMadeBeforeTheLoad) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        EXPECT_FALSE(at::detail::getCUDAHooks().hasCUDART());
        try {
          load_torch_cuda();
        } catch (const c10::Error& e) {
          std::cerr << e.what_without_backtrace();
          std::exit(3);
        }
        std::exit(0);
      },
      testing::ExitedWithCode(3), "answered a CUDA query before it was.*torch::manual_seed");
}

}  // namespace
}  // namespace fsdp::compat
