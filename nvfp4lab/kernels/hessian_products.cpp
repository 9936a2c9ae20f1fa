// GPTQ's Hessian products in float64, each sum in a defined order: the Gram matrix of float32 rows
// (the Hessian sum) and the block rotation Q^T H Q (MR-GPTQ's rotated Hessian).
//
// Gram.
// nvfp4lab_gram_add adds sum[i][j] += x[0][i] * x[0][j] + x[1][i] * x[1][j] + ... for the lower
// block triangle of sum (every j <= i, and the rest of the tiles that hold them), one row (token)
// after the other: each element is the running sum, then the product of row 0, then of row 1, ...,
// each addition rounded to float64. Every product of two float32 values is exact in float64 (24
// + 24 significant bits <= 53, no overflow, no subnormal), so an FMA and a multiply-then-add give
// the same bits, and the result does not depend on the vector path, the tiling or the thread
// count: it is what `for row in x: sum += outer(row, row)` gives in float64.
//
// Layout: x float32 [rows, k] (row stride ldx elements), sum float64 [k, k] row-major. Rows are
// converted to float64 kDepth at a time into panels of kPanel = 8 columns ([panel][row][8], zero
// past k); a tile of MR sum rows by NR sum columns keeps its sums in registers over the kDepth
// rows (AVX-512 8 x 24, AVX2 6 x 8, scalar 4 x 4).
//
// Block rotation. nvfp4lab_block_congruence overwrites h float64 [k, k] with Q^T h Q, where
// Q = diag(r_0, r_1, ...) holds b x b matrices on its diagonal (k a multiple of b): first
// t = Q^T h, t[i][j] = sum over s of r_{i/b}[s][i % b] * h[b * (i / b) + s][j], then t Q,
// out[i][j] = sum over s of t[i][b * (j / b) + s] * r_{j/b}[s][j % b]; each sum starts at 0.0 and adds
// its b products in the order of s, each product and each addition rounded to float64 (no FMA:
// with r's entries powers of two, +-1/4 for a 16-point Hadamard, the products are exact and an
// FMA would give the same bits). Row block i / b of the result needs only row block i / b of h,
// so it is computed in place, one b x k scratch per thread: b * k * 4 multiply-adds per row block
// instead of a dense product's k^3 * 2.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "native.h"

