// The device handle: every device-specific operation the FSDP runtime needs, behind one
// interface, so that fsdp/core does not branch on the device type (PyTorch:
// torch.distributed.fsdp._common_utils._FSDPDeviceHandle, which forwards to the
// torch.cuda-like module of the compute device).
//
//   std::shared_ptr<fsdp::DeviceHandle> device = fsdp::DeviceHandle::for_device(at::kCPU);
//   at::Tensor flat = at::empty({1024});
//   device->free_storage(flat);        // flat.storage().nbytes() == 0, flat still valid
//   device->reallocate_storage(flat);  // 4096 bytes again (values undefined)
//   c10::Stream unshard = device->side_stream("unshard");
//   auto ready = device->record_event(unshard);
//   device->wait_event(device->current_stream(), *ready);  // compute waits for it
//
// Handles. for_device(device) makes a new handle for `device`; the handle's side streams
// are its own (one FSDP root per rank holds one handle, as PyTorch keeps one per FSDP
// state), while memory statistics are the device's, shared by every handle of it.
// Registered device types:
// - CPU (always, this target): storage is resized in place through c10's CPU
//   allocator; memory statistics are the tracking allocator's (tracking_allocator.h:
//   they count only while a MemoryTracker is installed); streams are one placeholder
//   stream per device (c10::Stream::DEFAULT) and events are no-ops, since CPU ops run
//   synchronously on the calling thread.
// - CUDA: only when //fsdp/core:cuda_device_handle is linked (cuda_device_handle.h; it
//   registers itself when its object file is loaded, and loads libtorch_cuda only when
//   the first CUDA handle is made, so CPU runs never map it). Without it,
//   for_device(cuda:N) throws a c10::Error that says to link it.
//
// Shapes and dtypes: storage calls take a tensor of any dtype and shape whose storage
// belongs to it alone (a flat parameter: 1-D, storage offset 0); other tensors viewing the
// same storage stay valid across free and reallocate (Note [Freeing the unsharded flat
// parameter] in flat_param.cc). Every tensor passed must be on device(). Storage is
// allocated and freed on the calling thread's current stream; FlatParamHandle frees a
// buffer only after the collectives using it completed, so no record_stream is needed
// (Note [Streams and freeing unsharded memory] in flat_param.cc).
//
// Threading: a handle may be used from several threads, except that two threads must not
// free or reallocate one storage at the same time. Streams and events follow the device
// runtime's rules (CUDA: the calling thread's current stream is per thread).
// Errors: c10::Error, e.g. for a tensor on another device. A new side-stream name is not
// an error: side streams are made on first use.
#ifndef FSDP_CORE_DEVICE_HANDLE_H_
#define FSDP_CORE_DEVICE_HANDLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace fsdp {

// A point in a stream's work, recorded by DeviceHandle::record_event (PyTorch:
// torch.cuda.Event). Opaque: only the handle that recorded it may use it.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // Whether the work before the event has finished (PyTorch: Event.query). CPU: true.
  virtual bool query() const = 0;
  // Blocks the calling thread until it has (PyTorch: Event.synchronize). CPU: returns.
  virtual void synchronize() const = 0;
};

// The names of the side streams the runtime uses (PyTorch FSDP1's _unshard_stream and
// _post_backward_stream).
inline constexpr const char* kUnshardStream = "unshard";
inline constexpr const char* kPostBackwardStream = "post_backward";
// The side stream that copies CPU-offloaded shards to the device (PyTorch FSDP1's
// _pre_unshard_stream; FSDP2's all-gather copy-in stream).
inline constexpr const char* kOffloadCopyStream = "offload_copy";

class DeviceHandle {
 public:
  virtual ~DeviceHandle() = default;
  DeviceHandle(const DeviceHandle&) = delete;
  DeviceHandle& operator=(const DeviceHandle&) = delete;

  // A new handle for `device` (PyTorch: _FSDPDeviceHandle.from_device). A CUDA device
  // without an index means the current CUDA device. Throws c10::Error for a device type
  // whose handle is not linked into the binary, naming the target to link.
  static std::shared_ptr<DeviceHandle> for_device(c10::Device device);

