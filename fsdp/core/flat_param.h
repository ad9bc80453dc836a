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
// Mixed precision (FlatParamOptions::param_dtype): the shard stays in the parameters'
// dtype (the optimizer's full-precision master copy); unshard() all-gathers a copy cast
// to param_dtype, so the original parameters hold low-precision values only while
// unsharded (forward and backward); unshard_full_precision() gathers the master values
// instead (summon_full_params). Gradients are reduced in reduce_dtype.
//
// Layout (REFERENCE §3). The flat parameter is the concatenation of the parameters'
// elements in the given order (shared parameters must be passed once), padded with zeros
// to shard_numel x world_size elements; rank r owns elements [r x shard_numel,
// (r + 1) x shard_numel). After construction the original parameters are views into the
// unsharded flat buffer (set_data), so modules keep using them unchanged; the handle
// starts resharded (that buffer's memory freed), so read them after unshard().
//
// NO_SHARD keeps the whole (unpadded) flat parameter on every rank: the sharded flat
// parameter is the flat buffer itself, unshard/reshard do nothing (with mixed precision
// or offload_params: they make and free the low-precision or device copy), and gradients
// are all-reduced. The HYBRID
// strategies shard over the handle's communicator (a shard group) and all-reduce the
// reduced gradient shard over FlatParamOptions::replicate_communicator.
//
// CPU offload (FlatParamOptions::offload_params): the shard, its gradient and so the
// optimizer state live in host memory (pinned when the device is CUDA); unshard() copies
// the shard to the device on a side stream before its all-gather, and the reduced
// gradient shard is copied back to the host (Note [CPU offload] in flat_param.cc).
//
// Threading: a handle is used by one thread (its rank's); collectives go through its
// communicator in call order. Streams: buffers are allocated on the calling thread's current
// (compute) stream; the collectives run on the communicator's streams, and the handle waits
// (on the host) for each collective before freeing a buffer it touches (Note [Streams and
// freeing unsharded memory] in flat_param.cc). Errors: c10::Error naming cleaned FQNs for
// bad input.
#ifndef FSDP_CORE_FLAT_PARAM_H_
#define FSDP_CORE_FLAT_PARAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/options.h"

namespace fsdp {

// Note [Gradient divide factors]
// Averaging over W ranks divides twice: by f(W) before the reduction and by W / f(W)
// after, so that neither the summands nor the sum over- or underflow in low precision
// (PyTorch: DefaultState._get_gradient_predivide_factor). f(W) = the first power of two
// k with W % k != 0 or k >= W / k. REFERENCE §6: W = 4 -> 2 and 2; W = 6 -> 4 and 1.5.
// W is the number of ranks the gradient is averaged over (every rank, for HYBRID too).
double gradient_predivide_factor(int64_t world_size);
double gradient_postdivide_factor(int64_t world_size);  // world_size / predivide

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

// Where a flat parameter's values are (PyTorch keeps this in FlatParamHandle as
// `is_sharded`, `_prefetched` and the unsharded tensors' sizes; here it is one checked
// state). Transitions, each a FlatParamHandle call:
//   kSharded   --prefetch()-->  kUnsharding  --unshard()-->  kUnsharded  --reshard()-->  kSharded
//   kSharded   --unshard()-->   kUnsharded (prefetch and wait in one)
//   kUnsharding --reshard()-->  kSharded (waits for the all-gather before freeing)
//   any state  --unshard_full_precision()-->  kUnshardedFullPrecision  --reshard()-->  kSharded
// NO_SHARD without mixed precision or offload_params stays kUnsharded: the flat buffer is
// the shard.
enum class FlatParamState {
  kSharded,                 // only the shard's memory is held
  kUnsharding,              // prefetch(): an all-gather is writing the unsharded buffer
  kUnsharded,               // the original parameters hold the full values (param_dtype)
  kUnshardedFullPrecision,  // ... the full values in the shards' dtype (summon_full_params)
};
// "SHARDED", "UNSHARDING", "UNSHARDED", "UNSHARDED_FULL_PRECISION".
const char* flat_param_state_name(FlatParamState state);

struct FlatParamOptions {
  // HYBRID strategies: the ranks holding the same shard in the other shard groups
  // (Communicator::split_hybrid's replicate_group). Required for them, unused otherwise.
  TORCH_ARG(std::shared_ptr<Communicator>, replicate_communicator);
  // dtype of the unsharded parameters in forward and backward (none: the parameters').
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype);
  // dtype gradients are reduced in (none: param_dtype if set, else the parameters').
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype);
  // Keep the reduced gradient shard in reduce_dtype instead of casting it to the
  // parameters' dtype for the optimizer.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  // The compute device's handle (device_handle.h): it frees and reallocates the unsharded
  // buffer's storage. Null: DeviceHandle::for_device of the parameters' device. Must be a
  // handle of the parameters' device.
  TORCH_ARG(std::shared_ptr<DeviceHandle>, device_handle);
  // Keep the sharded flat parameter and its gradient in host memory
  // (DeviceHandle::empty_host: pinned for CUDA) instead of on the device, so the optimizer
  // steps on the CPU and the device holds only unsharded buffers in flight. With a CPU
  // device the host copies are allocations of their own. PyTorch:
  // CPUOffload(offload_params=True). See Note [CPU offload] in flat_param.cc.
  TORCH_ARG(bool, offload_params) = false;
};

