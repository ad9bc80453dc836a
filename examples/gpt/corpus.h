// The character-level corpus of the GPT example: the English fortunes of Debian's
// `fortunes` package (entries separated by "%" lines), as byte tokens, with a held-out
// validation split.
//
//   fsdp::examples::Corpus corpus = fsdp::examples::load_fortunes("/usr/share/games/fortunes");
//   corpus.vocab_size();        // distinct bytes in the text
//   corpus.train;               // int64 token ids, 1-D
//   corpus.decode(ids);         // back to text
#ifndef FSDP_EXAMPLES_GPT_CORPUS_H_
#define FSDP_EXAMPLES_GPT_CORPUS_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::examples {

struct Corpus {
  at::Tensor train;            // 1-D int64 token ids
  at::Tensor validation;       // 1-D int64 token ids: every 10th entry
  std::vector<uint8_t> bytes;  // token id -> byte
  int64_t entries = 0;         // fortunes read

  int64_t vocab_size() const { return static_cast<int64_t>(bytes.size()); }
  std::string decode(const at::Tensor& ids) const;
};

// Reads every fortune file in `dir` (files without an extension; the .dat indexes and
// .u8 copies are skipped). Throws c10::Error if the folder has no fortune files (install
// Debian's `fortunes` package), if one cannot be read (naming it), or if they hold fewer
// than 10 fortunes (no validation split).
Corpus load_fortunes(const std::string& dir);

// `batch` windows of `context + 1` consecutive tokens starting at the given offsets:
// inputs [batch, context] and next-token targets [batch, context].
std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& tokens, const at::Tensor& starts,
                                          int64_t context);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_CORPUS_H_
