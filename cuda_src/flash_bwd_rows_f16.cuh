// flash_bwd_rows_f16.cuh -- what the two dK/dV kernels of the float16 /
// bfloat16 backward (flash_bwd_f16.cu's mma.sync one and flash_bwd_sm90.cu's
// wgmma one) share: the kernels around them (flash_bwd_rows.cuh:
// preprocess, deterministic dQ, dQ conversion, sums of grouped heads) and
// dq_add_pair, the float32 atomics by which they add dQi.

#pragma once
#include "flash_common_f16.cuh"

// Add a pair (d, d+1) of one dQ row into the float32 accumulator.
__device__ __forceinline__ void dq_add_pair(float *row, int d, int D, float x0, float x1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if ((D & 1) == 0 && d + 1 < D) {  // 8-byte aligned pair: one vector atomic
        atomicAdd(reinterpret_cast<float2 *>(row + d), make_float2(x0, x1));
        return;
    }
#endif
    if (d < D) atomicAdd(row + d, x0);
    if (d + 1 < D) atomicAdd(row + d + 1, x1);
}

#include "flash_bwd_rows.cuh"
