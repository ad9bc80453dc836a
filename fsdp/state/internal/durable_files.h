// Crash-safe checkpoint folders, shared by the sharded checkpoints (checkpoint.cc) and
// Distributed Checkpoint folders (dcp_checkpoint.cc): a checkpoint is assembled in a
// hidden sibling directory (".<name>.partial-<token>"), its files written with
// fsdp/formats/atomic_file.h, and published with one rename. Not a public API.
// Errors: c10::Error naming the path and the system's reason.
#ifndef FSDP_STATE_INTERNAL_DURABLE_FILES_H_
#define FSDP_STATE_INTERNAL_DURABLE_FILES_H_

#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>

#include <ATen/core/TensorBody.h>

#include "fsdp/comm/communicator.h"

namespace fsdp::state_internal {

std::string errno_text();

// An exception's message without LibTorch's C++ backtrace.
std::string message_of(const std::exception& e);

// How much space a failed save needed and how much the file system holding `dir` has
// free, after its partial directory is gone.
std::string space_note(const std::filesystem::path& dir, int64_t needed);

// A partial directory: ".<name>.partial-<token>".
bool is_partial_name(const std::string& name);

// Removes `partial` (several ranks may do so at once: retried until it is gone).
void remove_partial(const std::filesystem::path& partial);

// Moves the complete `partial` directory to `dir`, swapping out an existing one.
void publish(const std::filesystem::path& partial, const std::filesystem::path& dir);

// The partial directory of one save into `target` (rank 0's pid and a save count,
// broadcast from rank 0), so that saves running at once into one directory never mix
// their files: each publishes a complete checkpoint, the last one wins. Collective (one
// broadcast of an int64 in `on_device` options).
std::filesystem::path partial_directory(const std::filesystem::path& target, Communicator& comm,
                                        const at::TensorOptions& on_device);

}  // namespace fsdp::state_internal

#endif  // FSDP_STATE_INTERNAL_DURABLE_FILES_H_
