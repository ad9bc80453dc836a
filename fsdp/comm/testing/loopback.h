// Bytes transmitted on the loopback interface, from /proc/net/dev: what benchmarks
// compare with the traffic formulas (every process of the machine counts).
#ifndef FSDP_COMM_TESTING_LOOPBACK_H_
#define FSDP_COMM_TESTING_LOOPBACK_H_

#include <cstdint>

namespace fsdp::comm_internal {

// The `lo` interface's transmitted bytes so far, or -1 if /proc/net/dev has no `lo`.
int64_t loopback_tx_bytes();

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_LOOPBACK_H_
