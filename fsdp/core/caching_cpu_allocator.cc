#include "fsdp/core/caching_cpu_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

// Note [Caching CPU blocks]
// Why. glibc's malloc either keeps freed blocks in its heap (its default: the heap then
// holds the largest amount ever used, fragmented, not the tensors alive: a fine-tune was
// measured 35-47% above its tensors' peak) or, for blocks above a fixed mmap threshold,
// maps each one fresh and unmaps it when freed (the resident set follows the tensors, but
// every step faults in and zeroes its activations' pages again: benchmarks/PROFILE.md
// measured a third of a GPT step's speed lost to it). Training allocates the same sizes
// every step, so keeping freed blocks by size gives both: no page faults after the first
// step, and no more memory than the tensors' peak.
//
// How. A block is a page-rounded anonymous mapping. Freed blocks go into `free_` (by
// size, most recently freed last) and into `lru_` (every cached block, least recently
// freed first). A request takes the most recently freed block of its rounded size. If
// there is none, it maps a new block, first unmapping cached blocks from the front of
// `lru_` until the mapped bytes, the new block counted, are within the most bytes ever in
// use at once (this request counted): mapped_bytes <= peak_in_use_bytes at all times.
// Unmapping any less than that would break the bound; unmapping more (e.g. as much as the
// request, whatever the bound) was measured to cascade: each miss unmapped blocks that
// later requests of the same step needed, so ~1/3 of a GPT step's requests kept missing.
// Exact sizes (no splitting, unlike the CUDA allocator's) keep the bound simple, and a
// step's sizes repeat, so exact reuse mostly hits; but a step's mix of sizes alive changes
// as it goes, so under the bound some requests still miss every step (a GPT of width 256
// at W = 2: about 25 of 160 per step). A miss that unmaps blocks therefore remaps the
// largest of them to its own size (mremap) instead of mapping fresh pages: the pages it
// keeps need no fault and no zeroing.
// System calls run outside the mutex.
class CachingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinCachedBlockBytes) return c10::GetDefaultCPUAllocator()->allocate(nbytes);
    void* data = take_block(round_to_pages(nbytes));
    return {data, data, &free_large, c10::Device(c10::kCPU)};
  }

  // raw_deallocate passes any pointer allocate returned: large ones are in `live_`.
  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  CpuCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void empty_cache() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (!lru_.empty()) evicted.push_back(evict_oldest());
      // The bound starts again from what is in use now.
      stats_.peak_in_use_bytes = stats_.mapped_bytes;
      stats_.peak_mapped_bytes = stats_.mapped_bytes;
    }
    unmap_all(evicted);
  }

  // Returns a block to the cache; false if `data` is not a large block of ours.
  bool release(void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(data);
    if (it == live_.end()) return false;
    const size_t bytes = it->second;
    live_.erase(it);
    lru_.push_back(Block{data, bytes});
    free_[bytes].push_back(std::prev(lru_.end()));
    stats_.cached_bytes += bytes;
    return true;
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };
  using LruIterator = std::list<Block>::iterator;

  static size_t round_to_pages(size_t nbytes) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    TORCH_CHECK(nbytes <= SIZE_MAX - page, "caching CPU allocator: cannot allocate ", nbytes,
                " bytes");
    return (nbytes + page - 1) / page * page;
  }

  static void free_large(void* data);
  static void free_any(void* data);

  void* take_block(size_t bytes) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        LruIterator block = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) free_.erase(it);
        void* data = block->data;
        lru_.erase(block);
        stats_.cached_bytes -= bytes;
        ++stats_.hits;
        live_.emplace(data, bytes);
        return data;
      }
      // Unmap only as much as keeps mapped_bytes within the peak in use, this request
      // counted: cached blocks below that bound are kept for later requests.
      const int64_t in_use = stats_.mapped_bytes - stats_.cached_bytes + int64_t(bytes);
      stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, in_use);
      while (!lru_.empty() && stats_.mapped_bytes + int64_t(bytes) > stats_.peak_in_use_bytes) {
        evicted.push_back(evict_oldest());
      }
      ++stats_.misses;
      // Counted as mapped before the call so that the bound holds at every moment.
      add_mapped(bytes);
    }
    void* data = remap_largest(evicted, bytes);
    unmap_all(evicted);
    if (data == nullptr) data = map_block(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(data, bytes);
    return data;
  }

  // Turns the largest of `evicted` into a block of `bytes` (mremap: its resident pages stay,
  // up to the new size) and takes it out of `evicted`; nullptr if there is none or the
  // kernel refuses. See Note [Caching CPU blocks].
  static void* remap_largest(std::vector<Block>& evicted, size_t bytes) {
    if (evicted.empty()) return nullptr;
    auto largest =
        std::max_element(evicted.begin(), evicted.end(),
                         [](const Block& a, const Block& b) { return a.bytes < b.bytes; });
    void* data = mremap(largest->data, largest->bytes, bytes, MREMAP_MAYMOVE);
    if (data == MAP_FAILED) return nullptr;  // `largest` is still mapped: unmapped with the rest
    evicted.erase(largest);
    return data;
  }

  // mapped_bytes already counts `bytes`; on failure it is taken back before the throw.
  void* map_block(size_t bytes) {
    const auto map = [bytes] {
      return mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    };
    void* data = map();
    if (data == MAP_FAILED) {
      empty_cache();
      data = map();
    }
    if (data == MAP_FAILED) {
      const int error = errno;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stats_.mapped_bytes -= static_cast<int64_t>(bytes);
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "caching CPU allocator: could not map ", bytes,
                       " bytes (", std::strerror(error),
                       "), even after unmapping every cached block");
    }
    return data;
  }

  // Caller holds mutex_.
  void add_mapped(size_t bytes) {
    stats_.mapped_bytes += static_cast<int64_t>(bytes);
    stats_.peak_mapped_bytes = std::max(stats_.peak_mapped_bytes, stats_.mapped_bytes);
  }

  // Caller holds mutex_. Removes the least recently freed block from the cache.
  Block evict_oldest() {
    const Block block = lru_.front();
    auto it = free_.find(block.bytes);
    TORCH_INTERNAL_ASSERT(it != free_.end() && &*it->second.front() == &lru_.front());
    it->second.pop_front();
    if (it->second.empty()) free_.erase(it);
    lru_.pop_front();
    stats_.cached_bytes -= static_cast<int64_t>(block.bytes);
    stats_.mapped_bytes -= static_cast<int64_t>(block.bytes);
    ++stats_.unmapped_blocks;
    return block;
  }

  static void unmap_all(const std::vector<Block>& blocks) {
    for (const Block& block : blocks) {
      TORCH_INTERNAL_ASSERT(munmap(block.data, block.bytes) == 0,
                            "munmap failed: ", std::strerror(errno));
    }
  }

  std::mutex mutex_;
  absl::flat_hash_map<void*, size_t> live_;                    // large blocks in use: bytes
  std::list<Block> lru_;                                       // cached, least recently freed first
  absl::flat_hash_map<size_t, std::deque<LruIterator>> free_;  // cached, by bytes
  CpuCacheStats stats_;
};

