// Launch variables of torchrun, Open MPI, MPICH and Slurm, and the rendezvous errors a
// user meets: a missing peer, an unreachable master, a port in use, mismatched world
// sizes.
#include "fsdp/comm/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>
#include <thread>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/nccl.h"
#include "fsdp/comm/testing/gpu_testing.h"
#include "fsdp/comm/testing/multiprocess.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

EnvLookup lookup_in(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(LaunchEnvironmentTest, Torchrun) {
  const LaunchEnvironment env = read_launch_environment(lookup_in({{"RANK", "3"},
                                                                   {"WORLD_SIZE", "4"},
                                                                   {"LOCAL_RANK", "1"},
                                                                   {"LOCAL_WORLD_SIZE", "2"},
                                                                   {"MASTER_ADDR", "10.0.0.1"},
                                                                   {"MASTER_PORT", "29500"},
                                                                   {"OMPI_COMM_WORLD_RANK", "0"},
                                                                   {"OMPI_COMM_WORLD_SIZE", "9"}}));
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(LaunchEnvironmentTest, OpenMpiMpichAndSlurm) {
  LaunchEnvironment env = read_launch_environment(lookup_in({{"OMPI_COMM_WORLD_RANK", "5"},
                                                             {"OMPI_COMM_WORLD_SIZE", "8"},
                                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  EXPECT_EQ(env.launcher, "Open MPI");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);

  env = read_launch_environment(lookup_in({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}}));
  EXPECT_EQ(env.launcher, "MPICH");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.local_rank, 2);  // no local variables: one node
  EXPECT_EQ(env.local_world_size, 3);

  env = read_launch_environment(lookup_in({{"SLURM_PROCID", "6"},
                                           {"SLURM_NTASKS", "8"},
                                           {"SLURM_LOCALID", "2"},
                                           {"SLURM_NTASKS_PER_NODE", "4"},
                                           {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}}));
  EXPECT_EQ(env.launcher, "Slurm");
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.master_addr, "10.1.2.3");
}

// Slurm's ranks per node are the job step's on this node (SLURM_STEP_TASKS_PER_NODE at
// SLURM_NODEID): SLURM_NTASKS_PER_NODE is missing without --ntasks-per-node, and a step
// inherits its batch job's.
TEST(LaunchEnvironmentTest, SlurmCountsTheStepsTasksOnThisNode) {
  LaunchEnvironment env =
      read_launch_environment(lookup_in({{"SLURM_PROCID", "5"},
                                         {"SLURM_NTASKS", "7"},
                                         {"SLURM_LOCALID", "1"},
                                         {"SLURM_NODEID", "2"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "2(x2),3"}}));
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 3);
  env = read_launch_environment(lookup_in({{"SLURM_PROCID", "3"},
                                           {"SLURM_NTASKS", "4"},
                                           {"SLURM_LOCALID", "1"},
                                           {"SLURM_NODEID", "1"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}));
  EXPECT_EQ(env.local_world_size, 2);  // was 4: the whole job
  env = read_launch_environment(lookup_in({{"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "1"},
                                           {"SLURM_NTASKS_PER_NODE", "2"},  // the batch job's
                                           {"SLURM_NODEID", "0"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "1"}}));
  EXPECT_EQ(env.local_world_size, 1);  // was an error: 2 is not in [1, 1]
  EXPECT_THAT(
      [] {
        read_launch_environment(lookup_in({{"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "4"},
                                           {"SLURM_NODEID", "1"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "2(x2"}}));
      },
      ThrowsMessage<c10::Error>(
          HasSubstr("SLURM_STEP_TASKS_PER_NODE='2(x2' gives no task count in [1, 4] for node 1")));
  EXPECT_THAT(
      [] {
        read_launch_environment(lookup_in({{"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "4"},
                                           {"SLURM_NODEID", "1"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "4"}}));
      },
      ThrowsMessage<c10::Error>(HasSubstr("gives no task count in [1, 4] for node 1")));
}

TEST(LaunchEnvironmentTest, NoVariablesMeansOneRank) {
  const LaunchEnvironment env = read_launch_environment(lookup_in({}));
  EXPECT_EQ(env.launcher, "none");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
}

TEST(LaunchEnvironmentTest, BadValuesNameTheVariable) {
  EXPECT_THAT(
      [] {
        read_launch_environment(lookup_in({{"RANK", "x"}, {"WORLD_SIZE", "2"}}));
      },
      ThrowsMessage<c10::Error>(HasSubstr("RANK='x' is not an integer in [0, 1]")));
  EXPECT_THAT(
      [] {
        read_launch_environment(lookup_in({{"RANK", "2"}, {"WORLD_SIZE", "2"}}));
      },
      ThrowsMessage<c10::Error>(HasSubstr("RANK='2' is not an integer in [0, 1]")));
  EXPECT_THAT(
      [] {
        read_launch_environment(
            lookup_in({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}));
      },
      ThrowsMessage<c10::Error>(HasSubstr("MASTER_PORT='70000'")));
}

// The message of the c10::Error `f` throws; "" if it throws none.
template <typename F>
std::string error_message(F f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

// Note [A partial torchrun environment].
TEST(LaunchEnvironmentTest, PartialTorchrunVariablesAreRefused) {
  EXPECT_EQ(error_message([] {
              read_launch_environment(lookup_in({{"RANK", "0"}}));
            }),
            "rendezvous: RANK='0' is set but WORLD_SIZE is not: a rank of a launched job has "
            "RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun and fsdp_run set "
            "them; set WORLD_SIZE too, or unset RANK to let the program start its own ranks");
  EXPECT_EQ(error_message([] {
              read_launch_environment(lookup_in({{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}}));
            }),
            "rendezvous: WORLD_SIZE='2' and LOCAL_RANK='1' are set but RANK is not: a rank of a "
            "launched job has RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun "
            "and fsdp_run set them; set RANK too, or unset WORLD_SIZE and LOCAL_RANK to let the "
            "program start its own ranks");
  EXPECT_EQ(error_message([] {
              read_launch_environment(lookup_in({{"LOCAL_RANK", "0"}}));
            }),
            "rendezvous: LOCAL_RANK='0' is set but RANK and WORLD_SIZE are not: a rank of a "
            "launched job has RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun "
            "and fsdp_run set them; set RANK and WORLD_SIZE too, or unset LOCAL_RANK to let the "
            "program start its own ranks");
  // Another launcher's complete variables win, as before: a Slurm step whose script
  // exports LOCAL_RANK alone, and an sbatch script itself (SLURM_PROCID of SLURM_NTASKS).
  const LaunchEnvironment env = read_launch_environment(lookup_in(
      {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}, {"LOCAL_RANK", "1"}}));
  EXPECT_EQ(env.launcher, "Slurm");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
}

// --- the backend (Note [Choosing the backend]) ----------------------------------------

TEST(ChooseBackendTest, DefaultIsGlooWithoutCudaDevices) {
  EXPECT_EQ(choose_backend(Backend::kDefault, 0, 0), Backend::kGloo);
  EXPECT_EQ(choose_backend(Backend::kDefault, 0, 5), Backend::kGloo);
}

TEST(ChooseBackendTest, DefaultIsNcclWhenLocalRankHasADevice) {
  EXPECT_EQ(choose_backend(Backend::kDefault, 1, 0), Backend::kNccl);
  EXPECT_EQ(choose_backend(Backend::kDefault, 8, 7), Backend::kNccl);
}

TEST(ChooseBackendTest, GlooOnRequestWhateverTheDevices) {
  EXPECT_EQ(choose_backend(Backend::kGloo, 0, 0), Backend::kGloo);
  EXPECT_EQ(choose_backend(Backend::kGloo, 8, 3), Backend::kGloo);
  EXPECT_EQ(choose_backend(Backend::kGloo, 1, 5), Backend::kGloo);  // more ranks than devices
}

TEST(ChooseBackendTest, NcclOnRequestWithADevice) {
  EXPECT_EQ(choose_backend(Backend::kNccl, 1, 0), Backend::kNccl);
  EXPECT_EQ(choose_backend(Backend::kNccl, 4, 3), Backend::kNccl);
}

TEST(ChooseBackendTest, NcclWithoutADeviceSaysWhy) {
  EXPECT_THAT(
      [] {
        choose_backend(Backend::kNccl, 0, 0,
                       "cudaGetDeviceCount: cudaErrorNoDevice: no CUDA-capable device is detected");
      },
      ThrowsMessage<c10::Error>(HasSubstr(
          "rendezvous: backend nccl needs a CUDA device, but this process sees none "
          "(cudaGetDeviceCount: cudaErrorNoDevice: no CUDA-capable device is detected); run it "
          "on a GPU host or choose Backend::kGloo")));
  EXPECT_THAT([] { choose_backend(Backend::kNccl, 0, 0); },
              ThrowsMessage<c10::Error>(HasSubstr("this process sees none; run it on a GPU host")));
}

// Not a fallback to Gloo: the other ranks of the host would be on NCCL.
TEST(ChooseBackendTest, LocalRankWithoutADeviceIsAnError) {
  EXPECT_THAT([] { choose_backend(Backend::kDefault, 2, 2); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "rendezvous: LOCAL_RANK=2 has no CUDA device: this process sees 2 (cuda:0 to "
                  "cuda:1) and NCCL runs one rank per device, on cuda:LOCAL_RANK (backend "
                  "requested: default); start at most 2 ranks per host, or choose "
                  "Backend::kGloo")));
  EXPECT_THAT([] { choose_backend(Backend::kNccl, 1, 3); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("LOCAL_RANK=3 has no CUDA device: this process sees 1 (cuda:0 to "
                            "cuda:0) and NCCL runs one rank per device, on cuda:LOCAL_RANK "
                            "(backend requested: nccl); start at most 1 ranks per host")));
}

TEST(ChooseBackendTest, Names) {
  EXPECT_STREQ(backend_name(Backend::kDefault), "default");
  EXPECT_STREQ(backend_name(Backend::kGloo), "gloo");
  EXPECT_STREQ(backend_name(Backend::kNccl), "nccl");
  EXPECT_EQ(RendezvousOptions().backend(), Backend::kDefault);
}

TEST(InitBackendTest, DefaultIsGlooOnAHostWithoutCuda) {
  if (cuda_device_count() > 0) {
    GTEST_SKIP() << "this host has a CUDA device, so the default is NCCL here "
                    "(InitBackendTest.DefaultIsNcclOnTheLocalRanksDevice)";
  }
  EXPECT_EQ(init_communicator(LaunchEnvironment())->backend_name(), "gloo");
}

TEST(InitBackendTest, NcclWithoutCudaFailsSayingWhy) {
  std::string why;
  if (cuda_device_count(&why) > 0) GTEST_SKIP() << "this host has a CUDA device";
  EXPECT_THAT(
      [] { init_communicator(LaunchEnvironment(), RendezvousOptions().backend(Backend::kNccl)); },
      ThrowsMessage<c10::Error>(
          HasSubstr("backend nccl needs a CUDA device, but this process sees none (" + why + ")")));
}

TEST(InitBackendTest, GlooOnRequestOnAnyHost) {
  std::shared_ptr<Communicator> comm =
      init_communicator(LaunchEnvironment(), RendezvousOptions().backend(Backend::kGloo));
  EXPECT_EQ(comm->backend_name(), "gloo");
  at::Tensor t = at::ones({3});
  comm->all_reduce(t);
  EXPECT_TRUE(at::equal(t, at::ones({3})));
}

TEST(InitBackendTest, DefaultIsNcclOnTheLocalRanksDevice) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<Communicator> comm = init_communicator(LaunchEnvironment());
  EXPECT_EQ(comm->backend_name(), "nccl");
  comm->barrier();  // a collective completes (no ordering needed)
}

LaunchEnvironment two_ranks(int rank, int port) {
  LaunchEnvironment env;
  env.rank = rank;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.launcher = "test";
  return env;
}

int free_port() {
  absl::StatusOr<int> port = pick_free_port("127.0.0.1");
  EXPECT_TRUE(port.ok()) << port.status();
  return port.value_or(0);
}

TEST(RendezvousTest, MissingPeerIsNamedAfterTheTimeout) {
  const RendezvousOptions options = RendezvousOptions().timeout(std::chrono::milliseconds(1000));
  EXPECT_THAT([&] { connect_store(two_ranks(0, free_port()), options); },
              ThrowsMessage<c10::Error>(HasSubstr("rank(s) 1 of 2 did not join within 1000 ms")));
}

TEST(RendezvousTest, UnreachableMasterIsAClearError) {
  const RendezvousOptions options = RendezvousOptions().timeout(std::chrono::milliseconds(1000));
  EXPECT_THAT([&] { connect_store(two_ranks(1, free_port()), options); },
              ThrowsMessage<c10::Error>(HasSubstr("rank 1 cannot reach the master at 127.0.0.1:")));
}

TEST(RendezvousTest, PortInUseIsAClearError) {
  // Hold a listening socket on a port, then ask rank 0 to host the store there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t length = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  const int port = ntohs(addr.sin_port);
  const RendezvousOptions options = RendezvousOptions().timeout(std::chrono::milliseconds(1000));
  EXPECT_THAT([&] { connect_store(two_ranks(0, port), options); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("rank 0 cannot host the store on 127.0.0.1:" + std::to_string(port))));
  close(fd);
}

// Said at once, instead of after the timeout as a port to change.
TEST(RendezvousTest, UnresolvableMasterIsNamedAtOnce) {
  LaunchEnvironment env = two_ranks(1, 29500);
  env.master_addr = "no.such.host.invalid";  // RFC 2606: never resolves
  addrinfo* found = nullptr;
  const int status = getaddrinfo(env.master_addr.c_str(), nullptr, nullptr, &found);
  ASSERT_NE(status, 0);
  const RendezvousOptions options = RendezvousOptions().timeout(std::chrono::seconds(60));
  const auto start = std::chrono::steady_clock::now();
  for (int rank : {0, 1}) {
    env.rank = rank;
    EXPECT_EQ(error_message([&] { connect_store(env, options); }),
              std::string("rendezvous: MASTER_ADDR='no.such.host.invalid' does not resolve (") +
                  gai_strerror(status) +
                  "); set MASTER_ADDR to the host name or IP address of the node that runs rank "
                  "0, as every node can resolve it");
  }
  // Not after the 60 s timeout (the resolver's own retries may take seconds).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(RendezvousTest, MasterAddressIsRequiredForSeveralRanks) {
  LaunchEnvironment env = two_ranks(0, 0);
  env.master_addr = "";
  EXPECT_THAT([&] { connect_store(env); },
              ThrowsMessage<c10::Error>(HasSubstr("MASTER_ADDR and MASTER_PORT must be set")));
}

TEST(DISABLED_RendezvousWorker, Join) {
  init_from_environment(
      RendezvousOptions().timeout(std::chrono::seconds(3)).backend(Backend::kGloo))
      ->barrier();
}

// Rank 0 asks for Gloo, rank 1 for NCCL on cuda:0 (LOCAL_RANK=0): rank 1 stops at the
// rendezvous naming both; rank 0 waits for it in Gloo's connect and times out.
TEST(DISABLED_RendezvousWorker, JoinWithBackendFromEnvironment) {
  const Backend backend =
      std::string(std::getenv("FSDP_TEST_BACKEND")) == "nccl" ? Backend::kNccl : Backend::kGloo;
  init_from_environment(RendezvousOptions().timeout(std::chrono::seconds(3)).backend(backend))
      ->barrier();
}

TEST(RendezvousTest, RanksWithDifferentBackendsAreNamed) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_RendezvousWorker.JoinWithBackendFromEnvironment", std::chrono::seconds(60),
      [](int rank, Environment& env) {
        env["FSDP_TEST_BACKEND"] = rank == 0 ? "gloo" : "nccl";
        env["LOCAL_RANK"] = "0";
      });
  EXPECT_NE(ranks[1].exit_code, 0) << comm_internal::describe(ranks);
  EXPECT_THAT(ranks[1].output, HasSubstr("rendezvous: rank 1 chose the nccl backend (requested: "
                                         "nccl, CUDA devices seen: "));
  EXPECT_THAT(ranks[1].output, HasSubstr(") but rank 0 chose gloo"));
  EXPECT_NE(ranks[0].exit_code, 0) << comm_internal::describe(ranks);
}

