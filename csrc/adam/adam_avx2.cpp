// AVX2 variant (with FMA and F16C): 8 fp32 lanes. The tail (< 8 elements) is copied into
// zero-padded stack buffers owned by adam_partial and run through the same vector code, so it
// gets exactly the same instructions as the body.
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include "adam/adam_kernels.h"

namespace offload_adam {
namespace {

template <int GradType>
inline __m256 load_grad(const void* grad, size_t i) {
  if (GradType == kF32) return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
  if (GradType == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// Round to nearest even like c10::BFloat16, NaN -> 0x7fc0.
inline __m128i to_bf16(__m256 p) {
  __m256i u = _mm256_castps_si256(p);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

// AdamW on one vector, the operations of torch's single-tensor AdamW in its order: updates
// p, m, v and returns sqrt(v') (before bias correction). Compact: the compact steps' bias
// correction (a multiplication by bias_correction2_rsqrt instead of torch's division). BoundM:
// the int8 step's bound, the update's m limited in magnitude to m_bound * sqrt(v') (min keeps
// |m| where the limit is NaN: a NaN v', whose weight is NaN whatever m is).
template <bool Compact, bool BoundM = false>
inline __m256 adamw_math(const AdamArgs& a, __m256 g, __m256& p, __m256& m, __m256& v, bool lerp_small,
                         __m256 lerp_coeff) {
  if (a.apply_scale) g = _mm256_mul_ps(g, _mm256_set1_ps(a.grad_scale));
  if (a.l2_decay) g = _mm256_fmadd_ps(p, _mm256_set1_ps(a.weight_decay), g);
  if (a.decoupled_decay) p = _mm256_mul_ps(p, _mm256_set1_ps(a.decay_factor));
  // (a blend, not a branch: the compiler re-tested lerp_small in every iteration)
  const __m256 lerp_base = _mm256_blendv_ps(g, m, _mm256_castsi256_ps(_mm256_set1_epi32(-int(lerp_small))));
  m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m), lerp_base);
  v = _mm256_mul_ps(v, _mm256_set1_ps(a.beta2));
  // addcmul_: torch's build contracts self + (value * t1) * t2 into one fused multiply-add
  v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(a.one_minus_beta2), g), g, v);
  const __m256 sqrt_v = _mm256_sqrt_ps(v);
  __m256 root = sqrt_v;
  if (a.correct_bc2)
    root = Compact ? _mm256_mul_ps(root, _mm256_set1_ps(a.bias_correction2_rsqrt))
                   : _mm256_div_ps(root, _mm256_set1_ps(a.bias_correction2_sqrt));
  __m256 denom = _mm256_add_ps(root, _mm256_set1_ps(a.eps));
  __m256 m_step = m;
  if (BoundM) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
    const __m256 limit = _mm256_mul_ps(sqrt_v, _mm256_set1_ps(a.m_bound));
    m_step = _mm256_or_ps(_mm256_min_ps(limit, _mm256_andnot_ps(sign, m)), _mm256_and_ps(sign, m));
  }
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(a.neg_step_size), m_step), denom));
  return sqrt_v;
}

// One 8-element step on the given buffers: reads the sources (param_in, grad, exp_avg_in,
// exp_avg_sq_in), writes the destinations (param, exp_avg, exp_avg_sq, out16). The real
// arrays, or the tail's stack copies (each source then its own destination).
// Stream: param_out16 + i is 16-byte aligned and written with a non-temporal store.
// Traffic: the same loads and stores around trivial arithmetic (the benchmark's bandwidth
// limit of this access pattern), not an Adam step.
template <int GradType, int OutType, bool Traffic, bool Stream = false>
inline void adam_vector(const AdamArgs& a, const float* param_in, const void* grad, const float* exp_avg_in,
                        const float* exp_avg_sq_in, float* param, float* exp_avg, float* exp_avg_sq,
                        uint16_t* out16, size_t i, bool lerp_small, __m256 lerp_coeff) {
  __m256 g = load_grad<GradType>(grad, i);
  __m256 p = _mm256_loadu_ps(param_in + i);
  __m256 m = _mm256_loadu_ps(exp_avg_in + i);
  __m256 v = _mm256_loadu_ps(exp_avg_sq_in + i);
  if (Traffic) {
    p = _mm256_add_ps(p, g);
    m = _mm256_add_ps(m, g);
    v = _mm256_add_ps(v, g);
  } else {
    adamw_math<false>(a, g, p, m, v, lerp_small, lerp_coeff);
  }
  _mm256_storeu_ps(param + i, p);
  _mm256_storeu_ps(exp_avg + i, m);
  _mm256_storeu_ps(exp_avg_sq + i, v);
  if (OutType == kNone) return;
  const __m128i half =
      OutType == kBF16 ? to_bf16(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (Stream)
    _mm_stream_si128(reinterpret_cast<__m128i*>(out16 + i), half);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + i), half);
}

