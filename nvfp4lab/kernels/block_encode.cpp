// nvfp4lab: the NVFP4 quantize (and quantize-dequantize) on the CPU, in every arithmetic order
// whose steps the flags below describe (kernel, compressed-tensors, modelopt, llama.cpp).
//
// Built with lut_decode.cpp into one library by nvfp4lab/kernels/native.py (plain C ABI, no torch
// headers, called through ctypes). Two passes over x (float32, bfloat16 or float16 bits, [NB, 16]
// contiguous):
//
//   nvfp4lab_abs_max   max |x| over all elements, as the bits of x's dtype (integer max of the
//                      magnitude bits: exact, and a NaN anywhere gives a NaN's bits)
//   nvfp4lab_encode    per block b: packed codes [NB, 8] (element 2i in the low nibble of byte i)
//                      and E4M3 scale bytes [NB]; or (fake) the decoded values in x's dtype [NB, 16]
//
// The arithmetic is the eager pipeline's (nvfp4lab.scales, nvfp4lab.e2m1, nvfp4lab.blocks), one
// IEEE float32 operation per step (built without fast-math and without FMA contraction), with t
// the tensor scale in the order's form (ENCODE gs, or DECODE d) and rgs = f32(1 / gs). Each step's
// variants are the flag constants below; for the kernel and compressed-tensors orders:
//
//   statistic   amax_b, or f32(amax_b / 6) rounded to x's dtype       (kDivideInInputDtype)
//   pre         gs * stat  (divided)  or  gs * (amax_b * f32(1/6)),  then min(pre, 448)
//   scale s     E4M3 nearest-even: the float32 bits rounded to 3 mantissa bits in the normal range,
//               rint(p * 512) / 512 below 2**-6; a scale of 0 becomes 0.125 (kZeroToEighth)
//   factor      1 / (s * rgs), 0 where s == 0  (kMultiplyByInverse: v = x * factor)
//               s / gs                          (otherwise:          v = x / factor)
//   code        a = min(|v|, 6); g2 = a >= 2, g4 = a >= 4; q = rint(a * (2 - g2 - g4/2));
//               index = q + 2 (g2 + g4), sign bit where v < 0
//   fake        (v < 0 ? -m : m) * (s / gs), m = q * (1/2 + g2/2 + g4), rounded to x's dtype
//
// Blocks go in tiles of 16: the per-block scale chain runs across a tile's blocks, then each
// block's 16 elements. Those two orders run their own AVX-512 intrinsics (encode_range_avx512,
// one block per vector); every order (modelopt's and llama.cpp's steps included: the block rules,
// the 2**-9 clamp, ggml's UE4M3 rounding, its first-nearest E2M1 code, the decode rules) runs
// encode_range_vec, the portable body encode_range step for step on AVX-512 or AVX2 vectors;
// CPUs without AVX2 run encode_range itself. The path is chosen at run time from the CPU's flags.

#include "native.h"

using namespace nvfp4lab_native;

