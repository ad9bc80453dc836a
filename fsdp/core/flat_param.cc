#include "fsdp/core/flat_param.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include "fsdp/base/shard_geometry.h"
#include "fsdp/base/torch_compat.h"

namespace fsdp {

double gradient_predivide_factor(int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "gradient_predivide_factor: expected world_size >= 1, got ",
              world_size);
  int64_t factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return static_cast<double>(factor);
}

double gradient_postdivide_factor(int64_t world_size) {
  return static_cast<double>(world_size) / gradient_predivide_factor(world_size);
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

FlatParamHandle::FlatParamHandle(std::vector<NamedParam> params, std::shared_ptr<Communicator> comm,
                                 ShardingStrategy strategy, const FlatParamOptions& options)
    : comm_(std::move(comm)),
      strategy_(strategy),
      device_(options.device_handle()),
      replicate_comm_(options.replicate_communicator()),
      keep_low_precision_grads_(options.keep_low_precision_grads()),
      offload_(options.offload_params()) {
  TORCH_CHECK(comm_ != nullptr, "FlatParamHandle: communicator is null");
  TORCH_CHECK(!params.empty(),
              "FlatParamHandle: expected at least one parameter to flatten, "
              "got none; a unit without parameters needs no flat parameter");
  TORCH_CHECK(!is_hybrid(strategy_) || replicate_comm_ != nullptr,
              "FlatParamHandle: ", sharding_strategy_name(strategy_),
              " needs options.replicate_communicator (the "
              "replicate group of Communicator::split_hybrid)");
  absl::flat_hash_map<const c10::TensorImpl*, std::string> seen;
  const at::Tensor& first = params.front().param;
  std::vector<std::string> trained, frozen;
  for (const NamedParam& p : params) {
    TORCH_CHECK(p.param.defined(), "FlatParamHandle: parameter '", p.fqn, "' is undefined");
    auto [it, inserted] = seen.try_emplace(p.param.unsafeGetTensorImpl(), p.fqn);
    TORCH_CHECK(inserted, "FlatParamHandle: '", p.fqn, "' is the same tensor as '", it->second,
                "'; pass a shared parameter once");
    TORCH_CHECK(p.param.scalar_type() == first.scalar_type() && p.param.device() == first.device(),
                "FlatParamHandle: all parameters of a unit need one dtype and device; '",
                params.front().fqn, "' is ", first.toString(), " on ", first.device(), " but '",
                p.fqn, "' is ", p.param.toString(), " on ", p.param.device());
    // See Note [Flat parameters of several dtypes].
    TORCH_CHECK(c10::isFloatingType(p.param.scalar_type()) || !p.param.requires_grad(),
                "FlatParamHandle: parameter '", p.fqn, "' has dtype ", p.param.scalar_type(),
                " and requires grad; a trainable parameter needs a floating dtype");
    infos_.push_back({p.fqn, p.param.sizes().vec(), p.param.numel(), numel_});
    numel_ += p.param.numel();
    (p.param.requires_grad() ? trained : frozen).push_back(p.fqn);
  }
  TORCH_CHECK(trained.empty() || frozen.empty(),
              "FlatParamHandle: a unit's parameters must "
              "agree on requires_grad (one flat parameter has one), but [",
              absl::StrJoin(trained, ", "), "] require grad and [", absl::StrJoin(frozen, ", "),
              "] do not; make one handle per kind (FullyShardedDataParallel does so for a "
              "unit that mixes them: FullyShardedUnit::frozen_handle)");
  // Meta parameters: see Note [Flat parameters of meta parameters].
  const bool meta = first.is_meta();
  if (device_ == nullptr) device_ = DeviceHandle::for_device(meta ? c10::kCPU : first.device());
  TORCH_CHECK(meta || device_->device() == first.device(), "FlatParamHandle: the device handle is ",
              device_->device(), "'s but the parameters (e.g. '", params.front().fqn, "') are on ",
              first.device());
  // PyTorch infers the reduce dtype from param_dtype when only the latter is given. Stored
  // (non-floating) values are gathered as they are: see Note [Flat parameters of several
  // dtypes].
  const bool stored = !c10::isFloatingType(first.scalar_type());
  param_dtype_ = stored ? first.scalar_type() : options.param_dtype().value_or(first.scalar_type());
  reduce_dtype_ = stored ? first.scalar_type() : options.reduce_dtype().value_or(param_dtype_);
  TORCH_CHECK(stored || (c10::isFloatingType(param_dtype_) && c10::isFloatingType(reduce_dtype_)),
              "FlatParamHandle: mixed precision needs floating dtypes, got param_dtype ",
              param_dtype_, " and reduce_dtype ", reduce_dtype_);
  const bool no_shard = strategy_ == ShardingStrategy::kNoShard;
  // NO_SHARD: one shard, the whole flat parameter, on every rank.
  const int64_t shards = no_shard ? 1 : comm_->world_size();
  const ShardRange range = shard_range(numel_, shards, no_shard ? 0 : comm_->rank());
  shard_offset_ = range.begin;
  shard_numel_ = range.numel();
  padded_numel_ = fsdp::padded_numel(numel_, shards);

  if (meta) {
    init_from_meta(params, /*trained=*/frozen.empty());
    return;
  }
  const auto options_of_params = first.options().requires_grad(false);
  at::Tensor flat = at::zeros({padded_numel_}, options_of_params);
  for (size_t i = 0; i < params.size(); ++i) {
    flat.narrow(0, infos_[i].offset, infos_[i].numel).copy_(params[i].param.detach().reshape({-1}));
    originals_.push_back(params[i].param);
  }
  const at::Tensor own_shard = no_shard ? flat : flat.narrow(0, shard_offset_, shard_numel_);
  if (offload_) {  // See Note [CPU offload].
    sharded_ = device_->empty_host(shard_numel_, first.scalar_type());
    sharded_.copy_(own_shard);
  } else {
    sharded_ = no_shard ? flat : own_shard.clone();  // NO_SHARD: the optimizer updates `flat`
  }
  sharded_.set_requires_grad(frozen.empty());
  unsharded_flat_ = uses_mixed_precision()
                        ? at::empty({padded_numel_}, options_of_params.dtype(param_dtype_))
                    : no_shard && !offload_ ? sharded_.detach()
                                            : flat;
  use_views_of(unsharded_flat_);
  reshard();  // sharded from the start: only the shard's memory stays allocated
}

// Note [Flat parameters of several dtypes]
// One flat parameter holds one dtype, as PyTorch FSDP1's FlatParameter. A unit whose
// parameters come in several dtypes (a LoRA model over a bf16 checkpoint: fp32 adapters
// beside a bf16 base; QLoRA: uint8 4-bit codes, fp32 scales, bf16 norms) gets one flat
// parameter for its trainable parameters (one dtype: their gradients are reduced together)
// and one per dtype for its frozen ones (fully_sharded.h, FullyShardedUnit::frozen_handles).
// Each keeps its dtype in its shard, so a bf16 base costs bf16 bytes on every rank.
// Floating flat parameters follow MixedPrecision::param_dtype, the frozen ones too (FSDP2's
// MixedPrecisionPolicy casts every parameter; a frozen fp32 embedding feeding bf16 layers
// must arrive in bf16); a flat parameter of another dtype holds stored values (packed
// codes, integer scales) that only their owner decodes, so it is gathered byte for byte in
// its own dtype: no float copy ever touches such bytes, so no bit pattern a float copy
// would rewrite (a NaN payload) can be altered. Frozen flat parameters have no gradient and
// no reduction.
// FSDP2 instead all-gathers a parameter group's tensors of every dtype in one collective,
// viewing each as bytes, then copies each rank's piece out of the gathered buffer. Here each
// flat parameter has its own all-gather, issued back to back and straight into its unsharded
// buffer: no copy-in, no copy-out. Measured with Gloo on 2 CPU ranks (W = 2, a bf16 buffer
// and a uint8 buffer, torch 2.11, 20 calls each, the shorter of two runs, a busy machine):
// two collectives took 2.4, 17.0 and 151 ms where one byte collective with its copy-out took
// 3.9, 26.1 and 353 ms, for 1 + 1, 8 + 2 and 64 + 16 MiB gathered. A unit of one dtype has
// one flat parameter and its collectives, bytes and results are those of before.

// Note [Flat parameters of meta parameters]
// Parameters on c10::kMeta have a shape and a dtype but no values and no memory: a model built
// so (deferred initialisation, PyTorch's meta device) costs nothing until FSDP shards it. The
// handle then allocates only what it would keep after resharding: the shard (shard_numel
// elements, on the device or, with offload_params, on the host) and an unsharded flat buffer
// whose memory reshard() frees at once. The original parameters become views into that buffer
// in place (compat::materialize_meta_tensor: set_data refuses a meta tensor), so the modules'
// members see them. The shard holds NaN (its padding zeros) until something writes the
// parameters' values: FullyShardedRoot::init_parameters, or a state-dict reader that copies
// each rank's bytes into its shard. NaN, not uninitialised memory, so that a value nothing
// wrote shows up in the first loss instead of training on whatever the allocator returned.
void FlatParamHandle::init_from_meta(const std::vector<NamedParam>& params, bool trained) {
  const c10::ScalarType dtype = params.front().param.scalar_type();
  sharded_ = offload_ ? device_->empty_host(shard_numel_, dtype)
                      : at::empty({shard_numel_}, device_options(dtype));
  if (c10::isFloatingType(dtype)) {
    sharded_.fill_(std::numeric_limits<double>::quiet_NaN());
  } else {
    sharded_.zero_();  // no NaN in an integer dtype: a stored tensor reads as zeros until loaded
  }
  const int64_t padding_in_shard = std::max<int64_t>(0, shard_offset_ + shard_numel_ - numel_);
  if (padding_in_shard > 0) {
    sharded_
        .narrow(0, shard_numel_ - std::min(padding_in_shard, shard_numel_),
                std::min(padding_in_shard, shard_numel_))
        .zero_();
  }
  sharded_.set_requires_grad(trained);
  const bool no_shard = strategy_ == ShardingStrategy::kNoShard;
  unsharded_flat_ = no_shard && !separate_unsharded()
                        ? sharded_.detach()
                        : at::empty({padded_numel_}, device_options(param_dtype_));
  for (size_t i = 0; i < params.size(); ++i) {
    compat::materialize_meta_tensor(
        params[i].param,
        unsharded_flat_.narrow(0, infos_[i].offset, infos_[i].numel).view(infos_[i].shape));
    originals_.push_back(params[i].param);
  }
  state_ = FlatParamState::kUnsharded;
  reshard();  // frees the unsharded buffer's memory: only the shard stays allocated
}

void FlatParamHandle::copy_into_shard(size_t index, const at::Tensor& value) {
  TORCH_CHECK(index < infos_.size(), "FlatParamHandle::copy_into_shard: parameter index ", index,
              " out of range (", infos_.size(), " parameters)");
  // An unsharded buffer of its own would keep the old values: write while sharded.
  TORCH_CHECK(state_ == FlatParamState::kSharded ||
                  (strategy_ == ShardingStrategy::kNoShard && !separate_unsharded()),
              "FlatParamHandle::copy_into_shard: '", infos_[index].fqn, "' is ",
              flat_param_state_name(state_), "; call it while the handle is sharded");
  const FlatParamInfo& info = infos_[index];
  TORCH_CHECK(value.sizes().vec() == info.shape, "FlatParamHandle::copy_into_shard: '", info.fqn,
              "' has shape ", c10::IntArrayRef(info.shape), " but the value has shape ",
              value.sizes());
  const int64_t first = std::max(info.offset, shard_offset_);
  const int64_t last = std::min(info.offset + info.numel, shard_offset_ + shard_numel_);
  if (first >= last) return;  // no element of it in this rank's shard
  at::NoGradGuard no_grad;
  sharded_.detach()
      .narrow(0, first - shard_offset_, last - first)
      .copy_(value.detach().reshape({-1}).narrow(0, first - info.offset, last - first));
}

void FlatParamHandle::use_views_of(const at::Tensor& flat) {
  for (size_t i = 0; i < originals_.size(); ++i) {
    originals_[i].set_data(flat.narrow(0, infos_[i].offset, infos_[i].numel).view(infos_[i].shape));
  }
}

std::vector<ShardParamInfo> FlatParamHandle::local_shard_param_infos() const {
  return shard_param_infos(infos_, shard_offset_, shard_offset_ + shard_numel_ - 1);
}

const char* flat_param_state_name(FlatParamState state) {
  switch (state) {
    case FlatParamState::kSharded:
      return "SHARDED";
    case FlatParamState::kUnsharding:
      return "UNSHARDING";
    case FlatParamState::kUnsharded:
      return "UNSHARDED";
    case FlatParamState::kUnshardedFullPrecision:
      return "UNSHARDED_FULL_PRECISION";
  }
  return "?";
}

void FlatParamHandle::check_not_in(FlatParamState state, const char* call) const {
  TORCH_CHECK(state_ != state, "FlatParamHandle of '", infos_.front().fqn, "' (", infos_.size(),
              " parameters): ", call, " in state ", flat_param_state_name(state_),
              state == FlatParamState::kUnshardedFullPrecision
                  ? " (inside summon_full_params); reshard() first"
                  : "");
}

// Note [Out of memory while unsharding]
// The unsharded flat parameter is the one large allocation FSDP makes per unit (padded_numel
// elements: a whole unit, where the shard is 1 / W of it), so it is where a model that does
// not fit runs out of device memory. The allocator's error (c10::OutOfMemoryError, e.g. the
// CUDA caching allocator's "CUDA out of memory. Tried to allocate ...") names neither the
// unit nor the remedy, so the handle rethrows it as a c10::OutOfMemoryError (a c10::Error;
// PyTorch's torch.OutOfMemoryError) naming the unit's parameters, the bytes asked for and
// the bytes free on the device (DeviceHandle::memory_free), and the three remedies. The
// allocation comes before any state change or collective, so the handle stays in the
// state it was in (kSharded for unshard) and a later call may retry; every rank that runs
// out of memory fails before the all-gather, and a rank that does not waits in it until the
// communicator's timeout.
void FlatParamHandle::throw_out_of_memory(const c10::OutOfMemoryError& error, const char* what,
                                          c10::ScalarType dtype) const {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "FlatParamHandle of '", infos_.front().fqn, "' (",
                   infos_.size(), " parameters): ", what, " needs ",
                   padded_numel_ * static_cast<int64_t>(c10::elementSize(dtype)), " bytes on ",
                   device(), " for the unsharded flat parameter (", padded_numel_, " elements of ",
                   dtype, ") and the device is out of memory (", device_->memory_free(),
                   " bytes free). To fit, make the unit smaller (a wrap policy that puts fewer "
                   "parameters in each unit), shard over more ranks (a larger world size), or "
                   "unshard in a smaller dtype (MixedPrecision::param_dtype). Allocator: ",
                   error.msg());
}

