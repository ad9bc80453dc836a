#include "fsdp/core/device_handle.h"

#include <unistd.h>

#include <fstream>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

class CpuEvent : public DeviceEvent {
 public:
  bool query() const override { return true; }
  void synchronize() const override {}
};

// MemAvailable of /proc/meminfo ("MemAvailable:   123456 kB"), else free physical pages.
int64_t available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

// CPU ops run on the calling thread, in order: there is nothing to overlap or order,
// so streams are one placeholder and events are no-ops.
class CpuDeviceHandle : public DeviceHandle {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }

  void free_storage(const at::Tensor& tensor) override {
    check_device(tensor, "free_storage");
    compat::resize_cpu_storage_bytes(tensor.storage().unsafeGetStorageImpl(), 0);
  }

  void reallocate_storage(const at::Tensor& tensor) override {
    check_device(tensor, "reallocate_storage");
    compat::resize_cpu_storage_bytes(
        tensor.storage().unsafeGetStorageImpl(),
        (tensor.storage_offset() + tensor.numel()) * tensor.element_size());
  }

  int64_t memory_allocated() const override { return fsdp::memory_allocated(tag()); }
  int64_t max_memory_allocated() const override { return fsdp::max_memory_allocated(tag()); }
  void reset_peak_memory_stats() override { fsdp::reset_peak_memory_stats(tag()); }
  int64_t memory_free() const override { return available_bytes(); }

  void synchronize() override {}

  c10::Stream current_stream() const override {
    return c10::Stream(c10::Stream::DEFAULT, device());
  }
  c10::Stream side_stream(const std::string& /*name*/) override { return current_stream(); }
  std::unique_ptr<DeviceEvent> record_event(c10::Stream stream) override {
    check_stream(stream);
    return std::make_unique<CpuEvent>();
  }
  void wait_event(c10::Stream stream, const DeviceEvent& event) override {
    check_stream(stream);
    TORCH_CHECK(dynamic_cast<const CpuEvent*>(&event) != nullptr,
                "DeviceHandle(cpu)::wait_event: the event was not recorded by a CPU handle");
  }

 private:
  // The calling thread's memory tag (a rank as a thread), else the whole process.
  static int tag() {
    const int tag = current_memory_tag();
    return tag == kUntagged ? kWholeProcess : tag;
  }
  void check_device(const at::Tensor& tensor, const char* what) const {
    TORCH_CHECK(tensor.defined() && tensor.device().type() == c10::kCPU,
                "DeviceHandle(cpu)::", what, ": expected a defined CPU tensor, got ",
                tensor.defined() ? tensor.device().str() : std::string("an undefined tensor"));
  }
  void check_stream(c10::Stream stream) const {
    TORCH_CHECK(stream.device_type() == c10::kCPU,
                "DeviceHandle(cpu): expected a CPU stream, got one of ", stream.device());
  }
};

struct Registry {
  std::mutex mutex;
  absl::flat_hash_map<c10::DeviceType, DeviceHandleFactory> factories;
};

Registry& registry() {
  static Registry* r = [] {
    auto* r = new Registry;
    r->factories[c10::kCPU] = [](c10::Device) { return std::make_shared<CpuDeviceHandle>(); };
    return r;
  }();
  return *r;
}

// The target that registers each device type's handle, for the error message.
std::string target_for(c10::DeviceType type) {
  const absl::flat_hash_map<c10::DeviceType, const char*> targets = {
      {c10::kCUDA, "//fsdp/core:cuda_device_handle"}};
  auto it = targets.find(type);
  return it != targets.end() ? std::string("; link ") + it->second + " into the binary"
                             : std::string("; fsdp has no handle for this device type");
}

}  // namespace

std::shared_ptr<DeviceHandle> DeviceHandle::for_device(c10::Device device) {
  DeviceHandleFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(device.type());
    TORCH_CHECK(it != r.factories.end(), "DeviceHandle::for_device(", device,
                "): no device handle is registered for ", c10::DeviceTypeName(device.type()),
                target_for(device.type()));
    factory = it->second;
  }
  std::shared_ptr<DeviceHandle> handle = factory(device);
  TORCH_INTERNAL_ASSERT(handle != nullptr);
  return handle;
}

at::Tensor DeviceHandle::empty_host(int64_t numel, c10::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "DeviceHandle(", device(), ")::empty_host: expected numel >= 0, got ",
              numel);
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(c10::kCPU));
}

bool register_device_handle(c10::DeviceType type, DeviceHandleFactory factory) {
  TORCH_CHECK(factory != nullptr, "register_device_handle: the factory is empty");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(r.factories.emplace(type, std::move(factory)).second,
              "register_device_handle: a handle for ", c10::DeviceTypeName(type),
              " is registered already");
  return true;
}

}  // namespace fsdp
