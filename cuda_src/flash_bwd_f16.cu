// flash_bwd_f16.cu -- FlashAttention backward pass, float16 / bfloat16 on the
// tensor cores (mma.sync.m16n8k16, float32 accumulators).
//
// Algorithm: FlashAttention-2 backward (Dao 2023, Algorithm 2).  With the
// forward's log-sum-exp Li, the attention matrix is recomputed tile by tile:
//   Pij  = exp(scale * Qi Kj^T + bias - Li)      (0 where masked)
//   dVj += Pij^T dOi
//   dPij = dOi Vj^T
//   dSij = Pij o (dPij - Di),  Di = rowsum(dOi o Oi)
//   dKj += scale * dSij^T Qi
//   dQi += scale * dSij Kj
// Pij and dSij are rounded to the input type before they enter a product;
// every sum runs in float32.  Kernels, launched in this order on one stream:
//   flash_bwd_preprocess  Di and Li*log2(e) into a float32 workspace; zeroes the dQ accumulator.
//   flash_bwd_dkdv_kernel one block per key tile Kj, Vj (outer loop) of one
//                         (batch, head); loops over the query tiles that see
//                         it; dKj, dVj stay in registers.  Given a dQ
//                         accumulator it also adds dQi into it with float32
//                         atomics (fast, summation order not deterministic).
//   flash_bwd_dq_kernel   deterministic dQ: one block per query tile Qi
//                         (outer loop) recomputes Pij, dSij and sums dSij Kj
//                         in a fixed order, all in registers.
//   flash_bwd_convert_dq  rounds the float32 accumulator into dq (strided).
//
// Assumptions: as flash_fwd_f16.cu; lse is the natural-log log-sum-exp of the
// forward (-inf for rows that saw no key: their gradients are 0).
//
// Tile layout (dkdv): BWD_WARPS = 8 warps, Bc keys x Br queries (defaults
// 128 x 128 for HEAD_DIM 64, 128 x 64 for 96 and 128, 64 x 64 for 192,
// 64 x 32 for 256).  Shared memory: Kj, Vj
// [Bc][LDH]; Qi, dOi [2][Br][LDH] (double buffered: the next query tile loads
// while this one is used); Pij, dSij [Br][Bc+8]; Li, Di [Br].  Each product
// spreads its output over the warps as a grid of (16*MT)-row x (8*NT)-column
// warp tiles: Sij, dPij (Br x Bc, MT = 1), dVj, dKj (Bc x HEAD_DIM, MT =
// KV_MT), dQi (Br x HEAD_DIM, MT = Q_MT).
// Pij and dSij pass through shared memory because dVj and dKj read them
// transposed (ldmatrix.trans) and dQi with another warp grid.
//
// The preprocess, deterministic dQ, dQ conversion and group-sum kernels
// come from flash_bwd_rows.cuh (through flash_bwd_rows_f16.cuh, which the
// Hopper dK/dV kernel, flash_bwd_sm90.cu, includes too), the warp grids from
// flash_bwd_warps.cuh.

#include "flash_bwd_rows_f16.cuh"
#include "flash_bwd_warps.cuh"

#define LDS (BWD_BC + SMEM_PAD_H)  // row stride of Pij, dSij
#ifndef S_CHUNK  // 8-wide Sij, dPij tiles per warp computed at once
#define S_CHUNK (NT_S < 4 ? NT_S : 4)
#endif
static_assert(NT_S % S_CHUNK == 0 && S_CHUNK % 2 == 0 && NT_KV % 2 == 0 && NT_Q % 2 == 0,
              "warp tiles are whole 16-column pairs");

// Unrolling of the head-dim loop of Sij and dPij: in full where registers
// allow; the element-wise mask code of MASK_MODE 1/2 needs registers of its
// own, so there the loop is unrolled by 2 (a full unroll would spill).
#ifndef BWD_KS_UNROLL
#if LEAN_REGISTERS
#define BWD_KS_UNROLL 1
#else
#define BWD_KS_UNROLL (MASK_MODE == 0 ? HEAD_DIM / 16 : 2)
#endif
#endif
constexpr int kBwdKsUnroll = BWD_KS_UNROLL;  // (#pragma unroll takes no macros)

// ------------------------------------------------------------------- dK, dV
// flash_bwd_dkdv_kernel (its parameters: FLASH_BWD_DKDV_KERNEL, flash_bwd_rows.cuh).
LAUNCH_SHAPE(flash_bwd_dkdv_kernel, BWD_THREADS, BWD_BC,
             ((2 * BWD_BC + 4 * BWD_BR) * LDH + 2 * BWD_BR * LDS) * sizeof(elem_t) + 2 * BWD_BR * sizeof(float));
