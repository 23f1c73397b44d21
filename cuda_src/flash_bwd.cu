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

#include "flash_common.cuh"

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
#define LD_S (BWD_BC + SMEM_PAD)

// Warp grids of the three product shapes.
#define SW_M (BWD_BR / 16)          // Sij, dPij: row groups
#define SW_N (BWD_WARPS / SW_M)     //            column groups
#define NT_S (BWD_BC / (8 * SW_N))  //            8-wide tiles per warp
#define KW_M (BWD_BC / 16)          // dKj, dVj
#define KW_N (BWD_WARPS / KW_M)
#define NT_KV (HEAD_DIM / (8 * KW_N))
#define QW_M (BWD_BR / 16)          // dQi
#define QW_N (BWD_WARPS / QW_M)
#define NT_Q (HEAD_DIM / (8 * QW_N))

static_assert(SW_M * SW_N == BWD_WARPS && NT_S * 8 * SW_N == BWD_BC, "Sij warp grid covers the tile");
static_assert(KW_M * KW_N == BWD_WARPS && NT_KV * 8 * KW_N == HEAD_DIM, "dKj warp grid covers the tile");
static_assert(QW_M * QW_N == BWD_WARPS && NT_Q * 8 * QW_N == HEAD_DIM, "dQi warp grid covers the tile");

#ifndef DQ_WARPS
#error "DQ_WARPS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define DQ_THREADS (DQ_WARPS * WARP_SIZE)
#define DQ_BR (16 * DQ_WARPS)
#ifndef DQ_BC
#error "DQ_BC must be defined (pycudaflash.compiler.defines)"
#endif
static_assert(BWD_BR % 16 == 0 && BWD_BC % 16 == 0 && DQ_BC % 8 == 0, "tiles are whole mma tiles");

// ------------------------------------------------------------- preprocess
// Di, Li * log2(e) and the zeroed dQ accumulator (preprocess_rows).
extern "C" __global__ void __launch_bounds__(PRE_THREADS)
flash_bwd_preprocess(const float *__restrict__ dO, const float *__restrict__ O, const float *__restrict__ LSE,
                     float *__restrict__ Dvec, float *__restrict__ L2vec, float *__restrict__ dQacc, int H, int Nq,
                     int D, i64 total_rows, i64 do_sb, i64 do_sh, i64 do_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                     i64 l_sb, i64 l_sh, i64 l_sn) {
    preprocess_rows(dO, O, LSE, Dvec, L2vec, dQacc, H, Nq, D, total_rows, do_sb, do_sh, do_sn, o_sb, o_sh, o_sn,
                    l_sb, l_sh, l_sn, [](float x) { return x; });
}