void FlatParamHandle::reallocate_unsharded(const char* what) {
  try {
    device_->reallocate_storage(unsharded_flat_);
  } catch (const c10::OutOfMemoryError& error) {
    throw_out_of_memory(error, what, param_dtype_);  // See Note [Out of memory while unsharding]
  }
}

void FlatParamHandle::prefetch() {
  check_not_in(FlatParamState::kUnshardedFullPrecision, "unshard()");
  if (state_ != FlatParamState::kSharded) return;
  reallocate_unsharded("unsharding");
  if (strategy_ == ShardingStrategy::kNoShard) {  // a low-precision or offloaded copy
    if (offload_) {
      at::Tensor copy = copy_shard_to_device();
      unsharded_flat_.copy_(copy);
      release_copied_shard(copy);
    } else {
      unsharded_flat_.copy_(sharded_.detach());
    }
    state_ = FlatParamState::kUnsharded;
    return;
  }
  gather_input_ = offload_ ? copy_shard_to_device() : sharded_.detach().to(param_dtype_);
  pending_ = comm_->all_gather_into_tensor_async(unsharded_flat_, gather_input_);
  state_ = FlatParamState::kUnsharding;
}

void FlatParamHandle::finish_all_gather() {
  TORCH_INTERNAL_ASSERT(state_ == FlatParamState::kUnsharding && pending_);
  pending_->wait();
  pending_ = nullptr;
  if (offload_) {
    release_copied_shard(gather_input_);
  } else {
    gather_input_ = at::Tensor();
  }
  state_ = FlatParamState::kUnsharded;
}

