// The collective schedule behind Communicator::enable_schedule_checks: each rank folds
// every collective of its communicator family into a running hash, keeps the last few
// as records for error messages, and compares with its peers over a side channel. See
// Note [Collective schedule checks] in schedule.cc.
//
// Internal to fsdp/comm.
#ifndef FSDP_COMM_INTERNAL_SCHEDULE_H_
#define FSDP_COMM_INTERNAL_SCHEDULE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "fsdp/comm/communicator.h"

namespace fsdp::comm_internal {

// One collective as the schedule sees it. `group`: group_code() of its communicator.
struct ScheduleRecord {
  int64_t step = 0;   // counted from 1
  int64_t index = 0;  // within the step, from 0
  int64_t kind = 0;   // CollectiveKind
  int64_t dtype = 0;  // c10::ScalarType; -1 for a barrier
  int64_t numel = 0;  // input elements (all-gather, reduce-scatter), the tensor's otherwise
  int64_t group = 0;
  static constexpr int kFields = 6;
};

// One step's collectives: how many, and their hash.
struct StepSummary {
  int64_t step = 0;
  int64_t count = 0;
  int64_t hash = 0;
  static constexpr int kFields = 3;
};

// The group of a communicator as every member can name it: its size in the high 32 bits
// and the stride between its consecutive global ranks in the low ones (1 for a root
// communicator and a shard group, F for a hybrid replicate group; 0 if not evenly
// spaced). Equal on the ranks of HYBRID's different shard groups.
int64_t group_code(const std::vector<int>& global_ranks);

// "all_gather_into_tensor of 1024 Float in a group of 2 ranks (stride 2)"; the root's
// group (stride 1, `world_size` ranks) reads "in the world".
std::string describe_record(const ScheduleRecord& record, int world_size);

// What every rank sends when the schedules are compared: its summaries since the last
// check (the step in progress last) and its last records, as int64 values of a fixed
// layout (see ScheduleReport::pack).
struct ScheduleReport {
  bool failed = false;  // this rank is reporting a failed collective, not checking
  int64_t checked_step = 0;
  std::vector<StepSummary> steps;       // oldest first, at most kMaxSteps
  std::vector<ScheduleRecord> records;  // oldest first, at most kMaxRecords
  static constexpr int kMaxSteps = 64;
  static constexpr int kMaxRecords = 64;
  static constexpr int kSize =
      4 + kMaxSteps * StepSummary::kFields + kMaxRecords * ScheduleRecord::kFields;
  void pack(int64_t* out) const;
  static ScheduleReport unpack(const int64_t* in);
};

// Returns "" when every rank's steps agree; otherwise the mismatch: the first step whose
// collectives differ, its first differing collective and what each rank ran there
// (global ranks), e.g.
//   the ranks ran different collectives in step 7, first at its collective #4: rank 0
//   ran all_gather_into_tensor of 1024 Float in the world (then reduce_scatter_tensor of
//   ...), rank 1 ran all_reduce of 1 Float in the world; in step 7 rank 0 issued 12
//   collectives, rank 1 issued 10
std::string describe_schedule_mismatch(const std::vector<ScheduleReport>& reports,
                                       const std::vector<int>& global_ranks);

// A communicator family's schedule (shared by the root and its subgroups). Thread-safe.
class CollectiveSchedule {
 public:
  // `side_channel`: a communicator of the same ranks as `root_ranks` that the family's
  // failures leave open; its own collectives are not recorded.
  CollectiveSchedule(std::shared_ptr<Communicator> side_channel, std::vector<int> root_ranks);

  // A few integer operations and one record write.
  void record(CollectiveKind kind, int64_t group, int64_t numel, c10::ScalarType dtype);
  void end_step();
  int64_t step() const;
  // Every rank: all-gathers this rank's hash over the side channel; throws a CommError
  // naming the mismatch, if any (then on every rank).
  void check();
  // A collective of the family failed with `error` on this rank: compares schedules with
  // the peers (who join from their own check or failure) and throws the mismatch if they
  // differ, else `error` itself.
  [[noreturn]] void fail(const CommError& error);

 private:
  ScheduleReport report(bool failed) const;  // under mutex_
  // Exchanges the headers, then the full reports if anything differs; the mismatch or "".
  std::string compare(bool failed, int64_t* peer);
  CommError error(const std::string& detail, int peer) const;

  std::shared_ptr<Communicator> side_channel_;
  std::vector<int> root_ranks_;
  mutable std::mutex mutex_;
  int64_t step_ = 1;
  int64_t checks_ = 0;
  int64_t checked_step_ = 0;         // the last step a check covered
  int64_t count_ = 0;                // collectives of the step in progress
  uint64_t hash_ = 0;                // ... their hash
  std::deque<StepSummary> steps_;    // ended steps since the last check (at most kMaxSteps)
  std::deque<ScheduleRecord> ring_;  // the last kMaxRecords collectives
  uint64_t window_hash_ = 0;         // every collective since the last check
  int64_t window_count_ = 0;
  std::optional<CommError> final_error_;  // once thrown, thrown again
  bool reported_failure_ = false;         // fail() compared once already
};

// Where a communicator family keeps its schedule: set once by enable_schedule_checks,
// read by every collective of the family.
struct ScheduleSlot {
  std::atomic<CollectiveSchedule*> schedule{nullptr};
  std::unique_ptr<CollectiveSchedule> owner;
  std::mutex mutex;  // held while enabling
};

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_INTERNAL_SCHEDULE_H_
