// A kernel that keeps SMs busy for a while, for the tests that a persistent kernel finishes on
// the SMs left to it (its CTAs must not wait for CTAs that cannot become resident).
#pragma once

#include <stdint.h>

namespace mok::test {
namespace {  // one copy per test file that launches it

// Holds one SM per block (launched with enough dynamic shared memory that no persistent CTA
// fits beside it) for `hold_ns`, then exits.
__global__ void hold_sms_kernel(uint64_t hold_ns) {
  extern __shared__ unsigned char hog[];
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (threadIdx.x == 0) hog[now & 1023] = 1;
  } while (now - start < hold_ns);
}

}  // namespace
}  // namespace mok::test
