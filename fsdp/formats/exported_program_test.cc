// The .pt2 reader: modules and classes, parameters with shapes, dtypes, ties and frozen
// flags, buffers, a meta-device export, and every bad input with its reason. Archives are
// written here with PyTorchStreamWriter in torch.export.save's layout (model.json in the
// 8.17 schema of torch 2.11); tests/plan_oracle_test.sh reads archives torch itself wrote.
#include "fsdp/formats/exported_program.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// {"dtype": d, "sizes": [{"as_int": n}, ...], ...} as torch.export writes tensor metadata.
Json tensor_meta(int dtype, std::vector<int64_t> sizes, bool requires_grad,
                 const std::string& device = "cpu") {
  Json json_sizes = Json::array();
  for (const int64_t size : sizes) json_sizes.push_back({{"as_int", size}});
  return {{"dtype", dtype},
          {"sizes", json_sizes},
          {"requires_grad", requires_grad},
          {"device", {{"type", device}, {"index", nullptr}}},
          {"layout", 7}};
}

// A graph node of the module stack `stack` that reads the graph inputs `reads`.
Json node_with_stack(const std::string& stack, std::vector<std::string> reads = {}) {
  Json inputs = Json::array();
  for (const std::string& name : reads) {
    inputs.push_back({{"name", "input"}, {"arg", {{"as_tensor", {{"name", name}}}}}});
  }
  return {{"target", "torch.ops.aten.linear.default"},
          {"inputs", inputs},
          {"metadata", {{"nn_module_stack", stack}}}};
}

// A model like
//   class Net(nn.Module):  # emb, blocks = ModuleList([Linear(4, 4)]), head, unused
//     def forward(self, x): return self.head(self.blocks[0](self.emb(x)))
// with head.weight tied to emb.weight, blocks.0.bias frozen, a persistent int64 buffer
// blocks.0.steps and a non-persistent bool buffer mask (not among the weights). As
// torch.export writes it, the graph reads the tied weight through p_head_weight only, and
// on the meta device every parameter's weight file is weight_0.
struct Archive {
  Json model;
  Json weights;
  std::map<std::string, int64_t> weight_bytes;  // weight_N -> bytes stored

  explicit Archive(const std::string& device = "cpu") {
    const bool meta = device == "meta";
    Json values = {
        {"p_emb_weight", tensor_meta(7, {10, 4}, true, device)},
        {"p_blocks_0_weight", tensor_meta(13, {4, 4}, true, device)},
        {"p_blocks_0_bias", tensor_meta(13, {4}, false, device)},
        {"p_head_weight", tensor_meta(7, {10, 4}, true, device)},
        {"b_blocks_0_steps", tensor_meta(5, {}, false, device)},
        {"b_mask", tensor_meta(12, {4}, false, device)},
    };
    auto param = [](const char* arg, const char* name) {
      return Json{{"parameter", {{"arg", {{"name", arg}}}, {"parameter_name", name}}}};
    };
    auto buffer = [](const char* arg, const char* name, bool persistent) {
      return Json{{"buffer",
                   {{"arg", {{"name", arg}}}, {"buffer_name", name}, {"persistent", persistent}}}};
    };
    const std::string root = "L__self__,,__main__.Net;";
    Json nodes = {
        node_with_stack(root + "L__self__emb,emb,torch.nn.modules.sparse.Embedding",
                        {"p_head_weight", "x"}),
        // A key with commas inside brackets, as serialize.py allows.
        node_with_stack(root + "getattr(L['self'].blocks, '0'),blocks.0,"
                               "torch.nn.modules.linear.Linear",
                        {"embedding", "p_blocks_0_weight", "p_blocks_0_bias"}),
        node_with_stack(root + "L__self__head@1,head@1,torch.nn.modules.linear.Linear",
                        {"linear", "p_head_weight"}),
        {{"target", "output"}},  // a node without metadata
    };
    Json call_graph = Json::array();
    for (const char* fqn : {"", "emb", "blocks", "blocks.0", "head", "unused"}) {
      call_graph.push_back({{"fqn", fqn}, {"signature", nullptr}});
    }
    model = {
        {"schema_version", {{"major", 8}, {"minor", 17}}},
        {"torch_version", "2.11.0+cu130"},
        {"graph_module",
         {{"graph", {{"nodes", nodes}, {"tensor_values", values}}},
          {"signature",
           {{"input_specs",
             {param("p_emb_weight", "emb.weight"),
              param("p_blocks_0_weight", "blocks.0.weight"),
              param("p_blocks_0_bias", "blocks.0.bias"),
              param("p_head_weight", "head.weight"),
              buffer("b_blocks_0_steps", "blocks.0.steps", true),
              buffer("b_mask", "mask", false),
              {{"user_input", {{"arg", {{"as_tensor", {{"name", "x"}}}}}}}}}}}},
          {"module_call_graph", call_graph}}},
    };
    auto entry = [&](const char* file, const char* value, bool is_param) {
      return Json{{"path_name", file},
                  {"is_param", is_param},
                  {"use_pickle", false},
                  {"tensor_meta", values[value]}};
    };
    const char* w1 = meta ? "weight_0" : "weight_1";
    const char* w2 = meta ? "weight_0" : "weight_2";
    const char* w3 = meta ? "weight_1" : "weight_3";
    weights = {{"config",
                {{"emb.weight", entry("weight_0", "p_emb_weight", true)},
                 {"head.weight", entry("weight_0", "p_head_weight", true)},
                 {"blocks.0.weight", entry(w1, "p_blocks_0_weight", true)},
                 {"blocks.0.bias", entry(w2, "p_blocks_0_bias", true)},
                 {"blocks.0.steps", entry(w3, "b_blocks_0_steps", false)}}}};
    if (meta) {
      weight_bytes = {{"weight_0", 0}, {"weight_1", 0}};
    } else {
      weight_bytes = {{"weight_0", 160}, {"weight_1", 32}, {"weight_2", 8}, {"weight_3", 8}};
    }
  }

