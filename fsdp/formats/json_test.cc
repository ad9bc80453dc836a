// Untrusted JSON: a wide object parses whole (the depth check is one linear pass), and
// nesting beyond kMaxJsonDepth or malformed text is refused with its exact message.
#include "fsdp/formats/json.h"

#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

// The message of the c10::Error parse_untrusted_json throws ("" when it throws none).
std::string parse_error(const std::string& text) {
  try {
    parse_untrusted_json(text, "'x.json'", "expected an object");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// A safetensors header of 200,000 tensors is one object of 200,000 members: every member
// is there with its value (a DOM parse with a depth callback took quadratic time here).
TEST(ParseUntrustedJson, WideObjectParsesWhole) {
  constexpr int kMembers = 200'000;
  std::string text = "{";
  for (int i = 0; i < kMembers; ++i) {
    text +=
        (i == 0 ? "\"k" : ",\"k") + std::to_string(i) + "\":{\"v\":[" + std::to_string(i) + "]}";
  }
  text += "}";
  const nlohmann::json json = parse_untrusted_json(text, "'x.json'", "");
  ASSERT_TRUE(json.is_object());
  EXPECT_EQ(json.size(), kMembers);
  EXPECT_EQ(json.at("k0").at("v").at(0), 0);
  EXPECT_EQ(json.at("k199999").at("v").at(0), 199'999);
}

// kMaxJsonDepth levels parse (and the value is destroyed); one more is refused by name.
TEST(ParseUntrustedJson, DepthLimit) {
  const std::string limit =
      std::string(kMaxJsonDepth, '[') + "{}" + std::string(kMaxJsonDepth, ']');
  EXPECT_EQ(parse_error(limit),
            "'x.json' nests arrays and objects deeper than 1000 levels, which fsdp does not "
            "read; expected an object");
  const std::string at_limit =
      std::string(kMaxJsonDepth - 1, '[') + "{}" + std::string(kMaxJsonDepth - 1, ']');
  EXPECT_EQ(parse_untrusted_json(at_limit, "'x.json'", "").dump(),
            std::string(kMaxJsonDepth - 1, '[') + "{}" + std::string(kMaxJsonDepth - 1, ']'));
}

// Malformed text, trailing text and a number beyond a double: nlohmann's own message,
// found by the depth pass before anything is built.
TEST(ParseUntrustedJson, InvalidJson) {
  EXPECT_EQ(parse_error(R"({"a": [1, 2})"),
            "'x.json' is not valid JSON: [json.exception.parse_error.101] parse error at line 1, "
            "column 12: syntax error while parsing array - unexpected '}'; expected ']'; "
            "expected an object");
  EXPECT_EQ(parse_error("{} {}"),
            "'x.json' is not valid JSON: [json.exception.parse_error.101] parse error at line 1, "
            "column 4: syntax error while parsing value - unexpected '{'; expected end of input; "
            "expected an object");
  EXPECT_EQ(parse_error("[1e999]"),
            "'x.json' is not valid JSON: [json.exception.out_of_range.406] number overflow "
            "parsing '1e999'; expected an object");
}

}  // namespace
}  // namespace fsdp
