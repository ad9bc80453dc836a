// NF4 (4-bit NormalFloat, QLoRA's frozen-weight format) as bitsandbytes 0.50 stores it, so
// that a pre-quantized Hugging Face folder (transformers + bitsandbytes' `weight`,
// `weight.absmax`, `weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`)
// and fsdp's own quantization give the same bytes and the same values:
//
//   fsdp::Nf4Tensor q = fsdp::quantize_nf4(weight);  // bf16 [out, in] -> 4 bits a value
//   at::Tensor w = fsdp::dequantize_nf4(q);           // bf16 [out, in] again (rounded)
//
// Layout (element i of the flattened tensor): its 4-bit code is the high nibble of byte
// i / 2 when i is even, the low nibble when odd; blocks of `blocksize` (64) consecutive
// elements share one absmax (the last block may be shorter), and the value is
// nf4_code()[code] x absmax in fp32, then cast to the tensor's dtype. With double
// quantization the absmax values are themselves stored in 8 bits: absmax[b] =
// nested_code[absmax byte b] x nested_absmax[b / 256] + offset (fp32), nested_code being
// bitsandbytes' signed dynamic map (dynamic_map()). PyTorch/bitsandbytes:
// bitsandbytes.functional.quantize_4bit(x, blocksize=64, quant_type="nf4",
// compress_statistics=True) and dequantize_4bit (Linear4bit's, QLoRA's defaults).
//
// Devices: any; every tensor of an Nf4Tensor on one device, the result on it. Errors:
// c10::Error saying what was expected and what was found (sizes that do not agree with
// the shape, wrong dtypes, an empty or non-floating input). Threading: pure functions.
#ifndef FSDP_FORMATS_NF4_H_
#define FSDP_FORMATS_NF4_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp {

// The 16 NF4 values, ascending from -1 to 1 (bitsandbytes' get_4bit_type("nf4")): float32
// [16] on the CPU.
at::Tensor nf4_code();

// bitsandbytes' create_dynamic_map(signed=True): the 256 values, ascending, of the 8-bit
// code that double quantization stores the absmax values in. float32 [256] on the CPU.
at::Tensor dynamic_map();

struct Nf4Tensor {
  std::vector<int64_t> shape;         // of the tensor it stands for
  at::ScalarType dtype = at::kFloat;  // ... and its dtype (dequantize_nf4 returns it)
  int64_t blocksize = 64;             // elements per absmax
  at::Tensor codes;                   // uint8 [ceil(numel / 2)]
  // float32 [blocks], blocks = ceil(numel / blocksize); or, double quantized, uint8
  // [blocks] with the three below.
  at::Tensor absmax;
  at::Tensor nested_absmax;  // float32 [ceil(blocks / nested_blocksize)]
  at::Tensor nested_code;    // float32 [256]: the absmax bytes' values (dynamic_map())
  // float32 [1]: the mean of the absmax values, added back. A tensor on the codes' device,
  // so that dequantizing never reads it on the host (a wait for the device on CUDA).
  at::Tensor offset;
  int64_t nested_blocksize = 256;

  bool double_quantized() const { return nested_absmax.defined(); }
  int64_t numel() const;
  int64_t blocks() const { return (numel() + blocksize - 1) / blocksize; }
};

// `x` (floating, any shape, not empty, finite) in NF4: each block's absmax, then each
// element scaled by it and given the code of the nearest NF4 value (ties to the lower one),
// as bitsandbytes' quantize_4bit does on the CPU; with `double_quant` the absmax values less
// their mean, in blocks of 256, given the nearest value of dynamic_map() the same way. The
// result is on x's device. On the CPU one loop over the values (at::parallel_for); elsewhere
// quantize_nf4_composite. A NaN or infinite value raises c10::Error naming its block.
Nf4Tensor quantize_nf4(const at::Tensor& x, bool double_quant = true, int64_t blocksize = 64);

// The same bytes from a composition of ATen ops, on any device: what quantize_nf4 runs off
// the CPU (CUDA), here so that the two can be compared on the CPU.
Nf4Tensor quantize_nf4_composite(const at::Tensor& x, bool double_quant = true,
                                 int64_t blocksize = 64);

// The tensor `q` stands for: shape q.shape, dtype q.dtype, on q.codes' device; bit for bit
// bitsandbytes' dequantize_4bit of the same bytes. On the CPU one loop over the codes
// (at::parallel_for); elsewhere dequantize_nf4_composite.
at::Tensor dequantize_nf4(const Nf4Tensor& q);

// The same values from a composition of ATen ops, on any device: what dequantize_nf4 runs
// off the CPU (CUDA), here so that the two can be compared on the CPU.
at::Tensor dequantize_nf4_composite(const Nf4Tensor& q);

}  // namespace fsdp

#endif  // FSDP_FORMATS_NF4_H_
