// NF4 by hand-worked values: the code table, the nibble order, blocks and their absmax,
// double quantization's round trip, and sizes that do not agree refused.
#include "fsdp/formats/nf4.h"

#include <limits>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::vector<int64_t> bytes(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(Nf4Test, TablesAreBitsandbytes) {
  const at::Tensor code = nf4_code();
  ASSERT_EQ(code.numel(), 16);
  EXPECT_EQ(code[0].item<float>(), -1.0f);
  EXPECT_EQ(code[7].item<float>(), 0.0f);
  EXPECT_EQ(code[15].item<float>(), 1.0f);
  EXPECT_TRUE(at::equal(code, std::get<0>(code.sort())));  // ascending
  const at::Tensor dynamic = dynamic_map();
  ASSERT_EQ(dynamic.numel(), 256);
  EXPECT_TRUE(at::equal(dynamic, std::get<0>(dynamic.sort())));
  EXPECT_EQ(dynamic[0].item<float>(), -dynamic[254].item<float>());  // signed, then 0 and 1
  EXPECT_EQ(dynamic[255].item<float>(), 1.0f);
}

// Block 0 (4 elements): absmax 2; x / 2 = 1, -1, 0, 0.03 -> codes 15, 0, 7, 7 (0.03 is
// nearer 0 than 0.0796). Block 1 (the short last one, 2 elements): absmax 0.5, x / 0.5 =
// 1, -0.4 -> 15, 3 (-0.4 is nearer -0.3949 than -0.5251).
TEST(Nf4Test, CodesAreNibblesOfNearestValues) {
  const at::Tensor x = at::tensor({2.0f, -2.0f, 0.0f, 0.06f, 0.5f, -0.2f});
  const Nf4Tensor q = quantize_nf4(x, /*double_quant=*/false, /*blocksize=*/4);
  EXPECT_EQ(bytes(q.codes), (std::vector<int64_t>{0xF0, 0x77, (15 << 4) | 3}));
  EXPECT_TRUE(at::equal(q.absmax, at::tensor({2.0f, 0.5f})));
  const at::Tensor back = dequantize_nf4(q);
  const at::Tensor code = nf4_code();
  EXPECT_TRUE(at::equal(back, at::stack({code[15] * 2, code[0] * 2, code[7] * 2, code[7] * 2,
                                         code[15] * 0.5f, code[3] * 0.5f})));
}

TEST(Nf4Test, DoubleQuantizationKeepsTheAbsmaxClose) {
  at::manual_seed(0);
  const at::Tensor w = at::randn({40, 96}, at::kBFloat16);
  const Nf4Tensor plain = quantize_nf4(w, false), nested = quantize_nf4(w, true);
  ASSERT_TRUE(nested.double_quantized());
  EXPECT_EQ(nested.absmax.scalar_type(), at::kByte);
  EXPECT_EQ(nested.blocks(), 60);
  EXPECT_EQ(nested.nested_absmax.numel(), 1);
  EXPECT_TRUE(at::equal(plain.codes, nested.codes));
  const at::Tensor a = dequantize_nf4(plain).to(at::kFloat),
                   b = dequantize_nf4(nested).to(at::kFloat);
  EXPECT_EQ(dequantize_nf4(nested).sizes(), w.sizes());
  EXPECT_EQ(dequantize_nf4(nested).scalar_type(), at::kBFloat16);
  // NF4's worst case is half the widest gap (0.16 of the absmax); the absmax's own 8 bits
  // add about 1%.
  EXPECT_LT((a - w.to(at::kFloat)).abs().max().item<float>(), 0.6f);
  EXPECT_LT(((a - b).abs() / a.abs().clamp_min(1e-6)).max().item<float>(), 0.02f);
}

// The CPU loop and the ATen composition (CUDA's path) give the same bits, for every
// output dtype, with and without double quantization, for a numel that is odd and not a
// multiple of the blocksize. Blocksizes of 64 and 32 run the 16-bit values through the
// SSSE3 lookup (16 code bytes at a time) on x86-64, with the scalar loop for the rest of
// each block; 4 and 2 the scalar loop alone, as do fp32 and fp64.
TEST(Nf4Test, CpuLoopEqualsTheAtenComposition) {
  at::manual_seed(0);
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{96, 70}, {3, 5, 7}, {1}, {2, 1001}}) {
    for (const int64_t blocksize : {64, 32, 4, 2}) {
      for (const bool double_quant : {true, false}) {
        for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
          const Nf4Tensor q = quantize_nf4(at::randn(shape).to(dtype), double_quant, blocksize);
          const at::Tensor loop = dequantize_nf4(q), composite = dequantize_nf4_composite(q);
          EXPECT_EQ(loop.scalar_type(), dtype);
          EXPECT_EQ(loop.sizes(), composite.sizes());
          EXPECT_TRUE(at::equal(loop, composite))
              << c10::IntArrayRef(shape) << " " << dtype << " blocksize " << blocksize;
        }
      }
    }
  }
}

