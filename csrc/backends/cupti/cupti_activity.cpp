// Kernel activity through CUPTI (placeholder until the backend lands).
#include "steptrace/backend.hpp"

namespace steptrace {

std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not) {
  *why_not = "the CUPTI activity backend is not built yet";
  return nullptr;
}

}  // namespace steptrace
