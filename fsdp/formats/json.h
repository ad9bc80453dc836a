// JSON that may have been written by anyone (safetensors headers, config.json, index
// files, the JSON records of .pt2 archives), parsed with nlohmann-json under two limits
// checked before it is built: its size, then how deeply it nests (a first pass that builds
// nothing, nlohmann's SAX parser). Both passes take time linear in the text's size. Every
// reader of such JSON in fsdp parses it here.
//
//   nlohmann::json j = fsdp::parse_untrusted_json(text, "config.json '/m/config.json'",
//                                                 "expected a Hugging Face config");
//   nlohmann::json k = fsdp::read_json_file("/m/model.safetensors.index.json",
//                                           "safetensors index", "expected {...}");
//
// nlohmann's parser is iterative and its destructor takes a value apart without
// recursion, but copies, comparisons and dump() recurse: the depth limit keeps them
// bounded. Errors: c10::Error "WHAT is not valid JSON: DETAIL; HINT", "WHAT nests deeper
// than ...", "WHAT has N bytes, more than ...". Threading: reentrant.
// PyTorch counterpart: none (Python's json module, whose limit is the recursion limit).
#ifndef FSDP_FORMATS_JSON_H_
#define FSDP_FORMATS_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fsdp {

// The most bytes of JSON read from one file (safetensors' own header limit, 100 MB).
constexpr int64_t kMaxJsonBytes = 100'000'000;
// The deepest nesting of arrays and objects accepted (a top-level object is depth 1).
constexpr int kMaxJsonDepth = 1000;

// Parses `text`; `what` names it in messages ("the header of safetensors file 'x'"),
// `hint` says what was expected ("" for none).
nlohmann::json parse_untrusted_json(std::string_view text, const std::string& what,
                                    std::string_view hint);

// The JSON in the regular file `path` (files.h), at most kMaxJsonBytes.
nlohmann::json read_json_file(const std::string& path, std::string_view what,
                              std::string_view hint);

}  // namespace fsdp

#endif  // FSDP_FORMATS_JSON_H_
