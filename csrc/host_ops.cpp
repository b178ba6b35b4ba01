// zenflow::adamw_compact_step_ and zenflow::accumulate_ -- the host side of ZenFlow's
// non-selected columns, in a compact layout.
//
// Compact layout. Each step the device sends a weight's non-selected columns (sorted
// column ids `index`, n of the weight's C columns) gathered along its column axis, exactly
// what `W.index_select(column_dim, index)` gives:
//   column_dim 1 (nn.Linear [rows, C]):           compact [rows, n], row r = W[r, index]
//   column_dim 0 (Conv1D [C, out], an embedding): compact [n, out], row j = W[index[j], :]
// The host keeps the window's fp32 gradient sum in that layout, so the loop that runs every
// step over ~(1 - topk) of the model is a contiguous multiply-add (accumulate_), and the
// bf16 image that goes back to the device after a host step is written in the same layout
// by the Adam pass itself (adamw_compact_step_), ready to be copied piece by piece.
//
// accumulate_(dst, src, scale, overwrite, sumsq):
//   dst = scale * src            (overwrite: the first sum of a window; dst is not read)
//   dst = dst + scale * src      (otherwise; the product is rounded to fp32 first, never
//                                 fused: bit for bit `dst.add_(src.float() * scale)`, what
//                                 clipping the gradient and then summing it gives)
// dst fp32 or bf16, src fp32 or bf16, both contiguous with the same number of elements. A
// bf16 dst (the compact host state's window sum, q8_ops.cpp) is read as fp32, the sum is
// formed in fp32 as above and stored rounded to nearest even: bf16(float(dst) + fp32(scale *
// src)), resp. bf16(fp32(scale * src)); the rounding is c10::BFloat16's (bit arithmetic so
// the loop vectorises). The vectorised body and the tail use the same operations, so every
// element is computed the same way whatever the thread count. With sumsq it returns the
// sum of squares of dst after the update, of the stored values (double; 0 otherwise): the
// host's share of the global gradient norm when micro-batches are summed on the host.
// Blocks of kBlockElems elements; within a block kLanes independent float64 partial sums (so
// the loop vectorises), combined per block and over blocks in block order: the value does
// not depend on the thread count. An overwrite of an fp32 dst of 2^18 elements or more
// without sumsq stores non-temporally (scale_into_streaming): the same values.
//
// adamw_compact_step_(param, grad, exp_avg, exp_avg_sq, index, column_dim, image, ...):
// one Adam(W) step (the arithmetic of cpu_adam.cpp: step_scalar / step_vector) of the
// elements of the full-shape fp32 param/moments that lie in the columns `index`, from the
// compact gradient `grad` (fp32 or bf16, compact shape); `image` (optional, bf16, compact
// shape) receives the updated values rounded to bf16 in the same pass. Elements of the
// other columns are not read or written. Per-column step counts: `col_steps` (int64, C
// entries, indexed by column id) or the scalar `step`. For column_dim 0 each column is a
// contiguous row of `out` elements; for column_dim 1 a row's non-selected columns form runs
// of consecutive ids, and each run is a contiguous span of both the param and the compact
// gradient. Every element is computed with the same instructions as the full-shape op, so
// the result is bit-identical to adamw_step_ on those elements, for any thread count.

