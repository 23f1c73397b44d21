// flash_bwd_warps.cuh -- the tiles of the mma.sync dK/dV kernels, float32
// (flash_bwd.cu) and float16 / bfloat16 (flash_bwd_f16.cu): Bc = BWD_BC
// keys x Br = BWD_BR query rows per step, BWD_WARPS warps, and the warp grids
// of the three product shapes, Sij and dPij (Br x Bc), dVj and dKj (Bc x
// HEAD_DIM), dQi (Br x HEAD_DIM): each spreads its output tile over the
// warps as a grid of (16*MT)-row x (8*NT)-column warp tiles.

#pragma once

// Tile sizes come from pycudaflash.compiler (-D), the one place they are chosen.
#ifndef BWD_WARPS
#error "BWD_WARPS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define BWD_THREADS (BWD_WARPS * WARP_SIZE)
#ifndef BWD_BR
#error "BWD_BR must be defined (pycudaflash.compiler.defines)"
#endif
#ifndef BWD_BC
#error "BWD_BC must be defined (pycudaflash.compiler.defines)"
#endif

// Warp grids of the three product shapes.
#define SW_M (BWD_BR / 16)          // Sij, dPij: row groups
#define SW_N (BWD_WARPS / SW_M)     //            column groups
#define NT_S (BWD_BC / (8 * SW_N))  //            8-wide tiles per warp
// dKj, dVj and dQi warp tiles hold KV_MT / Q_MT 16-row blocks: each B
// fragment then feeds that many products (less shared-memory traffic).
// (2 where that leaves each warp a whole number of 16-column pairs; the
// float32 pass sets 1.)
#ifndef KV_MT
#if BWD_BC % 32 == 0 && BWD_WARPS % (BWD_BC / 32) == 0 && (HEAD_DIM / (8 * (BWD_WARPS / (BWD_BC / 32)))) % 2 == 0
#define KV_MT 2
#else
#define KV_MT 1
#endif
#endif
#ifndef Q_MT
#if BWD_BR % 32 == 0 && BWD_WARPS % (BWD_BR / 32) == 0 && (HEAD_DIM / (8 * (BWD_WARPS / (BWD_BR / 32)))) % 2 == 0
#define Q_MT 2
#else
#define Q_MT 1
#endif
#endif
#define KW_M (BWD_BC / (16 * KV_MT))  // dKj, dVj
#define KW_N (BWD_WARPS / KW_M)
#define NT_KV (HEAD_DIM / (8 * KW_N))
#define QW_M (BWD_BR / (16 * Q_MT))   // dQi
#define QW_N (BWD_WARPS / QW_M)
#define NT_Q (HEAD_DIM / (8 * QW_N))

static_assert(SW_M * SW_N == BWD_WARPS && NT_S * 8 * SW_N == BWD_BC, "Sij warp grid covers the tile");
static_assert(KW_M * KW_N == BWD_WARPS && KW_M * 16 * KV_MT == BWD_BC && NT_KV * 8 * KW_N == HEAD_DIM,
              "dKj warp grid covers the tile");
static_assert(QW_M * QW_N == BWD_WARPS && QW_M * 16 * Q_MT == BWD_BR && NT_Q * 8 * QW_N == HEAD_DIM,
              "dQi warp grid covers the tile");
static_assert(BWD_BR % 16 == 0 && BWD_BC % 16 == 0, "tiles are whole 16-wide k steps");