// ------------------------------------------------------------------- dK, dV
extern "C" __global__ void __launch_bounds__(BWD_THREADS, 1)
flash_bwd_dkdv_kernel(const float *__restrict__ Q, const float *__restrict__ K, const float *__restrict__ V,
                      const float *__restrict__ dO, const float *__restrict__ Dvec,
                      const float *__restrict__ L2vec, float *__restrict__ dQacc, float *__restrict__ dK,
                      float *__restrict__ dV, const void *__restrict__ mask, const int *__restrict__ key_lengths,
                      int Nq, int Nk, int D, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                      i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, i64 dk_sb, i64 dk_sh,
                      i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk,
                      float scale_log2, float scale, int band_lo, int band_hi, int vec, int kv_group) {
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
    // Grid (H, B, key tiles): key tile slowest, so all heads' first (under a
    // causal band, longest) key tiles are scheduled before any later one.
    const int h = blockIdx.x, b = blockIdx.y, H = gridDim.x;
    const int k0 = blockIdx.z * BWD_BC;

    const MaskParams mp =
        mask_params(mask, m_sb, m_sh, m_sq, m_sk, band_lo, band_hi, key_length(key_lengths, b, Nk), Nq);
    const char *mask_bh = mask_head_base(mp, b, h);

    const float *Qg = Q + (i64)b * q_sb + (i64)h * q_sh;
    const float *dOg = dO + (i64)b * do_sb + (i64)h * do_sh;
    const i64 row_base = ((i64)b * H + h) * Nq;  // row offset into Dvec, L2vec, dQacc

    // Query tiles with a row that sees any key of this tile.
    const TileRange qt = query_tiles(k0, BWD_BC, Nq, mp.kl, band_lo, band_hi, BWD_BR);
    const int tr_begin = qt.begin, tr_end = qt.end;

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
        const int hk = kv_head(h, kv_group);  // the K/V head this query head reads
        load_tile<BWD_BC, BWD_THREADS>(Kj, K + (i64)b * k_sb + (i64)hk * k_sh, k_sn, k0, Nk, D, vec, tid);
        load_tile<BWD_BC, BWD_THREADS>(Vj, V + (i64)b * v_sb + (i64)hk * v_sh, v_sn, k0, Nk, D, vec, tid);
    }

    for (int tr = tr_begin; tr < tr_end; ++tr) {
        const int i0 = tr * BWD_BR;
        // Load Qi, dOi (async) and the row statistics Li, Di.
        load_tile<BWD_BR, BWD_THREADS>(Qi, Qg, q_sn, i0, Nq, D, vec, tid);
        load_tile<BWD_BR, BWD_THREADS>(dOi, dOg, do_sn, i0, Nq, D, vec, tid);
        cp_async_commit();
        if (tid < BWD_BR) {
            const int i = i0 + tid;
            Li[tid] = (i < Nq) ? L2vec[row_base + i] : NEG_INF;
            Di[tid] = (i < Nq) ? Dvec[row_base + i] : 0.f;
        }
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

        // Pij = exp2(Sij*scale*log2e + bias - Li), dSij = Pij o (dPij - Di), into shared memory.
        const bool need_mask = tile_needs_mask(mp, i0, BWD_BR, k0, BWD_BC);
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = s_row + g + 8 * (e >> 1), c = s_col + 8 * n + 2 * t + (e & 1);
                const float x = need_mask ? masked_score(s[0][n][e], scale_log2, mp, mask_bh, i0 + r, k0 + c)
                                          : s[0][n][e] * scale_log2;
                const float l2 = Li[r];
                const float p = (l2 == NEG_INF) ? 0.f : exp2f(x - l2);
                Pij[r * LD_S + c] = p;
                dSij[r * LD_S + c] = p * (dp[0][n][e] - Di[r]);
            }
        }
        // Pij and dSij are complete.
        __syncthreads();

        // dVj += Pij^T dOi and dKj += dSij^T Qi (scale applied at the end), each
        // through a fresh accumulator added in float32 (see warp_mma_rega_add).
        {
            float part[1][NT_KV][4];
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[0][n][e] = 0.f;
            warp_mma<1, NT_KV, true>(
                part, [&](int m, int k) { return Pij[k * LD_S + kv_row + m]; },
                [&](int k, int n) { return dOi[k * LD_HEAD + kv_col + n]; }, BWD_BR / 8, D - kv_col, lane);
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dv_acc[0][n][e] += part[0][n][e];
                    part[0][n][e] = 0.f;
                }
            warp_mma<1, NT_KV, true>(
                part, [&](int m, int k) { return dSij[k * LD_S + kv_row + m]; },
                [&](int k, int n) { return Qi[k * LD_HEAD + kv_col + n]; }, BWD_BR / 8, D - kv_col, lane);
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dk_acc[0][n][e] += part[0][n][e];
        }

        // dQi += scale * dSij Kj, added into the float32 accumulator.
        if (dQacc != nullptr) {
            float dq[1][NT_Q][4];
#pragma unroll
            for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq[0][n][e] = 0.f;
            warp_mma<1, NT_Q, false>(
                dq, [&](int m, int k) { return dSij[(q_row + m) * LD_S + k]; },
                [&](int k, int n) { return Kj[k * LD_HEAD + q_col + n]; }, BWD_BC / 8, D - q_col, lane);
#pragma unroll
            for (int n = 0; n < NT_Q; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = i0 + q_row + g + 8 * (e >> 1), d = q_col + 8 * n + 2 * t + (e & 1);
                    if (i < Nq && d < D) atomicAdd(dQacc + (row_base + i) * D + d, scale * dq[0][n][e]);
                }
            }
        }
        // Every warp is done with Qi, dOi, Pij, dSij, Li, Di before the next tile overwrites them.
        __syncthreads();
    }

    // Write dKj (scaled) and dVj; key tiles no query sees get zeros.
    float *dKg = dK + (i64)b * dk_sb + (i64)h * dk_sh;
    float *dVg = dV + (i64)b * dv_sb + (i64)h * dv_sh;
