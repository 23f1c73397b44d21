// flash_bwd.cu -- FlashAttention backward pass, float32 (split-TF32 tensor cores).
//
// Algorithm: FlashAttention-2 backward (Dao 2023, Algorithm 2).  With the
// forward's log-sum-exp Li, the attention matrix is recomputed tile by tile:
//   Pij  = exp(scale * Qi Kj^T + bias - Li)      (0 where masked)
//   dVj += Pij^T dOi
//   dPij = dOi Vj^T
//   dSij = Pij o (dPij - Di),  Di = rowsum(dOi o Oi)
//   dKj += scale * dSij^T Qi
//   dQi += scale * dSij Kj
// Kernels, launched in this order on one stream:
//   flash_bwd_preprocess  Di and Li*log2(e) into a float32 workspace; zeroes the dQ accumulator.
//   flash_bwd_dkdv_kernel one block per key tile Kj, Vj (outer loop) of one
//                         (batch, head); loops over the query tiles that see
//                         it; dKj, dVj stay in registers.  Given a dQ
//                         accumulator it also adds dQi into it with float32
//                         atomics (fast, summation order not deterministic).
//   flash_bwd_dq_kernel   deterministic dQ: one block per query tile Qi
//                         (outer loop) recomputes Pij, dSij and sums dSij Kj
//                         in a fixed order.
//   flash_bwd_convert_dq  copies the float32 accumulator into dq (strided).
// (and flash_bwd_sum_groups for grouped K/V heads).  This file defines the
// dK/dV kernel; the others, written once for every backward pass, come from
// flash_bwd_rows.cuh, the warp grids from flash_bwd_warps.cuh.
//
// Assumptions: as flash_fwd.cu; lse is the natural-log log-sum-exp of the
// forward (-inf for rows that saw no key: their gradients are 0).
//
// Tile layout (dkdv): BWD_WARPS = 8 warps; Bc x Br = 64 x 32 (HEAD_DIM <= 64),
// 64 x 64 (HEAD_DIM 128), 32 x 32 (HEAD_DIM 256).
// Shared memory: Kj, Vj [Bc][HEAD_DIM+4], Qi, dOi [Br][HEAD_DIM+4],
// Pij, dSij [Br][Bc+4], Li, Di [Br].  Each product spreads its output tile
// over the 8 warps as a grid of 16-row x (8*NT)-column warp tiles:
//   Sij, dPij (Br x Bc), dVj, dKj (Bc x HEAD_DIM), dQi (Br x HEAD_DIM).
// Pij and dSij pass through shared memory because dVj and dKj need them
// transposed.  Tile layout (dq): as the forward, 4 warps of 16 query rows.

#include "flash_common_f32.cuh"
#include "flash_bwd_rows.cuh"

#define KV_MT 1  // 16-row blocks of the dKj, dVj and dQi warp tiles
#define Q_MT 1
#include "flash_bwd_warps.cuh"

#define LD_S (BWD_BC + SMEM_PAD)  // row stride of Pij, dSij

// ------------------------------------------------------------------- dK, dV
// flash_bwd_dkdv_kernel (its parameters: FLASH_BWD_DKDV_KERNEL, flash_bwd_rows.cuh).
LAUNCH_SHAPE(flash_bwd_dkdv_kernel, BWD_THREADS, BWD_BC,
             ((2 * BWD_BC + 2 * BWD_BR) * LD_HEAD + 2 * BWD_BR * LD_S + 2 * BWD_BR) * sizeof(float));
