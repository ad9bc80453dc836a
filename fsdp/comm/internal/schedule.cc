#include "fsdp/comm/internal/schedule.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>

namespace fsdp::comm_internal {

// Note [Collective schedule checks]
// Ranks that take different branches (a unit skipped on one rank, an extra all-reduce in
// one rank's logging) issue different collectives. Size checks (Note [Mismatched sizes]
// in gloo.cc) catch that at the collective, at one small all-gather per collective
// (+16-37% a step); FSDP keeps them on in its first iteration only. The schedule check
// is the cheap one for every later step:
// - Each rank folds (kind, group, element count, dtype) of every collective of its
//   communicator family into a running 64-bit FNV-1a hash, per step and since the last
//   check, and keeps its last ScheduleReport::kMaxRecords collectives as records: a
//   mutex and a few integer operations per collective.
// - Every N steps (FullyShardedDataParallelOptions::schedule_check_every, at the end of
//   the root's iteration) and whenever the program calls check_collective_schedule, the
//   ranks all-gather (count, hash) since the last check: 4 int64 per rank. Only if they
//   differ do they all-gather their full reports (4.6 KB per rank) and every rank throws
//   the same description: the first step whose collectives differ, its first differing
//   collective, and what each rank ran there.
// - These exchanges go over a side channel: a second group of the same ranks, made when
//   the checks are enabled, with its own sequence numbers, twice the communicator's
//   timeout, and left open when a collective of the family fails. So a rank that is
//   still waiting in a collective its peers never issued cannot pair it with their check.
// - A collective of the family that fails while checks are on (a timeout, a lost peer, a
//   size check's or the fake backend's mismatch) does not throw its CommError at once:
//   the rank first reports on the side channel, where its peers meet it from their own
//   check or their own failure, and every rank throws the schedule mismatch (with the
//   failure appended) if the schedules differ, the original error if they do not.
// What is guaranteed, with checks on and the side channel's timeout (2 T) not exceeded:
// - A divergence whose collectives still pair up (equal sizes; a different number of
//   collectives that ends with a rank waiting) is reported at the next check, or when the
//   waiting rank's collective times out after T, whichever comes first; every rank stops
//   with the same description within about 2 T of the divergence, instead of hanging.
// - A divergence in the first iteration is caught by FSDP's size checks and then named
//   by the same exchange.
// - Not caught without size checks: on Gloo, a rank that receives a longer message than
//   it posted for (collectives of different sizes paired) is terminated by Gloo before
//   anything can be exchanged (Note [Gloo terminations] in gloo.cc, which names the
//   collective); its peers then stop with the lost rank named. Check every step (N = 1)
//   to shorten the window in which that can happen, or use validate_execution_order.
// - A rank that never reaches the side channel (killed, or stuck outside collectives)
//   makes its peers' exchange fail after 2 T with an error naming it and this rank's last
//   collectives.

namespace {

constexpr uint64_t kFnvOffset = 14695981039346656037ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;

uint64_t fold(uint64_t hash, int64_t value) {
  return (hash ^ static_cast<uint64_t>(value)) * kFnvPrime;
}

bool same_collective(const ScheduleRecord& a, const ScheduleRecord& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.numel == b.numel && a.group == b.group;
}

std::string kind_name(int64_t kind) {
  const bool known = kind >= 0 && kind < kNumCollectiveKinds;
  return known ? collective_name(static_cast<CollectiveKind>(kind))
               : absl::StrCat("collective kind ", kind);
}

}  // namespace

int64_t group_code(const std::vector<int>& global_ranks) {
  int64_t stride = global_ranks.size() > 1 ? global_ranks[1] - global_ranks[0] : 1;
  for (size_t i = 1; i < global_ranks.size(); ++i) {
    if (global_ranks[i] - global_ranks[i - 1] != stride) stride = 0;
  }
  return (static_cast<int64_t>(global_ranks.size()) << 32) | stride;
}

std::string describe_record(const ScheduleRecord& record, int world_size) {
  const int64_t size = record.group >> 32;
  const int64_t stride = record.group & 0xffffffff;
  const std::string group =
      size == world_size && stride == 1
          ? "in the world"
          : absl::StrCat("in a group of ", size, " ranks",
                         stride > 0 ? absl::StrCat(" (stride ", stride, ")") : "");
  if (record.kind == static_cast<int64_t>(CollectiveKind::kBarrier)) {
    return absl::StrCat(kind_name(record.kind), " ", group);
  }
  const bool known_dtype =
      record.dtype >= 0 && record.dtype < static_cast<int64_t>(c10::ScalarType::NumOptions);
  return absl::StrCat(kind_name(record.kind), " of ", record.numel, " ",
                      known_dtype ? c10::toString(static_cast<c10::ScalarType>(record.dtype))
                                  : absl::StrCat("dtype ", record.dtype),
                      " ", group);
}

void ScheduleReport::pack(int64_t* out) const {
  std::fill(out, out + kSize, 0);
  out[0] = failed ? 1 : 0;
  out[1] = checked_step;
  out[2] = static_cast<int64_t>(steps.size());
  out[3] = static_cast<int64_t>(records.size());
  int64_t* p = out + 4;
  for (const StepSummary& s : steps) {
    *p++ = s.step;
    *p++ = s.count;
    *p++ = s.hash;
  }
  p = out + 4 + kMaxSteps * StepSummary::kFields;
  for (const ScheduleRecord& r : records) {
    for (int64_t v : {r.step, r.index, r.kind, r.dtype, r.numel, r.group}) *p++ = v;
  }
}

ScheduleReport ScheduleReport::unpack(const int64_t* in) {
  ScheduleReport report;
  report.failed = in[0] != 0;
  report.checked_step = in[1];
  const int64_t steps = std::clamp<int64_t>(in[2], 0, kMaxSteps);
  const int64_t records = std::clamp<int64_t>(in[3], 0, kMaxRecords);
  const int64_t* p = in + 4;
  for (int64_t i = 0; i < steps; ++i, p += StepSummary::kFields) {
    report.steps.push_back({p[0], p[1], p[2]});
  }
  p = in + 4 + kMaxSteps * StepSummary::kFields;
  for (int64_t i = 0; i < records; ++i, p += ScheduleRecord::kFields) {
    report.records.push_back({p[0], p[1], p[2], p[3], p[4], p[5]});
  }
  return report;
}

namespace {

// Step -> (count, hash) of one report; a step a report does not list ran nothing.
std::pair<int64_t, int64_t> summary_of(const ScheduleReport& report, int64_t step) {
  for (const StepSummary& s : report.steps) {
    if (s.step == step) return {s.count, s.hash};
  }
  return {0, 0};
}

const ScheduleRecord* record_of(const ScheduleReport& report, int64_t step, int64_t index) {
  for (const ScheduleRecord& r : report.records) {
    if (r.step == step && r.index == index) return &r;
  }
  return nullptr;
}

// What `report`'s rank ran at collective `index` of `step`, and up to two after it.
std::string what_ran(const ScheduleReport& report, int64_t step, int64_t index, int64_t count,
                     int world_size) {
  if (index >= count) return "issued no collective there";
  std::string text =
      absl::StrCat("ran ", describe_record(*record_of(report, step, index), world_size));
  std::vector<std::string> then;
  for (int64_t i = index + 1; i < std::min(count, index + 3); ++i) {
    if (const ScheduleRecord* r = record_of(report, step, i)) {
      then.push_back(describe_record(*r, world_size));
    }
  }
  if (!then.empty()) absl::StrAppend(&text, " (then ", absl::StrJoin(then, ", "), ")");
  return text;
}

}  // namespace

std::string describe_schedule_mismatch(const std::vector<ScheduleReport>& reports,
                                       const std::vector<int>& global_ranks) {
  const int world_size = static_cast<int>(reports.size());
  std::map<int64_t, bool> steps;
  for (const ScheduleReport& report : reports) {
    for (const StepSummary& s : report.steps) steps[s.step] = true;
  }
  int64_t step = -1;
  for (const auto& [candidate, unused] : steps) {
    for (const ScheduleReport& report : reports) {
      if (summary_of(report, candidate) != summary_of(reports[0], candidate)) step = candidate;
    }
    if (step >= 0) break;
  }
  if (step < 0) return "";
  std::vector<int64_t> counts;
  int64_t most = 0;
  for (const ScheduleReport& report : reports) {
    counts.push_back(summary_of(report, step).first);
    most = std::max(most, counts.back());
  }
  // The first collective of the step that every rank kept (or did not issue) and that
  // differs between two ranks.
  int64_t index = -1;
  for (int64_t i = 0; i < most && index < 0; ++i) {
    std::vector<const ScheduleRecord*> at;
    bool known = true;
    for (int r = 0; r < world_size; ++r) {
      const ScheduleRecord* record = i < counts[r] ? record_of(reports[r], step, i) : nullptr;
      known = known && (i >= counts[r] || record != nullptr);
      at.push_back(record);
    }
    if (!known) continue;
    for (int r = 1; r < world_size; ++r) {
      const bool differ = (at[r] == nullptr) != (at[0] == nullptr) ||
                          (at[r] != nullptr && !same_collective(*at[r], *at[0]));
      if (differ) index = i;
    }
  }
  std::vector<std::string> ran, issued;
  for (int r = 0; r < world_size; ++r) {
    if (index >= 0) {
      ran.push_back(absl::StrCat("rank ", global_ranks[r], " ",
                                 what_ran(reports[r], step, index, counts[r], world_size)));
    }
    issued.push_back(absl::StrCat("rank ", global_ranks[r], " issued ", counts[r]));
  }
  const std::string where =
      index >= 0
          ? absl::StrCat(", first at its collective #", index, ": ", absl::StrJoin(ran, ", "))
          : absl::StrCat(" (before the last ", ScheduleReport::kMaxRecords,
                         " collectives each rank kept)");
  return absl::StrCat("the ranks ran different collectives in step ", step, where, "; in step ",
                      step, " ", absl::StrJoin(issued, ", "),
                      " collectives (steps counted from 1; every rank must issue the same "
                      "collectives in the same order)");
}

CollectiveSchedule::CollectiveSchedule(std::shared_ptr<Communicator> side_channel,
                                       std::vector<int> root_ranks)
    : side_channel_(std::move(side_channel)),
      root_ranks_(std::move(root_ranks)),
      hash_(kFnvOffset),
      window_hash_(kFnvOffset) {}

void CollectiveSchedule::record(CollectiveKind kind, int64_t group, int64_t numel,
                                c10::ScalarType dtype) {
  const int64_t dtype_code = kind == CollectiveKind::kBarrier ? -1 : static_cast<int64_t>(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t value : {static_cast<int64_t>(kind), group, numel, dtype_code}) {
    hash_ = fold(hash_, value);
    window_hash_ = fold(window_hash_, value);
  }
  if (ring_.size() == ScheduleReport::kMaxRecords) ring_.pop_front();
  ring_.push_back({step_, count_, static_cast<int64_t>(kind), dtype_code, numel, group});
  ++count_;
  ++window_count_;
}

void CollectiveSchedule::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (steps_.size() == ScheduleReport::kMaxSteps - 1) steps_.pop_front();
  steps_.push_back({step_, count_, static_cast<int64_t>(hash_)});
  ++step_;
  count_ = 0;
  hash_ = kFnvOffset;
}

