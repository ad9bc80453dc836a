// NF4 quantization and dequantization of one Qwen3-8B MLP projection's shape ([4096,
// 12288] bf16, 50 M values) on one CPU thread: the CPU loops against the ATen
// compositions they replace on the CPU (Note [Quantizing NF4 on the CPU], Note
// [Dequantizing NF4 on the CPU] in nf4.cc). Values/s counts the weight's values.
//
//   bazel run -c opt //fsdp/formats:nf4_benchmark
#include <malloc.h>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include "fsdp/formats/nf4.h"

namespace fsdp {
namespace {

const at::Tensor& weight() {
  static const at::Tensor w = [] {
    at::set_num_threads(1);
    // Outputs reuse freed memory, as in the trainers (fsdp::CachingCpuAllocator): glibc
    // would map each 100 MB output afresh, and its page faults would outweigh the loops.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    at::manual_seed(0);
    return at::randn({4096, 12288}, at::kBFloat16);
  }();
  return w;
}

void BM_QuantizeNf4(benchmark::State& state) {
  const bool composite = state.range(0) != 0;
  weight();  // made outside the timed loop
  for (auto _ : state) {
    const Nf4Tensor q = composite ? quantize_nf4_composite(weight()) : quantize_nf4(weight());
    benchmark::DoNotOptimize(q.codes.data_ptr());
  }
  state.SetLabel(composite ? "ATen composition" : "CPU loop");
  state.SetItemsProcessed(state.iterations() * weight().numel());
}
BENCHMARK(BM_QuantizeNf4)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_DequantizeNf4(benchmark::State& state) {
  const bool composite = state.range(0) != 0;
  const Nf4Tensor q = quantize_nf4(weight());
  for (auto _ : state) {
    const at::Tensor w = composite ? dequantize_nf4_composite(q) : dequantize_nf4(q);
    benchmark::DoNotOptimize(w.data_ptr());
  }
  state.SetLabel(composite ? "ATen composition" : "CPU loop");
  state.SetItemsProcessed(state.iterations() * weight().numel());
}
BENCHMARK(BM_DequantizeNf4)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace fsdp
