// fsdp: Fully Sharded Data Parallel for the LibTorch C++ frontend. This umbrella header
// includes every public header of the library (target @fsdp//fsdp); a translation unit
// that needs only part of it may include the narrower headers listed below instead, which
// compiles faster.
//
//   #include "fsdp/fsdp.h"
//
//   auto comm = fsdp::init_from_environment();                      // torchrun, fsdp_run
//   fsdp::FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(),
//                                                 fsdp::FullyShardedDataParallelOptions(comm));
//   torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.01);  // the flat shards
//
// Layers (each header documents its own API; PyTorch counterparts are named there):
//   names and shard geometry     fsdp/base/names.h, fsdp/base/shard_geometry.h
//   communication                fsdp/comm/communicator.h (CommError), gloo.h, nccl.h,
//                                fake.h, rendezvous.h, launcher.h
//   choosing units               fsdp/wrap/module_tree.h, torchscript_tree.h, policy.h,
//                                plan.h, recursive_wrap.h, wrap_context.h
//   sharded training             fsdp/core/fully_sharded.h (FullyShardedDataParallel,
//                                FullyShardedRoot; with unit.h, training_state.h),
//                                options.h (the enums and option structs),
//                                flat_param.h, checkpoint_wrapper.h, tracking_allocator.h,
//                                fused_adamw.h (AdamW on ATen's fused kernel)
//   state dicts and checkpoints  fsdp/state/state_dict.h, optim_state_dict.h, checkpoint.h,
//                                async_checkpoint.h, dcp_checkpoint.h (PyTorch Distributed
//                                Checkpoint folders)
//   file formats                 fsdp/formats/safetensors.h, pickle.h, dcp.h
//   LoRA adapters                fsdp/lora/lora.h, adapter_file.h (PEFT's files)
//
// Errors: c10::Error throughout (fsdp::CommError, a c10::Error, for communication
// failures). Threading: see each header.
#ifndef FSDP_FSDP_H_
#define FSDP_FSDP_H_

#include "fsdp/base/names.h"
#include "fsdp/base/shard_geometry.h"
#include "fsdp/comm/communicator.h"
#include "fsdp/comm/fake.h"
#include "fsdp/comm/gloo.h"
#include "fsdp/comm/launcher.h"
#include "fsdp/comm/nccl.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/caching_cpu_allocator.h"
#include "fsdp/core/checkpoint_wrapper.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/fused_adamw.h"
#include "fsdp/core/options.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/core/training_state.h"
#include "fsdp/core/unit.h"
#include "fsdp/formats/dcp.h"
#include "fsdp/formats/pickle.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/lora/lora.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/dcp_checkpoint.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "fsdp/state/state_dict.h"
#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/plan.h"
#include "fsdp/wrap/policy.h"
#include "fsdp/wrap/recursive_wrap.h"
#include "fsdp/wrap/torchscript_tree.h"
#include "fsdp/wrap/wrap_context.h"

#endif  // FSDP_FSDP_H_
