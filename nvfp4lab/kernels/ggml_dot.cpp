// nvfp4lab: llama.cpp's CPU arithmetic for NVFP4 weights (ggml type 40) in C++, bit for bit the
// eager nvfp4lab/execution/ggml_cpu.py (its docstring and docs/llama_cpp.md give ggml's steps).
//
// Built with the other native sources into one library by nvfp4lab/kernels/native.py (plain C
// ABI, no torch headers, ctypes; no fast-math, no FMA contraction: every FMA below is an explicit
// _mm*_fmadd_ps or std::fmaf, every other float32 step one IEEE operation).
//
//   nvfp4lab_q8_0_quantize       float32 rows -> Q8_0 per 32 values: amax = max |x|,
//                                d = fp16_rne(amax / 127), id = amax != 0 ? 127 / amax : 0,
//                                code = clamp(round_half_even(x * id), -128, 127) (NaN -> 0,
//                                as the eager torch path)
//   nvfp4lab_nvfp4_q8_0_mul_mat  out[m, n] = ggml_vec_dot_nvfp4_q8_0 (AVX2 order) of activation
//                                row m (Q8_0) with weight row n (packed E2M1 codes, element 2i
//                                in the low nibble of byte i, and UE4M3 bytes per 16 values)
//   nvfp4lab_nvfp4_q8_0_linear   both: float32 rows x weight -> out (the q8_0 backend's call)
//
// The dot, per output: 8 float32 lanes acc = 0; per Q8_0 block j (32 values, in order): lane l
// is the exact integer sum of the 4 products of values 32j + 4l .. 32j + 4l + 3 (E2M1 codes as
// ggml's doubled kvalues 0, 1, 2, 3, 4, 6, 8, 12, sign bit 3), s_l = T[scale byte 2j + l / 4]
// * f32(d_j) (T the halved UE4M3 value, 0 for bytes 0 and 0x7F, the sign bit ignored), and
// acc_l = fma(s_l, f32(lane_l), acc_l); at the end ((a4 + a0) + (a6 + a2)) + ((a5 + a1) +
// (a7 + a3)). The tensor scale is not applied (the caller multiplies, as ggml's graph does).
//
// Paths, chosen at run time from the CPU's flags (capped by the caller's isa argument):
//   AVX-512 (F, BW, VL + AVX2, FMA, F16C)  two weight rows per zmm (lanes 0-7 row n, 8-15 row
//                                          n + 1): each lane the same op sequence as AVX2's
//   AVX2 (+ FMA, F16C)                     one weight row per ymm: the 8 lanes are ggml's
//   scalar                                 plain loops, std::fmaf
// The vector paths decode 4 weight rows at a time and keep 4 rows' accumulators in flight.
// The integer lanes are |q| (unsigned) times the weight value with q's sign applied
// (maddubs + madd): exact for every int8 q, -128 included. Threads split the weight rows; the
// activation rows go in tiles of kRowTile per decoded weight row.

#include <algorithm>
#include <vector>

#include "native.h"

using namespace nvfp4lab_native;

namespace {

constexpr int64_t kQ8Block = 32;
// Activation rows computed against one decoded weight row (the tile's Q8_0 rows stay in cache).
constexpr int64_t kRowTile = 64;
// Below this many multiply-adds (M * N * K) one thread works.
constexpr int64_t kParallelWork = int64_t{1} << 18;

// ggml's kvalues_mxfp4: an E2M1 code (sign in bit 3) -> twice its value.
alignas(16) constexpr int8_t kKvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#define NVFP4LAB_GGML_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NVFP4LAB_GGML_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// ggml_ue4m3_to_fp32 of every byte: the UE4M3 value halved; bytes 0 and 0x7F give 0, bit 7 is
// ignored (exponent field (b >> 3) & 15, mantissa b & 7; field 0 is subnormal, man * 2**-9).
struct Ue4m3Table {
  float value[256];
  Ue4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xF;
      const int mantissa = b & 7;
      float v = exponent == 0
                    ? static_cast<float>(mantissa) / 1024.0f
                    : float_of(static_cast<uint32_t>(exponent + 119) << 23 |
                               static_cast<uint32_t>(mantissa) << 20);
      value[b] = (b == 0 || b == 0x7F) ? 0.0f : v;
    }
  }
};

const float* ue4m3_half() {
  static const Ue4m3Table table;
  return table.value;
}

