#include "fsdp/formats/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>

namespace fsdp {

AtomicFile::AtomicFile(std::string path)
    : path_(std::move(path)), temporary_path_(absl::StrCat(path_, ".tmp-", ::getpid())) {
  fd_ = ::open(temporary_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot create '", temporary_path_, "': ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temporary_path_.c_str());
  }
}

void AtomicFile::fail(const std::string& what, int error) {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  ::unlink(temporary_path_.c_str());
  TORCH_CHECK(false, what, ": ", std::strerror(error));
}

void AtomicFile::append(std::string_view bytes) {
  TORCH_CHECK(fd_ >= 0, "'", path_, "' is already committed (or failed); nothing can be added");
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      fail(absl::StrCat("cannot write '", temporary_path_, "'"), error);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

void AtomicFile::commit() {
  TORCH_CHECK(fd_ >= 0, "'", path_, "' is already committed (or failed)");
  const bool synced = ::fsync(fd_) == 0;
  const bool closed = synced && ::close(std::exchange(fd_, -1)) == 0;
  if (!closed) {
    const int error = errno;
    fail(absl::StrCat("cannot write '", temporary_path_, "'"), error);
  }
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    fail(absl::StrCat("cannot rename '", temporary_path_, "' to '", path_, "'"), error);
  }
  fsync_directory(std::filesystem::path(path_).parent_path().string());
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  AtomicFile file(path);
  file.append(bytes);
  file.commit();
}

void fsync_directory(const std::string& dir) {
  const char* name = dir.empty() ? "." : dir.c_str();
  const int fd = ::open(name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open the directory '", name, "' to sync it: ", std::strerror(errno));
  const bool synced = ::fsync(fd) == 0 || errno == EINVAL;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(synced, "cannot sync the directory '", name, "': ", std::strerror(error));
}

}  // namespace fsdp
