// The NCCL backend. Host-side logic runs everywhere: dtype and op mapping, the messages of
// failed NCCL and CUDA calls, the unique-id exchange through a c10d store, and option
// validation. The collectives need a CUDA GPU (one rank, W = 1: NCCL does not allow two
// ranks of one communicator on one device) and are skipped, saying why, without one.
#include "fsdp/comm/nccl.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "fsdp/comm/internal/nccl_utils.h"
#include "fsdp/comm/internal/size_checks.h"
#include "fsdp/comm/testing/gpu_testing.h"

namespace fsdp {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// --- host-side helpers -------------------------------------------------------------------

TEST(NcclDtypeTest, EverySupportedDtypeMapsToTheNcclTypeOfTheSameWidth) {
  using comm_internal::to_nccl_dtype;
  EXPECT_EQ(to_nccl_dtype(c10::kFloat), ncclFloat32);
  EXPECT_EQ(to_nccl_dtype(c10::kDouble), ncclFloat64);
  EXPECT_EQ(to_nccl_dtype(c10::kHalf), ncclFloat16);
  EXPECT_EQ(to_nccl_dtype(c10::kBFloat16), ncclBfloat16);
  EXPECT_EQ(to_nccl_dtype(c10::kLong), ncclInt64);
  EXPECT_EQ(to_nccl_dtype(c10::kInt), ncclInt32);
  EXPECT_EQ(to_nccl_dtype(c10::kByte), ncclUint8);
}

TEST(NcclDtypeTest, UnsupportedDtypesThrowNamingTheDtype) {
  for (c10::ScalarType dtype : {c10::kBool, c10::kChar, c10::kShort, c10::kComplexFloat}) {
    EXPECT_FALSE(is_supported_dtype(dtype));
    EXPECT_THAT([&] { comm_internal::to_nccl_dtype(dtype); },
                ThrowsMessage<c10::Error>(
                    AllOf(HasSubstr("cannot move dtype"), HasSubstr(c10::toString(dtype)))));
  }
}

TEST(NcclOpTest, SumAndAvgMapToNcclSumAndNcclAvg) {
  EXPECT_EQ(comm_internal::to_nccl_op(ReduceOp::kSum), ncclSum);
  EXPECT_EQ(comm_internal::to_nccl_op(ReduceOp::kAvg), ncclAvg);
}

TEST(NcclErrorTest, NcclFailureNamesTheCallTheCodeAndTheLastError) {
  const std::string message = comm_internal::describe_nccl_failure("ncclAllGather", ncclSystemError,
                                                                   "socket closed by peer");
  EXPECT_EQ(message, std::string("ncclAllGather failed: ") + ncclGetErrorString(ncclSystemError) +
                         " [ncclSystemError]; last NCCL error: socket closed by peer");
}

TEST(NcclErrorTest, NcclFailureWithoutLastErrorEndsAtTheCode) {
  EXPECT_EQ(comm_internal::describe_nccl_failure("ncclCommInitRank", ncclInvalidUsage, ""),
            std::string("ncclCommInitRank failed: ") + ncclGetErrorString(ncclInvalidUsage) +
                " [ncclInvalidUsage]");
  EXPECT_EQ(comm_internal::describe_nccl_failure("ncclBroadcast", ncclRemoteError, nullptr),
            std::string("ncclBroadcast failed: ") + ncclGetErrorString(ncclRemoteError) +
                " [ncclRemoteError]");
}

TEST(NcclErrorTest, EveryResultCodeHasAName) {
  EXPECT_STREQ(comm_internal::nccl_result_name(ncclUnhandledCudaError), "ncclUnhandledCudaError");
  EXPECT_STREQ(comm_internal::nccl_result_name(ncclInternalError), "ncclInternalError");
  EXPECT_STREQ(comm_internal::nccl_result_name(ncclInvalidArgument), "ncclInvalidArgument");
  // A code this header has no name for (a newer NCCL's), inside the enum's range: a value
  // outside it would be undefined behaviour (clang's UBSan reports the load).
  EXPECT_STREQ(comm_internal::nccl_result_name(static_cast<ncclResult_t>(ncclNumResults + 1)),
               "unknown ncclResult_t");
}

TEST(NcclErrorTest, CudaFailureNamesTheCallAndTheError) {
  EXPECT_EQ(comm_internal::describe_cuda_failure("cudaSetDevice", cudaErrorInvalidDevice),
            std::string("cudaSetDevice failed: ") + cudaGetErrorString(cudaErrorInvalidDevice) +
                " [cudaErrorInvalidDevice]");
}

TEST(NcclErrorTest, ChecksThrowNcclCallErrorOnFailureOnly) {
  using comm_internal::check_cuda;
  using comm_internal::check_nccl;
  using comm_internal::NcclCallError;
  EXPECT_NO_THROW(check_nccl(ncclSuccess, "ncclAllReduce"));
  EXPECT_NO_THROW(check_nccl(ncclInProgress, "ncclAllReduce"));  // not finished, not failed
  EXPECT_NO_THROW(check_cuda(cudaSuccess, "cudaMalloc"));
  EXPECT_THAT(
      [] { check_nccl(ncclInvalidArgument, "ncclReduceScatter"); },
      ThrowsMessage<NcclCallError>(HasSubstr(
          "ncclReduceScatter failed: " + std::string(ncclGetErrorString(ncclInvalidArgument)))));
  EXPECT_THAT([] { check_cuda(cudaErrorMemoryAllocation, "cudaMalloc"); },
              ThrowsMessage<c10::Error>(HasSubstr("cudaMalloc failed: ")));
}

// An id whose bytes are `seed`, `seed + 1`, ... (no NCCL call, no device).
ncclUniqueId fake_id(int seed) {
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    id.internal[i] = static_cast<char>(seed + static_cast<int>(i));
  }
  return id;
}