inline float half_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

inline uint16_t float_to_half(float f) {  // round to nearest even (GCC's conversion)
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

inline bool finite(float f) { return (bits_of(f) & 0x7F800000u) != 0x7F800000u; }

// round half to even of a float32 product, clamped to int8; NaN -> 0.
inline int8_t q8_code(float v) {
  const float r = std::nearbyint(v);
  if (r != r) return 0;
  return static_cast<int8_t>(r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r));
}

// ------------------------------------------------------------------------------------------
// Q8_0 quantize: blocks [b0, b1) of 32 values; returns the count of non-finite inputs.
// ------------------------------------------------------------------------------------------

int64_t quantize_scalar(const float* x, int64_t b0, int64_t b1, int8_t* codes, uint16_t* d) {
  int64_t bad = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const float* v = x + kQ8Block * b;
    float amax = 0.0f;
    for (int i = 0; i < kQ8Block; ++i) {
      bad += finite(v[i]) ? 0 : 1;
      const float a = std::fabs(v[i]);
      amax = a > amax ? a : amax;
    }
    d[b] = float_to_half(amax / 127.0f);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < kQ8Block; ++i) codes[kQ8Block * b + i] = q8_code(v[i] * id);
  }
  return bad;
}

// The AVX2 body, compiled for AVX2 and again for AVX-512 (the same 256-bit algorithm).
#define NVFP4LAB_Q8_QUANTIZE(SUFFIX, TARGET)                                                    \
  TARGET int64_t quantize_##SUFFIX(const float* x, int64_t b0, int64_t b1, int8_t* codes,       \
                                   uint16_t* d) {                                               \
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));                 \
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);                                     \
    const __m256 lo = _mm256_set1_ps(-128.0f);                                                  \
    const __m256 hi = _mm256_set1_ps(127.0f);                                                   \
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);                            \
    int64_t bad = 0;                                                                            \
    for (int64_t b = b0; b < b1; ++b) {                                                         \
      const float* p = x + kQ8Block * b;                                                        \
      __m256 v[4];                                                                              \
      __m256 m = _mm256_setzero_ps();                                                           \
      for (int i = 0; i < 4; ++i) {                                                             \
        v[i] = _mm256_loadu_ps(p + 8 * i);                                                      \
        const __m256 a = _mm256_and_ps(v[i], magnitude);                                        \
        m = _mm256_max_ps(m, a);                                                                \
        const __m256i e = _mm256_and_si256(_mm256_castps_si256(v[i]), exponent);                \
        bad += __builtin_popcount(                                                              \
            _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, exponent))));          \
      }                                                                                         \
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));            \
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));                                                   \
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));                                               \
      const float amax = _mm_cvtss_f32(h);                                                      \
      d[b] = static_cast<uint16_t>(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));         \
      const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);                    \
      __m256i q[4];                                                                             \
      for (int i = 0; i < 4; ++i) {                                                             \
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id),                                     \
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);              \
        const __m256 ordered = _mm256_cmp_ps(r, r, _CMP_ORD_Q);                                 \
        r = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), ordered);                    \
        q[i] = _mm256_cvtps_epi32(r);                                                           \
      }                                                                                         \
      const __m256i q01 = _mm256_packs_epi32(q[0], q[1]);                                       \
      const __m256i q23 = _mm256_packs_epi32(q[2], q[3]);                                       \
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), order);   \
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + kQ8Block * b), bytes);             \
    }                                                                                           \
    return bad;                                                                                 \
  }

NVFP4LAB_Q8_QUANTIZE(avx2, NVFP4LAB_GGML_AVX2)
NVFP4LAB_Q8_QUANTIZE(avx512, NVFP4LAB_GGML_AVX512)

// ------------------------------------------------------------------------------------------
// The dot. A weight row is first decoded into int8 values (Q8_0 block j at w + j * stride) and
// per-lane weight scales (8 floats per block j at wsc + j * fstride: T[byte 2j] x4, T[byte 2j+1] x4).
// ------------------------------------------------------------------------------------------

void decode_row_scalar(const uint8_t* codes, const uint8_t* scales, int64_t nq, int8_t* w,
                       float* wsc) {
  const float* table = ue4m3_half();
  for (int64_t j = 0; j < nq; ++j) {
    for (int i = 0; i < 16; ++i) {
      const uint8_t byte = codes[16 * j + i];
      w[kQ8Block * j + 2 * i] = kKvalues[byte & 0xF];
      w[kQ8Block * j + 2 * i + 1] = kKvalues[byte >> 4];
    }
    for (int l = 0; l < 8; ++l) wsc[8 * j + l] = table[scales[2 * j + l / 4]];
  }
}

