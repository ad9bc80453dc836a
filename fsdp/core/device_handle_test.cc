// The CPU device handle: storage free/reallocate exactly as FlatParamHandle did it, memory
// statistics from the tracking allocator, placeholder streams and no-op events, and the
// registry's errors.
#include "fsdp/core/device_handle.h"

#include <unistd.h>

#include <thread>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(DeviceHandleTest, CpuHandleReportsTheCpuDevice) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  ASSERT_NE(handle, nullptr);
  EXPECT_EQ(handle->device(), c10::Device(at::kCPU));
  // A new handle each call.
  EXPECT_NE(DeviceHandle::for_device(at::kCPU), handle);
}

TEST(DeviceHandleTest, FreeAndReallocateKeepViewsValid) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  at::Tensor flat = at::arange(12, at::kFloat);
  at::Tensor view = flat.narrow(0, 4, 4).view({2, 2});
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  handle->free_storage(flat);
  EXPECT_EQ(flat.storage().nbytes(), 0u);
  EXPECT_EQ(flat.storage().unsafeGetStorageImpl(), storage);  // the same storage
  EXPECT_EQ(flat.sizes(), at::IntArrayRef({12}));
  handle->reallocate_storage(flat);
  EXPECT_EQ(flat.storage().nbytes(), 48u);
  EXPECT_EQ(view.storage().unsafeGetStorageImpl(), storage);
  flat.copy_(at::arange(12, at::kFloat).mul(2));
  EXPECT_TRUE(at::equal(view, at::arange(4, 8, at::kFloat).mul(2).view({2, 2})));
}

TEST(DeviceHandleTest, ReallocateCountsTheStorageOffset) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  at::Tensor base = at::zeros({10}, at::kDouble);
  at::Tensor tail = base.narrow(0, 6, 4);
  handle->free_storage(tail);
  EXPECT_EQ(base.storage().nbytes(), 0u);
  handle->reallocate_storage(tail);
  EXPECT_EQ(base.storage().nbytes(), 80u);  // (offset 6 + 4 elements) x 8 bytes
}

TEST(DeviceHandleTest, MemoryStatsComeFromTheTrackingAllocator) {
  MemoryTracker tracker;
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  at::Tensor flat = at::empty({1000});  // 4000 bytes
  const int64_t before = handle->memory_allocated();
  EXPECT_EQ(before, memory_allocated());
  handle->reset_peak_memory_stats();
  handle->free_storage(flat);
  EXPECT_EQ(handle->memory_allocated(), before - 4000);
  EXPECT_EQ(handle->max_memory_allocated(), before);
  handle->reset_peak_memory_stats();
  EXPECT_EQ(handle->max_memory_allocated(), before - 4000);
  handle->reallocate_storage(flat);
  EXPECT_EQ(handle->memory_allocated(), before);
  EXPECT_EQ(handle->max_memory_allocated(), before);
  EXPECT_EQ(memory_allocated(), before);
}

TEST(DeviceHandleTest, MemoryStatsFollowTheThreadsTag) {
  MemoryTracker tracker;
  std::thread rank([] {
    MemoryTagGuard tag(3);
    std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
    const int64_t before = handle->memory_allocated();
    EXPECT_EQ(before, memory_allocated(3));
    handle->reset_peak_memory_stats();
    at::Tensor t = at::empty({250}, at::kDouble);  // 2000 bytes under tag 3
    EXPECT_EQ(handle->memory_allocated(), before + 2000);
    t.reset();
    EXPECT_EQ(handle->memory_allocated(), before);
    EXPECT_EQ(handle->max_memory_allocated(), before + 2000);
    EXPECT_EQ(max_memory_allocated(3), before + 2000);
  });
  rank.join();
}

TEST(DeviceHandleTest, CpuMemoryFreeIsTheKernelsAvailableMemory) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  // MemAvailable changes with every other process, so only its range is known.
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  EXPECT_GT(handle->memory_free(), 0);
  EXPECT_LE(handle->memory_free(), physical);
}

TEST(DeviceHandleTest, CpuStreamsAndEventsAreNoOps) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  const c10::Stream current = handle->current_stream();
  EXPECT_EQ(current.device(), c10::Device(at::kCPU));
  EXPECT_EQ(handle->side_stream(kUnshardStream), current);
  EXPECT_EQ(handle->side_stream(kPostBackwardStream), current);
  std::unique_ptr<DeviceEvent> event = handle->record_event(handle->side_stream(kUnshardStream));
  ASSERT_NE(event, nullptr);
  EXPECT_TRUE(event->query());
  event->synchronize();
  handle->wait_event(current, *event);
  handle->synchronize();
}

TEST(DeviceHandleTest, CpuHandleRefusesOtherDevices) {
  std::shared_ptr<DeviceHandle> handle = DeviceHandle::for_device(at::kCPU);
  EXPECT_THAT([&] { handle->free_storage(at::Tensor()); },
              ThrowsMessage<c10::Error>(HasSubstr("expected a defined CPU tensor")));
  EXPECT_THAT(
      [&] { handle->record_event(c10::Stream(c10::Stream::DEFAULT, c10::Device("cuda:0"))); },
      ThrowsMessage<c10::Error>(HasSubstr("expected a CPU stream")));
}

TEST(DeviceHandleTest, CudaWithoutItsTargetSaysWhatToLink) {
  // This test does not link //fsdp/core:cuda_device_handle.
  EXPECT_THAT([] { DeviceHandle::for_device(c10::Device("cuda:0")); },
              ThrowsMessage<c10::Error>(HasSubstr("link //fsdp/core:cuda_device_handle")));
  EXPECT_THAT([] { DeviceHandle::for_device(c10::Device(c10::kXLA)); },
              ThrowsMessage<c10::Error>(HasSubstr("no device handle is registered for XLA")));
}

TEST(DeviceHandleTest, RegisteringATypeTwiceIsAnError) {
  EXPECT_THAT(
      [] {
        register_device_handle(c10::kCPU,
                               [](c10::Device) { return std::shared_ptr<DeviceHandle>(); });
      },
      ThrowsMessage<c10::Error>(HasSubstr("registered already")));
}

}  // namespace
}  // namespace fsdp