TEST(NcclUniqueIdTest, KeysIncludeThePrefix) {
  EXPECT_EQ(comm_internal::unique_id_key("fsdp/nccl"), "fsdp/nccl/nccl_unique_id");
  EXPECT_NE(comm_internal::unique_id_key("fsdp/nccl"),
            comm_internal::unique_id_key("fsdp/nccl/group[0,1]#0"));
}

TEST(NcclUniqueIdTest, RankZeroPublishesAndRankOneFetchesTheSameBytes) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string key = comm_internal::unique_id_key("test");
  ncclUniqueId got0, got1;
  int made = 0;
  // Rank 1 starts first and blocks in store.get until rank 0 publishes.
  std::thread rank1([&] {
    got1 = comm_internal::exchange_unique_id(*store, key, 1, [&] {
      ADD_FAILURE() << "only rank 0 makes the id";
      return fake_id(0);
    });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::thread rank0([&] {
    got0 = comm_internal::exchange_unique_id(*store, key, 0, [&] {
      ++made;
      return fake_id(7);
    });
  });
  rank0.join();
  rank1.join();
  EXPECT_EQ(made, 1);
  const ncclUniqueId expected = fake_id(7);
  EXPECT_EQ(std::memcmp(got0.internal, expected.internal, NCCL_UNIQUE_ID_BYTES), 0);
  EXPECT_EQ(std::memcmp(got1.internal, expected.internal, NCCL_UNIQUE_ID_BYTES), 0);
  EXPECT_EQ(store->get(key).size(), static_cast<size_t>(NCCL_UNIQUE_ID_BYTES));
}

TEST(NcclUniqueIdTest, SubgroupsUnderDistinctPrefixesGetTheirOwnIds) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string world = comm_internal::unique_id_key("p");
  const std::string group = comm_internal::unique_id_key("p/group[1]#0");
  comm_internal::exchange_unique_id(*store, world, 0, [] { return fake_id(1); });
  comm_internal::exchange_unique_id(*store, group, 0, [] { return fake_id(2); });
  const ncclUniqueId a = comm_internal::exchange_unique_id(*store, world, 3, nullptr);
  const ncclUniqueId b = comm_internal::exchange_unique_id(*store, group, 3, nullptr);
  EXPECT_EQ(std::memcmp(a.internal, fake_id(1).internal, NCCL_UNIQUE_ID_BYTES), 0);
  EXPECT_EQ(std::memcmp(b.internal, fake_id(2).internal, NCCL_UNIQUE_ID_BYTES), 0);
}

