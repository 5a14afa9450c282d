// Hardware counters through CUPTI PM sampling (placeholder until the backend lands).
#include "steptrace/backend.hpp"

namespace steptrace {

std::unique_ptr<CounterSampler> make_cupti_counter_sampler(int /*device_index*/,
                                                           std::string* why_not) {
  *why_not = "the CUPTI PM sampling backend is not built yet";
  return nullptr;
}

}  // namespace steptrace