// Elements [i, i + rest), rest < 8: copied from the sources into zero-padded stack buffers
// owned by this call, run through the same vector code in place, copied out to the
// destinations.
template <int GradType, int OutType, bool Traffic>
inline void adam_partial(const AdamArgs& a, size_t i, size_t rest, bool lerp_small, __m256 lerp_coeff) {
  const size_t grad_bytes = GradType == kF32 ? 4 : 2;
  alignas(32) float param[8] = {0}, exp_avg[8] = {0}, exp_avg_sq[8] = {0};
  alignas(32) unsigned char grad[32] = {0};
  alignas(32) uint16_t out[8] = {0};
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  std::memcpy(param, a.param_in + i, rest * 4);
  std::memcpy(exp_avg, a.exp_avg_in + i, rest * 4);
  std::memcpy(exp_avg_sq, a.exp_avg_sq_in + i, rest * 4);
  std::memcpy(grad, static_cast<const unsigned char*>(a.grad) + i * grad_bytes, rest * grad_bytes);
  adam_vector<GradType, OutType, Traffic>(a, param, grad, exp_avg, exp_avg_sq, param, exp_avg, exp_avg_sq,
                                          out, 0, lerp_small, lerp_coeff);
  std::memcpy(a.param + i, param, rest * 4);
  std::memcpy(a.exp_avg + i, exp_avg, rest * 4);
  std::memcpy(a.exp_avg_sq + i, exp_avg_sq, rest * 4);
  if (OutType != kNone) std::memcpy(out16 + i, out, rest * 2);
}

// The streaming loop: elements up to the first 64-byte boundary of param_out16 go through
// the stack-buffer path, then full vectors with non-temporal stores of param_out16, then the
// tail; a store fence makes the streamed stores globally visible before the range returns.
template <int GradType, int OutType, bool Traffic>
void adam_stream(const AdamArgs& a, size_t begin, size_t end, bool lerp_small, __m256 lerp_coeff) {
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  size_t i = begin;
  {
    const uintptr_t address = reinterpret_cast<uintptr_t>(out16 + i);
    size_t head = min_size(end - i, ((64 - (address & 63)) & 63) / 2);
    for (; head > 0;) {
      const size_t k = min_size(head, 7);
      adam_partial<GradType, OutType, Traffic>(a, i, k, lerp_small, lerp_coeff);
      i += k;
      head -= k;
    }
  }
  for (; i + 8 <= end; i += 8)
    adam_vector<GradType, OutType, Traffic, true>(a, a.param_in, a.grad, a.exp_avg_in, a.exp_avg_sq_in,
                                                  a.param, a.exp_avg, a.exp_avg_sq, out16, i, lerp_small,
                                                  lerp_coeff);
  if (i < end) adam_partial<GradType, OutType, Traffic>(a, i, end - i, lerp_small, lerp_coeff);
  _mm_sfence();
}

template <int GradType, int OutType, bool Traffic>
void adam_range(const AdamArgs& args, size_t begin, size_t end) {
  // A local copy: with -fno-strict-aliasing every store could otherwise alias the caller's
  // AdamArgs and force its fields to be reloaded each iteration.
  const AdamArgs a = args;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const __m256 lerp_coeff = _mm256_set1_ps(lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f);
  // A param_out16 at an odd address cannot be aligned for streaming stores (a 16-bit tensor
  // from torch never is).
  if (OutType != kNone && a.stream && (reinterpret_cast<uintptr_t>(a.param_out16) & 1) == 0)
    return adam_stream<GradType, OutType, Traffic>(a, begin, end, lerp_small, lerp_coeff);
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  size_t i = begin;
  for (; i + 8 <= end; i += 8)
    adam_vector<GradType, OutType, Traffic>(a, a.param_in, a.grad, a.exp_avg_in, a.exp_avg_sq_in, a.param,
                                            a.exp_avg, a.exp_avg_sq, out16, i, lerp_small, lerp_coeff);
  if (i < end) adam_partial<GradType, OutType, Traffic>(a, i, end - i, lerp_small, lerp_coeff);
}

// ---- compact moments (docs/compact_state.md) --------------------------------------------

