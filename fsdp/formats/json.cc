#include "fsdp/formats/json.h"

#include <cstddef>
#include <string>

#include <c10/util/Exception.h>

#include "fsdp/formats/files.h"

namespace fsdp {

namespace {

// A SAX handler that builds nothing: it counts how deeply arrays and objects nest, stops
// at the first one deeper than kMaxJsonDepth, and keeps the parse error if any. One linear
// pass (a DOM parse with a callback rescans each object as it ends: quadratic).
class DepthBound {
 public:
  using json = nlohmann::json;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool key(json::string_t&) { return true; }
  bool start_object(std::size_t) { return enter(); }
  bool end_object() { return leave(); }
  bool start_array(std::size_t) { return enter(); }
  bool end_array() { return leave(); }
  // parse_error, and out_of_range for a number that overflows a double ("1e999999").
  bool parse_error(std::size_t, const std::string&, const json::exception& e) {
    error_ = e.what();
    return false;
  }

  bool too_deep() const { return depth_ > kMaxJsonDepth; }
  const std::string& error() const { return error_; }

 private:
  bool enter() { return ++depth_ <= kMaxJsonDepth; }
  bool leave() {
    --depth_;
    return true;
  }

  int depth_ = 0;  // of the innermost array or object open (a top-level one is 1)
  std::string error_;
};

}  // namespace

nlohmann::json parse_untrusted_json(std::string_view text, const std::string& what,
                                    std::string_view hint) {
  const std::string tail = hint.empty() ? "" : "; " + std::string(hint);
  TORCH_CHECK(static_cast<int64_t>(text.size()) <= kMaxJsonBytes, what, " has ", text.size(),
              " bytes of JSON, more than the ", kMaxJsonBytes, " fsdp reads", tail);
  DepthBound bound;
  nlohmann::json::sax_parse(text.begin(), text.end(), &bound);
  TORCH_CHECK(!bound.too_deep(), what, " nests arrays and objects deeper than ", kMaxJsonDepth,
              " levels, which fsdp does not read", tail);
  TORCH_CHECK(bound.error().empty(), what, " is not valid JSON: ", bound.error(), tail);
  // Valid and bounded: the same parser builds it without a callback, in linear time.
  return nlohmann::json::parse(text.begin(), text.end());
}

nlohmann::json read_json_file(const std::string& path, std::string_view what,
                              std::string_view hint) {
  return parse_untrusted_json(read_regular_file(path, what, kMaxJsonBytes),
                              std::string(what) + " '" + path + "'", hint);
}

}  // namespace fsdp