int64_t CollectiveSchedule::step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return step_;
}

ScheduleReport CollectiveSchedule::report(bool failed) const {
  ScheduleReport report;
  report.failed = failed;
  report.checked_step = checked_step_;
  report.steps.assign(steps_.begin(), steps_.end());
  report.steps.push_back({step_, count_, static_cast<int64_t>(hash_)});
  report.records.assign(ring_.begin(), ring_.end());
  return report;
}

CommError CollectiveSchedule::error(const std::string& detail, int peer) const {
  // The check's number from 1 (a failure joins the next check).
  return CommError("schedule_check", checks_ + 1, root_ranks_[side_channel_->rank()], peer, detail);
}

std::string CollectiveSchedule::compare(bool failed, int64_t* peer) {
  int64_t header[4];
  ScheduleReport mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    header[0] = failed ? 1 : 0;
    header[1] = step_;
    header[2] = window_count_;
    header[3] = static_cast<int64_t>(window_hash_);
    mine = report(failed);
  }
  const int world_size = side_channel_->world_size();
  at::Tensor all = at::empty({4 * world_size}, at::kLong);
  side_channel_->all_gather_into_tensor(all, at::from_blob(header, {4}, at::kLong));
  const int64_t* h = all.data_ptr<int64_t>();
  bool differ = false;
  for (int r = 0; r < world_size; ++r) {
    differ = differ || h[4 * r] != 0 || h[4 * r + 2] != header[2] || h[4 * r + 3] != header[3];
    if (*peer < 0 && (h[4 * r + 2] != header[2] || h[4 * r + 3] != header[3])) {
      *peer = root_ranks_[r];
    }
  }
  if (!differ) return "";
  at::Tensor packed = at::empty({ScheduleReport::kSize}, at::kLong);
  mine.pack(packed.data_ptr<int64_t>());
  at::Tensor reports = at::empty({ScheduleReport::kSize * world_size}, at::kLong);
  side_channel_->all_gather_into_tensor(reports, packed);
  std::vector<ScheduleReport> unpacked;
  for (int r = 0; r < world_size; ++r) {
    unpacked.push_back(
        ScheduleReport::unpack(reports.data_ptr<int64_t>() + r * ScheduleReport::kSize));
  }
  return describe_schedule_mismatch(unpacked, root_ranks_);
}

