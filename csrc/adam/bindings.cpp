// Python bindings of offload._adam_ext: run-time ISA dispatch, work splitting over the
// thread pool, and the GIL released around every kernel. Pointers come from
// torch.Tensor.data_ptr() and are validated (device, dtype, contiguity, sizes) by
// offload/optim/kernels.py; this layer checks what it can see (types, null pointers, sources
// that overlap a destination without being it).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_kernels.h"
#include "adam/thread_pool.h"

namespace py = pybind11;
using namespace offload_adam;

namespace {

// Below this many elements a call runs on the calling thread: waking workers costs more.
constexpr size_t kSerialElements = size_t(1) << 15;
// has_nonfinite splits into blocks of this fixed size, run on any thread.
constexpr size_t kReduceBlock = size_t(1) << 16;
// sq_norm's canonical blocks (see sq_norm): offload.plan.optimizer_plan.NORM_BLOCK, the unit
// every streamed piece of optimizer state is a multiple of, is this number.
constexpr size_t kNormBlock = 1024;
// Blocks a thread takes at a time from sq_norm's shared counter (128 KiB of fp32).
constexpr size_t kNormGrab = 32;
// Per-thread ranges of the elementwise kernel start at multiples of this many elements
// (256 bytes of fp32, 128 of 16-bit): no two threads write the same cache line.
constexpr size_t kSplitAlign = 64;

int default_thread_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// The process-wide pool, created on first use and never destroyed (its workers may be
// blocked at interpreter exit; the OS reclaims them).
ThreadPool& pool() {
  static ThreadPool* instance = new ThreadPool(default_thread_count());
  return *instance;
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

const IsaKernels* best_kernels() {
  if (cpu_has_avx512()) return &avx512_kernels();
  if (cpu_has_avx2()) return &avx2_kernels();
  return &portable_kernels();
}

std::atomic<const IsaKernels*> g_kernels{nullptr};  // the variant every call uses

const IsaKernels& kernels() {
  const IsaKernels* k = g_kernels.load();
  if (!k) {
    k = best_kernels();
    g_kernels.store(k);
  }
  return *k;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  if (cpu_has_avx512()) names.push_back("avx512");
  if (cpu_has_avx2()) names.push_back("avx2");
  names.push_back("portable");
  return names;
}

void force_isa(const std::string& name) {
  if (name.empty()) {
    g_kernels.store(best_kernels());
  } else if (name == "avx512") {
    if (!cpu_has_avx512()) throw std::invalid_argument("force_isa: this CPU lacks AVX-512 (F/BW/VL/DQ)");
    g_kernels.store(&avx512_kernels());
  } else if (name == "avx2") {
    if (!cpu_has_avx2()) throw std::invalid_argument("force_isa: this CPU lacks AVX2/FMA/F16C");
    g_kernels.store(&avx2_kernels());
  } else if (name == "portable") {
    g_kernels.store(&portable_kernels());
  } else {
    throw std::invalid_argument("force_isa: unknown instruction set '" + name +
                                "' (expected 'avx512', 'avx2' or 'portable')");
  }
}

void check_type(const char* op, const char* what, int type, bool allow_none) {
  if (type == kF32 || type == kBF16 || type == kF16 || (allow_none && type == kNone)) return;
  throw std::invalid_argument(std::string(op) + ": invalid element type code for " + what);
}

void check_pointer(const char* op, const char* what, uintptr_t ptr) {
  if (!ptr) throw std::invalid_argument(std::string(op) + ": " + what + " is a null pointer");
}

// Calls body(begin, end) over [0, n) in chunks of kChunkElements that the threads take in
// turn from a shared counter: a thread slowed down by other processes on a shared machine
// takes fewer chunks instead of delaying the whole call. Chunk starts are multiples of
// kSplitAlign, so no two threads write the same cache line. Only for elementwise work,
// whose result does not depend on the split.
constexpr size_t kChunkElements = size_t(1) << 16;
template <typename Body>
void parallel_ranges(size_t n, const Body& body) {
  if (n < kSerialElements) {
    body(size_t(0), n);
    return;
  }
  static_assert(kChunkElements % kSplitAlign == 0, "chunks must start on cache-line boundaries");
  const size_t chunks = (n + kChunkElements - 1) / kChunkElements;
  std::atomic<size_t> next{0};
  pool().run([&](int, int) {
    for (size_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      body(c * kChunkElements, std::min(n, (c + 1) * kChunkElements));
  });
}

// Calls of adam_step with at least this many elements use the streaming mode (AdamArgs::
// stream): their arrays are far larger than a last-level cache (tens of MB), so param_out16
// would be evicted before anyone re-reads it. Smaller calls keep it in cache for the copy
// that follows. Settable for tests and benchmarks.
constexpr size_t kDefaultStreamElements = size_t(1) << 21;
std::atomic<size_t> g_stream_elements{kDefaultStreamElements};

bool use_streaming(size_t n) { return n >= g_stream_elements.load(std::memory_order_relaxed); }

void set_streaming_threshold(int64_t n) {
  if (n < 0) throw std::invalid_argument("set_streaming_threshold: n must be >= 0, got " + std::to_string(n));
  g_stream_elements.store(size_t(n));
}

void check_step_types(const char* op, int grad_type, int out_type) {
  check_type(op, "grad", grad_type, false);
  check_type(op, "param_out16", out_type, true);
  if (out_type == kF32) throw std::invalid_argument(std::string(op) + ": param_out16 must be bf16 or fp16");
}

// Byte range [begin, begin + size) of one buffer of a step.
struct ByteRange {
  const char* what;
  uintptr_t begin;
  size_t size;
};

bool overlap(const ByteRange& x, const ByteRange& y) {
  return x.size > 0 && y.size > 0 && x.begin < y.begin + y.size && y.begin < x.begin + x.size;
}

// A source is read while this and other threads write the destinations: it must overlap none
// of them, or the result would depend on the order of the writes, except its own destination
// when it is exactly that buffer (in place: each element read, then written).
// sources[s] for s < paired is destination s's source; the sources after them (a compact
// step's grad) are only read.
template <size_t Sources, size_t Destinations>
void check_sources(const char* op, const ByteRange (&sources)[Sources],
                   const ByteRange (&destinations)[Destinations], size_t paired = 3) {
  for (size_t s = 0; s < Sources; ++s) {
    const bool in_place = s < paired && sources[s].begin == destinations[s].begin;
    for (size_t d = 0; d < Destinations; ++d) {
      if (in_place && d == s) continue;  // read, then written, element by element
      if (overlap(sources[s], destinations[d]))
        throw std::invalid_argument(std::string(op) + ": " + sources[s].what + " overlaps " +
                                    destinations[d].what +
                                    " without being it (a source must be its own destination or overlap "
                                    "no destination)");
    }
  }
}

// The buffers of one step, checked, with the scalars left zero. param, exp_avg and exp_avg_sq
// are the destinations; param_in, exp_avg_in, exp_avg_sq_in the sources (0: the destination,
// in place).
AdamArgs buffer_args(const char* op, uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                     uintptr_t param_out16, size_t n, int grad_type, int out_type, uintptr_t param_in,
                     uintptr_t exp_avg_in, uintptr_t exp_avg_sq_in) {
  check_step_types(op, grad_type, out_type);
  check_pointer(op, "param", param);
  check_pointer(op, "grad", grad);
  check_pointer(op, "exp_avg", exp_avg);
  check_pointer(op, "exp_avg_sq", exp_avg_sq);
  if (out_type != kNone) check_pointer(op, "param_out16", param_out16);
  if (!param_in) param_in = param;
  if (!exp_avg_in) exp_avg_in = exp_avg;
  if (!exp_avg_sq_in) exp_avg_sq_in = exp_avg_sq;
  const size_t bytes = n * 4;
  check_sources(op,
                {{"param_in", param_in, bytes},
                 {"exp_avg_in", exp_avg_in, bytes},
                 {"exp_avg_sq_in", exp_avg_sq_in, bytes}},
                {{"param", param, bytes},
                 {"exp_avg", exp_avg, bytes},
                 {"exp_avg_sq", exp_avg_sq, bytes},
                 {"param_out16", param_out16, out_type == kNone ? 0 : n * 2}});
  AdamArgs args{};
  args.param_in = reinterpret_cast<const float*>(param_in);
  args.grad = reinterpret_cast<const void*>(grad);
  args.exp_avg_in = reinterpret_cast<const float*>(exp_avg_in);
  args.exp_avg_sq_in = reinterpret_cast<const float*>(exp_avg_sq_in);
  args.param = reinterpret_cast<float*>(param);
  args.exp_avg = reinterpret_cast<float*>(exp_avg);
  args.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
  args.param_out16 = out_type == kNone ? nullptr : reinterpret_cast<void*>(param_out16);
  args.grad_type = grad_type;
  args.out_type = out_type;
  return args;
}

// The memory traffic of adam_step on these buffers (IsaKernels::traffic), streaming mode
// forced on or off; for the benchmark's bandwidth limit. Overwrites the destinations.
void adam_traffic(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                  uintptr_t param_out16, size_t n, int grad_type, int out_type, bool stream,
                  uintptr_t param_in, uintptr_t exp_avg_in, uintptr_t exp_avg_sq_in) {
  check_step_types("adam_traffic", grad_type, out_type);
  if (n == 0) return;
  AdamArgs args = buffer_args("adam_traffic", param, grad, exp_avg, exp_avg_sq, param_out16, n, grad_type,
                              out_type, param_in, exp_avg_in, exp_avg_sq_in);
  args.stream = stream;
  const IsaKernels& k = kernels();
  parallel_ranges(n, [&](size_t begin, size_t end) { k.traffic(args, begin, end); });
}

// The step's scalars, each rounded to fp32 once, as torch rounds a Python scalar operand.
// bias_correction2_factor: sqrt(bias_correction2) for the fp32 step (it divides by it),
// 1 / sqrt(bias_correction2) for a compact one (it multiplies).
void set_scalars(AdamArgs& args, double grad_scale, double weight_decay, bool l2_decay, double decay_factor,
                 bool decoupled_decay, double beta1_weight, double beta2, double one_minus_beta2,
                 double bias_correction2_factor, bool compact, double eps, double neg_step_size,
                 double m_bound = std::numeric_limits<double>::infinity()) {
  args.grad_scale = float(grad_scale);
  args.apply_scale = grad_scale != 1.0;
  args.weight_decay = float(weight_decay);
  args.l2_decay = l2_decay;
  args.decay_factor = float(decay_factor);
  args.decoupled_decay = decoupled_decay;
  args.beta1_weight = float(beta1_weight);
  args.beta2 = float(beta2);
  args.one_minus_beta2 = float(one_minus_beta2);
  const float factor = float(bias_correction2_factor);
  args.bias_correction2_sqrt = compact ? 1.0f : factor;
  args.bias_correction2_rsqrt = compact ? factor : 1.0f;
  // Late in training (beta2 = 0.999: from about step 17000) and without bias correction the
  // fp32 factor is exactly 1; dividing or multiplying by it changes no bit (sqrt never returns
  // a signalling NaN).
  args.correct_bc2 = factor != 1.0f;
  args.eps = float(eps);
  args.neg_step_size = float(neg_step_size);
  args.m_bound = float(m_bound);  // rounded up to an fp32 value by the caller
}

void adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               uintptr_t param_out16, size_t n, int grad_type, int out_type, double grad_scale,
               double weight_decay, bool l2_decay, double decay_factor, bool decoupled_decay,
               double beta1_weight, double beta2, double one_minus_beta2, double bias_correction2_sqrt,
               double eps, double neg_step_size, uintptr_t param_in, uintptr_t exp_avg_in,
               uintptr_t exp_avg_sq_in) {
  check_step_types("adam_step", grad_type, out_type);
  if (n == 0) return;
  AdamArgs args = buffer_args("adam_step", param, grad, exp_avg, exp_avg_sq, param_out16, n, grad_type,
                              out_type, param_in, exp_avg_in, exp_avg_sq_in);
  args.stream = use_streaming(n);
  set_scalars(args, grad_scale, weight_decay, l2_decay, decay_factor, decoupled_decay, beta1_weight, beta2,
              one_minus_beta2, bias_correction2_sqrt, false, eps, neg_step_size);
  const IsaKernels& k = kernels();
  parallel_ranges(n, [&](size_t begin, size_t end) { k.adam(args, begin, end); });
}

// The buffers of one compact step, checked (the scalars left zero). Destinations: param, the
// moments (bf16: 2n bytes each; int8: n code bytes each) and, for int8, their block exponents
// (ceil(n / 32) bytes each); sources the *_in (0: the destination, in place).
CompactArgs compact_buffer_args(const char* op, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
                                uintptr_t exp_avg_exponents, uintptr_t exp_avg_sq,
                                uintptr_t exp_avg_sq_exponents, uintptr_t param_out16, size_t n,
                                int moment_type, int grad_type, int out_type, uint32_t key, uint64_t position,
                                uintptr_t param_in, uintptr_t exp_avg_in, uintptr_t exp_avg_exponents_in,
                                uintptr_t exp_avg_sq_in, uintptr_t exp_avg_sq_exponents_in) {
  check_step_types(op, grad_type, out_type);
  if (moment_type != kMomentBF16 && moment_type != kMomentInt8)
    throw std::invalid_argument(std::string(op) + ": invalid moment type code " +
                                std::to_string(moment_type));
  const bool int8 = moment_type == kMomentInt8;
  if (int8 && position % kInt8Block != 0)
    throw std::invalid_argument(std::string(op) + ": position " + std::to_string(position) +
                                " is not a multiple of 32 (an int8 range starts on a block)");
  check_pointer(op, "param", param);
  check_pointer(op, "grad", grad);
  check_pointer(op, "exp_avg", exp_avg);
  check_pointer(op, "exp_avg_sq", exp_avg_sq);
  if (int8) {
    check_pointer(op, "exp_avg block exponents", exp_avg_exponents);
    check_pointer(op, "exp_avg_sq block exponents", exp_avg_sq_exponents);
  } else {
    exp_avg_exponents = exp_avg_sq_exponents = exp_avg_exponents_in = exp_avg_sq_exponents_in = 0;
  }
  if (out_type != kNone) check_pointer(op, "param_out16", param_out16);
  if (!param_in) param_in = param;
  if (!exp_avg_in) exp_avg_in = exp_avg;
  if (!exp_avg_sq_in) exp_avg_sq_in = exp_avg_sq;
  if (!exp_avg_exponents_in) exp_avg_exponents_in = exp_avg_exponents;
  if (!exp_avg_sq_exponents_in) exp_avg_sq_exponents_in = exp_avg_sq_exponents;
  const size_t moment_bytes = int8 ? n : 2 * n;
  const size_t exponent_bytes = int8 ? (n + kInt8Block - 1) / kInt8Block : 0;
  check_sources(op,
                {{"param_in", param_in, 4 * n},
                 {"exp_avg_in", exp_avg_in, moment_bytes},
                 {"exp_avg_sq_in", exp_avg_sq_in, moment_bytes},
                 {"exp_avg_in block exponents", exp_avg_exponents_in, exponent_bytes},
                 {"exp_avg_sq_in block exponents", exp_avg_sq_exponents_in, exponent_bytes},
                 {"grad", grad, n * (grad_type == kF32 ? 4 : 2)}},
                {{"param", param, 4 * n},
                 {"exp_avg", exp_avg, moment_bytes},
                 {"exp_avg_sq", exp_avg_sq, moment_bytes},
                 {"exp_avg block exponents", exp_avg_exponents, exponent_bytes},
                 {"exp_avg_sq block exponents", exp_avg_sq_exponents, exponent_bytes},
                 {"param_out16", param_out16, out_type == kNone ? 0 : n * 2}},
                5);
  CompactArgs args{};
  args.step.param_in = reinterpret_cast<const float*>(param_in);
  args.step.grad = reinterpret_cast<const void*>(grad);
  args.step.param = reinterpret_cast<float*>(param);
  args.step.param_out16 = out_type == kNone ? nullptr : reinterpret_cast<void*>(param_out16);
  args.step.grad_type = grad_type;
  args.step.out_type = out_type;
  args.moment_type = moment_type;
  args.exp_avg_in = reinterpret_cast<const void*>(exp_avg_in);
  args.exp_avg_sq_in = reinterpret_cast<const void*>(exp_avg_sq_in);
  args.exp_avg = reinterpret_cast<void*>(exp_avg);
  args.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
  args.exp_avg_exponents_in = reinterpret_cast<const uint8_t*>(exp_avg_exponents_in);
  args.exp_avg_sq_exponents_in = reinterpret_cast<const uint8_t*>(exp_avg_sq_exponents_in);
  args.exp_avg_exponents = reinterpret_cast<uint8_t*>(exp_avg_exponents);
  args.exp_avg_sq_exponents = reinterpret_cast<uint8_t*>(exp_avg_sq_exponents);
  args.key = key;
  args.position = uint32_t(position);  // the random words take positions mod 2^32
  return args;
}

void adam_step_compact(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_exponents,
                       uintptr_t exp_avg_sq, uintptr_t exp_avg_sq_exponents, uintptr_t param_out16, size_t n,
                       int moment_type, int grad_type, int out_type, uint32_t key, uint64_t position,
                       double grad_scale, double weight_decay, bool l2_decay, double decay_factor,
                       bool decoupled_decay, double beta1_weight, double beta2, double one_minus_beta2,
                       double bias_correction2_rsqrt, double eps, double neg_step_size, double m_bound,
                       uintptr_t param_in, uintptr_t exp_avg_in, uintptr_t exp_avg_exponents_in,
                       uintptr_t exp_avg_sq_in, uintptr_t exp_avg_sq_exponents_in) {
  if (n == 0) return;
  CompactArgs args = compact_buffer_args("adam_step_compact", param, grad, exp_avg, exp_avg_exponents,
                                         exp_avg_sq, exp_avg_sq_exponents, param_out16, n, moment_type,
                                         grad_type, out_type, key, position, param_in, exp_avg_in,
                                         exp_avg_exponents_in, exp_avg_sq_in, exp_avg_sq_exponents_in);
  set_scalars(args.step, grad_scale, weight_decay, l2_decay, decay_factor, decoupled_decay, beta1_weight,
              beta2, one_minus_beta2, bias_correction2_rsqrt, true, eps, neg_step_size, m_bound);
  const IsaKernels& k = kernels();
  // chunks start at multiples of kChunkElements, whole int8 blocks
  parallel_ranges(n, [&](size_t begin, size_t end) { k.adam_compact(args, begin, end); });
}

// The memory traffic of adam_step_compact on these buffers (IsaKernels::compact_traffic), for
// the benchmark's bandwidth limit. Overwrites the destinations.
void compact_traffic(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_exponents,
                     uintptr_t exp_avg_sq, uintptr_t exp_avg_sq_exponents, uintptr_t param_out16, size_t n,
                     int moment_type, int grad_type, int out_type) {
  if (n == 0) return;
  CompactArgs args = compact_buffer_args("compact_traffic", param, grad, exp_avg, exp_avg_exponents,
                                         exp_avg_sq, exp_avg_sq_exponents, param_out16, n, moment_type,
                                         grad_type, out_type, 0, 0, 0, 0, 0, 0, 0);
  const IsaKernels& k = kernels();
  parallel_ranges(n, [&](size_t begin, size_t end) { k.compact_traffic(args, begin, end); });
}

// The sum of squares in its canonical order, continued from `carried`: blocks of kNormBlock
// elements from the start of `data`, each summed by the kernel table's sum_squares (16 lanes in
// a fixed order, the same bits on every ISA), added to the running total one block at a time in
// block order. Because the order depends only on the element positions, a vector cut into
// pieces that are whole blocks (every piece but the last a multiple of kNormBlock) gives, with
// each piece continuing from the previous piece's result, the same bits as the vector in one
// call: the engine's gradient norm is the same whether a unit's state streams in pieces or
// stays whole, on any CPU and thread count.
double sq_norm(uintptr_t data, size_t n, int type, double carried) {
  check_type("sq_norm", "tensor", type, false);
  if (n == 0) return carried;
  check_pointer("sq_norm", "tensor", data);
  const void* ptr = reinterpret_cast<const void*>(data);
  const IsaKernels& k = kernels();
  const size_t blocks = (n + kNormBlock - 1) / kNormBlock;
  auto block_sum = [&](size_t b) {
    return k.sum_squares(ptr, type, b * kNormBlock, std::min(n, (b + 1) * kNormBlock));
  };
  if (n <= kSerialElements) {
    for (size_t b = 0; b < blocks; ++b) carried += block_sum(b);
    return carried;
  }
  std::vector<double> partial(blocks, 0.0);  // one slot per block, written by whichever thread ran it
  std::atomic<size_t> next{0};
  pool().run([&](int, int) {
    for (size_t first = next.fetch_add(kNormGrab); first < blocks; first = next.fetch_add(kNormGrab))
      for (size_t b = first; b < std::min(blocks, first + kNormGrab); ++b) partial[b] = block_sum(b);
  });
  for (double sum : partial) carried += sum;  // the calling thread, in block order
  return carried;
}

bool has_nonfinite(uintptr_t data, size_t n, int type) {
  check_type("has_nonfinite", "tensor", type, false);
  if (n == 0) return false;
  check_pointer("has_nonfinite", "tensor", data);
  const void* ptr = reinterpret_cast<const void*>(data);
  const IsaKernels& k = kernels();
  const size_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
  if (blocks == 1) return k.any_nonfinite(ptr, type, 0, n);
  std::atomic<bool> found{false};
  std::atomic<size_t> next{0};
  pool().run([&](int, int) {
    for (size_t b = next.fetch_add(1); b < blocks && !found.load(std::memory_order_relaxed);
         b = next.fetch_add(1))
      if (k.any_nonfinite(ptr, type, b * kReduceBlock, std::min(n, (b + 1) * kReduceBlock)))
        found.store(true);
  });
  return found.load();
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_num_threads: n must be >= 1, got " + std::to_string(n));
  pool().resize(n);
}

// STREAM-style bandwidth kernels for the benchmark (portable C++, auto-vectorized, on the
// same pool as Adam). triad: a = b + s*c (STREAM counts 24 bytes per element);
// scale_add: a = a + s*b, in place like Adam's state updates (12 bytes, no write-allocate).
void stream_triad(uintptr_t a, uintptr_t b, uintptr_t c, size_t n, double scalar) {
  // Pointers captured by value: with -fno-strict-aliasing a store through a captured
  // reference could alias the pointer itself and defeat vectorization.
  float* out = reinterpret_cast<float*>(a);
  const float* x = reinterpret_cast<const float*>(b);
  const float* y = reinterpret_cast<const float*>(c);
  const float s = float(scalar);
  parallel_ranges(n, [out, x, y, s](size_t begin, size_t end) {
    float* __restrict o = out;
    const float* __restrict xr = x;
    const float* __restrict yr = y;
    for (size_t i = begin; i < end; ++i) o[i] = xr[i] + s * yr[i];
  });
}

void stream_scale_add(uintptr_t a, uintptr_t b, size_t n, double scalar) {
  float* out = reinterpret_cast<float*>(a);
  const float* x = reinterpret_cast<const float*>(b);
  const float s = float(scalar);
  parallel_ranges(n, [out, x, s](size_t begin, size_t end) {
    float* __restrict o = out;
    const float* __restrict xr = x;
    for (size_t i = begin; i < end; ++i) o[i] = o[i] + s * xr[i];
  });
}

}  // namespace

PYBIND11_MODULE(_adam_ext, m) {
  m.doc() =
      "CPU Adam/AdamW kernel, squared norm and non-finite check over raw buffers (offload.optim.kernels "
      "wraps it)";
  using release = py::call_guard<py::gil_scoped_release>;
  m.attr("NORM_BLOCK") = kNormBlock;
  m.attr("F32") = int(kF32);
  m.attr("BF16") = int(kBF16);
  m.attr("F16") = int(kF16);
  m.attr("NONE") = int(kNone);
  m.def("adam_step", &adam_step, release(), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("param_out16"), py::arg("n"), py::arg("grad_type"),
        py::arg("out_type"), py::arg("grad_scale"), py::arg("weight_decay"), py::arg("l2_decay"),
        py::arg("decay_factor"), py::arg("decoupled_decay"), py::arg("beta1_weight"), py::arg("beta2"),
        py::arg("one_minus_beta2"), py::arg("bias_correction2_sqrt"), py::arg("eps"),
        py::arg("neg_step_size"), py::arg("param_in") = 0, py::arg("exp_avg_in") = 0,
        py::arg("exp_avg_sq_in") = 0);
  m.def("adam_traffic", &adam_traffic, release(), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("param_out16"), py::arg("n"), py::arg("grad_type"),
        py::arg("out_type"), py::arg("stream"), py::arg("param_in") = 0, py::arg("exp_avg_in") = 0,
        py::arg("exp_avg_sq_in") = 0);
  m.attr("MOMENT_BF16") = int(kMomentBF16);
  m.attr("MOMENT_INT8") = int(kMomentInt8);
  m.def("adam_step_compact", &adam_step_compact, release(), py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_exponents"), py::arg("exp_avg_sq"),
        py::arg("exp_avg_sq_exponents"), py::arg("param_out16"), py::arg("n"), py::arg("moment_type"),
        py::arg("grad_type"), py::arg("out_type"), py::arg("key"), py::arg("position"), py::arg("grad_scale"),
        py::arg("weight_decay"), py::arg("l2_decay"), py::arg("decay_factor"), py::arg("decoupled_decay"),
        py::arg("beta1_weight"), py::arg("beta2"), py::arg("one_minus_beta2"),
        py::arg("bias_correction2_rsqrt"), py::arg("eps"), py::arg("neg_step_size"), py::arg("m_bound"),
        py::arg("param_in") = 0, py::arg("exp_avg_in") = 0, py::arg("exp_avg_exponents_in") = 0,
        py::arg("exp_avg_sq_in") = 0, py::arg("exp_avg_sq_exponents_in") = 0);
  m.def("compact_traffic", &compact_traffic, release(), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_exponents"), py::arg("exp_avg_sq"), py::arg("exp_avg_sq_exponents"),
        py::arg("param_out16"), py::arg("n"), py::arg("moment_type"), py::arg("grad_type"),
        py::arg("out_type"));
  m.def("set_streaming_threshold", &set_streaming_threshold, py::arg("n"));
  m.def("streaming_threshold", [] { return g_stream_elements.load(); });
  m.attr("DEFAULT_STREAMING_THRESHOLD") = kDefaultStreamElements;
  m.def("sq_norm", &sq_norm, release(), py::arg("data"), py::arg("n"), py::arg("type"), py::arg("carried"));
  m.def("has_nonfinite", &has_nonfinite, release(), py::arg("data"), py::arg("n"), py::arg("type"));
  m.def("set_num_threads", &set_num_threads, release(), py::arg("n"));
  m.def("get_num_threads", [] { return pool().num_threads(); }, release());
  m.def("default_num_threads", &default_thread_count);
  m.def("active_isa", [] { return std::string(kernels().name); });
  m.def("available_isas", &available_isas);
  m.def("force_isa", &force_isa, py::arg("name"));
  m.def("stream_triad", &stream_triad, release(), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("n"),
        py::arg("scalar"));
  m.def("stream_scale_add", &stream_scale_add, release(), py::arg("a"), py::arg("b"), py::arg("n"),
        py::arg("scalar"));
}
