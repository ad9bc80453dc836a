// libFuzzer target for the safetensors reader (safetensors.h): the input is a whole file.
// It is parsed as a header, then opened through a memory file and every tensor it lists
// is read whole and by a range. Every input must end in a value or a c10::Error; anything
// else (a crash, a sanitizer report, a read out of bounds, a hang) is a bug. Run with
// tools/fuzz.sh.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

#include "fsdp/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    fsdp::parse_safetensors_header(bytes, size, "fuzz input");
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  const int fd = ::memfd_create("safetensors_fuzz", MFD_CLOEXEC);
  if (fd < 0 || ::write(fd, data, size) != static_cast<ssize_t>(size)) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  try {
    const auto file = fsdp::SafetensorsFile::open("/proc/self/fd/" + std::to_string(fd));
    for (const fsdp::SafetensorsTensorInfo& t : file.header().tensors) {
      if (t.nbytes > (int64_t{1} << 20)) continue;  // keep each run small
      file.read(t.name);
      if (t.numel() > 1) file.read_range(t.name, 1, t.numel() - 1);
    }
  } catch (const c10::Error&) {
  }
  ::close(fd);
  return 0;
}
