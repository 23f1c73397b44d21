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

// SWZ_COLS (flash_common_f16.cuh): columns of one swizzle block (128 bytes).
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

// D[64 x N] = A B^T over the head dim (HEAD_DIM/16 k steps of 16; zero-filled
// columns past D add nothing), A and B K-major swizzled tiles: a_addr is this
// warpgroup's first row of A (a tile of A_ROWS rows), b_addr the first row of
// B (B_ROWS rows, N of them used).  JIT: the addresses pass through an empty
// asm each step, so that the compiler forms each step's descriptors just in
// time instead of holding all of them in registers.
template <int A_ROWS, int B_ROWS, bool JIT = false, int R>
__device__ __forceinline__ void wgmma_over_head_dim(float (&d)[R], u32 a_addr, u32 b_addr) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        if (JIT) asm volatile("" : "+r"(a_addr), "+r"(b_addr));
        const u32 blk = (ks * 16) / SWZ_COLS, in_blk = ((ks * 16) % SWZ_COLS) * 2;
        wgmma_ss(d, smem_desc_sw128(a_addr + blk * A_ROWS * SWZ_ROW_BYTES + in_blk, 16),
                 smem_desc_sw128(b_addr + blk * B_ROWS * SWZ_ROW_BYTES + in_blk, 16), ks > 0);
    }
}

// D += A B for A in registers (KK k steps: the packed C fragments of a previous
// product, pack_frags) and B the swizzled tile of 16*KK rows at b_addr, read as
// the MN-major operand (its 64-column blocks 16*KK rows apart).
template <int KK, int R>
__device__ __forceinline__ void wgmma_regs_a(float (&d)[R], const u32 (&a)[KK][4], u32 b_addr) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
        wgmma_rs_tb(d, a[kk], smem_desc_sw128(b_addr + kk * 16 * SWZ_ROW_BYTES, KK * 16 * SWZ_ROW_BYTES), 1);
}

// C fragments (8 floats a 16-wide k step) rounded to elem_t and packed into
// the A fragments of the KK k steps of the next product.
template <int KK>
__device__ __forceinline__ void pack_frags(u32 (&a)[KK][4], const float (&c)[8 * KK]) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[kk][e] = pack2(c[8 * kk + 2 * e], c[8 * kk + 2 * e + 1]);
}

// Keep A fragments' registers untouched until the product reading them has finished.
template <int KK>
__device__ __forceinline__ void hold_frag(u32 (&a)[KK][4]) {
#pragma unroll
    for (int i = 0; i < KK; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// Make this thread's shared-memory writes (cp.async, st.shared) visible to
// the tensor core's asynchronous proxy; a barrier then publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// TMA, mbarriers, register reallocation and named barriers.
#include "flash_tma.cuh"