TEST(RendezvousTest, DifferentWorldSizesAreNamed) {
  const auto ranks =
      comm_internal::run_test_as_ranks(2, "DISABLED_RendezvousWorker.Join",
                                       std::chrono::seconds(60), [](int rank, Environment& env) {
                                         if (rank == 1) env["WORLD_SIZE"] = "3";
                                       });
  EXPECT_NE(ranks[0].exit_code, 0) << comm_internal::describe(ranks);
  EXPECT_THAT(ranks[0].output, HasSubstr("rank 1 was started with WORLD_SIZE=3 but rank 0 "
                                         "with WORLD_SIZE=2"));
  // Rank 1 waits for a rank 2 that never comes, unless rank 0's failure takes the store
  // (which rank 0 hosts) down first.
  EXPECT_NE(ranks[1].exit_code, 0);
  EXPECT_THAT(ranks[1].output,
              ::testing::AnyOf(HasSubstr("rank(s) 2 of 3 did not join within 3000 ms"),
                               HasSubstr("rank 1 lost the store hosted by rank 0")));
}

TEST(RendezvousTest, FileStoreRendezvous) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/filestore";
  unlink(path.c_str());
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_RendezvousWorker.JoinThroughFile", std::chrono::seconds(60),
      [&](int, Environment& env) { env["FSDP_TEST_FILE_STORE"] = path; });
  for (const auto& rank : ranks) EXPECT_EQ(rank.exit_code, 0) << comm_internal::describe(ranks);
}