//
// accumulate_keep_i8_(dst, src, scale, codes, scales, prev_mul, prev_delta): first, where
// asked, the previous step's correction of the same sum, block by block from the copy about
// to be replaced: dst = dst * prev_mul (prev_mul != 1), or dst = dst + fp32(prev_delta *
// fp32(code * s)) (prev_delta != 0), each stored as add_dequantized_i8_ stores (so the
// sum is bit for bit what the correction as its own pass, then the add, gives); then
// accumulate_'s add (dst = dst +
// fp32(scale * src), never an overwrite, a bf16 dst rounded as there) and, in the same pass
// over src, src's 8-bit copy (zfctl.step_store "q8": a piece kept until its step's clipping
// coefficient corrects the sum). Per block of kI8Block = 256 elements of src (the last may
// be partial): absmax = max |x|; the block's scale s = absmax / 127 (fp32 division, 0 for
// an all-zero block); a value's code is the integer nearest to x * (127 / absmax) (both fp32
// operations, ties to even), clamped to -127..127 (int8; 0 for an all-zero block); it
// decodes to fp32(code * s). Linear, not q8_ops.cpp's float-like codes: a gradient's 256
// neighbours sit within a decade or two, where 7 bits of linear code lose less (an RMS of
// about 0.7% of a Gaussian block against 2.6%) than 3 bits of mantissa.
// add_dequantized_i8_(dst, codes, scales, scale): dst = dst + fp32(scale * fp32(code * s)),
// a bf16 dst as accumulate_'s. The step store's correction: scale = the step's coefficient
// less the one its adds predicted.
// Both run on kBlockElems blocks as accumulate_ does (whole 256-blocks each), every element
// by the same operations: the results do not depend on the thread count. Non-finite values
// are never passed (the engine zeroes a piece that is not finite before it crosses).
//
// compact_merge_(data, drop, insert_at, values, column_dim): a hand-over's re-layout of one
// compact host array, in place. The compact layout holds a weight's non-selected columns in
// sorted order; at a re-selection m columns enter the device (they leave the host array:
// their OLD positions `drop`, sorted) and m leave it (they join the host array: their NEW
// positions `insert_at`, sorted, values `values` in that order, shaped like the compact
// layout with m columns). The staying columns keep their relative order, so the new array
// is the old one with `drop` removed, gaps opened at `insert_at` and `values` written
// there: for each row, a forward pass of memmoves closes the dropped items, a backward pass
// opens the gaps, then the values are copied in. Each item moves at most twice, in runs as
// long as the gaps between moved columns, with no new array: the alternative (gather the
// staying columns into a new array, scatter the values) is a strided gather per element
// and a new allocation (a re-registration, for a pinned master) every re-selection.
// column_dim 1 ([rows, n]): every row is a sequence of n one-element items, rows run on
// the threads; column_dim 0 ([n, inner]): one sequence of n items of `inner` elements. Any
// dtype (moved as bytes); data and values contiguous, same dtype.
//
// gather_columns_(out, src, index, dim): out = src.index_select(dim, index) for contiguous CPU
// tensors of any dtype (moved as bytes), parallel. src is seen as [outer, n, inner] around
// `dim`; out as [outer, m, inner]. Consecutive ids in `index` form runs, each one memcpy of
// len * inner elements per outer slice: outer slices run on the threads (a Linear's rows),
// or, with one slice (columns along dim 0), the runs themselves, cut to at most ~1 MiB. The
// host's column gathers (the first selection's compact state, a hand-over's entering
// columns, a whole gradient's non-selected columns) are ~N elements each; torch's
// index_select along dim 1 runs them on one thread, element by element (about 2 GB/s on a
// GPU box's server core, measured by make gpu-check).

#include "adam_kernel.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

namespace zenflow {
namespace {

constexpr const char* kCompactOp = "zenflow::adamw_compact_step_";
constexpr const char* kAccumOp = "zenflow::accumulate_";

// Independent float64 partial sums of squares per block: a multiple of every vector width.
constexpr int64_t kLanes = 16;

void check_tensor(const at::Tensor& t, const char* op, const char* name, bool allow_bf16,
                  int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  const bool ok = t.scalar_type() == at::kFloat ||
                  (allow_bf16 && t.scalar_type() == at::kBFloat16);
  TORCH_CHECK(ok, op, ": ", name, " must be Float", allow_bf16 ? " or BFloat16" : "", ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name,
              " must be contiguous (pass a contiguous tensor, not a view with strides ",
              t.strides(), ")");
  TORCH_CHECK(t.numel() == numel, op, ": ", name, " has ", t.numel(), " elements, expected ",
              numel);
}

inline float load_float(const float* x, int64_t i) { return x[i]; }
inline float load_float(const c10::BFloat16* x, int64_t i) { return load_grad_scalar(x, i); }

// Stores x at dst[i]; returns the value stored, as fp32.
inline float store_float(float* dst, int64_t i, float x) {
  dst[i] = x;
  return x;
}

// bf16: round to nearest even as c10::BFloat16(float) does (add 0x7FFF + lsb, keep the top
// half; NaN becomes 0x7FC0), written with integer operations only so that the compiler
// vectorises the loop.
inline float store_float(c10::BFloat16* dst, int64_t i, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t top = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  top = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : top;
  const uint16_t half = static_cast<uint16_t>(top);
  std::memcpy(dst + i, &half, sizeof(half));
  const uint32_t wide = top << 16;
  float stored;
  std::memcpy(&stored, &wide, sizeof(stored));
  return stored;
}

// The first sum of a window (overwrite) of at least this many fp32 elements is written with
// non-temporal stores: 1 MiB, beyond a core's L2, where the sum is not read again from a
// cache (its next reader is the next step's add, a whole backward later).
constexpr int64_t kStreamMinElems = int64_t{1} << 18;

#if defined(__AVX512F__)
inline void stream_vec(float* dst, __m512 x) { _mm512_stream_ps(dst, x); }
inline __m512 vec_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
inline void stream_vec(float* dst, __m256 x) { _mm256_stream_ps(dst, x); }
inline __m256 vec_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
#endif

// dst[i] = scale * src[i], i < n (fp32 dst, not read): the overwrite of accumulate_blocks
// with the vector body's stores non-temporal, so that each destination line is written
// without first being read into the cache (an ordinary store's read for ownership): 6
// bytes an element of a bf16 src instead of 10. Scalar stores up to the vector's
// alignment (a piece's place in a window sum starts anywhere) and for the tail; the same
// product, fp32 scale * src, for every element. The scalar build has no vector body.
template <typename SrcT>
inline void scale_into_streaming(float* __restrict dst, const SrcT* __restrict src, int64_t n,
                                 float scale) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr uintptr_t kAlign = kWidth * sizeof(float);
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % kAlign != 0; ++i) {
    dst[i] = scale * load_float(src, i);
  }
  const Vec s = vec_set1(scale);
  for (; i + kWidth <= n; i += kWidth) stream_vec(dst + i, vec_mul(load_grad_vec(src, i), s));
  _mm_sfence();  // the streamed lines ordered before what this thread does next
#endif
  for (; i < n; ++i) dst[i] = scale * load_float(src, i);
}

