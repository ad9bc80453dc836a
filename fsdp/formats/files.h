// Opening files that may have been written by anyone (a downloaded checkpoint, a model
// folder, a plan input): every reader in fsdp opens its inputs here, so a path that
// names a device (/dev/zero), a FIFO, a socket or a directory is refused by name before
// a single byte is read, and every read is checked against the bytes the file has.
// A symlink to a regular file is fine (the Hugging Face cache is made of them).
//
//   fsdp::ReadableFile f = fsdp::ReadableFile::open("/ckpt/.metadata", "DCP metadata");
//   std::string head = f.read(0, 16);                  // bytes [0, 16), or throws
//   std::string all = fsdp::read_regular_file(path, "config.json", fsdp::kMaxJsonBytes);
//
// Errors: c10::Error naming the path and what is wrong (missing, not a regular file and
// what it is instead, larger than the caller's limit, a read past the end, an I/O error).
// Threading: a ReadableFile may be read from several threads at once (pread only).
// PyTorch counterpart: none (torch.load opens whatever path it is given).
#ifndef FSDP_FORMATS_FILES_H_
#define FSDP_FORMATS_FILES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace fsdp {

// A regular file opened read-only; copies share the descriptor (closed with the last).
class ReadableFile {
 public:
  // Opens `path`; `what` says what the file is for ("DCP metadata", "config.json") in
  // messages. Refuses anything but a regular file (after following symlinks) before
  // opening it, and again on the opened descriptor (opened non-blocking, so a FIFO
  // swapped in between cannot hang the open).
  static ReadableFile open(const std::string& path, std::string_view what);

  const std::string& path() const { return path_; }
  int fd() const { return *fd_; }
  // The file's size in bytes when it was opened.
  int64_t size() const { return size_; }

  // Bytes [offset, offset + length) into `out`: checked against size() before any read;
  // a file that shrank since it was opened is an error.
  void read_into(char* out, int64_t offset, int64_t length) const;
  // The same as a new string (allocated only after the check).
  std::string read(int64_t offset, int64_t length) const;

 private:
  ReadableFile(std::string path, std::string what, std::shared_ptr<const int> fd, int64_t size);
  std::string path_;
  std::string what_;
  std::shared_ptr<const int> fd_;
  int64_t size_ = 0;
};

// The most bytes fsdp reads of a checkpoint's metadata file (a Distributed Checkpoint's
// .metadata, an fsdp checkpoint's metadata.pt), refused before reading: 1 GiB, far above
// the metadata of a real job (some hundred bytes a chunk) and below what would exhaust a
// host's memory.
constexpr int64_t kMaxMetadataBytes = int64_t{1} << 30;

// The whole of the regular file `path` (see ReadableFile::open), refused before reading
// when it is larger than `max_bytes`.
std::string read_regular_file(const std::string& path, std::string_view what,
                              int64_t max_bytes = INT64_MAX);

}  // namespace fsdp

#endif  // FSDP_FORMATS_FILES_H_
