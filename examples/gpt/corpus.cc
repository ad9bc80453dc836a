#include "examples/gpt/corpus.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_split.h"
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

namespace fsdp::examples {

std::string Corpus::decode(const at::Tensor& ids) const {
  std::string text;
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    text.push_back(static_cast<char>(bytes.at(flat.data_ptr<int64_t>()[i])));
  }
  return text;
}

Corpus load_fortunes(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  // The selection path_flag_error (flags.cc) checks up front: entries without an
  // extension that are, or link to, regular files; one whose type cannot be read is named.
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().has_extension()) continue;
    std::error_code type_error;
    const bool regular = std::filesystem::is_regular_file(entry.path(), type_error);
    TORCH_CHECK(!type_error, "cannot read the fortune file '", entry.path().string(),
                "': ", type_error.message(), "; fix it or pass another --data_dir");
    if (regular) files.push_back(entry.path());
  }
  TORCH_CHECK(!error && !files.empty(), "no fortune files in '", dir,
              "'; install Debian's fortunes package (tools/setup.sh does)");
  std::sort(files.begin(), files.end());  // a fixed order: the split is reproducible

  std::string train_text, validation_text;
  Corpus corpus;
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.good(), "cannot read the fortune file '", path.string(),
                "': ", std::strerror(errno), "; fix its permissions or pass another --data_dir");
    std::stringstream content;
    content << in.rdbuf();
    for (absl::string_view entry : absl::StrSplit(content.str(), "\n%\n", absl::SkipEmpty())) {
      std::string& text = corpus.entries++ % 10 == 9 ? validation_text : train_text;
      text.append(entry.data(), entry.size());
      text.append("\n\n");
    }
  }
  TORCH_CHECK(!train_text.empty() && !validation_text.empty(), "the fortune files in '", dir,
              "' hold ", corpus.entries,
              " fortunes; the trainer needs at least 10 (every "
              "10th is held out for validation)");
  std::array<int64_t, 256> id_of;
  id_of.fill(-1);
  for (const std::string* text : {&train_text, &validation_text}) {
    for (unsigned char c : *text) {
      if (id_of[c] < 0) {
        id_of[c] = static_cast<int64_t>(corpus.bytes.size());
        corpus.bytes.push_back(c);
      }
    }
  }
  auto encode = [&](const std::string& text) {
    at::Tensor ids = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
    int64_t* out = ids.data_ptr<int64_t>();
    for (size_t i = 0; i < text.size(); ++i) out[i] = id_of[static_cast<unsigned char>(text[i])];
    return ids;
  };
  corpus.train = encode(train_text);
  corpus.validation = encode(validation_text);
  return corpus;
}

std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& tokens, const at::Tensor& starts,
                                          int64_t context) {
  const at::Tensor index = starts.unsqueeze(1) + at::arange(context + 1, at::kLong).unsqueeze(0);
  const at::Tensor chunk = tokens.index_select(0, index.reshape({-1})).view(index.sizes());
  return {chunk.narrow(1, 0, context).contiguous(), chunk.narrow(1, 1, context).contiguous()};
}

}  // namespace fsdp::examples
