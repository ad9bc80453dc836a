// Numbers read from files checked before they are used: a count (a step, an epoch, an
// element count) must be an integer in [0, 2^53), where every integer is exact as a
// double (PyTorch keeps Adam's step as a float32 or float64 tensor), and a float that
// feeds training (a learning rate, a momentum) must be finite. A checkpoint holding
// step -10^12 would otherwise train with a negative learning rate forever.
//
//   int64_t step = fsdp::checked_count(value, "'/ckpt/step_200': step");
//   double lr = fsdp::checked_finite(v, "param_groups[0]['lr']");
//
// Errors: c10::Error "FIELD is VALUE; expected an integer in [0, 2^53) (...)" or
// "FIELD is VALUE; expected a finite number (...)". Threading: reentrant.
// PyTorch counterpart: none (torch.load trusts the values it reads).
#ifndef FSDP_FORMATS_VALUES_H_
#define FSDP_FORMATS_VALUES_H_

#include <cstdint>
#include <string_view>

namespace fsdp {

// The bound on counts read from files: 2^53.
constexpr int64_t kMaxFileCount = int64_t{1} << 53;

// `value` if it is an integer in [0, kMaxFileCount); else throws naming `field`.
int64_t checked_count(int64_t value, std::string_view field);
int64_t checked_count(double value, std::string_view field);

// `value` if it is finite; else throws naming `field`.
double checked_finite(double value, std::string_view field);

}  // namespace fsdp

#endif  // FSDP_FORMATS_VALUES_H_
