// CRC-32C (Castagnoli), the checksum of swap files.
//
// crc32c_extend(crc, data, n) continues a finished checksum `crc` (0 for an empty prefix)
// over n more bytes, like zlib's crc32(): crc32c_extend(0, "123456789", 9) == 0xE3069283.
// The hardware path (SSE4.2 crc32 instruction, three interleaved lanes) is chosen at run
// time from what the CPU reports; the portable table path gives bit-identical results.
#pragma once
#include <cstddef>
#include <cstdint>

namespace offload_aio {

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// Checksum of A||B from crc(A), crc(B) and len(B): lets workers checksum pieces in any order.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
bool crc32c_hardware();

}  // namespace offload_aio