TEST(NcclUniqueIdTest, MissingIdTimesOutNamingTheKeyAndRank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::milliseconds(50));
  EXPECT_THAT(
      [&] { comm_internal::exchange_unique_id(*store, "nobody/nccl_unique_id", 2, nullptr); },
      ThrowsMessage<c10::Error>(AllOf(HasSubstr("rank 2 could not fetch"),
                                      HasSubstr("\"nobody/nccl_unique_id\""), HasSubstr("50 ms"))));
}

TEST(NcclUniqueIdTest, WrongSizedValueIsRejected) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->set("k", std::vector<uint8_t>{1, 2, 3});
  EXPECT_THAT([&] { comm_internal::exchange_unique_id(*store, "k", 1, nullptr); },
              ThrowsMessage<c10::Error>(AllOf(HasSubstr("holds 3 bytes"), HasSubstr("128"))));
}

TEST(NcclOptionsTest, DefaultsAndChaining) {
  NcclOptions options;
  EXPECT_EQ(options.device_index(), 0);
  EXPECT_EQ(options.timeout(), std::chrono::minutes(10));
  EXPECT_EQ(options.compute_stream(), nullptr);
  EXPECT_EQ(options.store_prefix(), "fsdp/nccl");
  EXPECT_FALSE(options.blocking_wait());
  EXPECT_EQ(options.max_in_flight_all_gathers(), 0);
  int stream_stand_in = 0;
  options.device_index(3)
      .timeout(std::chrono::milliseconds(50))
      .compute_stream(&stream_stand_in)
      .store_prefix("x");
  EXPECT_EQ(options.device_index(), 3);
  EXPECT_EQ(options.timeout(), std::chrono::milliseconds(50));
  EXPECT_EQ(options.compute_stream(), &stream_stand_in);
  EXPECT_EQ(options.store_prefix(), "x");
}

TEST(NcclOptionsTest, BadArgumentsThrowBeforeAnyCudaCall) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT([] { make_nccl_communicator(c10::intrusive_ptr<c10d::Store>(), 0, 1); },
              ThrowsMessage<c10::Error>(HasSubstr("expected a c10d store")));
  EXPECT_THAT([&] { make_nccl_communicator(store, 0, 1, NcclOptions().device_index(-1)); },
              ThrowsMessage<c10::Error>(HasSubstr("device_index must be >= 0, got -1")));
  EXPECT_THAT(
      [&] {
        make_nccl_communicator(store, 0, 1, NcclOptions().timeout(std::chrono::milliseconds(0)));
      },
      ThrowsMessage<c10::Error>(HasSubstr("timeout must be positive, got 0")));
  EXPECT_THAT(
      [&] { make_nccl_communicator(store, 0, 1, NcclOptions().max_in_flight_all_gathers(-1)); },
      ThrowsMessage<c10::Error>(HasSubstr("max_in_flight_all_gathers must be >= 0 (0: no bound), "
                                          "got -1")));
  EXPECT_THAT([&] { make_nccl_communicator(store, 2, 2); },
              ThrowsMessage<c10::Error>(HasSubstr("rank must be in [0, 2), got 2")));
}

// The size checks' comparison (Note [NCCL size checks] in nccl.cc, shared with Gloo).
TEST(SizeChecksTest, DescribesEveryRanksCollectiveWhenOneDisagrees) {
  const int64_t same[] = {2, 7, 2, 7};
  EXPECT_EQ(
      comm_internal::describe_mismatched_collectives(same, {0, 1}, CollectiveKind::kAllReduce, 7),
      "");
  const int64_t other[] = {2, 7, 0, 5, 9, 1};
  EXPECT_EQ(comm_internal::describe_mismatched_collectives(other, {0, 2, 4},
                                                           CollectiveKind::kAllReduce, 7),
            "rank 0 runs all_reduce of 7 elements, rank 2 runs all_gather_into_tensor of 5 "
            "elements, rank 4 runs collective kind 9 of 1 elements: the ranks are not running "
            "the same units in the same order");
  // A single rank that published another count than it runs (fault injection) disagrees
  // with itself.
  const int64_t injected[] = {2, 10};
  EXPECT_NE(
      comm_internal::describe_mismatched_collectives(injected, {0}, CollectiveKind::kAllReduce, 7),
      "");
}

