#include "fsdp/core/caching_cpu_allocator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// A float tensor of exactly `bytes` bytes (a multiple of 4).
at::Tensor tensor_of_bytes(int64_t bytes) { return at::empty({bytes / 4}, at::kFloat); }

class CachingCpuAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    install_caching_cpu_allocator();
    empty_cpu_cache();
    // No test leaves a large tensor alive, so nothing is mapped between tests.
    ASSERT_EQ(cpu_cache_stats().mapped_bytes, 0);
  }
};

TEST_F(CachingCpuAllocatorTest, InstallsOnceAsC10sCpuAllocator) {
  EXPECT_TRUE(caching_cpu_allocator_installed());
  c10::Allocator* installed = c10::GetCPUAllocator();
  install_caching_cpu_allocator();  // a second call is a no-op
  EXPECT_EQ(c10::GetCPUAllocator(), installed);
  EXPECT_NE(installed, c10::GetDefaultCPUAllocator());
}

TEST_F(CachingCpuAllocatorTest, FreedBlockServesTheNextRequestOfItsSize) {
  const CpuCacheStats before = cpu_cache_stats();
  at::Tensor first = tensor_of_bytes(kMiB);
  void* data = first.data_ptr();
  first.fill_(7);
  first.reset();
  EXPECT_EQ(cpu_cache_stats().cached_bytes, kMiB);
  at::Tensor second = tensor_of_bytes(kMiB);
  EXPECT_EQ(second.data_ptr(), data);  // the same mapping, not a fresh one
  const CpuCacheStats after = cpu_cache_stats();
  EXPECT_EQ(after.misses - before.misses, 1);
  EXPECT_EQ(after.hits - before.hits, 1);
  EXPECT_EQ(after.cached_bytes, 0);
  EXPECT_EQ(after.mapped_bytes, kMiB);
  // A reused block keeps its bytes (at::empty promises nothing); at::zeros still zeroes.
  at::Tensor zeros = at::zeros({kMiB / 4});
  EXPECT_EQ(zeros.sum().item<float>(), 0.0f);
}

TEST_F(CachingCpuAllocatorTest, SizesRoundUpToPages) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  at::Tensor a = tensor_of_bytes(kMiB + 4);  // one page more than 1 MiB
  EXPECT_EQ(cpu_cache_stats().mapped_bytes, kMiB + page);
  a.reset();
  const CpuCacheStats before = cpu_cache_stats();
  at::Tensor b = tensor_of_bytes(kMiB + page);  // the same rounded size: a hit
  EXPECT_EQ(cpu_cache_stats().hits - before.hits, 1);
}

TEST_F(CachingCpuAllocatorTest, SmallRequestsBypassTheCache) {
  const CpuCacheStats before = cpu_cache_stats();
  {
    at::Tensor small = tensor_of_bytes(static_cast<int64_t>(kMinCachedBlockBytes) - 4);
    at::Tensor empty = at::empty({0});
  }
  const CpuCacheStats after = cpu_cache_stats();
  EXPECT_EQ(after.hits, before.hits);
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(after.mapped_bytes, 0);
}

TEST_F(CachingCpuAllocatorTest, MissUnmapsCachedBlocksBeforeMapping) {
  at::Tensor a = tensor_of_bytes(kMiB);
  at::Tensor b = tensor_of_bytes(kMiB);
  a.reset();
  b.reset();  // cached: a (older), b
  const CpuCacheStats before = cpu_cache_stats();
  at::Tensor c = tensor_of_bytes(kMiB / 2);  // no block of its size: unmaps a, then maps
  CpuCacheStats after = cpu_cache_stats();
  EXPECT_EQ(after.unmapped_blocks - before.unmapped_blocks, 1);
  EXPECT_EQ(after.cached_bytes, kMiB);
  EXPECT_EQ(after.mapped_bytes, kMiB + kMiB / 2);
  at::Tensor d = tensor_of_bytes(3 * kMiB);  // unmaps b; the cache is then empty
  after = cpu_cache_stats();
  EXPECT_EQ(after.unmapped_blocks - before.unmapped_blocks, 2);
  EXPECT_EQ(after.cached_bytes, 0);
  EXPECT_EQ(after.mapped_bytes, kMiB / 2 + 3 * kMiB);
}

TEST_F(CachingCpuAllocatorTest, MissRemapsTheBlockItUnmapsInPlace) {
  at::Tensor a = tensor_of_bytes(2 * kMiB);
  void* data = a.data_ptr();
  a.reset();  // the peak in use is 2 MiB: a 1 MiB block may not be mapped beside it
  const CpuCacheStats before = cpu_cache_stats();
  at::Tensor b = tensor_of_bytes(kMiB);
  EXPECT_EQ(b.data_ptr(), data);  // a's mapping, shrunk in place (its pages kept)
  const CpuCacheStats after = cpu_cache_stats();
  EXPECT_EQ(after.misses - before.misses, 1);
  EXPECT_EQ(after.unmapped_blocks - before.unmapped_blocks, 1);
  EXPECT_EQ(after.mapped_bytes, kMiB);
  EXPECT_EQ(after.cached_bytes, 0);
}