namespace {

// The order's steps as bits (nvfp4lab/kernels/block_encode.py: order_flags). Block rule, bits 0-1:
constexpr int kBlockRuleMask = 3;
constexpr int kEncodeTimesAmaxTimesInverse = 0;  // gs * (amax_b * f32(1/6))
constexpr int kDivideInInputDtype = 1;           // gs * f32(amax_b / 6 rounded to x's dtype)
constexpr int kAmaxOverTargetTimesDecode = 2;    // amax_b / f32(6 * d)
constexpr int kPrescaledAmaxOverTarget = 3;      // f32(f32(gs * amax_b) / 6)
// Element rule, bits 2-3:
constexpr int kElementShift = 2;
constexpr int kMultiplyByInverse = 0;      // x * (1 / (s * (1/gs))), 0 where s == 0
constexpr int kDivideByScaleOverEncode = 1;  // x / (s / gs)
constexpr int kDivideByScaleTimesDecode = 2;  // x / f32(s * d)
constexpr int kPrescaleOnly = 3;           // f32(x * gs), the table scaled by s instead
// Single steps:
constexpr int kHalfUpUE4M3 = 1 << 4;        // E4M3 rounding: ggml's ggml_fp32_to_ue4m3
constexpr int kFirstNearestScaled = 1 << 5;  // E2M1 ties: first nearest of E2M1(i) * s
constexpr int kDecodeTimes = 1 << 6;        // decode value * f32(s * d) (else s / gs)
constexpr int kZeroBlockOne = 1 << 7;       // a block rule giving 0 gives 1 before rounding
constexpr int kMinSubnormal = 1 << 8;       // block scales clamped to at least 2**-9
constexpr int kZeroToEighth = 1 << 9;       // an E4M3 scale of 0 becomes 0.125
// What encode_range_avx512 implements (the graphs' orders); other flags run encode_range_vec.
constexpr int kIntrinsicFlags = 1 | (1 << kElementShift) | kZeroToEighth;

constexpr int kTile = 16;  // blocks per tile
// Below this many blocks (64 K elements) one thread works (as the LUT decode).
constexpr int64_t kParallelBlocks = 4096;

// Element i of x as float32 (exact for every dtype).
template <int DT>
inline __attribute__((always_inline)) float load(const void* x, int64_t i) {
  if constexpr (DT == kFloat32) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (DT == kBFloat16) {
    return float_of(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  } else {
    return static_cast<float>(static_cast<const _Float16*>(x)[i]);
  }
}

// |x_i| as the float32 bits of its magnitude (integer order == float order for finite values).
template <int DT>
inline __attribute__((always_inline)) uint32_t magnitude_bits(const void* x, int64_t i) {
  return bits_of(load<DT>(x, i)) & 0x7FFFFFFFu;
}

// float32 -> float32 rounded to x's dtype, nearest even (finite or infinite inputs: no NaN here).
template <int DT>
inline __attribute__((always_inline)) float round_to(float f) {
  if constexpr (DT == kFloat32) {
    return f;
  } else if constexpr (DT == kBFloat16) {
    const uint32_t u = bits_of(f);
    return float_of(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
  } else {
    return static_cast<float>(static_cast<_Float16>(f));
  }
}

template <int DT>
inline __attribute__((always_inline)) void store(void* out, int64_t i, float f) {
  if constexpr (DT == kFloat32) {
    static_cast<float*>(out)[i] = f;
  } else if constexpr (DT == kBFloat16) {
    const uint32_t u = bits_of(f);
    static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  } else {
    static_cast<_Float16*>(out)[i] = static_cast<_Float16>(f);
  }
}

// The midpoints of consecutive E2M1 magnitudes.
constexpr float kMidpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

// E4M3 nearest-even of p in [0, 448] (or NaN): the byte (the float8 cast's), value in *value.
inline __attribute__((always_inline)) int32_t e4m3_nearest_even(float p, float* value) {
  const uint32_t pb = bits_of(p);
  const uint32_t rounded = (pb + 0x7FFFFu + ((pb >> 20) & 1u)) & 0xFFF00000u;
  const int32_t normal_byte = ((static_cast<int32_t>(rounded >> 23) - 120) << 3) |
                              static_cast<int32_t>((rounded >> 20) & 7u);
  const float q = rintf(p * 512.0f);
  const bool subnormal = p < 0.015625f;
  *value = subnormal ? q * (1.0f / 512.0f) : float_of(rounded);
  return subnormal ? static_cast<int32_t>(q) : normal_byte;
}

// ggml's ggml_fp32_to_ue4m3 of p (clamped to 448 first): the byte, value in *value. 0 for p <= 0
// or NaN; below 2**-6 (int)(p * 512 + 0.5) capped at 7; else the mantissa's top 3 bits plus the
// 4th (half up, a carry raising the exponent), an exponent field of 15 giving 0x7E (448).
inline __attribute__((always_inline)) int32_t ue4m3_half_up(float p, float* value) {
  const float x = p > 448.0f ? 448.0f : p;
  const uint32_t xb = bits_of(x);
  const int32_t field = static_cast<int32_t>((xb >> 23) & 0xFFu) - 120;
  int32_t mantissa = static_cast<int32_t>(((xb >> 20) & 7u) + ((xb >> 19) & 1u));
  const int32_t exponent = field + (mantissa > 7 ? 1 : 0);
  mantissa = mantissa > 7 ? 0 : mantissa;
  int32_t code = exponent >= 15 ? 0x7E : ((exponent << 3) | mantissa);
  if (field <= 0) {
    const int32_t sub = static_cast<int32_t>(x * 512.0f + 0.5f);
    code = sub > 7 ? 7 : sub;
  }
  code = x > 0.0f ? code : 0;  // also NaN
  *value = code < 8 ? static_cast<float>(code) * (1.0f / 512.0f)
                    : float_of(static_cast<uint32_t>((code >> 3) + 120) << 23 |
                               static_cast<uint32_t>(code & 7) << 20);
  return code;
}

// llama.cpp's code of v (the block's domain) at scale s: the first i in 0..15 minimizing float32
// |E2M1(i) * s - v|. Where |v| <= 6 s the count of midpoints below |v| (exact, see
// nvfp4lab.blocks._nearest_scaled_table); beyond, ggml's loop over the 8 magnitudes (strict <).
inline __attribute__((always_inline)) int32_t first_nearest_scaled(float v, float s) {
  const float a = std::fabs(v);
  int32_t index = 0;
  if (a > 6.0f * s) {
    float best = a;
    for (int j = 1; j < 8; ++j) {
      const float error = std::fabs(s * kE2M1[j] - a);
      if (error < best) {
        index = j;
        best = error;
      }
    }
  } else {
    for (int j = 0; j < 7; ++j) index += a > s * kMidpoints[j] ? 1 : 0;
  }
  return (v < 0.0f && index > 0) ? (index | 8) : index;  // NaN: index 0
}

// Blocks [b0, b1): codes and scale bytes, or (FAKE) the quantize-dequantize values, in any order
// the flags describe; gs is the tensor scale in the order's form (d for kDecodeTimes orders).
template <int DT, bool FAKE>
inline __attribute__((always_inline)) void encode_range(const void* x, int64_t b0, int64_t b1,
                                                        float gs, float rgs, int flags,
                                                        uint8_t* packed, uint8_t* scale_bytes,
                                                        void* out) {
  const int block_rule = flags & kBlockRuleMask;
  const int element_rule = (flags >> kElementShift) & 3;
  const bool half_up = flags & kHalfUpUE4M3;
  const bool first_nearest = flags & kFirstNearestScaled;
  const bool decode_times = flags & kDecodeTimes;
  const bool zero_block_one = flags & kZeroBlockOne;
  const float low = (flags & kMinSubnormal) ? 1.0f / 512.0f : -448.0f;
  const bool replace_zero = flags & kZeroToEighth;
  const float inv6 = static_cast<float>(1.0 / 6.0);
  const float six_d = 6.0f * gs;
  alignas(64) float amax[kTile];
  alignas(64) float scale[kTile];
  alignas(64) float factor[kTile];
  alignas(64) float decode[kTile];
  alignas(64) uint8_t byte[kTile];
  alignas(64) uint8_t codes[16];
  for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
    const int n = static_cast<int>(b1 - t0 < kTile ? b1 - t0 : kTile);
    // 1. block amax (integer max of magnitude bits)
    for (int j = 0; j < n; ++j) {
      const int64_t base = 16 * (t0 + j);
      uint32_t m = 0;
      for (int i = 0; i < 16; ++i) {
        const uint32_t a = magnitude_bits<DT>(x, base + i);
        m = a > m ? a : m;
      }
      amax[j] = float_of(m);
    }
    // 2. the scale chain, across the tile's blocks
    for (int j = 0; j < n; ++j) {
      float pre;
      if (block_rule == kEncodeTimesAmaxTimesInverse) {
        pre = gs * (amax[j] * inv6);
      } else if (block_rule == kDivideInInputDtype) {
        pre = gs * round_to<DT>(amax[j] / 6.0f);
      } else if (block_rule == kAmaxOverTargetTimesDecode) {
        pre = amax[j] / six_d;
      } else {
        pre = (gs * amax[j]) / 6.0f;
      }
      if (zero_block_one) pre = pre == 0.0f ? 1.0f : pre;
      pre = pre < low ? low : pre;  // NaN passes, as torch.clamp
      pre = pre > 448.0f ? 448.0f : pre;
      float s;
      int32_t b = half_up ? ue4m3_half_up(pre, &s) : e4m3_nearest_even(pre, &s);
      if (replace_zero) {
        const bool zero = s == 0.0f;
        s = zero ? 0.125f : s;
        b = zero ? 0x20 : b;
      }
      byte[j] = static_cast<uint8_t>(b);
      scale[j] = s;
      if (element_rule == kMultiplyByInverse) {
        const float inverse = 1.0f / (s * rgs);
        factor[j] = s == 0.0f ? 0.0f : inverse;
      } else if (element_rule == kDivideByScaleOverEncode) {
        factor[j] = s / gs;
      } else if (element_rule == kDivideByScaleTimesDecode) {
        factor[j] = s * gs;
      } else {
        factor[j] = gs;
      }
      decode[j] = decode_times ? s * gs : s / gs;
    }
    // 3. the elements, block by block
    for (int j = 0; j < n; ++j) {
      const int64_t base = 16 * (t0 + j);
      const float f = factor[j];
      const float d = decode[j];
      const float s = scale[j];
      for (int i = 0; i < 16; ++i) {
        const float xv = load<DT>(x, base + i);
        int32_t code;
        if (first_nearest) {
          code = first_nearest_scaled(xv * f, s);
        } else {
          const float v = element_rule == kMultiplyByInverse ? xv * f : xv / f;
          float a = std::fabs(v);
          a = a > 6.0f ? 6.0f : a;
          const float g2 = a >= 2.0f ? 1.0f : 0.0f;
          const float g4 = a >= 4.0f ? 1.0f : 0.0f;
          const float q = rintf(a * (2.0f - g2 - 0.5f * g4));
          code = static_cast<int32_t>(q + 2.0f * (g2 + g4)) | (v < 0.0f ? 8 : 0);
        }
        if constexpr (FAKE) {
          store<DT>(out, base + i, kE2M1[code & 15] * d);  // & 15: a NaN's code (INT_MIN | 8)
        } else {
          codes[i] = static_cast<uint8_t>(code);
        }
      }
      if constexpr (!FAKE) {
        uint8_t* p = packed + 8 * (t0 + j);
        for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
      }
    }
    if constexpr (!FAKE) std::memcpy(scale_bytes + t0, byte, static_cast<size_t>(n));
  }
}

template <int DT>
inline __attribute__((always_inline)) uint32_t abs_max_range(const void* x, int64_t i0,
                                                             int64_t i1) {
  uint32_t m = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t a = magnitude_bits<DT>(x, i);
    m = a > m ? a : m;
  }
  return m;
}

template <int DT>
inline __attribute__((always_inline)) void encode_dtype(const void* x, int64_t b0, int64_t b1,
                                                        bool fake, float gs, float rgs, int flags,
                                                        uint8_t* packed, uint8_t* scales,
                                                        void* out) {
  if (fake) return encode_range<DT, true>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  return encode_range<DT, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
}

// The portable encode, for CPUs without AVX2 (the vector paths below run it step for step).
void encode_scalar(const void* x, int64_t b0, int64_t b1, int dtype, bool fake, float gs,
                   float rgs, int flags, uint8_t* packed, uint8_t* scales, void* out) {
  if (dtype == kFloat32) return encode_dtype<kFloat32>(x, b0, b1, fake, gs, rgs, flags, packed, scales, out);
  if (dtype == kBFloat16) return encode_dtype<kBFloat16>(x, b0, b1, fake, gs, rgs, flags, packed, scales, out);
  return encode_dtype<kFloat16>(x, b0, b1, fake, gs, rgs, flags, packed, scales, out);
}

// The first pass, one body per instruction set (the always-inline template takes its target).
#define NVFP4LAB_ABS_MAX(SUFFIX, TARGET)                                                          \
  TARGET uint32_t abs_max_##SUFFIX(const void* x, int64_t i0, int64_t i1, int dtype) {            \
    if (dtype == kFloat32) return abs_max_range<kFloat32>(x, i0, i1);                            \
    if (dtype == kBFloat16) return abs_max_range<kBFloat16>(x, i0, i1);                          \
    return abs_max_range<kFloat16>(x, i0, i1);                                                    \
  }

