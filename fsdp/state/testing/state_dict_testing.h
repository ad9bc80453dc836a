// State-dict round trips inside training (REFERENCE §7: save -> zero -> load after every
// step), shared by the CPU and GPU state-dict tests, and the checkpoint tests' scratch
// directories (testonly).
#ifndef FSDP_STATE_TESTING_STATE_DICT_TESTING_H_
#define FSDP_STATE_TESTING_STATE_DICT_TESTING_H_

#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/state/state_dict.h"

namespace fsdp::state_testing {

// An empty directory `name` under the test's TEST_TMPDIR (/tmp outside Bazel), made anew.
inline std::filesystem::path scratch(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir = std::filesystem::path(tmp != nullptr ? tmp : "/tmp") / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Every shard and buffer set to zero (what a fresh, wrongly initialised model holds).
template <typename Net>
void zero_model(FullyShardedDataParallelImpl<Net>& model) {
  torch::NoGradGuard no_grad;
  for (at::Tensor shard : model.parameters()) shard.zero_();
  for (at::Tensor buffer : model.buffers()) buffer.zero_();
}

enum class Kind { kFull, kSharded, kLocal };

// The after-step callback of expect_parity_on (parity_testing.h) that saves the model's
// state dict of `kind`, zeroes the model and loads it back. A full state dict is taken
// with FullStateDictOptions::offload_to_cpu(`offload_to_cpu`), and its values are
// EXPECTed on the CPU with it, on the model's device without; it is loaded from there.
template <typename Net>
core_testing::AfterStep<Net> save_zero_load(Kind kind, bool offload_to_cpu = false) {
  return
      [kind, offload_to_cpu](FullyShardedDataParallelImpl<Net>& model, torch::optim::Optimizer&) {
        switch (kind) {
          case Kind::kFull: {
            const StateDict saved =
                full_state_dict(model, FullStateDictOptions().offload_to_cpu(offload_to_cpu));
            const c10::Device want =
                offload_to_cpu ? c10::Device(c10::kCPU) : model.device_handle().device();
            for (const auto& item : saved) EXPECT_EQ(item.value().device(), want) << item.key();
            zero_model(model);
            load_full_state_dict(model, saved);
            break;
          }
          case Kind::kSharded: {
            const ShardedStateDict saved = sharded_state_dict(model);
            zero_model(model);
            load_sharded_state_dict(model, saved);
            break;
          }
          case Kind::kLocal: {
            const LocalStateDict saved = local_state_dict(model);
            zero_model(model);
            load_local_state_dict(model, saved);
            break;
          }
        }
      };
}

}  // namespace fsdp::state_testing

#endif  // FSDP_STATE_TESTING_STATE_DICT_TESTING_H_
