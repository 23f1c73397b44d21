// flash_tma.cuh -- the Tensor Memory Accelerator and the asynchronous
// transaction barriers of Hopper (sm_90a), for kernels whose loads are issued
// by one producer warp and waited on by consumer warpgroups.
//
// A tensor map (TmaMap, encoded on the host by pycudaflash._tma) describes a
// (B, H, N, D) operand; tma_load copies a box of 64 head-dim columns x ROWS
// rows of one (b, h) plane into shared memory in the 128-byte swizzle of
// flash_common_sm90.cuh (the map's swizzle mode), zero-filling rows past N
// and columns past D.  The copy signals an mbarrier with the bytes it wrote
// ("transactions"): a waiter that saw the barrier's phase flip knows the whole
// box has landed.
//
// One pipeline stage = one shared-memory buffer and two barriers:
//   full[s]   the producer arms it with the bytes it expects (arrive_expect_tx),
//             the TMA completes them; consumers wait on it before reading.
//   empty[s]  each consumer warpgroup arrives when it has finished reading;
//             the producer waits on it before overwriting the buffer.
// Phases alternate 0, 1, 0, ... each time a barrier completes; a stage's
// k-th use waits for parity k & 1 (PipeState tracks stage and parity).
//
// Registers: setmaxnreg moves registers between warpgroups (the producer
// gives its own up, the consumers take them); it must be executed by all
// threads of a warpgroup, and the block's total must stay within the launch's.
// Named barriers (bar.sync / bar.arrive with an id and a thread count) order
// consumer warpgroups among themselves without stopping the producer.
//
// Bulk reductions (cp.reduce.async.bulk) add a buffer of shared memory into
// global memory through the same copy engine: the Hopper backward adds its
// staged dQi tiles that way.

#pragma once
// (included by flash_common_sm90.cuh, after smem_addr, u32, u64 and fence_proxy_async)

// (TmaMap, a tensor map as the kernel receives it: flash_params.cuh.)

// ---------------------------------------------------------------- mbarriers

// Initialise a barrier that completes a phase after `count` arrivals (and the
// transactions armed on it).  One thread; then fence_barrier_init and a block
// barrier before any other thread or the TMA uses it.
__device__ __forceinline__ void mbar_init(u64 *bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Make initialised barriers visible to the asynchronous proxy (the TMA).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive once and arm the barrier with `bytes` more transactions to wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64 *bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Arrive once (a consumer releasing a stage).
__device__ __forceinline__ void mbar_arrive(u64 *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Wait until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u64 *bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// Stage and parity of a ring of STAGES buffers, advanced once per use.
template <int STAGES>
struct PipeState {
    int stage = 0;
    u32 parity = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == STAGES) stage = 0, parity ^= 1u;
    }
};

// ---------------------------------------------------------------------- TMA

// Bring a tensor map into the constant cache before its first use.
__device__ __forceinline__ void tma_prefetch_map(const TmaMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// Copy the box at coordinates (col, row, h, b) -- innermost first, in elements
// -- of `map` into shared memory at `dst` (1024-byte aligned for the 128-byte
// swizzle); completion is counted on `bar` in bytes.
__device__ __forceinline__ void tma_load(void *dst, const TmaMap *map, u64 *bar, int col, int row, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(dst)),
        "l"(map), "r"(smem_addr(bar)), "r"(col), "r"(row), "r"(h), "r"(b)
        : "memory");
}

// Copy the shared-memory box at `src` to coordinates (col, row, h, b) of
// `map` (elements outside the tensor are not written).  A bulk operation:
// commit and wait as below.
__device__ __forceinline__ void tma_store(const TmaMap *map, const void *src, int col, int row, int h, int b) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     map),
                 "r"(smem_addr(src)), "r"(col), "r"(row), "r"(h), "r"(b)
                 : "memory");
}

// dst[0, bytes/4) += src[0, bytes/4) in float32, element by element, done by the
// copy engine at the L2 (atomic per element against other blocks' additions);
// dst and src 16-byte aligned, bytes a multiple of 16.  A bulk operation.
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, const float *src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(smem_addr(src)), "r"(bytes)
                 : "memory");
}

// Bulk groups, per thread: commit the bulk operations this thread issued
// since its last commit as one group; wait until at most N of its committed
// groups still read shared memory (_read: the source may then be reused) or
// are still running at all (their global writes done).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// (A bulk operation reading shared memory written by threads follows fence_proxy_async
// in each writer and a barrier among them: flash_common_sm90.cuh.)

// ------------------------------------------------ registers, named barriers

// Raise (consumers) or lower (producer) this warpgroup's registers a thread
// to N (a multiple of 8 in [24, 256]).
template <int N>
__device__ __forceinline__ void regs_raise() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_lower() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads
// (a multiple of 32): sync waits for all of them, arrive only counts itself.
__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
