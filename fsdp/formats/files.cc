#include "fsdp/formats/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

std::string errno_text() { return std::strerror(errno); }

// What a file that is not a regular one is, for messages.
const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void check_regular(const struct stat& st, const std::string& path, std::string_view what) {
  TORCH_CHECK(S_ISREG(st.st_mode), "'", path, "' is ", file_type_name(st.st_mode), "; ", what,
              " must be a regular file (or a symlink to one)");
}

}  // namespace

// Note [Regular files only]
// A reader that opens a FIFO blocks until some process writes to it, and one that reads
// /dev/zero (or any character device) never reaches the end: both turn a hostile path
// into a hang or an out-of-memory kill. So the path is stat'ed (following symlinks)
// before it is opened, which never opens a device, and the descriptor is fstat'ed after
// an O_NONBLOCK open, which cannot block even if a FIFO was swapped in meanwhile (the
// flag is cleared once the descriptor is known to be a regular file). The
// size taken from that fstat bounds every read: a length or offset from the file's own
// content is compared with it before any buffer is allocated.
ReadableFile ReadableFile::open(const std::string& path, std::string_view what) {
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "cannot open ", what, " '", path,
              "': ", errno_text());
  check_regular(st, path, what);
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  TORCH_CHECK(raw >= 0, "cannot open ", what, " '", path, "': ", errno_text());
  auto fd = std::shared_ptr<const int>(new int(raw), [](const int* p) {
    ::close(*p);
    delete p;
  });
  TORCH_CHECK(::fstat(raw, &st) == 0, "cannot stat ", what, " '", path, "': ", errno_text());
  check_regular(st, path, what);
  // A regular file: back to ordinary (blocking) reads.
  const int flags = ::fcntl(raw, F_GETFL);
  TORCH_CHECK(flags >= 0 && ::fcntl(raw, F_SETFL, flags & ~O_NONBLOCK) == 0, "cannot set up ", what,
              " '", path, "': ", errno_text());
  return ReadableFile(path, std::string(what), std::move(fd), static_cast<int64_t>(st.st_size));
}

ReadableFile::ReadableFile(std::string path, std::string what, std::shared_ptr<const int> fd,
                           int64_t size)
    : path_(std::move(path)), what_(std::move(what)), fd_(std::move(fd)), size_(size) {}

void ReadableFile::read_into(char* out, int64_t offset, int64_t length) const {
  TORCH_CHECK(offset >= 0 && length >= 0 && offset <= size_ && length <= size_ - offset, what_,
              " '", path_, "' has ", size_, " bytes; bytes [", offset, ", ", offset + length,
              ") were asked for: the file is truncated or does not belong with the files "
              "that point into it");
  while (length > 0) {
    const ssize_t n = ::pread(*fd_, out, static_cast<size_t>(length), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "reading ", what_, " '", path_, "' at byte ", offset,
                " failed: ", errno_text());
    TORCH_CHECK(n > 0, what_, " '", path_, "' is cut short at byte ", offset,
                ": the file shrank after it was opened");
    out += n;
    offset += n;
    length -= n;
  }
}

std::string ReadableFile::read(int64_t offset, int64_t length) const {
  std::string bytes;
  if (offset >= 0 && length >= 0 && offset <= size_ && length <= size_ - offset) {
    bytes.resize(static_cast<size_t>(length));
  }
  read_into(bytes.data(), offset, length);  // checks the range first
  return bytes;
}

std::string read_regular_file(const std::string& path, std::string_view what, int64_t max_bytes) {
  const ReadableFile file = ReadableFile::open(path, what);
  TORCH_CHECK(file.size() <= max_bytes, what, " '", path, "' has ", file.size(),
              " bytes, more than the ", max_bytes, " fsdp reads for it; it is not ", what,
              " or is damaged");
  return file.read(0, file.size());
}

}  // namespace fsdp
