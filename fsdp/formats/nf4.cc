#include "fsdp/formats/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

// x86-64 CPUs with SSSE3 (nearly all) dequantize 16-bit values with its byte shuffle,
// chosen at run time (Note [Dequantizing NF4 on the CPU]); elsewhere the scalar loop.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FSDP_NF4_SSSE3 1
#include <immintrin.h>
#else
#define FSDP_NF4_SSSE3 0
#endif

namespace fsdp {
namespace {

// bitsandbytes' NF4 table, as its Python source writes it (float32 after conversion).
constexpr float kNf4[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};

// Per block of `blocksize` elements of the flat fp32 `x`: its absmax (float32 [blocks]) and
// each element's index into the ascending `code` whose value is nearest to x / absmax
// (int64 [numel]): bitsandbytes' default quantize_blockwise / quantize_4bit (a full block
// is scaled by a multiplication with 1 / absmax, the short last block by a division).
std::pair<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& x, const at::Tensor& code,
                                                  int64_t blocksize) {
  const int64_t n = x.numel(), full = n - n % blocksize;
  std::vector<at::Tensor> absmax, scaled;
  if (full > 0) {
    const at::Tensor blocks = x.narrow(0, 0, full).view({-1, blocksize});
    const at::Tensor m = std::get<0>(blocks.abs().max(-1));
    absmax.push_back(m);
    scaled.push_back(
        at::clamp(blocks * (1.0 / m.clamp_min(1e-38)).view({-1, 1}), -1, 1).reshape(-1));
  }
  if (full < n) {
    const at::Tensor rest = x.narrow(0, full, n - full);
    const at::Tensor m = rest.abs().max().clamp_min(1e-38);
    absmax.push_back(m.view({1}));
    scaled.push_back(at::clamp(rest / m, -1, 1));
  }
  const at::Tensor bounds =
      (code.narrow(0, 0, code.numel() - 1) + code.narrow(0, 1, code.numel() - 1)) / 2;
  return {at::cat(absmax), at::bucketize(at::cat(scaled), bounds)};
}

// out[i] = values[i] x absmax[i / blocksize] for the flat `out` [n]: one fp32 product,
// rounded once to out's dtype (at::mul_out computes in its inputs' dtype and casts on
// store). values float32 [>= n], absmax float32 [ceil(n / blocksize)], all on one device.
void scale_blocks(at::Tensor& out, const at::Tensor& values, const at::Tensor& absmax,
                  int64_t blocksize) {
  const int64_t n = out.numel(), full = n / blocksize, head = full * blocksize;
  if (full > 0) {
    at::Tensor blocks = out.narrow(0, 0, head).view({full, blocksize});
    at::mul_out(blocks, values.narrow(0, 0, head).view({full, blocksize}),
                absmax.narrow(0, 0, full).unsqueeze(1));
  }
  if (head < n) {
    at::Tensor rest = out.narrow(0, head, n - head);
    at::mul_out(rest, values.narrow(0, head, n - head), absmax.narrow(0, full, 1));
  }
}

// Note [Dequantizing NF4 on the CPU]
// QLoRA dequantizes every projection of a unit in forward and again in backward, so this
// runs over every frozen weight twice a step. The CPU loop below reads each code byte
// once and writes each value once in the output dtype. Like the composition of Note
// [Dequantizing NF4 off the CPU], it computes nf4 value x absmax as one fp32 product and
// rounds it to the dtype once (c10's conversions, round to nearest even), so the two give
// the same bits: fsdp/formats:nf4_test compares them, and tests:nf4_interop_test the loop
// with bitsandbytes. The loop makes each block's 16 products and conversions once, into a
// table, and copies every element from it; for 16-bit dtypes (bf16, fp16: QLoRA's compute
// dtypes) on x86-64 it looks up 32 elements at a time with SSSE3's byte shuffle. On one
// core, a [4096, 12288] bf16 weight (fsdp/formats:nf4_benchmark): 22-29 ms, against
// 92-124 ms converting each element.

// Note [Dequantizing NF4 off the CPU]
// On CUDA, dequantize_nf4 is a composition of ATen ops, three passes over a weight of n
// values: the code bytes widened to int32 (n / 2 x 4 bytes), each byte's two values looked
// up in a [256, 2] table (nf4_pairs; n x 4 bytes of fp32), and those times their block's
// absmax, broadcast over a [blocks, blocksize] view and written in the output dtype by the
// multiplication itself: about 14.5 bytes of memory traffic a bf16 value. (Unpacking the
// nibbles into an int64 index, repeating each absmax blocksize times and casting apart
// took about 47.) Nothing in it reads a value on the host: the table is made once per
// device and the double quantization's offset is a device tensor, so the host never waits
// for the device while it queues a step.

#if FSDP_NF4_SSSE3
// The 16-bit case of dequantize_block over the first multiple of 16 of `bytes` code bytes;
// returns how many it did. SSSE3's byte shuffle is a lookup in a table of 16 bytes, so the
// values' low and high bytes are looked up apart and interleaved into 16-bit values: 32
// values per 16 code bytes in a few instructions, where the scalar loop takes two loads
// and two stores a byte.
__attribute__((target("ssse3"))) int64_t dequantize_16bit_ssse3(const uint8_t* codes, int64_t bytes,
                                                                const uint16_t* table,
                                                                uint16_t* out) {
  alignas(16) uint8_t low[16], high[16];
  for (int k = 0; k < 16; ++k) {
    low[k] = static_cast<uint8_t>(table[k] & 0xff);
    high[k] = static_cast<uint8_t>(table[k] >> 8);
  }
  const __m128i low_table = _mm_load_si128(reinterpret_cast<const __m128i*>(low));
  const __m128i high_table = _mm_load_si128(reinterpret_cast<const __m128i*>(high));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  int64_t j = 0;
  for (; j + 16 <= bytes; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
    const __m128i first = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);  // element 2j
    const __m128i second = _mm_and_si128(b, nibble);                    // element 2j + 1
    const __m128i index[2] = {_mm_unpacklo_epi8(first, second), _mm_unpackhi_epi8(first, second)};
    for (int half = 0; half < 2; ++half) {
      const __m128i l = _mm_shuffle_epi8(low_table, index[half]);
      const __m128i h = _mm_shuffle_epi8(high_table, index[half]);
      __m128i* to = reinterpret_cast<__m128i*>(out + 2 * j + 16 * half);
      _mm_storeu_si128(to, _mm_unpacklo_epi8(l, h));
      _mm_storeu_si128(to + 1, _mm_unpackhi_epi8(l, h));
    }
  }
  return j;
}

