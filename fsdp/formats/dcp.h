// PyTorch Distributed Checkpoint (torch.distributed.checkpoint, "DCP") folders as the
// default FileSystemWriter/Reader lay them out: `.metadata` (one pickle of
// torch.distributed.checkpoint.metadata.Metadata) and `__{rank}_0.distcp` files, each a
// run of complete torch.save archives, one per entry, at the byte ranges `.metadata`
// records. This file knows nothing of FSDP: it reads and writes the metadata and reads
// an entry's bytes; fsdp/state/dcp_checkpoint.h maps a model's shards onto it.
//
//   fsdp::DcpMetadata md = fsdp::read_dcp_metadata("/ckpt/step_200");
//   const fsdp::DcpEntryMetadata* w = md.find("model.layers.0.weight");  // size, chunks
//   for (const fsdp::DcpStorageInfo& s : md.storage) { /* fqn, chunk offsets, file range */ }
//   std::string archive = fsdp::read_dcp_entry("/ckpt/step_200", md.storage[0]);
//
// Metadata we write is a protocol-2 pickle with PyTorch's class names (torch 2.11's
// dcp.load and format_utils.dcp_to_torch_save read it); storage_meta is left None.
// Every file is read as hostile data (SECURITY.md): `.metadata` and `.distcp` must be
// regular files (files.h), the pickle reader is bounded (pickle.h), and the chunks of
// each tensor must cover every element exactly once before anything reads them.
// Errors: c10::Error naming the file and what is wrong (not a DCP metadata pickle, an
// unknown dtype, a chunk outside its tensor, chunks that overlap or leave a hole, a
// storage record for an unknown key, a missing, truncated or non-regular .metadata or
// .distcp file). Threading: reentrant.
// PyTorch: torch.distributed.checkpoint.metadata.Metadata, FileSystemReader/Writer.
#ifndef FSDP_FORMATS_DCP_H_
#define FSDP_FORMATS_DCP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

namespace fsdp {

// The file names of the default FileSystemWriter.
constexpr char kDcpMetadataFile[] = ".metadata";
std::string dcp_data_file(int rank);  // "__{rank}_0.distcp"

// A chunk of a tensor: where it starts in the whole tensor and its extent, per dimension
// (elements). PyTorch: ChunkStorageMetadata.
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};

// One element of a key's place in the nested state dict (planner_data): a dict key or a
// list index, e.g. ("optim", "param_groups", 0, "lr").
using DcpPathElement = std::variant<std::string, int64_t>;

// One key of the flattened state dict. PyTorch: TensorStorageMetadata (is_tensor) or
// BytesStorageMetadata (any other value, stored as a torch.save of it).
struct DcpEntryMetadata {
  std::string fqn;  // the flattened key, e.g. "optim.state.l1.weight.exp_avg"
  bool is_tensor = true;
  c10::ScalarType dtype = c10::ScalarType::Float;  // tensors only
  bool requires_grad = false;
  std::vector<int64_t> size;     // the whole tensor's shape
  std::vector<DcpChunk> chunks;  // the pieces stored, together covering the tensor
  std::vector<DcpPathElement> path;
};

// Where one chunk (or one non-tensor value) is stored. PyTorch: a MetadataIndex (fqn,
// offset, index) key and its _StorageInfo (relative_path, offset, length).
struct DcpStorageInfo {
  std::string fqn;
  std::optional<std::vector<int64_t>> chunk_offsets;  // nullopt for a non-tensor value
  std::optional<int64_t> index;                       // the chunk's index in the entry
  std::string relative_path;                          // e.g. "__1_0.distcp"
  int64_t offset = 0;                                 // bytes into that file
  int64_t length = 0;                                 // bytes of the torch.save archive
};

struct DcpMetadata {
  std::vector<DcpEntryMetadata> entries;  // in the order they were saved
  std::vector<DcpStorageInfo> storage;
  std::string version = "1.0.0";

  // The entry `fqn`, or nullptr.
  const DcpEntryMetadata* find(std::string_view fqn) const;
  // Where chunk `chunk_offsets` of `fqn` is stored (nullopt: a non-tensor value), or
  // nullptr.
  const DcpStorageInfo* find_storage(
      std::string_view fqn, const std::optional<std::vector<int64_t>>& chunk_offsets) const;
};

// Parses the bytes of a `.metadata` file (any pickle protocol up to 5); `name` is used
// in messages. Checks every chunk against its tensor, that each tensor's chunks cover it
// exactly once, and every storage record against the entries.
DcpMetadata parse_dcp_metadata(std::string_view bytes, const std::string& name);
// The `.metadata` of `dir`.
DcpMetadata read_dcp_metadata(const std::string& dir);
// The bytes of a `.metadata` file holding `metadata` (protocol-2 pickle).
std::string serialize_dcp_metadata(const DcpMetadata& metadata);

// The bytes of the entry `info` describes (a whole torch.save archive), read from
// `dir`/info.relative_path (a regular file) with one positioned read, its range checked
// against the file's size first.
std::string read_dcp_entry(const std::string& dir, const DcpStorageInfo& info);

}  // namespace fsdp

#endif  // FSDP_FORMATS_DCP_H_
