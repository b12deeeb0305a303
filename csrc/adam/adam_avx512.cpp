// AVX-512 variant (F, BW, VL, DQ): 16 fp32 lanes, masked loads/stores for the tail so the
// tail goes through exactly the same instructions as the body.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns about the deliberately undefined registers inside its own avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "adam/adam_kernels.h"

namespace offload_adam {
namespace {

// 16 bf16 values as fp32: each word moved to the high half of its lane, the low half zeroed, by
// one word permutation (not a widening and a shift).
inline __m512 widen_bf16(__m256i h) {
  const __m512i into_high_halves = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7,
                                                    0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return _mm512_castsi512_ps(
      _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, into_high_halves, _mm512_castsi256_si512(h)));
}

// The bf16 of x from `rounded` (x's bits with the rounding already added below the kept 16):
// each lane's high half, as 16 words, by one word permutation; NaN -> 0x7fc0.
inline __m256i bf16_high_halves(__m512 x, __m512i rounded) {
  const __m512i high_words = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31,
                                              29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  rounded =
      _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_words, rounded));
}

template <int GradType>
inline __m512 load_grad(const void* grad, size_t i, __mmask16 mask) {
  if (GradType == kF32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
  if (GradType == kBF16) return widen_bf16(h);
  return _mm512_cvtph_ps(h);
}

// Round to nearest even like c10::BFloat16, NaN -> 0x7fc0: bits + 0x7fff, plus 1 where bit 16
// (the kept part's last bit) is set.
inline __m256i to_bf16(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  __m512i rounded = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
  rounded = _mm512_mask_add_epi32(rounded, _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000)), rounded,
                                  _mm512_set1_epi32(1));
  return bf16_high_halves(p, rounded);
}

// AdamW on one vector, the operations of torch's single-tensor AdamW in its order: updates
// p, m, v and returns sqrt(v') (before bias correction). Compact: the compact steps' bias
// correction (a multiplication by bias_correction2_rsqrt instead of torch's division). BoundM:
// the int8 step's bound (see adam_avx2.cpp).
template <bool Compact, bool BoundM = false>
inline __m512 adamw_math(const AdamArgs& a, __m512 g, __m512& p, __m512& m, __m512& v, bool lerp_small,
                         __m512 lerp_coeff) {
  if (a.apply_scale) g = _mm512_mul_ps(g, _mm512_set1_ps(a.grad_scale));
  if (a.l2_decay) g = _mm512_fmadd_ps(p, _mm512_set1_ps(a.weight_decay), g);
  if (a.decoupled_decay) p = _mm512_mul_ps(p, _mm512_set1_ps(a.decay_factor));
  m = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, m), lerp_small ? m : g);
  v = _mm512_mul_ps(v, _mm512_set1_ps(a.beta2));
  // addcmul_: torch's build contracts self + (value * t1) * t2 into one fused multiply-add
  v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(a.one_minus_beta2), g), g, v);
  const __m512 sqrt_v = _mm512_sqrt_ps(v);
  __m512 root = sqrt_v;
  if (a.correct_bc2)
    root = Compact ? _mm512_mul_ps(root, _mm512_set1_ps(a.bias_correction2_rsqrt))
                   : _mm512_div_ps(root, _mm512_set1_ps(a.bias_correction2_sqrt));
  __m512 denom = _mm512_add_ps(root, _mm512_set1_ps(a.eps));
  __m512 m_step = m;
  if (BoundM) {
    // VRANGEPS, imm 0b0010: of m and the limit the one of smaller magnitude, with m's sign (a
    // limit >= +0 or NaN: a NaN limit gives NaN, as does the step it comes with: a NaN v')
    m_step = _mm512_range_ps(m, _mm512_mul_ps(sqrt_v, _mm512_set1_ps(a.m_bound)), 0x2);
  }
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(a.neg_step_size), m_step), denom));
  return sqrt_v;
}

