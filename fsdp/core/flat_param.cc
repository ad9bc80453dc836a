#include "fsdp/core/flat_param.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include <ATen/Functions.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

namespace fsdp {

const char* sharding_strategy_name(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
  }
  return "unknown";
}

std::vector<ShardParamInfo> shard_param_infos(const std::vector<FlatParamInfo>& infos,
                                              int64_t start, int64_t end) {
  std::vector<ShardParamInfo> result;
  for (const FlatParamInfo& info : infos) {
    const int64_t first = std::max(start, info.offset);
    const int64_t last = std::min(end, info.offset + info.numel - 1);
    if (first <= last) result.push_back({info.fqn, first - info.offset, last - info.offset});
  }
  return result;
}

FlatParamHandle::FlatParamHandle(std::vector<NamedParam> params,
                                 std::shared_ptr<Communicator> comm, ShardingStrategy strategy)
    : comm_(std::move(comm)), strategy_(strategy) {
  TORCH_CHECK(comm_ != nullptr, "FlatParamHandle: communicator is null");
  TORCH_CHECK(!params.empty(), "FlatParamHandle: expected at least one parameter to flatten, "
              "got none; a unit without parameters needs no flat parameter");
  absl::flat_hash_map<const c10::TensorImpl*, std::string> seen;
  const at::Tensor& first = params.front().param;
  for (const NamedParam& p : params) {
    TORCH_CHECK(p.param.defined(), "FlatParamHandle: parameter '", p.fqn, "' is undefined");
    auto [it, inserted] = seen.try_emplace(p.param.unsafeGetTensorImpl(), p.fqn);
    TORCH_CHECK(inserted, "FlatParamHandle: '", p.fqn, "' is the same tensor as '", it->second,
                "'; pass a shared parameter once");
    TORCH_CHECK(p.param.scalar_type() == first.scalar_type() &&
                    p.param.device() == first.device(),
                "FlatParamHandle: all parameters of a unit need one dtype and device; '",
                params.front().fqn, "' is ", first.toString(), " on ", first.device(), " but '",
                p.fqn, "' is ", p.param.toString(), " on ", p.param.device());
    TORCH_CHECK(c10::isFloatingType(p.param.scalar_type()), "FlatParamHandle: parameter '",
                p.fqn, "' has dtype ", p.param.scalar_type(), "; expected a floating dtype");
    infos_.push_back({p.fqn, p.param.sizes().vec(), p.param.numel(), numel_});
    numel_ += p.param.numel();
  }
  const int64_t w = comm_->world_size();
  const bool no_shard = strategy_ == ShardingStrategy::kNoShard;
  shard_numel_ = no_shard ? numel_ : (numel_ + w - 1) / w;
  padded_numel_ = no_shard ? numel_ : shard_numel_ * w;

  const auto options = first.options().requires_grad(false);
  unsharded_flat_ = at::zeros({padded_numel_}, options);
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor view = unsharded_flat_.narrow(0, infos_[i].offset, infos_[i].numel);
    view.copy_(params[i].param.detach().reshape({-1}));
    params[i].param.set_data(view.view(infos_[i].shape));
    originals_.push_back(params[i].param);
  }
  if (no_shard) {
    sharded_ = unsharded_flat_;  // the optimizer updates the flat buffer the views use
  } else {
    sharded_ = unsharded_flat_.narrow(0, comm_->rank() * shard_numel_, shard_numel_).clone();
  }
  sharded_.set_requires_grad(true);
  reshard();  // sharded from the start: only the shard's memory stays allocated
}

std::vector<ShardParamInfo> FlatParamHandle::local_shard_param_infos() const {
  const int64_t start = strategy_ == ShardingStrategy::kNoShard ? 0
                                                                : comm_->rank() * shard_numel_;
  return shard_param_infos(infos_, start, start + shard_numel_ - 1);
}