// fp-contract=off: the compiler must not fuse dst + scale * src into one FMA (see above).
template <typename DstT, typename SrcT>
__attribute__((optimize("fp-contract=off"))) double accumulate_blocks(
    DstT* dst, const SrcT* src, int64_t numel, float scale, bool overwrite, bool sumsq,
    int team) {
  const int64_t num_blocks = (numel + kBlockElems - 1) / kBlockElems;
  std::vector<double> partial(sumsq ? num_blocks : 0, 0.0);
  const bool stream = overwrite && !sumsq && numel >= kStreamMinElems;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t begin = block * kBlockElems;
    const int64_t end = begin + kBlockElems < numel ? begin + kBlockElems : numel;
    if constexpr (std::is_same_v<DstT, float>) {
      if (stream) {
        scale_into_streaming(dst + begin, src + begin, end - begin, scale);
        continue;
      }
    }
    double lanes[kLanes] = {0.0};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      for (int64_t k = 0; k < kLanes; ++k) {
        const float prod = scale * load_float(src, i + k);
        const float out =
            store_float(dst, i + k, overwrite ? prod : load_float(dst, i + k) + prod);
        if (sumsq) lanes[k] += static_cast<double>(out) * out;
      }
    }
    for (; i < end; ++i) {
      const float prod = scale * load_float(src, i);
      const float out = store_float(dst, i, overwrite ? prod : load_float(dst, i) + prod);
      if (sumsq) lanes[0] += static_cast<double>(out) * out;
    }
    if (sumsq) {
      double total = 0.0;
      for (int64_t k = 0; k < kLanes; ++k) total += lanes[k];
      partial[block] = total;
    }
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

template <typename DstT>
double accumulate_into(DstT* dst, const at::Tensor& src, int64_t numel, float scale,
                       bool overwrite, bool sumsq, int team) {
  if (src.scalar_type() == at::kFloat) {
    return accumulate_blocks(dst, src.data_ptr<float>(), numel, scale, overwrite, sumsq, team);
  }
  return accumulate_blocks(dst, src.data_ptr<c10::BFloat16>(), numel, scale, overwrite, sumsq,
                           team);
}

double accumulate_(const at::Tensor& dst, const at::Tensor& src, double scale, bool overwrite,
                   bool sumsq, int64_t num_threads) {
  const int64_t numel = dst.numel();
  check_tensor(dst, kAccumOp, "dst", true, numel);
  check_tensor(src, kAccumOp, "src", true, numel);
  TORCH_CHECK(num_threads >= 0, kAccumOp, ": num_threads must be >= 0 (0 = OpenMP default), got ",
              num_threads);
  if (numel == 0) return 0.0;
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const float s = static_cast<float>(scale);
  if (dst.scalar_type() == at::kFloat) {
    return accumulate_into(dst.data_ptr<float>(), src, numel, s, overwrite, sumsq, team);
  }
  return accumulate_into(dst.data_ptr<c10::BFloat16>(), src, numel, s, overwrite, sumsq, team);
}

constexpr const char* kKeepOp = "zenflow::accumulate_keep_i8_";
constexpr const char* kAddI8Op = "zenflow::add_dequantized_i8_";
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
static_assert(kBlockElems % kI8Block == 0, "threads take whole 8-bit blocks");

