// flash_common_f16.cuh -- pieces shared by the float16/bfloat16 passes
// (flash_fwd_f16.cu, flash_bwd_f16.cu and the Hopper passes), on top of
// flash_common.cuh (masks, cp.async); the defines:
//   ELEM_BF16  0: float16 inputs and outputs, 1: bfloat16.
//   HEAD_DIM   padded head dim of the variant (64, 96, 128, 192, 256).
//
// Matrix products run as mma.sync.m16n8k16 with float32 accumulators.  Lane
// = 4*g + t (g = lane/4, t = lane%4); each 32-bit register holds two 16-bit
// values, the lower column/k index in the low half:
//   A (16x16, row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (16x8, k x n):      b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C (16x8):             c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
// The C fragments of two adjacent 8-column tiles, packed in pairs, are exactly
// the A fragment of the 16-wide k step they cover; P and dS therefore feed the
// next product from registers where the layout allows.
//
// Shared-memory tiles are row-major with rows padded by 8 elements (16 bytes):
// a row stride of 16 (mod 128) bytes puts the eight 16-byte rows one ldmatrix
// phase reads in eight different bank groups, so every ldmatrix (plain and
// transposed) and every 16-byte cp.async is free of bank conflicts.

#pragma once
#include "flash_common.cuh"

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef ELEM_BF16
#error "ELEM_BF16 must be defined (pycudaflash.compiler.defines)"
#endif
static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM is a whole number of 16-wide k steps");

#define ELEM_F32 0  // (see flash_common_f32.cuh)

// elem_t, its name in the mma instructions, and its conversions from and to
// float (ELEM_FN picks the intrinsic of the type; from_floats: two floats,
// rounded, as one packed pair).
#if ELEM_BF16
typedef __nv_bfloat16 elem_t;
#define MMA_ELEM "bf16"
#define ELEM_FN(half_fn, bf16_fn) bf16_fn
#else
typedef __half elem_t;
#define MMA_ELEM "f16"
#define ELEM_FN(half_fn, bf16_fn) half_fn
#endif
__device__ __forceinline__ float to_float(elem_t x) { return ELEM_FN(__half2float, __bfloat162float)(x); }
__device__ __forceinline__ elem_t from_float(float x) { return ELEM_FN(__float2half_rn, __float2bfloat16_rn)(x); }
__device__ __forceinline__ auto from_floats(float lo, float hi) {
    return ELEM_FN(__floats2half2_rn, __floats2bfloat162_rn)(lo, hi);
}

// LEAN_REGISTERS (set by pycudaflash.compiler per architecture: 1 before
// sm_90): sm_8x allocates registers differently, so there the loops over the
// head dim are unrolled less (no software pipelining of the fragment loads),
// which keeps every variant free of local-memory spills; sm_90 gets the full
// schedule.
#ifndef LEAN_REGISTERS
#error "LEAN_REGISTERS must be defined (pycudaflash.compiler.defines)"
#endif

// SMEM_PAD_H: elements of padding per shared row.
#ifndef SMEM_PAD_H
#error "SMEM_PAD_H must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define LDH (HEAD_DIM + SMEM_PAD_H)         // row stride of [rows][HEAD_DIM] tiles
#define ELEMS_PER_16B 8
typedef unsigned char smem_t;  // the type the kernels declare their dynamic shared memory with

// Two floats rounded to elem_t and packed (lo in the low half).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    auto v = from_floats(lo, hi);
    return *reinterpret_cast<u32 *>(&v);
}

