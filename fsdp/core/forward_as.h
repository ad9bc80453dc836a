// ForwardAs: gives a wrapper module (Unit<T>, CheckpointWrapper<T>) a non-template
// forward() with exactly the signature of the wrapped module's. A building block of the
// wrapper templates in unit.h and checkpoint_wrapper.h, not an API of its own.
#ifndef FSDP_CORE_FORWARD_AS_H_
#define FSDP_CORE_FORWARD_AS_H_

#include <utility>

namespace fsdp {
namespace detail {

// Gives Derived a non-template forward() with exactly the signature of Contained's, so
// AnyModule (Sequential) can take its address. Derived provides call(args...).
template <typename Derived, typename Signature>
class ForwardAs;

template <typename Derived, typename Contained, typename Result, typename... Args>
class ForwardAs<Derived, Result (Contained::*)(Args...)> {
 public:
  Result forward(Args... args) {
    return static_cast<Derived*>(this)->call(std::forward<Args>(args)...);
  }
};

}  // namespace detail
}  // namespace fsdp

#endif  // FSDP_CORE_FORWARD_AS_H_
