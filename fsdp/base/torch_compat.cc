#include "fsdp/base/torch_compat.h"

#include <cstring>
#include <utility>

#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

namespace fsdp::compat {

void resize_cpu_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  at::native::resize_bytes_cpu(storage, bytes);
}

void materialize_meta_tensor(const at::Tensor& meta, const at::Tensor& value) {
  TORCH_CHECK(meta.defined() && meta.is_meta() && value.defined() && !value.is_meta(),
              "materialize_meta_tensor: expected a meta tensor and a tensor with storage, got ",
              meta.defined() ? meta.device().str() : "undefined", " and ",
              value.defined() ? value.device().str() : "undefined");
  // set_data's own step, less its check that both tensors have one backend.
  meta.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
}

void queue_end_of_backward_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

std::vector<char> save_torch_archive(const c10::IValue& value) {
  // torch::jit::pickle_save, less the type tags (restore_type_tag) that torch.load's
  // weights_only unpickler refuses.
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    const char* begin = static_cast<const char*>(bytes);
    archive.insert(archive.end(), begin, begin + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace fsdp::compat
