#include "aio/crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define OFFLOAD_X86 1
#endif

namespace offload_aio {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, bit-reflected

struct Table {
  uint32_t t[8][256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Table& table() {
  static const Table tab;
  return tab;
}

// Raw (not inverted) register update, slicing-by-8.
uint32_t sw_raw(uint32_t c, const uint8_t* p, size_t n) {
  const Table& T = table();
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = T.t[7][w & 0xff] ^ T.t[6][(w >> 8) & 0xff] ^ T.t[5][(w >> 16) & 0xff] ^ T.t[4][(w >> 24) & 0xff] ^
        T.t[3][(w >> 32) & 0xff] ^ T.t[2][(w >> 40) & 0xff] ^ T.t[1][(w >> 48) & 0xff] ^ T.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ T.t[0][(c ^ *p++) & 0xff];
  return c;
}

uint32_t sw_extend(uint32_t crc, const uint8_t* p, size_t n) { return ~sw_raw(~crc, p, n); }

// GF(2) 32x32 matrices for crc32c_combine (appending len_b zero bytes to A's register).
uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (int i = 0; vec; ++i, vec >>= 1)
    if (vec & 1) sum ^= mat[i];
  return sum;
}
void gf2_square(uint32_t* out, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) out[n] = gf2_times(mat, mat[n]);
}

// op[k]: the operator that appends 2^k zero bytes to a CRC register (k < 64), built once.
struct ZeroOperators {
  uint32_t op[64][32];
  ZeroOperators() {
    uint32_t one_bit[32], two_bits[32], four_bits[32];
    one_bit[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; ++n) one_bit[n] = 1u << (n - 1);
    gf2_square(two_bits, one_bit);
    gf2_square(four_bits, two_bits);
    gf2_square(op[0], four_bits);  // eight zero bits: one byte
    for (int k = 1; k < 64; ++k) gf2_square(op[k], op[k - 1]);
  }
};
const ZeroOperators& zero_operators() {
  static const ZeroOperators ops;
  return ops;
}

#ifdef OFFLOAD_X86
__attribute__((target("sse4.2"))) uint32_t hw_raw(uint32_t c32, const uint8_t* p, size_t n) {
  uint64_t c = c32;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t r = static_cast<uint32_t>(c);
  while (n--) r = _mm_crc32_u8(r, *p++);
  return r;
}

// Three independent lanes hide the instruction's 3-cycle latency (about 3x a single lane);
// the lane checksums are joined with crc32c_combine, so the result is plain CRC-32C.
__attribute__((target("sse4.2"))) uint32_t hw_extend(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < 3 * 4096) return ~hw_raw(~crc, p, n);
  const size_t lane = (n / 3) & ~size_t(7);
  uint64_t a = ~crc & 0xffffffffu, b = 0xffffffffu, c = 0xffffffffu;
  const uint8_t* pa = p;
  const uint8_t* pb = p + lane;
  const uint8_t* pc = p + 2 * lane;
  for (size_t i = 0; i < lane; i += 8) {
    uint64_t wa, wb, wc;
    std::memcpy(&wa, pa + i, 8);
    std::memcpy(&wb, pb + i, 8);
    std::memcpy(&wc, pc + i, 8);
    a = _mm_crc32_u64(a, wa);
    b = _mm_crc32_u64(b, wb);
    c = _mm_crc32_u64(c, wc);
  }
  const size_t rest = n - 3 * lane;
  uint32_t cc = hw_raw(static_cast<uint32_t>(c), pc + lane, rest);
  uint32_t ra = ~static_cast<uint32_t>(a), rb = ~static_cast<uint32_t>(b), rc = ~cc;
  return crc32c_combine(crc32c_combine(ra, rb, lane), rc, lane + rest);
}

bool detect_hw() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#else
bool detect_hw() { return false; }
#endif

const bool g_hw = detect_hw();

}  // namespace

bool crc32c_hardware() { return g_hw; }

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // One operator per set bit of len_b (a few dozen XORs each) instead of squaring matrices on
  // every call: the I/O engine joins a checksum per block of every read and write.
  const ZeroOperators& zeros = zero_operators();
  for (int k = 0; len_b; ++k, len_b >>= 1)
    if (len_b & 1) crc_a = gf2_times(zeros.op[k], crc_a);
  return crc_a ^ crc_b;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
#ifdef OFFLOAD_X86
  if (g_hw) return hw_extend(crc, p, n);
#endif
  return sw_extend(crc, p, n);
}

// For tests: the portable path regardless of the CPU.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return sw_extend(crc, static_cast<const uint8_t*>(data), n);
}

}  // namespace offload_aio
