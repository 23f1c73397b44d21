// flash_bwd_rows.cuh -- the kernels of the FlashAttention backward that
// surround its dK/dV kernel, written once for every backward pass: float32
// (flash_bwd.cu, through flash_common_f32.cuh) and float16 / bfloat16
// (flash_bwd_f16.cu and flash_bwd_sm90.cu, through flash_bwd_rows_f16.cuh).
//   flash_bwd_preprocess  Di = rowsum(dOi o Oi) and Li*log2(e) into a float32
//                         workspace; zeroes the dQ accumulator.
//   flash_bwd_dq_kernel   deterministic dQ: one block per query tile Qi
//                         (outer loop) recomputes Pij, dSij and sums dSij Kj
//                         in a fixed order, all in registers.
//   flash_bwd_convert_dq  copies (rounds) the float32 dQ accumulator into dq
//                         (strided).
//   flash_bwd_sum_groups  dK, dV of grouped K/V heads from the per-query-head
//                         terms.
// and the signature of the dK/dV kernel, FLASH_BWD_DKDV_KERNEL.
// The algorithm and its names are described in flash_bwd.cu.
//
// Tile layout (dq): DQ_WARPS warps of 16 query rows, DQ_BC keys a step, as
// the forward; dSij feeds dSij Kj straight from its C fragments.  Products:
// float32 as split TF32 (warp_mma, Sij and dPij over the 8-wide k steps that
// hold real head-dim columns), 16-bit as mma.sync.m16n8k16 over the whole
// padded head dim, dSij rounded to elem_t for dSij Kj.

#pragma once

#ifndef DQ_WARPS
#error "DQ_WARPS must be defined (pycudaflash.compiler.LAYOUT)"
#endif
#define DQ_THREADS (DQ_WARPS * WARP_SIZE)
#define DQ_BR (16 * DQ_WARPS)
#ifndef DQ_BC
#error "DQ_BC must be defined (pycudaflash.compiler.defines)"
#endif
static_assert(DQ_BC % 16 == 0, "dq key tile is a whole number of 16-wide k steps");
#if !ELEM_F32
// Unrolling of the dq kernel's head-dim loop (in full where registers allow).
constexpr int kDqKsUnroll = LEAN_REGISTERS ? 1 : HEAD_DIM / 16;
#endif

// ------------------------------------------------------------------- dK, dV
// The signature of flash_bwd_dkdv_kernel (THREADS a block), whose body each
// pass writes after it: flash_bwd.cu, flash_bwd_f16.cu, flash_bwd_sm90.cu.
#define FLASH_BWD_DKDV_KERNEL(THREADS)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) flash_bwd_dkdv_kernel(                       \
        const elem_t *__restrict__ Q, const elem_t *__restrict__ K, const elem_t *__restrict__ V,          \
        const elem_t *__restrict__ dO, const float *__restrict__ Dvec, const float *__restrict__ L2vec,    \
        float *__restrict__ dQacc, elem_t *__restrict__ dK, elem_t *__restrict__ dV,                        \
        const void *__restrict__ mask, const unsigned char *__restrict__ tmap,                             \
        const int *__restrict__ key_lengths, int Nq, int Nk, int D, const __grid_constant__ AttnParams args)

// Kj, Vj of a dK/dV block: keys blk.k0.. of the K/V head its query head
// reads, the keys no query row may see zero-filled.
template <int KEYS, int NTHREADS, bool SWZ = false>
__device__ __forceinline__ void load_block_kv(elem_t *Kj, elem_t *Vj, const elem_t *K, const elem_t *V,
                                              const KeyTile<elem_t> &blk, const AttnParams &args, int Nq, int D,
                                              int tid) {
    const int hk = kv_head(blk.h, args.kv_group);
    const KeyRange kr = seen_keys(0, Nq, Nq, blk.mp.kl, args.band_lo, args.band_hi, mask_seen(blk.mp));
    load_tile<KEYS, NTHREADS, SWZ>(Kj, K + (i64)blk.b * args.k_sb + (i64)hk * args.k_sh, args.k_sn, blk.k0, kr.hi, D,
                                   args.vec, tid, kr.lo, range_bits(kr));
    load_tile<KEYS, NTHREADS, SWZ>(Vj, V + (i64)blk.b * args.v_sb + (i64)hk * args.v_sh, args.v_sn, blk.k0, kr.hi, D,
                                   args.vec, tid, kr.lo, range_bits(kr));
}

// ------------------------------------------------------------- preprocess
// Di, Li * log2(e) and the zeroed dQ accumulator (preprocess_rows).
LAUNCH_SHAPE(flash_bwd_preprocess, PRE_THREADS, PRE_ROWS * PRE_WARPS, 0);
extern "C" __global__ void __launch_bounds__(PRE_THREADS, PRE_MIN_BLOCKS)
flash_bwd_preprocess(const elem_t *__restrict__ dO, const elem_t *__restrict__ O, const float *__restrict__ LSE,
                     float *__restrict__ Dvec, float *__restrict__ L2vec, float *__restrict__ dQacc, int Nq, int D,
                     const __grid_constant__ AttnParams args) {
    preprocess_rows(dO, O, LSE, Dvec, L2vec, dQacc, args.H, Nq, D, args.total_rows, args.do_sb, args.do_sh, args.do_sn,
                    args.o_sb, args.o_sh, args.o_sn,
                    args.l_sb, args.l_sh, args.l_sn, args.rows_vec, [](elem_t x) { return to_float(x); });
}

