// Turns a timed-out device wait's record into the words the host reports.
#pragma once

#include <string>

#include "kernels/common/wait_types.h"

namespace mok {

std::string describe_wait_diagnosis(const kernels::WaitDiagnosis& record);

}  // namespace mok