bool has_ssse3() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("ssse3") != 0;
  }();
  return supported;
}
#endif

// One block: codes[0, ceil(count / 2)) to out[0, count). Its 16 values are converted to T
// once, into a table, and every element is a copy from it: the same bits as converting
// each product (the product depends only on the code). 16-bit values are looked up 32 at
// a time where the CPU has SSSE3.
template <typename T>
void dequantize_block(const uint8_t* codes, int64_t count, float scale, T* out) {
  T table[16];
  for (int k = 0; k < 16; ++k) table[k] = static_cast<T>(kNf4[k] * scale);
  const int64_t pairs = count / 2;
  int64_t j = 0;
#if FSDP_NF4_SSSE3
  if constexpr (sizeof(T) == 2) {
    if (has_ssse3()) {
      uint16_t bits[16];
      std::memcpy(bits, table, sizeof bits);
      j = dequantize_16bit_ssse3(codes, pairs, bits, reinterpret_cast<uint16_t*>(out));
    }
  }
#endif
  for (; j < pairs; ++j) {
    const uint8_t byte = codes[j];
    out[2 * j] = table[byte >> 4];
    out[2 * j + 1] = table[byte & 15];
  }
  if (count % 2 != 0) out[count - 1] = table[codes[pairs] >> 4];
}

template <typename T>
void dequantize_cpu(const uint8_t* codes, const float* absmax, int64_t n, int64_t blocksize,
                    T* out) {
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (int64_t{1} << 16) / blocksize),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) {
                       const int64_t first = b * blocksize;
                       dequantize_block(codes + first / 2, std::min(n - first, blocksize),
                                        absmax[b], out + first);
                     }
                   });
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel,
                  const Nf4Tensor& q) {
  TORCH_CHECK(
      t.defined() && t.scalar_type() == dtype && t.numel() == numel, "NF4 tensor of shape ",
      c10::IntArrayRef(q.shape), ": expected ", name, " of ", numel, " ", dtype, " values, found ",
      t.defined() ? std::to_string(t.numel()) + " " + c10::toString(t.scalar_type()) + " values"
                  : std::string("none"));
}

}  // namespace

at::Tensor nf4_code() { return at::tensor(std::vector<float>(kNf4, kNf4 + 16), at::kFloat); }

