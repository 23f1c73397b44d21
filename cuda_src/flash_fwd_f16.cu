// flash_fwd_f16.cu -- FlashAttention forward pass, float16 / bfloat16 on the
// tensor cores (mma.sync.m16n8k16, float32 accumulators): the kernel of
// flash_fwd_mma.cuh, where the algorithm, tiles and masks are described.
// Pij is rounded to the input type for Pij Vj; Oi is rounded once, at the
// end.
//
// Tile layout: FWD_WARPS warps of FWD_MT 16-row blocks and Bc keys a step
// (all from pycudaflash.compiler); shared rows of LDH = HEAD_DIM + 8
// elements (ldmatrix and cp.async without bank conflicts).

#include "flash_common_f16.cuh"

#ifndef FWD_MT
#error "FWD_MT must be defined (pycudaflash.compiler.defines)"
#endif
#ifndef FWD_MIN_BLOCKS
#define FWD_MIN_BLOCKS 1
#endif

#include "flash_fwd_mma.cuh"