float dot_scalar(const int8_t* w, const float* wsc, const int8_t* q, const float* dq,
                 int64_t nq) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t j = 0; j < nq; ++j) {
    for (int l = 0; l < 8; ++l) {
      int32_t lane = 0;
      for (int t = 0; t < 4; ++t) {
        const int64_t i = kQ8Block * j + 4 * l + t;
        lane += static_cast<int32_t>(q[i]) * static_cast<int32_t>(w[i]);
      }
      const float s = wsc[8 * j + l] * dq[j];
      acc[l] = std::fmaf(s, static_cast<float>(lane), acc[l]);
    }
  }
  return ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]));
}

// The vector paths work on groups of kGroup weight rows, decoded together: Q8_0 block j of row r
// at w + kGroup * 32 * j + 32 * r (int8 values), its lane scales at wsc + kGroup * 8 * j + 8 * r
// (T[byte 2j] x4, T[byte 2j + 1] x4). Four independent accumulators per activation row hide the
// FMA latency; rows past N (the last group) are decoded as zeros and never stored.
constexpr int64_t kGroup = 4;

#define NVFP4LAB_GGML_GROUP(SUFFIX, TARGET)                                                     \
  TARGET void decode_group_##SUFFIX(const uint8_t* codes, const uint8_t* scales, int64_t rows,   \
                                    int64_t nq, int8_t* w, float* wsc) {                        \
    const float* table = ue4m3_half();                                                          \
    const __m128i kv = _mm_load_si128(reinterpret_cast<const __m128i*>(kKvalues));              \
    const __m128i nibble = _mm_set1_epi8(0x0F);                                                 \
    for (int64_t r = 0; r < kGroup; ++r) {                                                      \
      const uint8_t* c = codes + r * 16 * nq;                                                   \
      const uint8_t* s = scales + r * 2 * nq;                                                   \
      for (int64_t j = 0; j < nq; ++j) {                                                        \
        int8_t* out = w + kGroup * kQ8Block * j + kQ8Block * r;                                 \
        float* f = wsc + kGroup * 8 * j + 8 * r;                                                \
        if (r >= rows) {                                                                        \
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_setzero_si256());         \
          _mm256_storeu_ps(f, _mm256_setzero_ps());                                             \
          continue;                                                                             \
        }                                                                                       \
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j));        \
        const __m128i low = _mm_shuffle_epi8(kv, _mm_and_si128(b, nibble));                     \
        const __m128i high = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(b, 4), nibble)); \
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(low, high));        \
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi8(low, high));   \
        _mm256_storeu_ps(f, _mm256_set_m128(_mm_set1_ps(table[s[2 * j + 1]]),                   \
                                            _mm_set1_ps(table[s[2 * j]])));                     \
      }                                                                                         \
    }                                                                                           \
  }                                                                                             \
  /* ggml's hsum_float_8, ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)), of four            \
     accumulators at once: lane r of the result is accumulator r's (the same IEEE adds) */     \
  TARGET inline __m128 hsum4_##SUFFIX(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {             \
    __m128 p0 = _mm_add_ps(_mm256_extractf128_ps(a0, 1), _mm256_castps256_ps128(a0));           \
    __m128 p1 = _mm_add_ps(_mm256_extractf128_ps(a1, 1), _mm256_castps256_ps128(a1));           \
    __m128 p2 = _mm_add_ps(_mm256_extractf128_ps(a2, 1), _mm256_castps256_ps128(a2));           \
    __m128 p3 = _mm_add_ps(_mm256_extractf128_ps(a3, 1), _mm256_castps256_ps128(a3));           \
    _MM_TRANSPOSE4_PS(p0, p1, p2, p3); /* p_i: element i of each accumulator's pairs */        \
    return _mm_add_ps(_mm_add_ps(p0, p2), _mm_add_ps(p1, p3));                                  \
  }

NVFP4LAB_GGML_GROUP(avx2, NVFP4LAB_GGML_AVX2)
NVFP4LAB_GGML_GROUP(avx512, NVFP4LAB_GGML_AVX512)