// MurmurHash3's finalizer on 8 lanes (fmix32 in adam_kernels.h).
inline __m256i fmix32_vector(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// The random words of elements first .. first + 7 (first = position + index, mod 2^32).
inline __m256i random_words(uint32_t key, uint32_t first) {
  const __m256i position =
      _mm256_add_epi32(_mm256_set1_epi32(int(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return fmix32_vector(_mm256_xor_si256(position, _mm256_set1_epi32(int(key))));
}

inline __m256 load_bf16(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// bf16 with stochastic rounding: r (< 2^16) added below the kept bits, a finite x saturating
// at the largest finite bf16 (encode_bf16 in adam_kernels.h); NaN -> 0x7fc0.
inline __m128i encode_bf16_vector(__m256 x, __m256i r) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i limit = _mm256_max_epu32(magnitude, _mm256_set1_epi32(int(kBF16SumLimit)));
  const __m256i sum = _mm256_min_epu32(_mm256_add_epi32(magnitude, r), limit);
  __m256i h = _mm256_srli_epi32(_mm256_or_si256(sum, _mm256_andnot_si256(magnitude, u)), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// 8 codes (bytes) widened to 32-bit lanes: zero-extended (E4M4), sign-extended (E3M4: the
// sign bit, bit 7, then fills bits 7..31).
inline __m256i load_codes(const uint8_t* src) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
}

inline __m256i load_signed_codes(const uint8_t* src) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
}

// The int8 formats' arithmetic as docs/compact_state.md writes it, 8 lanes at a time, on normal
// fp32 numbers only: each range's formula is computed and a min, max or compare picks one per
// lane. (Going through fp32 subnormals instead, one multiplication fewer, cost microcode
// assists: 2.2x slower on Gaussian gradients, whose first moments have some lanes far below
// their block's largest in most vectors.)
//
// Two forms of each, equal bit for bit where both apply:
// - general (any block exponent e): values in units of the block's scale 2^(e - 127), then
//   multiplied by it (decode) or by its inverse (encode), as the doc writes them;
// - scaled (the blocks of every ordinary moment: scaled_exponent, scaled_exponent_e3m4t): the
//   scale folded into the exponent field. Multiplying a normal fp32 number by 2^k adds k << 23
//   to its bits when the product is normal, and in this range every value the formulas form is
//   (docs/compact_state.md, "Exactness of the kernels' scaled form"). Saves the multiplications,
//   the base subtractions and, for a block of E4M4 codes or roots with no lane in the subnormal
//   range (nearly every block of a second moment: the range is below 2^-14 of the block's
//   largest root), the subnormal formula.
//
// The root's subnormal formulas reuse the normal ones: float((c + 1808) << 19) is
// 2 * float((c + 1792) << 19) (one more in the exponent field), and a code of y + end's bits
// with 1808 subtracted is the code of (y + end) / 2 with 1792.

// value(c) of root codes c (< 256, in 32-bit lanes): float((c + 1792) << 19) from code 16 on,
// float((c + 1808) << 19) - 2^-14 below; times the block's scale.
inline __m256 decode_root_vector(__m256i c, __m256 scale) {
  const __m256i normal = _mm256_cmpgt_epi32(c, _mm256_set1_epi32(15));
  const __m256 normal_value =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(1792)), 19));
  const __m256 subnormal_value =
      _mm256_sub_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(1808)), 19)),
                    _mm256_castsi256_ps(_mm256_set1_epi32(int(kTwoPowM14Bits))));
  return _mm256_mul_ps(_mm256_blendv_ps(subnormal_value, normal_value, _mm256_castsi256_ps(normal)), scale);
}

// exp_avg magnitudes of codes c (< 128, in 32-bit lanes): the smaller of the E3M4 value
// float((c + normal_base) << 19) and the tail's float(min(c + tail_base, 254) << 23), zero for
// code 0. The tail's value doubles per code and equals the E3M4 one at code 15, so it is the
// smaller below 15 and the larger from there (254: 2^127, above every value of a block). In
// units of the scale: bases 1905 and 105; scaled form: 1905 + 16 (e - 127) and 105 + e - 127.
inline __m256 decode_e3m4t_magnitude(__m256i c, __m256i normal_base, __m256i tail_base) {
  const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(c, normal_base), 19));
  const __m256i tail_exponent = _mm256_min_epu32(_mm256_add_epi32(c, tail_base), _mm256_set1_epi32(254));
  const __m256 tail = _mm256_castsi256_ps(_mm256_slli_epi32(tail_exponent, 23));
  const __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, _mm256_setzero_si256()));
  return _mm256_andnot_ps(zero, _mm256_min_ps(normal, tail));
}

// exp_avg: bit 7 of the (sign-extended) code is the sign, applied to the magnitude's value.
inline __m256 with_code_sign(__m256 magnitude, __m256i code) {
  const __m256i sign = _mm256_and_si256(code, _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(magnitude), sign));
}

// The 32 exp_avg values of a block (codes at src, exponent byte e) into dst.
inline void decode_e3m4t_block(const uint8_t* src, uint32_t e, float* dst) {
  const __m256i magnitude = _mm256_set1_epi32(127);
  if (scaled_exponent_e3m4t(e)) {
    const __m256i normal_base = _mm256_set1_epi32(int(kE3M4TNormalBase + 16u * (e - 127u)));
    const __m256i tail_base = _mm256_set1_epi32(int(kE3M4TTailBase + e - 127u));
    for (size_t k = 0; k < 4; ++k) {
      const __m256i code = load_signed_codes(src + 8 * k);
      const __m256 value = decode_e3m4t_magnitude(_mm256_and_si256(code, magnitude), normal_base, tail_base);
      _mm256_store_ps(dst + 8 * k, with_code_sign(value, code));
    }
    return;
  }
  const __m256 scale = _mm256_set1_ps(exponent_scale(e));
  const __m256i normal_base = _mm256_set1_epi32(int(kE3M4TNormalBase));
  const __m256i tail_base = _mm256_set1_epi32(int(kE3M4TTailBase));
  for (size_t k = 0; k < 4; ++k) {
    const __m256i code = load_signed_codes(src + 8 * k);
    const __m256 value = _mm256_mul_ps(
        decode_e3m4t_magnitude(_mm256_and_si256(code, magnitude), normal_base, tail_base), scale);
    _mm256_store_ps(dst + 8 * k, with_code_sign(value, code));
  }
}

