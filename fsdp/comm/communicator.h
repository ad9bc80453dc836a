// The communicator: every byte fsdp moves between ranks goes through this interface.
// fsdp/comm knows nothing of FSDP; backends (gloo.h, fake.h, nccl.h) only move bytes.
//
//   std::shared_ptr<fsdp::Communicator> comm = fsdp::init_from_environment();  // rendezvous.h
//   at::Tensor shard = at::ones({5});
//   at::Tensor full = at::empty({5 * comm->world_size()});
//   comm->all_gather_into_tensor(full, shard);            // blocks
//   fsdp::WorkHandle work = comm->reduce_scatter_tensor_async(shard, full, fsdp::ReduceOp::kAvg);
//   work->wait();                                          // throws fsdp::CommError on failure
//   comm->counters().get(fsdp::CollectiveKind::kAllGather).bytes_sent;  // 4 * 5 * (W - 1)
//
// Buffers. A collective takes CommBuffers: non-owning views of contiguous memory (a CPU
// at::Tensor, or a raw device pointer for NCCL). The caller keeps the memory alive and
// untouched until the work completes, as with c10d.
//
// Validation. Sizes, dtypes and devices are checked before any traffic; a mismatch
// throws c10::Error naming the collective and both shapes. Backend failures (a peer gone,
// a timeout, an NCCL error) throw CommError (see Note [Communication errors]).
//
// Ordering and threading. Every rank must issue the same collectives in the same order.
// Works of one communicator complete in issue order. A communicator may be used from one
// thread at a time; counters may be read from any thread.
//
// Traffic counters. Each collective adds what this rank sends and receives under the
// algorithm the backends implement (ring or pairwise exchange; see CollectiveKind):
// exact, and checked against the loopback interface's counters by the benchmarks.
#ifndef FSDP_COMM_COMMUNICATOR_H_
#define FSDP_COMM_COMMUNICATOR_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace fsdp {

namespace comm_internal {
struct ScheduleSlot;
}  // namespace comm_internal

enum class ReduceOp {
  kSum,
  kAvg,  // sum / world_size; floating-point dtypes only
};

// Collective kinds, with the bytes one rank sends (and receives) for a call on W ranks:
enum class CollectiveKind : int {
  kAllGather = 0,  // (W - 1) x input bytes
  kReduceScatter,  // (W - 1) x output bytes
  kAllReduce,      // 2 (W - 1) x ceil(bytes / W) (reduce-scatter then all-gather)
  kBroadcast,      // root sends W - 1 copies; every other rank receives one
  kBarrier,        // 0 bytes
};
inline constexpr int kNumCollectiveKinds = 5;

// "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier".
const char* collective_name(CollectiveKind kind);

struct CollectiveTraffic {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

// Per-kind call and byte counters of one communicator. Thread-safe.
class TrafficCounters {
 public:
  void record(CollectiveKind kind, int64_t bytes_sent, int64_t bytes_received);
  CollectiveTraffic get(CollectiveKind kind) const;
  CollectiveTraffic total() const;  // all kinds summed
  void reset();

 private:
  struct Slot {
    std::atomic<int64_t> calls{0}, sent{0}, received{0};
  };
  std::array<Slot, kNumCollectiveKinds> slots_;
};

// Note [Communication errors]
// Whatever the backend (a Gloo exception, an NCCL result code, a timeout, a fake
// backend's injected failure), a failed collective surfaces as one CommError thrown from
// Work::wait or the blocking call, and it says which collective (name and sequence
// number on this communicator, and the group's members if it is a subgroup), which rank
// saw it, which peer is to blame when the backend knows (-1 otherwise), and what the
// backend reported, e.g.
//   all_reduce #59 in group [0, 2] failed on rank 0 (peer rank 3): <backend's words>
// Ranks are global (ranks of the root communicator, as in the RANK variable), also for
// a subgroup, and the peer need not be a member of the failing group: the lost rank is
// named even when this rank only waited on a survivor. After a CommError the
// communicator is broken: every later call throws a CommError that repeats the first.
// CommError derives from c10::Error (as c10d's DistBackendError does), so a LibTorch
// user's `catch (const c10::Error&)` sees it; what() and what_without_backtrace() are the
// message above (no backtrace).
class CommError : public c10::Error {
 public:
  // `group`: the subgroup's global ranks, or empty for a root communicator.
  CommError(std::string collective, int64_t sequence, int rank, int peer, const std::string& detail,
            std::vector<int> group = {});
  const std::string& collective() const { return collective_; }
  int64_t sequence() const { return sequence_; }
  int rank() const { return rank_; }
  int peer() const { return peer_; }  // -1: unknown
  const std::vector<int>& group() const { return group_; }