// ------------------------------------------------------- deterministic dQ
LAUNCH_SHAPE(flash_bwd_dq_kernel, DQ_THREADS, DQ_BR, (2 * DQ_BR + 2 * DQ_BC) * LDH * sizeof(elem_t));
TILE_MAP(flash_bwd_dq_kernel, DQ_BR, DQ_BC);
extern "C" __global__ void __launch_bounds__(DQ_THREADS, 1)
flash_bwd_dq_kernel(const elem_t *__restrict__ Q, const elem_t *__restrict__ K, const elem_t *__restrict__ V,
                    const elem_t *__restrict__ dO, const float *__restrict__ Dvec, const float *__restrict__ L2vec,
                    elem_t *__restrict__ dQ, const void *__restrict__ mask, const unsigned char *__restrict__ tmap,
                    const int *__restrict__ key_lengths, int Nq, int Nk, int D,
                    const __grid_constant__ AttnParams args) {
    extern __shared__ __align__(16) smem_t smem_raw[];
    elem_t *Qi = reinterpret_cast<elem_t *>(smem_raw);  // [DQ_BR][LDH]
    elem_t *dOi = Qi + DQ_BR * LDH;                     // [DQ_BR][LDH]
    elem_t *Kj = dOi + DQ_BR * LDH;                     // [DQ_BC][LDH]
    elem_t *Vj = Kj + DQ_BC * LDH;                      // [DQ_BC][LDH]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * DQ_BR;
    const int row_w = 16 * warp;

    const MaskParams mp = mask_params<DQ_BR, DQ_BC>(mask, tmap, args, key_length(key_lengths, b, Nk), Nq, Nk, b, h);
    const char *mask_bh = mask_head_base(mp, b, h);
    const i64 row_base = ((i64)b * H + h) * Nq;

    const TileRange kt = key_tiles(q0, DQ_BR, Nq, mp.kl, args.band_lo, args.band_hi, DQ_BC);
    // The keys any row of the tile may see (the rest zero-filled) and the
    // block map's entries of the tile, kept in shared memory: dQi takes the
    // registers at large head dims.
    __shared__ KeyRange seen;
    __shared__ const unsigned char *kinds;
    if (tid == 0)
        seen = seen_keys(q0, DQ_BR, Nq, mp.kl, args.band_lo, args.band_hi, mask_seen(mp)), kinds = map_row(mp, q0 / DQ_BR);
    // seen and kinds are visible to every thread.
    __syncthreads();
    const int tc_begin = next_tile(kinds, 1, kt.begin, kt.end), tc_end = kt.end;

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
#if ELEM_F32
    const int ksteps_d = (D + 7) / 8;  // 8-wide k steps that hold real head-dim columns
#endif

    if (tc_begin < tc_end) {
        load_tile<DQ_BR, DQ_THREADS>(Qi, Q + (i64)b * args.q_sb + (i64)h * args.q_sh, args.q_sn, q0, Nq, D, args.vec,
                                     tid);
        load_tile<DQ_BR, DQ_THREADS>(dOi, dO + (i64)b * args.do_sb + (i64)h * args.do_sh, args.do_sn, q0, Nq, D,
                                     args.vec, tid);
    }
    for (int tc = tc_begin; tc < tc_end; tc = next_tile(kinds, 1, tc + 1, tc_end)) {
        const int k0 = tc * DQ_BC;
        const int hk = kv_head(h, args.kv_group);  // the K/V head this query head reads
        const KeyRange kr = seen;
        load_tile<DQ_BC, DQ_THREADS, false, false, true>(Kj, K + (i64)b * args.k_sb + (i64)hk * args.k_sh, args.k_sn, k0, kr.hi, D,
                                     args.vec, tid, kr.lo, range_bits(kr));
        load_tile<DQ_BC, DQ_THREADS, false, false, true>(Vj, V + (i64)b * args.v_sb + (i64)hk * args.v_sh, args.v_sn, k0, kr.hi, D,
                                     args.vec, tid, kr.lo, range_bits(kr));
        cp_async_commit();
        cp_async_wait<0>();
        // Qi, dOi, Kj, Vj are in shared memory for every thread.
        __syncthreads();

        // Sij = Qi Kj^T, dPij = dOi Vj^T (16 x DQ_BC per warp; zero-filled
        // head-dim columns past D add nothing).
        float s[1][DQ_BC / 8][4], dp[1][DQ_BC / 8][4];
#pragma unroll
        for (int n = 0; n < DQ_BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = dp[0][n][e] = 0.f;
#if ELEM_F32
        warp_mma<1, DQ_BC / 8, false>(
            s, [&](int m, int k) { return Qi[(row_w + m) * LDH + k]; },
            [&](int k, int n) { return Kj[n * LDH + k]; }, ksteps_d, DQ_BC, lane);
        warp_mma<1, DQ_BC / 8, false>(
            dp, [&](int m, int k) { return dOi[(row_w + m) * LDH + k]; },
            [&](int k, int n) { return Vj[n * LDH + k]; }, ksteps_d, DQ_BC, lane);
#else
#pragma unroll kDqKsUnroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
            mma_s_dp_kstep<DQ_BC / 16>(s[0], dp[0], Qi, dOi, Kj, Vj, row_w, 0, ks, lane);
#endif

        // dSij = Pij o (dPij - Di) (through the score modifier), kept in registers (C layout).
        const bool need_mask = tile_needs_mask(mp, q0, DQ_BR, k0, DQ_BC, map_kind(kinds, tc));
#pragma unroll
        for (int n = 0; n < DQ_BC / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int i = q0 + row_w + g + 8 * r, j = k0 + 8 * n + 2 * t + (e & 1);
                const float x = tile_score(s[0][n][e], need_mask, args.scale_log2, mp, mask_bh, i, j);
                const float p = (l2[r] == NEG_INF) ? 0.f : softmax_exp2(x - l2[r]);
                s[0][n][e] = DS_THROUGH_SCORE_MOD(p * (dp[0][n][e] - di[r]), s[0][n][e], mp, mask_bh, i, j);
            }
        }

        // dQi += dSij Kj.
#if ELEM_F32
        warp_mma_rega_add<DQ_BC / 8, HEAD_DIM / 8, 2>(dq_acc, s[0], [&](int k, int n) { return Kj[k * LDH + n]; },
                                                     lane);
#else
        // (dSij rounded to elem_t straight from the C fragments)
#pragma unroll
        for (int kk = 0; kk < DQ_BC / 16; ++kk) {
            u32 a[4];
            pack_a(a, s[0][2 * kk], s[0][2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < HEAD_DIM / 16; ++np) {
                u32 bk[4];
                load_b_kn(bk, Kj, LDH, 16 * np, 16 * kk, lane);
                mma16816_x2(dq_acc[2 * np], dq_acc[2 * np + 1], a, bk);
            }
        }
#endif
        // Every warp is done with Kj and Vj before the next tile overwrites them.
        __syncthreads();
    }

    elem_t *dQg = dQ + (i64)b * args.dq_sb + (i64)h * args.dq_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + row_w + g + 8 * r;
        if (i < Nq) {
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                store_pair_scaled(dQg + (i64)i * args.dq_sn, 8 * n + 2 * t, D, dq_acc[n][2 * r], dq_acc[n][2 * r + 1],
                                  args.scale, args.vec);
        }
    }
}