TILE_MAP(flash_bwd_dkdv_kernel, BWD_BR, BWD_BC);
FLASH_BWD_DKDV_KERNEL(BWD_THREADS) {
    extern __shared__ __align__(16) smem_t smem_raw[];
    elem_t *Kj = reinterpret_cast<elem_t *>(smem_raw);  // [BWD_BC][LDH]
    elem_t *Vj = Kj + BWD_BC * LDH;                     // [BWD_BC][LDH]
    elem_t *Qbuf = Vj + BWD_BC * LDH;                   // [2][BWD_BR][LDH]
    elem_t *dObuf = Qbuf + 2 * BWD_BR * LDH;            // [2][BWD_BR][LDH]
    elem_t *Pij = dObuf + 2 * BWD_BR * LDH;             // [BWD_BR][LDS]
    elem_t *dSij = Pij + BWD_BR * LDS;                  // [BWD_BR][LDS]
    float *Li = reinterpret_cast<float *>(dSij + BWD_BR * LDS);  // [BWD_BR], log2 units
    float *Di = Li + BWD_BR;                                     // [BWD_BR]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const KeyTile<elem_t> blk = key_tile<BWD_BC, BWD_BR>(Q, dO, mask, tmap, key_lengths, Nq, Nk, args);
    const int tr_begin = blk.qt.begin, tr_end = blk.qt.end;

    // Warp tiles.
    const int s_row = 16 * (warp % SW_M), s_col = 8 * NT_S * (warp / SW_M);
    const int kv_row = 16 * KV_MT * (warp % KW_M), kv_col = 8 * NT_KV * (warp / KW_M);
    const int q_row = 16 * Q_MT * (warp % QW_M), q_col = 8 * NT_Q * (warp / QW_M);

    float dv_acc[KV_MT][NT_KV][4], dk_acc[KV_MT][NT_KV][4];
#pragma unroll
    for (int mt = 0; mt < KV_MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT_KV; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[mt][n][e] = dk_acc[mt][n][e] = 0.f;

    if (tr_begin < tr_end) {
        // Kj, Vj and the first Qi, dOi.
        load_block_kv<BWD_BC, BWD_THREADS>(Kj, Vj, K, V, blk, args, Nq, D, tid);
        load_tile<BWD_BR, BWD_THREADS>(Qbuf, blk.Qg, args.q_sn, tr_begin * BWD_BR, Nq, D, args.vec, tid);
        load_tile<BWD_BR, BWD_THREADS>(dObuf, blk.dOg, args.do_sn, tr_begin * BWD_BR, Nq, D, args.vec, tid);
        cp_async_commit();
    }
    // The block map's entries of this key tile (query tiles kinds_stride
    // apart), kept in shared memory for the registers' sake (the loop's first
    // barrier publishes them).
    __shared__ const unsigned char *kinds;
    __shared__ int kinds_stride;
    if (tid == 0) kinds = map_col(blk.mp, blockIdx.z), kinds_stride = map_stride(blk.mp);

    for (int tr = tr_begin, step = 0, tr_next; tr < tr_end; tr = tr_next, ++step) {
        const int i0 = tr * BWD_BR;
        const int buf = step & 1;
        const elem_t *Qi = Qbuf + buf * BWD_BR * LDH;
        const elem_t *dOi = dObuf + buf * BWD_BR * LDH;
        // Row statistics of this query tile.
        load_row_stats<BWD_BR>(Li, Di, L2vec, Dvec, blk.row_base, i0, Nq, tid);
        cp_async_wait<0>();
        // Qi, dOi (and Kj, Vj), Li and Di are in shared memory for every
        // thread; every warp is done with the previous tile's buffers, Pij, dSij.
        __syncthreads();
        tr_next = next_tile(kinds, kinds_stride, tr + 1, tr_end);  // (the next Qi, dOi)
        if (tr_next < tr_end) {  // prefetch the next query tile into the other buffer
            load_tile<BWD_BR, BWD_THREADS>(Qbuf + (buf ^ 1) * BWD_BR * LDH, blk.Qg, args.q_sn, tr_next * BWD_BR, Nq,
                                           D, args.vec, tid);
            load_tile<BWD_BR, BWD_THREADS>(dObuf + (buf ^ 1) * BWD_BR * LDH, blk.dOg, args.do_sn, tr_next * BWD_BR,
                                           Nq, D, args.vec, tid);
            cp_async_commit();
        }

        // Sij = Qi Kj^T and dPij = dOi Vj^T on this warp's 16 x (8*NT_S) tile,
        // S_CHUNK 8-wide column tiles at a time (bounds the live registers).
        const bool need_mask = tile_needs_mask(blk.mp, i0, BWD_BR, blk.k0, BWD_BC, map_kind(kinds, (i64)tr * kinds_stride));
#pragma unroll
        for (int c0 = 0; c0 < NT_S; c0 += S_CHUNK) {
            float s[S_CHUNK][4], dp[S_CHUNK][4];
#pragma unroll
            for (int n = 0; n < S_CHUNK; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll kBwdKsUnroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks)  // (zero-filled columns past D add nothing)
                mma_s_dp_kstep<S_CHUNK / 2>(s, dp, Qi, dOi, Kj, Vj, s_row, s_col + 8 * c0, ks, lane);

            // Pij = exp2(Sij*scale*log2e + bias - Li), dSij = Pij o (dPij - Di)
            // (through the score modifier), rounded to elem_t into shared memory.
#pragma unroll
            for (int n = 0; n < S_CHUNK; ++n) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = s_row + g + 8 * r, c = s_col + 8 * (c0 + n) + 2 * t;
                    const float l2 = Li[row], di = Di[row];
                    float p[2], ds[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float sv = s[n][2 * r + e];
                        const float x = tile_score(sv, need_mask, args.scale_log2, blk.mp, blk.mask_bh, i0 + row,
                                                   blk.k0 + c + e);
                        p[e] = (l2 == NEG_INF) ? 0.f : exp2_fast(x - l2);
                        ds[e] = DS_THROUGH_SCORE_MOD(p[e] * (dp[n][2 * r + e] - di), sv, blk.mp, blk.mask_bh, i0 + row,
                                                     blk.k0 + c + e);
                    }
                    *reinterpret_cast<u32 *>(Pij + row * LDS + c) = pack2(p[0], p[1]);
                    *reinterpret_cast<u32 *>(dSij + row * LDS + c) = pack2(ds[0], ds[1]);
                }
            }
        }
        // Pij and dSij are complete.
        __syncthreads();

        // dVj += Pij^T dOi, dKj += dSij^T Qi (scale applied at the end).
#pragma unroll
        for (int kk = 0; kk < BWD_BR / 16; ++kk) {
            u32 ap[KV_MT][4], ads[KV_MT][4];
#pragma unroll
            for (int mt = 0; mt < KV_MT; ++mt) {
                load_a_t(ap[mt], Pij, LDS, kv_row + 16 * mt, 16 * kk, lane);
                load_a_t(ads[mt], dSij, LDS, kv_row + 16 * mt, 16 * kk, lane);
            }
#pragma unroll
            for (int np = 0; np < NT_KV / 2; ++np) {  // (columns past D come out 0 and are not stored)
                u32 bdo[4], bq[4];
                load_b_kn(bdo, dOi, LDH, kv_col + 16 * np, 16 * kk, lane);
                load_b_kn(bq, Qi, LDH, kv_col + 16 * np, 16 * kk, lane);
#pragma unroll
                for (int mt = 0; mt < KV_MT; ++mt) {
                    mma16816_x2(dv_acc[mt][2 * np], dv_acc[mt][2 * np + 1], ap[mt], bdo);
                    mma16816_x2(dk_acc[mt][2 * np], dk_acc[mt][2 * np + 1], ads[mt], bq);
                }
            }
        }

        // dQi += scale * dSij Kj, added into the float32 accumulator.
        if (dQacc != nullptr) {
            float dq[Q_MT][NT_Q][4];
            zero_frags(dq);
#pragma unroll
            for (int kk = 0; kk < BWD_BC / 16; ++kk) {
                u32 a[Q_MT][4];
#pragma unroll
                for (int mt = 0; mt < Q_MT; ++mt) load_a(a[mt], dSij, LDS, q_row + 16 * mt, 16 * kk, lane);
#pragma unroll
                for (int np = 0; np < NT_Q / 2; ++np) {
                    u32 bk[4];
                    load_b_kn(bk, Kj, LDH, q_col + 16 * np, 16 * kk, lane);
#pragma unroll
                    for (int mt = 0; mt < Q_MT; ++mt) mma16816_x2(dq[mt][2 * np], dq[mt][2 * np + 1], a[mt], bk);
                }
            }
#pragma unroll
            for (int mt = 0; mt < Q_MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = i0 + q_row + 16 * mt + g + 8 * r;
                    if (i < Nq) {
                        float *row = dQacc + (blk.row_base + i) * D;
#pragma unroll
                        for (int n = 0; n < NT_Q; ++n)
                            dq_add_pair(row, q_col + 8 * n + 2 * t, D, args.scale * dq[mt][n][2 * r],
                                        args.scale * dq[mt][n][2 * r + 1]);
                    }
                }
        }
    }

    // Write dKj (scaled) and dVj; key tiles no query sees get zeros.
    elem_t *dKg = dK + (i64)blk.b * args.dkh_sb + (i64)blk.h * args.dkh_sh;
    elem_t *dVg = dV + (i64)blk.b * args.dvh_sb + (i64)blk.h * args.dvh_sh;
#pragma unroll
    for (int mt = 0; mt < KV_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = blk.k0 + kv_row + 16 * mt + g + 8 * r;
            if (j < Nk) {
#pragma unroll
                for (int n = 0; n < NT_KV; ++n) {
                    const int d = kv_col + 8 * n + 2 * t;
                    store_pair(dKg + (i64)j * args.dkh_sn, d, D, args.scale * dk_acc[mt][n][2 * r],
                               args.scale * dk_acc[mt][n][2 * r + 1], args.vec);
                    store_pair(dVg + (i64)j * args.dvh_sn, d, D, dv_acc[mt][n][2 * r], dv_acc[mt][n][2 * r + 1],
                               args.vec);
                }
            }
        }
}
