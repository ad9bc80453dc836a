// libFuzzer target for whole checkpoint folders: a Distributed Checkpoint folder
// (dcp_checkpoint.h: `.metadata` and `__{rank}_0.distcp` files) or an fsdp sharded
// checkpoint folder (checkpoint.h: `metadata.pt` and `rank_{rank}.pt` files), loaded into a
// model at W = 1, so that what only shows across files is reachable: chunks or pieces that
// overlap, leave holes or reach past their tensor, records pointing into the wrong bytes,
// out-of-range values (a step of -10^12), huge sizes. Every input must end in a loaded model
// or a c10::Error; anything else (a crash, a sanitizer report, a hang, an OOM) is a bug.
//
// Input: byte 0 picks the folder (even: DCP, odd: fsdp), then sections split by kSeparator:
//   1. the metadata as a pickle: the `.metadata` file (DCP), or the data.pkl of
//      metadata.pt (fsdp; this target wraps it in the zip archive, so the fuzzer does not
//      spend its time failing CRC checks);
//   2. (DCP, optional) a pickle wrapped as a torch.save archive and appended to
//      __0_0.distcp at its original size, where a mutated storage record may point (how a
//      value such as "step" is stored).
// The data files are the ones a real save wrote: TinyLm (fsdp/core/testing) trained one
// AdamW step at W = 2 and saved in both formats when the target starts. With
// FSDP_FUZZ_SEED_DIR set, the start also writes the seeds derived from that save there
// (good folders, chunks or pieces that overlap and leave a hole, huge sizes, a step of
// -10^12); tools/checkpoint_folder_fuzz_seeds.py adds deep nesting and a memo bomb. Run with
// tools/fuzz.sh.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/optim/adamw.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/formats/dcp.h"
#include "fsdp/formats/pickle.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"

namespace {

namespace fs = std::filesystem;
using Model = fsdp::FullyShardedDataParallel<fsdp::core_testing::TinyLmImpl>;

constexpr std::string_view kSeparator = "\n#FUZZ#\n";

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A zip archive holding `pickle` as data.pkl, as torch.save lays one out.
std::string torch_save_archive(std::string_view pickle) {
  std::string archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    archive.append(static_cast<const char*>(bytes), n);
    return n;
  });
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return archive;
}

// The data.pkl record of the zip archive at `path`.
std::string data_pkl(const fs::path& path) {
  caffe2::serialize::PyTorchStreamReader reader(path.string());
  auto [data, size] = reader.getRecord("data.pkl");
  return std::string(static_cast<const char*>(data.get()), size);
}

Model tiny_lm(std::shared_ptr<fsdp::Communicator> comm) {
  torch::manual_seed(0);
  return Model(fsdp::core_testing::make<fsdp::core_testing::TinyLmImpl>(),
               fsdp::FullyShardedDataParallelOptions(std::move(comm)));
}

// The folders of one real save, the W = 1 model loads go into, and the work folders.
struct Fixture {
  fs::path root;
  fs::path dcp;  // the work folders, rewritten per input
  fs::path fsdp;
  std::string distcp0;  // __0_0.distcp as saved
  std::shared_ptr<fsdp::FakeWorld> world;
  std::unique_ptr<Model> model;
  std::unique_ptr<torch::optim::AdamW> adamw;
};