// --------------------------------------------------------------- convert dQ
// dq[b, h, i, d] = dQacc[((b*H + h)*Nq + i)*D + d] (already scaled), as elem_t.
LAUNCH_SHAPE(flash_bwd_convert_dq, PRE_THREADS, PRE_ROWS * PRE_WARPS, 0);
extern "C" __global__ void __launch_bounds__(PRE_THREADS, PRE_MIN_BLOCKS)
flash_bwd_convert_dq(const float *__restrict__ dQacc, elem_t *__restrict__ dQ, int Nq, int D,
                     const __grid_constant__ AttnParams args) {
    convert_dq_rows(dQacc, dQ, args.H, Nq, D, args.total_rows, args.dq_sb, args.dq_sh, args.dq_sn, args.dq_vec,
                    [](float x) { return from_float(x); },
                    [&](elem_t *row, int d, float x0, float x1) { store_pair(row, d, D, x0, x1, args.vec); });
}

// -------------------------------------------------- grouped K/V heads: sums
// dK, dV of each K/V head from the per-query-head terms in the workspace
// (sum_head_groups); blockIdx.y 0: dK, 1: dV.
LAUNCH_SHAPE(flash_bwd_sum_groups, GRID_STRIDE_THREADS, 1, 0);
extern "C" __global__ void __launch_bounds__(GRID_STRIDE_THREADS)
flash_bwd_sum_groups(const elem_t *__restrict__ dKh, const elem_t *__restrict__ dVh, elem_t *__restrict__ dK,
                     elem_t *__restrict__ dV, int Nk, int D, const __grid_constant__ AttnParams args) {
    const bool is_v = blockIdx.y == 1;
    sum_head_groups(is_v ? dVh : dKh, is_v ? dV : dK, args.Hkv, args.kv_group, Nk, D, args.kv_total,
                    is_v ? args.dv_sb : args.dk_sb, is_v ? args.dv_sh : args.dk_sh, is_v ? args.dv_sn : args.dk_sn,
                    [](elem_t x) { return to_float(x); }, [](elem_t *p, float x) { *p = from_float(x); });
}