// One activation row against a decoded group, AVX2: one ymm (ggml's 8 lanes) per weight row.
NVFP4LAB_GGML_AVX2 __m128 dot_group_avx2(const int8_t* w, const float* wsc, const int8_t* q,
                                         const float* dq, int64_t nq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kGroup] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                        _mm256_setzero_ps()};
  for (int64_t j = 0; j < nq; ++j) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kQ8Block * j));
    const __m256i aq = _mm256_abs_epi8(qv);  // |q| as unsigned bytes (128 for -128)
    const __m256 d = _mm256_set1_ps(dq[j]);
    for (int r = 0; r < kGroup; ++r) {
      const __m256i wv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + kGroup * kQ8Block * j + kQ8Block * r));
      const __m256i pairs = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(wv, qv));
      const __m256 lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(wsc + kGroup * 8 * j + 8 * r), d);
      acc[r] = _mm256_fmadd_ps(s, lanes, acc[r]);
    }
  }
  return hsum4_avx2(acc[0], acc[1], acc[2], acc[3]);
}

// AVX-512: two weight rows per zmm (lanes 0-7 row 2p, 8-15 row 2p + 1), each lane the AVX2 ops.
NVFP4LAB_GGML_AVX512 __m128 dot_group_avx512(const int8_t* w, const float* wsc, const int8_t* q,
                                             const float* dq, int64_t nq) {
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < nq; ++j) {
    const __m512i qv = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kQ8Block * j)));
    const __m512i aq = _mm512_abs_epi8(qv);
    const __mmask64 negative = _mm512_movepi8_mask(qv);
    const __m512 d = _mm512_set1_ps(dq[j]);
    for (int p = 0; p < 2; ++p) {
      const __m512i wv = _mm512_loadu_si512(w + kGroup * kQ8Block * j + 2 * kQ8Block * p);
      // the weight value with q's sign (q = 0 multiplies |q| = 0: its sign does not matter)
      const __m512i signed_w = _mm512_mask_sub_epi8(wv, negative, zero, wv);
      const __m512i pairs = _mm512_maddubs_epi16(aq, signed_w);
      const __m512 lanes = _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, ones));
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(wsc + kGroup * 8 * j + 16 * p), d);
      acc[p] = _mm512_fmadd_ps(s, lanes, acc[p]);
    }
  }
  const auto high = [](__m512 a) NVFP4LAB_GGML_AVX512 {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  };
  return hsum4_avx512(_mm512_castps512_ps256(acc[0]), high(acc[0]),
                      _mm512_castps512_ps256(acc[1]), high(acc[1]));
}

// Weight rows [n0, n1) against every activation row, in tiles of kRowTile activation rows.
void mul_mat_range(const int8_t* q8, const float* dq, int64_t m, const uint8_t* codes,
                   const uint8_t* scales, int64_t n, int64_t k, int64_t n0, int64_t n1, int isa,
                   float* out) {
  const int64_t nq = k / kQ8Block;
  std::vector<int8_t> w(static_cast<size_t>(kGroup * k));
  std::vector<float> wsc(static_cast<size_t>(kGroup * 8 * nq));
  alignas(16) float four[kGroup];
  for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
    const int64_t m1 = std::min(m, m0 + kRowTile);
    if (isa == kScalar) {
      for (int64_t r = n0; r < n1; ++r) {
        decode_row_scalar(codes + r * (k / 2), scales + r * (k / 16), nq, w.data(), wsc.data());
        for (int64_t i = m0; i < m1; ++i)
          out[i * n + r] = dot_scalar(w.data(), wsc.data(), q8 + i * k, dq + i * nq, nq);
      }
      continue;
    }
    for (int64_t r = n0; r < n1; r += kGroup) {
      const int64_t rows = std::min(kGroup, n1 - r);
      if (isa == kAvx512) {
        decode_group_avx512(codes + r * (k / 2), scales + r * (k / 16), rows, nq, w.data(),
                            wsc.data());
      } else {
        decode_group_avx2(codes + r * (k / 2), scales + r * (k / 16), rows, nq, w.data(),
                          wsc.data());
      }
      for (int64_t i = m0; i < m1; ++i) {
        const __m128 o = isa == kAvx512
                             ? dot_group_avx512(w.data(), wsc.data(), q8 + i * k, dq + i * nq, nq)
                             : dot_group_avx2(w.data(), wsc.data(), q8 + i * k, dq + i * nq, nq);
        if (rows == kGroup) {
          std::memcpy(out + i * n + r, &o, sizeof o);
        } else {
          std::memcpy(four, &o, sizeof o);
          for (int64_t t = 0; t < rows; ++t) out[i * n + r + t] = four[t];
        }
      }
    }
  }
}

