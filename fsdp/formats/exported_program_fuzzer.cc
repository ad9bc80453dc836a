// libFuzzer target for the .pt2 reader's JSON side (exported_program.h): the input is
// model.json and model_weights_config.json joined by a NUL byte (all of it is model.json
// when there is none, with an empty weights config). Every input must end in a value or a
// c10::Error; anything else (a crash, a sanitizer report, an uncaught nlohmann exception,
// a hang) is a bug. Run with tools/fuzz.sh 30 exported_program.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <c10/util/Exception.h>

#include "fsdp/formats/exported_program.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t split = bytes.find('\0');
  const std::string_view model = bytes.substr(0, split);
  const std::string_view weights =
      split == std::string_view::npos ? std::string_view("{}") : bytes.substr(split + 1);
  try {
    const fsdp::ExportedProgramInfo info = fsdp::parse_exported_program(model, weights, "fuzz");
    for (const auto& tensor : info.parameters) (void)tensor.nbytes();
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  return 0;
}