  // Writes the archive to a fresh file named `stem`.pt2 (its zip folder is `stem`).
  std::string write(const std::string& stem, bool with_format = true) const {
    const std::string path = testing::TempDir() + stem + ".pt2";
    caffe2::serialize::PyTorchStreamWriter writer(path);
    auto put = [&](const std::string& name, const std::string& bytes) {
      writer.writeRecord(name, bytes.data(), bytes.size());
    };
    if (with_format) put("archive_format", "pt2");
    put("models/model.json", model.dump());
    put("data/weights/model_weights_config.json", weights.dump());
    for (const auto& [file, bytes] : weight_bytes) {
      put("data/weights/" + file, std::string(static_cast<size_t>(bytes), '\0'));
    }
    writer.writeEndOfFile();
    return path;
  }

  ExportedProgramInfo parse() const {
    return parse_exported_program(model.dump(), weights.dump(), "test");
  }
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(ExportedProgramTest, ReadsModulesParametersBuffersAndTies) {
  const ExportedProgramInfo info = read_exported_program(Archive().write("net"));
  EXPECT_EQ(info.schema_major, 8);
  EXPECT_EQ(info.schema_minor, 17);
  EXPECT_EQ(info.torch_version, "2.11.0+cu130");
  EXPECT_FALSE(info.meta);
  std::vector<std::string> modules;
  for (const ExportedModuleInfo& m : info.modules) modules.push_back(m.fqn + "=" + m.class_path);
  EXPECT_THAT(modules, ElementsAre("=__main__.Net", "emb=torch.nn.modules.sparse.Embedding",
                                   "blocks=", "blocks.0=torch.nn.modules.linear.Linear",
                                   "head=torch.nn.modules.linear.Linear", "unused="));
  ASSERT_EQ(info.parameters.size(), 4u);
  const ExportedTensorInfo& emb = info.parameters[0];
  EXPECT_EQ(emb.fqn, "emb.weight");
  EXPECT_THAT(emb.sizes, ElementsAre(10, 4));
  EXPECT_EQ(emb.dtype, c10::ScalarType::Float);
  EXPECT_TRUE(emb.requires_grad);
  EXPECT_EQ(emb.device, "cpu");
  EXPECT_EQ(emb.weight_file, "weight_0");
  EXPECT_EQ(emb.stored_bytes, 160);
  EXPECT_EQ(emb.numel(), 40);
  EXPECT_EQ(emb.nbytes(), 160);
  const ExportedTensorInfo& bias = info.parameters[2];
  EXPECT_EQ(bias.fqn, "blocks.0.bias");
  EXPECT_EQ(bias.dtype, c10::ScalarType::BFloat16);
  EXPECT_FALSE(bias.requires_grad);  // frozen
  EXPECT_EQ(bias.nbytes(), 8);
  EXPECT_EQ(info.parameters[3].fqn, "head.weight");
  EXPECT_EQ(info.parameters[3].weight_file, "weight_0");  // tied to emb.weight
  EXPECT_EQ(info.parameters[3].tied_to, "emb.weight");
  EXPECT_EQ(info.parameters[3].graph_input, "p_head_weight");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(info.parameters[i].tied_to, "") << i;
  ASSERT_EQ(info.buffers.size(), 2u);
  EXPECT_EQ(info.buffers[0].fqn, "blocks.0.steps");
  EXPECT_EQ(info.buffers[0].dtype, c10::ScalarType::Long);
  EXPECT_TRUE(info.buffers[0].sizes.empty());
  EXPECT_EQ(info.buffers[0].numel(), 1);
  EXPECT_FALSE(info.buffers[0].requires_grad);
  EXPECT_TRUE(info.buffers[0].persistent);
  EXPECT_EQ(info.buffers[0].stored_bytes, 8);
  EXPECT_EQ(info.buffers[1].fqn, "mask");
  EXPECT_EQ(info.buffers[1].dtype, c10::ScalarType::Bool);
  EXPECT_FALSE(info.buffers[1].persistent);
  EXPECT_EQ(info.buffers[1].weight_file, "");
}

TEST(ExportedProgramTest, ParseLeavesStoredBytesUnknown) {
  const ExportedProgramInfo info = Archive().parse();
  EXPECT_EQ(info.parameters[0].stored_bytes, -1);
  EXPECT_EQ(info.modules.size(), 6u);
}

TEST(ExportedProgramTest, MetaDeviceExportHasZeroByteWeights) {
  const ExportedProgramInfo info = read_exported_program(Archive("meta").write("meta_net"));
  EXPECT_TRUE(info.meta);
  EXPECT_EQ(info.parameters[0].device, "meta");
  EXPECT_EQ(info.parameters[0].stored_bytes, 0);
  EXPECT_EQ(info.parameters[0].nbytes(), 160);
  // Every parameter is in weight_0; the tie comes from the graph (Note [Ties in .pt2
  // archives]): emb.weight is never read, emb's node reads p_head_weight.
  EXPECT_EQ(info.parameters[2].weight_file, "weight_0");
  std::vector<std::string> tied;
  for (const ExportedTensorInfo& p : info.parameters) tied.push_back(p.fqn + ">" + p.tied_to);
  EXPECT_THAT(tied, ElementsAre("emb.weight>", "blocks.0.weight>", "blocks.0.bias>",
                                "head.weight>emb.weight"));
}

TEST(ExportedProgramTest, MetaParameterNeverReadByACalledModuleStaysUntied) {
  Archive archive("meta");
  // emb's node reads nothing of head's.
  archive.model["graph_module"]["graph"]["nodes"][0] = node_with_stack(
      "L__self__,,__main__.Net;L__self__emb,emb,torch.nn.modules.sparse.Embedding", {"x"});
  for (const ExportedTensorInfo& p : archive.parse().parameters) EXPECT_EQ(p.tied_to, "") << p.fqn;
}

TEST(ExportedProgramTest, MapsEverySchemaDtype) {
  using c10::ScalarType;
  const std::map<int, ScalarType> expected = {{1, ScalarType::Byte},
                                              {2, ScalarType::Char},
                                              {3, ScalarType::Short},
                                              {4, ScalarType::Int},
                                              {5, ScalarType::Long},
                                              {6, ScalarType::Half},
                                              {7, ScalarType::Float},
                                              {8, ScalarType::Double},
                                              {9, ScalarType::ComplexHalf},
                                              {10, ScalarType::ComplexFloat},
                                              {11, ScalarType::ComplexDouble},
                                              {12, ScalarType::Bool},
                                              {13, ScalarType::BFloat16},
                                              {28, ScalarType::UInt16},
                                              {29, ScalarType::Float8_e4m3fn},
                                              {30, ScalarType::Float8_e5m2},
                                              {31, ScalarType::Float8_e4m3fnuz},
                                              {32, ScalarType::Float8_e5m2fnuz}};
  for (const auto& [number, dtype] : expected) {
    EXPECT_EQ(exported_program_dtype(number), dtype) << number;
  }
  for (const int bad : {0, 14, 27, 33, -1}) {
    EXPECT_THAT(error_of([&] { exported_program_dtype(bad); }),
                HasSubstr("unknown export-schema dtype number " + std::to_string(bad)));
  }
}

TEST(ExportedProgramTest, FileErrorsSayWhatTheFileIs) {
  const std::string dir = testing::TempDir();
  std::ofstream(dir + "text.pt2") << "not a zip at all";
  EXPECT_THAT(error_of([&] { read_exported_program(dir + "text.pt2"); }),
              HasSubstr("is not a readable zip archive (missing, truncated or damaged"));
  EXPECT_THAT(
      error_of([&] { read_exported_program(dir + "absent.pt2"); }),
      HasSubstr("cannot open .pt2 archive '" + dir + "absent.pt2': No such file or directory"));
  // A FIFO is refused by name, before anything opens it (which would block).
  ::unlink((dir + "fifo.pt2").c_str());
  ASSERT_EQ(::mkfifo((dir + "fifo.pt2").c_str(), 0600), 0);
  EXPECT_THAT(error_of([&] { read_exported_program(dir + "fifo.pt2"); }),
              HasSubstr("fifo.pt2' is a FIFO (named pipe); .pt2 archive must be a regular file "
                        "(or a symlink to one)"));

  const std::string good = Archive().write("whole");
  std::stringstream bytes;
  bytes << std::ifstream(good, std::ios::binary).rdbuf();
  const std::string all = bytes.str();
  std::ofstream(dir + "half.pt2", std::ios::binary) << all.substr(0, all.size() / 2);
  EXPECT_THAT(error_of([&] { read_exported_program(dir + "half.pt2"); }),
              HasSubstr("is not a readable zip archive (missing, truncated or damaged"));

  EXPECT_THAT(error_of([&] { read_exported_program(Archive().write("plain", false)); }),
              HasSubstr("is a zip archive but not a .pt2 archive (no archive_format record)"));
}

TEST(ExportedProgramTest, MissingOrShortWeightsAreNamed) {
  Archive missing;
  missing.weight_bytes.erase("weight_1");
  EXPECT_THAT(error_of([&] { read_exported_program(missing.write("missing")); }),
              HasSubstr("the weight of blocks.0.weight (data/weights/weight_1) is missing"));

  Archive short_weight;
  short_weight.weight_bytes["weight_0"] = 100;
  EXPECT_THAT(error_of([&] { read_exported_program(short_weight.write("short")); }),
              HasSubstr("the weight of emb.weight (data/weights/weight_0) holds 100 bytes, "
                        "expected at least 160 (Float, 40 elements)"));

  Archive pickled;  // a tensor subclass's weight is a torch.save pickle of any size
  pickled.weight_bytes["weight_0"] = 100;
  pickled.weights["config"]["emb.weight"]["use_pickle"] = true;
  pickled.weights["config"]["head.weight"]["use_pickle"] = true;
  EXPECT_TRUE(read_exported_program(pickled.write("pickled")).parameters[0].pickled);

  Archive unlisted;
  unlisted.weights["config"].erase("blocks.0.bias");
  EXPECT_THAT(error_of([&] { unlisted.parse(); }),
              HasSubstr("parameter blocks.0.bias has no entry in "
                        "data/weights/model_weights_config.json (a missing weight)"));
}

TEST(ExportedProgramTest, SchemaErrorsSayWhatWasExpected) {
  Archive old;
  old.model["schema_version"]["major"] = 7;
  EXPECT_THAT(error_of([&] { old.parse(); }),
              HasSubstr("unsupported export schema version 7.17: this reader understands "
                        "version 8.x"));

  EXPECT_THAT(error_of([] { parse_exported_program("{", "{}", "x"); }),
              HasSubstr("x: models/model.json is not valid JSON"));
  EXPECT_THAT(error_of([] { parse_exported_program("[1]", "{}", "x"); }),
              HasSubstr("x: models/model.json is not a JSON object"));

  Archive no_specs;
  no_specs.model["graph_module"]["signature"].erase("input_specs");
  EXPECT_THAT(error_of([&] { no_specs.parse(); }),
              HasSubstr("graph_module.signature has no \"input_specs\""));

  Archive dtype;
  dtype.model["graph_module"]["graph"]["tensor_values"]["p_emb_weight"]["dtype"] = 99;
  EXPECT_THAT(error_of([&] { dtype.parse(); }), HasSubstr("dtype number 99"));

  Archive symbolic;
  symbolic.model["graph_module"]["graph"]["tensor_values"]["p_emb_weight"]["sizes"][0] = {
      {"as_expr", {{"expr_str", "s0"}}}};
  EXPECT_THAT(error_of([&] { symbolic.parse(); }),
              HasSubstr("sizes[0] of emb.weight is symbolic or malformed"));

  Archive no_value;
  no_value.model["graph_module"]["graph"]["tensor_values"].erase("p_head_weight");
  EXPECT_THAT(error_of([&] { no_value.parse(); }),
              HasSubstr("head.weight (graph input 'p_head_weight') has no entry in "
                        "graph.tensor_values"));

  Archive stack;
  stack.model["graph_module"]["graph"]["nodes"][0] = node_with_stack("a,b");
  EXPECT_THAT(error_of([&] { stack.parse(); }),
              HasSubstr("nn_module_stack entry 'a,b' is not of the form key,fqn,class"));

  Archive path;
  path.weights["config"]["emb.weight"]["path_name"] = "../etc/passwd";
  EXPECT_THAT(error_of([&] { path.parse(); }), HasSubstr("invalid path_name '../etc/passwd'"));
}

TEST(ExportedProgramTest, RecognisesArchiveRecords) {
  EXPECT_TRUE(is_exported_program_records({"models/model.json", "archive_format"}));
  EXPECT_FALSE(is_exported_program_records({"data.pkl", "constants.pkl"}));
}

}  // namespace
}  // namespace fsdp
