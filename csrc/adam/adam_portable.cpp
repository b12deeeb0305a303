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
      if (a.apply_scale) g = g * a.grad_scale;
      if (a.l2_decay) g = __builtin_fmaf(p, a.weight_decay, g);   // grad.add(param, alpha=wd)
      if (a.decoupled_decay) p = p * a.decay_factor;              // param.mul_(1 - lr*wd)
      m = __builtin_fmaf(lerp_coeff, g - m, lerp_small ? m : g);  // exp_avg.lerp_(grad, 1-beta1)
      v = v * a.beta2;                                            // exp_avg_sq.mul_(beta2)
      v = __builtin_fmaf(a.one_minus_beta2 * g, g, v);            //   .addcmul_(grad, grad, 1-beta2)
      float root = __builtin_sqrtf(v);
      if (a.divide_bc2) root = root / a.bias_correction2_sqrt;
      float denom = root + a.eps;
      p = p + (a.neg_step_size * m) / denom;  // addcdiv_(m, denom, -step)
    }
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if (OutType == kBF16) out16[i] = float_to_bf16(p);
    if (OutType == kF16) out16[i] = float_to_f16(p);
  }
}

#include "adam/isa_dispatch.inc"

}  // namespace

const IsaKernels& portable_kernels() {
  static const IsaKernels table{"portable", adam, traffic, sum_squares, any_nonfinite};
  return table;
}

}  // namespace offload_adam
