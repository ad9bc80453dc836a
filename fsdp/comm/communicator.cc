#include "fsdp/comm/communicator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "fsdp/comm/internal/schedule.h"
#include "fsdp/comm/internal/size_checks.h"

namespace fsdp {

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "all_gather_into_tensor";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter_tensor";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kBarrier:
      return "barrier";
  }
  return "unknown";
}

void TrafficCounters::record(CollectiveKind kind, int64_t bytes_sent, int64_t bytes_received) {
  Slot& slot = slots_[static_cast<int>(kind)];
  slot.calls.fetch_add(1, std::memory_order_relaxed);
  slot.sent.fetch_add(bytes_sent, std::memory_order_relaxed);
  slot.received.fetch_add(bytes_received, std::memory_order_relaxed);
}

CollectiveTraffic TrafficCounters::get(CollectiveKind kind) const {
  const Slot& slot = slots_[static_cast<int>(kind)];
  return {slot.calls.load(), slot.sent.load(), slot.received.load()};
}

CollectiveTraffic TrafficCounters::total() const {
  CollectiveTraffic sum;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const CollectiveTraffic one = get(static_cast<CollectiveKind>(k));
    sum.calls += one.calls;
    sum.bytes_sent += one.bytes_sent;
    sum.bytes_received += one.bytes_received;
  }
  return sum;
}

void TrafficCounters::reset() {
  for (Slot& slot : slots_) {
    slot.calls = 0;
    slot.sent = 0;
    slot.received = 0;
  }
}

CommError::CommError(std::string collective, int64_t sequence, int rank, int peer,
                     const std::string& detail, std::vector<int> group)
    : c10::Error(absl::StrCat(
          collective, " #", sequence,
          group.empty() ? std::string()
                        : absl::StrCat(" in group [", absl::StrJoin(group, ", "), "]"),
          " failed on rank ", rank,
          peer >= 0 ? absl::StrCat(" (peer rank ", peer, ")") : std::string(), ": ", detail)),
      collective_(std::move(collective)),
      sequence_(sequence),
      rank_(rank),
      peer_(peer),
      group_(std::move(group)) {}

CommBuffer CommBuffer::of(const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.defined(), what, ": expected a tensor, got an undefined one");
  TORCH_CHECK(tensor.is_contiguous(), what, ": expected a contiguous tensor, got sizes ",
              tensor.sizes(), " strides ", tensor.strides(), "; call .contiguous() first");
  return {tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), tensor.device()};
}

at::Tensor CommBuffer::as_tensor() const {
  // target_device: no lookup of the pointer's device (CUDA's rejects the null data of an
  // empty buffer).
  return at::for_blob(data, {numel})
      .options(at::TensorOptions().dtype(dtype).device(device))
      .target_device(device)
      .make_tensor();
}

std::string CommBuffer::describe() const {
  return absl::StrCat("[", numel, "] ", c10::toString(dtype), " on ", device.str());
}

void Work::wait() { wait(default_timeout_); }

bool is_supported_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kBFloat16:
    case c10::kLong:
    case c10::kInt:
    case c10::kByte:
      return true;
    default:
      return false;
  }
}

Communicator::Communicator(int rank, int world_size, std::chrono::milliseconds timeout,
                           std::vector<int> global_ranks)
    : rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      global_ranks_(std::move(global_ranks)),
      is_subgroup_(!global_ranks_.empty()),
      schedule_(std::make_shared<comm_internal::ScheduleSlot>()) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ", rank);
  TORCH_CHECK(timeout.count() > 0, "timeout must be positive, got ", timeout.count(), " ms");
  if (!is_subgroup_) {
    for (int r = 0; r < world_size; ++r) global_ranks_.push_back(r);
  }
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == world_size, "a subgroup of world_size ",
              world_size, " needs as many global ranks, got [", absl::StrJoin(global_ranks_, ", "),
              "]");
  group_code_ = comm_internal::group_code(global_ranks_);
}

CommError Communicator::comm_error(CollectiveKind kind, int64_t sequence, int peer,
                                   const std::string& detail) const {
  return CommError(collective_name(kind), sequence, global_rank(), peer, detail, error_group());
}

std::vector<int> Communicator::error_group() const {
  return is_subgroup_ ? global_ranks_ : std::vector<int>();
}

void Communicator::mark_broken(const CommError& error) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!broken_) broken_ = error;
}