void CollectiveSchedule::check() {
  if (final_error_) throw *final_error_;
  int64_t peer = -1;
  std::string mismatch;
  try {
    mismatch = compare(/*failed=*/false, &peer);
  } catch (const CommError& e) {
    final_error_ = error(
        absl::StrCat("the ranks did not all reach the check of step ", step(), ": ", e.what()),
        e.peer());
    throw *final_error_;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!mismatch.empty()) {
    final_error_ = error(mismatch, static_cast<int>(peer));
    throw *final_error_;
  }
  ++checks_;
  checked_step_ = step_ - 1;
  steps_.clear();
  window_count_ = 0;
  window_hash_ = kFnvOffset;
}

void CollectiveSchedule::fail(const CommError& failure) {
  if (final_error_) throw *final_error_;
  if (std::exchange(reported_failure_, true)) throw failure;  // the peers compared already
  int64_t peer = -1;
  std::string mismatch;
  try {
    mismatch = compare(/*failed=*/true, &peer);
  } catch (const CommError& e) {
    // The peers are gone too (a closed connection: at once), or one stopped answering
    // (a timeout: the job ended only after this wait too, which the failure's own words
    // do not count). The side channel's error says which.
    CommError unanswered = failure;
    unanswered.add_context(
        absl::StrCat("then the ranks' collective schedules could not be compared either: ",
                     e.what_without_backtrace()));
    throw unanswered;
  }
  if (mismatch.empty()) throw failure;
  final_error_ = error(absl::StrCat(mismatch, "; on this rank, then: ", failure.what()),
                       static_cast<int>(peer));
  throw *final_error_;
}

}  // namespace fsdp::comm_internal
