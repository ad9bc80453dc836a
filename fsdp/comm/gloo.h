// The Gloo backend: host collectives over c10d's ProcessGroupGloo (LibTorch 2.11), the
// embedded default that needs no GPU. See Note [Gloo collectives] in gloo.cc.
//
//   c10::intrusive_ptr<c10d::Store> store = fsdp::connect_store(env, options);  // rendezvous.h
//   std::shared_ptr<fsdp::Communicator> comm = fsdp::make_gloo_communicator(
//       store, env.rank, env.world_size, fsdp::GlooOptions().timeout(std::chrono::seconds(30)));
//
// How the collectives map onto Gloo (see Note [Gloo collectives] in gloo.cc): all-gather
// is a direct exchange (each rank sends its input to every peer) into views of the flat
// output; reduce-scatter is the same exchange of the input's chunks followed by a local
// sum in rank order, so each rank sends and receives (W - 1)/W of the input, like a ring
// reduce-scatter; all-reduce is Gloo's ring all-reduce. Data that is only moved moves as
// bytes, so every dtype of is_supported_dtype works.
//
// Signals: make_gloo_communicator sets SIGPIPE to ignored if it is at its default, as
// Python does at start-up, so that a peer closing its connections surfaces as a CommError
// naming that peer instead of killing this process; a handler the program set is kept.
// Likewise, if the terminate handler is still libstdc++'s default, it installs one that
// names the collective and the likely cause when Gloo terminates the process from its
// transport thread (mismatched sizes without size checks; Note [Gloo terminations] in
// gloo.cc), then calls the default; a handler the program set is kept.
//
// Devices: CPU buffers, and CUDA buffers staged through host copies (Note [Gloo on device
// tensors] in gloo.cc: the issuing thread waits for its current stream).
//
// Threading: collectives are issued on the calling thread (one at a time, in the same
// order on every rank) and moved by Gloo's and c10d's threads; Work::wait may be called
// from any thread, and the first wait runs what completes the collective (a
// reduce-scatter's local sum). Work::is_completed of an all-gather or reduce-scatter is
// true only once it was waited for. PyTorch: ProcessGroupGloo.
#ifndef FSDP_COMM_GLOO_H_
#define FSDP_COMM_GLOO_H_

#include <chrono>
#include <memory>
#include <string>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/comm/communicator.h"

namespace fsdp {

struct GlooOptions {
  // Deadline of every collective (Gloo's own timeout, and Work::wait's default).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // Network interface to bind (like GLOO_SOCKET_IFNAME); wins over `hostname`.
  TORCH_ARG(std::string, interface) = "";
  // Address or host name to bind; "" = this host's name, or loopback if it does not
  // resolve (c10d's default device).
  TORCH_ARG(std::string, hostname) = "";
};

// Connects `world_size` ranks through `store` (every rank calls it; blocks until all
// have). Throws c10::Error if rank/world_size are out of range or the connection fails
// within the timeout.
std::shared_ptr<Communicator> make_gloo_communicator(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int world_size,
                                                     const GlooOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_COMM_GLOO_H_
