#include "fsdp/formats/atomic_file.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("atomic_file_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

std::string temporary_of(const std::string& path) {
  return path + ".tmp-" + std::to_string(::getpid());
}

TEST(AtomicFile, ReplacesTheFileWithExactlyTheBytes) {
  const std::string path = fresh_dir("replace") + "/a.json";
  write_file_atomically(path, "old");
  write_file_atomically(path, std::string("{\0}\n", 4));
  EXPECT_EQ(slurp(path), std::string("{\0}\n", 4));
  EXPECT_FALSE(fs::exists(temporary_of(path)));
}

TEST(AtomicFile, AppendsUntilCommitAndLeavesTheOldFileUntilThen) {
  const std::string path = fresh_dir("append") + "/b.bin";
  write_file_atomically(path, "old");
  {
    AtomicFile file(path);
    EXPECT_EQ(file.temporary_path(), temporary_of(path));
    file.append("ab");
    file.append("");
    file.append("cde");
    EXPECT_EQ(slurp(path), "old");
    file.commit();
    EXPECT_EQ(error_of([&] { file.append("f"); }),
              "'" + path + "' is already committed (or failed); nothing can be added");
  }
  EXPECT_EQ(slurp(path), "abcde");
  {
    AtomicFile abandoned(path);
    abandoned.append("never");
    EXPECT_TRUE(fs::exists(temporary_of(path)));
  }
  EXPECT_FALSE(fs::exists(temporary_of(path)));
  EXPECT_EQ(slurp(path), "abcde");
}

TEST(AtomicFile, ErrorsNameThePathAndTheReason) {
  const std::string dir = fresh_dir("errors");
  const std::string missing = dir + "/no/such/c.json";
  EXPECT_EQ(error_of([&] { write_file_atomically(missing, "x"); }),
            "cannot create '" + temporary_of(missing) + "': No such file or directory");
  // A directory in the way of the rename: the temporary file goes, the directory stays.
  const std::string taken = dir + "/d";
  fs::create_directories(taken + "/inside");
  EXPECT_EQ(error_of([&] { write_file_atomically(taken, "x"); }),
            "cannot rename '" + temporary_of(taken) + "' to '" + taken + "': Is a directory");
  EXPECT_FALSE(fs::exists(temporary_of(taken)));
  EXPECT_TRUE(fs::is_directory(taken + "/inside"));
}

TEST(AtomicFile, AFailedWriteRemovesTheTemporaryAndKeepsTheOldFile) {
  const std::string path = fresh_dir("full") + "/e.bin";
  write_file_atomically(path, "old");
  // A file size limit of 4 bytes makes the fifth byte's write fail with EFBIG.
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto previous_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = before;
  small.rlim_cur = 4;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string error = error_of([&] { write_file_atomically(path, "12345678"); });
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &before), 0);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_EQ(error, "cannot write '" + temporary_of(path) + "': File too large");
  EXPECT_FALSE(fs::exists(temporary_of(path)));
  EXPECT_EQ(slurp(path), "old");
}

TEST(AtomicFile, SyncsADirectoryOrSaysWhyNot) {
  fsync_directory(fresh_dir("sync"));
  fsync_directory("");
  const std::string missing = fresh_dir("sync") + "/missing";
  EXPECT_EQ(error_of([&] { fsync_directory(missing); }),
            "cannot open the directory '" + missing + "' to sync it: No such file or directory");
}

}  // namespace
}  // namespace fsdp