void FlatParamHandle::unshard() {
  prefetch();
  if (state_ == FlatParamState::kUnsharding) finish_all_gather();
}

void FlatParamHandle::unshard_full_precision() {
  if (!uses_mixed_precision()) return unshard();
  if (state_ == FlatParamState::kUnshardedFullPrecision) return;
  reshard();  // drop a low-precision copy: the views move to the full-precision values
  if (strategy_ == ShardingStrategy::kNoShard && !offload_) {
    full_precision_flat_ = sharded_.detach();  // edits go straight to the shard
  } else {
    try {
      full_precision_flat_ = at::empty({padded_numel_}, device_options(sharded_.scalar_type()));
    } catch (const c10::OutOfMemoryError& error) {
      throw_out_of_memory(error, "unshard_full_precision()", sharded_.scalar_type());
    }
    if (strategy_ == ShardingStrategy::kNoShard) {
      full_precision_flat_.copy_(sharded_.detach());  // offloaded: from the host
    } else {
      // Offloaded: a blocking copy to the device (summon_full_params is not on the hot path).
      comm_->all_gather_into_tensor(full_precision_flat_,
                                    sharded_.detach().to(device(), /*non_blocking=*/false,
                                                         /*copy=*/offload_));
    }
  }
  use_views_of(full_precision_flat_);
  state_ = FlatParamState::kUnshardedFullPrecision;
}

