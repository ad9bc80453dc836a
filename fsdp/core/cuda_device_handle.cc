#include "fsdp/core/cuda_device_handle.h"

#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "fsdp/base/torch_compat_cuda.h"

namespace fsdp {
namespace {

class CudaEvent : public DeviceEvent {
 public:
  bool query() const override { return event_.query(); }
  void synchronize() const override { event_.synchronize(); }

  void record(const c10::cuda::CUDAStream& stream) { event_.record(stream); }
  // Makes `stream` wait for the event (cudaStreamWaitEvent); the event is unchanged.
  void block(const c10::cuda::CUDAStream& stream) const { event_.block(stream); }

 private:
  mutable c10::cuda::CUDAEvent event_;  // cudaEventDisableTiming; block() is not const
};

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

class CudaDeviceHandle : public DeviceHandle {
 public:
  explicit CudaDeviceHandle(c10::Device device) : device_(device) {}

  c10::Device device() const override { return device_; }

  void free_storage(const at::Tensor& tensor) override {
    check_tensor(tensor, "free_storage");
    c10::cuda::CUDAGuard guard(device_.index());
    compat::resize_cuda_storage_bytes(tensor.storage().unsafeGetStorageImpl(), 0);
  }

  void reallocate_storage(const at::Tensor& tensor) override {
    check_tensor(tensor, "reallocate_storage");
    c10::cuda::CUDAGuard guard(device_.index());
    compat::resize_cuda_storage_bytes(
        tensor.storage().unsafeGetStorageImpl(),
        (tensor.storage_offset() + tensor.numel()) * tensor.element_size());
  }

  int64_t memory_allocated() const override { return stats().allocated_bytes[kAggregate].current; }
  int64_t max_memory_allocated() const override { return stats().allocated_bytes[kAggregate].peak; }
  void reset_peak_memory_stats() override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
  }
  int64_t memory_free() const override {
    c10::cuda::CUDAGuard guard(device_.index());
    size_t free = 0;
    size_t total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const c10::CachingDeviceAllocator::DeviceStats s = stats();
    return static_cast<int64_t>(free) + s.reserved_bytes[kAggregate].current -
           s.allocated_bytes[kAggregate].current;
  }

  void synchronize() override {
    c10::cuda::CUDAGuard guard(device_.index());
    c10::cuda::device_synchronize();
  }

  c10::Stream current_stream() const override {
    return c10::cuda::getCurrentCUDAStream(device_.index()).unwrap();
  }

  c10::Stream side_stream(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = side_streams_.find(name);
    if (it == side_streams_.end()) {
      it = side_streams_
               .emplace(
                   name,
                   c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()).unwrap())
               .first;
    }
    return it->second;
  }

  std::unique_ptr<DeviceEvent> record_event(c10::Stream stream) override {
    auto event = std::make_unique<CudaEvent>();
    event->record(cuda_stream(stream, "record_event"));
    return event;
  }

  // Pinned through LibTorch's caching host allocator (pinned_memory(true), as
  // tensor.pin_memory()): a block is reused only after the copies recorded on it
  // completed, and copies from and to it with non_blocking=true are asynchronous.
  at::Tensor empty_host(int64_t numel, c10::ScalarType dtype) override {
    TORCH_CHECK(numel >= 0, "DeviceHandle(", device_, ")::empty_host: expected numel >= 0, got ",
                numel);
    return at::empty({numel},
                     at::TensorOptions().dtype(dtype).device(c10::kCPU).pinned_memory(true));
  }

  void wait_event(c10::Stream stream, const DeviceEvent& event) override {
    const auto* cuda_event = dynamic_cast<const CudaEvent*>(&event);
    TORCH_CHECK(cuda_event != nullptr, "DeviceHandle(", device_,
                ")::wait_event: the event was not recorded by a CUDA handle");
    cuda_event->block(cuda_stream(stream, "wait_event"));
  }

 private:
  c10::Device device_;
  std::mutex mutex_;
  absl::flat_hash_map<std::string, c10::Stream> side_streams_;

  c10::CachingDeviceAllocator::DeviceStats stats() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
  }
  void check_tensor(const at::Tensor& tensor, const char* what) const {
    TORCH_CHECK(tensor.defined() && tensor.device() == device_, "DeviceHandle(", device_,
                ")::", what, ": expected a defined tensor on ", device_, ", got ",
                tensor.defined() ? tensor.device().str() : std::string("an undefined tensor"));
  }
  c10::cuda::CUDAStream cuda_stream(c10::Stream stream, const char* what) const {
    TORCH_CHECK(stream.device() == device_, "DeviceHandle(", device_, ")::", what,
                ": expected a stream of ", device_, ", got one of ", stream.device());
    return c10::cuda::CUDAStream(stream);
  }
};

}  // namespace

std::shared_ptr<DeviceHandle> make_cuda_device_handle(c10::Device device) {
  TORCH_CHECK(device.is_cuda(), "make_cuda_device_handle: expected a CUDA device, got ", device);
  compat::load_torch_cuda();  // pinned host tensors and CUDA kernels need it
  const int count = c10::cuda::device_count();
  TORCH_CHECK(count > 0, "DeviceHandle for ", device,
              ": no CUDA device is available (c10::cuda::device_count() is 0)");
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < count, "DeviceHandle for ", device, ": device index ",
              int(index), " is out of range; c10::cuda::device_count() is ", count);
  return std::make_shared<CudaDeviceHandle>(c10::Device(c10::kCUDA, index));
}

namespace {
// Static registration: the target is alwayslink, so this runs in every binary linking it.
const bool registered = register_device_handle(c10::kCUDA, make_cuda_device_handle);
}  // namespace

}  // namespace fsdp