TEST(SizeChecksTest, AnInjectedFaultIsTakenOnce) {
  EXPECT_EQ(comm_internal::take_size_check_fault(), 0);
  comm_internal::inject_size_check_fault(3);
  EXPECT_EQ(comm_internal::take_size_check_fault(), 3);
  EXPECT_EQ(comm_internal::take_size_check_fault(), 0);
}

// A rank whose device does not exist fails in setup with a c10::Error naming the CUDA
// call (cudaSetDevice on a GPU machine; cudaGetDevice or cudaSetDevice without one).
TEST(NcclSetupTest, InvalidDeviceFailsWithTheCudaCallsName) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const ncclUniqueId id = fake_id(0);
  store->set(comm_internal::unique_id_key("fsdp/nccl"),
             std::vector<uint8_t>(id.internal, id.internal + NCCL_UNIQUE_ID_BYTES));
  // Rank 1 of 2 only fetches the id, so no NCCL call runs before the device is set.
  EXPECT_THAT([&] { make_nccl_communicator(store, 1, 2, NcclOptions().device_index(1000)); },
              ThrowsMessage<c10::Error>(AllOf(
                  HasSubstr("make_nccl_communicator (rank 1 of 2, cuda:1000"),
                  AnyOf(HasSubstr("cudaGetDevice failed"), HasSubstr("cudaSetDevice failed")))));
}

// --- collectives on a GPU (W = 1) --------------------------------------------------------

// cuda_device_count names a reason exactly when it finds no device (FSDP_SKIP_WITHOUT_GPU
// prints it).
TEST(CudaDeviceCountTest, AReasonExactlyWhenThereIsNoDevice) {
  std::string why = "stale";
  const int count = cuda_device_count(&why);
  EXPECT_GE(count, 0);
  EXPECT_EQ(count == 0, !why.empty()) << why;
  if (count == 0) {
    EXPECT_THAT(why, HasSubstr("cudaGetDeviceCount"));
  }
  EXPECT_EQ(cuda_device_count(), count);
}

