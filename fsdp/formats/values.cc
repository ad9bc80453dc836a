#include "fsdp/formats/values.h"

#include <cmath>
#include <cstdio>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

constexpr char kCountRange[] =
    "; expected an integer in [0, 2^53) (the file is damaged or was edited: use another "
    "checkpoint)";

// All the digits a double has: -1e12 as -1000000000000, 2.5 as 2.5.
std::string text(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.17g", value);
  return buffer;
}

}  // namespace

int64_t checked_count(int64_t value, std::string_view field) {
  TORCH_CHECK(value >= 0 && value < kMaxFileCount, field, " is ", value, kCountRange);
  return value;
}

int64_t checked_count(double value, std::string_view field) {
  TORCH_CHECK(std::isfinite(value) && value >= 0 && value < static_cast<double>(kMaxFileCount) &&
                  value == std::floor(value),
              field, " is ", text(value), kCountRange);
  return static_cast<int64_t>(value);
}

double checked_finite(double value, std::string_view field) {
  TORCH_CHECK(std::isfinite(value), field, " is ", text(value),
              "; expected a finite number (the file is damaged or was edited: use another "
              "checkpoint)");
  return value;
}

}  // namespace fsdp
