// Test helpers: run a script with the pinned environment's Python (FSDP_PYTHON, set by
// the test's BUILD rule) and read the files it writes.
#ifndef FSDP_FORMATS_TESTING_PYTHON_TESTING_H_
#define FSDP_FORMATS_TESTING_PYTHON_TESTING_H_

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

namespace fsdp::formats_testing {

// TEST_TMPDIR/name (or /tmp/name outside Bazel).
inline std::string scratch_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir ? dir : "/tmp", "/", name);
}

// Runs `code` with Python; returns its standard output. A failing script fails the test.
inline std::string run_python(const std::string& code) {
  const char* python = std::getenv("FSDP_PYTHON");
  if (python == nullptr) python = "python3";
  const std::string script = scratch_path("script.py");
  std::ofstream(script) << code;
  FILE* pipe = ::popen(absl::StrCat(python, " ", script).c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string out;
  char buffer[4096];
  for (size_t n; pipe && (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) {
    out.append(buffer, n);
  }
  EXPECT_EQ(pipe ? ::pclose(pipe) : -1, 0) << "python failed on:\n" << code;
  return out;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace fsdp::formats_testing

#endif  // FSDP_FORMATS_TESTING_PYTHON_TESTING_H_
