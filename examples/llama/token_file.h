// Token files for the fine-tune trainer: a flat little-endian array of token ids of 2
// bytes (uint16) or 4 (uint32), the nanoGPT / llm.c convention (examples/llama/tokenize.py
// writes one with a model folder's tokenizer). The file is read window by window
// (pread, through fsdp/formats/files.h), never held whole: a rank's memory does not grow
// with the data, and ranks on one machine share the page cache. PyTorch counterpart: nanoGPT's
// np.memmap of train.bin.
//
//   const TokenFile tokens("train.bin", /*bytes_per_id=*/2, config.vocab_size);
//   auto [inputs, targets] = tokens.windows(starts, /*context=*/512);  // int64 [n, 512]
//
// Threading: a TokenFile may be read from several threads (pread keeps no file
// position). Errors: c10::Error naming the file and what was expected.
#ifndef FSDP_EXAMPLES_LLAMA_TOKEN_FILE_H_
#define FSDP_EXAMPLES_LLAMA_TOKEN_FILE_H_

#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "fsdp/formats/files.h"

namespace fsdp::models {

class TokenFile {
 public:
  // Which ids are checked against the vocabulary when the file is opened.
  enum class IdCheck {
    kEvery,   // every id, the file read once in 1 MiB blocks (and looks_like_4_byte_ids)
    kAsRead,  // none (a check of kEvery made earlier); windows() checks the ids it reads
  };

  // Opens `path` and checks it: a regular file of a whole number of `bytes_per_id`-byte
  // ids (2 or 4), and with kEvery every id below `vocab_size`. Throws naming the file, and
  // the first id that is not with its index.
  TokenFile(const std::string& path, int64_t bytes_per_id, int64_t vocab_size,
            IdCheck check = IdCheck::kEvery);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return size_; }  // ids in the file

  // True when, checked with kEvery, the file was read as 2-byte ids, holds at least 64 of
  // them, and every id at
  // an odd index is 0 while some id at an even index is not: a file of 4-byte ids read as
  // 2-byte ones (every id below 65536 has a zero high half). Real 2-byte data does not
  // look like that.
  bool looks_like_4_byte_ids() const { return looks_like_4_byte_ids_; }

  // The windows of context + 1 consecutive ids starting at `starts` (int64 [n], each in
  // [0, size() - context - 1]): inputs [n, context] and next-token targets [n, context],
  // int64 on the CPU. Throws if a window does not lie in the file, or if the file has
  // changed since it was opened (shrunk, or an id not below vocab_size).
  std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& starts, int64_t context) const;

 private:
  ReadableFile file_;  // copies share the descriptor
  int64_t bytes_per_id_;
  int64_t vocab_size_;
  int64_t size_ = 0;
  bool looks_like_4_byte_ids_ = false;
};

}  // namespace fsdp::models

#endif  // FSDP_EXAMPLES_LLAMA_TOKEN_FILE_H_
