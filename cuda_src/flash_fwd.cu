// flash_fwd.cu -- FlashAttention forward pass, float32 (split-TF32 tensor
// cores): the kernel of flash_fwd_mma.cuh, where the algorithm, tiles and
// masks are described.
//
// Tile layout: FWD_WARPS = 4 warps of one 16-row block each, so Br = 64;
// Bc = 64 keys (32 for HEAD_DIM 256, to bound registers); shared rows of
// HEAD_DIM + SMEM_PAD floats.

#include "flash_common_f32.cuh"

#define FWD_MT 1  // 16-row blocks per warp
// Blocks per multiprocessor the register allocation must allow.
#if HEAD_DIM <= 64
#define FWD_MIN_BLOCKS 3
#elif HEAD_DIM <= 128
#define FWD_MIN_BLOCKS 2
#else
#define FWD_MIN_BLOCKS 1
#endif

#include "flash_fwd_mma.cuh"
