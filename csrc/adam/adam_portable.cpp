// Portable variant: plain C++ for any x86-64 (and any other CPU). No target pragma.
// It performs the same fp32 operations in the same order as the vector variants (and as
// torch.optim.AdamW), with the fused multiply-adds made explicit through __builtin_fmaf, so
// every variant gives bit-identical results.
#pragma GCC optimize("fp-contract=off")

#include "adam/adam_kernels.h"

namespace offload_adam {
namespace {

template <int GradType>
inline float load_grad(const void* grad, size_t i) {
  if (GradType == kF32) return static_cast<const float*>(grad)[i];
  if (GradType == kBF16) return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  return f16_to_float(static_cast<const uint16_t*>(grad)[i]);
}

// AdamW on one element, the operations of torch's single-tensor AdamW in its order (the fused
// multiply-adds explicit): updates p, m, v and returns sqrt(v') (before bias correction).
// Compact: the compact steps' bias correction (multiplied by bias_correction2_rsqrt). BoundM:
// the int8 step's bound, the update's m limited in magnitude to m_bound * sqrt(v') (a NaN
// limit, from a NaN v', leaves m: that step's weight is NaN whatever m is).
template <bool Compact, bool BoundM = false>
inline float adamw_element(const AdamArgs& a, float g, float& p, float& m, float& v, bool lerp_small,
                           float lerp_coeff) {
  if (a.apply_scale) g = g * a.grad_scale;
  if (a.l2_decay) g = __builtin_fmaf(p, a.weight_decay, g);   // grad.add(param, alpha=wd)
  if (a.decoupled_decay) p = p * a.decay_factor;              // param.mul_(1 - lr*wd)
  m = __builtin_fmaf(lerp_coeff, g - m, lerp_small ? m : g);  // exp_avg.lerp_(grad, 1-beta1)
  v = v * a.beta2;                                            // exp_avg_sq.mul_(beta2)
  v = __builtin_fmaf(a.one_minus_beta2 * g, g, v);            //   .addcmul_(grad, grad, 1-beta2)
  const float sqrt_v = __builtin_sqrtf(v);
  float root = sqrt_v;
  if (a.correct_bc2) root = Compact ? root * a.bias_correction2_rsqrt : root / a.bias_correction2_sqrt;
  float denom = root + a.eps;
  float m_step = m;
  if (BoundM) {
    const float limit = sqrt_v * a.m_bound;
    const float magnitude = __builtin_fabsf(m);
    m_step = bits_float(float_bits(limit < magnitude ? limit : magnitude) | (float_bits(m) & 0x80000000u));
  }
  p = p + (a.neg_step_size * m_step) / denom;  // addcdiv_(m, denom, -step)
  return sqrt_v;
}

// Reads the sources (param_in, grad, exp_avg_in, exp_avg_sq_in), writes the destinations
// (param, exp_avg, exp_avg_sq, param_out16); in place when they are the same arrays.
// Traffic: the same loads and stores around trivial arithmetic (the benchmark's bandwidth
// limit of this access pattern), not an Adam step. No streaming stores here (a.stream ignored).
template <int GradType, int OutType, bool Traffic>
void adam_range(const AdamArgs& args, size_t begin, size_t end) {
  // A local copy: with -fno-strict-aliasing every store could otherwise alias the caller's
  // AdamArgs and force its fields to be reloaded each iteration.
  const AdamArgs a = args;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const float lerp_coeff = lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f;
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  for (size_t i = begin; i < end; ++i) {
    float g = load_grad<GradType>(a.grad, i);
    float p = a.param_in[i];
    float m = a.exp_avg_in[i];
    float v = a.exp_avg_sq_in[i];
    if (Traffic) {
      p = p + g;
      m = m + g;
      v = v + g;
    } else {
      adamw_element<false>(a, g, p, m, v, lerp_small, lerp_coeff);
    }
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if (OutType == kBF16) out16[i] = float_to_bf16(p);
    if (OutType == kF16) out16[i] = float_to_f16(p);
  }
}

template <int OutType>
inline void store_out16(uint16_t* out16, size_t i, float p) {
  if (OutType == kBF16) out16[i] = float_to_bf16(p);
  if (OutType == kF16) out16[i] = float_to_f16(p);
}

// Compact step, bf16 moments, element by element. Traffic: the same loads and stores around
// trivial arithmetic (the moments' bits plus one).
template <int GradType, int OutType, bool Traffic>
void bf16_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;
  const AdamArgs& a = c.step;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const float lerp_coeff = lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f;
  const uint16_t* m_in = static_cast<const uint16_t*>(c.exp_avg_in);
  const uint16_t* v_in = static_cast<const uint16_t*>(c.exp_avg_sq_in);
  uint16_t* m_out = static_cast<uint16_t*>(c.exp_avg);
  uint16_t* v_out = static_cast<uint16_t*>(c.exp_avg_sq);
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  for (size_t i = begin; i < end; ++i) {
    float g = load_grad<GradType>(a.grad, i);
    float p = a.param_in[i];
    if (Traffic) {
      p = p + g;
      m_out[i] = uint16_t(m_in[i] + 1);
      v_out[i] = uint16_t(v_in[i] + 1);
    } else {
      float m = bf16_to_float(m_in[i]);
      float v = bf16_to_float(v_in[i]);
      adamw_element<true>(a, g, p, m, v, lerp_small, lerp_coeff);
      const uint32_t word = fmix32(c.key ^ uint32_t(c.position + i));
      m_out[i] = encode_bf16(m, word & 0xFFFFu);
      v_out[i] = encode_bf16(v, word >> 16);
    }
    a.param[i] = p;
    store_out16<OutType>(out16, i, p);
  }
}

// Compact step, int8 moments, block by block: decode 32 elements, step, the blocks' largest
// magnitudes, encode. begin is a multiple of 32; the last block may be partial.
template <int GradType, int OutType, bool Traffic>
void int8_range(const CompactArgs& args, size_t begin, size_t end) {
  const CompactArgs c = args;
  const AdamArgs& a = c.step;
  const bool lerp_small = __builtin_fabsf(a.beta1_weight) < 0.5f;
  const float lerp_coeff = lerp_small ? a.beta1_weight : a.beta1_weight - 1.0f;
  const uint8_t* m_in = static_cast<const uint8_t*>(c.exp_avg_in);
  const uint8_t* v_in = static_cast<const uint8_t*>(c.exp_avg_sq_in);
  uint8_t* m_out = static_cast<uint8_t*>(c.exp_avg);
  uint8_t* v_out = static_cast<uint8_t*>(c.exp_avg_sq);
  uint16_t* out16 = static_cast<uint16_t*>(a.param_out16);
  for (size_t start = begin; start < end; start += kInt8Block) {
    const size_t count = min_size(kInt8Block, end - start);
    const size_t block = start / kInt8Block;
    if (Traffic) {
      for (size_t j = 0; j < count; ++j) {
        const size_t i = start + j;
        const float p = a.param_in[i] + load_grad<GradType>(a.grad, i);
        m_out[i] = uint8_t(m_in[i] + 1);
        v_out[i] = uint8_t(v_in[i] + 1);
        a.param[i] = p;
        store_out16<OutType>(out16, i, p);
      }
      c.exp_avg_exponents[block] = uint8_t(c.exp_avg_exponents_in[block] + 1);
      c.exp_avg_sq_exponents[block] = uint8_t(c.exp_avg_sq_exponents_in[block] + 1);
      continue;
    }
    const float m_scale = exponent_scale(c.exp_avg_exponents_in[block]);
    const float v_scale = exponent_scale(c.exp_avg_sq_exponents_in[block]);
    float ms[kInt8Block], roots[kInt8Block];
    uint32_t m_largest = 0, root_largest = 0;
    for (size_t j = 0; j < count; ++j) {
      const size_t i = start + j;
      float g = load_grad<GradType>(a.grad, i);
      float p = a.param_in[i];
      float m = decode_e3m4t(m_in[i], m_scale);
      const float stored_root = decode_e4m4(v_in[i], v_scale);
      float v = stored_root * stored_root;
      const float root = adamw_element<true, true>(a, g, p, m, v, lerp_small, lerp_coeff);
      a.param[i] = p;
      store_out16<OutType>(out16, i, p);
      ms[j] = m;
      roots[j] = root;
      const uint32_t m_magnitude = float_bits(m) & 0x7fffffffu;
      const uint32_t root_magnitude = float_bits(root) & 0x7fffffffu;
      m_largest = m_magnitude > m_largest ? m_magnitude : m_largest;
      root_largest = root_magnitude > root_largest ? root_magnitude : root_largest;
    }
    const uint32_t m_exponent = block_exponent(m_largest);
    const uint32_t v_exponent = block_exponent(root_largest);
    const float m_inverse = exponent_inverse(m_exponent);
    const float v_inverse = exponent_inverse(v_exponent);
    const uint32_t v_limit = root_code_limit(v_exponent);
    for (size_t j = 0; j < count; ++j) {
      const size_t i = start + j;
      const uint32_t word = fmix32(c.key ^ uint32_t(c.position + i));
      m_out[i] = m_exponent == 255 ? 0 : uint8_t(encode_e3m4t(ms[j], m_inverse, word));
      v_out[i] = v_exponent == 255 ? 0 : uint8_t(encode_e4m4(roots[j], v_inverse, word, v_limit));
    }
    c.exp_avg_exponents[block] = uint8_t(m_exponent);
    c.exp_avg_sq_exponents[block] = uint8_t(v_exponent);
  }
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

const IsaKernels& portable_kernels() {
  static const IsaKernels table{"portable",    adam,         traffic,        sum_squares,
                                any_nonfinite, adam_compact, compact_traffic};
  return table;
}

}  // namespace offload_adam
