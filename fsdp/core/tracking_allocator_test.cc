// The tracking CPU allocator: exact byte counts, peaks, tags across threads, frees of
// memory allocated before or after the tracker's scope, nesting.
#include "fsdp/core/tracking_allocator.h"

#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(TrackingAllocatorTest, CountsExactBytesAndPeak) {
  MemoryTracker tracker;
  const int64_t before = memory_allocated();
  reset_peak_memory_stats();
  const MemoryStats stats_before = memory_stats();
  at::Tensor a = at::empty({1000});  // float
  EXPECT_EQ(memory_allocated(), before + 4000);
  at::Tensor b = at::empty({250}, at::kDouble);
  EXPECT_EQ(memory_allocated(), before + 6000);
  EXPECT_EQ(max_memory_allocated(), before + 6000);
  a.reset();
  EXPECT_EQ(memory_allocated(), before + 2000);
  EXPECT_EQ(max_memory_allocated(), before + 6000);
  reset_peak_memory_stats();
  EXPECT_EQ(max_memory_allocated(), before + 2000);
  b.reset();
  EXPECT_EQ(memory_allocated(), before);
  EXPECT_EQ(max_memory_allocated(), before + 2000);
  const MemoryStats stats = memory_stats();
  EXPECT_EQ(stats.allocations - stats_before.allocations, 2);
  EXPECT_EQ(stats.allocated_bytes - stats_before.allocated_bytes, 6000);
}

TEST(TrackingAllocatorTest, OpsAndResizesAreCounted) {
  MemoryTracker tracker;
  at::Tensor a = at::ones({100});
  const int64_t before = memory_allocated();
  reset_peak_memory_stats();
  at::Tensor sum = at::add(a, a);  // a fresh result of 100 floats
  EXPECT_EQ(memory_allocated(), before + 400);
  // Resizing a storage to 0 bytes frees it, back up allocates (FlatParamHandle's
  // reshard / unshard): the storage keeps the tracking allocator.
  at::native::resize_bytes_cpu(sum.storage().unsafeGetStorageImpl(), 0);
  EXPECT_EQ(memory_allocated(), before);
  at::native::resize_bytes_cpu(sum.storage().unsafeGetStorageImpl(), 400);
  EXPECT_EQ(memory_allocated(), before + 400);
  EXPECT_EQ(max_memory_allocated(), before + 400);
}

TEST(TrackingAllocatorTest, ZeroBytesAndEmptyTensorsCountNothing) {
  MemoryTracker tracker;
  const MemoryStats before = memory_stats();
  at::Tensor empty = at::empty({0});
  EXPECT_EQ(memory_stats().current_bytes, before.current_bytes);
  EXPECT_EQ(memory_stats().allocations, before.allocations);
}

TEST(TrackingAllocatorTest, InstallsAndRestoresThePreviousAllocator) {
  c10::Allocator* original = c10::GetCPUAllocator();
  EXPECT_FALSE(MemoryTracker::is_installed());
  {
    MemoryTracker outer;
    c10::Allocator* tracking = c10::GetCPUAllocator();
    EXPECT_NE(tracking, original);
    {
      MemoryTracker inner;  // nests: same allocator
      EXPECT_EQ(c10::GetCPUAllocator(), tracking);
    }
    EXPECT_TRUE(MemoryTracker::is_installed());
    EXPECT_EQ(c10::GetCPUAllocator(), tracking);
  }
  EXPECT_FALSE(MemoryTracker::is_installed());
  EXPECT_EQ(c10::GetCPUAllocator(), original);
}

TEST(TrackingAllocatorTest, AllocatedBeforeInstallIsNeverSubtracted) {
  at::Tensor old = at::empty({1000});  // untracked
  MemoryTracker tracker;
  const int64_t before = memory_allocated();
  old.reset();  // freed with the previous allocator's deleter
  EXPECT_EQ(memory_allocated(), before);
}

