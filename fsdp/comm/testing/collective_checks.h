// Closed-form checks of the Communicator contract, shared by every backend's tests so
// they are tested the same way (testonly).
#ifndef FSDP_COMM_TESTING_COLLECTIVE_CHECKS_H_
#define FSDP_COMM_TESTING_COLLECTIVE_CHECKS_H_

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "fsdp/comm/communicator.h"

namespace fsdp::comm_internal {

// Runs all-gather (5 elements per rank), reduce-scatter (sum), all-reduce of 7 elements
// (padding for most world sizes), broadcast from the last rank and a barrier in `dtype`,
// and EXPECTs closed-form results and exact traffic counters. Resets the counters first.
// Every rank of `comm` calls it. The buffers are on `device` (its current stream).
void expect_collectives_match_closed_forms(Communicator& comm, c10::ScalarType dtype,
                                           c10::Device device = c10::kCPU);

// Average reduce-scatter and all-reduce on float32, buffers on `device`.
void expect_average_divides_by_world_size(Communicator& comm, c10::Device device = c10::kCPU);

// split_hybrid(2) on 4 ranks: shard groups {0,1}, {2,3}; replicate groups {0,2}, {1,3}.
void expect_hybrid_groups_of_four(Communicator& comm);

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_COLLECTIVE_CHECKS_H_