  // The compute device, with its index (PyTorch: FSDP's compute_device).
  virtual c10::Device device() const = 0;

  // --- Storage (PyTorch: _free_storage / _alloc_storage in torch/distributed/utils.py,
  // tensor.untyped_storage().resize_(n)).
  // Resizes `tensor`'s storage to 0 bytes: its memory goes back to the allocator (CUDA:
  // the caching allocator). `tensor` and its views keep their sizes and may not be read
  // until reallocate_storage.
  virtual void free_storage(const at::Tensor& tensor) = 0;
  // Resizes `tensor`'s storage to (storage_offset + numel) x element_size bytes, the
  // bytes it needs (allocating anew, also if it already had them); the contents are
  // undefined.
  virtual void reallocate_storage(const at::Tensor& tensor) = 0;

  // --- Memory statistics of the device, in bytes as the allocator counts them
  // (PyTorch: torch.cuda.memory_allocated / max_memory_allocated /
  // reset_peak_memory_stats). CPU: the tracking allocator's figures for the calling
  // thread's memory tag if it has one (ranks as threads), else the whole process.
  virtual int64_t memory_allocated() const = 0;
  virtual int64_t max_memory_allocated() const = 0;
  virtual void reset_peak_memory_stats() = 0;
  // Bytes an allocation on the device could still get now, for error messages (an
  // estimate: another process may take them, fragmentation may deny them). CUDA: the
  // driver's free bytes (cudaMemGetInfo, PyTorch: torch.cuda.mem_get_info()[0]) plus the
  // caching allocator's reserved-but-unallocated bytes of the device (its
  // reserved_bytes - allocated_bytes), which it releases before failing. CPU: MemAvailable
  // of /proc/meminfo (the kernel's estimate of memory available without swapping), or
  // free physical pages x page size (sysconf) where that file is missing. Whole device,
  // not the calling thread's memory tag.
  virtual int64_t memory_free() const = 0;

  // Blocks until every stream of the device has finished its work (PyTorch:
  // torch.cuda.synchronize). CPU: returns at once.
  virtual void synchronize() = 0;

  // --- Streams and events (PyTorch: torch.cuda.current_stream, torch.cuda.Stream,
  // Stream.record_event, Stream.wait_event). CPU: one placeholder stream, no-op events.
  // The calling thread's current stream of device() (where its ops run).
  virtual c10::Stream current_stream() const = 0;
  // This handle's side stream called `name` (e.g. kUnshardStream), made on first use and
  // the same stream for every later call with that name. CUDA: a pool stream, not the
  // current one.
  virtual c10::Stream side_stream(const std::string& name) = 0;
  // Records an event on `stream` (of device()): it completes when the work queued on the
  // stream so far has finished.
  virtual std::unique_ptr<DeviceEvent> record_event(c10::Stream stream) = 0;
  // Makes `stream` wait for `event` before running work queued after this call; the
  // calling thread does not block. `event` must come from this handle's record_event.
  virtual void wait_event(c10::Stream stream, const DeviceEvent& event) = 0;

  // --- Host memory for CPU offload (FullyShardedDataParallelOptions::cpu_offload).
  // A new, uninitialised 1-D host (CPU) tensor of `numel` elements of `dtype`, for data
  // that lives on the host and is copied to and from this device. CUDA: page-locked
  // (pinned, from LibTorch's caching host allocator, as tensor.pin_memory()), so copies
  // with non_blocking=true run asynchronously on a stream. CPU (this default): an ordinary
  // allocation, separate from every device tensor. Errors: c10::Error for numel < 0.
  virtual at::Tensor empty_host(int64_t numel, c10::ScalarType dtype);

 protected:
  DeviceHandle() = default;
};

// Makes for_device find handles for `type` (one factory per type; a second registration
// of a type throws c10::Error). The factory gets the device as passed to for_device. For
// handle targets' static registration (alwayslink); returns true.
using DeviceHandleFactory = std::function<std::shared_ptr<DeviceHandle>(c10::Device)>;
bool register_device_handle(c10::DeviceType type, DeviceHandleFactory factory);

}  // namespace fsdp

#endif  // FSDP_CORE_DEVICE_HANDLE_H_
