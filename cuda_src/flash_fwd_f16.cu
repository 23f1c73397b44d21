// flash_fwd_f16.cu -- FlashAttention forward pass, float16 / bfloat16 on the
// tensor cores (mma.sync.m16n8k16, float32 accumulators).
//
// Algorithm: FlashAttention-2 forward (Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023, Algorithm 1).  Each
// block owns one query tile Qi (Br rows) of one (batch, head) and streams the
// key/value tiles Kj, Vj (Bc rows) through shared memory; the running row
// maximum mi, row sum li and the unnormalised output Oi stay in float32
// registers (online softmax).  Pij is rounded to the input type for Pij Vj.
// At the end Oi /= li (rounded once to the input type) and Li = mi + log(li).
//
// Assumptions: q (B,H,Nq,D), k/v (B,H,Nk,D), o like q in elem_t, lse
// (B,H,Nq) float32, last dimension contiguous, any other strides; D <=
// HEAD_DIM (zero-filled to HEAD_DIM in shared memory).  Any Nq, Nk >= 1.
//
// Tile layout: FWD_WARPS warps, warp w owns FWD_MT row blocks of 16 rows, so
// Br = 16 * FWD_MT * FWD_WARPS; Bc keys per step.  Shared memory: Qi[Br][LDH],
// Kj[Bc][LDH], Vj[Bc][LDH] (LDH = HEAD_DIM + 8).  Kj and Vj are single
// buffers whose loads overlap compute: Vj loads while Sij = Qi Kj^T and the
// softmax run, K(j+1) loads while Oi += Pij Vj runs.  Per warp: Sij as
// 16 x Bc C fragments (Bc/2 floats a thread per row block), Oi as 16 x
// HEAD_DIM (HEAD_DIM/2 floats); a thread holds rows g and g+8 of each row
// block, so a row's statistics reduce over the 4 lanes of a quad.  Scores are
// in log2 units (scale * log2(e) folded in) and exponentiated with exp2.
//
// Masks: as flash_fwd.cu -- key tiles outside the causal/window/key-length
// band are skipped, boundary tiles are masked element-wise, MASK_MODE adds a
// dense bool or float mask.  A row that sees no key ends with li = 0:
// Oi = 0, Li = -inf.

#include "flash_common_f16.cuh"

#ifndef FWD_WARPS
#error "FWD_WARPS must be defined (pycudaflash.compiler.defines)"
#endif
// Defaults as pycudaflash.compiler.tiles() (which passes them as -D).
#ifndef FWD_MT
#error "FWD_MT must be defined (pycudaflash.compiler.defines)"
#endif
#ifndef BC
#error "BC must be defined (pycudaflash.compiler.defines)"
#endif
#define FWD_THREADS (FWD_WARPS * WARP_SIZE)
#define BR (16 * FWD_MT * FWD_WARPS)
#define S_TILES (BC / 8)         // 8-wide score tiles per row block
#define O_TILES (HEAD_DIM / 8)   // 8-wide output tiles
#define K_STEPS (HEAD_DIM / 16)  // 16-wide k steps over the head dim

static_assert(BC % 16 == 0, "key tile is a whole number of 16-wide k steps for Pij Vj");
static_assert(HEAD_DIM % 16 == 0, "head dim is a whole number of 16-wide tiles");

#ifndef FWD_MIN_BLOCKS
#define FWD_MIN_BLOCKS 1
#endif

extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MIN_BLOCKS)
flash_fwd_kernel(const elem_t *__restrict__ Q, const elem_t *__restrict__ K, const elem_t *__restrict__ V,
                 elem_t *__restrict__ O, float *__restrict__ LSE, const void *__restrict__ mask,
                 const int *__restrict__ key_lengths, int Nq, int Nk, int D, i64 q_sb, i64 q_sh, i64 q_sn,
                 i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                 i64 l_sb, i64 l_sh, i64 l_sn, i64 m_sb, i64 m_sh, i64 m_sq, i64 m_sk, float scale_log2,
                 int band_lo, int band_hi, int vec, int kv_group) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t *Qi = reinterpret_cast<elem_t *>(smem_raw);  // [BR][LDH]
    elem_t *Kj = Qi + BR * LDH;                         // [BC][LDH]
    elem_t *Vj = Kj + BC * LDH;                         // [BC][LDH]

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    // Launch the last query tiles first: under a causal mask they are the longest.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;

    const MaskParams mp =
        mask_params(mask, m_sb, m_sh, m_sq, m_sk, band_lo, band_hi, key_length(key_lengths, b, Nk), Nq);
    const char *mask_bh = mask_head_base(mp, b, h);

    const elem_t *Qg = Q + (i64)b * q_sb + (i64)h * q_sh;
    const int hk = kv_head(h, kv_group);  // the K/V head this query head reads
    const elem_t *Kg = K + (i64)b * k_sb + (i64)hk * k_sh;
    const elem_t *Vg = V + (i64)b * v_sb + (i64)hk * v_sh;

    // Keys any row of this tile may see.
    const TileRange kt = key_tiles(q0, BR, Nq, mp.kl, band_lo, band_hi, BC);
    const int tc_begin = kt.begin, tc_end = kt.end;

    float o_acc[FWD_MT][O_TILES][4];
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
        for (int n = 0; n < O_TILES; ++n) o_acc[mt][n][0] = o_acc[mt][n][1] = o_acc[mt][n][2] = o_acc[mt][n][3] = 0.f;
    float m_i[FWD_MT][2], l_i[FWD_MT][2];  // running row max (log2 units), row sum (own columns)
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt) m_i[mt][0] = m_i[mt][1] = NEG_INF, l_i[mt][0] = l_i[mt][1] = 0.f;

    const int row_w = 16 * FWD_MT * warp;  // first row of this warp in the tile

    if (tc_begin < tc_end) {
        // Load Qi and the first Kj.
        load_tile_h<BR, FWD_THREADS>(Qi, Qg, q_sn, q0, Nq, D, vec, tid);
        load_tile_h<BC, FWD_THREADS>(Kj, Kg, k_sn, tc_begin * BC, Nk, D, vec, tid);
        cp_async_commit();
    }

    for (int tc = tc_begin; tc < tc_end; ++tc) {
        const int k0 = tc * BC;
        cp_async_wait<0>();
        // Qi and Kj have landed for every thread; every warp is also done with
        // the previous Vj, so it may be overwritten now.
        __syncthreads();
        load_tile_h<BC, FWD_THREADS>(Vj, Vg, v_sn, k0, Nk, D, vec, tid);
        cp_async_commit();

        // Sij = Qi Kj^T (16 x BC per row block).  The fragments of k step
        // ks + 1 load while the products of step ks run; zero-filled head-dim
        // columns past D add nothing.
        float s[FWD_MT][S_TILES][4];
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#if LEAN_REGISTERS
#pragma unroll 1
        for (int ks = 0; ks < K_STEPS; ++ks) {
            u32 a[FWD_MT][4];
#pragma unroll
            for (int mt = 0; mt < FWD_MT; ++mt) load_a(a[mt], Qi, LDH, row_w + 16 * mt, 16 * ks, lane);
#pragma unroll
            for (int np = 0; np < S_TILES / 2; ++np) {
                u32 bf[4];
                load_b_nk(bf, Kj, LDH, 16 * np, 16 * ks, lane);
#pragma unroll
                for (int mt = 0; mt < FWD_MT; ++mt) {
                    mma16816(s[mt][2 * np], a[mt], bf[0], bf[1]);
                    mma16816(s[mt][2 * np + 1], a[mt], bf[2], bf[3]);
                }
            }
        }
#else
        {
            u32 a[2][FWD_MT][4], bf[2][S_TILES / 2][4];
#pragma unroll
            for (int mt = 0; mt < FWD_MT; ++mt) load_a(a[0][mt], Qi, LDH, row_w + 16 * mt, 0, lane);
#pragma unroll
            for (int np = 0; np < S_TILES / 2; ++np) load_b_nk(bf[0][np], Kj, LDH, 16 * np, 0, lane);
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks) {
                const int cur = ks & 1;
                if (ks + 1 < K_STEPS) {
#pragma unroll
                    for (int mt = 0; mt < FWD_MT; ++mt)
                        load_a(a[cur ^ 1][mt], Qi, LDH, row_w + 16 * mt, 16 * (ks + 1), lane);
#pragma unroll
                    for (int np = 0; np < S_TILES / 2; ++np)
                        load_b_nk(bf[cur ^ 1][np], Kj, LDH, 16 * np, 16 * (ks + 1), lane);
                }
#pragma unroll
                for (int np = 0; np < S_TILES / 2; ++np)
#pragma unroll
                    for (int mt = 0; mt < FWD_MT; ++mt) {
                        mma16816(s[mt][2 * np], a[cur][mt], bf[cur][np][0], bf[cur][np][1]);
                        mma16816(s[mt][2 * np + 1], a[cur][mt], bf[cur][np][2], bf[cur][np][3]);
                    }
            }
        }
