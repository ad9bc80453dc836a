// The comparison behind Communicator::set_size_checks, shared by the backends that
// all-gather each rank's (kind, numel) record before a collective (Gloo, NCCL).
//
// Internal to fsdp/comm.
#ifndef FSDP_COMM_INTERNAL_SIZE_CHECKS_H_
#define FSDP_COMM_INTERNAL_SIZE_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/comm/communicator.h"

namespace fsdp::comm_internal {

// `records`: 2 x global_ranks.size() int64 values, rank r's kind (CollectiveKind as
// int64) and element count at 2r and 2r + 1, as the size check's all-gather leaves them.
// Returns "" when every rank's record is (kind, numel), this rank's collective; otherwise
// "rank 0 runs all_gather_into_tensor of 5 elements, rank 1 runs all_reduce of 7
// elements: the ranks are not running the same units in the same order" (global ranks).
std::string describe_mismatched_collectives(const int64_t* records,
                                            const std::vector<int>& global_ranks,
                                            CollectiveKind kind, int64_t numel);

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_INTERNAL_SIZE_CHECKS_H_