class FlatParamHandle {
 public:
  // `params`: distinct parameters (the same tensor twice is an error naming both FQNs),
  // at least one, all of one dtype and device, all trained or all frozen (requires_grad; a
  // frozen flat parameter does not require grad), contiguous or not. The dtype is floating,
  // or, for frozen parameters only, any other (stored values such as 4-bit codes packed in
  // uint8: gathered as they are, never cast; mixed precision leaves them alone; see Note
  // [Flat parameters of several dtypes] in flat_param.cc).
  // Their values
  // become the flat parameter; rank r of `comm` keeps its shard. Parameters on c10::kMeta
  // (deferred initialisation) are allowed: the handle allocates only the shard, on
  // options.device_handle's device (CPU without one), holding NaN (zeros in the padding,
  // and everywhere in a non-floating dtype)
  // until copy_into_shard writes it, and the meta parameters become views of the
  // unsharded buffer in place (see Note [Flat parameters of meta parameters] in
  // flat_param.cc). Throws c10::Error on bad input (and for a HYBRID strategy without
  // options.replicate_communicator, or a device handle of another device than the
  // parameters').
  FlatParamHandle(std::vector<NamedParam> params, std::shared_ptr<Communicator> comm,
                  ShardingStrategy strategy, const FlatParamOptions& options = {});

  int64_t numel() const { return numel_; }                // sum of the parameters' numels
  int64_t shard_numel() const { return shard_numel_; }    // ceil(numel / W); NO_SHARD: numel
  int64_t padded_numel() const { return padded_numel_; }  // shard_numel x W; NO_SHARD: numel
  int64_t padding() const { return padded_numel_ - numel_; }
  // First element of this rank's shard in the padded flat parameter: rank x shard_numel
  // (fsdp/base/shard_geometry.h); NO_SHARD: 0.
  int64_t shard_offset() const { return shard_offset_; }
  ShardingStrategy strategy() const { return strategy_; }
  // The parameters' device and its handle (FlatParamOptions::device_handle).
  c10::Device device() const { return device_->device(); }
  DeviceHandle& device_handle() const { return *device_; }
  // The ranks the flat parameter is sharded over (HYBRID: the shard group).
  Communicator& communicator() const { return *comm_; }
  // HYBRID: the replicas gradients are all-reduced over; null otherwise.
  Communicator* replicate_communicator() const { return replicate_comm_.get(); }
  // The same two, shared (a root reuses the groups of units sharded at construction).
  const std::shared_ptr<Communicator>& shared_communicator() const { return comm_; }
  const std::shared_ptr<Communicator>& shared_replicate_communicator() const {
    return replicate_comm_;
  }
  const std::vector<FlatParamInfo>& param_infos() const { return infos_; }
  // This rank's shard as ShardParamInfos.
  std::vector<ShardParamInfo> local_shard_param_infos() const;

