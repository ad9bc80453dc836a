// A caching CPU allocator for tensors: the CPU counterpart of PyTorch's CUDA caching
// allocator. Each block of at least kMinCachedBlockBytes is mapped on its own (mmap);
// when its tensor is freed the block is kept, and the next request of the same
// page-rounded size gets it back without a system call or a page fault. A training step
// allocates the same sizes as the step before (activations, gathered units, flat
// gradients), so from the second step on its large tensors come from the cache.
//
//   int main(int argc, char** argv) {
//     fsdp::install_caching_cpu_allocator();   // first, before any tensor exists
//     ...                                      // train
//     fsdp::cpu_cache_stats().hits;            // requests served from the cache
//     fsdp::empty_cpu_cache();                 // unmap what is cached
//   }
//
// Memory. The cache never makes the process hold more than its tensors' peak: before it
// maps a new block it unmaps cached blocks, least recently freed first, as far as needed
// to keep the bytes mapped for large blocks within the most bytes of large blocks alive at
// once (peak_in_use_bytes below), and remaps the largest of them to the new size rather
// than mapping fresh pages. So the resident set follows the tensors (as a fixed glibc mmap
// threshold makes it, but without returning every freed block to the kernel and faulting
// fresh zeroed pages back in on the next step).
// Smaller requests go to c10's default CPU allocator (glibc's heap).
// See Note [Caching CPU blocks] in caching_cpu_allocator.cc.
//
// Threading. Allocation and freeing are safe from any thread (one mutex, held for a few
// hash-map operations, never across a system call's page faults). Installing swaps c10's
// CPU allocator pointer, which c10 does not synchronise: install before other threads
// allocate tensors. Not fork-safe between fork and exec (as malloc is not).
//
// PyTorch: c10::cuda::CUDACachingAllocator (torch.cuda.empty_cache,
// torch.cuda.memory_reserved) on the GPU; on the CPU PyTorch has none for desktop builds
// (c10's CPUCachingAllocator is for mobile builds and never returns memory).
#ifndef FSDP_CORE_CACHING_CPU_ALLOCATOR_H_
#define FSDP_CORE_CACHING_CPU_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>

namespace fsdp {

// Requests of at least this many bytes are mapped on their own and cached when freed.
inline constexpr size_t kMinCachedBlockBytes = size_t{256} << 10;

// Installs the caching allocator as c10's CPU allocator, for the rest of the process.
// Call it first in main(), before any tensor exists: a storage keeps the allocator it was
// made with (resizes included), so tensors made before stay on c10's default. A second
// call is a no-op. Throws c10::Error if another allocator than c10's default is installed
// (e.g. a live fsdp::MemoryTracker: install the cache first, the tracker wraps it).
void install_caching_cpu_allocator();

// Whether install_caching_cpu_allocator has run in this process.
bool caching_cpu_allocator_installed();

// The cache's counters since install (all zero before). Bytes are page-rounded block sizes.
struct CpuCacheStats {
  int64_t mapped_bytes = 0;       // blocks mapped now: in use + cached
  int64_t cached_bytes = 0;       // blocks mapped now and free for reuse
  int64_t peak_mapped_bytes = 0;  // the most mapped_bytes has been, and
  int64_t peak_in_use_bytes = 0;  // the most bytes of blocks in use at once, since install
                                  // or empty_cpu_cache; peak_mapped <= peak_in_use always
  int64_t hits = 0;               // requests served from the cache
  int64_t misses = 0;             // requests that mapped a new block
  int64_t unmapped_blocks = 0;    // cached blocks taken out of the cache by a miss or by
                                  // empty_cpu_cache: unmapped, or remapped to the miss's size
};
// PyTorch: torch.cuda.memory_stats ("reserved_bytes", "num_alloc_retries" ...).
CpuCacheStats cpu_cache_stats();

// Unmaps every cached (free) block; blocks in use are untouched. The peaks restart from
// the bytes in use now, so the cache regrows only up to what the work after the call holds
// at once (e.g. call it after loading a checkpoint whose transient peak training never
// reaches). Safe from any thread. PyTorch: torch.cuda.empty_cache and
// torch.cuda.reset_peak_memory_stats.
void empty_cpu_cache();

}  // namespace fsdp

#endif  // FSDP_CORE_CACHING_CPU_ALLOCATOR_H_
