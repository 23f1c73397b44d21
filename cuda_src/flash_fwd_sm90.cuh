// flash_fwd_sm90.cuh -- what the Hopper forward kernels share (flash_fwd_sm90.cu,
// loading with cp.async from every thread, and flash_fwd_sm90_tma.cu, loading
// through the TMA from a producer warp): tile sizes and their defines, the
// online softmax of one tile, the rescaling of Oi, and the jobs (query tiles)
// with their key tiles.  FWD_THREADS counts the threads that compute (the
// consumer warpgroups).

#pragma once
#include "flash_common_sm90.cuh"

// Keys per step (Bc):
#ifndef BC
#error "BC must be defined (pycudaflash.compiler.defines)"
#endif
// Overlap the softmax of Sj with O += P(j-1) V(j-1) (keeps P(j-1) live
// through the softmax: off where a float mask's addressing needs the registers).
#ifndef FWD_OVERLAP
#if MASK_MODE == 2 && HEAD_DIM >= 128
#define FWD_OVERLAP 0
#else
#define FWD_OVERLAP 1
#endif
#endif
// Fold the scale into the exponent on unmasked tiles (measured faster up to
// head dim 128, slower at 256).
#ifndef FWD_FOLD
#define FWD_FOLD (HEAD_DIM <= 128)
#endif
// Warpgroups of 64 query rows each per block:
#ifndef FWD_WGS
#error "FWD_WGS must be defined (pycudaflash.compiler.defines)"
#endif
// Persistent blocks: a block runs jobs until none are left, loading the next
// job's first tiles under the current one's last product (see the kernel).
#ifndef FWD_PERSIST
#error "FWD_PERSIST must be defined (pycudaflash.compiler.defines)"
#endif
// Blocks per SM the registers must allow:
#ifndef FWD_MINB
#error "FWD_MINB must be defined (pycudaflash.compiler.defines)"
#endif
#define FWD_THREADS (FWD_WGS * WG_THREADS)
#define BR (64 * FWD_WGS)
#define S_REGS (BC / 2)                         // Sij floats per thread
#define O_REGS (HEAD_DIM / 2)                   // Oi floats per thread

static_assert(BC % 16 == 0 && BC >= 32 && BC <= 192, "key tile: whole k steps of Pij Vj, a wgmma N");
static_assert(HEAD_DIM % 16 == 0, "head dim: whole k steps of Qi Kj^T");
static_assert(FWD_WGS >= 1 && FWD_WGS <= 3, "warpgroups of a block (up to 384 threads)");
static_assert(BR % 8 == 0 && BC % 8 == 0, "tiles are whole 8-row swizzle groups");

// Scores to log2 units (tile_score: masked on boundary tiles, through the
// score modifier if any), then the online softmax
// of one tile: new row max mi, alpha = exp2(m_old - mi) for Oi, Pij =
// exp2(Sij - mi) in place, li = alpha * li + rowsum(Pij) (this thread's
// columns).  i0: row of s[0]; j0: column of s[0].  With FWD_FOLD, on a
// tile without masks or score modifier (and scale > 0, so that scaling keeps the maximum) the
// scale is folded into the exponent instead: the raw row maximum, then one
// FFMA per score, exp2(s * scale_log2 - mi).
__device__ __forceinline__ void softmax_step(float (&s)[S_REGS], float (&m_i)[2], float (&l_i)[2], float (&alpha)[2],
                                             bool need_mask, float scale_log2, const MaskParams &mp,
                                             const char *mask_bh, int i0, int j0) {
    const bool fold = FWD_FOLD && !SCORE_MOD && !need_mask && scale_log2 > 0.f;
    if (!fold) {
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[4 * n + e] = tile_score(s[4 * n + e], need_mask, scale_log2, mp, mask_bh, i0 + 8 * (e >> 1),
                                          j0 + 8 * n + (e & 1));
    }
    const float c = fold ? scale_log2 : 1.f;  // what still multiplies s
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(m_i[r], mx * c);
        // A row that has seen only masked keys keeps mi = -inf; use 0 as the
        // exponent base so that exp2(-inf - base) = 0 and nothing is NaN.
        const float base = (mx == NEG_INF) ? 0.f : mx;
        alpha[r] = exp2_fast(m_i[r] - base);
        m_i[r] = mx;
        float rowsum = 0.f;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
            s[4 * n + 2 * r] = exp2_fast(fmaf(s[4 * n + 2 * r], c, -base));
            s[4 * n + 2 * r + 1] = exp2_fast(fmaf(s[4 * n + 2 * r + 1], c, -base));
            rowsum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
        }
        l_i[r] = l_i[r] * alpha[r] + rowsum;
    }
}