// The 32 stored roots of a block of exp_avg_sq codes into dst. Scaled and no code below 16:
// only the normal formula.
inline void decode_e4m4_block(const uint8_t* src, uint32_t e, float* dst) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i sixteen = _mm256_set1_epi8(16);
  const bool all_normal =
      _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(codes, sixteen), codes)) == -1;
  if (scaled_exponent(e) && all_normal) {
    const __m256i base = _mm256_set1_epi32(int(1792u + 16u * (e - 127u)));
    for (size_t k = 0; k < 4; ++k)
      _mm256_store_ps(dst + 8 * k, _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_add_epi32(load_codes(src + 8 * k), base), 19)));
    return;
  }
  const __m256 scale = _mm256_set1_ps(exponent_scale(e));
  for (size_t k = 0; k < 4; ++k)
    _mm256_store_ps(dst + 8 * k, decode_root_vector(load_codes(src + 8 * k), scale));
}

// Where y = root * inverse falls among the root's codes, code << 19 | the dropped bits
// (root_position in adam_kernels.h): bits(y) - 1792 << 19 from 2^-14 on, bits((y + 2^-14) / 2)
// - 1792 << 19 below (y + 2^-14 an fp32 add).
inline __m256i root_position_vector(__m256 root, __m256 inverse) {
  const __m256 end = _mm256_castsi256_ps(_mm256_set1_epi32(int(kTwoPowM14Bits)));
  const __m256 y = _mm256_mul_ps(root, inverse);
  const __m256 small = _mm256_cmp_ps(y, end, _CMP_LT_OQ);
  const __m256 t = _mm256_blendv_ps(y, _mm256_mul_ps(_mm256_add_ps(y, end), _mm256_set1_ps(0.5f)), small);
  return _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(int(1792u << 19)));
}

// exp_avg's magnitude codes of |x| (magnitude, x finite), not yet limited to the largest code:
// (the larger, as signed integers, of the E3M4 position bits(a) + normal_offset and the tail's
// (bits(max(a, (a + floor) / 2)) >> 4) + tail_offset, plus r) >> 19 (e3m4t_position in
// adam_kernels.h). General form: a = y = |x| * inverse, floor 2^-21, offsets -1905 << 19 and
// -105 << 19; scaled form: a = |x|, floor 2^-21 * scale, offsets bits(inverse) - bits(1) -
// 1905 << 19 and (127 - e) << 19 - 105 << 19 (the exponent's shift, as 19-bit units).
inline __m256i encode_e3m4t_magnitude(__m256 a, __m256 floor, __m256i normal_offset, __m256i tail_offset,
                                      __m256i r) {
  const __m256 t = _mm256_max_ps(a, _mm256_mul_ps(_mm256_add_ps(a, floor), _mm256_set1_ps(0.5f)));
  const __m256i normal = _mm256_add_epi32(_mm256_castps_si256(a), normal_offset);
  const __m256i tail = _mm256_add_epi32(_mm256_srli_epi32(_mm256_castps_si256(t), 4), tail_offset);
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_max_epi32(normal, tail), r), 19);
}

// Roots' codes at positions code << 19 | F rounded so that v = root^2 is unbiased, not yet
// limited to the largest code (root_rounds_up in adam_kernels.h). AllNormal: every code is at
// least 16, so 2L + 1 = 33 + 2 (code % 16), taken straight from the position's bits.
template <bool AllNormal>
inline __m256i encode_roots_unbiased_square(__m256i position, __m256i r) {
  const __m256i code = _mm256_srli_epi32(position, 19);
  const __m256i fraction = _mm256_and_si256(position, _mm256_set1_epi32(0x7FFFF));
  __m256i odd;  // 2L + 1
  if (AllNormal) {
    odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(position, 18), _mm256_set1_epi32(30)),
                          _mm256_set1_epi32(33));
  } else {
    const __m256i l = _mm256_min_epu32(
        code, _mm256_add_epi32(_mm256_and_si256(code, _mm256_set1_epi32(15)), _mm256_set1_epi32(16)));
    odd = _mm256_or_si256(_mm256_slli_epi32(l, 1), _mm256_set1_epi32(1));
  }
  const __m256i high = _mm256_srli_epi32(fraction, 3);
  const __m256i gap = _mm256_sub_epi32(fraction, _mm256_srli_epi32(_mm256_mullo_epi32(high, high), 13));
  const __m256i up = _mm256_cmpgt_epi32(_mm256_mullo_epi32(odd, _mm256_sub_epi32(fraction, r)), gap);
  return _mm256_sub_epi32(code, up);  // up: all ones (-1) where the root rounds up
}