void check_i8_copy(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t numel) {
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), op,
              ": codes and scales must be on the CPU");
  TORCH_CHECK(codes.scalar_type() == at::kChar, op, ": codes must be Char (int8), got ",
              codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be Float, got ",
              scales.scalar_type());
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), op,
              ": codes and scales must be contiguous");
  TORCH_CHECK(codes.numel() == numel, op, ": codes has ", codes.numel(),
              " elements, expected one per element: ", numel);
  const int64_t blocks = (numel + kI8Block - 1) / kI8Block;
  TORCH_CHECK(scales.numel() == blocks, op, ": scales has ", scales.numel(),
              " elements, expected one per 256-element block: ", blocks);
}

// Calls body(q0, q1) for every 256-block [q0, q1) of [0, numel), on the team, in groups of
// kBlockElems elements (whole 256-blocks each, handed out dynamically).
template <typename Body>
void for_each_i8_block(int64_t numel, int team, const Body& body) {
  const int64_t num_blocks = (numel + kBlockElems - 1) / kBlockElems;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t begin = block * kBlockElems;
    const int64_t end = begin + kBlockElems < numel ? begin + kBlockElems : numel;
    for (int64_t q0 = begin; q0 < end; q0 += kI8Block) {
      body(q0, q0 + kI8Block < end ? q0 + kI8Block : end);
    }
  }
}

// One 256-block of accumulate_keep_i8_: the add and the copy (src read once, then from the
// core's L1). fp-contract=off: dst + scale * src is never one FMA (see accumulate_).
template <typename DstT, typename SrcT>
struct KeepI8Block {
  DstT* dst;
  const SrcT* src;
  float scale;
  int8_t* codes;
  float* scales;
  float prev_mul;    // != 1: the sum times it first (a window's first step's clipping)
  float prev_delta;  // != 0: the sum plus it times the copy held first (the last step's)

  __attribute__((optimize("fp-contract=off"))) void operator()(int64_t q0, int64_t q1) const {
    // the members in locals: a store through int8_t* may alias anything, and would make
    // the compiler reload them after every code (no vector loop)
    DstT* const dst = this->dst;
    const SrcT* const src = this->src;
    const float scale = this->scale;
    int8_t* const codes = this->codes;
    // the previous step's correction, from the copy this block is about to replace: the
    // same operations, stored the same way, as add_dequantized_i8_ / a multiply before
    if (prev_delta != 0.0f) {
      const float delta = prev_delta;
      const float held = this->scales[q0 / kI8Block];
      for (int64_t i = q0; i < q1; ++i) {
        const float prod = delta * (static_cast<float>(codes[i]) * held);
        store_float(dst, i, load_float(dst, i) + prod);
      }
    } else if (prev_mul != 1.0f) {
      const float mul = prev_mul;
      for (int64_t i = q0; i < q1; ++i) store_float(dst, i, load_float(dst, i) * mul);
    }
    // absmax on the bits: for non-negative floats the integer order is the float order,
    // and an integer max reduction vectorises (a float one would not, without fast-math)
    uint32_t top = 0;
    for (int64_t i = q0; i < q1; ++i) {
      const float x = load_float(src, i);
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      bits &= 0x7FFFFFFFu;
      top = bits > top ? bits : top;
    }
    float absmax;
    std::memcpy(&absmax, &top, sizeof(absmax));
    const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    this->scales[q0 / kI8Block] = absmax / 127.0f;
    for (int64_t i = q0; i < q1; ++i) {
      const float x = load_float(src, i);
      const float prod = scale * x;
      store_float(dst, i, load_float(dst, i) + prod);
      // |x * inv| <= 127 (+ rounding): adding and taking away 1.5 * 2^23 rounds it to the
      // nearest integer, ties to even (the sum's ulp is 1), as std::nearbyint does
      const float q = (x * inv + kRoundMagic) - kRoundMagic;
      int32_t code = static_cast<int32_t>(q);
      code = code > 127 ? 127 : code;
      code = code < -127 ? -127 : code;
      codes[i] = static_cast<int8_t>(code);
    }
  }
};

// One 256-block of add_dequantized_i8_ (fp-contract=off, as above).
template <typename DstT>
struct AddI8Block {
  DstT* dst;
  const int8_t* codes;
  const float* scales;
  float scale;

  __attribute__((optimize("fp-contract=off"))) void operator()(int64_t q0, int64_t q1) const {
    DstT* const dst = this->dst;  // in locals, as in KeepI8Block
    const int8_t* const codes = this->codes;
    const float scale = this->scale;
    const float s = this->scales[q0 / kI8Block];
    for (int64_t i = q0; i < q1; ++i) {
      const float value = static_cast<float>(codes[i]) * s;
      const float prod = scale * value;
      store_float(dst, i, load_float(dst, i) + prod);
    }
  }
};

