// nvfp4lab's native GPTQ step (nvfp4lab/kernels/gptq_columns.py): the columns of one group of
// GPTQ's column loop (nvfp4lab/execution/gptq.py: _gptq_loop), one after the other, each rounded
// to NVFP4 at fixed block scales and its error spread over the group's later columns.
//
// Every step is the one IEEE operation the eager loop's torch calls make, in their order
// (compiled without fast-math and without FMA contraction, so `a - h * e` is a multiply, then a
// subtract):
//   x = f32(w)                       the column, float64 -> float32 (nearest even)
//   v = clamp(x * m, -6, 6)          the kernel order's element scaling (m = 1 / (s * (1/gs)))
//   code = E2M1 code of v            nearest, ties to even (e2m1.py's round-down limits)
//   q = E2M1(code) * f               decode at the block's float32 factor
//   e = (w - f64(q)) / d             float64, d = the inverse Cholesky factor's diagonal entry
//   w_r = w_r - u_r * e              each later column r of the group
// The group's columns are rows of the transposed weight (contiguous), so each step is a loop over
// the N output rows. One thread: a group is 16 x N elements.
#include "native.h"

namespace nvfp4lab_native {
namespace {

// nvfp4lab.e2m1.round_to_e2m1_codes of one float32 value, as it computes it: the number of the
// seven round-down limits (_ROUND_DOWN_LIMITS: the midpoints, or the float32 just below one
// whose tie goes up to the even code) that |v| exceeds, and the sign bit when v < 0; NaN
// exceeds none and gives code 0, as there.
inline int e2m1_code(float v) {
  const float magnitude = std::fabs(v);
  const int index = (magnitude > 0x1p-2f) + (magnitude > 0x1.7ffffep-1f) + (magnitude > 1.25f) +
                    (magnitude > 0x1.bffffep+0f) + (magnitude > 2.5f) +
                    (magnitude > 0x1.bffffep+1f) + (magnitude > 5.0f);
  return index | (v < 0.0f ? 8 : 0);
}

}  // namespace
}  // namespace nvfp4lab_native

using namespace nvfp4lab_native;

// The group's m columns, rows of `block` (float64 [m, n], contiguous, updated in place). u: the
// inverse Cholesky factor at the group's first column, element (i, r) at u[i * u_row + r * u_col].
// multipliers, factors: float32 rows of n per column, `factor_row` elements apart (0: one row for
// all). Writes q (float32 [m, n]), codes (uint8 [m, n]) and errors (float64 [m, n]).
extern "C" void nvfp4lab_gptq_columns(double* block, const double* u, int64_t u_row, int64_t u_col,
                                     int64_t m, int64_t n, const float* multipliers,
                                     const float* factors, int64_t factor_row, float* q,
                                     uint8_t* codes, double* errors) {
  for (int64_t i = 0; i < m; ++i) {
    const double diagonal = u[i * u_row + i * u_col];
    const double* w = block + i * n;
    const float* multiplier = multipliers + i * factor_row;
    const float* factor = factors + i * factor_row;
    float* qi = q + i * n;
    uint8_t* ci = codes + i * n;
    double* ei = errors + i * n;
    for (int64_t k = 0; k < n; ++k) {
      float v = static_cast<float>(w[k]) * multiplier[k];
      v = v < -6.0f ? -6.0f : (v > 6.0f ? 6.0f : v);  // NaN stays NaN, as torch's clamp
      const int code = e2m1_code(v);
      const float value = kE2M1[code] * factor[k];
      qi[k] = value;
      ci[k] = static_cast<uint8_t>(code);
      ei[k] = (w[k] - static_cast<double>(value)) / diagonal;
    }
    for (int64_t r = i + 1; r < m; ++r) {
      const double h = u[i * u_row + r * u_col];
      double* later = block + r * n;
      for (int64_t k = 0; k < n; ++k) later[k] -= h * ei[k];
    }
  }
}