// The random words of 32 elements from `first`: fmix32(key ^ position), 8 lanes at a time.
inline void block_random_words(uint32_t key, uint32_t first, __m256i (&words)[4]) {
  __m256i position =
      _mm256_add_epi32(_mm256_set1_epi32(int(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (size_t k = 0; k < 4; ++k) {
    words[k] = fmix32_vector(_mm256_xor_si256(position, _mm256_set1_epi32(int(key))));
    position = _mm256_add_epi32(position, _mm256_set1_epi32(8));
  }
}

// 32 codes in 32-bit lanes (4 vectors, each < 256) packed to 32 bytes in element order; with
// signs, bit 7 of each byte is set where the corresponding value of x is negative (its sign
// bit: -0 and negative NaNs count).
inline __m256i pack_codes(const __m256i (&c)[4]) {
  return _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
}

inline void store_packed(uint8_t* dst, __m256i packed) {
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
}

inline void store_codes_with_signs(uint8_t* dst, const __m256i (&c)[4], const float* x) {
  const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 8));
  const __m256i x2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256i x3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 24));
  // signed saturation keeps each value's sign through both packs
  const __m256i signs = _mm256_packs_epi16(_mm256_packs_epi32(x0, x1), _mm256_packs_epi32(x2, x3));
  store_packed(dst, _mm256_or_si256(pack_codes(c), _mm256_and_si256(signs, _mm256_set1_epi8(char(0x80)))));
}

// The codes of a block of first moments x (32 at x) with exponent byte e into dst.
inline void encode_e3m4t_block(const float* x, uint32_t e, const __m256i (&words)[4], uint8_t* dst) {
  if (e == 255) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_setzero_si256());
    return;
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i low_bits = _mm256_set1_epi32(0x7FFFF);
  __m256i codes[4];
  if (scaled_exponent_e3m4t(e)) {
    const __m256 floor = _mm256_castsi256_ps(_mm256_set1_epi32(int(kTwoPowM21Bits + scale_bits(e))));
    const __m256i normal_offset = _mm256_set1_epi32(int(scale_bits(254u - e) - (kE3M4TNormalBase << 19)));
    const __m256i tail_offset = _mm256_set1_epi32(int(((127u - e) << 19) - (kE3M4TTailBase << 19)));
    for (size_t k = 0; k < 4; ++k)
      codes[k] = encode_e3m4t_magnitude(_mm256_and_ps(_mm256_load_ps(x + 8 * k), abs_mask), floor,
                                        normal_offset, tail_offset, _mm256_and_si256(words[k], low_bits));
  } else {
    // Up to 127 (y <= 1) unless the exponent is 253, where y reaches 4: limited to 127.
    const __m256 inverse = _mm256_set1_ps(exponent_inverse(e));
    const __m256 floor = _mm256_castsi256_ps(_mm256_set1_epi32(int(kTwoPowM21Bits)));
    const __m256i normal_offset = _mm256_set1_epi32(-int(kE3M4TNormalBase << 19));
    const __m256i tail_offset = _mm256_set1_epi32(-int(kE3M4TTailBase << 19));
    for (size_t k = 0; k < 4; ++k) {
      const __m256 y = _mm256_mul_ps(_mm256_and_ps(_mm256_load_ps(x + 8 * k), abs_mask), inverse);
      codes[k] = _mm256_min_epi32(
          encode_e3m4t_magnitude(y, floor, normal_offset, tail_offset, _mm256_and_si256(words[k], low_bits)),
          _mm256_set1_epi32(127));
    }
  }
  store_codes_with_signs(dst, codes, x);
}

// The codes of a block of roots (32 at root, each >= +0: sqrt of a v that is never -0; NaN only
// in a non-finite block, whose codes are 0) with exponent byte e into dst. Up to 240 unless the
// exponent is 253, limited to root_code_limit(e) (255, or 239 where code 240 would square to
// infinity). A root above zero takes at least code 1 (its bits, a positive int, limited to 1,
// as a floor); in the scaled form with no root below the subnormal end every code is at least
// 16 and at most 240.
inline void encode_e4m4_block(const float* root, uint32_t e, const __m256i (&words)[4], uint8_t* dst) {
  if (e == 255) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_setzero_si256());
    return;
  }
  __m256i codes[4];
  __m256i bits[4];
  for (size_t k = 0; k < 4; ++k) bits[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(root + 8 * k));
  if (scaled_root_encode(e)) {
    // roots are >= +0: their bits order like their values
    const __m256i smallest =
        _mm256_min_epu32(_mm256_min_epu32(bits[0], bits[1]), _mm256_min_epu32(bits[2], bits[3]));
    const __m256i end = _mm256_set1_epi32(int(kTwoPowM14Bits + scale_bits(e)));
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(smallest, end), smallest)) == -1) {
      const __m256i offset = _mm256_set1_epi32(int(scale_bits(254u - e) - (1792u << 19)));
      for (size_t k = 0; k < 4; ++k)
        codes[k] = encode_roots_unbiased_square<true>(_mm256_add_epi32(bits[k], offset),
                                                      _mm256_srli_epi32(words[k], 13));
      store_packed(dst, pack_codes(codes));
      return;
    }
  }
  const __m256 inverse = _mm256_set1_ps(exponent_inverse(e));
  for (size_t k = 0; k < 4; ++k) {
    const __m256i c = encode_roots_unbiased_square<false>(
        root_position_vector(_mm256_castsi256_ps(bits[k]), inverse), _mm256_srli_epi32(words[k], 13));
    codes[k] = _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(int(root_code_limit(e)))),
                                _mm256_min_epi32(bits[k], _mm256_set1_epi32(1)));
  }
  store_packed(dst, pack_codes(codes));
}

