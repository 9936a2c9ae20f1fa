// nvfp4lab: the table-lookup (LUT) decode of NVFP4 weights on the CPU.
//
// Built on first use by nvfp4lab/kernels/lut_decode.py (torch.utils.cpp_extension, no torch
// headers: a plain C ABI called through ctypes). Decodes packed E2M1 codes (uint8 [NB, 8], element
// 2i in the low nibble of byte i, 2i+1 in the high nibble) with one E4M3 scale byte per 16-element
// block (uint8 [NB]) and a float32 tensor scale t into out [NB, 16] (float32, bfloat16 or float16
// bits), exactly as nvfp4lab.tensor.decode_blocks does in float32:
//
//   rule 0 (SCALE_OVER_ENCODE):  f = float(s) / t      rule 1 (SCALE_TIMES_DECODE): f = float(s) * t
//   x = value(code) * f  (float32), then one round-to-nearest-even to the output dtype.
//
// The result depends only on (scale byte, code), so each call first builds the table of all
// 256 x 16 results with that float32 arithmetic (compiled without fast-math or FMA contraction:
// each step is one IEEE operation), and the decode is then a pure gather: per block, the 16-entry
// row of its scale byte indexed by the 16 codes. AVX-512 (vpermw / vpermps), AVX2 (pshufb /
// vpermps) and a scalar loop do the gather; the path is chosen at run time (CPU flags).

#include "native.h"

using namespace nvfp4lab_native;

namespace {

// Codes are prefetched this many bytes ahead (128 blocks; their scale bytes 128 ahead): the
// hardware's stream prefetch alone left the gather waiting on memory (measured on one core: a
// 4096 x 4096 weight's 16.8 M elements decoded right after a GEMM in 1.73 ms without, 1.33-1.51
// ms with 1-2 KiB; 3-4 KiB no better).
constexpr int64_t kPrefetchBytes = 1024;

// float8_e4m3fn byte -> float32 (exact): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN; there are no infinities.
float e4m3_value(uint32_t byte) {
  const uint32_t exponent = (byte >> 3) & 0xF;
  const uint32_t mantissa = byte & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), static_cast<int>(exponent) - 10);
  }
  return (byte & 0x80) ? -magnitude : magnitude;
}

// float32 -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
uint16_t to_bfloat16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits, round to nearest even (subnormals kept, overflow to infinity).
uint16_t to_float16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (a <= 0x33000000u) return sign;             // <= 2^-25 (a tie at 2^-25) rounds to zero
  const int exponent = static_cast<int>(a >> 23) - 127;
  const uint32_t significand = (a & 0x7FFFFFu) | 0x800000u;  // value = significand * 2^(e-23)
  // Bits of the significand below the float16 unit in the last place (2^(max(e,-14)-10)).
  const int drop = exponent >= -14 ? 13 : 13 + (-14 - exponent);
  uint32_t q = significand >> drop;
  const uint32_t rest = significand & ((1u << drop) - 1u);
  const uint32_t half = 1u << (drop - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  // Normal: q holds the implicit bit at 2^10, so (e+15)<<10 | (q-1024) == ((e+14)<<10) + q, and a
  // carry out of the mantissa moves into the exponent. Subnormal: q is the mantissa itself.
  const uint32_t h = exponent >= -14 ? ((static_cast<uint32_t>(exponent + 14) << 10) + q) : q;
  return sign | static_cast<uint16_t>(h);
}

// The 256 x 16 decoded values of one call (row = scale byte, column = code), in output bits.
struct Table {
  alignas(64) float f32[256 * 16];
  alignas(64) uint16_t h16[256 * 16];
  alignas(64) uint8_t lo[256 * 16];  // low / high bytes of h16, for the AVX2 byte shuffles
  alignas(64) uint8_t hi[256 * 16];
  uint32_t t_bits = 0;  // what the table holds: the tensor scale's bits, the rule, the dtype
  int rule = -1;
  int dtype = -1;
  bool valid = false;
};

// Fills table for (t, rule, dtype) unless it already holds it (the tiles of one weight share one
// table: the table is built once per weight, not per tile).
void build_table(float t, int rule, int dtype, Table* table) {
  if (table->valid && table->t_bits == bits_of(t) && table->rule == rule &&
      table->dtype == dtype) {
    return;
  }
  table->valid = false;
  for (uint32_t s = 0; s < 256; ++s) {
    const float scale = e4m3_value(s);
    const float factor = rule == 0 ? scale / t : scale * t;
    for (int c = 0; c < 16; ++c) {
      const float x = kE2M1[c] * factor;
      const int i = static_cast<int>(s) * 16 + c;
      if (dtype == kFloat32) {
        table->f32[i] = x;
      } else {
        const uint16_t h = dtype == kBFloat16 ? to_bfloat16(x) : to_float16(x);
        table->h16[i] = h;
        table->lo[i] = static_cast<uint8_t>(h & 0xFF);
        table->hi[i] = static_cast<uint8_t>(h >> 8);
      }
    }
  }
  table->t_bits = bits_of(t);
  table->rule = rule;
  table->dtype = dtype;
  table->valid = true;
}

