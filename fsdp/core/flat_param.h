// Flat parameters: a unit's parameters flattened into one padded 1-D buffer, sharded
// across ranks (PyTorch: torch.distributed.fsdp.flat_param.FlatParamHandle /
// FlatParameter).
//
//   std::vector<fsdp::NamedParam> params = {{"0.weight", w0}, {"2.weight", w2}};
//   fsdp::FlatParamHandle handle(params, comm, fsdp::ShardingStrategy::kFullShard);
//   handle.sharded_flat_param();  // leaf, ceil(numel / W) elements: give it to the optimizer
//   handle.unshard();             // all-gather: w0 and w2 (views) hold the full values
//   handle.reshard();             // frees the unsharded buffer's memory (views stay valid)
//   handle.reduce_grad({g0, g2});  // average over ranks into sharded_flat_param().grad()
//
// Layout (REFERENCE §3). The flat parameter is the concatenation of the parameters'
// elements in the given order (shared parameters must be passed once), padded with zeros
// to shard_numel x world_size elements; rank r owns elements [r x shard_numel,
// (r + 1) x shard_numel). After construction the original parameters are views into the
// unsharded flat buffer (set_data), so modules keep using them unchanged; the handle
// starts resharded (that buffer's memory freed), so read them after unshard().
//
// NO_SHARD keeps the whole (unpadded) flat parameter on every rank: the sharded flat
// parameter is the flat buffer itself, unshard/reshard do nothing, and gradients are
// all-reduced.
//
// Threading: a handle is used by one thread (its rank's); collectives go through its
// communicator in call order. Errors: c10::Error naming cleaned FQNs for bad input.
#ifndef FSDP_CORE_FLAT_PARAM_H_
#define FSDP_CORE_FLAT_PARAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/comm/communicator.h"

namespace fsdp {

// PyTorch: torch.distributed.fsdp.ShardingStrategy.
enum class ShardingStrategy {
  kFullShard,    // parameters, gradients, optimizer state sharded; reshard after forward
  kShardGradOp,  // parameters kept unsharded from forward to backward
  kNoShard,      // replicated, gradients all-reduced (DDP)
};

const char* sharding_strategy_name(ShardingStrategy strategy);  // "FULL_SHARD", ...

struct NamedParam {
  std::string fqn;
  at::Tensor param;
};

// Where one original parameter lives in the flat parameter.
struct FlatParamInfo {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // first element in the flat parameter
};

// The part of one original parameter inside a flat range: elements [start, end] of the
// parameter (inclusive, flattened), as in PyTorch's shard metadata.
struct ShardParamInfo {
  std::string fqn;
  int64_t start = 0;
  int64_t end = 0;
};

// The parameters overlapping flat elements [start, end] (inclusive; elements past the
// last parameter are padding and belong to none), in flat order.
// REFERENCE §3: [50, 149] over 0.weight, 2.weight (100 each) -> 0.weight (50, 99),
// 2.weight (0, 49).
std::vector<ShardParamInfo> shard_param_infos(const std::vector<FlatParamInfo>& infos,
                                              int64_t start, int64_t end);

class FlatParamHandle {
 public:
  // `params`: distinct parameters (the same tensor twice is an error naming both FQNs),
  // at least one, all of one floating dtype and device, contiguous or not. Their values
  // become the flat parameter; rank r keeps its shard. Throws c10::Error on bad input.
  FlatParamHandle(std::vector<NamedParam> params, std::shared_ptr<Communicator> comm,
                  ShardingStrategy strategy);

  int64_t numel() const { return numel_; }                // sum of the parameters' numels
  int64_t shard_numel() const { return shard_numel_; }    // ceil(numel / W); NO_SHARD: numel
  int64_t padded_numel() const { return padded_numel_; }  // shard_numel x W; NO_SHARD: numel
  int64_t padding() const { return padded_numel_ - numel_; }
  ShardingStrategy strategy() const { return strategy_; }
  const std::vector<FlatParamInfo>& param_infos() const { return infos_; }
  // This rank's shard as ShardParamInfos.
  std::vector<ShardParamInfo> local_shard_param_infos() const;

  // The leaf the optimizer updates: 1-D, shard_numel elements, requires_grad.
  const at::Tensor& sharded_flat_param() const { return sharded_; }
  // The original parameters (views into the unsharded flat buffer), in flattening order.
  const std::vector<at::Tensor>& original_params() const { return originals_; }

  // All-gathers the shards into the unsharded flat buffer (allocating its memory), so the
  // original parameters hold the current full values. No-op if already unsharded.
  void unshard();
  // Starts unshard()'s all-gather without waiting for it (prefetch); the next unshard()
  // waits. No-op if unsharded or already prefetching.
  void prefetch();
  // Frees the unsharded flat buffer's memory (after a pending prefetch completes). No-op
  // for NO_SHARD or if already resharded.
  void reshard();
  bool is_unsharded() const { return unsharded_; }

  // Flattens the original parameters' gradients (`grads[i]` for original_params()[i];
  // an undefined tensor counts as zeros), averages them over ranks (reduce-scatter, or
  // all-reduce for NO_SHARD), and adds the result to sharded_flat_param().grad().
  void reduce_grad(const std::vector<at::Tensor>& grads);

  // Inside no_sync: adds the flattened gradients (as for reduce_grad) to an unsharded
  // accumulator, without communication; the next reduce_grad reduces their sum.
  void accumulate_grad(const std::vector<at::Tensor>& grads);
  bool has_accumulated_grad() const { return unsharded_grad_.defined(); }

  // Copies this rank's chunk of the unsharded flat buffer (edited through the original
  // parameters, e.g. in summon_full_params) back into the shard. Needs is_unsharded().
  void write_back_shard();

  // A copy of the full flat parameter (numel elements, no padding), e.g. for tests.
  at::Tensor full_flat_param();

 private:
  std::shared_ptr<Communicator> comm_;
  ShardingStrategy strategy_;
  std::vector<FlatParamInfo> infos_;
  std::vector<at::Tensor> originals_;
  int64_t numel_ = 0;
  int64_t shard_numel_ = 0;
  int64_t padded_numel_ = 0;
  at::Tensor unsharded_flat_;  // padded_numel elements; its storage is freed by reshard()
  at::Tensor flatten_grads(const std::vector<at::Tensor>& grads) const;

  at::Tensor sharded_;         // the optimizer's leaf
  at::Tensor unsharded_grad_;  // no_sync accumulator, padded_numel elements, or undefined
  WorkHandle pending_;         // a prefetch's all-gather
  bool unsharded_ = true;
};

}  // namespace fsdp

#endif  // FSDP_CORE_FLAT_PARAM_H_