__device__ __forceinline__ void rescale(float (&o)[O_REGS], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
        o[4 * n + 0] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
    }
}

// One job: query tile q0..q0+Br-1 of (batch b, head h) and the key tiles
// before tc_end that any of its rows may see and the block map leaves, from
// tc_begin (job_next_tile walks on).
struct FwdJob {
    int b, h, q0, kl;
    int tc_begin, tc_end;  // its key tiles, from the first the block map leaves
#if TILE_MAPS
    const unsigned char *kinds;  // the block map's entries of its query tile (nullptr: none)
    const u32 *seen;             // the seen-key bits of its plane (nullptr: none)
#endif
};

// The block map's entries of a job's query tile (nullptr: none).
__device__ __forceinline__ const unsigned char *job_kinds(const FwdJob &jb) {
#if TILE_MAPS
    return jb.kinds;
#else
    (void)jb;
    return nullptr;
#endif
}

// The keys a job's rows may see: the band's, those of the seen-key bits (the rest zero-filled).
__device__ __forceinline__ KeyRange job_keys(const FwdJob &jb, int Nq, const AttnParams &args) {
#if TILE_MAPS
    return seen_keys(jb.q0, BR, Nq, jb.kl, args.band_lo, args.band_hi, jb.seen);
#else
    return seen_keys(jb.q0, BR, Nq, jb.kl, args.band_lo, args.band_hi);
#endif
}

// The job's first key tile after tile t that the block map leaves (or tc_end).
__device__ __forceinline__ int job_next_tile(const FwdJob &jb, int t) {
    return next_tile(job_kinds(jb), 1, t + 1, jb.tc_end);
}

// Job `job` of the work list.  The (batch, head) pairs form groups of
// 2^group_shift consecutive pairs (a power of two that divides B * H); a
// group's jobs run in tile-rank order, the last query tile of every head of
// the group first, then the second last, and so on, heads fastest.  Under a
// causal mask the last tile is the longest, so the list ends on its
// shortest jobs (the blocks finish together); group_shift = 0 keeps the
// tiles of one head side by side (its Kj, Vj shared in L2).
__device__ __forceinline__ FwdJob fwd_job(int job, int n_qt, int H, int Nq, int Nk, const int *key_lengths,
                                          int band_lo, int band_hi, int group_shift, const unsigned char *tmap,
                                          const AttnParams &args) {
    FwdJob jb;
#if FWD_PERSIST
    const int head_in_group = job & ((1 << group_shift) - 1);
    const int t = job >> group_shift;  // (group, rank)
    const int group = t / n_qt;
    const int rank = t - group * n_qt;  // 0: the last query tile
    const int bh = (group << group_shift) + head_in_group;
    jb.q0 = (n_qt - 1 - rank) * BR;
    jb.h = bh % H;
    jb.b = bh / H;
#else
    // One job per block, grid (Tr, H, B), the last tile of a head first;
    // indices the compiler can read again instead of keeping them in registers.
    jb.q0 = (gridDim.x - 1 - blockIdx.x) * BR;
    jb.h = blockIdx.y;
    jb.b = blockIdx.z;
#endif
    jb.kl = key_length(key_lengths, jb.b, Nk);
    const TileRange kt = key_tiles(jb.q0, BR, Nq, jb.kl, band_lo, band_hi, BC);
#if TILE_MAPS
    const unsigned char *plane = map_plane<BR, BC>(tmap, args, Nq, Nk, jb.b, jb.h);
    jb.kinds = plane ? plane + (i64)(jb.q0 / BR) * ((Nk + BC - 1) / BC) : nullptr;
    jb.seen = plane_seen<BR, BC>(plane, Nq, Nk);
#else
    (void)tmap; (void)args;
#endif
    jb.tc_end = kt.end;
    jb.tc_begin = next_tile(job_kinds(jb), 1, kt.begin, kt.end);
    return jb;
}