TILE_MAP(flash_bwd_dkdv_kernel, BWD_BR, BWD_BC);
FLASH_BWD_DKDV_KERNEL(BWD_THREADS) {
    extern __shared__ __align__(16) float smem[];
    float *Kj = smem;                      // [BWD_BC][LD_HEAD]
    float *Vj = Kj + BWD_BC * LD_HEAD;     // [BWD_BC][LD_HEAD]
    float *Qi = Vj + BWD_BC * LD_HEAD;     // [BWD_BR][LD_HEAD]
    float *dOi = Qi + BWD_BR * LD_HEAD;    // [BWD_BR][LD_HEAD]
    float *Pij = dOi + BWD_BR * LD_HEAD;   // [BWD_BR][LD_S]
    float *dSij = Pij + BWD_BR * LD_S;     // [BWD_BR][LD_S]
    float *Li = dSij + BWD_BR * LD_S;      // [BWD_BR], log2 units
    float *Di = Li + BWD_BR;               // [BWD_BR]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const KeyTile<float> blk = key_tile<BWD_BC, BWD_BR>(Q, dO, mask, tmap, key_lengths, Nq, Nk, args);
    const int tr_begin = blk.qt.begin, tr_end = blk.qt.end;

    // Warp tiles.
    const int s_row = 16 * (warp % SW_M), s_col = 8 * NT_S * (warp / SW_M);
    const int kv_row = 16 * (warp % KW_M), kv_col = 8 * NT_KV * (warp / KW_M);
    const int q_row = 16 * (warp % QW_M), q_col = 8 * NT_Q * (warp / QW_M);
    const int ksteps_d = (D + 7) / 8;

    float dv_acc[1][NT_KV][4], dk_acc[1][NT_KV][4];
#pragma unroll
    for (int n = 0; n < NT_KV; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv_acc[0][n][e] = dk_acc[0][n][e] = 0.f;

    if (tr_begin < tr_end) {
        load_block_kv<BWD_BC, BWD_THREADS>(Kj, Vj, K, V, blk, args, Nq, D, tid);
    }

    const unsigned char *kinds = map_col(blk.mp, blockIdx.z);  // (the block map's entries of this key tile)
    for (int tr = tr_begin; tr < tr_end; tr = next_tile(kinds, map_stride(blk.mp), tr + 1, tr_end)) {
        const int i0 = tr * BWD_BR;
        // Load Qi, dOi (async) and the row statistics Li, Di.
        load_tile<BWD_BR, BWD_THREADS>(Qi, blk.Qg, args.q_sn, i0, Nq, D, args.vec, tid);
        load_tile<BWD_BR, BWD_THREADS>(dOi, blk.dOg, args.do_sn, i0, Nq, D, args.vec, tid);
        cp_async_commit();
        load_row_stats<BWD_BR>(Li, Di, L2vec, Dvec, blk.row_base, i0, Nq, tid);
        cp_async_wait<0>();
        // Kj, Vj, Qi, dOi, Li and Di are in shared memory for every thread.
        __syncthreads();

        // Sij = Qi Kj^T and dPij = dOi Vj^T on this warp's 16 x (8*NT_S) tile.
        float s[1][NT_S][4], dp[1][NT_S][4];
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = dp[0][n][e] = 0.f;
        warp_mma<1, NT_S, false>(
            s, [&](int m, int k) { return Qi[(s_row + m) * LD_HEAD + k]; },
            [&](int k, int n) { return Kj[(s_col + n) * LD_HEAD + k]; }, ksteps_d, 8 * NT_S, lane);
        warp_mma<1, NT_S, false>(
            dp, [&](int m, int k) { return dOi[(s_row + m) * LD_HEAD + k]; },
            [&](int k, int n) { return Vj[(s_col + n) * LD_HEAD + k]; }, ksteps_d, 8 * NT_S, lane);

        // Pij = exp2(Sij*scale*log2e + bias - Li), dSij = Pij o (dPij - Di) (through the
        // score modifier), into shared memory.
        const bool need_mask = tile_needs_mask(blk.mp, i0, BWD_BR, blk.k0, BWD_BC, map_kind(kinds, (i64)tr * map_stride(blk.mp)));
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = s_row + g + 8 * (e >> 1), c = s_col + 8 * n + 2 * t + (e & 1);
                const float x = tile_score(s[0][n][e], need_mask, args.scale_log2, blk.mp, blk.mask_bh, i0 + r, blk.k0 + c);
                const float l2 = Li[r];
                const float p = (l2 == NEG_INF) ? 0.f : exp2f(x - l2);
                Pij[r * LD_S + c] = p;
                dSij[r * LD_S + c] = DS_THROUGH_SCORE_MOD(p * (dp[0][n][e] - Di[r]), s[0][n][e], blk.mp, blk.mask_bh,
                                                          i0 + r, blk.k0 + c);
            }
        }
        // Pij and dSij are complete.
        __syncthreads();

        // dVj += Pij^T dOi and dKj += dSij^T Qi (scale applied at the end), each
        // through a fresh accumulator added in float32 (see warp_mma_rega_add).
        auto add_product = [&](float (&acc)[1][NT_KV][4], const float *At, const float *B) {  // acc += At^T B
            float part[1][NT_KV][4];
            zero_frags(part);
            warp_mma<1, NT_KV, true>(
                part, [&](int m, int k) { return At[k * LD_S + kv_row + m]; },
                [&](int k, int n) { return B[k * LD_HEAD + kv_col + n]; }, BWD_BR / 8, D - kv_col, lane);
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[0][n][e] += part[0][n][e];
        };
        add_product(dv_acc, Pij, dOi);
        add_product(dk_acc, dSij, Qi);

        // dQi += scale * dSij Kj, added into the float32 accumulator.
        if (dQacc != nullptr) {
            float dq[1][NT_Q][4];
            zero_frags(dq);
            warp_mma<1, NT_Q, false>(
                dq, [&](int m, int k) { return dSij[(q_row + m) * LD_S + k]; },
                [&](int k, int n) { return Kj[k * LD_HEAD + q_col + n]; }, BWD_BC / 8, D - q_col, lane);
#pragma unroll
            for (int n = 0; n < NT_Q; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = i0 + q_row + g + 8 * (e >> 1), d = q_col + 8 * n + 2 * t + (e & 1);
                    if (i < Nq && d < D) atomicAdd(dQacc + (blk.row_base + i) * D + d, args.scale * dq[0][n][e]);
                }
            }
        }
        // Every warp is done with Qi, dOi, Pij, dSij, Li, Di before the next tile overwrites them.
        __syncthreads();
    }

    // Write dKj (scaled) and dVj; key tiles no query sees get zeros.
    float *dKg = dK + (i64)blk.b * args.dkh_sb + (i64)blk.h * args.dkh_sh;
    float *dVg = dV + (i64)blk.b * args.dvh_sb + (i64)blk.h * args.dvh_sh;
#pragma unroll
    for (int n = 0; n < NT_KV; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = blk.k0 + kv_row + g + 8 * (e >> 1), d = kv_col + 8 * n + 2 * t + (e & 1);
            if (j < Nk && d < D) {
                dKg[(i64)j * args.dkh_sn + d] = args.scale * dk_acc[0][n][e];
                dVg[(i64)j * args.dvh_sn + d] = dv_acc[0][n][e];
            }
        }
    }
}