// The bound of the header: mapped bytes never exceed the most bytes in use at once, for
// any sequence of requests and frees.
TEST_F(CachingCpuAllocatorTest, MappedBytesNeverExceedThePeakInUse) {
  std::mt19937 random(42);
  const std::vector<int64_t> sizes = {256 << 10, 512 << 10, kMiB, 3 * kMiB, 5 * kMiB / 2};
  std::vector<at::Tensor> alive;
  int64_t in_use = 0, peak_in_use = 0;
  for (int i = 0; i < 2000; ++i) {
    if (!alive.empty() && (alive.size() > 12 || random() % 2 == 0)) {
      const size_t k = random() % alive.size();
      in_use -= alive[k].nbytes();
      alive.erase(alive.begin() + static_cast<int64_t>(k));
    } else {
      alive.push_back(tensor_of_bytes(sizes[random() % sizes.size()]));
      in_use += alive.back().nbytes();
      peak_in_use = std::max(peak_in_use, in_use);
    }
    const CpuCacheStats stats = cpu_cache_stats();
    ASSERT_LE(stats.mapped_bytes, peak_in_use) << "after operation " << i;
    ASSERT_EQ(stats.mapped_bytes - stats.cached_bytes, in_use) << "after operation " << i;
  }
  alive.clear();
  EXPECT_EQ(cpu_cache_stats().cached_bytes, cpu_cache_stats().mapped_bytes);
  empty_cpu_cache();
  EXPECT_EQ(cpu_cache_stats().mapped_bytes, 0);
}

// A repeated step (the same sizes in the same order) is served from the cache entirely
// from its second run on.
TEST_F(CachingCpuAllocatorTest, RepeatedStepHitsEveryTime) {
  const auto step = [] {
    at::Tensor x = tensor_of_bytes(kMiB);
    at::Tensor y = at::matmul(x.view({512, 512}), x.view({512, 512}));  // 1 MiB result
    at::Tensor z = tensor_of_bytes(2 * kMiB);
    y.reset();
    at::Tensor w = tensor_of_bytes(kMiB);
  };
  step();
  const CpuCacheStats before = cpu_cache_stats();
  for (int i = 0; i < 5; ++i) step();
  const CpuCacheStats after = cpu_cache_stats();
  EXPECT_EQ(after.misses - before.misses, 0);
  EXPECT_EQ(after.hits - before.hits, 5 * 4);
  EXPECT_EQ(after.unmapped_blocks, before.unmapped_blocks);
}

TEST_F(CachingCpuAllocatorTest, StorageResizeGoesThroughTheCache) {
  at::Tensor flat = tensor_of_bytes(kMiB);
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  void* data = flat.data_ptr();
  at::native::resize_bytes_cpu(storage, 0);  // reshard: the block goes to the cache
  EXPECT_EQ(cpu_cache_stats().cached_bytes, kMiB);
  at::native::resize_bytes_cpu(storage, kMiB);  // unshard: the same block comes back
  EXPECT_EQ(storage->data(), data);
  EXPECT_EQ(cpu_cache_stats().cached_bytes, 0);
}

TEST_F(CachingCpuAllocatorTest, RawAllocateAndDeallocateBothSizes) {
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* small = allocator->raw_allocate(1024);
  void* large = allocator->raw_allocate(kMiB);
  ASSERT_NE(small, nullptr);
  ASSERT_NE(large, nullptr);
  allocator->raw_deallocate(small);
  allocator->raw_deallocate(large);
  EXPECT_EQ(cpu_cache_stats().cached_bytes, kMiB);
}

TEST_F(CachingCpuAllocatorTest, MemoryTrackerWrapsTheCache) {
  MemoryTracker tracker;
  const int64_t tracked_before = memory_allocated();
  const CpuCacheStats before = cpu_cache_stats();
  {
    at::Tensor a = tensor_of_bytes(kMiB);
    EXPECT_EQ(memory_allocated() - tracked_before, kMiB);
  }
  EXPECT_EQ(memory_allocated(), tracked_before);
  EXPECT_EQ(cpu_cache_stats().misses - before.misses, 1);  // header + 1 MiB, page-rounded
}

TEST(CachingCpuAllocatorInstallTest, RefusedUnderALiveMemoryTracker) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: nothing installed yet
  EXPECT_EXIT(
      {
        MemoryTracker tracker;
        try {
          install_caching_cpu_allocator();
        } catch (const c10::Error& e) {
          std::exit(
              std::string(e.what()).find("before any MemoryTracker") != std::string::npos ? 3 : 4);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(3), "");
}

}  // namespace
}  // namespace fsdp
