// The C++ half of llama_hf_test.sh: loads a Hugging Face folder into fsdp's decoder
// (//models) at several world sizes (ranks as threads, FULL_SHARD,
// each decoder layer a unit) and writes the logits of the same token ids for each.
//
//   llama_logits HF_DIR IDS_FILE OUT_FILE W...
//
// IDS_FILE: torch.save({"ids": int64 [batch, time]}); OUT_FILE gets {"w<W>": logits} for
// every W (rank 0's; every rank computes the whole batch).
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_checkpoint.h"

namespace fsdp {
namespace {

at::Tensor logits_at(const std::string& dir, const at::Tensor& ids, int world_size) {
  const models::DecoderConfig config = models::load_decoder_config(dir + "/config.json");
  at::Tensor result;
  FakeWorld::run(FakeWorld::create(world_size), [&](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    auto module = std::make_shared<models::CausalLMImpl>(config);
    module->to(models::hf_weights_dtype(dir));
    FullyShardedDataParallel<models::CausalLMImpl> model(module,
                                                         FullyShardedDataParallelOptions(self));
    // A unit per decoder layer and the root, and the embeddings' and the head's when untied.
    const int64_t units = config.num_hidden_layers + 1 + (config.tie_word_embeddings ? 0 : 2);
    TORCH_CHECK(int64_t(model->units().size()) == units, "expected ", units, " units, got ",
                model->units().size());
    models::load_hf_weights(*model, dir);
    torch::NoGradGuard no_grad;
    const at::Tensor logits = model->forward(ids);
    if (comm.rank() == 0) result = logits;
  });
  return result;
}

int run(int argc, char** argv) {
  const std::string dir = argv[1];
  const at::Tensor ids = load_state_dict(argv[2])["ids"];
  StateDict out;
  for (int i = 4; i < argc; ++i) {
    const int world_size = std::atoi(argv[i]);
    out.insert("w" + std::to_string(world_size), logits_at(dir, ids, world_size));
  }
  save_state_dict(out, argv[3]);
  return 0;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: llama_logits HF_DIR IDS_FILE OUT_FILE W...\n";
    return 2;
  }
  return fsdp::run(argc, argv);
}
