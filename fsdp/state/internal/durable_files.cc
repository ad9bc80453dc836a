#include "fsdp/state/internal/durable_files.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>

#include "fsdp/formats/atomic_file.h"

namespace fsdp::state_internal {

namespace fs = std::filesystem;

namespace {

std::string bytes_text(int64_t bytes) {
  return absl::StrFormat("%d bytes (%.1f MB)", bytes, bytes / 1e6);
}

}  // namespace

std::string errno_text() { return std::strerror(errno); }

std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

std::string space_note(const fs::path& dir, int64_t needed) {
  struct statvfs stats = {};
  const std::string free =
      ::statvfs(dir.c_str(), &stats) == 0
          ? bytes_text(static_cast<int64_t>(stats.f_bavail) * static_cast<int64_t>(stats.f_frsize))
          : "an unknown amount (" + errno_text() + ")";
  return absl::StrCat("the checkpoint needs at least ", bytes_text(needed), ", ", free,
                      " is free on the file system of '", dir.string(),
                      "'; its partial directory was removed: free space (or save elsewhere) "
                      "and save again");
}

bool is_partial_name(const std::string& name) {
  return absl::StartsWith(name, ".") && absl::StrContains(name, ".partial-");
}

void remove_partial(const fs::path& partial) {
  std::error_code error;
  for (int attempt = 0; attempt < 10 && fs::exists(partial, error); ++attempt) {
    fs::remove_all(partial, error);
  }
}

void publish(const fs::path& partial, const fs::path& dir) {
  if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, dir.c_str(), RENAME_NOREPLACE) != 0) {
    TORCH_CHECK(errno == EEXIST || errno == ENOTEMPTY, "cannot publish checkpoint '", dir.string(),
                "': ", errno_text());
    TORCH_CHECK(::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0,
                "cannot replace checkpoint '", dir.string(), "': ", errno_text());
    fs::remove_all(partial);  // now the previous checkpoint
  }
  fsync_directory(dir.parent_path().string());
}

fs::path partial_directory(const fs::path& target, Communicator& comm,
                           const at::TensorOptions& on_device) {
  static std::atomic<int64_t> saves{0};
  at::Tensor token =
      at::scalar_tensor(int64_t{getpid()} << 24 | (saves++ & 0xffffff), on_device).reshape({1});
  comm.broadcast(token, /*root=*/0);
  return target.parent_path() /
         absl::StrCat(".", target.filename().string(), ".partial-", token.item<int64_t>());
}

}  // namespace fsdp::state_internal