// Device memory holding a copy of a CPU tensor, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const at::Tensor& host) : host_(host.contiguous()) {
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(host_.nbytes(), 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host_.data_ptr(), host_.nbytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    // A pageable copy may still be in flight, and non-blocking streams do not wait for it.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  CommBuffer view() const {
    return {data_, host_.numel(), host_.scalar_type(), c10::Device(c10::kCUDA, 0)};
  }
  void* data() const { return data_; }
  // The device contents as a CPU tensor (synchronous copy).
  at::Tensor read() const {
    at::Tensor out = at::empty_like(host_);
    EXPECT_EQ(cudaMemcpy(out.data_ptr(), data_, host_.nbytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  at::Tensor host_;
  void* data_ = nullptr;
};

std::shared_ptr<Communicator> single_rank(NcclOptions options = {}) {
  return make_nccl_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
}

class NcclGpuTest : public ::testing::TestWithParam<c10::ScalarType> {};

TEST_P(NcclGpuTest, EveryCollectiveOnOneRankHasItsClosedForm) {
  FSDP_SKIP_WITHOUT_GPU();
  const c10::ScalarType dtype = GetParam();
  const bool floating = c10::isFloatingType(dtype);
  std::shared_ptr<Communicator> comm = single_rank();
  EXPECT_EQ(comm->backend_name(), "nccl");
  const at::Tensor values = (at::arange(6, at::kDouble) * 3 + 1).to(dtype);

  // W = 1: all-gather copies the input, reduce-scatter and all-reduce are the identity
  // (sum and average of one rank), broadcast from rank 0 keeps the data.
  DeviceBuffer input(values), output(at::zeros_like(values));
  comm->all_gather_into_tensor_async(output.view(), input.view())->wait();
  EXPECT_TRUE(at::equal(output.read(), values));

  DeviceBuffer scattered(at::zeros_like(values));
  comm->reduce_scatter_tensor_async(scattered.view(), input.view(), ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::equal(scattered.read(), values));

  DeviceBuffer reduced(values);
  comm->all_reduce_async(reduced.view(), ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::equal(reduced.read(), values));
  if (floating) {
    comm->all_reduce_async(reduced.view(), ReduceOp::kAvg)->wait();
    EXPECT_TRUE(at::equal(reduced.read(), values));
    DeviceBuffer averaged(at::zeros_like(values));
    comm->reduce_scatter_tensor_async(averaged.view(), input.view(), ReduceOp::kAvg)->wait();
    EXPECT_TRUE(at::equal(averaged.read(), values));
  }

  DeviceBuffer broadcast(values);
  WorkHandle work = comm->broadcast_async(broadcast.view(), 0);
  work->wait();
  EXPECT_TRUE(work->is_completed());
  EXPECT_TRUE(at::equal(broadcast.read(), values));
  comm->barrier();

  // One rank sends and receives nothing.
  EXPECT_EQ(comm->counters().get(CollectiveKind::kAllGather).calls, 1);
  EXPECT_EQ(comm->counters().get(CollectiveKind::kReduceScatter).calls, floating ? 2 : 1);
  EXPECT_EQ(comm->counters().get(CollectiveKind::kBarrier).calls, 1);
  EXPECT_EQ(comm->counters().total().bytes_sent, 0);
  EXPECT_EQ(comm->counters().total().bytes_received, 0);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, NcclGpuTest,
                         ::testing::Values(c10::kFloat, c10::kDouble, c10::kHalf, c10::kBFloat16,
                                           c10::kLong, c10::kInt, c10::kByte),
                         [](const ::testing::TestParamInfo<c10::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

// The collective starts after what the compute stream queued before it, and after wait()
// the compute stream sees the output.
TEST(NcclGpuStreamTest, CollectivesAreOrderedAgainstTheComputeStream) {
  FSDP_SKIP_WITHOUT_GPU();
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  {
    std::shared_ptr<Communicator> comm = single_rank(NcclOptions().compute_stream(compute));
    const int64_t n = 1 << 20;
    const at::Tensor values = at::arange(n, at::kFloat);
    DeviceBuffer input(at::zeros({n}, at::kFloat)), output(at::zeros({n}, at::kFloat));
    // The input is written on the compute stream right before the all-gather is issued.
    ASSERT_EQ(
        cudaMemcpyAsync(input.data(), values.data_ptr(), n * 4, cudaMemcpyHostToDevice, compute),
        cudaSuccess);
    comm->all_gather_into_tensor_async(output.view(), input.view())->wait();
    // Read the output back on the compute stream.
    at::Tensor back = at::empty({n}, at::kFloat);
    ASSERT_EQ(
        cudaMemcpyAsync(back.data_ptr(), output.data(), n * 4, cudaMemcpyDeviceToHost, compute),
        cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
    EXPECT_TRUE(at::equal(back, values));
  }
  EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
}

TEST(NcclGpuSubgroupTest, SubgroupOfOneRankWorks) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<Communicator> comm = single_rank();
  std::shared_ptr<Communicator> group = comm->new_subgroup({0});
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->world_size(), 1);
  DeviceBuffer t(at::full({3}, 5.0, at::kFloat));
  group->all_reduce_async(t.view())->wait();
  EXPECT_TRUE(at::equal(t.read(), at::full({3}, 5.0, at::kFloat)));
  EXPECT_EQ(group->counters().get(CollectiveKind::kAllReduce).calls, 1);
  EXPECT_EQ(comm->counters().get(CollectiveKind::kAllReduce).calls, 0);
}

TEST(NcclGpuValidationTest, CpuAndOtherDeviceBuffersAreRejected) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<Communicator> comm = single_rank();
  DeviceBuffer t(at::ones({4}, at::kFloat));
  CommBuffer on_cpu = t.view();
  on_cpu.device = c10::Device(c10::kCPU);
  EXPECT_THAT([&] { comm->all_reduce_async(on_cpu); },
              ThrowsMessage<c10::Error>(HasSubstr("the nccl backend cannot move a buffer on cpu")));
  CommBuffer other_gpu = t.view();
  other_gpu.device = c10::Device(c10::kCUDA, 1);
  EXPECT_THAT([&] { comm->all_reduce_async(other_gpu); },
              ThrowsMessage<c10::Error>(HasSubstr("cannot move a buffer on cuda:1")));
}

void CUDART_CB sleep_300_ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

// With blocking_wait, a collective held back by the compute stream misses a short
// deadline in wait(): the work throws a CommError naming it, the NCCL communicator is
// aborted, and later calls throw too. Runs last: it aborts an NCCL communicator.
TEST(NcclGpuZFailureTest, TimeoutAbortsAndBreaksTheCommunicator) {
  FSDP_SKIP_WITHOUT_GPU();
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  {
    std::shared_ptr<Communicator> comm =
        single_rank(NcclOptions().compute_stream(compute).blocking_wait(true));
    DeviceBuffer t(at::ones({4}, at::kFloat));
    ASSERT_EQ(cudaLaunchHostFunc(compute, sleep_300_ms, nullptr), cudaSuccess);
    WorkHandle work = comm->all_reduce_async(t.view());
    EXPECT_FALSE(work->is_completed());
    EXPECT_THAT([&] { work->wait(std::chrono::milliseconds(20)); },
                ThrowsMessage<CommError>(AllOf(HasSubstr("all_reduce #0 failed on rank 0"),
                                               HasSubstr("did not complete within 20 ms"),
                                               HasSubstr("aborted"))));
    EXPECT_TRUE(work->is_completed());
    EXPECT_THROW(work->wait(), CommError);  // the same error again
    EXPECT_THAT([&] { comm->barrier(); },
                ThrowsMessage<CommError>(AllOf(HasSubstr("barrier #1 failed on rank 0"),
                                               HasSubstr("broken by an earlier failure"))));
  }
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
}

// --- issue 29: the compute stream, the host running ahead, the watchdog, size checks ---

// With no compute_stream option the collective is ordered against the caller's current
// stream (a pool stream here, set as c10's current one), at the call and at the wait.
TEST(NcclGpuStreamTest, CollectivesFollowTheCallersCurrentStream) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<Communicator> comm = single_rank();
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  const c10::cuda::CUDAStreamGuard current(stream);
  const int64_t n = 1 << 20;
  const at::Tensor values = at::arange(n, at::kFloat);
  DeviceBuffer input(at::zeros({n}, at::kFloat)), output(at::zeros({n}, at::kFloat));
  ASSERT_EQ(cudaLaunchHostFunc(stream.stream(), sleep_300_ms, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(input.data(), values.data_ptr(), n * 4, cudaMemcpyHostToDevice,
                            stream.stream()),
            cudaSuccess);
  const auto begin = std::chrono::steady_clock::now();
  comm->all_gather_into_tensor_async(output.view(), input.view())->wait();
  // The host did not wait for the collective (held back 300 ms by the stream).
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::milliseconds(200));
  at::Tensor back = at::empty({n}, at::kFloat);
  ASSERT_EQ(cudaMemcpyAsync(back.data_ptr(), output.data(), n * 4, cudaMemcpyDeviceToHost,
                            stream.stream()),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream()), cudaSuccess);
  EXPECT_TRUE(at::equal(back, values));
}

