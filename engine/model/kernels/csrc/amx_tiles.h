// What every AMX kernel shares (prefill_attention_amx.cpp, bf16_linear_amx.cpp): the CPU
// check, Linux's grant of the tile registers, the one tile configuration they all use
// (8 tiles of 16 rows x 64 bytes), and a 16x16 dword transpose for packing operands and
// unpacking results. Compiled for AMX whatever the build machine (a target attribute);
// callers ask amx_available() (ops.h) before running a tile instruction.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define KVSERVE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define KVSERVE_HAVE_AMX 1

namespace kvserve::amx {

constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileBytes = 64;  // bytes of every tile row: 32 bf16, or 16 float32 / pairs

inline bool cpu_has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  // Read from CPUID rather than __builtin_cpu_supports: GCC 12's answers "amx-bf16" with 0.
  return (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// Linux (5.16+) lets a process use the 8 KiB tile register file only after asking; the
// grant covers every thread of the process.
inline bool kernel_grants_tile_data() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

// Palette 1 with all 8 tiles at their full 16 rows x 64 bytes: every product here uses
// whole tiles (operands are padded with zeros instead).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tile configuration is per thread: a worker loads it before its first tile instruction
// and releases the tiles when done.
KVSERVE_AMX_TARGET inline void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.bytes_per_row[i] = kTileBytes;
    config.rows[i] = kTileRows;
  }
  // GCC 12 does not see ldtilecfg read the struct and drops the stores above; the empty
  // asm that "uses" the memory keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

KVSERVE_AMX_TARGET inline void release_tiles() { _tile_release(); }

// In place: row i of the result is column i of the 16x16 dword matrix r (unpacks within
// 128-bit lanes make 4x4 blocks, two lane shuffles put the blocks in place).
KVSERVE_AMX_TARGET inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

}  // namespace kvserve::amx

#endif
