// libFuzzer target for the pickle reader (pickle.h): the input is a whole pickle, read
// with the classes of Distributed Checkpoint metadata allowed and a persistent-id hook,
// then written back when the writer takes it. Every input must end in a value or a
// c10::Error; anything else (a crash, a sanitizer report, a leak, a hang) is a bug. Run
// with tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

#include "fsdp/formats/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::PickleHooks hooks;
  hooks.allow_global = [](const std::string& name) {
    return name.rfind("torch.", 0) == 0 || name == "collections.OrderedDict";
  };
  hooks.persistent_load = [](const fsdp::PickleValuePtr& pid) { return pid; };
  try {
    const fsdp::PickleValuePtr value = fsdp::read_pickle(
        std::string_view(reinterpret_cast<const char*>(data), size), hooks, "fuzz input");
    fsdp::write_pickle(*value);
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  return 0;
}