  // The leaf the optimizer updates: 1-D, shard_numel elements, in the parameters'
  // original dtype; requires_grad unless the parameters are frozen. On device(), or on the
  // CPU with offload_params (as its grad).
  const at::Tensor& sharded_flat_param() const { return sharded_; }
  // The original parameters (views into the unsharded flat buffer), in flattening order.
  const std::vector<at::Tensor>& original_params() const { return originals_; }
  // dtype of the original parameters while unsharded for forward/backward, and of
  // gradient reduction.
  c10::ScalarType param_dtype() const { return param_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  // FlatParamOptions::keep_low_precision_grads.
  bool keep_low_precision_grads() const { return keep_low_precision_grads_; }

  // See FlatParamState for the transitions each call makes.
  FlatParamState state() const { return state_; }
  bool is_unsharded() const {
    return state_ == FlatParamState::kUnsharded ||
           state_ == FlatParamState::kUnshardedFullPrecision;
  }
  // All-gathers the shards (cast to param_dtype) into the unsharded flat buffer
  // (allocating its memory), so the original parameters hold the current full values;
  // waits for a prefetch's all-gather. No-op if already unsharded. Throws c10::Error in
  // kUnshardedFullPrecision (reshard() first), and c10::OutOfMemoryError naming the unit,
  // the bytes needed (padded_numel x the element size of param_dtype) and the bytes free
  // if the device cannot hold the unsharded buffer; the handle then stays kSharded (see
  // Note [Out of memory while unsharding] in flat_param.cc). Same for prefetch(), and
  // for unshard_full_precision() (the shards' dtype) and the reshard() that ends it.
  void unshard();
  // Starts unshard()'s all-gather without waiting for it (prefetch); the next unshard()
  // or reshard() waits. No-op unless kSharded (throws in kUnshardedFullPrecision).
  void prefetch();
  // Like unshard(), but the original parameters hold the full-precision values (the
  // shards' dtype) until reshard(): for summon_full_params. Frees a low-precision copy
  // first. Without mixed precision the same as unshard().
  void unshard_full_precision();
  // Frees the unsharded flat buffer's memory (after a pending prefetch's all-gather
  // completes): kSharded. No-op for NO_SHARD without mixed precision, or if sharded.
  void reshard();

  // Flattens the original parameters' gradients (`grads[i]` for original_params()[i];
  // an undefined tensor counts as zeros) in reduce_dtype, averages them over ranks
  // (reduce-scatter, or all-reduce for NO_SHARD; HYBRID: reduce-scatter in the shard
  // group, then all-reduce across groups; see Note [Gradient divide factors]), and adds
  // the result (cast to the shard's dtype unless keep_low_precision_grads) to
  // sharded_flat_param().grad().
  // Each gradient is released as soon as it is copied (pass them with std::move to free
  // their memory while the flat gradient fills). Same as start_reduce_grad followed by
  // finish_reduce_grad.
  void reduce_grad(std::vector<at::Tensor> grads);
  // reduce_grad in two halves, so that the collective runs while the caller computes:
  // start_reduce_grad flattens the gradients and issues the reduce-scatter (NO_SHARD:
  // all-reduce) without waiting; finish_reduce_grad waits for it, runs HYBRID's
  // all-reduce across groups, and adds the result to sharded_flat_param().grad(). Until
  // then the flat gradient (padded_numel elements of reduce_dtype) stays allocated. One
  // reduction per handle at a time: start_reduce_grad while one is pending is an error.
  void start_reduce_grad(std::vector<at::Tensor> grads);
  void finish_reduce_grad();
  // Drops a pending reduction: waits for its collective (whose buffers must outlive it),
  // then frees them, leaving sharded_flat_param().grad() as it was. For a backward pass
  // that threw (Note [A backward that did not finish] in internal/runtime.cc). No-op
  // without one. Throws the collective's error, if any, with the reduction dropped.
  void cancel_reduce_grad();
  // With offload_params: whether the shard lives in host memory (FlatParamOptions).
  bool offloads_params() const { return offload_; }
  // With offload_params, finish_reduce_grad only queues the copy of the reduced gradient
  // shard to the host (non_blocking, on the compute stream), so the host need not wait
  // in the middle of backward; this blocks until it and the last copy of the shard to the
  // device have completed, then adds that gradient to sharded_flat_param().grad(). Call
  // it before anything reads the gradient or writes the shard on the host (the optimizer
  // step): the runtime does at the end of every iteration, reduce_grad before it
  // returns. No-op without offload_params or with nothing in flight.
  void wait_for_offload();
  bool reduction_pending() const { return reduction_.input.defined(); }

  // Inside no_sync: adds the flattened gradients (as for reduce_grad) to an unsharded
  // accumulator, without communication; the next reduce_grad reduces their sum.
  void accumulate_grad(std::vector<at::Tensor> grads);
  bool has_accumulated_grad() const { return unsharded_grad_.defined(); }

  // Copies this rank's chunk of the unsharded flat buffer (edited through the original
  // parameters, e.g. in summon_full_params) back into the shard. Needs the handle
  // unsharded in full precision (unshard_full_precision(), or unshard() without mixed
  // precision).
  void write_back_shard();

  // Copies the elements of original_params()[index] that lie in this rank's shard from
  // `value`, the parameter's full value (its shape; any device and dtype, converted), into
  // sharded_flat_param(), without unsharding or communicating: how a meta-initialised
  // handle's shard is filled (FullyShardedRoot::init_parameters). Needs the handle sharded
  // (kSharded), or NO_SHARD without a separate unsharded buffer. Throws c10::Error for an
  // index out of range or another shape.
  void copy_into_shard(size_t index, const at::Tensor& value);

  // Prepends `prefix` to every parameter's FQN: for a handle made before its unit's
  // place in the model was known (EnableWrap in fully_sharded.h).
  void add_fqn_prefix(const std::string& prefix);

  // A copy of the full flat parameter (numel elements, no padding), e.g. for tests.
  at::Tensor full_flat_param();

 private:
  std::shared_ptr<Communicator> comm_;
  ShardingStrategy strategy_;
  std::shared_ptr<DeviceHandle> device_;
  std::vector<FlatParamInfo> infos_;
  std::vector<at::Tensor> originals_;
  int64_t numel_ = 0;
  int64_t shard_offset_ = 0;
  int64_t shard_numel_ = 0;
  int64_t padded_numel_ = 0;
  std::shared_ptr<Communicator> replicate_comm_;  // HYBRID only
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  bool keep_low_precision_grads_;

  bool offload_;
  bool uses_mixed_precision() const { return param_dtype_ != sharded_.scalar_type(); }
  // Whether the unsharded flat buffer is an allocation of its own (NO_SHARD otherwise
  // computes on the shard itself).
  bool separate_unsharded() const { return uses_mixed_precision() || offload_; }
  // Options of a new buffer on the compute device (the shard may be on the host).
  at::TensorOptions device_options(c10::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(device());
  }
  // Adds `shard_grad` to sharded_flat_param().grad() (or makes it the grad).
  void add_to_grad(const at::Tensor& shard_grad);
  // offload_params: the half of wait_for_offload that waits for the reduced gradient's
  // copy to the host and adds it; no-op with none in flight.
  void finish_grad_offload();
  // offload_params: the shard copied to the device (in param_dtype) on the copy stream,
  // which the compute stream then waits for; release_copied_shard drops such a copy once
  // the compute stream's work queued so far is all that reads it (Note [CPU offload]).
  at::Tensor copy_shard_to_device();
  void release_copied_shard(at::Tensor& copy);
  // Ranks the gradients are averaged over: the shard group's, times the groups (HYBRID).
  int64_t total_replicas() const;
  void use_views_of(const at::Tensor& flat);
  // The constructor's allocation for meta parameters (Note [Flat parameters of meta
  // parameters]).
  void init_from_meta(const std::vector<NamedParam>& params, bool trained);
  at::Tensor flatten_grads(std::vector<at::Tensor>& grads) const;  // releases each grad

  at::Tensor sharded_;  // the optimizer's leaf
  // padded_numel elements of param_dtype, the views' storage in forward and backward;
  // its storage is freed by reshard(). NO_SHARD without mixed precision: sharded_.
  at::Tensor unsharded_flat_;
  at::Tensor full_precision_flat_;  // unshard_full_precision()'s buffer, or undefined
  at::Tensor gather_input_;         // a prefetch's low-precision shard copy
  at::Tensor unsharded_grad_;       // no_sync accumulator, padded_numel elements, or undefined
  WorkHandle pending_;              // kUnsharding: the prefetch's all-gather
  struct Reduction {
    at::Tensor input;   // the flat gradient; undefined when no reduction is pending
    at::Tensor output;  // the reduced shard (NO_SHARD: input itself)
    WorkHandle work;    // null when nothing was sent (NO_SHARD at one rank)
  };
  Reduction reduction_;  // between start_reduce_grad and finish_reduce_grad
  // offload_params: the last copy of the shard to the device, and the reduced gradient
  // shard on its way to the host (see wait_for_offload).
  std::unique_ptr<DeviceEvent> copy_in_done_;
  struct GradOffload {
    at::Tensor host;  // undefined when none is in flight
    std::unique_ptr<DeviceEvent> done;
  };
  GradOffload grad_offload_;
  FlatParamState state_ = FlatParamState::kUnsharded;  // the constructor reshards

  // kUnsharding -> kUnsharded: waits for the prefetch's all-gather.
  void finish_all_gather();
  // Throws c10::Error naming the handle's parameters if the state is `state`.
  void check_not_in(FlatParamState state, const char* call) const;
  // DeviceHandle::reallocate_storage(unsharded_flat_) for `what` (e.g. "unsharding"),
  // rethrowing a c10::OutOfMemoryError as throw_out_of_memory's.
  void reallocate_unsharded(const char* what);
  // Throws a c10::OutOfMemoryError for a failed allocation of the unsharded flat
  // parameter in `dtype`, naming the unit, the bytes and what to do (see Note [Out of
  // memory while unsharding] in flat_param.cc).
  [[noreturn]] void throw_out_of_memory(const c10::OutOfMemoryError& error, const char* what,
                                        c10::ScalarType dtype) const;
};

}  // namespace fsdp

#endif  // FSDP_CORE_FLAT_PARAM_H_