template <int OutType>
inline void store_out16(uint16_t* out16, __m256 p) {
  if (OutType == kNone) return;
  const __m128i half =
      OutType == kBF16 ? to_bf16(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out16), half);
}

// The buffers of one compact vector or block: the real arrays at an element offset, or the
// partial tail's zero-padded stack copies (each source then its own destination).
struct CompactBuffers {
  const float* param_in;
  const void* grad;
  const void* m_in;  // uint16 (bf16) or uint8 codes (int8)
  const void* v_in;
  float* param;
  void* m_out;
  void* v_out;
  uint16_t* out16;
};

// 8 elements with bf16 moments at offset i of the buffers; `first` is element i's position.
template <int GradType, int OutType, bool Traffic>
inline void bf16_vector(const CompactArgs& c, const CompactBuffers& b, size_t i, uint32_t first,
                        bool lerp_small, __m256 lerp_coeff) {
  const uint16_t* m_in = static_cast<const uint16_t*>(b.m_in) + i;
  const uint16_t* v_in = static_cast<const uint16_t*>(b.v_in) + i;
  __m128i* m_out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.m_out) + i);
  __m128i* v_out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.v_out) + i);
  __m256 g = load_grad<GradType>(b.grad, i);
  __m256 p = _mm256_loadu_ps(b.param_in + i);
  if (Traffic) {
    p = _mm256_add_ps(p, g);
    const __m128i one = _mm_set1_epi16(1);
    _mm_storeu_si128(m_out, _mm_add_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_in)), one));
    _mm_storeu_si128(v_out, _mm_add_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v_in)), one));
  } else {
    __m256 m = load_bf16(m_in);
    __m256 v = load_bf16(v_in);
    adamw_math<true>(c.step, g, p, m, v, lerp_small, lerp_coeff);
    const __m256i word = random_words(c.key, first);
    _mm_storeu_si128(m_out, encode_bf16_vector(m, _mm256_and_si256(word, _mm256_set1_epi32(0xFFFF))));
    _mm_storeu_si128(v_out, encode_bf16_vector(v, _mm256_srli_epi32(word, 16)));
  }
  _mm256_storeu_ps(b.param + i, p);
  store_out16<OutType>(b.out16 + i, p);
}

// Elements [i, i + rest), rest < 8, through zero-padded stack copies.
template <int GradType, int OutType, bool Traffic>
inline void bf16_partial(const CompactArgs& c, size_t i, size_t rest, bool lerp_small, __m256 lerp_coeff) {
  const AdamArgs& a = c.step;
  const size_t grad_bytes = GradType == kF32 ? 4 : 2;
  alignas(32) float param[8] = {0};
  alignas(32) unsigned char grad[32] = {0};
  alignas(32) uint16_t m[8] = {0}, v[8] = {0}, out[8] = {0};
  std::memcpy(param, a.param_in + i, rest * 4);
  std::memcpy(grad, static_cast<const unsigned char*>(a.grad) + i * grad_bytes, rest * grad_bytes);
  std::memcpy(m, static_cast<const uint16_t*>(c.exp_avg_in) + i, rest * 2);
  std::memcpy(v, static_cast<const uint16_t*>(c.exp_avg_sq_in) + i, rest * 2);
  const CompactBuffers stack{param, grad, m, v, param, m, v, out};
  bf16_vector<GradType, OutType, Traffic>(c, stack, 0, uint32_t(c.position + i), lerp_small, lerp_coeff);
  std::memcpy(a.param + i, param, rest * 4);
  std::memcpy(static_cast<uint16_t*>(c.exp_avg) + i, m, rest * 2);
  std::memcpy(static_cast<uint16_t*>(c.exp_avg_sq) + i, v, rest * 2);
  if (OutType != kNone) std::memcpy(static_cast<uint16_t*>(a.param_out16) + i, out, rest * 2);
}