 private:
  std::string collective_;
  int64_t sequence_;
  int rank_;
  int peer_;
  std::vector<int> group_;
};

// A non-owning view of contiguous memory holding `numel` elements of `dtype`.
struct CommBuffer {
  void* data = nullptr;
  int64_t numel = 0;
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device = c10::Device(c10::kCPU);

  // A view of a contiguous tensor; throws c10::Error (naming `what`) if it is not
  // contiguous or not defined.
  static CommBuffer of(const at::Tensor& tensor, const char* what);
  int64_t nbytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
  // The memory as a 1-D tensor of `numel` elements of `dtype` on `device`: a view, no
  // copy, valid while the memory is.
  at::Tensor as_tensor() const;
  std::string describe() const;  // e.g. "[10] Float on cpu"
};

// Handle to an issued collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective completed. Throws CommError if it failed or did not
  // complete within `timeout` (the communicator's timeout() by default, see below).
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  void wait();
  virtual bool is_completed() = 0;

 protected:
  explicit Work(std::chrono::milliseconds default_timeout) : default_timeout_(default_timeout) {}

 private:
  std::chrono::milliseconds default_timeout_;
};
using WorkHandle = std::shared_ptr<Work>;

// The two groups of hybrid sharding for this rank: parameters are sharded inside
// `shard_group` (F consecutive ranks, e.g. one host) and replicated across
// `replicate_group` (the ranks with the same index in the other shard groups).
struct HybridGroups {
  std::shared_ptr<class Communicator> shard_group;
  std::shared_ptr<class Communicator> replicate_group;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // This rank in the root communicator (the one new_subgroup was first called on).
  // PyTorch: dist.get_rank().
  int global_rank() const { return global_ranks_[rank_]; }
  // The members as root communicator ranks: global_ranks()[r] is rank r's global rank
  // (0 .. world_size - 1 for a root communicator). PyTorch: dist.get_process_group_ranks.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // Default deadline of blocking calls and Work::wait().
  std::chrono::milliseconds timeout() const { return timeout_; }
  virtual std::string backend_name() const = 0;