TEST(DISABLED_RendezvousWorker, JoinThroughFile) {
  const RendezvousOptions options = RendezvousOptions()
                                        .timeout(std::chrono::seconds(10))
                                        .backend(Backend::kGloo)
                                        .file_store_path(std::getenv("FSDP_TEST_FILE_STORE"));
  std::shared_ptr<Communicator> comm = init_from_environment(options);
  at::Tensor t = at::ones({2});
  comm->all_reduce(t);
  EXPECT_EQ(t[0].item<float>(), 2.0f);
}

}  // namespace
}  // namespace fsdp

// Note [Uncaught errors on a rank]: an uncaught c10::Error is one line naming the rank,
// without libstdc++'s terminate message or the C++ backtrace, and exit status 1; with
// TORCH_SHOW_CPP_STACKTRACES=1 the backtrace is there.
TEST(ReportUncaughtErrorsTest, OneLineNamingTheRankAndStatusOne) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto throw_uncaught = [] {
    fsdp::report_uncaught_errors(3);
    std::thread([] { TORCH_CHECK(false, "the checkpoint is damaged; use another one"); }).join();
  };
  EXPECT_EXIT(
      throw_uncaught(), ::testing::ExitedWithCode(1),
      ::testing::AllOf(::testing::HasSubstr("fsdp: rank 3 failed: the checkpoint is damaged; use "
                                            "another one\n"),
                       ::testing::Not(::testing::HasSubstr("terminate called")),
                       ::testing::Not(::testing::HasSubstr("Exception raised from"))));
  EXPECT_EXIT(
      {
        setenv("TORCH_SHOW_CPP_STACKTRACES", "1", 1);
        throw_uncaught();
      },
      ::testing::ExitedWithCode(1),
      ::testing::AllOf(::testing::HasSubstr("fsdp: rank 3 failed: the checkpoint is damaged"),
                       ::testing::HasSubstr("Exception raised from")));
}