int best_isa() {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return kAvx512;
  }
  return base ? kAvx2 : kScalar;
}


}  // namespace

extern "C" {

// The best path of this CPU for the Q8_0 quantize and the dot: 2 = AVX-512 (F, BW, VL; with AVX2,
// FMA, F16C), 1 = AVX2 (FMA, F16C), 0 = scalar.
int nvfp4lab_ggml_isa(void) { return best_isa(); }

// Q8_0 of x (float32 [nblocks * 32]): codes int8 [nblocks * 32] and d as float16 bits [nblocks].
// Returns the number of non-finite values in x (their codes are meaningless: the caller refuses).
int64_t nvfp4lab_q8_0_quantize(const float* x, int64_t nblocks, int isa, int threads,
                               int8_t* codes, uint16_t* d) {
  isa = clamp_isa(isa, best_isa());
  const int workers = threads > 1 && nblocks >= 4096 ? threads : 1;
  const unsigned csr = _mm_getcsr();
  int64_t bad = 0;
#pragma omp parallel num_threads(workers) reduction(+ : bad)
  {
    const CallerFloatMode mode(csr);
    const int64_t t = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    const int64_t b0 = nblocks * i / t;
    const int64_t b1 = nblocks * (i + 1) / t;
    if (isa == kAvx512) {
      bad = quantize_avx512(x, b0, b1, codes, d);
    } else if (isa == kAvx2) {
      bad = quantize_avx2(x, b0, b1, codes, d);
    } else {
      bad = quantize_scalar(x, b0, b1, codes, d);
    }
  }
  return bad;
}

// out float32 [m, n] = ggml_vec_dot_nvfp4_q8_0 of every Q8_0 row (q8 int8 [m, k], d float16 bits
// [m, k / 32]) with every NVFP4 weight row (codes uint8 [n, k / 2], UE4M3 bytes [n, k / 16]);
// k a multiple of 64. Returns the path used.
int nvfp4lab_nvfp4_q8_0_mul_mat(const int8_t* q8, const uint16_t* d, int64_t m,
                                const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k,
                                int isa, int threads, float* out) {
  isa = clamp_isa(isa, best_isa());
  const int64_t nq = k / kQ8Block;
  std::vector<float> dq(static_cast<size_t>(m * nq));
  for (int64_t i = 0; i < m * nq; ++i) dq[i] = half_to_float(d[i]);
  const int workers = threads > 1 && m * n * k >= kParallelWork ? threads : 1;
  const unsigned csr = _mm_getcsr();
#pragma omp parallel num_threads(workers)
  {
    const CallerFloatMode mode(csr);
    const int64_t t = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    const int64_t groups = (n + kGroup - 1) / kGroup;  // whole groups per thread
    const int64_t n0 = std::min(n, kGroup * (groups * i / t));
    const int64_t n1 = std::min(n, kGroup * (groups * (i + 1) / t));
    mul_mat_range(q8, dq.data(), m, codes, scales, n, k, n0, n1, isa, out);
  }
  return isa;
}

// ggml's mul_mat of float32 rows x [m, k] with the weight (as above): the Q8_0 quantize into a
// scratch buffer, then the dot. Returns the number of non-finite values of x (then out is not
// written: the caller refuses).
int64_t nvfp4lab_nvfp4_q8_0_linear(const float* x, int64_t m, const uint8_t* codes,
                                   const uint8_t* scales, int64_t n, int64_t k, int isa,
                                   int threads, float* out) {
  std::vector<int8_t> q8(static_cast<size_t>(m * k));
  std::vector<uint16_t> d(static_cast<size_t>(m * (k / kQ8Block)));
  const int64_t bad = nvfp4lab_q8_0_quantize(x, m * (k / kQ8Block), isa, threads, q8.data(),
                                             d.data());
  if (bad == 0) nvfp4lab_nvfp4_q8_0_mul_mat(q8.data(), d.data(), m, codes, scales, n, k, isa,
                                            threads, out);
  return bad;
}

}  // extern "C"