#pragma unroll
    for (int n = 0; n < NT_KV; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = k0 + kv_row + g + 8 * (e >> 1), d = kv_col + 8 * n + 2 * t + (e & 1);
            if (j < Nk && d < D) {
                dKg[(i64)j * dk_sn + d] = scale * dk_acc[0][n][e];
                dVg[(i64)j * dv_sn + d] = dv_acc[0][n][e];
            }
        }
    }
}

// ------------------------------------------------------- deterministic dQ
extern "C" __global__ void __launch_bounds__(DQ_THREADS, 1)
flash_bwd_dq_kernel(const float *__restrict__ Q, const float *__restrict__ K, const float *__restrict__ V,
                    const float *__restrict__ dO, const float *__restrict__ Dvec, const float *__restrict__ L2vec,
                    float *__restrict__ dQ, const void *__restrict__ mask, const int *__restrict__ key_lengths,
                    int Nq, int Nk, int D, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb,
                    i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, i64 dq_sb, i64 dq_sh, i64 dq_sn,
                    i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk, float scale_log2, float scale, int band_lo,
                    int band_hi, int vec, int kv_group) {
    extern __shared__ __align__(16) float smem[];
    float *Qi = smem;                   // [DQ_BR][LD_HEAD]
    float *dOi = Qi + DQ_BR * LD_HEAD;  // [DQ_BR][LD_HEAD]
    float *Kj = dOi + DQ_BR * LD_HEAD;  // [DQ_BC][LD_HEAD]
    float *Vj = Kj + DQ_BC * LD_HEAD;   // [DQ_BC][LD_HEAD]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * DQ_BR;
    const int row_w = 16 * warp;

    const MaskParams mp =
        mask_params(mask, m_sb, m_sh, m_sq, m_sk, band_lo, band_hi, key_length(key_lengths, b, Nk), Nq);
    const char *mask_bh = mask_head_base(mp, b, h);
    const i64 row_base = ((i64)b * H + h) * Nq;

    const TileRange kt = key_tiles(q0, DQ_BR, Nq, mp.kl, band_lo, band_hi, DQ_BC);
    const int tc_begin = kt.begin, tc_end = kt.end;

    // Row statistics of this thread's rows g and g+8.
    float l2[2], di[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + row_w + g + 8 * r;
        l2[r] = (i < Nq) ? L2vec[row_base + i] : NEG_INF;
        di[r] = (i < Nq) ? Dvec[row_base + i] : 0.f;
    }

    float dq_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.f;
    const int ksteps_d = (D + 7) / 8;

    if (tc_begin < tc_end) {
        load_tile<DQ_BR, DQ_THREADS>(Qi, Q + (i64)b * q_sb + (i64)h * q_sh, q_sn, q0, Nq, D, vec, tid);
        load_tile<DQ_BR, DQ_THREADS>(dOi, dO + (i64)b * do_sb + (i64)h * do_sh, do_sn, q0, Nq, D, vec, tid);
    }
    for (int tc = tc_begin; tc < tc_end; ++tc) {
        const int k0 = tc * DQ_BC;
        const int hk = kv_head(h, kv_group);  // the K/V head this query head reads
        load_tile<DQ_BC, DQ_THREADS>(Kj, K + (i64)b * k_sb + (i64)hk * k_sh, k_sn, k0, Nk, D, vec, tid);
        load_tile<DQ_BC, DQ_THREADS>(Vj, V + (i64)b * v_sb + (i64)hk * v_sh, v_sn, k0, Nk, D, vec, tid);
        cp_async_commit();
        cp_async_wait<0>();
        // Qi, dOi, Kj, Vj are in shared memory for every thread.
        __syncthreads();

        // Sij = Qi Kj^T, dPij = dOi Vj^T (16 x DQ_BC per warp).
        float s[1][DQ_BC / 8][4], dp[1][DQ_BC / 8][4];
#pragma unroll
        for (int n = 0; n < DQ_BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = dp[0][n][e] = 0.f;
        warp_mma<1, DQ_BC / 8, false>(
            s, [&](int m, int k) { return Qi[(row_w + m) * LD_HEAD + k]; },
            [&](int k, int n) { return Kj[n * LD_HEAD + k]; }, ksteps_d, DQ_BC, lane);
        warp_mma<1, DQ_BC / 8, false>(
            dp, [&](int m, int k) { return dOi[(row_w + m) * LD_HEAD + k]; },
            [&](int k, int n) { return Vj[n * LD_HEAD + k]; }, ksteps_d, DQ_BC, lane);

        // dSij = Pij o (dPij - Di), kept in registers (C layout).
        const bool need_mask = tile_needs_mask(mp, q0, DQ_BR, k0, DQ_BC);
#pragma unroll
        for (int n = 0; n < DQ_BC / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int i = q0 + row_w + g + 8 * r, j = k0 + 8 * n + 2 * t + (e & 1);
                const float x = need_mask ? masked_score(s[0][n][e], scale_log2, mp, mask_bh, i, j)
                                          : s[0][n][e] * scale_log2;
                const float p = (l2[r] == NEG_INF) ? 0.f : exp2f(x - l2[r]);
                s[0][n][e] = p * (dp[0][n][e] - di[r]);
            }
        }

        // dQi += dSij Kj.
        warp_mma_rega_add<DQ_BC / 8, HEAD_DIM / 8, 2>(dq_acc, s[0],
                                                     [&](int k, int n) { return Kj[k * LD_HEAD + n]; }, lane);
        // Every warp is done with Kj and Vj before the next tile overwrites them.
        __syncthreads();
    }

    float *dQg = dQ + (i64)b * dq_sb + (i64)h * dq_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + row_w + g + 8 * r;
        if (i < Nq) {
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                const int d = 8 * n + 2 * t;
                if (d < D) dQg[(i64)i * dq_sn + d] = scale * dq_acc[n][2 * r];
                if (d + 1 < D) dQg[(i64)i * dq_sn + d + 1] = scale * dq_acc[n][2 * r + 1];
            }
        }
    }
}

