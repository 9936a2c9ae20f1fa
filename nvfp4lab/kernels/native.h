// nvfp4lab's native CPU library: what its kernels share (lut_decode.cpp, block_encode.cpp,
// gptq_columns.cpp, ggml_dot.cpp).
// Built by nvfp4lab/kernels/native.py (torch.utils.cpp_extension, no torch headers, plain C ABI).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>

namespace nvfp4lab_native {

// Vector paths, numbered as the Python side's ISAS: the best the CPU has is picked at run time.
constexpr int kScalar = 0;
constexpr int kAvx2 = 1;
constexpr int kAvx512 = 2;

// Element dtypes, numbered as the Python side's _DTYPES.
constexpr int kFloat32 = 0;
constexpr int kBFloat16 = 1;
constexpr int kFloat16 = 2;

// E2M1 values by code: index 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign (code 8: -0.0).
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline __attribute__((always_inline)) uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline __attribute__((always_inline)) float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The vector path a call asked for (isa), capped at the best this CPU has for the kernel (have)
// and never below the scalar loop.
inline int clamp_isa(int isa, int have) {
  if (isa > have) isa = have;
  return isa < kScalar ? kScalar : isa;
}

// The caller's MXCSR (flush-to-zero, denormals-are-zero, rounding: torch.set_flush_denormal sets
// them on the calling thread only) for the length of one OpenMP worker's share, so that every
// thread computes as the caller's thread and a result does not depend on the thread count.
// Construct it first thing in a parallel region with the caller's _mm_getcsr().
class CallerFloatMode {
 public:
  explicit CallerFloatMode(unsigned caller) : own_(_mm_getcsr()) { _mm_setcsr(caller); }
  ~CallerFloatMode() { _mm_setcsr(own_); }
  CallerFloatMode(const CallerFloatMode&) = delete;
  CallerFloatMode& operator=(const CallerFloatMode&) = delete;

 private:
  unsigned own_;
};

}  // namespace nvfp4lab_native
