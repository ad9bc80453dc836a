// A communicator that hands every collective to another one, for tests that watch what
// the layers above issue (testonly).
//
//   class Log : public comm_internal::ForwardingCommunicator {
//     using ForwardingCommunicator::ForwardingCommunicator;
//     void issued(CollectiveKind kind, const CommBuffer&, ReduceOp) override { ... }
//   };
//
// Results, errors and subgroups are the inner communicator's; the forwarding one keeps
// its own sequence numbers and traffic counters, as any backend.
#ifndef FSDP_COMM_TESTING_FORWARDING_H_
#define FSDP_COMM_TESTING_FORWARDING_H_

#include <memory>
#include <string>
#include <utility>

#include "fsdp/comm/communicator.h"

namespace fsdp::comm_internal {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::shared_ptr<Communicator> inner)
      : Communicator(inner->rank(), inner->world_size(), inner->timeout()),
        inner_(std::move(inner)) {}
  std::string backend_name() const override { return "forwarding:" + inner_->backend_name(); }

 protected:
  // Called before each collective is handed on. `buffer`: the input of an all-gather or
  // reduce-scatter, the tensor of an all-reduce or broadcast, empty for a barrier. `op`:
  // the reduction of a reduce-scatter or all-reduce, kSum for the others.
  virtual void issued(CollectiveKind kind, const CommBuffer& buffer, ReduceOp op) = 0;

  bool supports_device(const c10::Device& device) const override { return device.is_cpu(); }
  WorkHandle do_all_gather(const CommBuffer& out, const CommBuffer& in, int64_t) override {
    issued(CollectiveKind::kAllGather, in, ReduceOp::kSum);
    return inner_->all_gather_into_tensor_async(out, in);
  }
  WorkHandle do_reduce_scatter(const CommBuffer& out, const CommBuffer& in, ReduceOp op,
                               int64_t) override {
    issued(CollectiveKind::kReduceScatter, in, op);
    return inner_->reduce_scatter_tensor_async(out, in, op);
  }
  WorkHandle do_all_reduce(const CommBuffer& t, ReduceOp op, int64_t) override {
    issued(CollectiveKind::kAllReduce, t, op);
    return inner_->all_reduce_async(t, op);
  }
  WorkHandle do_broadcast(const CommBuffer& t, int root, int64_t) override {
    issued(CollectiveKind::kBroadcast, t, ReduceOp::kSum);
    return inner_->broadcast_async(t, root);
  }
  WorkHandle do_barrier(int64_t) override {
    issued(CollectiveKind::kBarrier, CommBuffer{}, ReduceOp::kSum);
    return inner_->barrier_async();
  }
  std::shared_ptr<Communicator> do_new_subgroup(const SubgroupSpec& spec) override {
    return inner_->new_subgroup(spec.ranks);
  }

 private:
  std::shared_ptr<Communicator> inner_;
};

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_FORWARDING_H_