Fixture& fixture() {
  static Fixture* f = [] {
    auto* f = new Fixture;
    f->root = fs::temp_directory_path() / absl::StrCat("fsdp_folder_fuzz_", ::getpid());
    fs::remove_all(f->root);
    fs::create_directories(f->root);
    std::atexit([] { fs::remove_all(fixture().root); });
    f->dcp = f->root / "dcp";
    f->fsdp = f->root / "fsdp";
    fsdp::core_testing::on_ranks(2, [&](std::shared_ptr<fsdp::Communicator> comm) {
      Model model = tiny_lm(comm);
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(0.01));
      const int rank = comm->rank();
      const auto batch = fsdp::core_testing::TinyLmImpl::batch(0, 4);
      adamw.zero_grad();
      fsdp::core_testing::TinyLmImpl::loss(model->forward(batch.input.narrow(0, 2 * rank, 2)),
                                           batch.target.narrow(0, 2 * rank, 2))
          .backward();
      adamw.step();
      fsdp::save_dcp_checkpoint(*model, &adamw, f->dcp.string(),
                                fsdp::DcpCheckpointOptions().extras({{"step", int64_t{1}}}));
      fsdp::save_sharded_checkpoint(*model, &adamw, f->fsdp.string());
    });
    f->distcp0 = read_bytes(f->dcp / fsdp::dcp_data_file(0));
    f->world = fsdp::FakeWorld::create(1);
    f->model = std::make_unique<Model>(tiny_lm(f->world->communicator(0)));
    f->adamw = std::make_unique<torch::optim::AdamW>((*f->model)->parameters(),
                                                     torch::optim::AdamWOptions(0.01));
    return f;
  }();
  return *f;
}

std::vector<std::string_view> sections(std::string_view input) {
  std::vector<std::string_view> out;
  for (size_t at; (at = input.find(kSeparator)) != std::string_view::npos;) {
    out.push_back(input.substr(0, at));
    input.remove_prefix(at + kSeparator.size());
  }
  out.push_back(input);
  return out;
}

// ---- Seeds (FSDP_FUZZ_SEED_DIR).

void write_seed(const fs::path& dir, const std::string& name, char kind,
                const std::vector<std::string>& parts) {
  std::string input(1, kind);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) input.append(kSeparator);
    input.append(parts[i]);
  }
  write_bytes(dir / name, input);
}

// The first 2-D tensor entry stored in several chunks whose last chunk starts below row 0.
fsdp::DcpEntryMetadata* split_entry(fsdp::DcpMetadata& md) {
  for (fsdp::DcpEntryMetadata& entry : md.entries) {
    if (entry.is_tensor && entry.size.size() == 2 && entry.chunks.size() >= 2 &&
        entry.chunks.back().offsets[0] >= 1) {
      return &entry;
    }
  }
  return nullptr;
}

// Moves the last chunk of `entry` up by one row, keeping its size: it overlaps the chunk
// before it and the row it ended on is no longer stored.
void overlap_chunks(fsdp::DcpMetadata& md, fsdp::DcpEntryMetadata& entry) {
  const std::vector<int64_t> old = entry.chunks.back().offsets;
  entry.chunks.back().offsets[0] -= 1;
  for (fsdp::DcpStorageInfo& info : md.storage) {
    if (info.fqn == entry.fqn && info.chunk_offsets == old) {
      info.chunk_offsets = entry.chunks.back().offsets;
    }
  }
}

// The metadata.pt pickle with `change` applied to each tensor's "pieces" or "shape" ints.
std::string edit_fsdp_metadata(
    const std::string& pickle, const std::string& field,
    const std::function<void(std::vector<fsdp::PickleValuePtr>&)>& change) {
  fsdp::PickleHooks hooks;
  hooks.allow_global = [](const std::string&) { return true; };
  fsdp::PickleValuePtr root = fsdp::read_pickle(pickle, hooks, "metadata.pt");
  // Every dict in the value (bounded: our own file, a few levels deep); LibTorch's typed
  // containers are objects whose first argument is the container.
  std::vector<fsdp::PickleValue*> stack = {root.get()};
  while (!stack.empty()) {
    fsdp::PickleValue* value = stack.back();
    stack.pop_back();
    if (value->kind == fsdp::PickleValue::Kind::kDict) {
      for (size_t i = 0; i + 1 < value->items.size(); i += 2) {
        fsdp::PickleValue* item = value->items[i + 1].get();
        while (item->kind == fsdp::PickleValue::Kind::kObject && !item->items.empty()) {
          item = item->items[0].get();
        }
        if (value->items[i]->string == field && item->kind == fsdp::PickleValue::Kind::kList) {
          change(item->items);
        }
      }
    }
    for (const fsdp::PickleValuePtr& child : value->items) stack.push_back(child.get());
  }
  return fsdp::write_pickle(*root);
}