template <int GradType, int OutType, bool Traffic>
void bf16_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m256 lerp_coeff = _mm256_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  const CompactBuffers arrays{
      c.step.param_in, c.step.grad, c.exp_avg_in, c.exp_avg_sq_in,
      c.step.param,    c.exp_avg,   c.exp_avg_sq, static_cast<uint16_t*>(c.step.param_out16)};
  size_t i = begin;
  for (; i + 8 <= end; i += 8)
    bf16_vector<GradType, OutType, Traffic>(c, arrays, i, uint32_t(c.position + i), lerp_small, lerp_coeff);
  if (i < end) bf16_partial<GradType, OutType, Traffic>(c, i, end - i, lerp_small, lerp_coeff);
}

// The largest lane of a (in *largest_a) and of b (in *largest_b), unsigned: both reduced by
// the same shuffles.
inline void horizontal_max_pair(__m256i a, __m256i b, uint32_t* largest_a, uint32_t* largest_b) {
  // lanes 0..3: a's halves, 4..7: b's halves, combined
  __m256i h = _mm256_max_epu32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
  h = _mm256_max_epu32(h, _mm256_shuffle_epi32(h, 0x4E));
  h = _mm256_max_epu32(h, _mm256_shuffle_epi32(h, 0xB1));
  *largest_a = uint32_t(_mm256_cvtsi256_si32(h));
  *largest_b = uint32_t(_mm_cvtsi128_si32(_mm256_extracti128_si256(h, 1)));
}

// Blocks processed together by int8_group.
constexpr size_t kGroupBlocks = 8;

// `blocks` (<= kGroupBlocks) blocks of 32 elements with int8 moments at offset i of the
// buffers (`first` the position of element i; the exponents of the first block at the given
// pointers), in three passes over two stack arrays: decode every block (ms: m, roots: the
// stored roots), step every vector there (the new weights stored; m' and sqrt(v') replace the
// decoded values, with each block's largest magnitudes), then encode block by block. The
// encoding does not wait on the long square-root and division chains of its own block (a
// one-pass block would), and every code and exponent of the group is read before any is
// written (in place).
template <int GradType, int OutType, bool Traffic>
__attribute__((always_inline)) inline void int8_group(const CompactArgs& c, const CompactBuffers& b, size_t i,
                                                      uint32_t first, const uint8_t* m_exponents_in,
                                                      const uint8_t* v_exponents_in, uint8_t* m_exponents,
                                                      uint8_t* v_exponents, size_t blocks, bool lerp_small,
                                                      __m256 lerp_coeff) {
  const uint8_t* m_in = static_cast<const uint8_t*>(b.m_in) + i;
  const uint8_t* v_in = static_cast<const uint8_t*>(b.v_in) + i;
  uint8_t* m_out = static_cast<uint8_t*>(b.m_out) + i;
  uint8_t* v_out = static_cast<uint8_t*>(b.v_out) + i;
  if (Traffic) {
    for (size_t k = 0; k < 4 * blocks; ++k) {
      const __m256 p =
          _mm256_add_ps(_mm256_loadu_ps(b.param_in + i + 8 * k), load_grad<GradType>(b.grad, i + 8 * k));
      _mm256_storeu_ps(b.param + i + 8 * k, p);
      store_out16<OutType>(b.out16 + i + 8 * k, p);
    }
    const __m256i one = _mm256_set1_epi8(1);
    for (size_t blk = 0; blk < blocks; ++blk) {
      const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m_in + 32 * blk));
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_in + 32 * blk));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_out + 32 * blk), _mm256_add_epi8(m, one));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_out + 32 * blk), _mm256_add_epi8(v, one));
      m_exponents[blk] = uint8_t(m_exponents_in[blk] + 1);
      v_exponents[blk] = uint8_t(v_exponents_in[blk] + 1);
    }
    return;
  }
  // Each block's old moments decoded into ms and roots, stepped there, then encoded.
  alignas(32) float ms[kGroupBlocks * kInt8Block], roots[kGroupBlocks * kInt8Block];
  uint32_t m_largest[kGroupBlocks], root_largest[kGroupBlocks];
  for (size_t blk = 0; blk < blocks; ++blk) {
    decode_e3m4t_block(m_in + kInt8Block * blk, m_exponents_in[blk], ms + kInt8Block * blk);
    decode_e4m4_block(v_in + kInt8Block * blk, v_exponents_in[blk], roots + kInt8Block * blk);
  }
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  for (size_t blk = 0; blk < blocks; ++blk) {
    __m256i m_max = _mm256_setzero_si256(), root_max = _mm256_setzero_si256();
    for (size_t k = 0; k < 4; ++k) {
      const size_t e = kInt8Block * blk + 8 * k;  // element within the group
      __m256 g = load_grad<GradType>(b.grad, i + e);
      __m256 p = _mm256_loadu_ps(b.param_in + i + e);
      __m256 m = _mm256_load_ps(ms + e);
      const __m256 stored_root = _mm256_load_ps(roots + e);
      __m256 v = _mm256_mul_ps(stored_root, stored_root);
      const __m256 root = adamw_math<true, true>(c.step, g, p, m, v, lerp_small, lerp_coeff);
      _mm256_storeu_ps(b.param + i + e, p);
      store_out16<OutType>(b.out16 + i + e, p);
      _mm256_store_ps(ms + e, m);
      _mm256_store_ps(roots + e, root);
      m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
      root_max = _mm256_max_epu32(root_max, _mm256_castps_si256(root));  // a root is never negative
    }
    horizontal_max_pair(m_max, root_max, &m_largest[blk], &root_largest[blk]);
  }
  for (size_t blk = 0; blk < blocks; ++blk) {
    const uint32_t m_e = block_exponent(m_largest[blk]);
    const uint32_t v_e = block_exponent(root_largest[blk]);
    __m256i words[4];
    block_random_words(c.key, first + uint32_t(kInt8Block * blk), words);
    encode_e3m4t_block(ms + kInt8Block * blk, m_e, words, m_out + kInt8Block * blk);
    encode_e4m4_block(roots + kInt8Block * blk, v_e, words, v_out + kInt8Block * blk);
    m_exponents[blk] = uint8_t(m_e);
    v_exponents[blk] = uint8_t(v_e);
  }
}