template <typename DstT>
void keep_i8_into(DstT* dst, const at::Tensor& src, int64_t numel, float scale, int8_t* codes,
                  float* scales, float prev_mul, float prev_delta, int team) {
  if (src.scalar_type() == at::kFloat) {
    const float* x = src.data_ptr<float>();
    for_each_i8_block(numel, team, KeepI8Block<DstT, float>{dst, x, scale, codes, scales,
                                                            prev_mul, prev_delta});
  } else {
    const c10::BFloat16* x = src.data_ptr<c10::BFloat16>();
    for_each_i8_block(numel, team, KeepI8Block<DstT, c10::BFloat16>{dst, x, scale, codes, scales,
                                                                    prev_mul, prev_delta});
  }
}

void accumulate_keep_i8_(const at::Tensor& dst, const at::Tensor& src, double scale,
                         const at::Tensor& codes, const at::Tensor& scales,
                         int64_t num_threads, double prev_mul, double prev_delta) {
  const int64_t numel = dst.numel();
  check_tensor(dst, kKeepOp, "dst", true, numel);
  check_tensor(src, kKeepOp, "src", true, numel);
  check_i8_copy(kKeepOp, codes, scales, numel);
  TORCH_CHECK(num_threads >= 0, kKeepOp, ": num_threads must be >= 0 (0 = OpenMP default), got ",
              num_threads);
  if (numel == 0) return;
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const float s = static_cast<float>(scale);
  int8_t* c = codes.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  const float pm = static_cast<float>(prev_mul), pd = static_cast<float>(prev_delta);
  if (dst.scalar_type() == at::kFloat) {
    keep_i8_into(dst.data_ptr<float>(), src, numel, s, c, sc, pm, pd, team);
  } else {
    keep_i8_into(dst.data_ptr<c10::BFloat16>(), src, numel, s, c, sc, pm, pd, team);
  }
}

void add_dequantized_i8_(const at::Tensor& dst, const at::Tensor& codes,
                         const at::Tensor& scales, double scale, int64_t num_threads) {
  const int64_t numel = dst.numel();
  check_tensor(dst, kAddI8Op, "dst", true, numel);
  check_i8_copy(kAddI8Op, codes, scales, numel);
  TORCH_CHECK(num_threads >= 0, kAddI8Op,
              ": num_threads must be >= 0 (0 = OpenMP default), got ", num_threads);
  if (numel == 0) return;
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const float s = static_cast<float>(scale);
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  if (dst.scalar_type() == at::kFloat) {
    for_each_i8_block(numel, team, AddI8Block<float>{dst.data_ptr<float>(), c, sc, s});
  } else {
    for_each_i8_block(numel, team,
                      AddI8Block<c10::BFloat16>{dst.data_ptr<c10::BFloat16>(), c, sc, s});
  }
}

// A span whose elements take per-element constants from tables already positioned at the
// span's first element (column c0 of a row): entry i holds element i's column.
template <typename GradT>
inline void run_span_tables(int64_t len, float* p, const GradT* g, float* m, float* v,
                            c10::BFloat16* pb, const StepConsts& c, const float* inv_tab,
                            const float* neg_tab) {
  int64_t i = 0;
  for (; i + kWidth <= len; i += kWidth)
    step_vector(i, p, g, m, v, pb, c, vec_load(inv_tab + i), vec_load(neg_tab + i));
  for (; i < len; ++i) step_scalar(i, p, g, m, v, pb, c, inv_tab[i], neg_tab[i]);
}

struct Run {
  int64_t j0;   // first position in the compact layout
  int64_t c0;   // its column id
  int64_t len;  // consecutive columns
};

std::vector<Run> runs_of(const int64_t* idx, int64_t n) {
  std::vector<Run> runs;
  int64_t j = 0;
  while (j < n) {
    int64_t len = 1;
    while (j + len < n && idx[j + len] == idx[j] + len) ++len;
    runs.push_back({j, idx[j], len});
    j += len;
  }
  return runs;
}

