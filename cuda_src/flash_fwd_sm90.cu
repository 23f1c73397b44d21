// flash_fwd_sm90.cu -- FlashAttention forward pass for Hopper (sm_90a),
// float16 / bfloat16 on the warpgroup tensor-core instructions
// (wgmma.mma_async, float32 accumulators).
//
// Algorithm: FlashAttention-2 forward (Dao 2023, Algorithm 1), with the
// products issued as Hopper warpgroup MMAs as in FlashAttention-3 (Shah et
// al. 2024, section 3): Sij = Qi Kj^T reads both operands from shared memory
// through matrix descriptors, Oi += Pij Vj takes Pij from registers.  The
// online softmax (mi, li, rescaling of Oi) is that of flash_fwd_f16.cu: scores
// in log2 units (scale * log2(e) folded in), exp2, float32 statistics, Pij
// rounded to the input type for Pij Vj, Oi /= li and Li = mi + log(li) at the
// end.  (No warp specialisation or TMA: every thread loads with cp.async.)
//
// Assumptions: as flash_fwd_f16.cu -- q (B,H,Nq,D), k/v (B,H,Nk,D), o like q
// in elem_t, lse (B,H,Nq) float32, last dimension contiguous; D <= HEAD_DIM
// (columns D..HEAD_DIM-1 zero-filled in shared memory); any Nq, Nk >= 1.
//
// Tile layout: FWD_WGS warpgroups of 128 threads (2 by default; 3 fit 168
// registers a thread where the tiles allow); warpgroup w owns rows
// 64w..64w+63 of Qi, so Br = 64 FWD_WGS; Bc = BC keys per step.  FWD_MINB
// blocks share an SM (head dim 64: Bc = 64 in 128 registers, 2 blocks, so
// one block's prologue and epilogue overlap the other's main loop).  Per thread: Sij as
// BC/2 floats, Oi as HEAD_DIM/2 floats (layout in flash_wgmma.cuh); a row's
// statistics reduce over the 4 lanes of a quad.
// Shared memory (1024-byte aligned): Qi [HD_ATOMS][Br][64], Kj and Vj
// [2 stages][HD_ATOMS][Bc][64] -- every tile is split into 64-column blocks
// whose 128-byte rows hold their 16-byte chunks XOR-swizzled by row % 8, the
// canonical 128-byte-swizzle layout of wgmma.  Qi and Kj are K-major operands
// (head dim contiguous); Vj is the MN-major (transposed) B operand of Pij Vj.
// Loads run one step ahead (cp.async): during step j, K(j+1) and Vj.  The
// softmax of step j overlaps the tensor cores' Oi += P(j-1) V(j-1)
// (FWD_OVERLAP, FlashAttention-3's intra-warpgroup pipelining).
// Grid: one block per query tile, or with FWD_PERSIST as many blocks as the
// SMs hold, each running query tiles ("jobs") until none are left and
// loading the next one's first tiles under the current one's last Pij Vj
// (see the kernel).
//
// Masks: as flash_fwd.cu -- key tiles outside the causal/window/key-length
// band are skipped, boundary tiles are masked element-wise, MASK_MODE adds a
// dense bool or float mask.  A row that sees no key ends with li = 0:
// Oi = 0, Li = -inf.

#include "flash_fwd_sm90.cuh"

// Kj or Vj into a stage: keys k0..k0+BC-1, of which those in kr are copied
// and the rest zero-filled (a tile inside kr without a test per chunk).
__device__ __forceinline__ void load_kv(elem_t *stage, const elem_t *src, i64 stride, int k0, KeyRange kr, bool vec,
                                        int D, int tid) {
    load_tile<BC, FWD_THREADS, SWIZZLED, true>(stage, src, stride, k0, kr.hi, D, vec, tid, kr.lo, range_bits(kr));
}

