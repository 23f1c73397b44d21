// flash_fwd.cu -- FlashAttention forward pass, float32 (split-TF32 tensor cores).
//
// Algorithm: FlashAttention-2 forward (Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023, Algorithm 1).  Each
// block owns one query tile Qi (Br rows) of one (batch, head) and streams the
// key/value tiles Kj, Vj (Bc rows) through shared memory, keeping the running
// row maximum mi, row sum li and the unnormalised output Oi in registers
// (online softmax).  At the end Oi /= li and Li = mi + log(li) (the
// log-sum-exp the backward pass needs) are written.
//
// Assumptions: q (B,H,Nq,D), k/v (B,H,Nk,D), o like q, lse (B,H,Nq), all
// float32 with the last dimension contiguous and any other strides; D <=
// HEAD_DIM (zero-filled to HEAD_DIM in shared memory).  Any Nq, Nk >= 1.
//
// Tile layout: FWD_WARPS = 4 warps, warp w owns rows [16w, 16w + 16) of Qi, so
// Br = 64; Bc = 64 keys (32 for HEAD_DIM 256, to bound registers).  Shared
// memory: Qi[Br][HEAD_DIM+4], Kj[Bc][HEAD_DIM+4], Vj[Bc][HEAD_DIM+4].  Per
// warp: Sij as a 16 x Bc C fragment (Bc/2 floats a thread), Oi as 16 x
// HEAD_DIM (HEAD_DIM/2 floats a thread); each thread holds rows g and g+8 of
// its warp (g = lane/4), so a row's statistics are reduced over 4 lanes.
// Scores are kept in log2 units (scale * log2(e) folded in) and exponentiated
// with exp2.
//
// Masks: the causal/window/key-length band is a run-time [lo, hi] diagonal
// range per row; key tiles outside it are skipped, tiles inside it are not
// masked element-wise, only boundary tiles are.  MASK_MODE adds a dense bool
// or float mask.  A row that sees no key ends with li = 0: Oi = 0, Li = -inf.

#include "flash_common.cuh"

#ifndef FWD_WARPS
#error "FWD_WARPS must be defined (pycudaflash.compiler.defines)"
#endif
#define FWD_THREADS (FWD_WARPS * WARP_SIZE)
#define BR (16 * FWD_WARPS)
// The key tile comes from pycudaflash.compiler (-D BC); this default matches it.
#ifndef BC
#error "BC must be defined (pycudaflash.compiler.defines)"
#endif

static_assert(BR == 16 * FWD_WARPS, "one warp per 16 query rows");
static_assert(BC % 8 == 0, "key tile is a whole number of 8-wide mma tiles");

// Blocks per multiprocessor the register allocation must allow.
#if HEAD_DIM <= 64
#define FWD_MIN_BLOCKS 3
#elif HEAD_DIM <= 128
#define FWD_MIN_BLOCKS 2
#else
#define FWD_MIN_BLOCKS 1
#endif

#define S_TILES (BC / 8)        // 8-wide score tiles per warp row block
#define O_TILES (HEAD_DIM / 8)  // 8-wide output tiles

extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MIN_BLOCKS)
flash_fwd_kernel(const float *__restrict__ Q, const float *__restrict__ K, const float *__restrict__ V,
                 float *__restrict__ O, float *__restrict__ LSE, const void *__restrict__ mask,
                 const int *__restrict__ key_lengths, int Nq, int Nk, int D, i64 q_sb, i64 q_sh, i64 q_sn,
                 i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                 i64 l_sb, i64 l_sh, i64 l_sn, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk, float scale_log2,
                 int band_lo, int band_hi, int vec, int kv_group) {
    extern __shared__ __align__(16) float smem[];
    float *Qi = smem;                  // [BR][LD_HEAD]
    float *Kj = Qi + BR * LD_HEAD;     // [BC][LD_HEAD]
    float *Vj = Kj + BC * LD_HEAD;     // [BC][LD_HEAD]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    // Launch the last query tiles first: under a causal mask they are the longest.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;

    const MaskParams mp =
        mask_params(mask, m_sb, m_sh, m_sq, m_sk, band_lo, band_hi, key_length(key_lengths, b, Nk), Nq);
    const char *mask_bh = mask_head_base(mp, b, h);

    const float *Qg = Q + (i64)b * q_sb + (i64)h * q_sh;
    const int hk = kv_head(h, kv_group);  // the K/V head this query head reads
    const float *Kg = K + (i64)b * k_sb + (i64)hk * k_sh;
    const float *Vg = V + (i64)b * v_sb + (i64)hk * v_sh;

    // Keys any row of this tile may see.
    const TileRange kt = key_tiles(q0, BR, Nq, mp.kl, band_lo, band_hi, BC);
    const int tc_begin = kt.begin, tc_end = kt.end;

    // Per-thread state for rows r = 0 (row g) and r = 1 (row g + 8) of the warp.
    float o_acc[O_TILES][4];
#pragma unroll
    for (int n = 0; n < O_TILES; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;
    float m_i[2] = {NEG_INF, NEG_INF};  // running row max (log2 units)
    float l_i[2] = {0.f, 0.f};          // running row sum (this thread's columns only)

    const int ksteps = (D + 7) / 8;     // 8-wide k steps that hold real head-dim columns
    const int row_w = 16 * warp;        // first row of this warp in the tile

    if (tc_begin < tc_end) {
        // Load Qi and the first Kj.
        load_tile_async<BR, FWD_THREADS>(Qi, Qg, q_sn, q0, Nq, D, vec, tid);
        load_tile_async<BC, FWD_THREADS>(Kj, Kg, k_sn, tc_begin * BC, Nk, D, vec, tid);
        cp_async_commit();
    }

    for (int tc = tc_begin; tc < tc_end; ++tc) {
        const int k0 = tc * BC;
        cp_async_wait<0>();
        // Qi and Kj have landed for every thread; every warp is also done with
        // the previous Vj, so it may be overwritten now.
        __syncthreads();
        load_tile_async<BC, FWD_THREADS>(Vj, Vg, v_sn, k0, Nk, D, vec, tid);
        cp_async_commit();

        // Sij = Qi Kj^T (16 x BC per warp).
        float s[1][S_TILES][4];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n) s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.f;
        warp_mma<1, S_TILES, false>(
            s, [&](int m, int k) { return Qi[(row_w + m) * LD_HEAD + k]; },
            [&](int k, int n) { return Kj[n * LD_HEAD + k]; }, ksteps, BC, lane);

        // Scale to log2 units and apply the masks on boundary tiles.
        const bool need_mask = tile_needs_mask(mp, q0, BR, k0, BC);
#pragma unroll
        for (int n = 0; n < S_TILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = q0 + row_w + g + 8 * (e >> 1);
                const int j = k0 + 8 * n + 2 * t + (e & 1);
                s[0][n][e] = need_mask ? masked_score(s[0][n][e], scale_log2, mp, mask_bh, i, j)
                                       : s[0][n][e] * scale_log2;
            }
        }

        // Online softmax: new row max mi, rescale factor, Pij = exp2(Sij - mi).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m_i[r];
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) mx = fmaxf(mx, fmaxf(s[0][n][2 * r], s[0][n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // A row that has seen only masked keys keeps mi = -inf; use 0 as the
            // exponent base so that exp2(-inf - base) = 0 and nothing is NaN.
            const float base = (mx == NEG_INF) ? 0.f : mx;
            const float alpha = exp2f(m_i[r] - base);
            m_i[r] = mx;
            float rowsum = 0.f;
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) {
                s[0][n][2 * r] = exp2f(s[0][n][2 * r] - base);
                s[0][n][2 * r + 1] = exp2f(s[0][n][2 * r + 1] - base);
                rowsum += s[0][n][2 * r] + s[0][n][2 * r + 1];
            }
            l_i[r] = l_i[r] * alpha + rowsum;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                o_acc[n][2 * r] *= alpha;
                o_acc[n][2 * r + 1] *= alpha;
            }
        }

        cp_async_wait<0>();
        // Vj has landed; every warp is also done reading Kj.
        __syncthreads();
        if (tc + 1 < tc_end) {
            load_tile_async<BC, FWD_THREADS>(Kj, Kg, k_sn, k0 + BC, Nk, D, vec, tid);
            cp_async_commit();
        }

        // Oi += Pij Vj (through fresh accumulators of 4 output tiles).
        warp_mma_rega_add<S_TILES, O_TILES, 4>(o_acc, s[0], [&](int k, int n) { return Vj[k * LD_HEAD + n]; },
                                               lane);
    }

    // Finish: li over the 4 lanes of a row, Oi /= li, Li = mi*ln2 + log(li).
    float *Og = O + (i64)b * o_sb + (i64)h * o_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_i[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv_l = (l > 0.f) ? 1.f / l : 0.f;
        const int i = q0 + row_w + g + 8 * r;
        if (i < Nq) {
            float *orow = Og + (i64)i * o_sn;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                const int d = 8 * n + 2 * t;
                if (d < D) orow[d] = o_acc[n][2 * r] * inv_l;
                if (d + 1 < D) orow[d + 1] = o_acc[n][2 * r + 1] * inv_l;
            }
            if (t == 0 && LSE)  // (LSE = nullptr: the caller needs no lse)
                LSE[(i64)b * l_sb + (i64)h * l_sh + (i64)i * l_sn] =
                    (l > 0.f) ? m_i[r] * LN2 + logf(l) : NEG_INF;
        }
    }
}