// Reads the sources (param_in, grad, exp_avg_in, exp_avg_sq_in) and writes the destinations
// (param, exp_avg, exp_avg_sq, param_out16), elements i + lane for the lanes set in mask.
// Stream: a full, unmasked vector whose param_out16 destination is 32-byte aligned, written
// with a non-temporal store. Traffic: the same loads and stores around trivial arithmetic (the
// benchmark's bandwidth limit of this access pattern), not an Adam step.
template <int GradType, int OutType, bool Traffic, bool Stream = false>
inline void adam_vector(const AdamArgs& a, size_t i, __mmask16 mask, bool lerp_small, __m512 lerp_coeff) {
  __m512 g = load_grad<GradType>(a.grad, i, mask);
  __m512 p = _mm512_maskz_loadu_ps(mask, a.param_in + i);
  __m512 m = _mm512_maskz_loadu_ps(mask, a.exp_avg_in + i);
  __m512 v = _mm512_maskz_loadu_ps(mask, a.exp_avg_sq_in + i);
  if (Traffic) {
    p = _mm512_add_ps(p, g);
    m = _mm512_add_ps(m, g);
    v = _mm512_add_ps(v, g);
  } else {
    adamw_math<false>(a, g, p, m, v, lerp_small, lerp_coeff);
  }
  _mm512_mask_storeu_ps(a.param + i, mask, p);
  _mm512_mask_storeu_ps(a.exp_avg + i, mask, m);
  _mm512_mask_storeu_ps(a.exp_avg_sq + i, mask, v);
  if (OutType == kNone) return;
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  const __m256i half =
      OutType == kBF16 ? to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (Stream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out16 + i), half);
  else
    _mm256_mask_storeu_epi16(out16 + i, mask, half);
}

// The streaming loop: elements up to the first 64-byte boundary of param_out16 go through
// masked vectors (the same instructions as the body), then full vectors with non-temporal
// stores, then the masked tail; a store fence makes the streamed stores globally visible
// before the range returns.
template <int GradType, int OutType, bool Traffic>
void adam_stream(const AdamArgs& a, size_t begin, size_t end, bool lerp_small, __m512 lerp_coeff) {
  size_t i = begin;
  {
    const uintptr_t address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.param_out16) + i);
    size_t head = min_size(end - i, ((64 - (address & 63)) & 63) / 2);
    for (; head > 0;) {
      const size_t k = min_size(head, 16);
      adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << k) - 1u), lerp_small, lerp_coeff);
      i += k;
      head -= k;
    }
  }
  for (; i + 16 <= end; i += 16)
    adam_vector<GradType, OutType, Traffic, true>(a, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
  _mm_sfence();
}

template <int GradType, int OutType, bool Traffic>
void adam_range(const AdamArgs& args, size_t begin, size_t end) {
  // A local copy: with -fno-strict-aliasing every store could otherwise alias the caller's
  // AdamArgs and force its fields to be reloaded each iteration.
  const AdamArgs a = args;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f);
  // A param_out16 at an odd address cannot be aligned for streaming stores (a 16-bit tensor
  // from torch never is).
  if (OutType != kNone && a.stream && (reinterpret_cast<uintptr_t>(a.param_out16) & 1) == 0)
    return adam_stream<GradType, OutType, Traffic>(a, begin, end, lerp_small, lerp_coeff);
  size_t i = begin;
  for (; i + 16 <= end; i += 16)
    adam_vector<GradType, OutType, Traffic>(a, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    adam_vector<GradType, OutType, Traffic>(a, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
}

// ---- compact moments (docs/compact_state.md) --------------------------------------------
// The same operations as adam_avx2.cpp's, 16 lanes; partial vectors and the call's last
// partial block through zero-masked loads and masked stores (zeros step to zero moments, so
// masked-off lanes leave a block's largest magnitudes alone).

// The random words of elements first .. first + 15 (first = position + index, mod 2^32).
inline __m512i random_words(uint32_t key, uint32_t first) {
  __m512i h = _mm512_add_epi32(_mm512_set1_epi32(int(first)),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  h = _mm512_xor_si512(h, _mm512_set1_epi32(int(key)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

inline __m512 load_bf16(const uint16_t* src, __mmask16 mask) {
  return widen_bf16(_mm256_maskz_loadu_epi16(mask, src));
}

// bf16 with stochastic rounding: r (< 2^16) added below the kept bits, a finite x saturating
// at the largest finite bf16 (encode_bf16 in adam_kernels.h); NaN -> 0x7fc0.
inline __m256i encode_bf16_vector(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i limit = _mm512_max_epu32(magnitude, _mm512_set1_epi32(int(kBF16SumLimit)));
  const __m512i sum = _mm512_min_epu32(_mm512_add_epi32(magnitude, r), limit);
  // the sign bit back: u ^ magnitude
  return bf16_high_halves(x, _mm512_or_si512(sum, _mm512_xor_si512(magnitude, u)));
}

// 16 codes (bytes) widened to 32-bit lanes, masked-off lanes zero: zero-extended (E4M4),
// sign-extended (E3M4: the sign bit, bit 7, then fills bits 7..31).
inline __m512i load_codes(const uint8_t* src, __mmask16 mask) {
  return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, src));
}

inline __m512i load_signed_codes(const uint8_t* src, __mmask16 mask) {
  return _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, src));
}

// The int8 formats' arithmetic on normal fp32 numbers only, each range's formula computed and
// one picked per lane (see adam_avx2.cpp: no fp32 subnormals, no microcode assists).

// value(c) of root codes c (< 256): float((c + 1792) << 19) from code 16 on, float((c + 1808)
// << 19) - 2^-14 below; times the block's scale.
inline __m512 decode_e4m4_vector(__m512i c, __m512 scale) {
  const __mmask16 normal = _mm512_cmpgt_epi32_mask(c, _mm512_set1_epi32(15));
  const __m512 normal_value =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(1792)), 19));
  const __m512 subnormal_value =
      _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(1808)), 19)),
                    _mm512_castsi512_ps(_mm512_set1_epi32(int(kTwoPowM14Bits))));
  return _mm512_mul_ps(_mm512_mask_mov_ps(subnormal_value, normal, normal_value), scale);
}