NVFP4LAB_ABS_MAX(avx512_generic, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))))
NVFP4LAB_ABS_MAX(avx2, __attribute__((target("avx2,f16c"))))
NVFP4LAB_ABS_MAX(scalar, )

// ------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL): the same arithmetic written with intrinsics (the generic body above
// auto-vectorizes poorly: a block's 16 elements are one vector here, the tile's scale chain another)
// ------------------------------------------------------------------------------------------

#define NVFP4LAB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))

template <int DT>
NVFP4LAB_AVX512 inline __m512 load16(const void* x, int64_t i) {
  if constexpr (DT == kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(x) + i));
    if constexpr (DT == kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// bfloat16 bits (in the low half of each lane) of float32 v, nearest even (no NaN reaches here).
NVFP4LAB_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

template <int DT>
NVFP4LAB_AVX512 inline __m512 round_to16(__m512 v) {
  if constexpr (DT == kFloat32) {
    return v;
  } else if constexpr (DT == kBFloat16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <int DT>
NVFP4LAB_AVX512 inline void store16(void* out, int64_t i, __m512 v) {
  if constexpr (DT == kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, v);
  } else {
    __m256i h;
    if constexpr (DT == kBFloat16) {
      h = _mm512_cvtepi32_epi16(bf16_bits(v));
    } else {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

template <int DT, bool FAKE>
NVFP4LAB_AVX512 void encode_range_avx512(const void* x, int64_t b0, int64_t b1, float gs,
                                         float rgs, int flags, uint8_t* packed,
                                         uint8_t* scale_bytes, void* out) {
  const bool divided = (flags & kBlockRuleMask) == kDivideInInputDtype;
  const bool multiplies = ((flags >> kElementShift) & 3) == kMultiplyByInverse;
  const bool replace_zero = flags & kZeroToEighth;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 six = _mm512_set1_ps(6.0f);
  const __m512 two = _mm512_set1_ps(2.0f);
  const __m512 four = _mm512_set1_ps(4.0f);
  const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i odd_shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512 vgs = _mm512_set1_ps(gs);
  const __m512 vrgs = _mm512_set1_ps(rgs);
  alignas(64) float amax[kTile];
  alignas(64) float factor[kTile];
  alignas(64) float decode[kTile];
  for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
    const int n = static_cast<int>(b1 - t0 < kTile ? b1 - t0 : kTile);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    // 1. block amax: the integer max of the magnitude bits
    for (int j = 0; j < n; ++j) {
      const __m512i a = _mm512_and_si512(_mm512_castps_si512(load16<DT>(x, 16 * (t0 + j))),
                                         magnitude_mask);
      amax[j] = float_of(_mm512_reduce_max_epu32(a));
    }
    // 2. the scale chain across the tile's blocks (lanes past n hold zeros)
    const __m512 am = _mm512_maskz_load_ps(live, amax);
    __m512 pre;
    if (divided) {
      pre = _mm512_mul_ps(vgs, round_to16<DT>(_mm512_div_ps(am, six)));
    } else {
      pre = _mm512_mul_ps(vgs, _mm512_mul_ps(am, _mm512_set1_ps(static_cast<float>(1.0 / 6.0))));
    }
    pre = _mm512_min_ps(_mm512_set1_ps(448.0f), pre);  // (448 < pre) ? 448 : pre
    const __m512i pb = _mm512_castps_si512(pre);
    const __m512i rounded = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(pb, _mm512_set1_epi32(0x7FFFF)),
                         _mm512_and_si512(_mm512_srli_epi32(pb, 20), _mm512_set1_epi32(1))),
        _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
    const __m512i normal_byte = _mm512_or_si512(
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(rounded, 23), _mm512_set1_epi32(120)), 3),
        _mm512_and_si512(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(7)));
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(pre, _mm512_set1_ps(512.0f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 subnormal = _mm512_cmp_ps_mask(pre, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    __m512 s = _mm512_mask_blend_ps(subnormal, _mm512_castsi512_ps(rounded),
                                    _mm512_mul_ps(q, _mm512_set1_ps(1.0f / 512.0f)));
    __m512i byte = _mm512_mask_blend_epi32(subnormal, normal_byte, _mm512_cvttps_epi32(q));
    const __mmask16 s_zero = _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ);
    if (replace_zero) {
      s = _mm512_mask_blend_ps(s_zero, s, _mm512_set1_ps(0.125f));
      byte = _mm512_mask_blend_epi32(s_zero, byte, _mm512_set1_epi32(0x20));
    }
    __m512 f, d;
    if (multiplies) {
      const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(s, vrgs));
      f = replace_zero ? inverse : _mm512_mask_blend_ps(s_zero, inverse, zero);
      d = _mm512_div_ps(s, vgs);
    } else {
      f = _mm512_div_ps(s, vgs);
      d = f;
    }
    _mm512_store_ps(factor, f);
    _mm512_store_ps(decode, d);
    if constexpr (!FAKE) {
      _mm_mask_storeu_epi8(scale_bytes + t0, live, _mm512_cvtepi32_epi8(byte));
    }
    // 3. the elements, one block per vector
    for (int j = 0; j < n; ++j) {
      const int64_t base = 16 * (t0 + j);
      const __m512 xv = load16<DT>(x, base);
      const __m512 v = multiplies ? _mm512_mul_ps(xv, _mm512_set1_ps(factor[j]))
                                  : _mm512_div_ps(xv, _mm512_set1_ps(factor[j]));
      const __mmask16 negative = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
      const __m512 a = _mm512_min_ps(
          six, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude_mask)));
      const __mmask16 g2 = _mm512_cmp_ps_mask(a, two, _CMP_GE_OQ);
      const __mmask16 g4 = _mm512_cmp_ps_mask(a, four, _CMP_GE_OQ);
      // a * (2 - g2 - g4/2): 2 below 2, 1 on [2, 4), 1/2 from 4 on (an exact power of two)
      const __m512 m = _mm512_mask_blend_ps(g4, _mm512_mask_blend_ps(g2, two, _mm512_set1_ps(1.0f)),
                                            _mm512_set1_ps(0.5f));
      const __m512 qe = _mm512_roundscale_ps(_mm512_mul_ps(a, m),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if constexpr (FAKE) {
        const __m512 step = _mm512_mask_blend_ps(
            g4, _mm512_mask_blend_ps(g2, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)), two);
        const __m512i mag = _mm512_castps_si512(_mm512_mul_ps(qe, step));
        const __m512 signed_value = _mm512_castsi512_ps(_mm512_mask_xor_epi32(mag, negative, mag, sign_bit));
        store16<DT>(out, base, _mm512_mul_ps(signed_value, _mm512_set1_ps(decode[j])));
      } else {
        __m512i index = _mm512_cvttps_epi32(qe);
        const __m512i two_i = _mm512_set1_epi32(2);
        index = _mm512_mask_add_epi32(index, g2, index, two_i);
        index = _mm512_mask_add_epi32(index, g4, index, two_i);
        index = _mm512_mask_or_epi32(index, negative, index, _mm512_set1_epi32(8));
        // odd elements up by 4 bits, then each 64-bit lane's high dword folded onto its low one
        const __m512i shifted = _mm512_sllv_epi32(index, odd_shift);
        const __m512i pairs = _mm512_or_si512(shifted, _mm512_srli_epi64(shifted, 32));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(packed + 8 * (t0 + j)),
                         _mm512_cvtepi64_epi8(pairs));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Every order, vectorized: encode_range_vec is encode_range (the portable body above) step for
// step on L-lane vectors, for AVX-512 (L = 16, a block per vector) and AVX2 (L = 8, a block in
// two). The lane operations each path needs are the members of Avx512 / Avx2 below; every one
// is a single IEEE float32 operation (or an integer one), as in encode_range.
// ------------------------------------------------------------------------------------------

#define NVFP4LAB_AVX2 __attribute__((target("avx2,f16c")))

// AVX-512 (F, BW, VL) lanes: 16 floats, masks as __mmask16.
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int kLanes = 16;
  NVFP4LAB_AVX512 static F set(float v) { return _mm512_set1_ps(v); }
  NVFP4LAB_AVX512 static I seti(int32_t v) { return _mm512_set1_epi32(v); }
  NVFP4LAB_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  NVFP4LAB_AVX512 static void put(float* p, F v) { _mm512_storeu_ps(p, v); }
  NVFP4LAB_AVX512 static void puti(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  template <int DT>
  NVFP4LAB_AVX512 static F load_x(const void* x, int64_t i) { return load16<DT>(x, i); }
  template <int DT>
  NVFP4LAB_AVX512 static void store_x(void* out, int64_t i, F v) { store16<DT>(out, i, v); }
  template <int DT>
  NVFP4LAB_AVX512 static F round_to(F v) { return round_to16<DT>(v); }
  NVFP4LAB_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  NVFP4LAB_AVX512 static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  NVFP4LAB_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  NVFP4LAB_AVX512 static F div(F a, F b) { return _mm512_div_ps(a, b); }
  // a < b ? a : b and a > b ? a : b (the second operand where either is NaN), as minps / maxps
  NVFP4LAB_AVX512 static F min(F a, F b) { return _mm512_min_ps(a, b); }
  NVFP4LAB_AVX512 static F max(F a, F b) { return _mm512_max_ps(a, b); }
  NVFP4LAB_AVX512 static F abs(F a) { return as_f(andi(as_i(a), seti(0x7FFFFFFF))); }
  NVFP4LAB_AVX512 static F rint(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  NVFP4LAB_AVX512 static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  NVFP4LAB_AVX512 static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  NVFP4LAB_AVX512 static M ge(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  NVFP4LAB_AVX512 static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  NVFP4LAB_AVX512 static M gti(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  NVFP4LAB_AVX512 static M both(M a, M b) { return a & b; }
  NVFP4LAB_AVX512 static M but_not(M a, M b) { return a & static_cast<M>(~b); }
  NVFP4LAB_AVX512 static bool any(M m) { return m != 0; }
  // m ? t : f, lane by lane
  NVFP4LAB_AVX512 static F pick(M m, F f, F t) { return _mm512_mask_blend_ps(m, f, t); }
  NVFP4LAB_AVX512 static I picki(M m, I f, I t) { return _mm512_mask_blend_epi32(m, f, t); }
  NVFP4LAB_AVX512 static I add_where(M m, I a, I k) { return _mm512_mask_add_epi32(a, m, a, k); }
  NVFP4LAB_AVX512 static I or_where(M m, I a, I k) { return _mm512_mask_or_epi32(a, m, a, k); }
  NVFP4LAB_AVX512 static I as_i(F a) { return _mm512_castps_si512(a); }
  NVFP4LAB_AVX512 static F as_f(I a) { return _mm512_castsi512_ps(a); }
  NVFP4LAB_AVX512 static I trunc(F a) { return _mm512_cvttps_epi32(a); }  // NaN, huge: INT_MIN
  NVFP4LAB_AVX512 static F to_f(I a) { return _mm512_cvtepi32_ps(a); }
  NVFP4LAB_AVX512 static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  NVFP4LAB_AVX512 static I ori(I a, I b) { return _mm512_or_si512(a, b); }
  NVFP4LAB_AVX512 static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  NVFP4LAB_AVX512 static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  NVFP4LAB_AVX512 static I mini(I a, I b) { return _mm512_min_epi32(a, b); }
  template <int K>
  NVFP4LAB_AVX512 static I srl(I a) { return _mm512_srli_epi32(a, K); }
  template <int K>
  NVFP4LAB_AVX512 static I sll(I a) { return _mm512_slli_epi32(a, K); }
  // kE2M1[code & 15] in each lane
  NVFP4LAB_AVX512 static F e2m1(I code) {
    return _mm512_permutexvar_ps(code, _mm512_loadu_ps(kE2M1));
  }
  // max of the float32 magnitude bits of block elements [i, i + 16)
  template <int DT>
  NVFP4LAB_AVX512 static uint32_t block_max_bits(const void* x, int64_t i) {
    return _mm512_reduce_max_epu32(andi(as_i(load_x<DT>(x, i)), seti(0x7FFFFFFF)));
  }
  // the 16 codes of a block (code[0], the block's only vector) as 8 bytes, element 2i low
  NVFP4LAB_AVX512 static void pack(const I* code, uint8_t* dst) {
    const I shifted = _mm512_sllv_epi32(code[0], _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0,
                                                                   4, 0, 4, 0, 4, 0));
    const I pairs = _mm512_or_si512(shifted, _mm512_srli_epi64(shifted, 32));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi64_epi8(pairs));
  }
};

// AVX2 (with F16C) lanes: 8 floats, masks as all-ones lanes.
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  using M = __m256i;
  static constexpr int kLanes = 8;
  NVFP4LAB_AVX2 static F set(float v) { return _mm256_set1_ps(v); }
  NVFP4LAB_AVX2 static I seti(int32_t v) { return _mm256_set1_epi32(v); }
  NVFP4LAB_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  NVFP4LAB_AVX2 static void put(float* p, F v) { _mm256_storeu_ps(p, v); }
  NVFP4LAB_AVX2 static void puti(int32_t* p, I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  template <int DT>
  NVFP4LAB_AVX2 static F load_x(const void* x, int64_t i) {
    if constexpr (DT == kFloat32) {
      return _mm256_loadu_ps(static_cast<const float*>(x) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const uint16_t*>(x) + i));
      if constexpr (DT == kBFloat16) {
        return as_f(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }
  // bfloat16 bits (low half of each lane) of v, nearest even (as store<kBFloat16>)
  NVFP4LAB_AVX2 static I bf16_bits(F v) {
    const I u = as_i(v);
    const I odd = andi(srl<16>(u), seti(1));
    return srl<16>(addi(addi(u, seti(0x7FFF)), odd));
  }
  template <int DT>
  NVFP4LAB_AVX2 static void store_x(void* out, int64_t i, F v) {
    if constexpr (DT == kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(out) + i, v);
    } else {
      __m128i h;
      if constexpr (DT == kBFloat16) {
        const I b = bf16_bits(v);
        h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
      } else {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
    }
  }
  template <int DT>
  NVFP4LAB_AVX2 static F round_to(F v) {
    if constexpr (DT == kFloat32) {
      return v;
    } else if constexpr (DT == kBFloat16) {
      return as_f(sll<16>(bf16_bits(v)));
    } else {
      return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  NVFP4LAB_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  NVFP4LAB_AVX2 static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  NVFP4LAB_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  NVFP4LAB_AVX2 static F div(F a, F b) { return _mm256_div_ps(a, b); }
  NVFP4LAB_AVX2 static F min(F a, F b) { return _mm256_min_ps(a, b); }
  NVFP4LAB_AVX2 static F max(F a, F b) { return _mm256_max_ps(a, b); }
  NVFP4LAB_AVX2 static F abs(F a) { return as_f(andi(as_i(a), seti(0x7FFFFFFF))); }
  NVFP4LAB_AVX2 static F rint(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  NVFP4LAB_AVX2 static M lt(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  NVFP4LAB_AVX2 static M gt(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  NVFP4LAB_AVX2 static M ge(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
  NVFP4LAB_AVX2 static M eq(F a, F b) { return as_i(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  NVFP4LAB_AVX2 static M gti(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  NVFP4LAB_AVX2 static M both(M a, M b) { return _mm256_and_si256(a, b); }
  NVFP4LAB_AVX2 static M but_not(M a, M b) { return _mm256_andnot_si256(b, a); }
  NVFP4LAB_AVX2 static bool any(M m) { return !_mm256_testz_si256(m, m); }
  NVFP4LAB_AVX2 static F pick(M m, F f, F t) { return _mm256_blendv_ps(f, t, as_f(m)); }
  NVFP4LAB_AVX2 static I picki(M m, I f, I t) { return _mm256_blendv_epi8(f, t, m); }
  NVFP4LAB_AVX2 static I add_where(M m, I a, I k) { return addi(a, andi(m, k)); }
  NVFP4LAB_AVX2 static I or_where(M m, I a, I k) { return ori(a, andi(m, k)); }
  NVFP4LAB_AVX2 static I as_i(F a) { return _mm256_castps_si256(a); }
  NVFP4LAB_AVX2 static F as_f(I a) { return _mm256_castsi256_ps(a); }
  NVFP4LAB_AVX2 static I trunc(F a) { return _mm256_cvttps_epi32(a); }
  NVFP4LAB_AVX2 static F to_f(I a) { return _mm256_cvtepi32_ps(a); }
  NVFP4LAB_AVX2 static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  NVFP4LAB_AVX2 static I ori(I a, I b) { return _mm256_or_si256(a, b); }
  NVFP4LAB_AVX2 static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  NVFP4LAB_AVX2 static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  NVFP4LAB_AVX2 static I mini(I a, I b) { return _mm256_min_epi32(a, b); }
  template <int K>
  NVFP4LAB_AVX2 static I srl(I a) { return _mm256_srli_epi32(a, K); }
  template <int K>
  NVFP4LAB_AVX2 static I sll(I a) { return _mm256_slli_epi32(a, K); }
  // kE2M1[code & 15]: the magnitude of code & 7, the sign bit where code & 8
  NVFP4LAB_AVX2 static F e2m1(I code) {
    const F magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), code);
    return as_f(ori(as_i(magnitude), sll<28>(andi(code, seti(8)))));
  }
  template <int DT>
  NVFP4LAB_AVX2 static uint32_t block_max_bits(const void* x, int64_t i) {
    const I mask = seti(0x7FFFFFFF);
    I m = _mm256_max_epu32(andi(as_i(load_x<DT>(x, i)), mask),
                           andi(as_i(load_x<DT>(x, i + 8)), mask));
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  }
  // the 16 codes of a block (code[0] elements 0-7, code[1] 8-15) as 8 bytes, element 2i low
  NVFP4LAB_AVX2 static void pack(const I* code, uint8_t* dst) {
    const I pairs0 = ori(code[0], _mm256_srli_epi64(code[0], 28));  // byte 0 of each qword
    const I pairs1 = ori(code[1], _mm256_srli_epi64(code[1], 28));
    // byte 0 of each 64-bit lane, then the two 128-bit halves' 2 bytes each
    const I pick_bytes = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    const I b0 = _mm256_shuffle_epi8(pairs0, pick_bytes);
    const I b1 = _mm256_shuffle_epi8(pairs1, pick_bytes);
    const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b0))) & 0xFFFFu;
    const uint32_t lo2 = static_cast<uint32_t>(_mm256_extract_epi32(b0, 4)) & 0xFFFFu;
    const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b1))) & 0xFFFFu;
    const uint32_t hi2 = static_cast<uint32_t>(_mm256_extract_epi32(b1, 4)) & 0xFFFFu;
    const uint64_t word = static_cast<uint64_t>(lo | (lo2 << 16)) |
                          (static_cast<uint64_t>(hi | (hi2 << 16)) << 32);
    std::memcpy(dst, &word, sizeof word);
  }
};

// e4m3_nearest_even on lanes: the byte in *byte, the value returned.
template <class V>
inline __attribute__((always_inline)) typename V::F e4m3_nearest_even_v(typename V::F p,
                                                                       typename V::I* byte) {
  using I = typename V::I;
  const I pb = V::as_i(p);
  const I rounded = V::andi(V::addi(V::addi(pb, V::seti(0x7FFFF)),
                                    V::andi(V::template srl<20>(pb), V::seti(1))),
                            V::seti(static_cast<int32_t>(0xFFF00000u)));
  const I normal_byte = V::ori(V::template sll<3>(V::subi(V::template srl<23>(rounded), V::seti(120))),
                               V::andi(V::template srl<20>(rounded), V::seti(7)));
  const typename V::F q = V::rint(V::mul(p, V::set(512.0f)));
  const typename V::M subnormal = V::lt(p, V::set(0.015625f));
  *byte = V::picki(subnormal, normal_byte, V::trunc(q));
  return V::pick(subnormal, V::as_f(rounded), V::mul(q, V::set(1.0f / 512.0f)));
}

// ue4m3_half_up on lanes (p already clamped to 448 by the caller, as there): byte and value.
template <class V>
inline __attribute__((always_inline)) typename V::F ue4m3_half_up_v(typename V::F p,
                                                                   typename V::I* byte) {
  using I = typename V::I;
  const typename V::F x = V::min(V::set(448.0f), p);
  const I xb = V::as_i(x);
  const I field = V::subi(V::andi(V::template srl<23>(xb), V::seti(0xFF)), V::seti(120));
  I mantissa = V::addi(V::andi(V::template srl<20>(xb), V::seti(7)),
                       V::andi(V::template srl<19>(xb), V::seti(1)));
  const typename V::M carry = V::gti(mantissa, V::seti(7));
  const I exponent = V::add_where(carry, field, V::seti(1));
  mantissa = V::picki(carry, mantissa, V::seti(0));
  I code = V::picki(V::gti(exponent, V::seti(14)),
                    V::ori(V::template sll<3>(exponent), mantissa), V::seti(0x7E));
  const I sub = V::mini(V::trunc(V::add(V::mul(x, V::set(512.0f)), V::set(0.5f))), V::seti(7));
  code = V::picki(V::gti(V::seti(1), field), code, sub);     // field <= 0
  code = V::picki(V::gt(x, V::set(0.0f)), V::seti(0), code);  // x <= 0 or NaN: 0
  *byte = code;
  const typename V::F subnormal = V::mul(V::to_f(code), V::set(1.0f / 512.0f));
  const typename V::F normal = V::as_f(V::ori(
      V::template sll<23>(V::addi(V::template srl<3>(code), V::seti(120))),
      V::template sll<20>(V::andi(code, V::seti(7)))));
  return V::pick(V::gti(V::seti(8), code), normal, subnormal);
}

// encode_range on L-lane vectors (FN: the kFirstNearestScaled code, else the nearest-even one).
template <class V, int DT, bool FAKE, bool FN>
inline __attribute__((always_inline)) void encode_range_vec(const void* x, int64_t b0,
                                                            int64_t b1, float gs, float rgs,
                                                            int flags, uint8_t* packed,
                                                            uint8_t* scale_bytes, void* out) {
  using F = typename V::F;
  using I = typename V::I;
  using M = typename V::M;
  constexpr int L = V::kLanes;
  constexpr int P = 16 / L;  // vectors per block
  const int block_rule = flags & kBlockRuleMask;
  const int element_rule = (flags >> kElementShift) & 3;
  const bool half_up = flags & kHalfUpUE4M3;
  const bool decode_times = flags & kDecodeTimes;
  const bool zero_block_one = flags & kZeroBlockOne;
  const float low = (flags & kMinSubnormal) ? 1.0f / 512.0f : -448.0f;
  const bool replace_zero = flags & kZeroToEighth;
  const bool multiplies = element_rule == kMultiplyByInverse;
  const F vgs = V::set(gs);
  const F zero = V::set(0.0f);
  alignas(64) float amax[kTile];
  alignas(64) float scale[kTile];
  alignas(64) float factor[kTile];
  alignas(64) float decode[kTile];
  alignas(64) float six_scale[kTile];
  alignas(64) float threshold[7][kTile];
  alignas(64) int32_t byte[kTile];
  alignas(64) int32_t counted[kTile];
  for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
    const int n = static_cast<int>(b1 - t0 < kTile ? b1 - t0 : kTile);
    // 1. block amax (encode_range's step 1: the integer max of the magnitude bits)
    for (int j = 0; j < n; ++j) amax[j] = float_of(V::template block_max_bits<DT>(x, 16 * (t0 + j)));
    for (int j = n; j < kTile; ++j) amax[j] = 0.0f;
    // 2. the scale chain across the tile's blocks (encode_range's step 2; in the eager codec
    //    nvfp4lab.scales.block_scales: block rule, zero block, clamp, E4M3 rounding, 0 -> 0.125)
    for (int c = 0; c < kTile; c += L) {
      const F am = V::load(amax + c);
      F pre;
      if (block_rule == kEncodeTimesAmaxTimesInverse) {
        pre = V::mul(vgs, V::mul(am, V::set(static_cast<float>(1.0 / 6.0))));
      } else if (block_rule == kDivideInInputDtype) {
        pre = V::mul(vgs, V::template round_to<DT>(V::div(am, V::set(6.0f))));
      } else if (block_rule == kAmaxOverTargetTimesDecode) {
        pre = V::div(am, V::set(6.0f * gs));
      } else {
        pre = V::div(V::mul(vgs, am), V::set(6.0f));
      }
      if (zero_block_one) pre = V::pick(V::eq(pre, zero), pre, V::set(1.0f));
      pre = V::max(V::set(low), pre);     // pre < low ? low : pre (NaN passes)
      pre = V::min(V::set(448.0f), pre);  // pre > 448 ? 448 : pre
      I b;
      F s = half_up ? ue4m3_half_up_v<V>(pre, &b) : e4m3_nearest_even_v<V>(pre, &b);
      const M s_zero = V::eq(s, zero);
      if (replace_zero) {
        s = V::pick(s_zero, s, V::set(0.125f));
        b = V::picki(s_zero, b, V::seti(0x20));
      }
      V::puti(byte + c, b);
      V::put(scale + c, s);
      // the element factor (nvfp4lab.scales: the order's element scaling)
      F f;
      if (element_rule == kMultiplyByInverse) {
        const F inverse = V::div(V::set(1.0f), V::mul(s, V::set(rgs)));
        f = replace_zero ? inverse : V::pick(s_zero, inverse, zero);  // no zero s once replaced
      } else if (element_rule == kDivideByScaleOverEncode) {
        f = V::div(s, vgs);
      } else if (element_rule == kDivideByScaleTimesDecode) {
        f = V::mul(s, vgs);
      } else {
        f = vgs;
      }
      V::put(factor + c, f);
      V::put(decode + c, decode_times ? V::mul(s, vgs) : V::div(s, vgs));
      if constexpr (FN) {  // the E2M1 table scaled by s: 6 s and the midpoints times s
        V::put(six_scale + c, V::mul(s, V::set(6.0f)));  // exact: s has 4 significant bits
        for (int k = 0; k < 7; ++k) V::put(threshold[k] + c, V::mul(s, V::set(kMidpoints[k])));
        // Whether the count of midpoints is the code of every element: max |v| = f32(amax |f|)
        // at most 2**22 s (below). NaN, infinities, s = 0 under a nonzero block: not.
        const F top = V::mul(am, V::abs(f));
        V::puti(counted + c, V::picki(V::ge(V::mul(s, V::set(4194304.0f)), top), V::seti(0),
                                      V::seti(1)));
      }
    }
    if constexpr (!FAKE) {
      for (int j = 0; j < n; ++j) scale_bytes[t0 + j] = static_cast<uint8_t>(byte[j]);
    }
    // 3. the elements, block by block (encode_range's step 3)
    for (int j = 0; j < n; ++j) {
      const int64_t base = 16 * (t0 + j);
      const F f = V::set(factor[j]);
      I codes[P];
      for (int p = 0; p < P; ++p) {
        const F xv = V::template load_x<DT>(x, base + p * L);
        I code;
        if constexpr (FN) {
          // first_nearest_scaled (nvfp4lab.blocks._nearest_scaled_table): midpoints below |v|,
          // ggml's loop over the 8 magnitudes beyond 6 s, the sign where v < 0 and code > 0
          const F v = V::mul(xv, f);
          const F a = V::abs(v);
          code = V::seti(0);
          for (int k = 0; k < 7; ++k) {
            code = V::add_where(V::gt(a, V::set(threshold[k][j])), code, V::seti(1));
          }
          // Beyond 6 s every midpoint is below a = |v|: the count is 7, and so is ggml's code
          // wherever |6 s - a| < |4 s - a| in float32 (its errors |m s - a| fall as m grows
          // there, so 7 is then the first minimum). That holds for every a <= 2**22 s (the two
          // exact differences are 2 s apart, each rounded by at most ulp(a) / 2 <= s / 4): the
          // block's counted flag. Elsewhere (a huge against s, s = 0, infinities) the check, and
          // ggml's loop where it fails.
          if (!counted[j]) {
            const F s = V::set(scale[j]);
            const M far = V::gt(a, V::set(six_scale[j]));
            const M seven = V::lt(V::abs(V::sub(V::set(six_scale[j]), a)),
                                  V::abs(V::sub(V::mul(s, V::set(4.0f)), a)));
            const M loop = V::but_not(far, seven);
            if (V::any(loop)) {
              F best = a;
              I index = V::seti(0);
              for (int m = 1; m < 8; ++m) {
                const F error = V::abs(V::sub(V::mul(s, V::set(kE2M1[m])), a));
                const M better = V::lt(error, best);
                index = V::picki(better, index, V::seti(m));
                best = V::pick(better, best, error);
              }
              code = V::picki(loop, code, index);
            }
          }
          code = V::or_where(V::both(V::lt(v, zero), V::gti(code, V::seti(0))), code, V::seti(8));
        } else {
          // the nearest-even code (nvfp4lab.e2m1's RNE: clamp to 6, rint(a * step), offset)
          const F v = multiplies ? V::mul(xv, f) : V::div(xv, f);
          const F a = V::min(V::set(6.0f), V::abs(v));
          const M g2 = V::ge(a, V::set(2.0f));
          const M g4 = V::ge(a, V::set(4.0f));
          const F step = V::pick(g4, V::pick(g2, V::set(2.0f), V::set(1.0f)), V::set(0.5f));
          code = V::trunc(V::rint(V::mul(a, step)));
          code = V::add_where(g2, code, V::seti(2));
          code = V::add_where(g4, code, V::seti(2));
          code = V::or_where(V::lt(v, zero), code, V::seti(8));
        }
        if constexpr (FAKE) {  // nvfp4lab.blocks' decode: E2M1 value * (s / gs) or f32(s * d)
          V::template store_x<DT>(out, base + p * L, V::mul(V::e2m1(code), V::set(decode[j])));
        } else {
          codes[p] = code;
        }
      }
      if constexpr (!FAKE) V::pack(codes, packed + 8 * (t0 + j));
    }
  }
}

template <class V, int DT, bool FAKE>
inline __attribute__((always_inline)) void encode_vec_ties(const void* x, int64_t b0, int64_t b1,
                                                          float gs, float rgs, int flags,
                                                          uint8_t* packed, uint8_t* scales,
                                                          void* out) {
  if (flags & kFirstNearestScaled) {
    return encode_range_vec<V, DT, FAKE, true>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  }
  return encode_range_vec<V, DT, FAKE, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
}

template <class V>
inline __attribute__((always_inline)) void encode_vec(const void* x, int64_t b0, int64_t b1,
                                                     int dtype, bool fake, float gs, float rgs,
                                                     int flags, uint8_t* packed, uint8_t* scales,
                                                     void* out) {
#define NVFP4LAB_VEC_CALL(DT)                                                                   \
  if (fake) return encode_vec_ties<V, DT, true>(x, b0, b1, gs, rgs, flags, packed, scales, out); \
  return encode_vec_ties<V, DT, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  if (dtype == kFloat32) {
    NVFP4LAB_VEC_CALL(kFloat32)
  }
  if (dtype == kBFloat16) {
    NVFP4LAB_VEC_CALL(kBFloat16)
  }
  NVFP4LAB_VEC_CALL(kFloat16)
#undef NVFP4LAB_VEC_CALL
}

NVFP4LAB_AVX512 void encode_avx512_vec(const void* x, int64_t b0, int64_t b1, int dtype,
                                       bool fake, float gs, float rgs, int flags,
                                       uint8_t* packed, uint8_t* scales, void* out) {
  encode_vec<Avx512>(x, b0, b1, dtype, fake, gs, rgs, flags, packed, scales, out);
}

NVFP4LAB_AVX2 void encode_avx2(const void* x, int64_t b0, int64_t b1, int dtype, bool fake,
                               float gs, float rgs, int flags, uint8_t* packed, uint8_t* scales,
                               void* out) {
  encode_vec<Avx2>(x, b0, b1, dtype, fake, gs, rgs, flags, packed, scales, out);
}

NVFP4LAB_AVX512 void encode_avx512(const void* x, int64_t b0, int64_t b1, int dtype, bool fake,
                                   float gs, float rgs, int flags, uint8_t* packed,
                                   uint8_t* scales, void* out) {
  if (flags & ~kIntrinsicFlags) {  // the other orders: every step on vectors
    return encode_avx512_vec(x, b0, b1, dtype, fake, gs, rgs, flags, packed, scales, out);
  }
  if (dtype == kFloat32) {
    if (fake) return encode_range_avx512<kFloat32, true>(x, b0, b1, gs, rgs, flags, packed, scales, out);
    return encode_range_avx512<kFloat32, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  }
  if (dtype == kBFloat16) {
    if (fake) return encode_range_avx512<kBFloat16, true>(x, b0, b1, gs, rgs, flags, packed, scales, out);
    return encode_range_avx512<kBFloat16, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  }
  if (fake) return encode_range_avx512<kFloat16, true>(x, b0, b1, gs, rgs, flags, packed, scales, out);
  return encode_range_avx512<kFloat16, false>(x, b0, b1, gs, rgs, flags, packed, scales, out);
}

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return kAvx2;
  return kScalar;
}

// The float32 / bfloat16 / float16 bits of a float32 magnitude's bits (exact: it is an element).
uint32_t as_dtype_bits(uint32_t magnitude, int dtype) {
  if (dtype == kFloat32) return magnitude;
  if (dtype == kBFloat16) return magnitude > 0x7F800000u ? 0x7FC0u : magnitude >> 16;
  if (magnitude > 0x7F800000u) return 0x7E00u;
  const _Float16 h = static_cast<_Float16>(float_of(magnitude));
  uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

}  // namespace

extern "C" {

// The best path of this CPU for the encode: 2 = AVX-512 (F, BW, VL), 1 = AVX2, 0 = baseline.
int nvfp4lab_encode_isa(void) { return best_isa(); }

// max |x| over n elements of dtype (0 float32, 1 bfloat16, 2 float16), as bits of that dtype
// (a NaN's bits when x holds one; +0 for n == 0).
uint32_t nvfp4lab_abs_max(const void* x, int64_t n, int dtype, int isa, int threads) {
  isa = clamp_isa(isa, best_isa());
  uint32_t m = 0;
  const int workers = threads > 1 && n >= 16 * kParallelBlocks ? threads : 1;
  const unsigned csr = _mm_getcsr();
#pragma omp parallel num_threads(workers) reduction(max : m)
  {
    const CallerFloatMode mode(csr);
    const int64_t k = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    const int64_t i0 = n * i / k;
    const int64_t i1 = n * (i + 1) / k;
    if (isa == kAvx512) {
      m = abs_max_avx512_generic(x, i0, i1, dtype);
    } else if (isa == kAvx2) {
      m = abs_max_avx2(x, i0, i1, dtype);
    } else {
      m = abs_max_scalar(x, i0, i1, dtype);
    }
  }
  return as_dtype_bits(m, dtype);
}

// Encode nblocks 16-element blocks of x (dtype as above) with the float32 ENCODE tensor scale gs
// and rgs = f32(1 / gs); flags: 1 the statistic divides in x's dtype, 2 the elements multiply by
// the inverse, 4 a zero scale becomes 0.125. fake == 0: packed [nblocks * 8] and scale bytes
// [nblocks]; fake == 1: out [nblocks * 16] in x's dtype. Returns the path used.
int nvfp4lab_encode(const void* x, int64_t nblocks, int dtype, int fake, float gs, float rgs,
                    int flags, int isa, int threads, uint8_t* packed, uint8_t* scales, void* out) {
  isa = clamp_isa(isa, best_isa());
  const int workers = threads > 1 && nblocks >= kParallelBlocks ? threads : 1;
  const unsigned csr = _mm_getcsr();
#pragma omp parallel num_threads(workers)
  {
    const CallerFloatMode mode(csr);
    const int64_t k = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    // Tile-aligned ranges: every thread but the last starts and ends on a tile boundary.
    const int64_t tiles = (nblocks + kTile - 1) / kTile;
    const int64_t b0 = kTile * (tiles * i / k);
    int64_t b1 = kTile * (tiles * (i + 1) / k);
    if (b1 > nblocks) b1 = nblocks;
    if (isa == kAvx512) {
      encode_avx512(x, b0, b1, dtype, fake != 0, gs, rgs, flags, packed, scales, out);
    } else if (isa == kAvx2) {
      encode_avx2(x, b0, b1, dtype, fake != 0, gs, rgs, flags, packed, scales, out);
    } else {
      encode_scalar(x, b0, b1, dtype, fake != 0, gs, rgs, flags, packed, scales, out);
    }
  }
  return isa;
}

}  // extern "C"