// Note [Streams and freeing unsharded memory]
// What PyTorch does. FSDP1 (torch/distributed/fsdp/_runtime_utils.py) issues all-gathers on
// an `_unshard_stream` and reduce-scatters on a `_post_backward_stream`; the unsharded flat
// parameter is allocated while the unshard stream is current and used on the compute stream,
// so before freeing it FlatParamHandle calls `_no_dispatch_record_stream` (record_stream)
// with the compute stream, and gradients handed to the post-backward stream get the same
// treatment. With `limit_all_gathers` (on by default) `_reshard` records an event on the
// compute stream after each free and queues it in a `_FreeEventQueue`
// (torch/distributed/fsdp/_limiter_utils.py); once two are queued
// (`_max_num_inflight_all_gathers = 2`), `_unshard` takes the oldest and synchronizes on it,
// blocking the CPU so that it cannot issue a third all-gather before an earlier unit's memory
// is freed. FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
// _fsdp_collectives.py) copies the all-gather input in on an all-gather copy-in stream, runs
// the all-gather on an all-gather stream and records an event the compute stream waits on;
// it never calls record_stream but keeps each buffer referenced until an event says its
// consumer is done: the all-gather result lives in the all-gather state until the next
// all-gather waits on its copy-out event (which also bounds all-gathers in flight to the
// current one and one prefetched), and the reduce-scatter input lives in the reduce-scatter
// state, with its event, until the next reduce-scatter waits on it.
//
// What fsdp does. The communicator's own streams are the unshard and post-backward streams
// (NCCL: its all-gather and reduce-scatter streams, Note [NCCL streams and events] in
// fsdp/comm/nccl.h); the runtime does not put collectives on DeviceHandle::side_stream.
// Every buffer is allocated on the compute stream (the caller's current stream): the
// unsharded flat parameter (DeviceHandle::reallocate_storage), the cast all-gather input,
// the flat gradient and the reduce-scatter output. (With CPU offload the all-gather input
// is the shard copied in on a side stream instead: Note [CPU offload].) Then:
// 1. A collective starts after an event recorded on the compute stream when it is issued,
//    so it runs after every kernel queued before it, including those that last used the
//    memory the allocator gave its buffers.
// 2. Work::wait() makes the compute stream wait for the collective (NCCL: without a host
//    wait; Gloo and the fake backend finish it on the host). No buffer a collective touches
//    is freed before its wait: reshard() of a unit still unsharding waits first, the
//    all-gather input goes in finish_all_gather, the flat gradient in finish_reduce_grad. So
//    memory is freed after its collective's event, FSDP2's choice, with no record_stream.
// This is safe with the CUDA caching allocator: a freed block returns to the pool of the
// stream it was allocated on, the compute stream, and is handed out again only to
// allocations on that stream, whose kernels are queued after those that read the old
// contents; when the new owner is a collective's buffer, (1) orders the collective after
// them. record_stream is only needed when a block is freed while another stream still has
// work queued on it, which (2) rules out.
//
// The bound. Prefetching is one unit ahead (Note [Prefetching] in
// fsdp/core/internal/runtime.cc) and a unit is resharded on the host before the unit after
// the next is unsharded, so freed blocks are reused in compute-stream order. Under
// FULL_SHARD (and HYBRID_SHARD) at most three units' flat parameters are unsharded or
// unsharding at once: the root's (kept from forward to backward), the unit computing and
// the unit prefetched, i.e. two units besides the root. fully_sharded_test's
// GatheredUnitsTest counts it. SHARD_GRAD_OP keeps every unit gathered from forward to
// backward by design, as in PyTorch. Under NCCL the host runs ahead of the device (it
// queues the next unit's kernels while an all-gather runs), at most two units ahead (Note
// [Limiting all-gathers] in fsdp/core/internal/runtime.cc: PyTorch's limit_all_gathers,
// always on); over Gloo each wait finishes the collective on the host.