CachingCpuAllocator& caching_allocator() {
  static auto* allocator = new CachingCpuAllocator();  // outlives every tensor
  return *allocator;
}

void CachingCpuAllocator::free_large(void* data) {
  TORCH_INTERNAL_ASSERT(caching_allocator().release(data),
                        "caching CPU allocator: freeing a block it did not allocate");
}

void CachingCpuAllocator::free_any(void* data) {
  if (data == nullptr) return;
  if (!caching_allocator().release(data)) c10::GetDefaultCPUAllocator()->raw_deleter()(data);
}

std::mutex install_mutex;
bool installed = false;  // guarded by install_mutex

// c10 keeps the allocator of the highest priority it was given; the tracking allocator
// (tracking_allocator.h) installs at 255 and must still be able to wrap this one.
constexpr uint8_t kCachingAllocatorPriority = 255;

}  // namespace

void install_caching_cpu_allocator() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed) return;
  TORCH_CHECK(c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator(),
              "install_caching_cpu_allocator: c10's CPU allocator is not its default one (a "
              "MemoryTracker alive, or another library's allocator); install the cache first "
              "thing in main(), before any MemoryTracker");
  c10::SetCPUAllocator(&caching_allocator(), kCachingAllocatorPriority);
  TORCH_CHECK(c10::GetCPUAllocator() == &caching_allocator(),
              "install_caching_cpu_allocator: c10 refused the allocator");
  installed = true;
}

bool caching_cpu_allocator_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return installed;
}

CpuCacheStats cpu_cache_stats() { return caching_allocator().stats(); }

void empty_cpu_cache() { caching_allocator().empty_cache(); }

}  // namespace fsdp