TEST(TrackingAllocatorTest, AllocatedInsideFreedAfterUninstallIsSubtracted) {
  int64_t before = 0;
  at::Tensor survivor;
  {
    MemoryTracker tracker;
    before = memory_allocated();
    survivor = at::empty({500});
    EXPECT_EQ(memory_allocated(), before + 2000);
  }
  EXPECT_EQ(memory_allocated(), before + 2000);
  at::Tensor untracked = at::empty({500});  // after uninstall: not counted
  EXPECT_EQ(memory_allocated(), before + 2000);
  survivor.reset();
  EXPECT_EQ(memory_allocated(), before);
}

TEST(TrackingAllocatorTest, RawAllocateAndDeallocate) {
  MemoryTracker tracker;
  const int64_t before = memory_allocated();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* p = allocator->raw_allocate(128);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(memory_allocated(), before + 128);
  allocator->raw_deallocate(p);
  EXPECT_EQ(memory_allocated(), before);
}

TEST(TrackingAllocatorTest, TagsCountPerThreadAndFreesReturnToTheAllocatingTag) {
  MemoryTracker tracker;
  constexpr int kThreads = 4;
  std::vector<int64_t> before(kThreads);
  for (int t = 0; t < kThreads; ++t) before[t] = memory_allocated(t);
  const int64_t process_before = memory_allocated();
  reset_peak_memory_stats();
  std::vector<at::Tensor> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &kept] {
      MemoryTagGuard tag(t);
      EXPECT_EQ(current_memory_tag(), t);
      for (int i = 0; i < 1000; ++i) at::empty({100 * (t + 1)});  // freed at once
      at::Tensor peak = at::empty({1000 * (t + 1)});
      kept[t] = at::empty({10 * (t + 1)});
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(current_memory_tag(), kUntagged);
  int64_t kept_bytes = 0;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(memory_allocated(t), before[t] + 40 * (t + 1)) << "tag " << t;
    // The peak: the kept 40 (t + 1) bytes after the 4000 (t + 1) ones freed, or during.
    EXPECT_EQ(max_memory_allocated(t), before[t] + 4000 * (t + 1) + 40 * (t + 1)) << "tag " << t;
    kept_bytes += 40 * (t + 1);
  }
  EXPECT_EQ(memory_allocated(), process_before + kept_bytes);
  kept.clear();  // freed on this (untagged) thread: charged back to each tag
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(memory_allocated(t), before[t]) << "tag " << t;
  EXPECT_EQ(memory_allocated(), process_before);
}

TEST(TrackingAllocatorTest, ResetPeakOfOneTagLeavesOthers) {
  MemoryTracker tracker;
  reset_peak_memory_stats();
  std::thread([] {
    MemoryTagGuard tag(3);
    at::empty({1000});
  }).join();
  std::thread([] {
    MemoryTagGuard tag(4);
    at::empty({1000});
  }).join();
  reset_peak_memory_stats(3);
  EXPECT_EQ(max_memory_allocated(3), memory_allocated(3));
  EXPECT_EQ(max_memory_allocated(4), memory_allocated(4) + 4000);
}

TEST(TrackingAllocatorTest, GuardsNestAndRestore) {
  EXPECT_EQ(current_memory_tag(), kUntagged);
  {
    MemoryTagGuard outer(1);
    {
      MemoryTagGuard inner(2);
      EXPECT_EQ(current_memory_tag(), 2);
    }
    EXPECT_EQ(current_memory_tag(), 1);
  }
  EXPECT_EQ(current_memory_tag(), kUntagged);
}

TEST(TrackingAllocatorTest, BadTagsAreRejected) {
  EXPECT_THAT([] { MemoryTagGuard tag(kNumMemoryTags); },
              ThrowsMessage<c10::Error>(HasSubstr("tag 64 is out of range")));
  EXPECT_THAT([] { memory_allocated(-3); },
              ThrowsMessage<c10::Error>(HasSubstr("memory tag -3 is out of range")));
  EXPECT_EQ(memory_allocated(kUntagged), memory_stats(kUntagged).current_bytes);
}

}  // namespace
}  // namespace fsdp
