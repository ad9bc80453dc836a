#include "examples/fashion_mnist/idx.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <zlib.h>

namespace fsdp::examples {
namespace {

constexpr int64_t kChunkBytes = int64_t{1} << 20;       // per gzread call
constexpr int64_t kMaxReserveBytes = int64_t{1} << 26;  // trust a header only this far

std::string hex(uint32_t value) { return absl::StrFormat("0x%08x", value); }

uint32_t big_endian_u32(const uint8_t* bytes) {
  return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
         uint32_t{bytes[3]};
}

// A gzFile (gzip or plain bytes, zlib tells them apart) closed when it goes out of scope.
class GzReader {
 public:
  explicit GzReader(std::string path) : path_(std::move(path)) {
    errno = 0;
    file_ = gzopen(path_.c_str(), "rb");
    TORCH_CHECK(file_ != nullptr, "cannot open IDX file '", path_,
                "': ", errno != 0 ? std::strerror(errno) : "out of memory",
                "; expected a gzipped or plain IDX file (Debian's dataset-fashion-mnist "
                "installs them in /usr/share/datasets/fashion-mnist)");
    gzbuffer(file_, 1 << 17);
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  const std::string& path() const { return path_; }

  // Up to `n` bytes: fewer only at the end of the data. Throws on corrupt gzip data or
  // a failed read.
  std::vector<uint8_t> read_up_to(int64_t n) {
    std::vector<uint8_t> bytes;
    bytes.reserve(static_cast<size_t>(std::min(n, kMaxReserveBytes)));
    while (static_cast<int64_t>(bytes.size()) < n) {
      const int64_t want = std::min(n - static_cast<int64_t>(bytes.size()), kChunkBytes);
      const size_t old_size = bytes.size();
      bytes.resize(old_size + static_cast<size_t>(want));
      const int got = gzread(file_, bytes.data() + old_size, static_cast<unsigned>(want));
      if (got < 0) throw_read_error();
      bytes.resize(old_size + static_cast<size_t>(got));
      if (got < want) break;
    }
    return bytes;
  }

  // After a short read: whether the gzip stream stopped in the middle (zlib's
  // "unexpected end of file") rather than ending cleanly.
  bool ended_early() const {
    int errnum = Z_OK;
    gzerror(file_, &errnum);
    return errnum == Z_BUF_ERROR;
  }

 private:
  [[noreturn]] void throw_read_error() const {
    int errnum = Z_OK;
    absl::string_view message = gzerror(file_, &errnum);
    absl::ConsumePrefix(&message, path_ + ": ");  // zlib prefixes system errors with it
    TORCH_CHECK(false, "cannot read IDX file '", path_, "': ", message,
                errnum == Z_DATA_ERROR ? " (the gzip data is corrupt)" : "");
  }

  std::string path_;
  gzFile file_;
};

// "images" or "labels", with the layout a magic number stands for.
std::string describe_magic(uint32_t magic) {
  return magic == kIdxImagesMagic ? "images: unsigned bytes, 3 dimensions"
                                  : "labels: unsigned bytes, 1 dimension";
}

// Reads and checks the header of an IDX file of unsigned bytes with `magic`; returns
// its dimensions (the example count first).
std::vector<int64_t> read_header(GzReader& in, uint32_t magic) {
  const int num_dims = static_cast<int>(magic & 0xff);
  const int64_t header_bytes = 4 + 4 * num_dims;
  const std::vector<uint8_t> header = in.read_up_to(header_bytes);
  TORCH_CHECK(header.size() >= 4, "IDX file '", in.path(), "' is truncated: it has ", header.size(),
              " bytes, expected at least the ", header_bytes, "-byte header (",
              describe_magic(magic), ")");
  const uint32_t found = big_endian_u32(header.data());
  TORCH_CHECK(found == magic, "'", in.path(), "' is not an IDX ",
              magic == kIdxImagesMagic ? "images" : "labels", " file: its magic number is ",
              hex(found), ", expected ", hex(magic), " (", describe_magic(magic), ")");
  TORCH_CHECK(static_cast<int64_t>(header.size()) == header_bytes, "IDX file '", in.path(),
              "' is truncated: its header has ", header.size(), " bytes, expected ", header_bytes);
  std::vector<int64_t> dims;
  for (int d = 0; d < num_dims; ++d) dims.push_back(big_endian_u32(header.data() + 4 + 4 * d));
  return dims;
}

// The number of values the dimensions declare; throws if it does not fit in int64.
int64_t declared_numel(const GzReader& in, const std::vector<int64_t>& dims) {
  int64_t numel = 1;
  for (int64_t dim : dims) {
    TORCH_CHECK(dim == 0 || numel <= std::numeric_limits<int64_t>::max() / dim, "IDX file '",
                in.path(), "' declares dimensions [", absl::StrJoin(dims, ", "),
                "], more values than fit in memory; the header is corrupt");
    numel *= dim;
  }
  return numel;
}

// The body of the file: exactly the values the header declares, and nothing after them.
std::vector<uint8_t> read_body(GzReader& in, const std::vector<int64_t>& dims) {
  const int64_t numel = declared_numel(in, dims);
  std::vector<uint8_t> body = in.read_up_to(numel);
  TORCH_CHECK(static_cast<int64_t>(body.size()) == numel, "IDX file '", in.path(),
              "' is truncated: its header declares dimensions [", absl::StrJoin(dims, ", "), "] (",
              numel, " bytes of data), found ", body.size(), " bytes",
              in.ended_early() ? " (the gzip stream ends early)" : "");
  TORCH_CHECK(in.read_up_to(1).empty(), "IDX file '", in.path(),
              "' has bytes after the data its header declares (dimensions [",
              absl::StrJoin(dims, ", "), "]); the header or the file is corrupt");
  return body;
}

}  // namespace

at::Tensor read_idx_images(const std::string& path, bool flatten) {
  GzReader in(path);
  const std::vector<int64_t> dims = read_header(in, kIdxImagesMagic);
  const std::vector<uint8_t> pixels = read_body(in, dims);
  at::Tensor images = flatten ? at::empty({dims[0], dims[1] * dims[2]}, at::kFloat)
                              : at::empty({dims[0], dims[1], dims[2]}, at::kFloat);
  std::transform(pixels.begin(), pixels.end(), images.data_ptr<float>(),
                 [](uint8_t pixel) { return static_cast<float>(pixel) / 255.0f; });
  return images;
}

at::Tensor read_idx_labels(const std::string& path) {
  GzReader in(path);
  const std::vector<int64_t> dims = read_header(in, kIdxLabelsMagic);
  const std::vector<uint8_t> bytes = read_body(in, dims);
  at::Tensor labels = at::empty({dims[0]}, at::kLong);
  std::copy(bytes.begin(), bytes.end(), labels.data_ptr<int64_t>());
  return labels;
}

IdxDataset read_idx_dataset(const std::string& images_path, const std::string& labels_path,
                            bool flatten) {
  IdxDataset dataset{read_idx_images(images_path, flatten), read_idx_labels(labels_path)};
  TORCH_CHECK(dataset.images.size(0) == dataset.labels.size(0), "'", images_path, "' holds ",
              dataset.images.size(0), " images but '", labels_path, "' holds ",
              dataset.labels.size(0),
              " labels; expected one label per image (are both files from the same split?)");
  return dataset;
}

}  // namespace fsdp::examples
