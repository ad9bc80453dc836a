// An in-process fake backend: W ranks as threads of one process, for fast unit tests of
// the layers above fsdp/comm. Same validation, counters and errors as the real backends;
// results computed exactly (sums in rank order, in the buffer's dtype).
//
//   auto world = fsdp::FakeWorld::create(/*world_size=*/4);
//   world->inject_failure(/*rank=*/1, /*sequence=*/3);   // rank 1's 4th collective fails
//   fsdp::FakeWorld::run(world, [](fsdp::Communicator& comm) {
//     at::Tensor t = at::full({2}, comm.rank());
//     comm.all_reduce(t);                                // every rank: 0+1+2+3
//   });
//
// A rank that does not reach a collective within the timeout makes the others throw a
// CommError naming the missing rank. Ranks that issue different collectives (or
// different sizes) at the same sequence number throw a CommError saying so.
//
// Devices and streams: buffers on the CPU or on a CUDA device (all of one collective's
// ranks on one device type; typically every rank on cuda:0, ranks as threads sharing one
// GPU). A collective runs on each rank's calling thread and returns a completed work:
// on CUDA it synchronizes that thread's current stream before peers read the rank's
// input, reads and writes on that stream, and synchronizes again before returning, so
// the output is complete for every stream (Note [Fake collectives on device buffers] in
// fake.cc). Give each rank thread its own current stream (PyTorch: a
// torch.cuda.Stream per rank under torch.cuda.stream) to test stream handling as on real
// ranks. This target needs no CUDA headers or libraries; CUDA buffers need libtorch_cuda
// in the binary (as any CUDA tensor does). Ranks as threads on CUDA that run backward
// must switch off the autograd engine's device threads on each rank thread
// (c10::AutogradState::get_tls_state().set_multithreading_enabled(false); PyTorch:
// torch.autograd.set_multithreading_enabled(False)): otherwise the engine runs every rank's CUDA
// backward on one shared device thread, and a collective issued there by one rank's hook waits for
// peers that cannot run.
//
// Host groups (Communicator::new_host_subgroup) are fake worlds of their own, as a device
// backend's are Gloo groups over its store: their collectives are not among the world's
// calls(). calls() records which thread issued each collective of the world and its
// subgroups, on which device, for tests of what runs where (e.g. that no thread but a
// rank's own issues a collective of that rank's family, as a device backend requires).
//
// Threading: each rank's communicator is used by that rank's thread; a FakeWorld is
// shared by all of them.
#ifndef FSDP_COMM_FAKE_H_
#define FSDP_COMM_FAKE_H_

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.h"

namespace fsdp {

namespace comm_internal {
class FakeGroup;
}  // namespace comm_internal

class FakeWorld {
 public:
  // Throws c10::Error if world_size < 1 or timeout <= 0.
  static std::shared_ptr<FakeWorld> create(
      int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // Rank `rank`'s communicator (one per rank; calling twice gives two communicators that
  // share the rank, which is an error to use concurrently).
  std::shared_ptr<Communicator> communicator(int rank);

  // Rank `rank`'s collective number `sequence` (0-based, counted on the world
  // communicator) fails with a CommError on that rank, which then stops taking part:
  // its peers time out waiting for it.
  void inject_failure(int rank, int64_t sequence);

  // Runs fn(comm) for every rank on its own thread; returns when all are done. Rethrows
  // the exception of the lowest failing rank, if any.
  static void run(const std::shared_ptr<FakeWorld>& world,
                  const std::function<void(Communicator&)>& fn);

  int world_size() const;

  // One collective as one rank issued it.
  struct Call {
    int rank;  // global
    CollectiveKind kind;
    std::vector<int> group;  // the subgroup's global ranks; empty for the world
    std::thread::id thread;  // the issuing thread
    c10::Device device;      // its buffers' (CPU for a barrier)
  };
  // Every collective issued so far on a communicator of this world or of a subgroup made
  // from one (new_subgroup, split_hybrid, the schedule checks' side channel), in the
  // order they were issued; not those of host groups. Thread-safe.
  std::vector<Call> calls() const;

 private:
  explicit FakeWorld(std::shared_ptr<comm_internal::FakeGroup> group);
  std::shared_ptr<comm_internal::FakeGroup> group_;
};

}  // namespace fsdp

#endif  // FSDP_COMM_FAKE_H_
