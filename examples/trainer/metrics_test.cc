// metrics.csv across --resume (issue 30): kept rows, and files set aside with a warning.
#include "examples/trainer/metrics.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp::examples {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;

const std::string kHeader = kMetricsHeader;
const std::string kRows =
    kHeader +
    "\n1,4.1000000,,0.000600,100\n2,3.9000000,3.8500000,0.001200,110\n3,3.7000000,,0.001800,120\n";

fs::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(tmp != nullptr ? tmp : "/tmp") / "metrics_test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(MetricsToKeep, KeepsTheRowsUpToTheStepAsTheyWere) {
  const KeptMetrics kept = metrics_to_keep(kRows + "4,3.6", 2);
  EXPECT_EQ(kept.problem, "");
  EXPECT_THAT(kept.lines, ElementsAre(kHeader, "1,4.1000000,,0.000600,100",
                                      "2,3.9000000,3.8500000,0.001200,110"));
  EXPECT_EQ(metrics_to_keep(kRows, 3).lines.size(), 4u);
}

TEST(MetricsToKeep, SaysWhyAFileDoesNotCoverTheSteps) {
  EXPECT_EQ(metrics_to_keep("", 2).problem, "it holds no complete line");
  EXPECT_EQ(metrics_to_keep("\x01garbage\n", 2).problem,
            "its first line '\\x01garbage' is not the header '" + kHeader + "'");
  EXPECT_EQ(metrics_to_keep(kRows, 4).problem, "it ends after step 3");
  EXPECT_EQ(metrics_to_keep(kHeader + "\n1,4.1,,0.0006,100\n3,3.7,,0.0018,120\n", 2).problem,
            "line 3 '3,3.7,,0.0018,120' is not the row of step 2");
  EXPECT_EQ(metrics_to_keep(kHeader + "\n1,nan,,0.0006,100\n", 1).problem,
            "line 2 '1,nan,,0.0006,100' is not the row of step 1");
  EXPECT_TRUE(metrics_to_keep(kHeader + "\n1,4.1,,0.0006,100\n", 1).lines.size() == 2);
}

TEST(OpenMetrics, ANewRunStartsWithTheHeader) {
  const fs::path dir = scratch("new");
  std::string warning = "stale";
  {
    std::ofstream csv = open_metrics((dir / "metrics.csv").string(), 0, &warning);
    csv << "1,4.1,,0.0006,100\n";
  }
  EXPECT_EQ(warning, "");
  EXPECT_EQ(read(dir / "metrics.csv"), kHeader + "\n1,4.1,,0.0006,100\n");
}

TEST(OpenMetrics, AResumeKeepsTheRowsUpToItsStep) {
  const fs::path dir = scratch("resume");
  std::ofstream(dir / "metrics.csv") << kRows;
  std::string warning;
  {
    std::ofstream csv = open_metrics((dir / "metrics.csv").string(), 2, &warning);
    csv << "3,3.7100000,,0.001800,121\n";
  }
  EXPECT_EQ(warning, "");
  EXPECT_EQ(read(dir / "metrics.csv"),
            kHeader +
                "\n1,4.1000000,,0.000600,100\n2,3.9000000,3.8500000,0.001200,110\n"
                "3,3.7100000,,0.001800,121\n");
  EXPECT_FALSE(fs::exists(dir / "metrics.set_aside_1.csv"));
}

TEST(OpenMetrics, ADamagedFileIsKeptAsideWithAWarning) {
  const fs::path dir = scratch("damaged");
  const std::string path = (dir / "metrics.csv").string();
  std::ofstream(dir / "metrics.set_aside_1.csv") << "an earlier one";
  std::ofstream(path) << "garbage\n";
  std::string warning;
  open_metrics(path, 2, &warning).close();
  EXPECT_EQ(warning, "warning: " + path +
                         " does not hold the rows of steps 1-2: its first line 'garbage' is not "
                         "the header '" +
                         kHeader + "'; kept it as " + (dir / "metrics.set_aside_2.csv").string() +
                         "; a new metrics.csv starts at step 3 (the rows of steps 1-2 are not "
                         "in it)");
  EXPECT_EQ(read(dir / "metrics.set_aside_2.csv"), "garbage\n");
  EXPECT_EQ(read(dir / "metrics.set_aside_1.csv"), "an earlier one");
  EXPECT_EQ(read(path), kHeader + "\n");
}

TEST(OpenMetrics, AMissingFileIsSaid) {
  const fs::path dir = scratch("missing");
  const std::string path = (dir / "metrics.csv").string();
  std::string warning;
  open_metrics(path, 4, &warning).close();
  EXPECT_EQ(warning, "warning: " + path +
                         " is missing; a new metrics.csv starts at step 5 (the rows of steps "
                         "1-4 are not in it)");
  EXPECT_EQ(read(path), kHeader + "\n");
}

TEST(OpenMetrics, AnUnreadableFileIsKeptAside) {
  const fs::path dir = scratch("unreadable");
  const std::string path = (dir / "metrics.csv").string();
  fs::create_directories(path);  // a folder where the file should be
  std::string warning;
  open_metrics(path, 1, &warning).close();
  EXPECT_EQ(warning, "warning: " + path + " is a folder, not a file; kept it as " +
                         (dir / "metrics.set_aside_1.csv").string() +
                         "; a new metrics.csv starts at step 2 (the rows of steps 1-1 are not "
                         "in it)");
  EXPECT_TRUE(fs::is_directory(dir / "metrics.set_aside_1.csv"));
  EXPECT_EQ(read(path), kHeader + "\n");
}

}  // namespace
}  // namespace fsdp::examples
