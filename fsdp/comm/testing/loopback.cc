#include "fsdp/comm/testing/loopback.h"

#include <fstream>
#include <sstream>
#include <string>

namespace fsdp::comm_internal {

int64_t loopback_tx_bytes() {
  std::ifstream dev("/proc/net/dev");
  std::string line;
  while (std::getline(dev, line)) {
    std::istringstream fields(line);
    std::string name;
    fields >> name;
    if (name != "lo:") continue;
    int64_t value = 0;
    for (int i = 0; i < 9; ++i) fields >> value;  // 8 receive fields, then tx bytes
    return value;
  }
  return -1;
}

}  // namespace fsdp::comm_internal