// Quantizing: the CPU loop and the ATen composition give the same bytes, for every input
// dtype, blocksize and double quantization, for a numel that is odd and not a multiple of
// the blocksize, a block of zeros, and values exactly on the midpoints between NF4 values
// (the lower code) and on the NF4 values themselves.
TEST(Nf4Test, CpuQuantizationEqualsTheAtenComposition) {
  at::manual_seed(0);
  const at::Tensor code = nf4_code();
  const at::Tensor midpoints = (code.narrow(0, 0, 15) + code.narrow(0, 1, 15)) / 2;
  // One block of 64 whose absmax is 1: the 15 midpoints, the 16 values, then zeros.
  const at::Tensor ties = at::cat({midpoints, code, at::zeros({64 - 31})});
  const std::vector<at::Tensor> inputs = {at::randn({96, 70}), at::randn({3, 5, 7}) * 1e-3,
                                          at::randn({1}),
                                          at::cat({ties, at::zeros({64}), at::randn({65})})};
  for (const at::Tensor& input : inputs) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
      for (const int64_t blocksize : {64, 4, 2}) {
        for (const bool double_quant : {true, false}) {
          const at::Tensor x = input.to(dtype);
          const Nf4Tensor loop = quantize_nf4(x, double_quant, blocksize),
                          composite = quantize_nf4_composite(x, double_quant, blocksize);
          const std::string what = ::testing::PrintToString(input.sizes().vec()) + " " +
                                   c10::toString(dtype) + " blocksize " + std::to_string(blocksize);
          EXPECT_TRUE(at::equal(loop.codes, composite.codes)) << what;
          EXPECT_TRUE(at::equal(loop.absmax, composite.absmax)) << what;
          EXPECT_EQ(loop.offset.defined(), double_quant) << what;
          if (double_quant) {
            EXPECT_TRUE(at::equal(loop.offset, composite.offset)) << what;
            EXPECT_TRUE(at::equal(loop.nested_absmax, composite.nested_absmax)) << what;
          }
        }
      }
    }
  }
  // The ties block by hand: midpoint k takes code k (the lower of its two values), value k
  // code k, zeros code 7.
  const at::Tensor codes = quantize_nf4(ties, false).codes;
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 64; i += 2) {
    const auto nibble = [](int64_t j) -> int64_t { return j < 15 ? j : j < 31 ? j - 15 : 7; };
    expected.push_back(nibble(i) << 4 | nibble(i + 1));
  }
  EXPECT_EQ(bytes(codes), expected);
}

TEST(Nf4Test, NonFiniteValuesAreRefused) {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    at::Tensor x = at::ones({4, 64});
    x[2][5] = bad;
    for (const bool composite : {false, true}) {
      EXPECT_THAT(
          [&] { composite ? quantize_nf4_composite(x) : quantize_nf4(x); },
          ThrowsMessage<c10::Error>(HasSubstr(
              "quantize_nf4: expected finite values, found NaN or infinity in the block of 64 "
              "values from flat index 128 of a tensor of shape [4, 64]")));
    }
  }
}

TEST(Nf4Test, SizesThatDisagreeAreRefused) {
  Nf4Tensor q = quantize_nf4(at::ones({3, 64}), true);
  q.shape = {3, 66};
  EXPECT_THAT([&] { dequantize_nf4(q); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "NF4 tensor of shape [3, 66]: expected codes of 99 Byte values, found 96 Byte "
                  "values")));
  q.shape = {3, 64};
  q.nested_code = at::Tensor();
  EXPECT_THAT([&] { dequantize_nf4(q); },
              ThrowsMessage<c10::Error>(HasSubstr("expected nested_code of 256 Float values, "
                                                  "found none")));
  EXPECT_THAT([&] { quantize_nf4(at::ones({2}, at::kLong)); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("quantize_nf4: expected a floating tensor with elements, found Long")));
}

}  // namespace
}  // namespace fsdp
