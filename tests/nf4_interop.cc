// The C++ half of nf4_interop_test.sh: fsdp's NF4 against bitsandbytes' (nf4_interop.py's
// file). For every case: fsdp dequantizes bitsandbytes' bytes to its values bit for bit
// (double quantized and not), and quantizes the input to the same codes, absmax and
// nested statistics. Prints one line per check; exits 1 if any fails.
//   nf4_interop FILE.safetensors
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include <ATen/Functions.h>

#include "fsdp/formats/nf4.h"
#include "fsdp/formats/safetensors.h"

namespace {

int failed = 0;

void check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok " : "FAIL ") << what << "\n";
  if (!ok) ++failed;
}

// Whether a and b hold the same bytes (same dtype and shape).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: nf4_interop FILE.safetensors\n";
    return 2;
  }
  const fsdp::SafetensorsFile file = fsdp::SafetensorsFile::open(argv[1]);
  std::map<std::string, std::map<std::string, at::Tensor>> cases;
  for (const auto& info : file.header().tensors) {
    const size_t dot = info.name.find('.');
    cases[info.name.substr(0, dot)][info.name.substr(dot + 1)] = file.read(info.name);
  }
  for (auto& [name, t] : cases) {
    const at::Tensor& x = t.at("x");
    // bitsandbytes' bytes, dequantized here.
    fsdp::Nf4Tensor plain;
    plain.shape = x.sizes().vec();
    plain.dtype = x.scalar_type();
    plain.codes = t.at("plain_codes");
    plain.absmax = t.at("plain_absmax");
    fsdp::Nf4Tensor nested = plain;
    nested.codes = t.at("codes");
    nested.absmax = t.at("absmax");
    nested.nested_absmax = t.at("nested_absmax");
    nested.nested_code = t.at("nested_code");
    nested.offset = t.at("offset").reshape({1});
    check(same_bits(fsdp::dequantize_nf4(plain), t.at("plain_dequantized")),
          name + ": dequantized bitsandbytes' bytes bit for bit");
    check(same_bits(fsdp::dequantize_nf4(nested), t.at("dequantized")),
          name + ": dequantized bitsandbytes' double-quantized bytes bit for bit");
    // The input, quantized here.
    const fsdp::Nf4Tensor ours = fsdp::quantize_nf4(x, false), ours2 = fsdp::quantize_nf4(x, true);
    check(
        same_bits(ours.codes, t.at("plain_codes")) && same_bits(ours.absmax, t.at("plain_absmax")),
        name + ": quantized to bitsandbytes' codes and absmax");
    const int64_t differ = ours2.absmax.ne(t.at("absmax")).sum().item<int64_t>();
    check(same_bits(ours2.codes, t.at("codes")) && differ == 0 &&
              same_bits(ours2.nested_absmax, t.at("nested_absmax")) &&
              same_bits(ours2.nested_code, t.at("nested_code")) &&
              same_bits(ours2.offset, nested.offset),
          name + ": double-quantized to bitsandbytes' codes, absmax bytes (" +
              std::to_string(differ) + " of " + std::to_string(ours2.absmax.numel()) +
              " differ), nested absmax, code and offset");
  }
  std::cout << (failed == 0 ? "PASS" : "FAIL") << ": " << cases.size() << " cases\n";
  return failed == 0 ? 0 : 1;
}
