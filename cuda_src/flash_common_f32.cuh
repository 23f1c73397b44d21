// flash_common_f32.cuh -- the float32 passes (flash_fwd.cu, flash_bwd.cu)
// under the names of flash_common_f16.cuh, so that the kernels they share
// with the 16-bit passes (flash_fwd_mma.cuh, flash_bwd_rows.cuh) are
// written once: elem_t is float, its conversions are the identity, tiles are
// [rows][LDH] with LDH = LD_HEAD (loaded by flash_common.cuh's load_tile),
// the softmax exponentiates with exp2f.

#pragma once
#include "flash_common.cuh"

#define ELEM_F32 1  // (the kernels both serve pick their products by it)
typedef float elem_t;
#define LDH LD_HEAD

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
__device__ __forceinline__ float softmax_exp2(float x) { return exp2f(x); }
typedef float smem_t;  // the type the kernels declare their dynamic shared memory with