// Note [Freeing the unsharded flat parameter]
// The original parameters, and tensors autograd saved from them, are views of
// unsharded_flat_'s storage. Resizing that storage to 0 bytes (DeviceHandle::free_storage,
// which on CUDA returns the bytes to the caching allocator) frees the memory while every
// view keeps pointing at the same StorageImpl; unshard() resizes it back
// (DeviceHandle::reallocate_storage) and all-gathers into it, so the views read the new
// values. The all-gather writes through a raw pointer, which leaves the views' version
// counters alone. Only unshard_full_precision() points the views elsewhere (set_data,
// outside forward and backward), and reshard() points them back.
void FlatParamHandle::reshard() {
  switch (state_) {
    case FlatParamState::kSharded:
      return;
    case FlatParamState::kUnshardedFullPrecision:
      // Views are bounds-checked against the storage; on failure the handle stays summoned.
      reallocate_unsharded("reshard() (back from unshard_full_precision)");
      full_precision_flat_ = at::Tensor();
      use_views_of(unsharded_flat_);
      break;
    case FlatParamState::kUnsharding:
      finish_all_gather();  // never free memory an all-gather is writing
      [[fallthrough]];
    case FlatParamState::kUnsharded:
      if (strategy_ == ShardingStrategy::kNoShard && !separate_unsharded()) return;
      break;
  }
  device_->free_storage(unsharded_flat_);
  state_ = FlatParamState::kSharded;
}