// --------------------------------------------------------------- convert dQ
// dq[b, h, i, d] = dQacc[((b*H + h)*Nq + i)*D + d] (already scaled).
extern "C" __global__ void __launch_bounds__(PRE_THREADS)
flash_bwd_convert_dq(const float *__restrict__ dQacc, float *__restrict__ dQ, int H, int Nq, int D, i64 total_rows,
                     i64 dq_sb, i64 dq_sh, i64 dq_sn, int vec) {
    (void)vec;  // (float32 columns are stored one by one)
    convert_dq_rows(dQacc, dQ, H, Nq, D, total_rows, dq_sb, dq_sh, dq_sn, [&](float *row, int d, float x0, float x1) {
        row[d] = x0;
        if (d + 1 < D) row[d + 1] = x1;
    });
}

// -------------------------------------------------- grouped K/V heads: sums
// dK, dV of each K/V head from the per-query-head terms in the workspace
// (sum_head_groups); blockIdx.y 0: dK, 1: dV.
extern "C" __global__ void __launch_bounds__(256)
flash_bwd_sum_groups(const float *__restrict__ dKh, const float *__restrict__ dVh, float *__restrict__ dK,
                     float *__restrict__ dV, int Hkv, int G, int Nk, int D, i64 total, i64 dk_sb, i64 dk_sh,
                     i64 dk_sn, i64 dv_sb, i64 dv_sh, i64 dv_sn) {
    const bool is_v = blockIdx.y == 1;
    sum_head_groups(is_v ? dVh : dKh, is_v ? dV : dK, Hkv, G, Nk, D, total, is_v ? dv_sb : dk_sb,
                    is_v ? dv_sh : dk_sh, is_v ? dv_sn : dk_sn, [](float x) { return x; },
                    [](float *p, float x) { *p = x; });
}
