// A tracking CPU allocator: counts the bytes of every CPU tensor allocation while a
// MemoryTracker lives, with current and peak figures for the whole process and per
// memory tag (e.g. per rank when ranks are threads). The CPU counterpart of
// torch.cuda.memory_allocated / max_memory_allocated / reset_peak_memory_stats.
//
//   fsdp::MemoryTracker tracker;                      // installs; restores on destruction
//   fsdp::reset_peak_memory_stats();
//   at::Tensor t = at::empty({1000});                 // float: +4000 bytes
//   fsdp::memory_allocated();                         // 4000 more than before
//   t.reset();
//   fsdp::max_memory_allocated();                     // still counts the 4000
//
//   // Ranks as threads: each thread counts under its own tag.
//   fsdp::FakeWorld::run(world, [](fsdp::Communicator& comm) {
//     fsdp::MemoryTagGuard tag(comm.rank());
//     ...
//     fsdp::max_memory_allocated(comm.rank());       // this rank's peak
//   });
//
// What is counted. Every allocation made through c10::GetCPUAllocator() while a
// MemoryTracker is installed (at::empty and friends, tensor results of CPU ops, storage
// resizes), in bytes as requested (a storage's nbytes), without allocator overhead.
// Memory that does not go through c10's CPU allocator (from_blob buffers, Gloo's own
// buffers, std::vector, malloc) is not counted. See Note [Tracked allocations] in
// tracking_allocator.cc for the bookkeeping; in short:
// - a tensor allocated before install and freed while installed (or after) never
//   touches the counters (its DataPtr carries the previous allocator's deleter);
// - a tensor allocated while installed and freed after uninstall is still subtracted,
//   from the tag it was counted under, whichever thread frees it;
// - a storage created while installed keeps the tracking allocator for later resizes
//   (at::native::resize_bytes_cpu, FlatParamHandle::unshard), so those stay counted
//   even after the last MemoryTracker is gone.
//
// Tags. Each thread has a current memory tag, kUntagged until a MemoryTagGuard sets one
// (thread_local; threads do not inherit it). An allocation is counted under its thread's
// tag and under the whole process; its free is subtracted from the same two counters.
// Tags are 0 <= tag < kNumMemoryTags (ranks); queries also accept kUntagged and
// kWholeProcess (the default).
//
// Threading. Counting and queries are lock-free (atomics) and safe from any thread.
// Installing and uninstalling (MemoryTracker's constructor and outermost destructor)
// swap c10's CPU allocator pointer, which c10 does not synchronise: do it while no other
// thread allocates CPU tensors (e.g. before starting rank threads).
#ifndef FSDP_CORE_TRACKING_ALLOCATOR_H_
#define FSDP_CORE_TRACKING_ALLOCATOR_H_

#include <cstdint>

namespace fsdp {

// Tags a thread may count under: 0 <= tag < kNumMemoryTags.
inline constexpr int kNumMemoryTags = 64;
// The tag of a thread that has no MemoryTagGuard.
inline constexpr int kUntagged = -1;
// Query every counted allocation, whatever its tag.
inline constexpr int kWholeProcess = -2;

// The c10 allocator priority the tracker installs with (the highest). c10 has no way to
// read a priority back, so uninstalling restores the previous allocator at this
// priority too: afterwards c10::SetCPUAllocator calls with a lower priority are ignored.
inline constexpr uint8_t kTrackingAllocatorPriority = 255;

// Installs the tracking allocator as c10's CPU allocator (wrapping the one in place) on
// construction and puts the previous one back on destruction. Scopes nest: only the
// outermost installs and restores. Counters are not reset by either (use
// reset_peak_memory_stats). Construct and destroy on one thread while no other thread
// allocates (see Threading above). PyTorch: none for CPU (the CUDA caching allocator
// always counts).
class MemoryTracker {
 public:
  MemoryTracker();
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Whether a MemoryTracker is alive (the tracking allocator is c10's CPU allocator).
  static bool is_installed();
};

// Sets the calling thread's memory tag for its lifetime and restores the previous one on
// destruction. `tag`: 0 <= tag < kNumMemoryTags, or kUntagged; throws c10::Error
// otherwise. Thread-local: affects only allocations made by this thread.
class [[nodiscard]] MemoryTagGuard {
 public:
  explicit MemoryTagGuard(int tag);
  ~MemoryTagGuard();
  MemoryTagGuard(const MemoryTagGuard&) = delete;
  MemoryTagGuard& operator=(const MemoryTagGuard&) = delete;

 private:
  int previous_;
};

// The calling thread's memory tag (kUntagged by default).
int current_memory_tag();

// Counters of one tag (or kUntagged, or kWholeProcess). Bytes as requested by c10.
struct MemoryStats {
  int64_t current_bytes = 0;    // allocated and not yet freed
  int64_t peak_bytes = 0;       // max of current_bytes since the last reset of the peak
  int64_t allocations = 0;      // number of counted allocations so far
  int64_t allocated_bytes = 0;  // their total size so far (freed or not)
};

// All counters of `tag` (0 <= tag < kNumMemoryTags, kUntagged or kWholeProcess; throws
// c10::Error otherwise). PyTorch: torch.cuda.memory_stats.
MemoryStats memory_stats(int tag = kWholeProcess);

// Bytes currently allocated under `tag`. PyTorch: torch.cuda.memory_allocated.
int64_t memory_allocated(int tag = kWholeProcess);

// Peak of memory_allocated(tag) since the last reset_peak_memory_stats covering `tag`.
// PyTorch: torch.cuda.max_memory_allocated.
int64_t max_memory_allocated(int tag = kWholeProcess);

// Sets the peak of `tag` to its current value; kWholeProcess resets every counter's peak
// (the process's, kUntagged's and every tag's). PyTorch: torch.cuda.reset_peak_memory_stats.
void reset_peak_memory_stats(int tag = kWholeProcess);

}  // namespace fsdp

#endif  // FSDP_CORE_TRACKING_ALLOCATOR_H_