at::Tensor FlatParamHandle::flatten_grads(std::vector<at::Tensor>& grads) const {
  TORCH_CHECK(grads.size() == infos_.size(), "FlatParamHandle: expected ", infos_.size(),
              " gradients (one per original parameter), got ", grads.size());
  at::Tensor flat_grad = at::zeros({padded_numel_}, device_options(reduce_dtype_));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    TORCH_CHECK(grads[i].numel() == infos_[i].numel, "FlatParamHandle: gradient of '",
                infos_[i].fqn, "' has ", grads[i].numel(), " elements, expected ", infos_[i].numel);
    flat_grad.narrow(0, infos_[i].offset, infos_[i].numel).copy_(grads[i].reshape({-1}));
    grads[i] = at::Tensor();  // its memory can go before the next one is copied
  }
  return flat_grad;
}

void FlatParamHandle::accumulate_grad(std::vector<at::Tensor> grads) {
  at::Tensor flat_grad = flatten_grads(grads);
  if (unsharded_grad_.defined()) {
    unsharded_grad_.add_(flat_grad);
  } else {
    unsharded_grad_ = flat_grad;
  }
}

void FlatParamHandle::write_back_shard() {
  TORCH_CHECK(state_ == FlatParamState::kUnshardedFullPrecision ||
                  (state_ == FlatParamState::kUnsharded && !uses_mixed_precision()),
              "write_back_shard: the flat parameter is not unsharded in full precision; "
              "call unshard_full_precision() first");
  if (strategy_ == ShardingStrategy::kNoShard && !offload_) return;  // one buffer: nothing to copy
  const at::Tensor& full =
      state_ == FlatParamState::kUnshardedFullPrecision ? full_precision_flat_ : unsharded_flat_;
  sharded_.detach().copy_(full.narrow(0, shard_offset_, shard_numel_));
}

