#include "fsdp/formats/json.h"

#include <c10/util/Exception.h>

#include "fsdp/formats/files.h"

namespace fsdp {

nlohmann::json parse_untrusted_json(std::string_view text, const std::string& what,
                                    std::string_view hint) {
  const std::string tail = hint.empty() ? "" : "; " + std::string(hint);
  TORCH_CHECK(static_cast<int64_t>(text.size()) <= kMaxJsonBytes, what, " has ", text.size(),
              " bytes of JSON, more than the ", kMaxJsonBytes, " fsdp reads", tail);
  // The callback sees each array or object start with the depth of its parent.
  auto bounded = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
    if (event == nlohmann::json::parse_event_t::object_start ||
        event == nlohmann::json::parse_event_t::array_start) {
      TORCH_CHECK(depth < kMaxJsonDepth, what, " nests arrays and objects deeper than ",
                  kMaxJsonDepth, " levels, which fsdp does not read", tail);
    }
    return true;
  };
  nlohmann::json json;
  std::string error;
  try {
    json = nlohmann::json::parse(text.begin(), text.end(), bounded);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number that overflows a double ("1e999999").
    error = e.what();
  }
  TORCH_CHECK(error.empty(), what, " is not valid JSON: ", error, tail);
  return json;
}

nlohmann::json read_json_file(const std::string& path, std::string_view what,
                              std::string_view hint) {
  return parse_untrusted_json(read_regular_file(path, what, kMaxJsonBytes),
                              std::string(what) + " '" + path + "'", hint);
}

}  // namespace fsdp
