#include "fsdp/formats/torch_zip.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

using caffe2::serialize::PyTorchStreamReader;

// PyTorchStreamReader over a ReadableFile (pread at the offsets miniz asks for).
class FileReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit FileReadAdapter(ReadableFile file) : file_(std::move(file)) {}
  size_t size() const override { return static_cast<size_t>(file_.size()); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size()) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size() - pos));
    file_.read_into(static_cast<char*>(buf), static_cast<int64_t>(pos), static_cast<int64_t>(n));
    return n;
  }

 private:
  ReadableFile file_;
};

}  // namespace

TorchZipArchive::TorchZipArchive(std::unique_ptr<PyTorchStreamReader> reader, int64_t bytes,
                                 std::string name)
    : reader_(std::move(reader)), bytes_(bytes), name_(std::move(name)) {}

TorchZipArchive TorchZipArchive::open(
    std::shared_ptr<caffe2::serialize::ReadAdapterInterface> adapter, std::string name) {
  const auto bytes = static_cast<int64_t>(adapter->size());
  auto reader = std::make_unique<PyTorchStreamReader>(std::move(adapter));
  const size_t records = reader->getAllRecords().size();
  TORCH_CHECK(static_cast<int64_t>(records) <= kMaxZipRecords, name, " holds ", records,
              " records, more than the ", kMaxZipRecords, " fsdp reads from one archive");
  return TorchZipArchive(std::move(reader), bytes, std::move(name));
}

TorchZipArchive TorchZipArchive::open_file(ReadableFile file) {
  std::string name = "'" + file.path() + "'";
  return open(std::make_shared<FileReadAdapter>(std::move(file)), std::move(name));
}

// Note [Zip records are no larger than their archive]
// A zip entry's header says how large it is once inflated, and PyTorchStreamReader
// allocates that much before inflating: a deflated record of a few kilobytes could claim
// gigabytes. PyTorch's writers (torch.save, torch.export.save, torch.jit.save) store
// every record uncompressed, so a record larger than the whole archive is refused
// before it is read. (miniz itself checks that a stored record lies inside the archive.)
int64_t TorchZipArchive::record_size(const std::string& record) const {
  TORCH_CHECK(reader_->hasRecord(record), name_, " has no record '", record, "'");
  const auto size = static_cast<uint64_t>(reader_->getRecordSize(record));
  TORCH_CHECK(size <= static_cast<uint64_t>(bytes_), name_, ": record '", record,
              "' says it holds ", size, " bytes, more than the whole archive (", bytes_,
              " bytes); PyTorch stores records uncompressed, so the archive is damaged or "
              "hostile");
  return static_cast<int64_t>(size);
}

std::string TorchZipArchive::read(const std::string& record) const {
  std::string bytes(static_cast<size_t>(record_size(record)), '\0');
  read_into(record, bytes.data(), static_cast<int64_t>(bytes.size()));
  return bytes;
}

void TorchZipArchive::read_into(const std::string& record, void* out, int64_t size) const {
  const int64_t stored = record_size(record);
  TORCH_CHECK(stored == size, name_, ": record '", record, "' holds ", stored, " bytes, ", size,
              " were expected");
  if (size > 0) reader_->getRecord(record, out, static_cast<size_t>(size));
}

}  // namespace fsdp
