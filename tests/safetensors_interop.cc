// The C++ half of safetensors_interop_test.sh: safetensors files move both ways between
// fsdp and the safetensors Python library (safetensors_interop.py), every dtype fsdp
// reads, and Hugging Face folders into and out of FSDP models at W = 1, 2, 3 (ranks as
// threads). Values follow formulas both halves compute, so each side checks exact values.
//
//   safetensors_interop write DIR   DIR/fsdp_dtypes.safetensors (every dtype) and
//                                   DIR/fsdp_model/ (save_safetensors at W = 2, sharded)
//   safetensors_interop check DIR   reads DIR/py_dtypes.safetensors (save_file) and loads
//                                   DIR/py_model/ (save_torch_state_dict, sharded) at
//                                   W = 1, 2, 3, and DIR/hf_llama/ (transformers'
//                                   save_pretrained, tied embeddings) into a module tree
//                                   of the same names with lm_head.weight tied
#include <cstdio>
#include <string>

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

using core_testing::NetImpl;

const at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                                  at::kInt,   at::kShort,  at::kChar, at::kByte,     at::kBool};

// Keep in step with safetensors_interop.py: value(k, shape, dtype).
at::Tensor value(int64_t k, at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const at::Tensor i = at::arange(numel, at::kLong);
  if (dtype == at::kBool) return ((i + k) % 3 == 0).reshape(shape);
  if (at::isFloatingType(dtype)) return ((i * 3 + k) * 0.25).reshape(shape).to(dtype);
  return ((i * 7 + k) % 100).reshape(shape).to(dtype);
}

// The model's state dict by the formula: the k-th entry gets value(k, ...).
StateDict model_values() {
  StateDict out;
  int64_t k = 0;
  for (const auto& item : module_state_dict(*core_testing::make<NetImpl>())) {
    out.insert(item.key(), value(k++, item.value().sizes(), item.value().scalar_type()));
  }
  return out;
}

void on_ranks(int world_size, const std::function<void(FullyShardedDataParallel<NetImpl>&)>& fn) {
  core_testing::on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<NetImpl> model(core_testing::make<NetImpl>(),
                                            FullyShardedDataParallelOptions(comm));
    fn(model);
  });
}

// A module tree with a parameter of each name and shape in `file`, plus lm_head.weight
// tied to model.embed_tokens.weight (as LlamaForCausalLM with tie_word_embeddings).
struct TreeImpl : torch::nn::Module {
  explicit TreeImpl(const SafetensorsFile& file) {
    for (const SafetensorsTensorInfo& t : file.header().tensors) {
      add(t.name, at::zeros(t.shape, at::TensorOptions().dtype(t.dtype)));
    }
    add("lm_head.weight", named_parameters()["model.embed_tokens.weight"]);
  }
  void add(const std::string& name, const at::Tensor& tensor) {
    torch::nn::Module* module = this;
    size_t begin = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', begin)) {
      const std::string child = name.substr(begin, dot - begin);
      auto children = module->named_children();
      module = children.contains(child)
                   ? children[child].get()
                   : module->register_module(child, std::make_shared<torch::nn::Module>()).get();
      begin = dot + 1;
    }
    module->register_parameter(name.substr(begin), tensor);
  }
  at::Tensor forward(at::Tensor x) { return x; }
};

void check_transformers_llama(const std::string& dir) {
  const SafetensorsFile expected = SafetensorsFile::open(dir + "/hf_llama_expected.safetensors");
  TORCH_CHECK(!SafetensorsCheckpoint::open(dir + "/hf_llama").contains("lm_head.weight"),
              "transformers wrote lm_head.weight");
  for (int world_size : {1, 2, 3}) {
    core_testing::on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      FullyShardedDataParallel<TreeImpl> model(std::make_shared<TreeImpl>(expected),
                                               FullyShardedDataParallelOptions(comm));
      load_safetensors(*model, dir + "/hf_llama");
      const StateDict got = full_state_dict(*model);
      for (const SafetensorsTensorInfo& t : expected.header().tensors) {
        TORCH_CHECK(at::equal(got[t.name], expected.read(t.name)), t.name, " differs");
      }
      TORCH_CHECK(at::equal(got["lm_head.weight"], expected.read("model.embed_tokens.weight")),
                  "lm_head.weight is not the embedding");
    });
    std::printf("hf_llama/ at W = %d: %zu tensors equal, lm_head.weight tied\n", world_size,
                expected.header().tensors.size() + 1);
  }
}

int write(const std::string& dir) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (at::ScalarType dtype : kDtypes) {
    tensors.emplace_back(safetensors_dtype_name(dtype), value(5, {3, 4}, dtype));
  }
  save_safetensors_file(dir + "/fsdp_dtypes.safetensors", tensors);
  on_ranks(2, [&](FullyShardedDataParallel<NetImpl>& model) {
    load_full_state_dict(*model, model_values());
    save_safetensors(*model, dir + "/fsdp_model", SaveSafetensorsOptions().max_shard_size(200));
  });
  return 0;
}

int check(const std::string& dir) {
  const SafetensorsFile file = SafetensorsFile::open(dir + "/py_dtypes.safetensors");
  for (at::ScalarType dtype : kDtypes) {
    const std::string name = safetensors_dtype_name(dtype);
    TORCH_CHECK(at::equal(file.read(name), value(9, {2, 5}, dtype)), "py_dtypes ", name,
                " differs from the formula");
    TORCH_CHECK(at::equal(file.read_range(name, 3, 4),
                          value(9, {2, 5}, dtype).reshape({-1}).narrow(0, 3, 4)),
                "py_dtypes ", name, " range differs");
  }
  std::printf("py_dtypes.safetensors: %zu dtypes equal\n", std::size(kDtypes));
  const StateDict want = model_values();
  TORCH_CHECK(SafetensorsCheckpoint::open(dir + "/py_model").files().size() > 1,
              "py_model should be sharded");
  for (int world_size : {1, 2, 3}) {
    on_ranks(world_size, [&](FullyShardedDataParallel<NetImpl>& model) {
      load_safetensors(*model, dir + "/py_model");
      const StateDict got = full_state_dict(*model);
      for (const auto& item : want) {
        TORCH_CHECK(at::equal(got[item.key()], item.value()), "W = ", world_size, ": ", item.key(),
                    " differs");
      }
    });
    std::printf("py_model/ at W = %d: %zu tensors equal\n", world_size, want.size());
  }
  check_transformers_llama(dir);
  return 0;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode == "write") return fsdp::write(argv[2]);
  if (mode == "check") return fsdp::check(argv[2]);
  std::fprintf(stderr, "usage: safetensors_interop write|check DIR\n");
  return 2;
}
