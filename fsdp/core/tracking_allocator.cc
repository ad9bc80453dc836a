#include "fsdp/core/tracking_allocator.h"

#include <array>
#include <atomic>
#include <limits>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

// Note [Tracked allocations]
// Each tracked allocation asks the wrapped (previous) allocator for kHeaderBytes more
// than requested and returns the memory after a header that records the wrapped
// DataPtr's context and deleter, the requested size and the counter slot charged. The
// DataPtr we return has data == context == the user's pointer and our deleter, which
// reads the header back, subtracts the size from that slot (and the whole-process
// slot), and hands the wrapped context to the wrapped deleter. So:
// - frees are charged to the tag of the allocating thread, from whichever thread;
// - memory allocated before install carries the previous allocator's deleter and never
//   reaches ours, so it is not subtracted although it was never added;
// - data == context keeps Allocator::raw_allocate / raw_deallocate working;
// - no side table and no lock: an allocation costs a few atomic adds.
// The header is kHeaderBytes = c10's alignment (64 bytes), so the user's pointer keeps
// the wrapped allocator's alignment.
constexpr size_t kHeaderBytes = c10::gAlignment;
constexpr uint64_t kMagic = 0xf5d9a110c8edull;

struct Header {
  void* wrapped_context;
  c10::DeleterFnPtr wrapped_deleter;
  int64_t nbytes;
  int32_t slot;
  uint64_t magic;
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit before the data");

// Slots: one per tag, then kUntagged's, then the whole process's.
constexpr int kUntaggedSlot = kNumMemoryTags;
constexpr int kProcessSlot = kNumMemoryTags + 1;
constexpr int kNumSlots = kNumMemoryTags + 2;

struct alignas(64) Counters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> allocated_bytes{0};

  void add(int64_t nbytes) {
    const int64_t now = current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    allocations.fetch_add(1, std::memory_order_relaxed);
    allocated_bytes.fetch_add(nbytes, std::memory_order_relaxed);
  }
  void subtract(int64_t nbytes) { current.fetch_sub(nbytes, std::memory_order_relaxed); }
  void reset_peak() {
    peak.store(current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
};

std::array<Counters, kNumSlots>& counters() {
  static auto* slots = new std::array<Counters, kNumSlots>();  // outlives every tensor
  return *slots;
}

thread_local int current_tag = kUntagged;

int slot_of_tag(int tag) { return tag == kUntagged ? kUntaggedSlot : tag; }

int slot_of_query(int tag) {
  TORCH_CHECK(tag == kWholeProcess || tag == kUntagged || (tag >= 0 && tag < kNumMemoryTags),
              "memory tag ", tag, " is out of range: expected 0 <= tag < ", kNumMemoryTags,
              ", kUntagged (-1) or kWholeProcess (-2)");
  return tag == kWholeProcess ? kProcessSlot : slot_of_tag(tag);
}

void delete_tracked(void* data) {
  if (data == nullptr) return;  // raw_deleter()(nullptr), e.g. after raw_allocate(0)
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
  TORCH_INTERNAL_ASSERT(header->magic == kMagic, "tracking allocator: corrupt header");
  counters()[header->slot].subtract(header->nbytes);
  counters()[kProcessSlot].subtract(header->nbytes);
  header->magic = 0;
  header->wrapped_deleter(header->wrapped_context);
}

// See Note [Tracked allocations]. Never destroyed: storages made while it was installed
// keep a pointer to it and call it when they resize, whenever that happens.
class TrackingAllocator final : public c10::Allocator {
 public:
  void set_wrapped(c10::Allocator* wrapped) { wrapped_.store(wrapped); }
  c10::Allocator* wrapped() const { return wrapped_.load(); }

  c10::DataPtr allocate(size_t nbytes) override {
    c10::Allocator* wrapped = wrapped_.load(std::memory_order_acquire);
    if (nbytes == 0) return {nullptr, nullptr, &delete_tracked, c10::Device(c10::kCPU)};
    TORCH_CHECK(nbytes <= std::numeric_limits<size_t>::max() - kHeaderBytes,
                "tracking allocator: cannot allocate ", nbytes, " bytes");
    c10::DataPtr inner = wrapped->allocate(nbytes + kHeaderBytes);
    char* base = static_cast<char*>(inner.get());
    const c10::DeleterFnPtr inner_deleter = inner.get_deleter();
    void* inner_context = inner.release_context();
    const int slot = slot_of_tag(current_tag);
    new (base) Header{inner_context, inner_deleter, static_cast<int64_t>(nbytes), slot, kMagic};
    counters()[slot].add(static_cast<int64_t>(nbytes));
    counters()[kProcessSlot].add(static_cast<int64_t>(nbytes));
    void* data = base + kHeaderBytes;
    return {data, data, &delete_tracked, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_tracked; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  std::atomic<c10::Allocator*> wrapped_{nullptr};
};

TrackingAllocator& tracking_allocator() {
  static auto* allocator = new TrackingAllocator();
  return *allocator;
}

std::mutex install_mutex;
int install_depth = 0;  // guarded by install_mutex

}  // namespace

MemoryTracker::MemoryTracker() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (install_depth++ > 0) return;
  TrackingAllocator& tracker = tracking_allocator();
  c10::Allocator* previous = c10::GetCPUAllocator();
  TORCH_INTERNAL_ASSERT(previous != &tracker);
  tracker.set_wrapped(previous);
  c10::SetCPUAllocator(&tracker, kTrackingAllocatorPriority);
  TORCH_CHECK(c10::GetCPUAllocator() == &tracker,
              "MemoryTracker: c10 refused to install the tracking CPU allocator");
}

MemoryTracker::~MemoryTracker() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (--install_depth > 0) return;
  // The tracker keeps wrapping `previous`, for storages that still use it.
  c10::SetCPUAllocator(tracking_allocator().wrapped(), kTrackingAllocatorPriority);
}

bool MemoryTracker::is_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return install_depth > 0;
}

MemoryTagGuard::MemoryTagGuard(int tag) : previous_(current_tag) {
  TORCH_CHECK(tag == kUntagged || (tag >= 0 && tag < kNumMemoryTags), "MemoryTagGuard: tag ", tag,
              " is out of range: expected 0 <= tag < ", kNumMemoryTags, " or kUntagged (-1)");
  current_tag = tag;
}

MemoryTagGuard::~MemoryTagGuard() { current_tag = previous_; }

int current_memory_tag() { return current_tag; }

MemoryStats memory_stats(int tag) {
  const Counters& c = counters()[slot_of_query(tag)];
  MemoryStats stats;
  stats.current_bytes = c.current.load(std::memory_order_relaxed);
  stats.peak_bytes = c.peak.load(std::memory_order_relaxed);
  stats.allocations = c.allocations.load(std::memory_order_relaxed);
  stats.allocated_bytes = c.allocated_bytes.load(std::memory_order_relaxed);
  return stats;
}

int64_t memory_allocated(int tag) { return memory_stats(tag).current_bytes; }

int64_t max_memory_allocated(int tag) { return memory_stats(tag).peak_bytes; }

void reset_peak_memory_stats(int tag) {
  const int slot = slot_of_query(tag);
  if (slot != kProcessSlot) {
    counters()[slot].reset_peak();
    return;
  }
  for (Counters& c : counters()) c.reset_peak();
}

}  // namespace fsdp