// exp_avg values of sign-extended codes: the magnitude the smaller of the E3M4 value
// float((c + normal_base) << 19) and the tail's float(min(c + tail_base, 254) << 23), zero for
// code 0 (see adam_avx2.cpp, decode_e3m4t_magnitude), with the code's sign. In units of the
// scale (the general form multiplies by it after): bases 1905 and 105; scaled form:
// 1905 + 16 (e - 127) and 105 + e - 127.
inline __m512 decode_e3m4t_vector(__m512i code, __m512i normal_base, __m512i tail_base) {
  const __m512i c = _mm512_and_si512(code, _mm512_set1_epi32(127));
  const __m512 normal = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(c, normal_base), 19));
  const __m512i tail_exponent = _mm512_min_epu32(_mm512_add_epi32(c, tail_base), _mm512_set1_epi32(254));
  // code 0: a tail of +0 (a masked shift), the smaller of the two
  const __m512 tail =
      _mm512_castsi512_ps(_mm512_maskz_slli_epi32(_mm512_test_epi32_mask(c, c), tail_exponent, 23));
  const __m512i magnitude = _mm512_castps_si512(_mm512_min_ps(normal, tail));
  // magnitude | (code & sign bit), one ternary-logic instruction
  return _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(magnitude, code, _mm512_set1_epi32(int(0x80000000u)), 0xF8));
}

// The general form's value: the magnitude in units of the scale, times the scale, signed.
inline __m512 decode_e3m4t_general(__m512i code, __m512 scale) {
  const __m512 unscaled =
      decode_e3m4t_vector(_mm512_and_si512(code, _mm512_set1_epi32(127)),
                          _mm512_set1_epi32(int(kE3M4TNormalBase)), _mm512_set1_epi32(int(kE3M4TTailBase)));
  const __m512i sign = _mm512_and_si512(code, _mm512_set1_epi32(int(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(unscaled, scale)), sign));
}

// exp_avg's magnitude codes of a (|x|, or y = |x| * inverse in the general form), not yet
// limited to the largest code (see adam_avx2.cpp, encode_e3m4t_magnitude).
inline __m512i encode_e3m4t_magnitude(__m512 a, __m512 floor, __m512i normal_offset, __m512i tail_offset,
                                      __m512i r) {
  const __m512 t = _mm512_max_ps(a, _mm512_mul_ps(_mm512_add_ps(a, floor), _mm512_set1_ps(0.5f)));
  const __m512i normal = _mm512_add_epi32(_mm512_castps_si512(a), normal_offset);
  const __m512i tail = _mm512_add_epi32(_mm512_srli_epi32(_mm512_castps_si512(t), 4), tail_offset);
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_max_epi32(normal, tail), r), 19);
}

