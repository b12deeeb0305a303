// Shared declarations of the CPU Adam extension.
//
// Each instruction-set variant (adam_avx512.cpp, adam_avx2.cpp, adam_portable.cpp) fills one
// IsaKernels table with plain functions over raw pointers and an index range [begin, end).
// The variants must not define any inline function with external linkage: the linker could
// otherwise keep an AVX-512 copy of it for the whole library. Everything they share lives in
// this header as `static inline` (internal linkage, one copy per translation unit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace offload_adam {

// Element types of the buffers the kernels read or write; values match kernels.py.
enum ElemType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Everything one Adam step needs. Pointers are borrowed from the caller (torch tensors that
// Python keeps alive for the duration of the call); the kernel never frees them.
// Each fp32 state array has a source (`*_in`, only read) and a destination (only written,
// after the element was read): the same pointer for an update in place, or a separate buffer
// for an out-of-place step that leaves the old state intact. A source is either exactly its
// destination or overlaps no destination at all (checked by the bindings).
struct AdamArgs {
  const float* param_in;       // fp32 master weights before the step
  const void* grad;            // gradient, element type grad_type
  const float* exp_avg_in;     // fp32 first moment before the step
  const float* exp_avg_sq_in;  // fp32 second moment before the step
  float* param;                // fp32 master weights after the step (param_in: in place)
  float* exp_avg;              // fp32 first moment after the step (exp_avg_in: in place)
  float* exp_avg_sq;           // fp32 second moment after the step (exp_avg_sq_in: in place)
  void* param_out16;           // optional 16-bit copy of the updated weights (nullptr: none)
  int grad_type;               // kF32 | kBF16 | kF16
  int out_type;                // kBF16 | kF16 | kNone
  // Scalars, already rounded to fp32 the way torch rounds a Python scalar operand.
  float grad_scale;  // gradient multiplier (1 skips the multiply)
  bool apply_scale;
  float weight_decay;  // L2 coefficient (adamw_mode false)
  bool l2_decay;
  float decay_factor;  // 1 - lr * weight_decay (adamw_mode true)
  bool decoupled_decay;
  float beta1_weight;  // 1 - beta1, the lerp weight of exp_avg
  float beta2;
  float one_minus_beta2;
  // The bias correction of the second moment: the fp32 step divides sqrt(v') by
  // bias_correction2_sqrt, as torch does; the compact steps multiply it by
  // bias_correction2_rsqrt = 1 / sqrt(bias_correction2) rounded to fp32 once (docs/compact_state.md:
  // one division fewer per element, at most an ulp from the quotient).
  float bias_correction2_sqrt;
  float bias_correction2_rsqrt;
  bool correct_bc2;  // this step's factor != 1 (x / 1 == x * 1 == x exactly: skipped)
  float eps;
  float neg_step_size;  // -lr / bias_correction1
  // The int8 step's bound on the first moment it steps with (docs/compact_state.md, "The
  // single-step bound"): |m'| taken as at most m_bound * sqrt(v'), AdamW's own largest
  // |m_t| / sqrt(v_t) at this step (finite: fp32's largest where there is none, so that the
  // limit is NaN only for a NaN v'). m' is stored as it is.
  float m_bound;
  // Large arrays (far beyond the last-level cache): write param_out16 with non-temporal
  // stores (no read-for-ownership of lines that are only written; it will not be re-read
  // from this cache soon). Changes no result, only the memory traffic; the portable variant
  // ignores it. Every range that streams ends with a store fence. (Software prefetch of the
  // read streams, 64..1024 elements ahead, measured no effect: the hardware prefetchers
  // keep up.) The fp32 destinations always take regular stores: in place, their lines are
  // already in cache from the loads; out of place, each destination line is read for
  // ownership before it is written.
  bool stream;
};

// Storage of the Adam moments of a compact step (docs/compact_state.md); fp32 moments take
// adam_step. Values match kernels.py.
enum MomentType : int { kMomentBF16 = 1, kMomentInt8 = 2 };

// Elements sharing one int8 block exponent (plan.state_layout.INT8_BLOCK).
constexpr size_t kInt8Block = 32;

// One compact step: `step` carries the scalars and the parameter, gradient and 16-bit copy
// pointers (its fp32 moment pointers are unused, its `stream` ignored: the compact kernels
// use ordinary stores). The moments: bf16, n uint16 each; int8, n code bytes each plus
// ceil(n / 32) block exponents (block b holds elements [32 b, 32 b + 32) of the call; a call
// starts on a block). Sources and destinations as in AdamArgs: each source is exactly its
// destination (in place) or overlaps no destination.
struct CompactArgs {
  AdamArgs step;
  int moment_type;  // kMomentBF16 | kMomentInt8
  const void* exp_avg_in;
  const void* exp_avg_sq_in;
  void* exp_avg;
  void* exp_avg_sq;
  const uint8_t* exp_avg_exponents_in;  // int8 only
  const uint8_t* exp_avg_sq_exponents_in;
  uint8_t* exp_avg_exponents;
  uint8_t* exp_avg_sq_exponents;
  uint32_t key;       // rounding_key(unit, rank, step)
  uint32_t position;  // the first element's offset in the unit's shard, mod 2^32
};

// (std::min would be an inline function with external linkage; see the note at the top.)
static inline size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

// One cache line at p fetched into every cache level ahead of its use. An asm statement, not
// __builtin_prefetch: GCC 12 dropped every __builtin_prefetch of prefetch_int8_ahead below from
// the kernels (with the 2-byte gradients always, with the fp32 ones in some layouts).
static inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Software prefetch, before the int8 kernels' group at element i of a range ending at `end`
// (groups of `count` elements), of what the group kPrefetchGroups ahead reads (weights, gradient
// of `grad_bytes` each, both moments' codes); nothing within that distance of the range's end. Unlike the
// fp32 kernel's (whose plain streams the hardware prefetchers keep up with), the int8 kernel's compute
// between loads left its memory time unhidden: on a 2-vCPU AVX-512 VM at 30M elements, two threads, it ran
// at 1.38 Gparam/s against 2.54 in cache; 2.22-2.25 with the prefetch 1 group ahead, 2.67-2.77 with
// 2, 2.54-2.56 with 4, 1.9-2.2 with 6. Changes no result.
constexpr size_t kPrefetchGroups = 2;
static inline void prefetch_int8_ahead(const CompactArgs& c, size_t i, size_t end, size_t count,
                                       size_t grad_bytes) {
  if (i + (kPrefetchGroups + 1) * count > end) return;
  const size_t j = i + kPrefetchGroups * count;
  const char* param = reinterpret_cast<const char*>(c.step.param_in + j);
  const char* grad = static_cast<const char*>(c.step.grad) + j * grad_bytes;
  const char* m = static_cast<const char*>(c.exp_avg_in) + j;
  const char* v = static_cast<const char*>(c.exp_avg_sq_in) + j;
  for (size_t b = 0; b < 4 * count; b += 64) prefetch_line(param + b);
  for (size_t b = 0; b < grad_bytes * count; b += 64) prefetch_line(grad + b);
  for (size_t b = 0; b < count; b += 64) {
    prefetch_line(m + b);
    prefetch_line(v + b);
  }
}

struct IsaKernels {
  const char* name;
  void (*adam)(const AdamArgs& args, size_t begin, size_t end);
  // The memory traffic of `adam` with the same arguments (same loads, stores and streaming
  // mode, same sources and destinations) around trivial arithmetic: the benchmark's bandwidth
  // limit for this access pattern. Overwrites the destinations with meaningless values.
  void (*traffic)(const AdamArgs& args, size_t begin, size_t end);
  // Sum of squares of elements [begin, end) in double, in a fixed order (deterministic).
  double (*sum_squares)(const void* data, int type, size_t begin, size_t end);
  // True when any element of [begin, end) is NaN or infinite.
  bool (*any_nonfinite)(const void* data, int type, size_t begin, size_t end);
  // A compact step over elements [begin, end) (int8: begin a multiple of 32, end a multiple
  // of 32 or the call's last element).
  void (*adam_compact)(const CompactArgs& args, size_t begin, size_t end);
  // Its memory traffic around trivial arithmetic (the benchmark's limit), like `traffic`.
  void (*compact_traffic)(const CompactArgs& args, size_t begin, size_t end);
};

const IsaKernels& avx512_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& portable_kernels();

// ---- scalar conversions shared by the portable path and the reductions -------------------

static inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// Round to nearest even, like c10::BFloat16; NaN becomes the canonical quiet NaN 0x7fc0.
static inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // zero or subnormal: mantissa * 2^-24 is exact in fp32
    float magnitude = float(mantissa) * (1.0f / 16777216.0f);
    return bits_float(float_bits(magnitude) | sign);
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// IEEE binary16 with round to nearest even (what F16C's vcvtps2ph does with
// _MM_FROUND_TO_NEAREST_INT): subnormals kept, overflow to infinity, NaN stays NaN (quieted).
static inline uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t x = u & 0x7fffffffu;
  if (x >= 0x7f800000u) {
    if (x == 0x7f800000u) return sign | 0x7c00u;
    return sign | 0x7e00u | uint16_t((x >> 13) & 0x3ffu);
  }
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {                        // below 2^-14: half subnormal or zero
    if (x <= 0x33000000u) return sign;          // <= 2^-25 rounds (ties to even) to zero
    uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - (x >> 23);  // 14 .. 24
    uint32_t result = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u))) ++result;
    return sign | uint16_t(result);
  }
  uint32_t rebased = x - 0x38000000u;  // exponent bias 127 -> 15
  return sign | uint16_t((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
}

// ---- compact moments (docs/compact_state.md), scalar forms -----------------------------

// MurmurHash3's 32-bit finalizer: the random word of element i is fmix32(key ^ (position + i)).
static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// exp_avg's magnitude codes, E3M4T (docs/compact_state.md): 0 is zero; 1..14 the tail, powers
// of two float((c + 105) << 23) = 2^(c - 22), from 2^-21 to 2^-8; 15..127 E3M4,
// float((c + 1905) << 19), from 2^-7 to 1.0 (code 127). Below the tail's floor 2^-21 a value
// rounds between 0 and it.
constexpr uint32_t kE3M4TTailBase = 105;
constexpr uint32_t kE3M4TNormalBase = 1905;
constexpr uint32_t kE3M4TFirstNormal = 15;
constexpr uint32_t kTwoPowM21Bits = (127u - 21u) << 23;
// Where the root's E4M4 subnormal range ends (bias 15): 2^-14.
constexpr uint32_t kTwoPowM14Bits = (127u - 14u) << 23;

// The compact kernels run with IEEE arithmetic whatever the calling thread set: round to
// nearest, no flush-to-zero, no denormals-are-zero (torch.set_flush_denormal(True) sets both;
// a tiny moment, weight or y is an fp32 subnormal, and the result must equal torch's).
// ieee_mode_enter returns the control word for ieee_mode_leave to restore.
static inline unsigned ieee_mode_enter() {
#if defined(__SSE2__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved & ~0xE040u);  // FTZ (bit 15), rounding control (13-14), DAZ (6)
  return saved;
#else
  return 0;
#endif
}

static inline void ieee_mode_leave(unsigned saved) {
#if defined(__SSE2__)
  _mm_setcsr(saved);
#else
  (void)saved;
#endif
}

// The int8 block exponent byte from the bits of the block's largest magnitude.
static inline uint32_t block_exponent(uint32_t largest) {
  if (largest >= 0x7f800000u) return 255;  // any element not finite
  if (largest == 0) return 0;
  const uint32_t e = (largest >> 23) + 1;
  return e < 253 ? e : 253;
}

// 2^(e - 127), NaN for a non-finite block (e = 255).
static inline float exponent_scale(uint32_t e) {
  return e == 255 ? bits_float(0x7fc00000u) : bits_float(e << 23);
}

// 2^(127 - e) (0 for e = 255, whose codes are 0 anyway).
static inline float exponent_inverse(uint32_t e) { return bits_float((e >= 254 ? 0u : 254u - e) << 23); }

// The block exponents of the vector kernels' scaled form (docs/compact_state.md, "Exactness of
// the kernels' scaled form"): there the block's scale is folded into the exponent field. The
// root's formulas stay normal down to 2^-15 of the scale, exp_avg's down to 2^-22 (the tail's
// floor halved).
static inline bool scaled_exponent(uint32_t e) { return e >= 16 && e <= 252; }
static inline bool scaled_exponent_e3m4t(uint32_t e) { return e >= 23 && e <= 252; }

// The root codes that square to a finite v: all but code 240 (2^64, v = 2^128 = infinity) of a
// block of exponent 191, whose roots lie in [2^63, 2^64) (v from 2^126 to the fp32 maximum): a v
// there saturates at code 239 ((31/16) 2^63, v = 3.19e38). Finite roots never reach a higher
// block (sqrt of the fp32 maximum is below 2^64).
constexpr uint32_t kRootOverflowExponent = 191;
static inline uint32_t root_code_limit(uint32_t e) { return e == kRootOverflowExponent ? 239 : 255; }
// The scaled form of the root's encode: its blocks but that one (the general form limits codes).
static inline bool scaled_root_encode(uint32_t e) { return scaled_exponent(e) && e != kRootOverflowExponent; }

// The bits of x * 2^(e - 127) minus those of x, mod 2^32 (x and the product normal).
static inline uint32_t scale_bits(uint32_t e) { return (e - 127u) << 23; }

// exp_avg's magnitude value of code c (< 128) in units of the block's scale.
static inline float e3m4t_value(uint32_t c) {
  if (c == 0) return 0.0f;
  return c < kE3M4TFirstNormal ? bits_float((c + kE3M4TTailBase) << 23)
                               : bits_float((c + kE3M4TNormalBase) << 19);
}

// exp_avg code: bit 7 the sign, bits 0..6 the E3M4T magnitude (value(127) = 1).
static inline float decode_e3m4t(uint32_t code, float scale) {
  return bits_float(float_bits(e3m4t_value(code & 127u) * scale) ^ ((code >> 7) << 31));
}

// exp_avg_sq code: the root's E4M4 magnitude (value(240) = 1).
static inline float decode_e4m4(uint32_t c, float scale) {
  const float value =
      c >= 16 ? bits_float((c + 1792u) << 19) : bits_float((c + 1808u) << 19) - bits_float(kTwoPowM14Bits);
  return value * scale;
}

// Where y = |x| * inverse falls among exp_avg's magnitude codes: code << 19 | the 19 dropped
// bits. The larger, as signed integers, of the E3M4 position bits(y) - 1905 << 19 (the larger
// from 2^-7 on) and the tail's (bits(t) >> 4) - 105 << 19 with t = max(y, (y + 2^-21) / 2) (the
// larger below): in the tail one code is a binade, whose 23 mantissa bits give the fraction's 19;
// below the floor, halving y + 2^-21 maps [0, 2^-21) linearly onto the binade under it, the
// position of code 0.
static inline uint32_t e3m4t_position(float x, float inverse) {
  const float y = bits_float(float_bits(x) & 0x7fffffffu) * inverse;
  const float half = (y + bits_float(kTwoPowM21Bits)) * 0.5f;
  const float t = half > y ? half : y;
  const int32_t normal = int32_t(float_bits(y) - (kE3M4TNormalBase << 19));
  const int32_t tail = int32_t((float_bits(t) >> 4) - (kE3M4TTailBase << 19));
  return uint32_t(normal > tail ? normal : tail);
}

// Where root * inverse falls among the root's E4M4 codes: code << 19 | fraction, the fraction
// the 19 dropped bits. From the subnormal end 2^-14 on, bits(y) - 1792 << 19; below,
// bits(y + 2^-14) (an fp32 add, in the binade above the end) - 1808 << 19.
static inline uint32_t root_position(float root, float inverse) {
  const float y = bits_float(float_bits(root) & 0x7fffffffu) * inverse;
  const float subnormal_end = bits_float(kTwoPowM14Bits);
  return y < subnormal_end ? float_bits(y + subnormal_end) - (1808u << 19) : float_bits(y) - (1792u << 19);
}

// Whether the root at position c << 19 | F rounds up so that v = root^2 comes back unbiased:
// with probability (x^2 - lo^2) / (hi^2 - lo^2) = f (2L + f) / (2L + 1) = f - f (1 - f) / (2L + 1),
// f = F / 2^19 the fraction and L = lo / (hi - lo): c below 16 (subnormal: codes c * 2^-18),
// else 16 + c % 16 (a normal binade's codes are (16 + m) / 16 of its power of two), i.e.
// min(c, 16 + c % 16). In 32-bit integers, r the 19 random bits: up iff
// (2L + 1) (F - r) > F (2^19 - F) / 2^19, the right side as F - ((F >> 3)^2 >> 13): at most 15
// above it, which lowers the probability by at most 15 / ((2L + 1) 2^19) (docs/compact_state.md).
static inline uint32_t root_rounds_up(uint32_t position, uint32_t r) {
  const uint32_t c = position >> 19;
  const int32_t fraction = int32_t(position & 0x7FFFFu);
  const int32_t odd = 2 * int32_t(c < 16 + (c & 15u) ? c : 16 + (c & 15u)) + 1;
  const uint32_t high = uint32_t(fraction) >> 3;
  const int32_t gap = fraction - int32_t((high * high) >> 13);
  return odd * (fraction - int32_t(r)) > gap ? 1u : 0u;
}

static inline uint32_t encode_e3m4t(float x, float inverse, uint32_t word) {
  const uint32_t c = (e3m4t_position(x, inverse) + (word & 0x7FFFFu)) >> 19;
  return (c < 127 ? c : 127) | ((float_bits(x) >> 31) << 7);
}

// The root's code, rounded so that v = root^2 is unbiased (root_rounds_up; r the word's top 19
// bits), at most `limit` (root_code_limit of the block). A root above zero never rounds to code
// 0 (docs/compact_state.md: a zero second moment under a nonzero first one would step by m / eps).
static inline uint32_t encode_e4m4(float root, float inverse, uint32_t word, uint32_t limit) {
  const uint32_t position = root_position(root, inverse);
  const uint32_t rounded = (position >> 19) + root_rounds_up(position, word >> 13);
  const uint32_t code = rounded < limit ? rounded : limit;
  return code == 0 && float_bits(root) != 0 ? 1 : code;
}

// bf16 with stochastic rounding: r (< 2^16) added below the kept 16 bits of |x|, the sum
// limited to the larger of |x|'s bits and 0x7f7fffff: a finite x saturates at the largest
// finite bf16 (0x7f7f, sign kept) instead of rounding to infinity, an infinity stays one;
// NaN -> 0x7fc0.
constexpr uint32_t kBF16SumLimit = 0x7f7fffffu;
static inline uint16_t encode_bf16(float x, uint32_t r) {
  const uint32_t u = float_bits(x);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7fc0;
  const uint32_t limit = magnitude > kBF16SumLimit ? magnitude : kBF16SumLimit;
  const uint32_t sum = magnitude + r < limit ? magnitude + r : limit;
  return uint16_t((sum | (u & 0x80000000u)) >> 16);
}

// ---- reductions, written once, compiled per instruction set by each variant ------------

// Sum of squares over [begin, end) with 16 double accumulators combined in a fixed order.
// Squares of fp32 values are exact in double, so the result does not depend on whether the
// compiler fuses multiply and add; it depends only on the range.
template <typename Load>
static inline double sum_squares_generic(Load load, size_t begin, size_t end) {
  double acc[16] = {0};
  size_t i = begin;
  for (; i + 16 <= end; i += 16)
    for (int j = 0; j < 16; ++j) {
      double x = load(i + j);
      acc[j] += x * x;
    }
  for (int j = 0; i < end; ++i, ++j) {
    double x = load(i);
    acc[j] += x * x;
  }
  // pairwise combine: fixed order
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

static inline double sum_squares_any(const void* data, int type, size_t begin, size_t end) {
  if (type == kF32) {
    const float* x = static_cast<const float*>(data);
    return sum_squares_generic([x](size_t i) { return double(x[i]); }, begin, end);
  }
  const uint16_t* h = static_cast<const uint16_t*>(data);
  if (type == kBF16)
    return sum_squares_generic([h](size_t i) { return double(bits_float(uint32_t(h[i]) << 16)); }, begin,
                               end);
  return sum_squares_generic([h](size_t i) { return double(f16_to_float(h[i])); }, begin, end);
}

template <typename Word>
static inline bool any_exponent_all_ones(const Word* x, Word exponent_mask, size_t begin, size_t end) {
  const size_t kBlock = 4096;
  for (size_t start = begin; start < end; start += kBlock) {
    size_t stop = start + kBlock < end ? start + kBlock : end;
    Word found = 0;
    for (size_t i = start; i < stop; ++i) found |= Word((x[i] & exponent_mask) == exponent_mask);
    if (found) return true;
  }
  return false;
}

static inline bool any_nonfinite_any(const void* data, int type, size_t begin, size_t end) {
  if (type == kF32)
    return any_exponent_all_ones(static_cast<const uint32_t*>(data), uint32_t(0x7f800000u), begin, end);
  const uint16_t mask = type == kBF16 ? 0x7f80 : 0x7c00;
  return any_exponent_all_ones(static_cast<const uint16_t*>(data), mask, begin, end);
}

}  // namespace offload_adam
