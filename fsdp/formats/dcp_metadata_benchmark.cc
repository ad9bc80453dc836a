// Reading Distributed Checkpoint metadata: a .metadata as a sharded save of a 7B-class
// model writes it (2,000 tensors, each in 8 row chunks, with its storage records: 4.6 MB
// of pickle), parsed from memory (BM_ParseDcpMetadata) and read from a file
// (BM_ReadDcpMetadata, the file in the page cache). Both include the chunk-cover check
// and the pickle reader's depth and cycle walk (SECURITY.md).
//
//   bazel run -c opt //fsdp/formats:dcp_metadata_benchmark
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include <benchmark/benchmark.h>

#include "fsdp/formats/dcp.h"

namespace fsdp {
namespace {

constexpr int kTensors = 2000;
constexpr int kChunks = 8;

DcpMetadata metadata() {
  DcpMetadata md;
  for (int t = 0; t < kTensors; ++t) {
    DcpEntryMetadata e;
    e.fqn = absl::StrCat("model.layers.", t / 10, ".weight", t % 10);
    e.path = {std::string("model"), e.fqn.substr(6)};
    e.size = {4096, 4096};
    for (int c = 0; c < kChunks; ++c) {
      e.chunks.push_back({{c * 512, 0}, {512, 4096}});
      md.storage.push_back({e.fqn, std::vector<int64_t>{c * 512, 0}, c, dcp_data_file(c),
                            int64_t{t} * 8'400'000, 8'400'000});
    }
    md.entries.push_back(std::move(e));
  }
  return md;
}

const std::string& bytes() {
  static const std::string* b = new std::string(serialize_dcp_metadata(metadata()));
  return *b;
}

void BM_ParseDcpMetadata(benchmark::State& state) {
  for (auto _ : state) {
    benchmark::DoNotOptimize(parse_dcp_metadata(bytes(), "bench"));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes().size()));
}
BENCHMARK(BM_ParseDcpMetadata)->Unit(benchmark::kMillisecond);

void BM_ReadDcpMetadata(benchmark::State& state) {
  const char* tmp = std::getenv("TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(tmp != nullptr ? tmp : "/tmp") / "fsdp_dcp_metadata_benchmark";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / kDcpMetadataFile, std::ios::binary) << bytes();
  for (auto _ : state) {
    benchmark::DoNotOptimize(read_dcp_metadata(dir.string()));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes().size()));
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_ReadDcpMetadata)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fsdp