void write_seeds(const fs::path& dir) {
  Fixture& f = fixture();
  fs::create_directories(dir);
  const std::string good_dcp = read_bytes(f.dcp / fsdp::kDcpMetadataFile);
  write_seed(dir, "dcp_good", 0, {good_dcp});

  fsdp::DcpMetadata md = fsdp::parse_dcp_metadata(good_dcp, "seed");
  fsdp::DcpMetadata overlap = md;
  if (fsdp::DcpEntryMetadata* entry = split_entry(overlap)) {
    overlap_chunks(overlap, *entry);
    write_seed(dir, "dcp_overlap_and_hole", 0, {fsdp::serialize_dcp_metadata(overlap)});
  }
  fsdp::DcpMetadata huge = md;
  if (fsdp::DcpEntryMetadata* entry = split_entry(huge)) {
    entry->size[0] = int64_t{1} << 40;
    entry->chunks.back().sizes[0] = (int64_t{1} << 40) - entry->chunks.back().offsets[0];
    write_seed(dir, "dcp_huge_sizes", 0, {fsdp::serialize_dcp_metadata(huge)});
  }
  // "step" = -10^12, stored after the saved bytes of __0_0.distcp.
  fsdp::DcpMetadata step = md;
  const std::string step_pickle =
      fsdp::write_pickle(*fsdp::PickleValue::integer_value(-1000000000000));
  for (fsdp::DcpStorageInfo& info : step.storage) {
    if (info.fqn == "step") {
      info.relative_path = fsdp::dcp_data_file(0);
      info.offset = static_cast<int64_t>(f.distcp0.size());
      info.length = static_cast<int64_t>(torch_save_archive(step_pickle).size());
    }
  }
  write_seed(dir, "dcp_negative_step", 0, {fsdp::serialize_dcp_metadata(step), step_pickle});

  const std::string good_fsdp = data_pkl(f.fsdp / "metadata.pt");
  write_seed(dir, "fsdp_good", 1, {good_fsdp});
  // Each tensor's pieces: (rank, offset, numel) triples; the second piece one element
  // earlier overlaps the first and leaves the last element unstored.
  write_seed(dir, "fsdp_overlap_and_hole", 1,
             {edit_fsdp_metadata(good_fsdp, "pieces", [](std::vector<fsdp::PickleValuePtr>& ints) {
               if (ints.size() == 6 && ints[4]->integer > 0) --ints[4]->integer;
             })});
  write_seed(dir, "fsdp_huge_shape", 1,
             {edit_fsdp_metadata(good_fsdp, "shape", [](std::vector<fsdp::PickleValuePtr>& ints) {
               if (!ints.empty()) ints[0]->integer = int64_t{1} << 40;
             })});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  fixture();
  if (const char* dir = std::getenv("FSDP_FUZZ_SEED_DIR")) write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Fixture& f = fixture();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::vector<std::string_view> parts = sections(input.substr(1));
  try {
    if (data[0] % 2 == 0) {
      write_bytes(f.dcp / fsdp::kDcpMetadataFile, parts[0]);
      std::string distcp0 = f.distcp0;
      if (parts.size() > 1) distcp0 += torch_save_archive(parts[1]);
      write_bytes(f.dcp / fsdp::dcp_data_file(0), distcp0);
      fsdp::load_dcp_checkpoint(**f.model, f.adamw.get(), f.dcp.string());
    } else {
      write_bytes(f.fsdp / "metadata.pt", torch_save_archive(parts[0]));
      fsdp::load_sharded_checkpoint(**f.model, f.adamw.get(), f.fsdp.string());
    }
  } catch (const c10::Error&) {
    // A clear error is the expected outcome for most inputs.
  }
  return 0;
}
