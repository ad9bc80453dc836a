#include "examples/llama/token_file.h"

#include <algorithm>
#include <vector>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace fsdp::models {
namespace {

constexpr int64_t kBlockBytes = int64_t{1} << 20;
constexpr char kWhat[] = "token file";

// The little-endian id of `bytes` bytes at `p`.
int64_t id_at(const char* p, int64_t bytes) {
  uint64_t id = 0;
  for (int64_t b = bytes - 1; b >= 0; --b) id = (id << 8) | static_cast<unsigned char>(p[b]);
  return static_cast<int64_t>(id);
}

}  // namespace

TokenFile::TokenFile(const std::string& path, int64_t bytes_per_id, int64_t vocab_size,
                     IdCheck check)
    : file_(ReadableFile::open(path, kWhat)), bytes_per_id_(bytes_per_id), vocab_size_(vocab_size) {
  TORCH_CHECK(bytes_per_id == 2 || bytes_per_id == 4,
              "TokenFile: expected 2- or 4-byte token ids, got ", bytes_per_id);
  TORCH_CHECK(file_.size() % bytes_per_id == 0, kWhat, " '", path, "': ", file_.size(),
              " bytes is not a whole number of ", bytes_per_id,
              "-byte token ids; check --data_dtype");
  size_ = file_.size() / bytes_per_id;
  if (check == IdCheck::kAsRead) return;
  std::vector<char> block(static_cast<size_t>(std::min(kBlockBytes, file_.size())));
  bool odd_all_zero = true, even_all_zero = true;
  for (int64_t first = 0; first < size_;) {  // blocks hold an even number of ids
    const int64_t count = std::min(size_ - first, kBlockBytes / bytes_per_id);
    file_.read_into(block.data(), first * bytes_per_id, count * bytes_per_id);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = id_at(block.data() + i * bytes_per_id, bytes_per_id);
      TORCH_CHECK(id < vocab_size, kWhat, " '", path, "': token ", first + i, " is ", id,
                  ", not below the model's vocab_size ", vocab_size,
                  "; was it made with another tokenizer, or with the other --data_dtype?");
      ((first + i) % 2 == 1 ? odd_all_zero : even_all_zero) &= id == 0;
    }
    first += count;
  }
  looks_like_4_byte_ids_ = bytes_per_id == 2 && size_ >= 64 && odd_all_zero && !even_all_zero;
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
  std::vector<char> raw(static_cast<size_t>((context + 1) * bytes_per_id_));
  for (int64_t w = 0; w < n; ++w) {
    TORCH_CHECK(start[w] >= 0 && start[w] <= size_ - context - 1, kWhat, " '", path(),
                "': a window of ", context + 1, " tokens at ", start[w], " does not lie in its ",
                size_, " tokens");
    file_.read_into(raw.data(), start[w] * bytes_per_id_, static_cast<int64_t>(raw.size()));
    for (int64_t i = 0; i <= context; ++i) {
      const int64_t id = id_at(raw.data() + i * bytes_per_id_, bytes_per_id_);
      TORCH_CHECK(id < vocab_size_, kWhat, " '", path(), "': token ", start[w] + i, " is now ", id,
                  ", not below vocab_size ", vocab_size_, "; was it changed while training?");
      out[w * (context + 1) + i] = id;
    }
  }
  return {chunk.narrow(1, 0, context).contiguous(), chunk.narrow(1, 1, context).contiguous()};
}

}  // namespace fsdp::models
