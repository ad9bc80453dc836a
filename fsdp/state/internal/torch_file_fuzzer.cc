// libFuzzer target for the checkpoint reader (internal/torch_file.h): the input is the
// pickle of an archive that also holds one 64-byte storage record "data/0", so the
// fuzzer spends its time in the unpickler rather than in the zip reader. Every input
// must end in a value or a c10::Error; anything else (a crash, a sanitizer report, a
// hang) is a bug. Run with tools/fuzz.sh.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include "fsdp/state/internal/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string archive;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
      archive.append(static_cast<const char*>(bytes), n);
      return n;
    });
    writer.writeRecord("data.pkl", data, size);
    const std::array<char, 64> storage{};
    writer.writeRecord("data/0", storage.data(), storage.size());
    writer.writeEndOfFile();
  }
  try {
    fsdp::state_internal::read_torch_file(archive, "fuzz input");
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  return 0;
}