at::Tensor dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for exponent i,
  // the midpoints of 2^i + 1 float32 points from 0.1 to 1, times 10^(i - 6) (a float32
  // product), each with its negative; then 0 and 1, sorted.
  std::vector<float> data;
  for (int64_t i = 0; i < 7; ++i) {
    const at::Tensor bounds = at::linspace(0.1, 1, (int64_t{1} << i) + 1, at::kFloat);
    const int64_t k = bounds.numel() - 1;
    const at::Tensor means = (bounds.narrow(0, 0, k) + bounds.narrow(0, 1, k)) / 2.0;
    const double scale = std::pow(10.0, static_cast<double>(i - 6));
    const at::Tensor positive = (means * scale).contiguous(),
                     negative = (means * -scale).contiguous();
    data.insert(data.end(), positive.data_ptr<float>(), positive.data_ptr<float>() + k);
    data.insert(data.end(), negative.data_ptr<float>(), negative.data_ptr<float>() + k);
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

int64_t Nf4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Note [Quantizing NF4 on the CPU]
// A QLoRA run quantizes every frozen projection as the folder is read: 6.9 G values for an
// 8 B model, on the CPU. The ATen composition (quantize_blocks, the path kept for other
// devices) makes about ten passes over the values with an fp32 copy and an int64 index
// (31 ns a value on one core: ~3.5 minutes for 8 B); the loop below reads each value once
// for its block's absmax and once for its code, and writes each code byte once. It
// computes what the composition computes, in the same fp32 operations: a full block's
// absmax m unclamped, its values times 1 / max(m, 1e-38); the short last block's absmax
// clamped to 1e-38, its values divided by it; both clamped to [-1, 1], and the code the
// count of midpoints between neighbouring NF4 values that lie below the value
// (at::bucketize: a value on a midpoint takes the lower code). So the bytes are the same:
// fsdp/formats:nf4_test compares the two. A block with a non-finite value gets a NaN
// absmax, which quantize_nf4 refuses.

// The bits of |v| as an unsigned integer: ordered as |v| is for finite values, and
// 0x7f800000 or more exactly when v is infinite or NaN.
inline uint32_t abs_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x7fffffffu;
}

// One block of Note [Quantizing NF4 on the CPU]: x[0, count), count even unless the
// block is the tensor's last; writes absmax[0] and codes[0, ceil(count / 2)). In groups of
// kGroup values held in arrays on the stack: loops of a fixed count over them are what
// the compiler vectorizes at -O2.
constexpr int kGroup = 16;

template <typename T>
void quantize_block(const T* x, int64_t count, bool full, const float* bounds, float* absmax,
                    uint8_t* codes) {
  uint32_t top[kGroup] = {};  // the largest |x| as bits: an integer max needs no NaN rules
  int64_t i = 0;
  for (; i + kGroup <= count; i += kGroup) {
    for (int j = 0; j < kGroup; ++j) {
      top[j] = std::max(top[j], abs_bits(static_cast<float>(x[i + j])));
    }
  }
  for (; i < count; ++i) top[0] = std::max(top[0], abs_bits(static_cast<float>(x[i])));
  const uint32_t m_bits = *std::max_element(top, top + kGroup);
  if (m_bits >= 0x7f800000u) {
    absmax[0] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float m;
  std::memcpy(&m, &m_bits, sizeof m);
  const float clamped = std::max(m, 1e-38f), inverse = 1.0f / clamped;
  absmax[0] = full ? m : clamped;
  for (int64_t start = 0; start < count; start += kGroup) {
    const int64_t len = std::min<int64_t>(kGroup, count - start);
    // A short group is padded with 0.0, whose code (7) is also the padding of an odd count.
    float v[kGroup];
    if (len == kGroup) {
      for (int j = 0; j < kGroup; ++j) v[j] = static_cast<float>(x[start + j]);
    } else {
      for (int j = 0; j < kGroup; ++j) v[j] = j < len ? static_cast<float>(x[start + j]) : 0.0f;
    }
    if (full) {
      for (int j = 0; j < kGroup; ++j) v[j] *= inverse;
    } else {
      for (int j = 0; j < kGroup; ++j) v[j] /= clamped;
    }
    for (int j = 0; j < kGroup; ++j) v[j] = std::min(std::max(v[j], -1.0f), 1.0f);
    int32_t c[kGroup] = {};
    for (int k = 0; k < 15; ++k) {
      for (int j = 0; j < kGroup; ++j) c[j] += bounds[k] < v[j] ? 1 : 0;
    }
    for (int64_t j = 0; j < len; j += 2) {
      codes[(start + j) / 2] = static_cast<uint8_t>(c[j] << 4 | c[j + 1]);
    }
  }
}

template <typename T>
void quantize_cpu(const T* x, int64_t n, int64_t blocksize, const float* bounds, float* absmax,
                  uint8_t* codes) {
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (int64_t{1} << 16) / blocksize),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t b = begin; b < end; ++b) {
                       const int64_t first = b * blocksize, count = std::min(n - first, blocksize);
                       quantize_block(x + first, count, count == blocksize, bounds, absmax + b,
                                      codes + first / 2);
                     }
                   });
}