void FlatParamHandle::reduce_grad(std::vector<at::Tensor> grads) {
  start_reduce_grad(std::move(grads));
  finish_reduce_grad();
  wait_for_offload();
}

void FlatParamHandle::start_reduce_grad(std::vector<at::Tensor> grads) {
  TORCH_CHECK(!reduction_pending(),
              "FlatParamHandle: start_reduce_grad while the previous reduction of '",
              infos_.front().fqn, "' is pending; call finish_reduce_grad first");
  at::Tensor flat_grad = flatten_grads(grads);
  if (unsharded_grad_.defined()) {
    flat_grad.add_(unsharded_grad_);
    unsharded_grad_ = at::Tensor();
  }
  // See Note [Gradient divide factors].
  const double predivide = gradient_predivide_factor(total_replicas());
  if (predivide > 1) flat_grad.div_(predivide);
  reduction_.input = flat_grad;
  if (strategy_ == ShardingStrategy::kNoShard) {
    reduction_.output = flat_grad;
    if (comm_->world_size() > 1) {
      reduction_.work = comm_->all_reduce_async(flat_grad, ReduceOp::kSum);
    }
  } else {
    reduction_.output = at::empty({shard_numel_}, flat_grad.options());
    reduction_.work =
        comm_->reduce_scatter_tensor_async(reduction_.output, flat_grad, ReduceOp::kSum);
  }
}

void FlatParamHandle::finish_reduce_grad() {
  TORCH_CHECK(reduction_pending(), "FlatParamHandle: finish_reduce_grad without a reduction");
  Reduction reduction = std::move(reduction_);
  reduction_ = Reduction();
  if (reduction.work != nullptr) reduction.work->wait();
  at::Tensor shard_grad = std::move(reduction.output);
  reduction.input = at::Tensor();  // freed here unless it is the output (NO_SHARD)
  if (strategy_ != ShardingStrategy::kNoShard && replicate_comm_ != nullptr) {
    replicate_comm_->all_reduce(shard_grad, ReduceOp::kSum);
  }
  const double postdivide = gradient_postdivide_factor(total_replicas());
  if (postdivide > 1) shard_grad.div_(postdivide);
  if (!keep_low_precision_grads_) shard_grad = shard_grad.to(sharded_.scalar_type());
  if (!offload_) return add_to_grad(shard_grad);
  // See Note [CPU offload]: to the host without waiting; wait_for_offload adds it.
  finish_grad_offload();  // an earlier reduction's copy, if nobody waited for it
  grad_offload_.host = device_->empty_host(shard_numel_, shard_grad.scalar_type());
  grad_offload_.host.copy_(shard_grad, /*non_blocking=*/true);
  grad_offload_.done = device_->record_event(device_->current_stream());
}

void FlatParamHandle::add_to_grad(const at::Tensor& shard_grad) {
  at::Tensor& grad = sharded_.mutable_grad();
  if (grad.defined()) {
    grad.add_(shard_grad);
  } else {
    grad = shard_grad;
  }
}

