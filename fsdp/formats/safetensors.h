// safetensors files and Hugging Face sharded folders: read a tensor, or any range of its
// elements, with pread (never the whole file), and write files atomically. Knows nothing
// of FSDP (fsdp/state maps flat-parameter shards onto it).
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2, 3],
//    "data_offsets": [0, 24]}, ...}
// then the raw little-endian bytes of every tensor, offsets relative to the end of the
// header, contiguous and without gaps. A folder holds `model.safetensors`, or
// `model-0000k-of-0000n.safetensors` files with `model.safetensors.index.json`
// ({"metadata": {"total_size": B}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}).
//
//   auto ckpt = fsdp::SafetensorsCheckpoint::open("llama/");       // a folder or a file
//   at::Tensor w = ckpt.read("model.embed_tokens.weight");          // the whole tensor
//   at::Tensor part = ckpt.read_range("lm_head.weight", 100, 50);  // elements [100, 150)
//
//   fsdp::SafetensorsFolderWriter out("out/", specs, fsdp::SafetensorsWriteOptions()
//                                                        .max_shard_size(1 << 30));
//   for (...) out.write(name, tensor);  // in the order of `specs`
//   out.commit();                       // fsync, rename, then the index
//
// PyTorch / Hugging Face: safetensors.torch.load_file / safe_open(...).get_slice /
// save_file, and transformers' save_pretrained(max_shard_size=...) folder layout.
//
// Dtypes: F32 F64 F16 BF16 I64 I32 I16 I8 U8 BOOL (at::kFloat ... at::kBool); any other is
// an error. Tensors are CPU, contiguous, little-endian (the only byte order supported).
// Errors: c10::Error naming the file, the tensor and what was expected (a truncated file,
// a header length past the end, a header that is not UTF-8 JSON or not of this form, an
// unknown dtype, a shape whose bytes differ from its offsets, offsets that overlap or leave
// gaps, an index naming a file outside its folder, a missing file or a tensor its file
// lacks). Bad input never reads out of bounds. Threading: a reader's const methods may be
// called from several threads (pread has no shared file position); a writer is used from
// one thread.
#ifndef FSDP_FORMATS_SAFETENSORS_H_
#define FSDP_FORMATS_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "fsdp/formats/atomic_file.h"
#include "fsdp/formats/files.h"

namespace fsdp {

// __metadata__: string keys to string values.
using SafetensorsMetadata = std::map<std::string, std::string>;

// "F32" <-> at::kFloat, ... Throws c10::Error for a dtype outside the list above.
at::ScalarType safetensors_dtype(const std::string& name);
std::string safetensors_dtype_name(at::ScalarType dtype);

// One tensor's entry in a header.
struct SafetensorsTensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // byte offset of its first element from the start of the file
  int64_t nbytes = 0;
  int64_t numel() const;
};

// A parsed, validated header.
struct SafetensorsHeader {
  std::vector<SafetensorsTensorInfo> tensors;   // in file order (increasing offset)
  std::map<std::string, std::string> metadata;  // __metadata__ (string values)
  int64_t data_offset = 0;                      // 8 + header length
};

// Parses and validates the header of a file of `file_size` bytes whose first bytes are
// `head` (at least the 8-byte length and the JSON it announces, or the whole file when it
// is shorter); `file` names it in errors. Checks every offset against `file_size`.
SafetensorsHeader parse_safetensors_header(std::string_view head, uint64_t file_size,
                                           const std::string& file);

// One safetensors file, opened for reading (header read and checked; tensor bytes read
// on demand with pread).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  // The entry of `name`, or nullptr.
  const SafetensorsTensorInfo* find(const std::string& name) const;
  // The entry of `name`; throws naming the file when it has none.
  const SafetensorsTensorInfo& info(const std::string& name) const;

  // Reads elements [begin, begin + numel) of `name` flattened in row-major order into
  // `out` (CPU, contiguous, of the tensor's dtype, numel elements; e.g. a view into a
  // flat-parameter shard): exactly those bytes are read.
  void read_range_into(const std::string& name, int64_t begin, int64_t numel,
                       const at::Tensor& out) const;
  // The same into a new 1-D tensor.
  at::Tensor read_range(const std::string& name, int64_t begin, int64_t numel) const;
  // The whole tensor, in its shape.
  at::Tensor read(const std::string& name) const;

 private:
  SafetensorsFile(ReadableFile file, SafetensorsHeader header);
  ReadableFile file_;  // closed when the last copy goes
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;  // name -> header_.tensors position
};

