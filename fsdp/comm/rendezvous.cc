#include "fsdp/comm/rendezvous.h"

#include <netdb.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdp/comm/nccl.h"

namespace fsdp {
namespace {

// The variable names of one launcher.
struct Scheme {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

constexpr Scheme kSchemes[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

// The variable's integer value, `fallback` if unset; throws if set but not an integer
// in [min, max].
int int_variable(const EnvLookup& lookup, const char* name, int fallback, int min, int max) {
  const std::optional<std::string> value = lookup(name);
  if (!value) return fallback;
  int parsed = 0;
  TORCH_CHECK(absl::SimpleAtoi(*value, &parsed) && parsed >= min && parsed <= max, name, "='",
              *value, "' is not an integer in [", min, ", ", max,
              "]; check how the job was "
              "launched");
  return parsed;
}

// The ranks of this Slurm job step on this node. SLURM_NTASKS_PER_NODE is set only with
// --ntasks-per-node, and a step inherits its batch job's value (srun -n 1 in a job of 2
// tasks per node); SLURM_STEP_TASKS_PER_NODE always holds the step's counts per node,
// "4(x2),3" for 4 on nodes 0 and 1 and 3 on node 2, this node being SLURM_NODEID.
// nullopt without SLURM_STEP_TASKS_PER_NODE; throws unless it gives this node a count in
// [1, world_size].
std::optional<int> slurm_step_tasks_here(const EnvLookup& lookup, int world_size) {
  const std::optional<std::string> counts = lookup("SLURM_STEP_TASKS_PER_NODE");
  if (!counts) return std::nullopt;
  const int node = int_variable(lookup, "SLURM_NODEID", 0, 0, world_size - 1);
  std::optional<int> here;
  int counted = 0;  // nodes 0 to counted - 1 have their counts in the parts seen
  for (absl::string_view part : absl::StrSplit(*counts, ',')) {
    const size_t times = part.find("(x");
    int tasks = 0;
    int nodes = 1;
    if (!absl::SimpleAtoi(part.substr(0, times), &tasks) ||
        (times != absl::string_view::npos &&
         (!absl::EndsWith(part, ")") ||
          !absl::SimpleAtoi(part.substr(times + 2, part.size() - times - 3), &nodes)))) {
      break;
    }
    counted += nodes;
    if (node < counted) {
      if (tasks >= 1 && tasks <= world_size) here = tasks;
      break;
    }
  }
  TORCH_CHECK(here, "SLURM_STEP_TASKS_PER_NODE='", *counts, "' gives no task count in [1, ",
              world_size, "] for node ", node, " (SLURM_NODEID); check how the job was launched");
  return here;
}

// Note [A partial torchrun environment]
// torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE for every rank; a
// process is its rank only with both RANK and WORLD_SIZE. One that has some of them but
// not both (RANK=0 exported by hand, a variable left over in the shell) would otherwise
// count as launched by nothing and start its own ranks, ignoring what the user set; so
// it is refused, naming what is set and what is missing. Only when no other launcher's
// variables are complete: a Slurm or MPI job whose script exports LOCAL_RANK (or RANK)
// alone for its programs stays that launcher's job.
void refuse_partial_torchrun(const EnvLookup& lookup) {
  const Scheme& torchrun = kSchemes[0];
  std::vector<std::string> set;
  std::vector<std::string> set_names;
  for (const char* name :
       {torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.local_world_size}) {
    if (const std::optional<std::string> value = lookup(name)) {
      set.push_back(absl::StrCat(name, "='", *value, "'"));
      set_names.push_back(name);
    }
  }
  if (set.empty()) return;
  std::vector<std::string> missing;
  for (const char* name : {torchrun.rank, torchrun.world_size}) {
    if (!lookup(name)) missing.push_back(name);
  }
  TORCH_CHECK(false, "rendezvous: ", absl::StrJoin(set, " and "), set.size() == 1 ? " is" : " are",
              " set but ", absl::StrJoin(missing, " and "), missing.size() == 1 ? " is" : " are",
              " not: a rank of a launched job has RANK, WORLD_SIZE, LOCAL_RANK and "
              "LOCAL_WORLD_SIZE, as torchrun and fsdp_run set them; set ",
              absl::StrJoin(missing, " and "), " too, or unset ", absl::StrJoin(set_names, " and "),
              " to let the program start its own ranks");
}

// Throws naming MASTER_ADDR and the resolver's words when `address` does not resolve:
// TCPStore would retry its connection until the timeout and then blame the port.
void check_resolves(const std::string& address) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = getaddrinfo(address.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  TORCH_CHECK(status == 0, "rendezvous: MASTER_ADDR='", address, "' does not resolve (",
              gai_strerror(status),
              "); set MASTER_ADDR to the host name or IP address of the node that runs rank 0, "
              "as every node can resolve it");
}

bool is_loopback(const std::string& address) {
  return address == "localhost" || absl::StartsWith(address, "127.") || address == "::1";
}

// Every rank sets "join/<rank>" = world size, then waits until ranks 0..W-1 all did.
void wait_for_all_ranks(c10d::Store& store, const LaunchEnvironment& env,
                        const RendezvousOptions& options, const std::string& where) {
  store.set(absl::StrCat("join/", env.rank),
            std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(&env.world_size),
                                 reinterpret_cast<const uint8_t*>(&env.world_size) + sizeof(int)));
  const auto deadline = std::chrono::steady_clock::now() + options.timeout();
  std::vector<int> missing;
  while (true) {
    missing.clear();
    for (int r = 0; r < env.world_size; ++r) {
      if (!store.check({absl::StrCat("join/", r)})) missing.push_back(r);
    }
    if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  TORCH_CHECK(missing.empty(), "rendezvous at ", where, ": rank(s) ", absl::StrJoin(missing, ", "),
              " of ", env.world_size, " did not join within ", options.timeout().count(),
              " ms; start every rank with the same MASTER_ADDR, "
              "MASTER_PORT and WORLD_SIZE");
  for (int r = 0; r < env.world_size; ++r) {
    const std::vector<uint8_t> value = store.get(absl::StrCat("join/", r));
    int theirs = 0;
    TORCH_INTERNAL_ASSERT(value.size() == sizeof(int));
    std::copy(value.begin(), value.end(), reinterpret_cast<uint8_t*>(&theirs));
    TORCH_CHECK(theirs == env.world_size, "rendezvous at ", where, ": rank ", r,
                " was started with WORLD_SIZE=", theirs, " but rank ", env.rank,
                " with WORLD_SIZE=", env.world_size,
                "; start every rank with the same "
                "world size");
  }
}

void check_all_joined(c10d::Store& store, const LaunchEnvironment& env,
                      const RendezvousOptions& options, const std::string& where) {
  try {
    wait_for_all_ranks(store, env, options, where);
  } catch (const c10::DistNetworkError& e) {
    // The TCPStore lives in rank 0: losing it mostly means rank 0 failed.
    TORCH_CHECK(false, "rendezvous at ", where, ": rank ", env.rank,
                " lost the store hosted by rank 0 (", e.what_without_backtrace(),
                "); rank 0 has probably failed: see its output");
  }
}

// Rank 0 publishes its backend; every other rank compares its own with it (one store
// read per rank), so a rank that chose differently stops here naming both.
void check_same_backend(c10d::Store& store, const LaunchEnvironment& env, Backend requested,
                        Backend chosen, int cuda_devices) {
  const std::string key = "backend";
  const std::string mine = backend_name(chosen);
  if (env.rank == 0) {
    store.set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
    return;
  }
  const std::vector<uint8_t> value = store.get(key);
  const std::string theirs(value.begin(), value.end());
  TORCH_CHECK(theirs == mine, "rendezvous: rank ", env.rank, " chose the ", mine,
              " backend (requested: ", backend_name(requested),
              ", CUDA devices seen: ", cuda_devices, ") but rank 0 chose ", theirs,
              "; give every rank the same RendezvousOptions::backend, and either CUDA devices "
              "on every host or on none");
}

}  // namespace

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kDefault:
      return "default";
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

Backend choose_backend(Backend requested, int cuda_device_count, int local_rank,
                       const std::string& why_no_cuda) {
  if (requested == Backend::kGloo) return Backend::kGloo;
  if (cuda_device_count <= 0) {
    const std::string why = why_no_cuda.empty() ? "" : absl::StrCat(" (", why_no_cuda, ")");
    TORCH_CHECK(requested != Backend::kNccl,
                "rendezvous: backend nccl needs a CUDA device, but this process sees none", why,
                "; run it on a GPU host or choose Backend::kGloo");
    return Backend::kGloo;
  }
  TORCH_CHECK(local_rank < cuda_device_count, "rendezvous: LOCAL_RANK=", local_rank,
              " has no CUDA device: this process sees ", cuda_device_count,
              " (cuda:0 to cuda:", cuda_device_count - 1,
              ") and NCCL runs one rank per device, on cuda:LOCAL_RANK ",
              "(backend requested: ", backend_name(requested), "); start at most ",
              cuda_device_count, " ranks per host, or choose Backend::kGloo");
  return Backend::kNccl;
}

LaunchEnvironment read_launch_environment(const EnvLookup& lookup_or_null) {
  const EnvLookup lookup = lookup_or_null ? lookup_or_null : [](const std::string& name) {
    const char* value = std::getenv(name.c_str());
    return value == nullptr ? std::nullopt : std::optional<std::string>(value);
  };
  LaunchEnvironment env;
  env.launcher = "none";
  for (const Scheme& scheme : kSchemes) {
    if (!lookup(scheme.rank) || !lookup(scheme.world_size)) continue;
    env.launcher = scheme.launcher;
    env.world_size = int_variable(lookup, scheme.world_size, 1, 1, 1 << 20);
    env.rank = int_variable(lookup, scheme.rank, 0, 0, env.world_size - 1);
    const std::optional<int> slurm_tasks = env.launcher == std::string("Slurm")
                                               ? slurm_step_tasks_here(lookup, env.world_size)
                                               : std::nullopt;
    env.local_world_size = slurm_tasks ? *slurm_tasks
                                       : int_variable(lookup, scheme.local_world_size,
                                                      env.world_size, 1, env.world_size);
    env.local_rank = int_variable(lookup, scheme.local_rank, env.rank % env.local_world_size, 0,
                                  env.local_world_size - 1);
    break;
  }
  if (env.launcher == "none") refuse_partial_torchrun(lookup);
  env.master_addr = lookup("MASTER_ADDR")
                        .value_or(env.launcher == std::string("Slurm")
                                      ? lookup("SLURM_LAUNCH_NODE_IPADDR").value_or("")
                                      : "");
  env.master_port = int_variable(lookup, "MASTER_PORT", 0, 1, 65535);
  return env;
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnvironment& env,
                                              const RendezvousOptions& options) {
  c10::intrusive_ptr<c10d::Store> store;
  std::string where;
  if (!options.file_store_path().empty()) {
    where = absl::StrCat("file ", options.file_store_path());
    store = c10::make_intrusive<c10d::FileStore>(options.file_store_path(), env.world_size);
  } else {
    TORCH_CHECK(env.world_size == 1 || (!env.master_addr.empty() && env.master_port > 0),
                "rendezvous: MASTER_ADDR and MASTER_PORT must be set for ", env.world_size,
                " ranks (launcher: ", env.launcher,
                "); use fsdp_run or torchrun, or set "
                "RendezvousOptions::file_store_path");
    const std::string addr = env.master_addr.empty() ? "127.0.0.1" : env.master_addr;
    where = absl::StrCat(addr, ":", env.master_port);
    check_resolves(addr);
    c10d::TCPStoreOptions tcp;
    tcp.port = static_cast<uint16_t>(env.master_port);
    tcp.isServer = env.rank == 0;
    tcp.numWorkers = env.world_size;
    tcp.waitWorkers = false;  // check_all_joined names the missing ranks instead
    tcp.timeout = options.timeout();
    try {
      store = c10::make_intrusive<c10d::TCPStore>(addr, tcp);
    } catch (const std::exception& e) {
      const std::string what = std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
      TORCH_CHECK(env.rank != 0, "rendezvous: rank 0 cannot host the store on ", where, " (", what,
                  "); pick a free MASTER_PORT (fsdp_run picks one by default)");
      TORCH_CHECK(false, "rendezvous: rank ", env.rank, " cannot reach the master at ", where,
                  " within ", options.timeout().count(), " ms (", what,
                  "); check MASTER_ADDR/MASTER_PORT and that rank 0 is running");
    }
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp", store);
  check_all_joined(*prefixed, env, options, where);
  return prefixed;
}

std::shared_ptr<Communicator> init_communicator(const LaunchEnvironment& env,
                                                const RendezvousOptions& options) {
  std::string why_no_cuda;
  const int cuda_devices =
      options.backend() == Backend::kGloo ? 0 : cuda_device_count(&why_no_cuda);
  const Backend backend =
      choose_backend(options.backend(), cuda_devices, env.local_rank, why_no_cuda);
  c10::intrusive_ptr<c10d::Store> store = connect_store(env, options);
  check_same_backend(*store, env, options.backend(), backend, cuda_devices);
  GlooOptions gloo;
  gloo.timeout(options.timeout());
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME")) {
    gloo.interface(interface);
  } else if (env.master_addr.empty() || is_loopback(env.master_addr)) {
    gloo.hostname("127.0.0.1");
  }
  if (backend == Backend::kNccl) {
    // PyTorch's switch for ProcessGroupNCCL's blocking wait, read the same way.
    const char* blocking = std::getenv("TORCH_NCCL_BLOCKING_WAIT");
    return make_nccl_communicator(
        store, env.rank, env.world_size,
        NcclOptions()
            .device_index(env.local_rank)
            .timeout(options.timeout())
            .blocking_wait(blocking != nullptr && std::string(blocking) == "1")
            .host_group_options(gloo));
  }
  return make_gloo_communicator(store, env.rank, env.world_size, gloo);
}

std::shared_ptr<Communicator> init_from_environment(const RendezvousOptions& options) {
  const LaunchEnvironment env = read_launch_environment();
  std::shared_ptr<Communicator> comm = init_communicator(env, options);
  report_uncaught_errors(env.rank);  // after the backend's own handler (gloo.h)
  return comm;
}

namespace {

// Note [Uncaught errors on a rank]
// A user's main that lets a c10::Error escape (a bad model at construction, a damaged
// checkpoint) would end in libstdc++'s terminate handler: "terminate called after
// throwing an instance of 'c10::Error'", the message and a 20-frame C++ backtrace, from
// every rank, then SIGABRT. Python programs under torchrun print the error once and exit
// with status 1, so this handler does the same for c10::Error; the backtrace stays
// behind PyTorch's TORCH_SHOW_CPP_STACKTRACES=1.
std::atomic<int> g_uncaught_rank{-1};
std::terminate_handler g_replaced_handler = nullptr;

void report_uncaught_error() {
  if (std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const c10::Error& error) {
      const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
      const bool backtrace = show != nullptr && std::string(show) == "1";
      std::fflush(stdout);
      std::fprintf(stderr, "fsdp: rank %d failed: %s\n", g_uncaught_rank.load(),
                   backtrace ? error.what() : error.what_without_backtrace());
      std::fflush(stderr);
      std::_Exit(1);
    } catch (...) {
    }
  }
  if (g_replaced_handler != nullptr) g_replaced_handler();
  std::abort();
}

}  // namespace

void report_uncaught_errors(int rank) {
  g_uncaught_rank.store(rank);
  static std::once_flag once;
  std::call_once(once, [] { g_replaced_handler = std::set_terminate(report_uncaught_error); });
}

}  // namespace fsdp