// Note [CPU offload]
// PyTorch's CPUOffload(offload_params=True) (FSDP1) and CPUOffloadPolicy (FSDP2): the
// sharded flat parameter, its gradient and so the optimizer's state live in host memory
// (DeviceHandle::empty_host: pinned on CUDA, so copies are asynchronous), and the
// optimizer steps on the CPU. The device holds only what is in flight: unsharded flat
// parameters (as without offload), the shard being all-gathered, flat gradients and the
// reduced shard until its copy to the host has run.
// - Unshard: copy_shard_to_device copies the shard on the handle's kOffloadCopyStream
//   side stream into a buffer allocated there (cast to param_dtype there too), records
//   an event and makes the compute stream wait for it; the all-gather, ordered after the
//   compute stream (Note [Streams and freeing unsharded memory]), then reads it. A
//   prefetched unit's copy therefore runs while the previous unit's kernels do. The copy
//   stream waits for nothing before the copy: the host shard was last written by the CPU
//   (optimizer, state-dict load) before the copy was issued, and the buffer comes from the
//   copy stream's own pool. When the all-gather has been waited for, release_copied_shard
//   makes the copy stream wait for the compute stream (which waited for the all-gather)
//   before the buffer goes back to that pool, so the next copy cannot overwrite it while
//   the all-gather may still read it, however the communicator orders its streams.
// - Reduce: the gradient is flattened, reduced (and for HYBRID all-reduced across groups)
//   and divided on the device as without offload; finish_reduce_grad then queues the
//   shard's copy to a new pinned host buffer on the compute stream (non_blocking) and
//   records an event, without blocking the host in backward (it waits only for an earlier
//   reduction's copy that nobody waited for, never for the copy-in, which the copy stream
//   holds behind the compute stream). wait_for_offload, which
//   the runtime calls for every unit at the end of each iteration (before the optimizer
//   can read a gradient or write a shard), synchronizes on that event and on the last
//   copy-in event, then adds the host buffer to .grad (or makes it .grad): FSDP1's
//   end-of-backward stream synchronize, FSDP2's post-reduce event.
// - summon_full_params, state dicts and full_flat_param copy the shard to the device with
//   blocking copies (not on the training path).
// With a CPU device every copy is a separate allocation and every stream and event a
// no-op, so the same code runs in the CPU tests: the values (and the arithmetic on them)
// are those of the run without offload, bit for bit.
at::Tensor FlatParamHandle::copy_shard_to_device() {
  const c10::Stream copy_stream = device_->side_stream(kOffloadCopyStream);
  at::Tensor copy;
  {
    c10::StreamGuard on_copy_stream(copy_stream);
    copy = at::empty({shard_numel_}, device_options(sharded_.scalar_type()));
    copy.copy_(sharded_.detach(), /*non_blocking=*/true);
    if (param_dtype_ != copy.scalar_type()) copy = copy.to(param_dtype_);
  }
  copy_in_done_ = device_->record_event(copy_stream);
  device_->wait_event(device_->current_stream(), *copy_in_done_);
  return copy;
}

void FlatParamHandle::release_copied_shard(at::Tensor& copy) {
  device_->wait_event(device_->side_stream(kOffloadCopyStream),
                      *device_->record_event(device_->current_stream()));
  copy = at::Tensor();
}

void FlatParamHandle::wait_for_offload() {
  if (copy_in_done_ != nullptr) {
    copy_in_done_->synchronize();
    copy_in_done_ = nullptr;
  }
  finish_grad_offload();
}

void FlatParamHandle::finish_grad_offload() {
  if (!grad_offload_.host.defined()) return;
  grad_offload_.done->synchronize();
  GradOffload done = std::exchange(grad_offload_, GradOffload());
  add_to_grad(done.host);
}

void FlatParamHandle::cancel_reduce_grad() {
  Reduction reduction = std::exchange(reduction_, Reduction());
  if (reduction.work != nullptr) reduction.work->wait();
}

int64_t FlatParamHandle::total_replicas() const {
  const int64_t groups = replicate_comm_ != nullptr ? replicate_comm_->world_size() : 1;
  return comm_->world_size() * groups;
}

void FlatParamHandle::add_fqn_prefix(const std::string& prefix) {
  for (FlatParamInfo& info : infos_) info.fqn = prefix + info.fqn;
}

at::Tensor FlatParamHandle::full_flat_param() {
  at::Tensor full = at::empty({padded_numel_}, device_options(sharded_.scalar_type()));
  if (strategy_ == ShardingStrategy::kNoShard) {
    full.copy_(sharded_.detach());
  } else {
    comm_->all_gather_into_tensor(
        full, sharded_.detach().to(device(), /*non_blocking=*/false, /*copy=*/offload_));
  }
  return full.narrow(0, 0, numel_);
}

}  // namespace fsdp
