// The CUDA device handle: registered by linking //fsdp/core:cuda_device_handle; on a GPU,
// storage free/reallocate returns bytes to the caching allocator (its statistics show
// it), side streams and events order work. Cases that need a CUDA device skip without one,
// naming why.
#include "fsdp/core/cuda_device_handle.h"

#include <string>

#include <ATen/Functions.h>
#include <c10/cuda/CUDAGuard.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/fake.h"
#include "fsdp/comm/nccl.h"                 // cuda_device_count
#include "fsdp/comm/testing/gpu_testing.h"  // FSDP_SKIP_WITHOUT_GPU
#include "fsdp/core/device_handle.h"
#include "fsdp/core/flat_param.h"

namespace fsdp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::ThrowsMessage;

TEST(CudaDeviceHandleTest, LinkingTheTargetRegistersIt) {
  if (cuda_device_count() == 0) {
    // Registered (not the "link ..." error), but there is no device to make it for.
    EXPECT_THAT([] { DeviceHandle::for_device(c10::Device("cuda:0")); },
                ThrowsMessage<c10::Error>(AllOf(HasSubstr("no CUDA device is available"),
                                                Not(HasSubstr("link //fsdp/core")))));
    return;
  }
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  EXPECT_EQ(handle->device(), c10::Device("cuda:0"));
  EXPECT_EQ(DeviceHandle::for_device(c10::Device(c10::kCUDA))->device().type(), c10::kCUDA);
  EXPECT_THAT([] { DeviceHandle::for_device(c10::Device(c10::kCUDA, 127)); },
              ThrowsMessage<c10::Error>(HasSubstr("out of range")));
}

TEST(CudaDeviceHandleTest, FreeReturnsBytesToTheCachingAllocator) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  at::Tensor flat = at::arange(1 << 20, at::TensorOptions().dtype(at::kFloat).device("cuda:0"));
  at::Tensor view = flat.narrow(0, 8, 4);
  handle->synchronize();
  const int64_t before = handle->memory_allocated();
  handle->reset_peak_memory_stats();
  handle->free_storage(flat);
  EXPECT_EQ(flat.storage().nbytes(), 0u);
  EXPECT_EQ(handle->memory_allocated(), before - (4 << 20));  // a multiple of 512
  EXPECT_EQ(handle->max_memory_allocated(), before);
  handle->reset_peak_memory_stats();
  EXPECT_EQ(handle->max_memory_allocated(), before - (4 << 20));
  handle->reallocate_storage(flat);
  EXPECT_EQ(flat.storage().nbytes(), size_t{4} << 20);
  EXPECT_EQ(handle->memory_allocated(), before);
  flat.fill_(3);
  EXPECT_TRUE(at::equal(view.cpu(), at::full({4}, 3.0f)));
  EXPECT_THAT([&] { handle->free_storage(at::zeros({4})); },
              ThrowsMessage<c10::Error>(HasSubstr("expected a defined tensor on cuda:0")));
}

TEST(CudaDeviceHandleTest, MemoryFreeCountsTheCachingAllocatorsReserve) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  at::Tensor flat = at::empty({64 << 20}, at::TensorOptions().dtype(at::kFloat).device("cuda:0"));
  handle->synchronize();
  const int64_t before = handle->memory_free();
  handle->free_storage(flat);  // cached by the allocator: still free for the next allocation
  EXPECT_EQ(handle->memory_free(), before + (int64_t{256} << 20));
}

// Note [Out of memory while unsharding] on a real device: a unit whose unsharded flat
// parameter (1 GiB) does not fit beside a tensor holding all but 512 MiB of the device.
TEST(CudaDeviceHandleTest, UnshardingAUnitThatDoesNotFitNamesIt) {
  FSDP_SKIP_WITHOUT_GPU();
  auto world = FakeWorld::create(1);
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  // 256 Mi elements of float32: 1 GiB unsharded.
  at::Tensor weight = at::zeros({256 << 20}, at::TensorOptions().device("cuda:0"));
  FlatParamHandle unit({{"big.weight", weight}}, world->communicator(0),
                       ShardingStrategy::kFullShard, FlatParamOptions().device_handle(handle));
  weight = at::Tensor();
  handle->synchronize();
  const int64_t hog_bytes = handle->memory_free() - (int64_t{512} << 20);
  at::Tensor hog = at::empty({hog_bytes}, at::TensorOptions().dtype(at::kByte).device("cuda:0"));
  EXPECT_THAT([&] { unit.unshard(); },
              ThrowsMessage<c10::OutOfMemoryError>(
                  AllOf(HasSubstr("FlatParamHandle of 'big.weight' (1 parameters): unsharding "
                                  "needs 1073741824 bytes on cuda:0"),
                        HasSubstr("bytes free). To fit, make the unit smaller"))));
  EXPECT_EQ(unit.state(), FlatParamState::kSharded);
  hog = at::Tensor();
  unit.unshard();  // fits again
  EXPECT_EQ(unit.state(), FlatParamState::kUnsharded);
}

TEST(CudaDeviceHandleTest, SideStreamsAreOwnAndStable) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  const c10::Stream unshard = handle->side_stream(kUnshardStream);
  const c10::Stream post_backward = handle->side_stream(kPostBackwardStream);
  EXPECT_EQ(handle->side_stream(kUnshardStream), unshard);
  EXPECT_NE(unshard, handle->current_stream());
  EXPECT_NE(unshard, post_backward);
  EXPECT_EQ(unshard.device(), c10::Device("cuda:0"));
}

TEST(CudaDeviceHandleTest, EventsOrderASideStreamBeforeTheCurrentOne) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(c10::Device("cuda:0"));
  const auto options = at::TensorOptions().dtype(at::kFloat).device("cuda:0");
  at::Tensor x = at::zeros({1 << 22}, options);
  handle->synchronize();
  std::unique_ptr<DeviceEvent> written;
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::CUDAStream(handle->side_stream(kUnshardStream)));
    for (int i = 0; i < 8; ++i) x.add_(1);  // queued on the side stream
    written = handle->record_event(handle->side_stream(kUnshardStream));
  }
  handle->wait_event(handle->current_stream(), *written);
  at::Tensor y = x.mul(2);  // on the current stream, after the side stream's adds
  written->synchronize();
  EXPECT_TRUE(written->query());
  handle->synchronize();
  EXPECT_TRUE(at::equal(y.cpu(), at::full({1 << 22}, 16.0f)));
}

}  // namespace
}  // namespace fsdp
