// AMX tile setup shared by the CPU kernels that multiply with the tile unit: the permission the
// kernel must grant a process before it touches tile registers, and the one tile shape they use.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedllm_amx {

#ifdef PAGEDLLM_AMX

// Linux hands out the tile registers' state on request (arch_prctl), once per process.
inline bool request_amx() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: a bf16 A tile (16 x 32), a bf16-pair B tile (16 pairs x 16) or an
// fp32 accumulator (16 x 16). The configuration is per thread, and oneDNN's kernels load their own
// on the same threads, so a kernel configures at the start of each parallel region it runs tiles in.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

#endif  // PAGEDLLM_AMX

// Whether this build and this process may use AMX-BF16 tiles (asked once).
inline bool amx_ready() {
#ifdef PAGEDLLM_AMX
  static const bool ready = request_amx();
  return ready;
#else
  return false;
#endif
}

}  // namespace pagedllm_amx