void FlatParamHandle::prefetch() {
  if (unsharded_ || pending_) return;
  // See Note [Freeing the unsharded flat parameter].
  at::native::resize_bytes_cpu(unsharded_flat_.storage().unsafeGetStorageImpl(),
                               padded_numel_ * unsharded_flat_.element_size());
  pending_ = comm_->all_gather_into_tensor_async(unsharded_flat_, sharded_.detach());
}

void FlatParamHandle::unshard() {
  if (unsharded_) return;
  prefetch();
  WorkHandle work = std::move(pending_);
  work->wait();
  unsharded_ = true;
}

// Note [Freeing the unsharded flat parameter]
// The original parameters, and tensors autograd saved from them, are views of
// unsharded_flat_'s storage. Resizing that storage to 0 bytes frees the memory while
// every view keeps pointing at the same StorageImpl; unshard() resizes it back and
// all-gathers into it, so the views read the new values. The all-gather writes through
// a raw pointer, which leaves the views' version counters alone.
void FlatParamHandle::reshard() {
  if (pending_) unshard();  // never free memory an all-gather is writing
  if (!unsharded_ || strategy_ == ShardingStrategy::kNoShard) return;
  at::native::resize_bytes_cpu(unsharded_flat_.storage().unsafeGetStorageImpl(), 0);
  unsharded_ = false;
}

at::Tensor FlatParamHandle::flatten_grads(const std::vector<at::Tensor>& grads) const {
  TORCH_CHECK(grads.size() == infos_.size(), "FlatParamHandle: expected ", infos_.size(),
              " gradients (one per original parameter), got ", grads.size());
  at::Tensor flat_grad = at::zeros({padded_numel_}, sharded_.options().requires_grad(false));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    TORCH_CHECK(grads[i].numel() == infos_[i].numel, "FlatParamHandle: gradient of '",
                infos_[i].fqn, "' has ", grads[i].numel(), " elements, expected ",
                infos_[i].numel);
    flat_grad.narrow(0, infos_[i].offset, infos_[i].numel).copy_(grads[i].reshape({-1}));
  }
  return flat_grad;
}

void FlatParamHandle::accumulate_grad(const std::vector<at::Tensor>& grads) {
  at::Tensor flat_grad = flatten_grads(grads);
  if (unsharded_grad_.defined()) {
    unsharded_grad_.add_(flat_grad);
  } else {
    unsharded_grad_ = flat_grad;
  }
}

void FlatParamHandle::write_back_shard() {
  TORCH_CHECK(unsharded_, "write_back_shard: the flat parameter is not unsharded");
  if (strategy_ == ShardingStrategy::kNoShard) return;  // one buffer: nothing to copy
  sharded_.detach().copy_(
      unsharded_flat_.narrow(0, comm_->rank() * shard_numel_, shard_numel_));
}

void FlatParamHandle::reduce_grad(const std::vector<at::Tensor>& grads) {
  at::Tensor flat_grad = flatten_grads(grads);
  if (unsharded_grad_.defined()) {
    flat_grad.add_(unsharded_grad_);
    unsharded_grad_ = at::Tensor();
  }
  at::Tensor shard_grad;
  if (strategy_ == ShardingStrategy::kNoShard) {
    if (comm_->world_size() > 1) comm_->all_reduce(flat_grad, ReduceOp::kAvg);
    shard_grad = flat_grad;
  } else {
    shard_grad = at::empty({shard_numel_}, flat_grad.options());
    comm_->reduce_scatter_tensor(shard_grad, flat_grad, ReduceOp::kAvg);
  }
  at::Tensor& grad = sharded_.mutable_grad();
  if (grad.defined()) {
    grad.add_(shard_grad);
  } else {
    grad = shard_grad;
  }
}

at::Tensor FlatParamHandle::full_flat_param() {
  at::Tensor full = at::empty({padded_numel_}, sharded_.options().requires_grad(false));
  if (strategy_ == ShardingStrategy::kNoShard) {
    full.copy_(sharded_.detach());
  } else {
    comm_->all_gather_into_tensor(full, sharded_.detach());
  }
  return full.narrow(0, 0, numel_);
}

}  // namespace fsdp