// Prefetch the codes and scales kPrefetchBytes ahead of block b, once per 8 blocks (a line).
// Always inlined: called, a function holding only prefetches counts as free of side effects and
// GCC drops the call.
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* packed,
                                                          const uint8_t* scales, int64_t b) {
  if ((b & 7) == 0) {
    __builtin_prefetch(packed + 8 * b + kPrefetchBytes, 0, 3);
    __builtin_prefetch(scales + b + kPrefetchBytes / 8, 0, 3);
  }
}

// ------------------------------------------------------------------------------------------
// Scalar gather (any CPU; also the tail of the vector loops)
// ------------------------------------------------------------------------------------------

template <typename T>
void gather_scalar(const uint8_t* packed, const uint8_t* scales, int64_t b0, int64_t b1,
                   const T* table, T* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const T* row = table + 16 * static_cast<int64_t>(scales[b]);
    const uint8_t* p = packed + 8 * b;
    T* o = out + 16 * b;
    for (int i = 0; i < 8; ++i) {
      o[2 * i] = row[p[i] & 0xF];
      o[2 * i + 1] = row[p[i] >> 4];
    }
  }
}

// ------------------------------------------------------------------------------------------
// AVX2
// ------------------------------------------------------------------------------------------

// The 16 codes of block b as bytes, in element order (low nibble first).
__attribute__((target("avx2"))) inline __m128i codes_of(const uint8_t* packed, int64_t b) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + 8 * b));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  return _mm_unpacklo_epi8(lo, hi);
}

__attribute__((target("avx2"))) void gather16_avx2(const uint8_t* packed, const uint8_t* scales,
                                                   int64_t b0, int64_t b1, const Table* table,
                                                   uint16_t* out) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) {
    prefetch_ahead(packed, scales, b);
    // Bytes of blocks b and b+1; their codes, one block per 128-bit lane.
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 8 * b));
    const __m128i lo = _mm_and_si128(bytes, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m256i idx =
        _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    const int64_t r0 = 16 * static_cast<int64_t>(scales[b]);
    const int64_t r1 = 16 * static_cast<int64_t>(scales[b + 1]);
    const __m256i tlo = _mm256_set_m128i(
        _mm_load_si128(reinterpret_cast<const __m128i*>(table->lo + r1)),
        _mm_load_si128(reinterpret_cast<const __m128i*>(table->lo + r0)));
    const __m256i thi = _mm256_set_m128i(
        _mm_load_si128(reinterpret_cast<const __m128i*>(table->hi + r1)),
        _mm_load_si128(reinterpret_cast<const __m128i*>(table->hi + r0)));
    const __m256i vlo = _mm256_shuffle_epi8(tlo, idx);
    const __m256i vhi = _mm256_shuffle_epi8(thi, idx);
    const __m256i first = _mm256_unpacklo_epi8(vlo, vhi);  // elements 0..7 of each block
    const __m256i second = _mm256_unpackhi_epi8(vlo, vhi);  // elements 8..15
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * b),
                        _mm256_permute2x128_si256(first, second, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * (b + 1)),
                        _mm256_permute2x128_si256(first, second, 0x31));
  }
  gather_scalar(packed, scales, b, b1, table->h16, out);
}

__attribute__((target("avx2"))) void gather32_avx2(const uint8_t* packed, const uint8_t* scales,
                                                   int64_t b0, int64_t b1, const Table* table,
                                                   float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    prefetch_ahead(packed, scales, b);
    const __m128i codes = codes_of(packed, b);
    const float* row = table->f32 + 16 * static_cast<int64_t>(scales[b]);
    const __m256 first8 = _mm256_load_ps(row);
    const __m256 last8 = _mm256_load_ps(row + 8);
    for (int half = 0; half < 2; ++half) {
      const __m256i idx = _mm256_cvtepu8_epi32(half ? _mm_srli_si128(codes, 8) : codes);
      // vpermps reads the low 3 bits; bit 3 of the code (moved to the sign bit) picks the half.
      const __m256 pick = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(first8, idx),
                                        _mm256_permutevar8x32_ps(last8, idx), pick);
      _mm256_storeu_ps(out + 16 * b + 8 * half, v);
    }
  }
}

// ------------------------------------------------------------------------------------------
// AVX-512 (F + BW)
// ------------------------------------------------------------------------------------------

