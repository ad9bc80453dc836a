// A Gloo group for another backend's host groups (Communicator::new_host_subgroup): the
// NCCL backend's are Gloo groups over its store (Note [Host groups of the NCCL backend] in
// nccl.cc). Internal to fsdp/comm.
#ifndef FSDP_COMM_INTERNAL_GLOO_GROUP_H_
#define FSDP_COMM_INTERNAL_GLOO_GROUP_H_

#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/comm/communicator.h"
#include "fsdp/comm/gloo.h"

namespace fsdp {
namespace comm_internal {

// This rank's Gloo communicator of the group whose members are `global_ranks` (root
// communicator ranks, ascending; this rank is global_ranks[rank]), connected through
// `store`, which every member passes with the same prefix of the group's own. A family
// of its own: its failures close no other communicator's connections, and it names the
// lost peer among its members (Note [Naming the lost peer] in gloo.cc). Collective over
// the members; throws c10::Error as make_gloo_communicator does.
std::shared_ptr<Communicator> make_gloo_group(c10::intrusive_ptr<c10d::Store> store, int rank,
                                              std::vector<int> global_ranks,
                                              const GlooOptions& options);

}  // namespace comm_internal
}  // namespace fsdp

#endif  // FSDP_COMM_INTERNAL_GLOO_GROUP_H_
