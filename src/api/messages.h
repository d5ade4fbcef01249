// Error texts used in more than one place, so the host checks and the device error word
// describe the same fault in the same words.
#pragma once

#include <cstdint>
#include <string>

namespace mok {

inline std::string bad_expert_id_message(int64_t rank, int64_t token, int64_t k, int64_t value,
                                         int64_t num_experts) {
  return "top_experts[rank " + std::to_string(rank) + ", token " + std::to_string(token) + ", k " +
         std::to_string(k) + "] = " + std::to_string(value) +
         " is out of range; valid expert ids are -1 (no route) and [0, " +
         std::to_string(num_experts) + ")";
}

}  // namespace mok
