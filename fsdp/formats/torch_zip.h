// Zip archives in PyTorch's layout (torch.save files, .pt2 archives, TorchScript
// archives) read through LibTorch's caffe2::serialize::PyTorchStreamReader under caps:
// the number of records, and each record's size (checked against the archive's size
// before the record is allocated, so a deflated record cannot expand into more memory
// than the archive has bytes: PyTorch's writers store records uncompressed).
//
//   auto archive = fsdp::TorchZipArchive::open_file(
//       fsdp::ReadableFile::open("/m/model.pt2", ".pt2 archive"));
//   std::string json = archive.read("models/model.json");
//
// Errors: c10::Error naming the archive and what is wrong (not a regular file, too many
// records, a record larger than the archive); LibTorch's own errors (a damaged zip) pass
// through as c10::Error. Threading: one reader per thread (PyTorchStreamReader locks).
// PyTorch counterpart: torch.serialization's _open_zipfile_reader.
#ifndef FSDP_FORMATS_TORCH_ZIP_H_
#define FSDP_FORMATS_TORCH_ZIP_H_

#include <cstdint>
#include <memory>
#include <string>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include "fsdp/formats/files.h"

namespace fsdp {

// The most records fsdp reads from one archive (torch.save writes one per storage).
constexpr int64_t kMaxZipRecords = 1'000'000;

class TorchZipArchive {
 public:
  // Opens the archive `adapter` reads; `name` names it in messages. Checks the number of
  // records.
  static TorchZipArchive open(std::shared_ptr<caffe2::serialize::ReadAdapterInterface> adapter,
                              std::string name);
  // The same over `file` (files.h: opening it refused a FIFO or device by name).
  static TorchZipArchive open_file(ReadableFile file);

  caffe2::serialize::PyTorchStreamReader& reader() const { return *reader_; }
  const std::string& name() const { return name_; }
  bool has(const std::string& record) const { return reader_->hasRecord(record); }
  // The size of `record` (uncompressed): throws when the archive has no such record or
  // when it is larger than the whole archive.
  int64_t record_size(const std::string& record) const;
  // The bytes of `record` (size checked first).
  std::string read(const std::string& record) const;
  // The bytes of `record` into `out`, which must have exactly its size (checked first).
  void read_into(const std::string& record, void* out, int64_t size) const;

 private:
  TorchZipArchive(std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader, int64_t bytes,
                  std::string name);
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  int64_t bytes_ = 0;  // the archive's size
  std::string name_;
};

}  // namespace fsdp

#endif  // FSDP_FORMATS_TORCH_ZIP_H_