// c += a * b, one m16n8k16 tile.
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_ELEM "." MMA_ELEM ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of a 16-wide k step from the C fragments of its two 8-column
// tiles (c0: columns 0-7, c1: 8-15), rounded to elem_t.
__device__ __forceinline__ void pack_a(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

// c0 += a * b[0..1] and c1 += a * b[2..3]: the two adjacent 8-column tiles of
// a load_b_nk / load_b_kn fragment.
__device__ __forceinline__ void mma16816_x2(float (&c0)[4], float (&c1)[4], const u32 (&a)[4], const u32 (&b)[4]) {
    mma16816(c0, a, b[0], b[1]);
    mma16816(c1, a, b[2], b[3]);
}

__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

// Four 8x8 matrices; lane l gives the row address of matrix l/8, row l%8.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const elem_t *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const elem_t *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// A fragment (16 x 16) of a row-major tile: rows m0.., columns k0...
__device__ __forceinline__ void load_a(u32 (&a)[4], const elem_t *tile, int ld, int m0, int k0, int lane) {
    ldsm_x4(a, tile + (m0 + (lane & 15)) * ld + k0 + ((lane >> 4) << 3));
}

// A fragment (16 x 16) of the transpose of a row-major tile T: A(m, k) = T(k0 + k, m0 + m).
__device__ __forceinline__ void load_a_t(u32 (&a)[4], const elem_t *tile, int ld, int m0, int k0, int lane) {
    // matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
    const int k = k0 + (lane & 7) + ((lane >> 4) << 3);
    const int m = m0 + (((lane >> 3) & 1) << 3);
    ldsm_x4_t(a, tile + k * ld + m);
}

// B fragments of two adjacent 8-column tiles n0.., n0+8.. over k0..k0+15,
// for B(k, n) = T(n, k) with T row-major ([n][k], e.g. K for Q K^T):
// b[0], b[1] for columns n0..n0+7 and b[2], b[3] for n0+8..n0+15.
__device__ __forceinline__ void load_b_nk(u32 (&b)[4], const elem_t *tile, int ld, int n0, int k0, int lane) {
    const int n = n0 + (lane & 7) + ((lane >> 4) << 3);
    const int k = k0 + (((lane >> 3) & 1) << 3);
    ldsm_x4(b, tile + n * ld + k);
}

// The same for B(k, n) = T(k, n) with T row-major ([k][n], e.g. V for P V).
__device__ __forceinline__ void load_b_kn(u32 (&b)[4], const elem_t *tile, int ld, int n0, int k0, int lane) {
    const int k = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
    const int n = n0 + ((lane >> 4) << 3);
    ldsm_x4_t(b, tile + k * ld + n);
}

// One 16-wide k step (k0..k0+15) of C += A B for a warp tile of MT 16-row
// blocks x NP 16-column pairs: A from rows m0 + 16mt.. of a row-major tile
// (row stride lda), B from columns n0.. of a row-major tile T (row stride
// ldb), T = B^T ([n][k], B_KN false: load_b_nk) or B itself (B_KN: load_b_kn).
template <int MT, int NP, bool B_KN>
__device__ __forceinline__ void mma_kstep(float (&c)[MT][2 * NP][4], const elem_t *A, int lda, int m0,
                                          const elem_t *T, int ldb, int n0, int k0, int lane) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a(a[mt], A, lda, m0 + 16 * mt, k0, lane);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
        u32 b[4];
        if (B_KN)
            load_b_kn(b, T, ldb, n0 + 16 * np, k0, lane);
        else
            load_b_nk(b, T, ldb, n0 + 16 * np, k0, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816_x2(c[mt][2 * np], c[mt][2 * np + 1], a[mt], b);
    }
}

// One 16-wide k step (ks) of Sij = Qi Kj^T and dPij = dOi Vj^T, the
// backward's two score products: rows m0..m0+15 of Qi, dOi against the NP
// 16-row pairs of Kj, Vj from row n0 (s, dp: their 2*NP C fragments).
template <int NP>
__device__ __forceinline__ void mma_s_dp_kstep(float (&s)[2 * NP][4], float (&dp)[2 * NP][4], const elem_t *Qi,
                                               const elem_t *dOi, const elem_t *Kj, const elem_t *Vj, int m0, int n0,
                                               int ks, int lane) {
    u32 aq[4], ado[4];
    load_a(aq, Qi, LDH, m0, 16 * ks, lane);
    load_a(ado, dOi, LDH, m0, 16 * ks, lane);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
        u32 bk[4], bv[4];
        load_b_nk(bk, Kj, LDH, n0 + 16 * np, 16 * ks, lane);
        load_b_nk(bv, Vj, LDH, n0 + 16 * np, 16 * ks, lane);
        mma16816_x2(s[2 * np], s[2 * np + 1], aq, bk);
        mma16816_x2(dp[2 * np], dp[2 * np + 1], ado, bv);
    }
}