#endif

        // Scale to log2 units and apply the masks on boundary tiles.
        const bool need_mask = tile_needs_mask(mp, q0, BR, k0, BC);
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = q0 + row_w + 16 * mt + g + 8 * (e >> 1);
                    const int j = k0 + 8 * n + 2 * t + (e & 1);
                    s[mt][n][e] = need_mask ? masked_score(s[mt][n][e], scale_log2, mp, mask_bh, i, j)
                                            : s[mt][n][e] * scale_log2;
                }

        // Online softmax: new row max mi, rescale factor, Pij = exp2(Sij - mi).
#pragma unroll
        for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m_i[mt][r];
#pragma unroll
                for (int n = 0; n < S_TILES; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // A row that has seen only masked keys keeps mi = -inf; use 0 as the
                // exponent base so that exp2(-inf - base) = 0 and nothing is NaN.
                const float base = (mx == NEG_INF) ? 0.f : mx;
                const float alpha = exp2_fast(m_i[mt][r] - base);
                m_i[mt][r] = mx;
                float rowsum = 0.f;
#pragma unroll
                for (int n = 0; n < S_TILES; ++n) {
                    s[mt][n][2 * r] = exp2_fast(s[mt][n][2 * r] - base);
                    s[mt][n][2 * r + 1] = exp2_fast(s[mt][n][2 * r + 1] - base);
                    rowsum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
                }
                l_i[mt][r] = l_i[mt][r] * alpha + rowsum;
#pragma unroll
                for (int n = 0; n < O_TILES; ++n) {
                    o_acc[mt][n][2 * r] *= alpha;
                    o_acc[mt][n][2 * r + 1] *= alpha;
                }
            }

        cp_async_wait<0>();
        // Vj has landed; every warp is also done reading Kj.
        __syncthreads();
        if (tc + 1 < tc_end) {
            load_tile_h<BC, FWD_THREADS>(Kj, Kg, k_sn, k0 + BC, Nk, D, vec, tid);
            cp_async_commit();
        }

        // Oi += Pij Vj, Pij rounded to elem_t straight from the C fragments.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 p[FWD_MT][4];
#pragma unroll
            for (int mt = 0; mt < FWD_MT; ++mt) {
                p[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                p[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                p[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                p[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < O_TILES / 2; ++dp) {  // (zero-filled columns past D give zeros)
                u32 bf[4];
                load_b_kn(bf, Vj, LDH, 16 * dp, 16 * kk, lane);
#pragma unroll
                for (int mt = 0; mt < FWD_MT; ++mt) {
                    mma16816(o_acc[mt][2 * dp], p[mt], bf[0], bf[1]);
                    mma16816(o_acc[mt][2 * dp + 1], p[mt], bf[2], bf[3]);
                }
            }
        }
    }

    // Finish: li over the 4 lanes of a row, Oi /= li, Li = mi*ln2 + log(li).
    elem_t *Og = O + (i64)b * o_sb + (i64)h * o_sh;
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_i[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv_l = (l > 0.f) ? 1.f / l : 0.f;
            const int i = q0 + row_w + 16 * mt + g + 8 * r;
            if (i < Nq) {
                elem_t *orow = Og + (i64)i * o_sn;
#pragma unroll
                for (int n = 0; n < O_TILES; ++n)
                    store_pair(orow, 8 * n + 2 * t, D, o_acc[mt][n][2 * r] * inv_l, o_acc[mt][n][2 * r + 1] * inv_l,
                               vec);
                if (t == 0 && LSE)  // (LSE = nullptr: the caller needs no lse)
                    LSE[(i64)b * l_sb + (i64)h * l_sh + (i64)i * l_sn] =
                        (l > 0.f) ? m_i[mt][r] * LN2 + logf(l) : NEG_INF;
            }
        }
}