template <typename GradT>
void compact_step(float* p, const GradT* g, float* m, float* v, c10::BFloat16* pb,
                  const int64_t* idx, int64_t n, int64_t num_cols, int64_t inner,
                  int64_t column_dim, const StepConsts& c, BiasConsts scalar,
                  const int64_t* steps, double lr, double beta1, double beta2, int team) {
  if (column_dim == 0) {
    // Column idx[j] is row idx[j] of the param: `inner` contiguous elements; compact row j.
    const int64_t per_block = inner >= kBlockElems ? 1 : kBlockElems / inner;
    const int64_t num_blocks = (n + per_block - 1) / per_block;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int64_t j_end = (block + 1) * per_block < n ? (block + 1) * per_block : n;
      for (int64_t j = block * per_block; j < j_end; ++j) {
        const BiasConsts b =
            steps == nullptr ? scalar : bias_consts(steps[idx[j]], lr, beta1, beta2);
        const int64_t off = idx[j] * inner;
        run_range(0, inner, p + off, g + j * inner, m + off, v + off,
                  pb == nullptr ? nullptr : pb + j * inner, c, b);
      }
    }
    return;
  }
  // column_dim 1: `inner` rows of num_cols columns; compact rows of n.
  const std::vector<Run> runs = runs_of(idx, n);
  std::vector<float> inv_tab, neg_tab;
  if (steps != nullptr) {
    inv_tab.resize(num_cols + kWidth);
    neg_tab.resize(num_cols + kWidth);
    for (const Run& r : runs) {
      int64_t last_step = 0;
      BiasConsts last{};
      for (int64_t k = 0; k < r.len; ++k) {
        const int64_t col = r.c0 + k;
        if (steps[col] != last_step) {
          last = bias_consts(steps[col], lr, beta1, beta2);
          last_step = steps[col];
        }
        inv_tab[col] = last.inv_bc2_sqrt;
        neg_tab[col] = last.neg_step_size;
      }
    }
  }
  const int64_t rows = inner;
  const int64_t per_block = n >= kBlockElems ? 1 : kBlockElems / n;
  const int64_t num_blocks = (rows + per_block - 1) / per_block;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (num_blocks > 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t r_end = (block + 1) * per_block < rows ? (block + 1) * per_block : rows;
    for (int64_t r = block * per_block; r < r_end; ++r) {
      for (const Run& run : runs) {
        const int64_t po = r * num_cols + run.c0;
        const int64_t go = r * n + run.j0;
        c10::BFloat16* pbo = pb == nullptr ? nullptr : pb + go;
        if (steps == nullptr) {
          run_range(0, run.len, p + po, g + go, m + po, v + po, pbo, c, scalar);
        } else {
          run_span_tables(run.len, p + po, g + go, m + po, v + po, pbo, c,
                          inv_tab.data() + run.c0, neg_tab.data() + run.c0);
        }
      }
    }
  }
}

void adamw_compact_step_(const at::Tensor& param, const at::Tensor& grad,
                         const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                         const at::Tensor& index, int64_t column_dim,
                         const std::optional<at::Tensor>& image, int64_t step, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         double grad_scale, bool adamw_mode, int64_t num_threads,
                         const std::optional<at::Tensor>& col_steps) {
  TORCH_CHECK(param.dim() == 2, kCompactOp, ": param must be 2-D, got ", param.dim(), " dims");
  TORCH_CHECK(column_dim == 0 || column_dim == 1, kCompactOp,
              ": column_dim must be 0 or 1, got ", column_dim);
  const int64_t numel = param.numel();
  check_tensor(param, kCompactOp, "param", false, numel);
  check_tensor(exp_avg, kCompactOp, "exp_avg", false, numel);
  check_tensor(exp_avg_sq, kCompactOp, "exp_avg_sq", false, numel);
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1 &&
                  index.is_contiguous(),
              kCompactOp, ": index must be a contiguous 1-D Long CPU tensor, got ",
              index.scalar_type(), " with ", index.dim(), " dims on ", index.device());
  const int64_t num_cols = param.size(column_dim);
  const int64_t inner = param.size(1 - column_dim);
  const int64_t n = index.numel();
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(idx[j] >= 0 && idx[j] < num_cols && (j == 0 || idx[j] > idx[j - 1]), kCompactOp,
                ": index must be strictly increasing column ids in [0, ", num_cols,
                "), got ", idx[j], " at position ", j);
  }
  check_tensor(grad, kCompactOp, "grad", true, n * inner);
  if (image.has_value()) {
    TORCH_CHECK(image->scalar_type() == at::kBFloat16, kCompactOp,
                ": image must be BFloat16, got ", image->scalar_type());
    TORCH_CHECK(image->device().is_cpu() && image->is_contiguous() && image->numel() == n * inner,
                kCompactOp, ": image must be a contiguous CPU tensor of ", n * inner,
                " elements (the compact layout)");
  }
  TORCH_CHECK(step >= 1, kCompactOp, ": step must be >= 1 (1-based, for bias correction), got ",
              step);
  TORCH_CHECK(num_threads >= 0, kCompactOp,
              ": num_threads must be >= 0 (0 = OpenMP default), got ", num_threads);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, kCompactOp, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, kCompactOp, ": beta2 must be in [0, 1), got ", beta2);
  const int64_t* steps = nullptr;
  if (col_steps.has_value()) {
    const at::Tensor& cs = *col_steps;
    TORCH_CHECK(cs.device().is_cpu() && cs.scalar_type() == at::kLong && cs.dim() == 1 &&
                    cs.is_contiguous() && cs.numel() == num_cols,
                kCompactOp, ": col_steps must be a contiguous 1-D Long CPU tensor of ", num_cols,
                " entries (one per column id), got ", cs.numel(), " ", cs.scalar_type());
    steps = cs.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK(steps[idx[j]] >= 1, kCompactOp,
                  ": col_steps must be >= 1 (1-based, for bias correction), got ",
                  steps[idx[j]], " for column ", idx[j]);
    }
  }
  if (n == 0 || inner == 0) return;
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const StepConsts c =
      make_step_consts(lr, beta1, beta2, eps, weight_decay, grad_scale, adamw_mode);
  const BiasConsts scalar = bias_consts(step, lr, beta1, beta2);
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  c10::BFloat16* pb = image.has_value() ? image->data_ptr<c10::BFloat16>() : nullptr;
  if (grad.scalar_type() == at::kFloat) {
    compact_step(p, grad.data_ptr<float>(), m, v, pb, idx, n, num_cols, inner, column_dim, c,
                 scalar, steps, lr, beta1, beta2, team);
  } else {
    compact_step(p, grad.data_ptr<c10::BFloat16>(), m, v, pb, idx, n, num_cols, inner,
                 column_dim, c, scalar, steps, lr, beta1, beta2, team);
  }
}