// Offset (elements) of element (r, c) in a 128-byte-swizzled [HD_ATOMS][ROWS][64]
// tile, the layout of the Hopper passes (described in flash_common_sm90.cuh).
#ifndef SWZ_COLS
#error "SWZ_COLS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
template <int ROWS>
__device__ __forceinline__ int swz(int r, int c) {
    return (c / SWZ_COLS) * ROWS * SWZ_COLS + r * SWZ_COLS + ((((c % SWZ_COLS) >> 3) ^ (r & 7)) << 3) + (c & 7);
}
constexpr bool SWIZZLED = true;  // (load_tile's layout argument)

// load_tile's 16-byte copies; CHECKED: test each chunk's row and column
// (zero-filling the invalid ones), else copy every chunk; BITS: also test
// each row's bit in row_bits (a tile holding keys that no row may see, rare:
// a loop that keeps few registers).
template <int ROWS, int NTHREADS, bool SWZ, bool CHECKED, bool BITS = false, bool ROLLED = false>
__device__ __forceinline__ void copy_chunks(elem_t *smem, const elem_t *gmem, i64 stride, int row0, int nrows,
                                            int ncols, int tid, int row_lo, const u32 *row_bits) {
    constexpr int CHUNKS = HEAD_DIM / ELEMS_PER_16B;  // 16-byte chunks per row
    constexpr int ITERS = (ROWS * CHUNKS + NTHREADS - 1) / NTHREADS;
#pragma unroll(ROLLED ? 1 : ITERS)
    for (int it = 0; it < ITERS; ++it) {
        const int c = tid + it * NTHREADS;
        if ((ROWS * CHUNKS) % NTHREADS == 0 || c < ROWS * CHUNKS) {
            const int r = c / CHUNKS, col = ELEMS_PER_16B * (c % CHUNKS);
            const bool ok =
                !CHECKED || ((row0 + r >= row_lo) && (row0 + r < nrows) && (col < ncols) && (!BITS || bit_set(row_bits, row0 + r)));
            const elem_t *src = ok ? gmem + (i64)(row0 + r) * stride + col : gmem;
            cp_async16((float *)(smem + (SWZ ? swz<ROWS>(r, col) : r * LDH + col)), (const float *)src, ok);
        }
    }
}

// Copy rows [row0, row0 + ROWS) x columns [0, HEAD_DIM) of a row-major
// global matrix (row stride `stride` elements, rows [row_lo, nrows) whose
// bit is set in row_bits (bit_set) and `ncols` = D columns valid) into a
// shared tile, row-major [ROWS][LDH] or
// (SWZ) swizzled; everything outside is zero-filled.  vec: 16-byte cp.async
// (D % 8 == 0, 16-byte aligned base and row stride); otherwise element-wise
// loads and stores (visible after the next barrier).  WHOLE: a tile whose
// every element is valid (the same answer in every thread) copies without a
// test per chunk (a second copy loop: faster where registers allow it).
// LEAN_BITS: a tile with row bits takes a rolled copy loop of its own.
template <int ROWS, int NTHREADS, bool SWZ = false, bool WHOLE = false, bool LEAN_BITS = false>
__device__ __forceinline__ void load_tile(elem_t *smem, const elem_t *gmem, i64 stride, int row0, int nrows, int ncols,
                                          bool vec, int tid, int row_lo = 0, const u32 *row_bits = nullptr) {
    if (bits_all_set(row_bits, max(row0, row_lo), min(row0 + ROWS, nrows))) row_bits = nullptr;
    if (vec) {
        if (LEAN_BITS && row_bits)  // (a copy loop of its own that keeps few registers)
            copy_chunks<ROWS, NTHREADS, SWZ, true, true, true>(smem, gmem, stride, row0, nrows, ncols, tid, row_lo,
                                                              row_bits);
        else if (WHOLE && row0 >= row_lo && row0 + ROWS <= nrows && ncols >= HEAD_DIM && !row_bits)
            copy_chunks<ROWS, NTHREADS, SWZ, false>(smem, gmem, stride, row0, nrows, ncols, tid, row_lo, nullptr);
        else
            copy_chunks<ROWS, NTHREADS, SWZ, true, !LEAN_BITS>(smem, gmem, stride, row0, nrows, ncols, tid, row_lo,
                                                              row_bits);
    } else {
        const elem_t zero = from_float(0.f);
        for (int c = tid; c < ROWS * HEAD_DIM; c += NTHREADS) {
            const int r = c / HEAD_DIM, col = c % HEAD_DIM;
            const bool ok = (row0 + r >= row_lo) && (row0 + r < nrows) && (col < ncols) && bit_set(row_bits, row0 + r);
            smem[SWZ ? swz<ROWS>(r, col) : r * LDH + col] = ok ? gmem[(i64)(row0 + r) * stride + col] : zero;
        }
    }
}