__attribute__((target("avx512f,avx512bw"))) void gather16_avx512(const uint8_t* packed,
                                                                 const uint8_t* scales,
                                                                 int64_t b0, int64_t b1,
                                                                 const Table* table,
                                                                 uint16_t* out) {
  // vpermw reads bits 0..4 of each index word: bits 0..3 pick the code's column, bit 4 the row
  // (block b's row in words 0..15 of the table register, block b+1's in words 16..31).
  const __m512i keep = _mm512_set1_epi32(0x000F000F);
  const __m512i second = _mm512_set_epi32(0x00100010, 0x00100010, 0x00100010, 0x00100010,
                                          0x00100010, 0x00100010, 0x00100010, 0x00100010, 0,
                                          0, 0, 0, 0, 0, 0, 0);
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) {
    prefetch_ahead(packed, scales, b);
    // One dword per byte of blocks b, b+1 (the byte in bits 0..7); shifted by 12 its high nibble
    // sits in bits 16..19. Kept: bits 0..3 of the first (the low nibble: word 2j, element 2j)
    // and bits 16..19 of the second (word 2j+1, element 2j+1), in one ternary-logic step.
    const __m512i d = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 8 * b)));
    const __m512i codes = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), keep, 0xA8);
    const __m512i idx = _mm512_or_si512(codes, second);
    const __m512i rows = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(
            table->h16 + 16 * static_cast<int64_t>(scales[b])))),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(
            table->h16 + 16 * static_cast<int64_t>(scales[b + 1]))),
        1);
    _mm512_storeu_si512(out + 16 * b, _mm512_permutexvar_epi16(idx, rows));
  }
  gather_scalar(packed, scales, b, b1, table->h16, out);
}

__attribute__((target("avx512f,avx512bw"))) void gather32_avx512(const uint8_t* packed,
                                                                 const uint8_t* scales,
                                                                 int64_t b0, int64_t b1,
                                                                 const Table* table, float* out) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
    prefetch_ahead(packed, scales, b);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + 8 * b));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble),
                                            _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    const __m512 row = _mm512_load_ps(table->f32 + 16 * static_cast<int64_t>(scales[b]));
    _mm512_storeu_ps(out + 16 * b, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), row));
  }
}

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return kAvx512;
  if (__builtin_cpu_supports("avx2")) return kAvx2;
  return kScalar;
}

void gather(const uint8_t* packed, const uint8_t* scales, int64_t b0, int64_t b1,
            const Table* table, int dtype, int isa, void* out) {
  if (dtype == kFloat32) {
    float* o = static_cast<float*>(out);
    if (isa == kAvx512) return gather32_avx512(packed, scales, b0, b1, table, o);
    if (isa == kAvx2) return gather32_avx2(packed, scales, b0, b1, table, o);
    return gather_scalar(packed, scales, b0, b1, table->f32, o);
  }
  uint16_t* o = static_cast<uint16_t*>(out);
  if (isa == kAvx512) return gather16_avx512(packed, scales, b0, b1, table, o);
  if (isa == kAvx2) return gather16_avx2(packed, scales, b0, b1, table, o);
  return gather_scalar(packed, scales, b0, b1, table->h16, o);
}

}  // namespace

extern "C" {

// The best gather path of this CPU: 2 = AVX-512 (F+BW), 1 = AVX2, 0 = scalar.
int nvfp4lab_lut_isa(void) { return best_isa(); }

// Decode nblocks blocks (see the file comment). rule: 0 = s / t, 1 = s * t. dtype: 0 = float32,
// 1 = bfloat16, 2 = float16. isa: the gather path (clamped to what the CPU has). threads: OpenMP
// threads (1: the calling thread only). All pointers contiguous; out holds 16 * nblocks values.
// Returns the path used.
int nvfp4lab_lut_decode(const uint8_t* packed, const uint8_t* scales, int64_t nblocks, float t,
                        int rule, int dtype, int isa, int threads, void* out) {
  const int have = best_isa();
  if (isa > have) isa = have;
  if (isa < kScalar) isa = kScalar;
  static thread_local Table table;
  build_table(t, rule, dtype, &table);
  const Table* shared = &table;
  // Below ~64 K elements a second thread costs more than it saves.
  if (threads <= 1 || nblocks < 4096) {
    gather(packed, scales, 0, nblocks, shared, dtype, isa, out);
    return isa;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t n = omp_get_num_threads();
    const int64_t i = omp_get_thread_num();
    // Even block ranges, so the vector loops see whole pairs and every thread one tail.
    const int64_t pairs = nblocks / 2;
    const int64_t b0 = 2 * (pairs * i / n);
    const int64_t b1 = i + 1 == n ? nblocks : 2 * (pairs * (i + 1) / n);
    gather(packed, scales, b0, b1, shared, dtype, isa, out);
  }
  return isa;
}

}  // extern "C"
