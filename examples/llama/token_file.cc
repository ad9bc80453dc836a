#include "examples/llama/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace fsdp::models {
namespace {

constexpr int64_t kBlockBytes = int64_t{1} << 20;

// Reads `count` bytes at `offset` of `fd` into `out`; throws naming `path` if the file
// ends first or the read fails.
void read_at(int fd, const std::string& path, int64_t offset, int64_t count, unsigned char* out) {
  int64_t done = 0;
  while (done < count) {
    const ssize_t got = ::pread(fd, out + done, static_cast<size_t>(count - done), offset + done);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, "cannot read token file '", path, "': ", std::strerror(errno));
    TORCH_CHECK(got > 0, "token file '", path, "' ended at byte ", offset + done, " where ",
                offset + count, " were expected; was it changed while training?");
    done += got;
  }
}

// The little-endian id of `bytes` bytes at `p`.
int64_t id_at(const unsigned char* p, int64_t bytes) {
  uint64_t id = 0;
  for (int64_t b = bytes - 1; b >= 0; --b) id = (id << 8) | p[b];
  return static_cast<int64_t>(id);
}

}  // namespace

TokenFile::TokenFile(const std::string& path, int64_t bytes_per_id, int64_t vocab_size)
    : path_(path), bytes_per_id_(bytes_per_id), vocab_size_(vocab_size) {
  TORCH_CHECK(bytes_per_id == 2 || bytes_per_id == 4,
              "TokenFile: expected 2- or 4-byte token ids, got ", bytes_per_id);
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  TORCH_CHECK(fd >= 0, "cannot open token file '", path, "': ", std::strerror(errno));
  fd_ = std::shared_ptr<const int>(new int(fd), [](const int* f) {
    ::close(*f);
    delete f;
  });
  struct stat info {};
  TORCH_CHECK(::fstat(fd, &info) == 0 && S_ISREG(info.st_mode), "token file '", path,
              "': expected a regular file");
  TORCH_CHECK(info.st_size % bytes_per_id == 0, "token file '", path, "': ", info.st_size,
              " bytes is not a whole number of ", bytes_per_id,
              "-byte token ids; check --data_dtype");
  size_ = info.st_size / bytes_per_id;
  std::vector<unsigned char> block(static_cast<size_t>(std::min(kBlockBytes, info.st_size)));
  for (int64_t first = 0; first < size_;) {
    const int64_t count = std::min(size_ - first, kBlockBytes / bytes_per_id);
    read_at(fd, path, first * bytes_per_id, count * bytes_per_id, block.data());
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = id_at(block.data() + i * bytes_per_id, bytes_per_id);
      TORCH_CHECK(id < vocab_size, "token file '", path, "': token ", first + i, " is ", id,
                  ", not below the model's vocab_size ", vocab_size,
                  "; was it made with another tokenizer, or with the other --data_dtype?");
    }
    first += count;
  }
}

std::pair<at::Tensor, at::Tensor> TokenFile::windows(const at::Tensor& starts,
                                                     int64_t context) const {
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong,
              "TokenFile::windows: expected int64 starts [n], got ", starts.scalar_type(), " ",
              starts.sizes());
  TORCH_CHECK(context >= 1, "TokenFile::windows: expected a context of 1 or more, got ", context);
  const at::Tensor at_cpu = starts.cpu().contiguous();
  const int64_t n = at_cpu.numel();
  const int64_t* start = at_cpu.data_ptr<int64_t>();
  at::Tensor chunk = at::empty({n, context + 1}, at::kLong);
  int64_t* out = chunk.data_ptr<int64_t>();
  std::vector<unsigned char> raw(static_cast<size_t>((context + 1) * bytes_per_id_));
  for (int64_t w = 0; w < n; ++w) {
    TORCH_CHECK(start[w] >= 0 && start[w] <= size_ - context - 1, "token file '", path_,
                "': a window of ", context + 1, " tokens at ", start[w], " does not lie in its ",
                size_, " tokens");
    read_at(*fd_, path_, start[w] * bytes_per_id_, static_cast<int64_t>(raw.size()), raw.data());
    for (int64_t i = 0; i <= context; ++i) {
      const int64_t id = id_at(raw.data() + i * bytes_per_id_, bytes_per_id_);
      TORCH_CHECK(id < vocab_size_, "token file '", path_, "': token ", start[w] + i, " is now ",
                  id, ", not below vocab_size ", vocab_size_, "; was it changed while training?");
      out[w * (context + 1) + i] = id;
    }
  }
  return {chunk.narrow(1, 0, context).contiguous(), chunk.narrow(1, 1, context).contiguous()};
}

}  // namespace fsdp::models