constexpr const char* kMergeOp = "zenflow::compact_merge_";

// Sorted, distinct positions in [0, n): the op's precondition, checked once.
const int64_t* sorted_positions(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 &&
                  t.is_contiguous(),
              kMergeOp, ": ", name, " must be a contiguous 1-D Long CPU tensor, got ",
              t.scalar_type(), " with ", t.dim(), " dims");
  const int64_t* q = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK(q[i] >= 0 && q[i] < n, kMergeOp, ": ", name, "[", i, "] = ", q[i],
                " is not a position in [0, ", n, ")");
    TORCH_CHECK(i == 0 || q[i] > q[i - 1], kMergeOp, ": ", name,
                " must be sorted and distinct, got ", q[i - 1], " then ", q[i]);
  }
  return q;
}

// One sequence of n items of `item` bytes at `row`: drop the items at `drop`, open gaps at
// `ins` (both m sorted positions), copy the m items of `vals` (consecutive, `vstride` bytes
// apart) into them.
void merge_row(char* row, int64_t n, int64_t item, const int64_t* drop, const int64_t* ins,
               int64_t m, const char* vals, int64_t vstride) {
  int64_t w = 0, prev = 0;  // forward: close the dropped items (moves go left)
  for (int64_t t = 0; t <= m; ++t) {
    const int64_t end = t < m ? drop[t] : n;
    const int64_t len = end - prev;
    if (len > 0 && w != prev) std::memmove(row + w * item, row + prev * item, len * item);
    w += len;
    prev = end + 1;
  }
  for (int64_t t = m; t >= 0; --t) {  // backward: open the gaps (moves go right by t)
    const int64_t begin = t > 0 ? ins[t - 1] + 1 : 0;
    const int64_t end = t < m ? ins[t] : n;
    if (end > begin && t > 0) {
      std::memmove(row + begin * item, row + (begin - t) * item, (end - begin) * item);
    }
  }
  for (int64_t t = 0; t < m; ++t) std::memcpy(row + ins[t] * item, vals + t * vstride, item);
}

void compact_merge_(at::Tensor data, const at::Tensor& drop, const at::Tensor& insert_at,
                    const at::Tensor& values, int64_t column_dim, int64_t num_threads) {
  TORCH_CHECK(column_dim == 0 || column_dim == 1, kMergeOp, ": column_dim must be 0 or 1, got ",
              column_dim);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.dim() == 2, kMergeOp,
              ": data must be a contiguous 2-D CPU tensor, got ", data.dim(), " dims");
  TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 &&
                  values.scalar_type() == data.scalar_type(),
              kMergeOp, ": values must be a contiguous 2-D CPU tensor of data's dtype ",
              data.scalar_type(), ", got ", values.scalar_type());
  const int64_t n = data.size(column_dim);
  const int64_t m = drop.numel();
  TORCH_CHECK(insert_at.numel() == m, kMergeOp, ": drop has ", m, " positions, insert_at ",
              insert_at.numel(), " (as many columns join the array as leave it)");
  const int64_t other = data.size(1 - column_dim);
  TORCH_CHECK(values.size(column_dim) == m && values.size(1 - column_dim) == other, kMergeOp,
              ": values must hold the ", m, " joining columns in data's layout, got shape ",
              values.sizes());
  const int64_t* dq = sorted_positions(drop, n, "drop");
  const int64_t* iq = sorted_positions(insert_at, n, "insert_at");
  if (m == 0 || data.numel() == 0) return;
  const int64_t es = data.element_size();
  char* base = static_cast<char*>(data.data_ptr());
  const char* vals = static_cast<const char*>(values.data_ptr());
  if (column_dim == 0) {  // one sequence of n rows of `other` elements
    merge_row(base, n, other * es, dq, iq, m, vals, other * es);
    return;
  }
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(team) if (other > 1)
  for (int64_t r = 0; r < other; ++r) {  // every row: n one-element items, values row r
    merge_row(base + r * n * es, n, es, dq, iq, m, vals + r * m * es, es);
  }
}