// A single safetensors file or a folder (model.safetensors, or the files named by
// model.safetensors.index.json). Every file is opened (headers only) on open().
class SafetensorsCheckpoint {
 public:
  // `path`: a .safetensors file, or a folder with model.safetensors.index.json or
  // model.safetensors. Throws when neither exists, when the index is not of the form
  // above, names a file outside the folder (a path with '/' or '..') or a missing one, or
  // names a tensor its file lacks, or when two files hold the same tensor.
  static SafetensorsCheckpoint open(const std::string& path);

  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  // The file holding `name`; throws naming the checkpoint when none does.
  const SafetensorsFile& file_of(const std::string& name) const;
  const SafetensorsTensorInfo& info(const std::string& name) const {
    return file_of(name).info(name);
  }
  at::Tensor read(const std::string& name) const { return file_of(name).read(name); }
  at::Tensor read_range(const std::string& name, int64_t begin, int64_t numel) const {
    return file_of(name).read_range(name, begin, numel);
  }
  void read_range_into(const std::string& name, int64_t begin, int64_t numel,
                       const at::Tensor& out) const {
    file_of(name).read_range_into(name, begin, numel, out);
  }
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> owner_;  // tensor -> files_ position
};

// What a writer will write for one tensor.
struct SafetensorsTensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t nbytes() const;
};

// Writes one file: the header first (from `specs`), then each tensor as write() gets it,
// in the order of `specs`, to an AtomicFile of `path` (atomic_file.h: a temporary file
// beside it); commit() fsyncs and renames it to `path`. A writer destroyed without
// commit() removes the temporary file. `metadata` becomes
// __metadata__ (transformers writes {"format": "pt"}).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsTensorSpec> specs,
                    std::map<std::string, std::string> metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // `tensor`: the next spec's name, dtype and shape (any device and layout: copied to a
  // contiguous CPU tensor first).
  void write(const std::string& name, const at::Tensor& tensor);
  void commit();

 private:
  std::string path_;
  std::vector<SafetensorsTensorSpec> specs_;
  size_t next_ = 0;
  std::unique_ptr<AtomicFile> file_;  // null once committed
};

// Writes a whole state dict to one file (safetensors.torch.save_file).
void save_safetensors_file(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                           std::map<std::string, std::string> metadata = {{"format", "pt"}});

struct SafetensorsWriteOptions {
  // Bytes per file at most (a larger tensor gets a file of its own), as
  // save_pretrained(max_shard_size=...); its default is transformers' ("50GB").
  TORCH_ARG(int64_t, max_shard_size) = 50'000'000'000;
  TORCH_ARG(SafetensorsMetadata, metadata) = {{"format", "pt"}};
};

// Which file each spec goes to, as huggingface_hub's split_state_dict_into_shards: in
// order, a new file when the next tensor would pass max_shard_size, so a tensor larger
// than it sits alone in a file. (huggingface_hub keeps filling the open file after such
// a tensor; here every file holds consecutive specs, so that files are written one after
// another.) Returns, per file, the positions in `specs` (one empty file for no specs).
std::vector<std::vector<size_t>> plan_safetensors_shards(
    const std::vector<SafetensorsTensorSpec>& specs, int64_t max_shard_size);

// Writes a folder as save_pretrained does: `model.safetensors` when everything fits one
// file, else `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`. Each
// file is written atomically; the index last. Creates `dir` if needed.
class SafetensorsFolderWriter {
 public:
  SafetensorsFolderWriter(std::string dir, std::vector<SafetensorsTensorSpec> specs,
                          const SafetensorsWriteOptions& options = {});
  ~SafetensorsFolderWriter();
  // In the order of `specs`.
  void write(const std::string& name, const at::Tensor& tensor);
  // Finishes the last file and writes the index. Returns the files written (names).
  std::vector<std::string> commit();

 private:
  void open_file(size_t file);
  std::string dir_;
  std::vector<SafetensorsTensorSpec> specs_;
  SafetensorsWriteOptions options_;
  std::vector<std::vector<size_t>> plan_;
  std::vector<std::string> file_names_;
  size_t file_ = 0;
  size_t written_in_file_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
};

// The file name save_pretrained gives file `k` (0-based) of `n`: "model.safetensors" for
// n = 1, else "model-0000{k+1}-of-0000{n}.safetensors".
std::string safetensors_shard_name(size_t k, size_t n);

inline constexpr char kSafetensorsIndexName[] = "model.safetensors.index.json";
inline constexpr char kSafetensorsSingleName[] = "model.safetensors";

}  // namespace fsdp

#endif  // FSDP_FORMATS_SAFETENSORS_H_