// Where y = root * inverse falls among the root's codes, code << 19 | the dropped bits (see
// adam_avx2.cpp, root_position_vector).
inline __m512i root_position_vector(__m512 root, __m512 inverse) {
  const __m512 end = _mm512_castsi512_ps(_mm512_set1_epi32(int(kTwoPowM14Bits)));
  const __m512 y = _mm512_mul_ps(root, inverse);
  const __m512i normal = _mm512_sub_epi32(_mm512_castps_si512(y), _mm512_set1_epi32(int(1792u << 19)));
  const __m512i subnormal =
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, end)), _mm512_set1_epi32(int(1808u << 19)));
  const __mmask16 small = _mm512_cmp_ps_mask(y, end, _CMP_LT_OQ);
  return _mm512_mask_mov_epi32(normal, small, subnormal);
}

// Roots' codes at positions code << 19 | F rounded so that v = root^2 is unbiased, not yet
// limited to the largest code (see adam_avx2.cpp, encode_roots_unbiased_square).
template <bool AllNormal>
inline __m512i encode_roots_unbiased_square(__m512i position, __m512i r) {
  const __m512i code = _mm512_srli_epi32(position, 19);
  const __m512i fraction = _mm512_and_si512(position, _mm512_set1_epi32(0x7FFFF));
  __m512i odd;  // 2L + 1
  if (AllNormal) {
    odd = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(position, 18), _mm512_set1_epi32(30)),
                          _mm512_set1_epi32(33));
  } else {
    const __m512i l = _mm512_min_epu32(
        code, _mm512_add_epi32(_mm512_and_si512(code, _mm512_set1_epi32(15)), _mm512_set1_epi32(16)));
    odd = _mm512_or_si512(_mm512_slli_epi32(l, 1), _mm512_set1_epi32(1));
  }
  const __m512i high = _mm512_srli_epi32(fraction, 3);
  const __m512i gap = _mm512_sub_epi32(fraction, _mm512_srli_epi32(_mm512_mullo_epi32(high, high), 13));
  const __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_mullo_epi32(odd, _mm512_sub_epi32(fraction, r)), gap);
  return _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
}

// codes | the sign of x in bit 7: x's bits shifted down by 24, then one ternary-logic
// instruction (codes | (shifted & 0x80))
inline __m512i with_e3m4t_signs(__m512i codes, __m512 x) {
  return _mm512_ternarylogic_epi32(codes, _mm512_srli_epi32(_mm512_castps_si512(x), 24),
                                   _mm512_set1_epi32(0x80), 0xF8);
}

// E4M4 codes of a root (>= +0; see adam_avx2.cpp).
// A root above zero takes at least code 1 (see adam_avx2.cpp).
inline __m512i encode_e4m4_vector(__m512 root, __m512 inverse, __m512i word) {
  const __m512i codes =
      encode_roots_unbiased_square<false>(root_position_vector(root, inverse), _mm512_srli_epi32(word, 13));
  return _mm512_max_epi32(codes, _mm512_min_epi32(_mm512_castps_si512(root), _mm512_set1_epi32(1)));
}

template <int OutType>
inline void store_out16(uint16_t* out16, __m512 p, __mmask16 mask) {
  if (OutType == kNone) return;
  const __m256i half =
      OutType == kBF16 ? to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_mask_storeu_epi16(out16, mask, half);
}