constexpr const char* kGatherOp = "zenflow::gather_columns_";

void gather_columns_(at::Tensor out, const at::Tensor& src, const at::Tensor& index,
                     int64_t dim, int64_t num_threads) {
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous() && src.dim() >= 1, kGatherOp,
              ": src must be a contiguous CPU tensor with at least one dim");
  TORCH_CHECK(dim >= 0 && dim < src.dim(), kGatherOp, ": dim ", dim, " is not a dim of src (",
              src.dim(), " dims)");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong &&
                  index.dim() == 1 && index.is_contiguous(),
              kGatherOp, ": index must be a contiguous 1-D Long CPU tensor, got ",
              index.scalar_type(), " with ", index.dim(), " dims");
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() &&
                  out.scalar_type() == src.scalar_type() && out.dim() == src.dim(),
              kGatherOp, ": out must be a contiguous CPU tensor of src's dtype ",
              src.scalar_type(), " and dims, got ", out.scalar_type(), " with ", out.dim(),
              " dims");
  const int64_t n = src.size(dim), m = index.numel();
  for (int64_t d = 0; d < src.dim(); ++d) {
    TORCH_CHECK(out.size(d) == (d == dim ? m : src.size(d)), kGatherOp, ": out has shape ",
                out.sizes(), ", the gather of ", m, " items along dim ", dim, " of ",
                src.sizes(), " needs that shape with ", m, " at dim ", dim);
  }
  const int64_t es = src.element_size();
  const char* sb = static_cast<const char*>(src.data_ptr());
  char* ob = static_cast<char*>(out.data_ptr());
  const auto o0 = reinterpret_cast<std::uintptr_t>(ob);
  const auto s0 = reinterpret_cast<std::uintptr_t>(sb);
  TORCH_CHECK(o0 + out.numel() * es <= s0 || s0 + src.numel() * es <= o0, kGatherOp,
              ": out overlaps src");
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= src.size(d);
  for (int64_t d = dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  if (m == 0 || outer == 0 || inner == 0) return;
  const int64_t item = inner * es;
  // one slice: the runs are the parallel work, so no run is longer than ~1 MiB
  const int64_t cap = outer == 1 ? std::max<int64_t>(1, (int64_t{1} << 20) / item) : m;
  const int64_t* q = index.data_ptr<int64_t>();
  std::vector<Run> runs;  // j0: position in out, c0: item of src
  for (int64_t t = 0; t < m; ++t) {
    TORCH_CHECK(q[t] >= 0 && q[t] < n, kGatherOp, ": index[", t, "] = ", q[t],
                " is not an item in [0, ", n, ")");
    if (!runs.empty() && q[t] == q[t - 1] + 1 && runs.back().len < cap) {
      ++runs.back().len;
    } else {
      runs.push_back({t, q[t], 1});
    }
  }
  const int team = num_threads > 0 ? static_cast<int>(num_threads) : omp_get_max_threads();
  const int64_t nruns = static_cast<int64_t>(runs.size());
  const bool wide = outer * m * item >= (int64_t{1} << 16);  // threads pay off
  if (outer == 1) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(team) if (wide && nruns > 1)
    for (int64_t r = 0; r < nruns; ++r) {
      std::memcpy(ob + runs[r].j0 * item, sb + runs[r].c0 * item, runs[r].len * item);
    }
    return;
  }
#pragma omp parallel for schedule(static) num_threads(team) if (wide)
  for (int64_t o = 0; o < outer; ++o) {
    const char* s_row = sb + o * n * item;
    char* o_row = ob + o * m * item;
    for (const Run& run : runs) {
      std::memcpy(o_row + run.j0 * item, s_row + run.c0 * item, run.len * item);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zenflow, CPU, m) {
  m.impl("adamw_compact_step_", &adamw_compact_step_);
  m.impl("accumulate_", &accumulate_);
  m.impl("accumulate_keep_i8_", &accumulate_keep_i8_);
  m.impl("add_dequantized_i8_", &add_dequantized_i8_);
  m.impl("compact_merge_", &compact_merge_);
  m.impl("gather_columns_", &gather_columns_);
}

}  // namespace zenflow