// Issuing a third all-gather while two are in flight waits for the oldest on the host;
// with no bound it returns at once.
TEST(NcclGpuLimitTest, AThirdAllGatherWaitsForTheFirstToComplete) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const int limit : {2, 0}) {
    cudaStream_t compute = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
    {
      std::shared_ptr<Communicator> comm =
          single_rank(NcclOptions().compute_stream(compute).max_in_flight_all_gathers(limit));
      DeviceBuffer input(at::ones({4}, at::kFloat)), output(at::zeros({4}, at::kFloat));
      ASSERT_EQ(cudaLaunchHostFunc(compute, sleep_300_ms, nullptr), cudaSuccess);
      std::vector<WorkHandle> works;
      const auto begin = std::chrono::steady_clock::now();
      for (int i = 0; i < 3; ++i) {
        works.push_back(comm->all_gather_into_tensor_async(output.view(), input.view()));
      }
      const auto issued = std::chrono::steady_clock::now() - begin;
      if (limit == 2) {
        EXPECT_GE(issued, std::chrono::milliseconds(200)) << "limit " << limit;
      } else {
        EXPECT_LT(issued, std::chrono::milliseconds(200)) << "no limit";
      }
      for (const WorkHandle& work : works) work->wait();
      ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
      EXPECT_TRUE(at::equal(output.read(), at::ones({4}, at::kFloat)));
    }
    EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
  }
}