// 2^x for x <= 0 or -inf (softmax exponents): the hardware approximation,
// flushing results below the smallest normal float to 0.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The softmax's 2^x in the kernels that float32 shares (flash_common_f32.cuh).
__device__ __forceinline__ float softmax_exp2(float x) { return exp2_fast(x); }

// Store two adjacent output columns (d, d+1) of one row; pairs are 4-byte
// aligned when vec holds (D even, aligned rows).  The _scaled form stores x * s.
__device__ __forceinline__ void store_pair(elem_t *row, int d, int D, float x0, float x1, bool vec) {
    if (vec && d + 1 < D) {
        *reinterpret_cast<u32 *>(row + d) = pack2(x0, x1);
    } else {
        if (d < D) row[d] = from_float(x0);
        if (d + 1 < D) row[d + 1] = from_float(x1);
    }
}
__device__ __forceinline__ void store_pair_scaled(elem_t *row, int d, int D, float x0, float x1, float s, bool vec) {
    store_pair(row, d, D, x0 * s, x1 * s, vec);
}

// A dense float mask stored in elem_t, converted to the float32 the kernels
// read: dst is contiguous with shape (n0, n1, n2, n3), src has element
// strides s0..s3 (0 on broadcast dimensions).
LAUNCH_SHAPE(flash_convert_mask, GRID_STRIDE_THREADS, 1, 0);
extern "C" __global__ void __launch_bounds__(GRID_STRIDE_THREADS)
flash_convert_mask(const elem_t *__restrict__ mask_src, float *__restrict__ mask,
                   const __grid_constant__ AttnParams args) {
    const i64 step = (i64)gridDim.x * blockDim.x;
    // (32-bit index arithmetic where the mask fits: a 64-bit division is a long emulated sequence)
    const bool narrow = args.mask_total <= 0xffffffffll;
    const unsigned n1 = (unsigned)args.mask_n1, n2 = (unsigned)args.mask_n2, n3 = (unsigned)args.mask_n3;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < args.mask_total; idx += step) {
        i64 i0, i1, i2, i3;
        if (narrow) {
            const unsigned u = (unsigned)idx, r3 = u / n3, r2 = r3 / n2;
            i3 = u - r3 * n3, i2 = r3 - r2 * n2, i1 = r2 % n1, i0 = r2 / n1;
        } else {
            const i64 r3 = idx / args.mask_n3, r2 = r3 / args.mask_n2;
            i3 = idx - r3 * args.mask_n3, i2 = r3 - r2 * args.mask_n2, i1 = r2 % args.mask_n1, i0 = r2 / args.mask_n1;
        }
        mask[idx] = to_float(mask_src[i0 * args.src_sb + i1 * args.src_sh + i2 * args.src_sq + i3 * args.src_sk]);
    }
}