// The codes and each block's absmax (float32 [blocks]) of the flat `x` on the CPU.
std::pair<at::Tensor, at::Tensor> quantize_nf4_cpu(const at::Tensor& x, int64_t blocksize) {
  const at::Tensor flat = x.reshape(-1).contiguous();
  const int64_t n = flat.numel();
  at::Tensor absmax =
      at::empty({(n + blocksize - 1) / blocksize}, flat.options().dtype(at::kFloat));
  at::Tensor codes = at::empty({(n + 1) / 2}, flat.options().dtype(at::kByte));
  float bounds[15];
  for (int k = 0; k < 15; ++k) bounds[k] = (kNf4[k] + kNf4[k + 1]) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, flat.scalar_type(), "quantize_nf4", [&] {
        quantize_cpu(flat.data_ptr<scalar_t>(), n, blocksize, bounds, absmax.data_ptr<float>(),
                     codes.data_ptr<uint8_t>());
      });
  return {std::move(codes), std::move(absmax)};
}

// The codes and each block's absmax from ATen ops, on x's device.
std::pair<at::Tensor, at::Tensor> quantize_nf4_aten(const at::Tensor& x, int64_t blocksize) {
  auto [absmax, index] =
      quantize_blocks(x.reshape(-1).to(at::kFloat), nf4_code().to(x.device()), blocksize);
  // An odd count ends with a padding value 0.0 (bitsandbytes pads the scaled values): code 7.
  if (index.numel() % 2 != 0) index = at::cat({index, at::full({1}, 7, index.options())});
  const at::Tensor pairs = index.to(at::kByte).view({-1, 2});
  return {at::bitwise_or(at::bitwise_left_shift(pairs.select(1, 0), 4), pairs.select(1, 1)),
          absmax};
}

Nf4Tensor quantize(const at::Tensor& x, bool double_quant, int64_t blocksize, bool composite) {
  TORCH_CHECK(x.defined() && x.numel() > 0 && at::isFloatingType(x.scalar_type()),
              "quantize_nf4: expected a floating tensor with elements, found ",
              x.defined() ? c10::toString(x.scalar_type()) : "none", " of shape ",
              x.defined() ? x.sizes() : c10::IntArrayRef());
  TORCH_CHECK(blocksize >= 2 && blocksize % 2 == 0,
              "quantize_nf4: expected an even blocksize of 2 or more, found ", blocksize);
  Nf4Tensor q;
  q.shape = x.sizes().vec();
  q.dtype = x.scalar_type();
  q.blocksize = blocksize;
  // See Note [Quantizing NF4 on the CPU].
  auto [codes, absmax] = x.device().is_cpu() && !composite ? quantize_nf4_cpu(x, blocksize)
                                                           : quantize_nf4_aten(x, blocksize);
  const at::Tensor nonfinite = at::logical_not(at::isfinite(absmax)).nonzero();
  TORCH_CHECK(nonfinite.numel() == 0, "quantize_nf4: expected finite values, found NaN or ",
              "infinity in the block of ", blocksize, " values from flat index ",
              nonfinite.numel() > 0 ? nonfinite[0][0].item<int64_t>() * blocksize : 0,
              " of a tensor of shape ", x.sizes(),
              "; a weight that is not finite cannot be quantized (check the checkpoint)");
  q.codes = std::move(codes);
  if (!double_quant) {
    q.absmax = std::move(absmax);
    return q;
  }
  const at::Tensor mean = absmax.mean();
  q.offset = mean.reshape({1});
  q.nested_code = dynamic_map().to(x.device());
  auto [nested, bytes] = quantize_blocks(absmax - mean, q.nested_code, q.nested_blocksize);
  q.absmax = bytes.to(at::kByte);
  q.nested_absmax = nested;
  return q;
}

}  // namespace

