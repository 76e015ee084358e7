// CRC32C (Castagnoli), the checksum of every block the NVMe tier writes.
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (about 8 bytes a cycle-latency per
// thread, far above one disk's bandwidth, and run on the I/O threads in parallel), else a
// table. Both give identical results; the tests check them against each other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zoffload::internal {

/// CRC32C of `len` bytes, continuing from `crc` (0 for a fresh checksum).
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);

/// The table implementation alone (for tests and for CPUs without SSE4.2).
uint32_t Crc32cPortable(const void* data, size_t len, uint32_t crc = 0);

/// True when Crc32c uses the hardware instruction.
bool Crc32cIsHardware();

}  // namespace zoffload::internal