// Elements i + lane (lanes in mask) with bf16 moments.
template <int GradType, int OutType, bool Traffic>
inline void bf16_vector(const CompactArgs& c, size_t i, __mmask16 mask, bool lerp_small, __m512 lerp_coeff) {
  const AdamArgs& a = c.step;
  const uint16_t* m_in = static_cast<const uint16_t*>(c.exp_avg_in) + i;
  const uint16_t* v_in = static_cast<const uint16_t*>(c.exp_avg_sq_in) + i;
  uint16_t* m_out = static_cast<uint16_t*>(c.exp_avg) + i;
  uint16_t* v_out = static_cast<uint16_t*>(c.exp_avg_sq) + i;
  __m512 g = load_grad<GradType>(a.grad, i, mask);
  __m512 p = _mm512_maskz_loadu_ps(mask, a.param_in + i);
  if (Traffic) {
    p = _mm512_add_ps(p, g);
    const __m256i one = _mm256_set1_epi16(1);
    _mm256_mask_storeu_epi16(m_out, mask, _mm256_add_epi16(_mm256_maskz_loadu_epi16(mask, m_in), one));
    _mm256_mask_storeu_epi16(v_out, mask, _mm256_add_epi16(_mm256_maskz_loadu_epi16(mask, v_in), one));
  } else {
    __m512 m = load_bf16(m_in, mask);
    __m512 v = load_bf16(v_in, mask);
    adamw_math<true>(a, g, p, m, v, lerp_small, lerp_coeff);
    const __m512i word = random_words(c.key, uint32_t(c.position + i));
    _mm256_mask_storeu_epi16(m_out, mask,
                             encode_bf16_vector(m, _mm512_and_si512(word, _mm512_set1_epi32(0xFFFF))));
    _mm256_mask_storeu_epi16(v_out, mask, encode_bf16_vector(v, _mm512_srli_epi32(word, 16)));
  }
  _mm512_mask_storeu_ps(a.param + i, mask, p);
  store_out16<OutType>(static_cast<uint16_t*>(a.param_out16) + i, p, mask);
}

template <int GradType, int OutType, bool Traffic>
void bf16_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  size_t i = begin;
  for (; i + 16 <= end; i += 16)
    bf16_vector<GradType, OutType, Traffic>(c, i, 0xffff, lerp_small, lerp_coeff);
  if (i < end)
    bf16_vector<GradType, OutType, Traffic>(c, i, __mmask16((1u << (end - i)) - 1u), lerp_small, lerp_coeff);
}

// Blocks processed together by int8_group.
constexpr size_t kGroupBlocks = 8;

// The lanes of vector k (16 elements) of a range of `count` elements.
inline __mmask16 lanes(size_t k, size_t count) {
  const size_t first = 16 * k;
  if (count >= first + 16) return 0xffff;
  return count <= first ? __mmask16(0) : __mmask16((1u << (count - first)) - 1u);
}