// The call's last block when it has fewer than 32 elements: zero-padded stack copies (zeros
// step to zero moments, so the padding leaves the block's largest magnitudes alone).
template <int GradType, int OutType, bool Traffic>
inline void int8_partial(const CompactArgs& c, size_t i, size_t rest, bool lerp_small, __m256 lerp_coeff) {
  const AdamArgs& a = c.step;
  const size_t grad_bytes = GradType == kF32 ? 4 : 2;
  const size_t block = i / kInt8Block;
  alignas(32) float param[32] = {0};
  alignas(32) unsigned char grad[128] = {0};
  alignas(32) uint8_t m[32] = {0}, v[32] = {0};
  alignas(32) uint16_t out[32] = {0};
  std::memcpy(param, a.param_in + i, rest * 4);
  std::memcpy(grad, static_cast<const unsigned char*>(a.grad) + i * grad_bytes, rest * grad_bytes);
  std::memcpy(m, static_cast<const uint8_t*>(c.exp_avg_in) + i, rest);
  std::memcpy(v, static_cast<const uint8_t*>(c.exp_avg_sq_in) + i, rest);
  const CompactBuffers stack{param, grad, m, v, param, m, v, out};
  int8_group<GradType, OutType, Traffic>(c, stack, 0, uint32_t(c.position + i),
                                         c.exp_avg_exponents_in + block, c.exp_avg_sq_exponents_in + block,
                                         c.exp_avg_exponents + block, c.exp_avg_sq_exponents + block, 1,
                                         lerp_small, lerp_coeff);
  std::memcpy(a.param + i, param, rest * 4);
  std::memcpy(static_cast<uint8_t*>(c.exp_avg) + i, m, rest);
  std::memcpy(static_cast<uint8_t*>(c.exp_avg_sq) + i, v, rest);
  if (OutType != kNone) std::memcpy(static_cast<uint16_t*>(a.param_out16) + i, out, rest * 2);
}

template <int GradType, int OutType, bool Traffic>
void int8_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m256 lerp_coeff = _mm256_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  const CompactBuffers arrays{
      c.step.param_in, c.step.grad, c.exp_avg_in, c.exp_avg_sq_in,
      c.step.param,    c.exp_avg,   c.exp_avg_sq, static_cast<uint16_t*>(c.step.param_out16)};
  size_t i = begin;
  while (i + kInt8Block <= end) {
    const size_t block = i / kInt8Block;
    const size_t blocks = min_size(kGroupBlocks, (end - i) / kInt8Block);
    prefetch_int8_ahead(c, i, end, kGroupBlocks * kInt8Block, GradType == kF32 ? 4 : 2);
    int8_group<GradType, OutType, Traffic>(c, arrays, i, uint32_t(c.position + i),
                                           c.exp_avg_exponents_in + block, c.exp_avg_sq_exponents_in + block,
                                           c.exp_avg_exponents + block, c.exp_avg_sq_exponents + block,
                                           blocks, lerp_small, lerp_coeff);
    i += blocks * kInt8Block;
  }
  if (i < end) int8_partial<GradType, OutType, Traffic>(c, i, end - i, lerp_small, lerp_coeff);
}

template <int Moment, int GradType, int OutType, bool Traffic>
void compact_range(const CompactArgs& c, size_t begin, size_t end) {
  const unsigned mode = ieee_mode_enter();
  if constexpr (Moment == kMomentInt8)
    int8_range<GradType, OutType, Traffic>(c, begin, end);
  else
    bf16_range<GradType, OutType, Traffic>(c, begin, end);
  ieee_mode_leave(mode);
}

#include "adam/isa_dispatch.inc"

}  // namespace

const IsaKernels& avx2_kernels() {
  static const IsaKernels table{"avx2",        adam,         traffic,        sum_squares,
                                any_nonfinite, adam_compact, compact_traffic};
  return table;
}

}  // namespace offload_adam