int64_t Communicator::begin_collective(CollectiveKind kind, int64_t numel, c10::ScalarType dtype,
                                       int64_t bytes_sent, int64_t bytes_received) {
  {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    if (broken_) {
      throw comm_error(
          kind, sequence_, broken_->peer(),
          absl::StrCat("the communicator is broken by an earlier failure: ", broken_->what()));
    }
  }
  counters_.record(kind, bytes_sent, bytes_received);
  if (comm_internal::CollectiveSchedule* schedule = schedule_->schedule.load()) {
    schedule->record(kind, group_code_, numel, dtype);
  }
  return sequence_++;
}

namespace {

// A collective's work while schedule checks are on: a failed wait first compares the
// schedules (CollectiveSchedule::fail). See Note [Collective schedule checks].
class WatchedWork : public Work {
 public:
  WatchedWork(WorkHandle inner, comm_internal::CollectiveSchedule* schedule,
              std::chrono::milliseconds timeout)
      : Work(timeout), inner_(std::move(inner)), schedule_(schedule) {}
  void wait(std::chrono::milliseconds timeout) override {
    try {
      inner_->wait(timeout);
    } catch (const CommError& error) {
      schedule_->fail(error);
    }
  }
  bool is_completed() override { return inner_->is_completed(); }

 private:
  WorkHandle inner_;
  comm_internal::CollectiveSchedule* schedule_;  // the family's, which outlives its works
};

}  // namespace

WorkHandle Communicator::watched(WorkHandle work) const {
  comm_internal::CollectiveSchedule* schedule = schedule_->schedule.load();
  if (schedule == nullptr) return work;
  return std::make_shared<WatchedWork>(std::move(work), schedule, timeout_);
}

std::shared_ptr<Communicator> Communicator::do_new_side_channel(
    const SubgroupSpec& spec, std::chrono::milliseconds /*timeout*/) {
  return do_new_subgroup(spec);
}

void Communicator::enable_schedule_checks() {
  TORCH_CHECK(!is_subgroup_,
              "enable_schedule_checks: expected the root communicator (the one subgroups are "
              "made from), got a subgroup of ranks [",
              absl::StrJoin(global_ranks_, ", "), "]; call it on the root");
  TORCH_CHECK(supports_device(c10::Device(c10::kCPU)),
              "enable_schedule_checks: the schedule is compared in CPU buffers, which the ",
              backend_name(), " backend cannot move; use gloo (or the fake backend)");
  std::lock_guard<std::mutex> lock(schedule_->mutex);
  if (schedule_->owner) return;
  SubgroupSpec spec;
  for (int r = 0; r < world_size_; ++r) spec.ranks.push_back(r);
  spec.rank = rank_;
  spec.tag = "schedule-side-channel";
  spec.global_ranks = global_ranks_;
  schedule_->owner = std::make_unique<comm_internal::CollectiveSchedule>(
      do_new_side_channel(spec, 2 * timeout_), global_ranks_);
  schedule_->schedule.store(schedule_->owner.get());
}

bool Communicator::supports_schedule_checks() const {
  return !is_subgroup_ && supports_device(c10::Device(c10::kCPU));
}

bool Communicator::schedule_checks_enabled() const { return schedule_->schedule.load() != nullptr; }

void Communicator::end_schedule_step() {
  if (comm_internal::CollectiveSchedule* schedule = schedule_->schedule.load()) {
    schedule->end_step();
  }
}

int64_t Communicator::schedule_step() const {
  comm_internal::CollectiveSchedule* schedule = schedule_->schedule.load();
  return schedule == nullptr ? 0 : schedule->step();
}

void Communicator::check_collective_schedule() {
  comm_internal::CollectiveSchedule* schedule = schedule_->schedule.load();
  TORCH_CHECK(schedule != nullptr,
              "check_collective_schedule: schedule checks are off; call "
              "enable_schedule_checks() on every rank first");
  schedule->check();
}

void Communicator::check_buffer(const char* collective, const CommBuffer& buffer) const {
  TORCH_CHECK(is_supported_dtype(buffer.dtype), collective, ": unsupported dtype ",
              c10::toString(buffer.dtype),
              "; expected float32, float64, float16, bfloat16, int64, int32 or uint8");
  TORCH_CHECK(supports_device(buffer.device), collective, ": the ", backend_name(),
              " backend cannot move a buffer on ", buffer.device.str());
  TORCH_CHECK(buffer.numel == 0 || buffer.data != nullptr, collective, ": buffer has ",
              buffer.numel, " elements but a null data pointer");
}