// `count` elements (ceil(count / 32) <= kGroupBlocks blocks; only the last may be partial,
// masked) with int8 moments from element i, in two passes as in adam_avx2.cpp's int8_group:
// decode and step every vector, then encode block by block. Masked-off lanes load zeros,
// which step to zero moments, so they leave a block's largest magnitudes alone.
template <int GradType, int OutType, bool Traffic>
__attribute__((always_inline)) inline void int8_group(const CompactArgs& c, size_t i, size_t count,
                                                      bool lerp_small, __m512 lerp_coeff) {
  const AdamArgs& a = c.step;
  const size_t block0 = i / kInt8Block;
  const size_t blocks = (count + kInt8Block - 1) / kInt8Block;
  const uint8_t* m_in = static_cast<const uint8_t*>(c.exp_avg_in) + i;
  const uint8_t* v_in = static_cast<const uint8_t*>(c.exp_avg_sq_in) + i;
  uint8_t* m_out = static_cast<uint8_t*>(c.exp_avg) + i;
  uint8_t* v_out = static_cast<uint8_t*>(c.exp_avg_sq) + i;
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16) + i;
  if (Traffic) {
    const __m128i one = _mm_set1_epi8(1);
    for (size_t k = 0; k < 2 * blocks; ++k) {
      const __mmask16 mask = lanes(k, count);
      const size_t j = i + 16 * k;
      const __m512 p =
          _mm512_add_ps(_mm512_maskz_loadu_ps(mask, a.param_in + j), load_grad<GradType>(a.grad, j, mask));
      _mm512_mask_storeu_ps(a.param + j, mask, p);
      store_out16<OutType>(out16 + 16 * k, p, mask);
      _mm_mask_storeu_epi8(m_out + 16 * k, mask,
                           _mm_add_epi8(_mm_maskz_loadu_epi8(mask, m_in + 16 * k), one));
      _mm_mask_storeu_epi8(v_out + 16 * k, mask,
                           _mm_add_epi8(_mm_maskz_loadu_epi8(mask, v_in + 16 * k), one));
    }
    for (size_t blk = block0; blk < block0 + blocks; ++blk) {
      c.exp_avg_exponents[blk] = uint8_t(c.exp_avg_exponents_in[blk] + 1);
      c.exp_avg_sq_exponents[blk] = uint8_t(c.exp_avg_sq_exponents_in[blk] + 1);
    }
    return;
  }
  alignas(64) float ms[kGroupBlocks * kInt8Block], roots[kGroupBlocks * kInt8Block];
  uint32_t m_largest[kGroupBlocks], root_largest[kGroupBlocks];
  uint8_t m_exponent_in[kGroupBlocks], v_exponent_in[kGroupBlocks];
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  for (size_t blk = 0; blk < blocks; ++blk) {
    m_exponent_in[blk] = c.exp_avg_exponents_in[block0 + blk];
    v_exponent_in[blk] = c.exp_avg_sq_exponents_in[block0 + blk];
  }
  for (size_t blk = 0; blk < blocks; ++blk) {
    const uint32_t m_e = m_exponent_in[blk], v_e = v_exponent_in[blk];
    const __m512 m_scale = _mm512_set1_ps(exponent_scale(m_e));
    const __m512 v_scale = _mm512_set1_ps(exponent_scale(v_e));
    const bool m_scaled = scaled_exponent_e3m4t(m_e);
    const __m512i m_normal_base = _mm512_set1_epi32(int(kE3M4TNormalBase + 16u * (m_e - 127u)));
    const __m512i m_tail_base = _mm512_set1_epi32(int(kE3M4TTailBase + m_e - 127u));
    const bool v_scaled = scaled_exponent(v_e);  // and, per vector, no code below 16
    const __m512i v_base = _mm512_set1_epi32(int(1792u + 16u * (v_e - 127u)));
    __m512i m_max = _mm512_setzero_si512(), root_max = _mm512_setzero_si512();
    for (size_t k = 0; k < 2; ++k) {
      const size_t e = kInt8Block * blk + 16 * k;  // element within the group
      const __mmask16 mask = lanes(2 * blk + k, count);
      __m512 g = load_grad<GradType>(a.grad, i + e, mask);
      __m512 p = _mm512_maskz_loadu_ps(mask, a.param_in + i + e);
      const __m512i m_code = load_signed_codes(m_in + e, mask);
      __m512 m = m_scaled ? decode_e3m4t_vector(m_code, m_normal_base, m_tail_base)
                          : decode_e3m4t_general(m_code, m_scale);
      const __m512i v_code = load_codes(v_in + e, mask);
      const __m512 stored_root =
          v_scaled && _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(16), v_code) == 0
              ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(v_code, v_base), 19))
              : decode_e4m4_vector(v_code, v_scale);
      __m512 v = _mm512_mul_ps(stored_root, stored_root);
      __m512 root = adamw_math<true, true>(a, g, p, m, v, lerp_small, lerp_coeff);
      // masked-off lanes: zero (a NaN scale would otherwise reach them)
      m = _mm512_maskz_mov_ps(mask, m);
      root = _mm512_maskz_mov_ps(mask, root);
      _mm512_mask_storeu_ps(a.param + i + e, mask, p);
      store_out16<OutType>(out16 + e, p, mask);
      _mm512_store_ps(ms + e, m);
      _mm512_store_ps(roots + e, root);
      m_max = _mm512_max_epu32(m_max, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
      root_max = _mm512_max_epu32(root_max, _mm512_castps_si512(root));  // a root is never negative
    }
    m_largest[blk] = _mm512_reduce_max_epu32(m_max);
    root_largest[blk] = _mm512_reduce_max_epu32(root_max);
  }
  for (size_t blk = 0; blk < blocks; ++blk) {
    const uint32_t m_e = block_exponent(m_largest[blk]);
    const uint32_t v_e = block_exponent(root_largest[blk]);
    const __m512 m_inverse = _mm512_set1_ps(exponent_inverse(m_e));
    const __m512 v_inverse = _mm512_set1_ps(exponent_inverse(v_e));
    const bool m_scaled = scaled_exponent_e3m4t(m_e);
    // the scaled form's floor and offsets, else the general form's (encode_e3m4t_magnitude)
    const __m512 m_floor = _mm512_castsi512_ps(
        _mm512_set1_epi32(int(m_scaled ? kTwoPowM21Bits + scale_bits(m_e) : kTwoPowM21Bits)));
    const __m512i m_normal_offset = _mm512_set1_epi32(
        int(m_scaled ? scale_bits(254u - m_e) - (kE3M4TNormalBase << 19) : 0u - (kE3M4TNormalBase << 19)));
    const __m512i m_tail_offset = _mm512_set1_epi32(
        int(m_scaled ? ((127u - m_e) << 19) - (kE3M4TTailBase << 19) : 0u - (kE3M4TTailBase << 19)));
    // scaled and, per vector, no root below the subnormal end: the normal formula only, every
    // code at least 16 (a partial block's masked-off lanes are zero roots: the general form)
    const bool v_scaled = scaled_root_encode(v_e);
    const __m512i v_end = _mm512_set1_epi32(int(kTwoPowM14Bits + scale_bits(v_e)));
    const __m512i v_offset = _mm512_set1_epi32(int(scale_bits(254u - v_e) - (1792u << 19)));
    for (size_t k = 0; k < 2; ++k) {
      const size_t e = kInt8Block * blk + 16 * k;
      const __mmask16 mask = lanes(2 * blk + k, count);
      const __m512i word = random_words(c.key, uint32_t(c.position + i + e));
      const __m512 m = _mm512_load_ps(ms + e);
      const __m512 m_magnitude =
          _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(0x7fffffff)));
      const __m512i r = _mm512_and_si512(word, _mm512_set1_epi32(0x7FFFF));
      __m512i m_codes;
      if (m_scaled) {
        m_codes = encode_e3m4t_magnitude(m_magnitude, m_floor, m_normal_offset, m_tail_offset, r);
      } else {
        // up to 127 (y <= 1) unless the exponent is 253, where y reaches 4: limited to 127
        m_codes = _mm512_min_epi32(encode_e3m4t_magnitude(_mm512_mul_ps(m_magnitude, m_inverse), m_floor,
                                                          m_normal_offset, m_tail_offset, r),
                                   _mm512_set1_epi32(127));
      }
      m_codes = with_e3m4t_signs(m_codes, m);
      __m512i v_codes;
      const __m512i root_bits = _mm512_load_si512(roots + e);
      if (v_scaled && _mm512_cmpgt_epi32_mask(v_end, root_bits) == 0) {
        v_codes = encode_roots_unbiased_square<true>(_mm512_add_epi32(root_bits, v_offset),
                                                     _mm512_srli_epi32(word, 13));
      } else {
        v_codes = encode_e4m4_vector(_mm512_load_ps(roots + e), v_inverse, word);
        v_codes = _mm512_min_epi32(v_codes, _mm512_set1_epi32(int(root_code_limit(v_e))));
      }
      if (m_e == 255) m_codes = _mm512_setzero_si512();
      if (v_e == 255) v_codes = _mm512_setzero_si512();
      _mm_mask_storeu_epi8(m_out + e, mask, _mm512_cvtepi32_epi8(m_codes));
      _mm_mask_storeu_epi8(v_out + e, mask, _mm512_cvtepi32_epi8(v_codes));
    }
    c.exp_avg_exponents[block0 + blk] = uint8_t(m_e);
    c.exp_avg_sq_exponents[block0 + blk] = uint8_t(v_e);
  }
}