Nf4Tensor quantize_nf4(const at::Tensor& x, bool double_quant, int64_t blocksize) {
  return quantize(x, double_quant, blocksize, /*composite=*/false);
}

Nf4Tensor quantize_nf4_composite(const at::Tensor& x, bool double_quant, int64_t blocksize) {
  return quantize(x, double_quant, blocksize, /*composite=*/true);
}

namespace {

// Checks `q` against its shape; each block's absmax, fp32 [blocks].
at::Tensor checked_absmax(const Nf4Tensor& q) {
  for (int64_t d : q.shape) {
    TORCH_CHECK(d >= 0, "NF4 tensor: expected a shape of sizes >= 0, found ",
                c10::IntArrayRef(q.shape));
  }
  TORCH_CHECK(q.blocksize >= 2 && q.blocksize % 2 == 0 && q.nested_blocksize >= 1,
              "NF4 tensor: expected an even blocksize of 2 or more, found ", q.blocksize);
  TORCH_CHECK(at::isFloatingType(q.dtype), "NF4 tensor: expected a floating dtype, found ",
              q.dtype);
  const int64_t n = q.numel(), blocks = q.blocks();
  check_tensor(q.codes, "codes", at::kByte, (n + 1) / 2, q);
  if (!q.double_quantized()) {
    check_tensor(q.absmax, "absmax", at::kFloat, blocks, q);
    return q.absmax;
  }
  check_tensor(q.absmax, "absmax (double quantized)", at::kByte, blocks, q);
  check_tensor(q.nested_absmax, "nested_absmax", at::kFloat,
               (blocks + q.nested_blocksize - 1) / q.nested_blocksize, q);
  check_tensor(q.nested_code, "nested_code", at::kFloat, 256, q);
  check_tensor(q.offset, "offset", at::kFloat, 1, q);
  at::Tensor absmax = at::empty({blocks}, q.nested_absmax.options());
  scale_blocks(absmax, q.nested_code.index_select(0, q.absmax.to(at::kInt)), q.nested_absmax,
               q.nested_blocksize);
  return absmax.add_(q.offset);
}

// Each code byte's two NF4 values, its high nibble's first: float32 [256, 2] on `device`.
// Made once per device and kept for the process, since a copy to a CUDA device waits for
// the device, which dequantizing (every frozen weight, every step) must not.
at::Tensor nf4_pairs(c10::Device device) {
  struct Tables {
    std::mutex mutex;
    absl::flat_hash_map<c10::Device, at::Tensor> by_device;
  };
  static Tables* const tables = new Tables;  // never destroyed: CUDA may be torn down first
  std::lock_guard<std::mutex> lock(tables->mutex);
  at::Tensor& pairs = tables->by_device[device];
  if (!pairs.defined()) {
    at::Tensor cpu = at::empty({256, 2}, at::TensorOptions(at::kFloat).device(c10::kCPU));
    float* values = cpu.data_ptr<float>();
    for (int byte = 0; byte < 256; ++byte) {
      values[2 * byte] = kNf4[byte >> 4];
      values[2 * byte + 1] = kNf4[byte & 15];
    }
    pairs = cpu.to(device);
  }
  return pairs;
}

// The ATen composition of Note [Dequantizing NF4 off the CPU], on codes' device.
at::Tensor dequantize_composite(const Nf4Tensor& q, const at::Tensor& absmax) {
  const at::Tensor values =
      nf4_pairs(q.codes.device()).index_select(0, q.codes.reshape(-1).to(at::kInt)).view(-1);
  at::Tensor out = at::empty({q.numel()}, q.codes.options().dtype(q.dtype));
  scale_blocks(out, values, absmax, q.blocksize);
  return out.view(q.shape);
}

}  // namespace

at::Tensor dequantize_nf4(const Nf4Tensor& q) {
  const at::Tensor absmax = checked_absmax(q);
  if (!q.codes.device().is_cpu()) return dequantize_composite(q, absmax);
  // See Note [Dequantizing NF4 on the CPU].
  const at::Tensor bytes = q.codes.reshape(-1).contiguous();
  const at::Tensor scales = absmax.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q.shape, bytes.options().dtype(q.dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.dtype, "dequantize_nf4", [&] {
    dequantize_cpu(bytes.data_ptr<uint8_t>(), scales.data_ptr<float>(), q.numel(), q.blocksize,
                   out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor dequantize_nf4_composite(const Nf4Tensor& q) {
  return dequantize_composite(q, checked_absmax(q));
}

}  // namespace fsdp