namespace {

using namespace nvfp4lab_native;

constexpr int64_t kPanel = 8;    // columns per packed panel
constexpr int64_t kDepth = 128;  // rows converted and packed at a time
constexpr int64_t kBand = 16;    // row blocks per band of tiles
// Below this many multiply-adds one thread works.
constexpr int64_t kParallelWork = int64_t{1} << 20;

#define NVFP4LAB_GRAM_AVX2 __attribute__((target("avx2,fma")))
#define NVFP4LAB_GRAM_AVX512 __attribute__((target("avx512f,avx2,fma")))

int best_isa() {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (base && __builtin_cpu_supports("avx512f")) return kAvx512;
  return base ? kAvx2 : kScalar;
}

// Tile shapes per path: MR sum rows by NR sum columns (NR a multiple or divisor of kPanel).
struct Shape {
  int64_t mr;
  int64_t nr;
};

Shape shape_of(int isa) {
  if (isa == kAvx512) return {8, 24};  // 24 zmm sums
  if (isa == kAvx2) return {6, 8};     // 12 ymm sums
  return {4, 4};
}

// Where packed element (row 0, column i) lives: panel i / kPanel, lane i % kPanel (row t:
// + t * kPanel).
inline const double* packed_row(const double* packed, int64_t i) {
  return packed + (i / kPanel) * kDepth * kPanel + i % kPanel;
}

// c[r * ldc + q] += sum over t < depth of a_r[t * kPanel] * b[t * kPanel + q], t in order.
template <int64_t MR, int64_t NR>
void tile_scalar(const double* const* a, const double* b, int64_t depth, double* c, int64_t ldc) {
  double acc[MR][NR];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t q = 0; q < NR; ++q) acc[r][q] = c[r * ldc + q];
  for (int64_t t = 0; t < depth; ++t) {
    for (int64_t r = 0; r < MR; ++r) {
      const double ar = a[r][t * kPanel];
      for (int64_t q = 0; q < NR; ++q) acc[r][q] = acc[r][q] + ar * b[t * kPanel + q];
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t q = 0; q < NR; ++q) c[r * ldc + q] = acc[r][q];
}

NVFP4LAB_GRAM_AVX2 void tile_avx2(const double* const* a, const double* b, int64_t depth,
                                  double* c, int64_t ldc) {
  __m256d acc[6][2];
  for (int r = 0; r < 6; ++r) {
    acc[r][0] = _mm256_loadu_pd(c + r * ldc);
    acc[r][1] = _mm256_loadu_pd(c + r * ldc + 4);
  }
  for (int64_t t = 0; t < depth; ++t) {
    const __m256d b0 = _mm256_loadu_pd(b + t * kPanel);
    const __m256d b1 = _mm256_loadu_pd(b + t * kPanel + 4);
    for (int r = 0; r < 6; ++r) {
      const __m256d ar = _mm256_broadcast_sd(a[r] + t * kPanel);
      acc[r][0] = _mm256_fmadd_pd(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(ar, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < 6; ++r) {
    _mm256_storeu_pd(c + r * ldc, acc[r][0]);
    _mm256_storeu_pd(c + r * ldc + 4, acc[r][1]);
  }
}

NVFP4LAB_GRAM_AVX512 void tile_avx512(const double* const* a, const double* b, int64_t depth,
                                      double* c, int64_t ldc) {
  __m512d acc[8][3];
  for (int r = 0; r < 8; ++r) {
    acc[r][0] = _mm512_loadu_pd(c + r * ldc);
    acc[r][1] = _mm512_loadu_pd(c + r * ldc + 8);
    acc[r][2] = _mm512_loadu_pd(c + r * ldc + 16);
  }
  const double* b1p = b + kDepth * kPanel;  // the next two panels: columns 8..23
  const double* b2p = b1p + kDepth * kPanel;
  for (int64_t t = 0; t < depth; ++t) {
    const __m512d b0 = _mm512_loadu_pd(b + t * kPanel);
    const __m512d b1 = _mm512_loadu_pd(b1p + t * kPanel);
    const __m512d b2 = _mm512_loadu_pd(b2p + t * kPanel);
    const double* at = a[0] + t * kPanel;  // the tile's 8 rows are one panel, in order
    for (int r = 0; r < 8; ++r) {
      const __m512d ar = _mm512_set1_pd(at[r]);
      acc[r][0] = _mm512_fmadd_pd(ar, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_pd(ar, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_pd(ar, b2, acc[r][2]);
    }
  }
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_pd(c + r * ldc, acc[r][0]);
    _mm512_storeu_pd(c + r * ldc + 8, acc[r][1]);
    _mm512_storeu_pd(c + r * ldc + 16, acc[r][2]);
  }
}

// One tile at sum rows i0.., columns j0..: in place where it lies wholly inside sum, else
// through a zero-padded copy (only the elements inside sum are read and written back).
void run_tile(int isa, Shape s, const double* packed, int64_t depth, int64_t i0, int64_t j0,
              int64_t k, double* sum) {
  const double* a[8];
  for (int64_t r = 0; r < s.mr; ++r) a[r] = packed_row(packed, i0 + r);
  const double* b = packed_row(packed, j0);
  const bool inside = i0 + s.mr <= k && j0 + s.nr <= k;
  double edge[8 * 24];
  double* c = sum + i0 * k + j0;
  int64_t ldc = k;
  if (!inside) {
    for (int64_t r = 0; r < s.mr; ++r)
      for (int64_t q = 0; q < s.nr; ++q)
        edge[r * s.nr + q] = i0 + r < k && j0 + q < k ? sum[(i0 + r) * k + j0 + q] : 0.0;
    c = edge;
    ldc = s.nr;
  }
  if (isa == kAvx512) {
    tile_avx512(a, b, depth, c, ldc);
  } else if (isa == kAvx2) {
    tile_avx2(a, b, depth, c, ldc);
  } else {
    tile_scalar<4, 4>(a, b, depth, c, ldc);
  }
  if (!inside) {
    for (int64_t r = 0; r < s.mr && i0 + r < k; ++r)
      for (int64_t q = 0; q < s.nr && j0 + q < k; ++q) sum[(i0 + r) * k + j0 + q] = edge[r * s.nr + q];
  }
}

// Calls visit(i0, j0) for the tiles numbered first .. last - 1 of the lower block triangle (every
// tile holding an element j <= i), in their order: by band of kBand row blocks (whose packed rows
// stay in cache), then column block, then row block. Returns how many tiles it walked past (all
// of them when last is past the end). No list is held: K = 28,672 has 25 million 4 x 4 tiles.
template <typename Visit>
int64_t walk_tiles(Shape s, int64_t k, int64_t first, int64_t last, Visit visit) {
  int64_t n = 0;
  const int64_t band = kBand * s.mr;
  for (int64_t b0 = 0; b0 < k; b0 += band) {
    const int64_t b1 = std::min(k, b0 + band);
    for (int64_t j0 = 0; j0 < b1; j0 += s.nr) {
      for (int64_t i0 = b0; i0 < b1; i0 += s.mr) {
        if (i0 + s.mr - 1 < j0) continue;
        if (n >= last) return n;
        if (n >= first) visit(i0, j0);
        ++n;
      }
    }
  }
  return n;
}

// Ask for the sums of the next tile while this one computes (they come from far in the cache:
// the whole lower triangle is touched once per kDepth rows).
inline void prefetch_tile(Shape s, int64_t i0, int64_t j0, int64_t k, const double* sum) {
  for (int64_t r = 0; r < s.mr && i0 + r < k; ++r) {
    const char* row = reinterpret_cast<const char*>(sum + (i0 + r) * k + j0);
    for (int64_t byte = 0; byte < s.nr * 8; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
  }
}

// Rows t0 .. t0 + depth of x, columns of panels p0 .. p1, into packed (zeros past k).
void pack(const float* x, int64_t ldx, int64_t t0, int64_t depth, int64_t k, int64_t p0,
          int64_t p1, double* packed) {
  for (int64_t p = p0; p < p1; ++p) {
    double* panel = packed + p * kDepth * kPanel;
    const int64_t j0 = p * kPanel;
    const int64_t width = std::max<int64_t>(0, std::min(kPanel, k - j0));
    for (int64_t t = 0; t < depth; ++t) {
      const float* row = x + (t0 + t) * ldx + j0;
      double* out = panel + t * kPanel;
      for (int64_t q = 0; q < width; ++q) out[q] = static_cast<double>(row[q]);
      for (int64_t q = width; q < kPanel; ++q) out[q] = 0.0;
    }
  }
}

// Row blocks a0 .. a1 of h := Q^T h Q (file comment), in place; r: float64 [k / b, b, b], the
// diagonal blocks; t: scratch float64 [b, k].
inline __attribute__((always_inline)) void congruence_rows(double* h, int64_t k, const double* r,
                                                           int64_t b, int64_t a0, int64_t a1,
                                                           double* t) {
  constexpr int64_t kChunk = 256;  // columns of the first product kept in cache at a time
  for (int64_t a = a0; a < a1; ++a) {
    double* rows = h + a * b * k;
    for (int64_t j0 = 0; j0 < k; j0 += kChunk) {
      const int64_t j1 = std::min(k, j0 + kChunk);
      for (int64_t i = 0; i < b; ++i) {
        double* out = t + i * k;
        for (int64_t j = j0; j < j1; ++j) out[j] = 0.0;
        for (int64_t s = 0; s < b; ++s) {
          const double weight = r[a * b * b + s * b + i];
          const double* in = rows + s * k;
          for (int64_t j = j0; j < j1; ++j) out[j] = out[j] + weight * in[j];
        }
      }
    }
    for (int64_t i = 0; i < b; ++i) {
      const double* in = t + i * k;
      double* out = rows + i * k;
      for (int64_t c = 0; c < k; c += b) {
        for (int64_t q = 0; q < b; ++q) out[c + q] = 0.0;
        for (int64_t s = 0; s < b; ++s) {
          const double value = in[c + s];
          const double* weights = r + c * b + s * b;
          for (int64_t q = 0; q < b; ++q) out[c + q] = out[c + q] + value * weights[q];
        }
      }
    }
  }
}

NVFP4LAB_GRAM_AVX512 void congruence_avx512(double* h, int64_t k, const double* r, int64_t b,
                                            int64_t a0, int64_t a1, double* t) {
  congruence_rows(h, k, r, b, a0, a1, t);
}

NVFP4LAB_GRAM_AVX2 void congruence_avx2(double* h, int64_t k, const double* r, int64_t b,
                                        int64_t a0, int64_t a1, double* t) {
  congruence_rows(h, k, r, b, a0, a1, t);
}

void congruence_scalar(double* h, int64_t k, const double* r, int64_t b, int64_t a0, int64_t a1,
                       double* t) {
  congruence_rows(h, k, r, b, a0, a1, t);
}

}  // namespace

extern "C" {

// The best path of this CPU for the Gram kernel: 2 = AVX-512 F (with AVX2, FMA), 1 = AVX2 (FMA),
// 0 = scalar.
int nvfp4lab_gram_isa(void) { return best_isa(); }

// sum float64 [k, k] += the Gram matrix of x float32 [rows, k] (row stride ldx), summed row by
// row (file comment), on every tile holding an element of the lower triangle (j <= i); elements
// above the diagonal are left as they were or updated the same way (the caller mirrors the lower
// triangle). Returns the path used.
int nvfp4lab_gram_add(const float* x, int64_t rows, int64_t k, int64_t ldx, int isa, int threads,
                      double* sum) {
  isa = clamp_isa(isa, best_isa());
  const Shape s = shape_of(isa);
  if (rows <= 0 || k <= 0) return isa;
  const int64_t ntiles = walk_tiles(s, k, 0, INT64_MAX, [](int64_t, int64_t) {});
  // One panel past the last covers rows a tile reads beyond k (zeros).
  const int64_t panels = (k + std::max(s.mr, s.nr) + kPanel - 1) / kPanel + 1;
  // 64-byte aligned: a packed row of kPanel = 8 doubles is one whole cache line.
  std::vector<double> storage(static_cast<size_t>(panels * kDepth * kPanel + 8), 0.0);
  double* const packed = storage.data() + (8 - reinterpret_cast<uintptr_t>(storage.data()) / 8 % 8) % 8;
  const int64_t packed_panels = (k + kPanel - 1) / kPanel;
  const int workers =
      threads > 1 && ntiles * s.mr * s.nr * rows >= kParallelWork ? threads : 1;
  const unsigned csr = _mm_getcsr();
#pragma omp parallel num_threads(workers)
  {
    const CallerFloatMode mode(csr);
    const int64_t nt = omp_get_num_threads();
    const int64_t me = omp_get_thread_num();
    const int64_t p0 = packed_panels * me / nt, p1 = packed_panels * (me + 1) / nt;
    const int64_t first = ntiles * me / nt, last = ntiles * (me + 1) / nt;
    for (int64_t t0 = 0; t0 < rows; t0 += kDepth) {
      const int64_t depth = std::min(kDepth, rows - t0);
      pack(x, ldx, t0, depth, k, p0, p1, packed);
#pragma omp barrier
      int64_t pending_i = -1, pending_j = -1;  // one tile behind: the next one is prefetched
      walk_tiles(s, k, first, last, [&](int64_t i0, int64_t j0) {
        prefetch_tile(s, i0, j0, k, sum);
        if (pending_i >= 0) run_tile(isa, s, packed, depth, pending_i, pending_j, k, sum);
        pending_i = i0;
        pending_j = j0;
      });
      if (pending_i >= 0) run_tile(isa, s, packed, depth, pending_i, pending_j, k, sum);
#pragma omp barrier
    }
  }
  return isa;
}

// h float64 [k, k] := Q^T h Q with Q = diag(r_0, r_1, ...), r float64 [k / b, b, b], k a multiple
// of b (file comment), in place. Returns the path used.
int nvfp4lab_block_congruence(double* h, int64_t k, const double* r, int64_t b, int isa,
                              int threads) {
  isa = clamp_isa(isa, best_isa());
  if (k <= 0 || b <= 0 || k % b) return isa;
  const int64_t blocks = k / b;
  const int workers = threads > 1 && k * k * b >= kParallelWork ? threads : 1;
  const unsigned csr = _mm_getcsr();
#pragma omp parallel num_threads(workers)
  {
    const CallerFloatMode mode(csr);
    const int64_t nt = omp_get_num_threads();
    const int64_t me = omp_get_thread_num();
    std::vector<double> t(static_cast<size_t>(b * k));
    const int64_t a0 = blocks * me / nt, a1 = blocks * (me + 1) / nt;
    if (isa == kAvx512) {
      congruence_avx512(h, k, r, b, a0, a1, t.data());
    } else if (isa == kAvx2) {
      congruence_avx2(h, k, r, b, a0, a1, t.data());
    } else {
      congruence_scalar(h, k, r, b, a0, a1, t.data());
    }
  }
  return isa;
}

}  // extern "C"