namespace {

void check_pair(const char* collective, const CommBuffer& output, const CommBuffer& input,
                int64_t expected_output_numel, const char* rule) {
  TORCH_CHECK(output.dtype == input.dtype && output.device == input.device, collective,
              ": output and input must have the same dtype and device, got output ",
              output.describe(), " and input ", input.describe());
  TORCH_CHECK(output.numel == expected_output_numel, collective, ": ", rule, ", got output ",
              output.describe(), " and input ", input.describe());
}

void check_op(const char* collective, ReduceOp op, c10::ScalarType dtype) {
  TORCH_CHECK(op != ReduceOp::kAvg || c10::isFloatingType(dtype), collective,
              ": ReduceOp::kAvg needs a floating-point dtype, got ", c10::toString(dtype),
              "; use kSum and divide yourself");
}

}  // namespace

WorkHandle Communicator::all_gather_into_tensor_async(const CommBuffer& output,
                                                      const CommBuffer& input) {
  const char* name = collective_name(CollectiveKind::kAllGather);
  check_buffer(name, output);
  check_buffer(name, input);
  check_pair(name, output, input, input.numel * world_size_,
             "output must hold world_size x input numel elements");
  const int64_t bytes = (world_size_ - 1) * input.nbytes();
  const int64_t sequence =
      begin_collective(CollectiveKind::kAllGather, input.numel, input.dtype, bytes, bytes);
  return watched(do_all_gather(output, input, sequence));
}

WorkHandle Communicator::reduce_scatter_tensor_async(const CommBuffer& output,
                                                     const CommBuffer& input, ReduceOp op) {
  const char* name = collective_name(CollectiveKind::kReduceScatter);
  check_buffer(name, output);
  check_buffer(name, input);
  TORCH_CHECK(input.numel == output.numel * world_size_ && output.dtype == input.dtype &&
                  output.device == input.device,
              name,
              ": input must hold world_size x output numel elements of the output's "
              "dtype and device, got output ",
              output.describe(), " and input ", input.describe());
  check_op(name, op, input.dtype);
  const int64_t bytes = (world_size_ - 1) * output.nbytes();
  const int64_t sequence =
      begin_collective(CollectiveKind::kReduceScatter, input.numel, input.dtype, bytes, bytes);
  return watched(do_reduce_scatter(output, input, op, sequence));
}

WorkHandle Communicator::all_reduce_async(const CommBuffer& tensor, ReduceOp op) {
  const char* name = collective_name(CollectiveKind::kAllReduce);
  check_buffer(name, tensor);
  check_op(name, op, tensor.dtype);
  const int64_t chunk = (tensor.numel + world_size_ - 1) / world_size_;
  const int64_t bytes =
      2 * (world_size_ - 1) * chunk * static_cast<int64_t>(c10::elementSize(tensor.dtype));
  const int64_t sequence =
      begin_collective(CollectiveKind::kAllReduce, tensor.numel, tensor.dtype, bytes, bytes);
  return watched(do_all_reduce(tensor, op, sequence));
}

WorkHandle Communicator::broadcast_async(const CommBuffer& tensor, int root) {
  const char* name = collective_name(CollectiveKind::kBroadcast);
  check_buffer(name, tensor);
  TORCH_CHECK(root >= 0 && root < world_size_, name, ": root must be in [0, ", world_size_,
              "), got ", root);
  const bool is_root = rank_ == root;
  const int64_t sent = is_root ? (world_size_ - 1) * tensor.nbytes() : 0;
  const int64_t received = is_root ? 0 : tensor.nbytes();
  const int64_t sequence =
      begin_collective(CollectiveKind::kBroadcast, tensor.numel, tensor.dtype, sent, received);
  return watched(do_broadcast(tensor, root, sequence));
}

WorkHandle Communicator::barrier_async() {
  return watched(do_barrier(begin_collective(CollectiveKind::kBarrier, 0, c10::kByte, 0, 0)));
}

// The tensor overloads: view, issue, and for the blocking ones wait with timeout().
WorkHandle Communicator::all_gather_into_tensor_async(const at::Tensor& output,
                                                      const at::Tensor& input) {
  return all_gather_into_tensor_async(CommBuffer::of(output, "all_gather_into_tensor output"),
                                      CommBuffer::of(input, "all_gather_into_tensor input"));
}
void Communicator::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  all_gather_into_tensor_async(output, input)->wait(timeout_);
}
WorkHandle Communicator::reduce_scatter_tensor_async(const at::Tensor& output,
                                                     const at::Tensor& input, ReduceOp op) {
  return reduce_scatter_tensor_async(CommBuffer::of(output, "reduce_scatter_tensor output"),
                                     CommBuffer::of(input, "reduce_scatter_tensor input"), op);
}
void Communicator::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                         ReduceOp op) {
  reduce_scatter_tensor_async(output, input, op)->wait(timeout_);
}
WorkHandle Communicator::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  return all_reduce_async(CommBuffer::of(tensor, "all_reduce tensor"), op);
}
void Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(tensor, op)->wait(timeout_);
}
WorkHandle Communicator::broadcast_async(const at::Tensor& tensor, int root) {
  return broadcast_async(CommBuffer::of(tensor, "broadcast tensor"), root);
}
void Communicator::broadcast(const at::Tensor& tensor, int root) {
  broadcast_async(tensor, root)->wait(timeout_);
}
void Communicator::barrier() { barrier_async()->wait(timeout_); }