// Grid: gridDim.x blocks work through n_jobs jobs (n_jobs = Tr * H * B).
// With FWD_PERSIST, block x starts with job x and takes each next job from
// the job counter sched[0] (two ints, zero before the launch) in its
// current job's last key step, so that a block claims a job only when it
// is about to run it; the last block to finish sets both ints back to
// zero.  A block with a next job loads that job's Qi, K0, V0 and K1 under
// its current job's last Pij Vj and output.
// Shared memory: Qi, then Kj and Vj in two stages each, in whole swizzle
// blocks of the head dim, and the slack that aligns them to the swizzle period.
LAUNCH_SHAPE(flash_fwd_kernel, FWD_THREADS, BR, (BR + 4 * BC) * HDP * sizeof(elem_t) + SMEM_ALIGN);
TILE_MAP(flash_fwd_kernel, BR, BC);

extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MINB)
flash_fwd_kernel(const elem_t *__restrict__ Q, const elem_t *__restrict__ K, const elem_t *__restrict__ V,
                 elem_t *__restrict__ O, float *__restrict__ LSE, const void *__restrict__ mask,
                 const unsigned char *__restrict__ tmap, const int *__restrict__ key_lengths, int *__restrict__ sched,
                 int Nq, int Nk, int D, const __grid_constant__ AttnParams args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int next_job[2];  // a block's next job, alternate jobs in alternate slots
    unsigned char *smem = swizzle_base(smem_raw);
    elem_t *Qi = reinterpret_cast<elem_t *>(smem);  // [HD_ATOMS][BR][64]
    elem_t *Ks = Qi + BR * HDP;                      // [2][HD_ATOMS][BC][64]
    elem_t *Vs = Ks + 2 * BC * HDP;                  // [2][HD_ATOMS][BC][64]

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % WARP_SIZE;
    const int warp_in_wg = (tid % WG_THREADS) / WARP_SIZE;
    const int g = lane >> 2, t = lane & 3;
    const int n_qt = (Nq + BR - 1) / BR;

    // (kl, b, h: per job)
    // (the block map: per job, FwdJob::kinds)
    MaskParams mp = mask_params<BR, BC>(mask, nullptr, args, Nk, Nq, Nk, 0, 0);

    const int row_w = 64 * wg + 16 * warp_in_wg;  // first row of this warp in the tile
    // Descriptor bases: this warpgroup's 64 rows of Qi (K-major A operand).
    const u32 q_addr = smem_addr(Qi) + 64 * wg * SWZ_ROW_BYTES;
    const u32 k_addr0 = smem_addr(Ks), v_addr0 = smem_addr(Vs);
    constexpr u32 KV_STAGE_BYTES = BC * HDP * 2;

    // A job's first loads, as two groups: Qi and K0; V0 and K1.  K and V
    // tile j of the job go to stage (sb + j) % 2.
    auto load_first = [&](const elem_t *Qg, const elem_t *Kg, const elem_t *Vg, const FwdJob &jb, int sb) {
        const KeyRange kr = job_keys(jb, Nq, args);  // (the rest zero-filled)
        load_tile<BR, FWD_THREADS, SWIZZLED>(Qi, Qg, args.q_sn, jb.q0, Nq, D, args.vec, tid);
        load_kv(Ks + sb * BC * HDP, Kg, args.k_sn, jb.tc_begin * BC, kr, args.vec, D, tid);
        cp_async_commit();
        load_kv(Vs + sb * BC * HDP, Vg, args.v_sn, jb.tc_begin * BC, kr, args.vec, D, tid);
        const int second = job_next_tile(jb, jb.tc_begin);
        if (second < jb.tc_end) load_kv(Ks + (sb ^ 1) * BC * HDP, Kg, args.k_sn, second * BC, kr, args.vec, D, tid);
        cp_async_commit();
    };

    bool loaded = false;  // this job's first loads are already on their way
    int sb = 0;           // stage of this job's first K and V tile
    int job = FWD_PERSIST ? blockIdx.x : 0;
#if FWD_PERSIST
    for (int round = 0; job < args.n_jobs; ++round)
#else
    const int round = 0;
#endif
    {
        const FwdJob jb =
            fwd_job(job, n_qt, args.H, Nq, Nk, key_lengths, args.band_lo, args.band_hi, args.group_shift, tmap, args);
        // The next job's claim: thread 0 sends it in the job's last key step
        // (here for a job of one step or none) and stores the answer into
        // next_job just before the barrier that publishes it, so that the
        // round trip runs under that step's products.
        int claim = 0;
        if (FWD_PERSIST && tid == 0 && job_next_tile(jb, jb.tc_begin) >= jb.tc_end) claim = atomicAdd(sched, 1);
        mp.kl = jb.kl;
        mask_head(mp, jb.b, jb.h);
        const char *mask_bh = mask_head_base(mp, jb.b, jb.h);
        const elem_t *Qg = Q + (i64)jb.b * args.q_sb + (i64)jb.h * args.q_sh;
        const int hk = kv_head(jb.h, args.kv_group);  // the K/V head this job reads
        const elem_t *Kg = K + (i64)jb.b * args.k_sb + (i64)hk * args.k_sh;
        const elem_t *Vg = V + (i64)jb.b * args.v_sb + (i64)hk * args.v_sh;
        const int q0 = jb.q0, tc_begin = jb.tc_begin, tc_end = jb.tc_end;
        const KeyRange kr = job_keys(jb, Nq, args);  // (the rest zero-filled)

        float o_acc[O_REGS];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o_acc[i] = 0.f;
        float m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {0.f, 0.f};  // running row max (log2 units), row sum

        // Software pipeline (FlashAttention-3's intra-warpgroup overlap): step j
        // issues Sj = Qi Kj^T and O += P(j-1) V(j-1) together, runs the softmax of
        // Sj while the second product is still on the tensor cores, then rescales
        // Oi.  Loads run one step ahead: during step j, K(j+1) and Vj.
        float s[S_REGS];
        u32 p[BC / 16][4];
        if (tc_begin < tc_end) {
            if (!loaded) load_first(Qg, Kg, Vg, jb, sb);
            cp_async_wait<1>();  // this thread's Qi and K0 have landed
            fence_proxy_async();
            // Every thread's Qi and K0 are visible to the tensor cores.
            __syncthreads();
            wgmma_fence();
            wgmma_over_head_dim<BR, BC>(s, q_addr, k_addr0 + sb * KV_STAGE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold(s);
            float alpha[2];  // (Oi is still 0: nothing to rescale)
            const bool need_mask = tile_needs_mask(mp, q0, BR, tc_begin * BC, BC, map_kind(job_kinds(jb), tc_begin));
            softmax_step(s, m_i, l_i, alpha, need_mask, args.scale_log2, mp, mask_bh, q0 + row_w + g,
                         tc_begin * BC + 2 * t);
            pack_frags(p, s);
        }
        int j = tc_begin < tc_end ? 1 : 0;  // (steps taken)
        for (int tc = job_next_tile(jb, tc_begin); tc < tc_end; ++j, tc = job_next_tile(jb, tc)) {
            const int k0 = tc * BC;
            const int st = (sb + j) & 1;  // stage of Kj (and of Vj, loaded now)
            cp_async_wait<0>();           // this thread's Kj and V(j-1) have landed
            fence_proxy_async();
            // Every thread's Kj and V(j-1) are visible to the tensor cores; every
            // warpgroup is done with S(j-1) (K stage of j+1) and with
            // P(j-2) V(j-2) (V stage of j), so the next loads may overwrite them.
            __syncthreads();
            const int tc_next = job_next_tile(jb, tc);
            if (FWD_PERSIST && tid == 0 && tc_next >= tc_end) claim = atomicAdd(sched, 1);
            if (tc_next < tc_end)
                load_kv(Ks + (st ^ 1) * BC * HDP, Kg, args.k_sn, tc_next * BC, kr, args.vec, D, tid);
            load_kv(Vs + st * BC * HDP, Vg, args.v_sn, k0, kr, args.vec, D, tid);
            cp_async_commit();

            wgmma_fence();
            wgmma_over_head_dim<BR, BC>(s, q_addr, k_addr0 + st * KV_STAGE_BYTES);  // Sj = Qi Kj^T
            wgmma_commit();
            wgmma_regs_a(o_acc, p, v_addr0 + (st ^ 1) * KV_STAGE_BYTES);  // Oi += P(j-1) V(j-1)
            wgmma_commit();
#if FWD_OVERLAP
            wgmma_wait<1>();  // Sj is done; P(j-1) V(j-1) may still run
#else
            wgmma_wait<0>();  // both are done (P(j-1)'s registers free for the softmax)
            hold_frag(p);
#endif
            wgmma_hold(s);
            float alpha[2];
            softmax_step(s, m_i, l_i, alpha, tile_needs_mask(mp, q0, BR, k0, BC, map_kind(job_kinds(jb), tc)),
                         args.scale_log2, mp, mask_bh, q0 + row_w + g, k0 + 2 * t);
            wgmma_wait<0>();  // P(j-1) V(j-1) is done: Oi and P(j-1) are free
            wgmma_hold(o_acc);
            hold_frag(p);
            rescale(o_acc, alpha);
            pack_frags(p, s);
        }
        // The next job (none without FWD_PERSIST: one job per block).
        int next = args.n_jobs;
        if (FWD_PERSIST && tid == 0) next_job[round & 1] = (int)gridDim.x + claim;
        if (j > 0) {
            cp_async_wait<0>();  // this thread's last V has landed
            fence_proxy_async();
            // Every thread's last V is visible to the tensor cores; every
            // warpgroup is done with Qi, both K stages and the other V stage
            // (the next job's loads may overwrite them); next_job is written.
            __syncthreads();
            if (FWD_PERSIST) next = next_job[round & 1];
            const int last = (sb + j - 1) & 1;  // stage of the last V
#if FWD_PERSIST
            sb = last ^ 1;
            loaded = false;
            if (next < args.n_jobs) {
                const FwdJob nb = fwd_job(next, n_qt, args.H, Nq, Nk, key_lengths, args.band_lo, args.band_hi,
                                          args.group_shift, tmap, args);
                loaded = nb.tc_begin < nb.tc_end;
                if (loaded) {  // under the last product and the output
                    const int nk = kv_head(nb.h, args.kv_group);
                    load_first(Q + (i64)nb.b * args.q_sb + (i64)nb.h * args.q_sh,
                               K + (i64)nb.b * args.k_sb + (i64)nk * args.k_sh,
                               V + (i64)nb.b * args.v_sb + (i64)nk * args.v_sh, nb, sb);
                }
            }
#endif
            wgmma_fence();
            wgmma_regs_a(o_acc, p, v_addr0 + last * KV_STAGE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold(o_acc);
            hold_frag(p);
        } else {
            loaded = false;
            if (FWD_PERSIST) {
                // next_job is written.
                __syncthreads();
                next = next_job[round & 1];
            }
        }

        // Finish: li over the 4 lanes of a row, Oi /= li, Li = mi*ln2 + log(li).
        elem_t *Og = O + (i64)jb.b * args.o_sb + (i64)jb.h * args.o_sh;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            store_out_row<HEAD_DIM / 8>(Og, args.o_sn, LSE, jb.b, jb.h, args.l_sb, args.l_sh, args.l_sn,
                                        q0 + row_w + g, r, Nq, D, t, m_i[r], l_i[r], args.vec,
                                        [&](int n, int e) { return o_acc[4 * n + 2 * r + e]; });
        job = next;
    }

    // The last block to finish leaves the job counter at zero for the next launch.
    if (FWD_PERSIST && tid == 0) {
        __threadfence();  // this block's claims come before its count
        if (atomicAdd(sched + 1, 1) == (int)gridDim.x - 1) {
            sched[0] = 0;
            sched[1] = 0;
        }
    }
}