  // output: numel = world_size x input numel, rank r's input lands at r x input numel.
  // Same dtype and device. PyTorch: dist.all_gather_into_tensor.
  WorkHandle all_gather_into_tensor_async(const CommBuffer& output, const CommBuffer& input);
  void all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input);
  WorkHandle all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input);

  // input: numel = world_size x output numel; output = op over ranks of chunk `rank` of
  // the inputs. Same dtype and device. PyTorch: dist.reduce_scatter_tensor.
  WorkHandle reduce_scatter_tensor_async(const CommBuffer& output, const CommBuffer& input,
                                         ReduceOp op = ReduceOp::kSum);
  void reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                             ReduceOp op = ReduceOp::kSum);
  WorkHandle reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                         ReduceOp op = ReduceOp::kSum);

  // In place: tensor = op over ranks of tensor. PyTorch: dist.all_reduce.
  WorkHandle all_reduce_async(const CommBuffer& tensor, ReduceOp op = ReduceOp::kSum);
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  WorkHandle all_reduce_async(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);

  // In place: every rank's tensor = root's. 0 <= root < world_size. PyTorch:
  // dist.broadcast.
  WorkHandle broadcast_async(const CommBuffer& tensor, int root);
  void broadcast(const at::Tensor& tensor, int root);
  WorkHandle broadcast_async(const at::Tensor& tensor, int root);

  // Returns when every rank has entered the barrier. PyTorch: dist.barrier.
  WorkHandle barrier_async();
  void barrier();

  // A communicator over `ranks` (ascending, distinct, each in [0, world_size)), or nullptr
  // on ranks not in the list. No traffic: only the members call it, each the same number
  // of times for the same list. Rank i of the subgroup is ranks[i]. PyTorch:
  // dist.new_group.
  std::shared_ptr<Communicator> new_subgroup(const std::vector<int>& ranks);

  // A communicator over `ranks` (as new_subgroup: ascending, distinct; nullptr on ranks
  // not in the list; only the members call it, in the same order) whose collectives move
  // CPU buffers and make no device call, for host-side bookkeeping on a thread other
  // than the one that owns this communicator (an asynchronous checkpoint's writes):
  // outside this family's collective schedule, and used by one thread at a time like any
  // communicator. For a backend that moves CPU buffers a group of the same backend (gloo:
  // a subgroup of this family; fake: a fake world of its own); for nccl a Gloo group over
  // the same store (Note [Host groups of the NCCL backend] in nccl.cc), so that no NCCL
  // call is ever made from another thread. Collective over the members (it connects
  // them). Throws c10::Error as new_subgroup, or when the backend cannot make one.
  // PyTorch: dist.new_group(ranks, backend="gloo").
  std::shared_ptr<Communicator> new_host_subgroup(const std::vector<int>& ranks);

  // Whether this backend moves buffers on `device` (gloo: CPU and CUDA; nccl: its CUDA
  // device; fake: CPU and CUDA). Collectives on other devices throw c10::Error.
  bool moves_buffers_on(const c10::Device& device) const { return supports_device(device); }

  // Hybrid sharding groups with `shard_group_size` F ranks per shard group; world_size
  // must be a multiple of F. Every rank calls it. PyTorch: the process groups of
  // ShardingStrategy.HYBRID_SHARD (_init_intra_and_inter_node_groups).
  HybridGroups split_hybrid(int shard_group_size);

  // Size checks for this communicator and every communicator of its family (the root it
  // was made from and their subgroups). While enabled, each collective is preceded by a
  // small all-gather of its kind and element count; ranks that disagree raise CommError
  // on every rank naming each rank's collective and size, where they would otherwise
  // corrupt data, hang, or abort inside the backend (Gloo terminates the process when a
  // peer sends more bytes than expected). Costs one extra latency-bound collective per
  // collective, not counted in counters(). Every rank must switch at the same point of
  // its collective sequence. Backends that always check (the fake one) ignore it.
  // PyTorch: the collective fingerprints of TORCH_DISTRIBUTED_DEBUG=DETAIL.
  // Measured on the GPT of examples/gpt at W = 2 over Gloo (BM_SizeChecks in
  // benchmarks/gpt_step_benchmark.cc: FULL_SHARD, 14 collectives a step, checks in every
  // step against the first only, stepped alternately; medians of 15 runs of 8 steps on 2
  // shared cores): +11 ms on a 27 ms step of one 64-token sequence per rank (+37%), +16 ms
  // on a 127 ms step of 16 sequences (+16%); +37 ms (+62%) and +11 ms (+7%) under a load
  // of 6-7. So FSDP keeps them on in its first iteration only, and in every iteration only
  // with validate_execution_order. Where they are off, a Gloo rank that receives a longer
  // message than it posted for is still terminated by Gloo, after one line naming the
  // collective and the cause (Note [Gloo terminations] in gloo.cc).
  virtual void set_size_checks(bool /*enabled*/) {}

  // Collective schedule checks for this root communicator's family (its subgroups, made
  // before or after): each rank folds (kind, group, element count, dtype) of every
  // collective into a running hash, a few integer operations per collective, and
  // check_collective_schedule compares the hashes of all ranks. Every rank calls it at the
  // same point of its collective sequence (it makes a side channel: a second group of the
  // same ranks, with twice this communicator's timeout); calling it again does nothing.
  // While they are on, a collective of the family that fails (a timeout, a lost peer, a
  // size check's mismatch) first compares schedules over the side channel, so that every
  // rank throws the description of the divergence instead of hanging (see Note
  // [Collective schedule checks] in internal/schedule.cc for what is guaranteed). Needs a
  // backend that moves CPU buffers (gloo, fake). Throws c10::Error on a subgroup.
  // PyTorch has no counterpart (TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective).
  void enable_schedule_checks();
  bool schedule_checks_enabled() const;
  // Whether enable_schedule_checks can be called here: a root communicator of a backend
  // that moves CPU buffers.
  bool supports_schedule_checks() const;
  // Ends a step of the schedule (FSDP's root calls it at the end of each iteration):
  // later collectives count towards the next step. Steps are counted from 1, on every
  // rank alike. No traffic. Does nothing while the checks are off.
  void end_schedule_step();
  // The step in progress (1 before the first end_schedule_step); 0 while checks are off.
  int64_t schedule_step() const;
  // Every rank: all-gathers (count, hash) of the collectives since the last check over
  // the side channel (4 int64 per rank); if any rank's differ, all-gathers the ranks'
  // last 64 collectives and throws CommError on every rank naming the first step whose
  // collectives differ, its first differing collective and what each rank ran, e.g.
  //   schedule_check #2 failed on rank 0 (peer rank 1): the ranks ran
  //   different collectives in step 7, first at its collective #4: rank 0 ran
  //   all_gather_into_tensor of 1024 Float in the world, rank 1 ran all_reduce of 1 Float
  //   in the world; in step 7 rank 0 issued 12, rank 1 issued 10 collectives (...)
  // Also throws it if a peer does not arrive within the side channel's timeout. After a
  // mismatch every later check throws the same error. Throws c10::Error while checks are
  // off.
  void check_collective_schedule();

  TrafficCounters& counters() { return counters_; }
  const TrafficCounters& counters() const { return counters_; }

 protected:
  // What a backend needs to build a subgroup's communicator (see new_subgroup).
  struct SubgroupSpec {
    std::vector<int> ranks;         // the members, as ranks of this communicator
    int rank;                       // this rank's index in `ranks`
    std::string tag;                // equal on all members, distinct per subgroup
    std::vector<int> global_ranks;  // the members as root communicator ranks
  };

  // A root communicator has no `global_ranks`; a subgroup passes its spec's.
  Communicator(int rank, int world_size, std::chrono::milliseconds timeout,
               std::vector<int> global_ranks = {});

  // Backends implement these; arguments are already validated. `sequence` numbers this
  // communicator's collectives from 0, for error messages.
  virtual WorkHandle do_all_gather(const CommBuffer& output, const CommBuffer& input,
                                   int64_t sequence) = 0;
  virtual WorkHandle do_reduce_scatter(const CommBuffer& output, const CommBuffer& input,
                                       ReduceOp op, int64_t sequence) = 0;
  virtual WorkHandle do_all_reduce(const CommBuffer& tensor, ReduceOp op, int64_t sequence) = 0;
  virtual WorkHandle do_broadcast(const CommBuffer& tensor, int root, int64_t sequence) = 0;
  virtual WorkHandle do_barrier(int64_t sequence) = 0;
  // `spec.ranks` is validated and contains this rank.
  virtual std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) = 0;
  // The group of new_host_subgroup (`spec` as for do_new_subgroup). The default, for
  // backends that move CPU buffers, is do_new_subgroup; a device backend overrides it.
  virtual std::shared_ptr<Communicator> do_new_host_subgroup(const SubgroupSpec& spec);
  // Devices this backend moves (checked for every buffer).
  virtual bool supports_device(const c10::Device& device) const = 0;
  // The side channel of enable_schedule_checks: a communicator over `spec`'s ranks (all
  // of this root's) with `timeout`, outside this communicator's family, so that a failed
  // collective of the family leaves it open. The default makes a subgroup (do_new_subgroup,
  // which keeps this communicator's timeout).
  virtual std::shared_ptr<Communicator> do_new_side_channel(const SubgroupSpec& spec,
                                                            std::chrono::milliseconds timeout);

  // The CommError of this communicator's collective `sequence`: this rank's global rank,
  // `peer` (a global rank, or -1), and the group if this is a subgroup.
  CommError comm_error(CollectiveKind kind, int64_t sequence, int peer,
                       const std::string& detail) const;
  // CommError's `group`: global_ranks() for a subgroup, empty for a root communicator.
  std::vector<int> error_group() const;

  // Records the first failure; from then on every new collective throws it again. Safe
  // to call from any thread (a Work may fail while being waited on elsewhere).
  void mark_broken(const CommError& error);

 private:
  // The spec of a new subgroup over `ranks` (validated), tagged "<kind>[r0,r1,...]#n" for
  // the n-th such group of those ranks; nullopt if this rank is not among them.
  std::optional<SubgroupSpec> subgroup_spec(const char* what, const std::string& kind,
                                            const std::vector<int>& ranks);
  int64_t begin_collective(CollectiveKind kind, int64_t numel, c10::ScalarType dtype,
                           int64_t bytes_sent, int64_t bytes_received);
  // The work of a collective, wrapped while schedule checks are on (see
  // enable_schedule_checks).
  WorkHandle watched(WorkHandle work) const;
  void check_buffer(const char* collective, const CommBuffer& buffer) const;

  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::vector<int> global_ranks_;
  bool is_subgroup_;
  int64_t sequence_ = 0;
  // (kind, rank list) -> groups made (subgroup_spec)
  std::map<std::pair<std::string, std::vector<int>>, int> subgroups_made_;
  TrafficCounters counters_;
  // The family's schedule (shared with every subgroup made from this one) and this
  // communicator's group as the schedule names it (comm_internal::group_code).
  std::shared_ptr<comm_internal::ScheduleSlot> schedule_;
  int64_t group_code_ = 0;
  std::mutex broken_mutex_;
  std::optional<CommError> broken_;
};

// dtypes every backend moves: float32, float64, float16, bfloat16, int64, int32, uint8.
bool is_supported_dtype(c10::ScalarType dtype);

}  // namespace fsdp

#endif  // FSDP_COMM_COMMUNICATOR_H_