template <int GradType, int OutType, bool Traffic>
void int8_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;  // a local copy (see adam_range)
  const bool lerp_small = __builtin_fabsf(c.step.beta1_weight) < 0.5f;
  const __m512 lerp_coeff = _mm512_set1_ps(lerp_small ? c.step.beta1_weight : c.step.beta1_weight - 1.0f);
  constexpr size_t kGroup = kGroupBlocks * kInt8Block;
  // Whole groups pass a constant count: every lane mask folds to all ones and the masked loads,
  // stores and moves become plain ones (single thread in cache: 1.52-1.57 to 1.78-1.83 Gparam/s
  // on a Zen 5 VM). The last, partial group takes the masked form.
  size_t i = begin;
  for (; i + kGroup <= end; i += kGroup) {
    prefetch_int8_ahead(c, i, end, kGroup, GradType == kF32 ? 4 : 2);
    int8_group<GradType, OutType, Traffic>(c, i, kGroup, lerp_small, lerp_coeff);
  }
  if (i < end) int8_group<GradType, OutType, Traffic>(c, i, end - i, lerp_small, lerp_coeff);
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

const IsaKernels& avx512_kernels() {
  static const IsaKernels table{"avx512",      adam,         traffic,        sum_squares,
                                any_nonfinite, adam_compact, compact_traffic};
  return table;
}

}  // namespace offload_adam
