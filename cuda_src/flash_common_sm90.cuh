// flash_common_sm90.cuh -- shared-memory layout of the Hopper (sm_90a)
// passes, flash_fwd_sm90.cu and flash_bwd_sm90.cu, on top of
// flash_common_f16.cuh and flash_wgmma.cuh.
//
// wgmma reads its shared-memory operands through descriptors in one of a few
// canonical layouts; these kernels use the 128-byte swizzle throughout.  A
// [ROWS][cols] tile of elem_t is split into blocks of 64 columns (128-byte
// rows), stored one after another ([cols/64][ROWS][64]); inside a block the
// eight 16-byte chunks of row r are permuted, chunk c stored at c ^ (r % 8).
// The tensor core undoes the permutation from address bits 4-6 and 7-9, so
// every block must start on a 1024-byte boundary (8 rows of 128 bytes).  The
// same bytes serve as a K-major operand (the 64 contiguous columns are the
// reduction dimension: Qi, Kj in Qi Kj^T) and as an MN-major one (they are
// the output dimension: Vj in Pij Vj).  The permutation also makes the
// 16-byte cp.async stores of a row and the paired 32-bit stores of dS^T
// free of bank conflicts.

#pragma once
#include "flash_common_f16.cuh"
#include "flash_wgmma.cuh"

// SWZ_COLS: columns of one swizzle block (128 bytes).
#ifndef SWZ_COLS
#error "SWZ_COLS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define SWZ_ROW_BYTES 128
// SMEM_ALIGN: swizzle pattern period (8 rows of 128 bytes).
#ifndef SMEM_ALIGN
#error "SMEM_ALIGN must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define HD_ATOMS ((HEAD_DIM + SWZ_COLS - 1) / SWZ_COLS)
#define HDP (HD_ATOMS * SWZ_COLS)                   // head dim as stored (whole swizzle blocks)
// WG_THREADS: threads of a warpgroup.
#ifndef WG_THREADS
#error "WG_THREADS must be defined (pycudaflash.compiler.LAYOUT)"
#endif

// The dynamic shared memory rounded up to the swizzle period (the launcher
// allocates SMEM_ALIGN bytes of slack).
__device__ __forceinline__ unsigned char *swizzle_base(unsigned char *raw) {
    return raw + ((SMEM_ALIGN - (smem_addr(raw) & (SMEM_ALIGN - 1))) & (SMEM_ALIGN - 1));
}

// Offset (elements) of element (r, c) in a swizzled [HD_ATOMS][ROWS][64] tile.
template <int ROWS>
__device__ __forceinline__ int swz(int r, int c) {
    return (c / SWZ_COLS) * ROWS * SWZ_COLS + r * SWZ_COLS + ((((c % SWZ_COLS) >> 3) ^ (r & 7)) << 3) + (c & 7);
}

// Copy rows [row0, row0 + ROWS) x columns [0, HEAD_DIM) of a row-major
// global matrix into a swizzled tile; rows past nrows and columns past ncols
// are zero-filled.  vec: 16-byte cp.async (as load_tile_h).
template <int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_swz(elem_t *smem, const elem_t *gmem, i64 stride, int row0, int nrows,
                                              int ncols, bool vec, int tid) {
    if (vec) {
        constexpr int CHUNKS = HEAD_DIM / ELEMS_PER_16B;
        constexpr int ITERS = (ROWS * CHUNKS + NTHREADS - 1) / NTHREADS;
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int c = tid + it * NTHREADS;
            if ((ROWS * CHUNKS) % NTHREADS == 0 || c < ROWS * CHUNKS) {
                const int r = c / CHUNKS, col = ELEMS_PER_16B * (c % CHUNKS);
                const bool ok = (row0 + r < nrows) && (col < ncols);
                const elem_t *src = ok ? gmem + (i64)(row0 + r) * stride + col : gmem;
                cp_async16((float *)(smem + swz<ROWS>(r, col)), (const float *)src, ok);
            }
        }
    } else {
        const elem_t zero = from_float(0.f);
        for (int c = tid; c < ROWS * HEAD_DIM; c += NTHREADS) {
            const int r = c / HEAD_DIM, col = c % HEAD_DIM;
            const bool ok = (row0 + r < nrows) && (col < ncols);
            smem[swz<ROWS>(r, col)] = ok ? gmem[(i64)(row0 + r) * stride + col] : zero;
        }
    }
}

// Make this thread's shared-memory writes (cp.async, st.shared) visible to
// the tensor core's asynchronous proxy; a barrier then publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