// Size checks at one rank: they pass for matching records, and a rank that publishes
// another count (fault injection) fails the collective with a CommError naming it, and
// breaks the communicator.
TEST(NcclGpuZFailureTest, SizeChecksNameTheDisagreement) {
  FSDP_SKIP_WITHOUT_GPU();
  std::shared_ptr<Communicator> comm = single_rank();
  comm->set_size_checks(true);
  DeviceBuffer t(at::full({4}, 2.0, at::kFloat));
  comm->all_reduce_async(t.view())->wait();
  EXPECT_TRUE(at::equal(t.read(), at::full({4}, 2.0, at::kFloat)));
  comm_internal::inject_size_check_fault(3);
  WorkHandle work = comm->all_reduce_async(t.view());
  EXPECT_THAT([&] { work->wait(); },
              ThrowsMessage<CommError>(
                  AllOf(HasSubstr("all_reduce #1 failed on rank 0"),
                        HasSubstr("size check: rank 0 runs all_reduce of 7 elements: the ranks are "
                                  "not running the same units in the same order"))));
  EXPECT_THROW(comm->barrier(), CommError);
}

// Without blocking_wait nobody waits on the host: the watchdog fails the collective at
// its deadline (moved to 20 ms by wait(20 ms)), aborts the NCCL communicator (which
// releases the stream behind it) and breaks the communicator.
TEST(NcclGpuZFailureTest, TheWatchdogFailsAStuckCollectiveWithoutAWaiter) {
  FSDP_SKIP_WITHOUT_GPU();
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  {
    std::shared_ptr<Communicator> comm = single_rank(NcclOptions().compute_stream(compute));
    DeviceBuffer t(at::ones({4}, at::kFloat));
    ASSERT_EQ(cudaLaunchHostFunc(compute, sleep_300_ms, nullptr), cudaSuccess);
    WorkHandle work = comm->all_reduce_async(t.view());
    work->wait(std::chrono::milliseconds(20));  // returns at once: the stream waits
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_TRUE(work->is_completed());
    EXPECT_THAT([&] { work->wait(); },
                ThrowsMessage<CommError>(AllOf(HasSubstr("all_reduce #0 failed on rank 0"),
                                               HasSubstr("did not complete within 20 ms"),
                                               HasSubstr("aborted"))));
    EXPECT_THAT([&] { comm->barrier(); },
                ThrowsMessage<CommError>(HasSubstr("broken by an earlier failure")));
  }
  EXPECT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(compute), cudaSuccess);
}

// A peer that never joins (rank 1 of 2 here) leaves the non-blocking communicator in
// progress: creation is aborted at the timeout and names the call.
TEST(NcclGpuZFailureTest, CreationGivesUpAtTheTimeoutWhenAPeerNeverJoins) {
  FSDP_SKIP_WITHOUT_GPU();
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_THAT(
      [&] {
        make_nccl_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 2,
                               NcclOptions().timeout(std::chrono::milliseconds(3000)));
      },
      ThrowsMessage<c10::Error>(AllOf(HasSubstr("make_nccl_communicator (rank 0 of 2"),
                                      HasSubstr("ncclCommInitRankConfig did not finish within "
                                                "3000 ms"))));
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(20));
}

}  // namespace
}  // namespace fsdp