std::optional<Communicator::SubgroupSpec> Communicator::subgroup_spec(
    const char* what, const std::string& kind, const std::vector<int>& ranks) {
  TORCH_CHECK(!ranks.empty(), what, ": expected at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < world_size_ && (i == 0 || ranks[i - 1] < ranks[i]),
                what, ": expected distinct ascending ranks in [0, ", world_size_, "), got [",
                absl::StrJoin(ranks, ", "), "]");
  }
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) return std::nullopt;
  const int count = subgroups_made_[{kind, ranks}]++;
  SubgroupSpec spec;
  spec.ranks = ranks;
  spec.rank = static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  spec.tag = absl::StrCat(kind, "[", absl::StrJoin(ranks, ","), "]#", count);
  for (int r : ranks) spec.global_ranks.push_back(global_ranks_[r]);
  return spec;
}

std::shared_ptr<Communicator> Communicator::new_subgroup(const std::vector<int>& ranks) {
  const std::optional<SubgroupSpec> spec = subgroup_spec("new_subgroup", "group", ranks);
  if (!spec) return nullptr;
  std::shared_ptr<Communicator> subgroup = do_new_subgroup(*spec);
  subgroup->schedule_ = schedule_;  // one schedule for the family
  return subgroup;
}

std::shared_ptr<Communicator> Communicator::new_host_subgroup(const std::vector<int>& ranks) {
  const std::optional<SubgroupSpec> spec = subgroup_spec("new_host_subgroup", "host-group", ranks);
  if (!spec) return nullptr;
  // Not in the family's schedule: it keeps the schedule slot it was made with, never
  // enabled, so its collectives are neither recorded nor compared (they run at times
  // that differ from rank to rank).
  return do_new_host_subgroup(*spec);
}

std::shared_ptr<Communicator> Communicator::do_new_host_subgroup(const SubgroupSpec& spec) {
  TORCH_CHECK(supports_device(c10::Device(c10::kCPU)), "new_host_subgroup: the ", backend_name(),
              " backend moves no CPU buffers and makes no host group");
  return do_new_subgroup(spec);
}

HybridGroups Communicator::split_hybrid(int shard_group_size) {
  TORCH_CHECK(shard_group_size >= 1 && world_size_ % shard_group_size == 0,
              "split_hybrid: world_size ", world_size_,
              " must be a multiple of the shard group size, got ", shard_group_size);
  const int first = rank_ / shard_group_size * shard_group_size;
  std::vector<int> shard, replicate;
  for (int r = first; r < first + shard_group_size; ++r) shard.push_back(r);
  for (int r = rank_ % shard_group_size; r < world_size_; r += shard_group_size) {
    replicate.push_back(r);
  }
  return {new_subgroup(shard), new_subgroup(replicate)};
}

namespace comm_internal {

std::string describe_mismatched_collectives(const int64_t* records,
                                            const std::vector<int>& global_ranks,
                                            CollectiveKind kind, int64_t numel) {
  const int world_size = static_cast<int>(global_ranks.size());
  bool same = true;
  for (int r = 0; r < world_size; ++r) {
    same = same && records[2 * r] == static_cast<int64_t>(kind) && records[2 * r + 1] == numel;
  }
  if (same) return "";
  std::vector<std::string> parts;
  for (int r = 0; r < world_size; ++r) {
    const int64_t theirs = records[2 * r];
    const bool known = theirs >= 0 && theirs <= static_cast<int64_t>(CollectiveKind::kBarrier);
    parts.push_back(absl::StrCat("rank ", global_ranks[r], " runs ",
                                 known ? collective_name(static_cast<CollectiveKind>(theirs))
                                       : absl::StrCat("collective kind ", theirs),
                                 " of ", records[2 * r + 1], " elements"));
  }
  return absl::StrCat(absl::StrJoin(parts, ", "),
                      ": the ranks are not running the same units in the same order");
}

}  // namespace comm_internal
}  // namespace fsdp
