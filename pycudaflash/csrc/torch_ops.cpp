// The host fast path of pycudaflash's torch operators, in C++.
//
// What it does
// ------------
// Registers, for CUDA tensors, the kernels of the operators that
// pycudaflash/torch.py defines:
//   * CUDA key of pycudaflash::flash_fwd and ::flash_bwd: allocate the outputs through torch's
//     caching allocator, look the call's signature up in a plan cache and launch the plan's
//     kernels on torch's current stream (cuLaunchKernel); no Python runs on a hit;
//   * AutogradCUDA key of pycudaflash::flash_fwd: the autograd node (a torch::autograd::Function)
//     whose backward calls pycudaflash::flash_bwd, so that an eager backward runs no Python.
// On a miss the signature is planned by the Python operator pycudaflash::_fast_plan (validation,
// kernel variant, grid, packed parameters: pycudaflash/_fastpath.py), which returns the plan as a
// flat int64 tensor; this file copies it and never calls Python for that signature again.
// Calls it does not serve (key lengths given on the host) go to pycudaflash::_flash_fwd_py /
// _flash_bwd_py, the Python implementations.
//
// Assumptions
// -----------
// * The tensors live in their device's primary context (torch's); the launch makes that context
//   current for its duration where the calling thread has another one or none, and pops it after.
// * The driver entry points come from Python (pycudaflash_fast_init): this file includes no CUDA
//   header and links to no CUDA library.
// * A signature is everything the plan depends on: per tensor its device, dtype, shape and
//   strides; whether every pointer is 16-byte aligned; the options; the stream (plans that
//   schedule through a per-stream job counter carry its address).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The C++ signatures of the operators pycudaflash/torch.py defines (flash_fwd and _flash_fwd_py
// share one schema, flash_bwd and _flash_bwd_py another), and the typed handle of one of them.
using FwdSig = std::tuple<Tensor, Tensor>(const Tensor &, const Tensor &, const Tensor &, const OptTensor &,
                                          const OptTensor &, c10::string_view, int64_t, int64_t, double, bool);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                                  const Tensor &, const Tensor &, const OptTensor &,
                                                  const OptTensor &, c10::string_view, int64_t, int64_t, double,
                                                  bool);
using PlanSig = Tensor(c10::string_view, at::TensorList, const OptTensor &, const OptTensor &, c10::string_view,
                       int64_t, int64_t, double, bool, int64_t);

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char *name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// ------------------------------------------------------------------ the driver

using CUresult = int;
using LaunchFn = CUresult (*)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned smem, void *stream, void **params, void **extra);
using CtxGetFn = CUresult (*)(void **ctx);
using CtxPushFn = CUresult (*)(void *ctx);
using CtxPopFn = CUresult (*)(void **ctx);
using ErrNameFn = CUresult (*)(CUresult err, const char **name);
// cuTensorMapEncodeTiled (its enumerations as int, the map 128 bytes aligned to 64).
using EncodeFn = CUresult (*)(void *map, int dtype, uint32_t rank, void *base, const uint64_t *dims,
                              const uint64_t *strides, const uint32_t *box, const uint32_t *elem_strides,
                              int interleave, int swizzle, int l2_promotion, int oob_fill);

struct Driver {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxPushFn ctx_push = nullptr;
  CtxPopFn ctx_pop = nullptr;
  ErrNameFn err_name = nullptr;
  EncodeFn encode = nullptr;
};
Driver drv;

void check(CUresult code, const char *call) {
  if (code == 0) return;
  const char *name = nullptr;
  if (drv.err_name == nullptr || drv.err_name(code, &name) != 0 || name == nullptr) name = "unknown error";
  TORCH_CHECK(false, call, " failed: ", name, " (", code, ")");
}

// Make context `ctx` current for one scope; pop it again if it had to be pushed.
struct ContextScope {
  bool pushed = false;
  explicit ContextScope(void *ctx) {
    void *cur = nullptr;
    check(drv.ctx_get(&cur), "cuCtxGetCurrent");
    if (cur != ctx) {
      check(drv.ctx_push(ctx), "cuCtxPushCurrent");
      pushed = true;
    }
  }
  ~ContextScope() {
    if (pushed) {
      void *popped = nullptr;
      drv.ctx_pop(&popped);  // (a destructor does not throw; the push succeeded)
    }
  }
};

// ------------------------------------------------------------------- plans
//
// A plan as _fast_plan lays it out (int64 words):
//   VERSION, context, n_vals, kl_slot, ws_slot, cnt_slot, counter, ws_bytes, n_derived,
//   n_struct_words, n_kernels, n_maps,
//   n_derived x (slot, src, offset), n_struct_words x struct word,
//   n_maps x (word, slot, n_args, n_args x argument),
//   n_kernels x (function, gx, gy, gz, bx, by, bz, smem, n_params, n_params x (kind, value))
// A parameter of kind >= 0 is pointer slot `kind`; STRUCT_PARAM the plan's struct; VALUE_PARAM
// the 8-byte `value`.  A map is a TMA tensor map the struct holds at word `word` (16 words) for
// the operand of pointer slot `slot`: cuTensorMapEncodeTiled's arguments after the base address
// (pycudaflash._tma.encode_args), encoded again whenever that operand's address changes.

constexpr int64_t VERSION = 2;
constexpr int64_t STRUCT_PARAM = -1;
constexpr int64_t VALUE_PARAM = -2;
constexpr int MAX_SLOTS = 32;   // pointer slots of a plan (cuda_backend._Pointers.CAPACITY)
constexpr int MAX_PARAMS = 64;  // parameters of a kernel
constexpr size_t MAX_PLANS = 1024;
constexpr int MAP_WORDS = 16;  // 128 bytes of an encoded map
constexpr int MAX_RANK = 5;    // dimensions of a tensor map

struct TensorMap {
  size_t word;
  int slot;
  int dtype, interleave, swizzle, l2, oob;
  uint32_t rank;
  uint64_t dims[MAX_RANK], strides[MAX_RANK];
  uint32_t box[MAX_RANK], elem[MAX_RANK];
};

struct Kernel {
  void *fn;
  unsigned grid[3], block[3], smem;
  std::vector<int64_t> kinds;
  std::vector<uint64_t> values;
};

struct Plan {
  void *ctx;
  int n_vals, kl_slot, ws_slot, cnt_slot;
  uint64_t counter;
  int64_t ws_bytes;
  std::vector<std::array<int64_t, 3>> derived;
  std::vector<uint64_t> struct_words;
  std::vector<Kernel> kernels;
  std::vector<TensorMap> maps;
  // The struct with the maps of the operands last launched (plans with maps only; their launches
  // hold `lock`: the struct is the plan's).
  mutable std::mutex lock;
  mutable std::vector<uint64_t> mapped_words;
  mutable std::vector<uint64_t> mapped_ptrs;
};

std::shared_ptr<const Plan> parse_plan(const Tensor &blob) {
  TORCH_CHECK(blob.scalar_type() == at::kLong && blob.dim() == 1 && blob.is_contiguous() && !blob.is_cuda(),
              "pycudaflash::_fast_plan must return a contiguous 1-d int64 CPU tensor");
  const int64_t *w = blob.data_ptr<int64_t>();
  const int64_t n = blob.numel();
  int64_t at = 0;
  auto next = [&]() -> int64_t {
    TORCH_CHECK(at < n, "pycudaflash::_fast_plan returned a truncated plan");
    return w[at++];
  };
  TORCH_CHECK(next() == VERSION, "pycudaflash::_fast_plan returned a plan of another version");
  auto plan = std::make_shared<Plan>();
  plan->ctx = reinterpret_cast<void *>(static_cast<uintptr_t>(next()));
  plan->n_vals = static_cast<int>(next());
  plan->kl_slot = static_cast<int>(next());
  plan->ws_slot = static_cast<int>(next());
  plan->cnt_slot = static_cast<int>(next());
  plan->counter = static_cast<uint64_t>(next());
  plan->ws_bytes = next();
  const int64_t n_derived = next(), n_words = next(), n_kernels = next(), n_maps = next();
  TORCH_CHECK(plan->n_vals >= 0 && plan->n_vals + n_derived <= MAX_SLOTS, "plan: too many pointer slots");
  for (int64_t i = 0; i < n_derived; ++i) {
    std::array<int64_t, 3> d{next(), next(), next()};
    TORCH_CHECK(d[0] >= plan->n_vals && d[0] < MAX_SLOTS && d[1] >= 0 && d[1] < plan->n_vals,
                "plan: a derived pointer slot out of range");
    plan->derived.push_back(d);
  }
  for (int64_t i = 0; i < n_words; ++i) plan->struct_words.push_back(static_cast<uint64_t>(next()));
  for (int64_t i = 0; i < n_maps; ++i) {
    TensorMap m;
    const int64_t word = next(), slot = next(), n_args = next();
    TORCH_CHECK(word >= 0 && word % 8 == 0 && word + MAP_WORDS <= n_words && slot >= 0 && slot < plan->n_vals,
                "plan: a tensor map out of place");
    m.word = static_cast<size_t>(word);
    m.slot = static_cast<int>(slot);
    m.dtype = static_cast<int>(next());
    const int64_t rank = next();
    // (data type, rank, rank dims, rank - 1 strides, rank box extents, rank element strides, 4 enums)
    TORCH_CHECK(rank >= 1 && rank <= MAX_RANK && n_args == 5 + 4 * rank, "plan: a tensor map of unknown form");
    m.rank = static_cast<uint32_t>(rank);
    for (int64_t d = 0; d < rank; ++d) m.dims[d] = static_cast<uint64_t>(next());
    for (int64_t d = 0; d + 1 < rank; ++d) m.strides[d] = static_cast<uint64_t>(next());
    for (int64_t d = 0; d < rank; ++d) m.box[d] = static_cast<uint32_t>(next());
    for (int64_t d = 0; d < rank; ++d) m.elem[d] = static_cast<uint32_t>(next());
    m.interleave = static_cast<int>(next());
    m.swizzle = static_cast<int>(next());
    m.l2 = static_cast<int>(next());
    m.oob = static_cast<int>(next());
    plan->maps.push_back(m);
  }
  plan->mapped_words = plan->struct_words;
  plan->mapped_ptrs.assign(plan->maps.size(), 0);  // (0: not encoded yet; operands are never at 0)
  for (int64_t i = 0; i < n_kernels; ++i) {
    Kernel k;
    k.fn = reinterpret_cast<void *>(static_cast<uintptr_t>(next()));
    for (unsigned &g : k.grid) g = static_cast<unsigned>(next());
    for (unsigned &b : k.block) b = static_cast<unsigned>(next());
    k.smem = static_cast<unsigned>(next());
    const int64_t n_params = next();
    TORCH_CHECK(n_params >= 0 && n_params <= MAX_PARAMS, "plan: a kernel with too many parameters");
    for (int64_t p = 0; p < n_params; ++p) {
      const int64_t kind = next(), value = next();
      TORCH_CHECK(kind == STRUCT_PARAM || kind == VALUE_PARAM || (kind >= 0 && kind < MAX_SLOTS),
                  "plan: a parameter of unknown kind");
      k.kinds.push_back(kind);
      k.values.push_back(static_cast<uint64_t>(value));
    }
    plan->kernels.push_back(std::move(k));
  }
  TORCH_CHECK(at == n, "pycudaflash::_fast_plan returned trailing words");
  return plan;
}

// The struct of `plan` with its tensor maps over the operands of `slots` (encoded where an
// operand's address changed since the last launch); the caller holds plan.lock.
const uint64_t *mapped_struct(const Plan &plan, const uint64_t (&slots)[MAX_SLOTS]) {
  for (size_t i = 0; i < plan.maps.size(); ++i) {
    const TensorMap &m = plan.maps[i];
    const uint64_t ptr = slots[m.slot];
    if (ptr == plan.mapped_ptrs[i]) continue;
    alignas(64) uint64_t raw[MAP_WORDS];
    check(drv.encode(raw, m.dtype, m.rank, reinterpret_cast<void *>(ptr), m.dims, m.strides, m.box, m.elem,
                     m.interleave, m.swizzle, m.l2, m.oob),
          "cuTensorMapEncodeTiled");
    std::memcpy(plan.mapped_words.data() + m.word, raw, sizeof(raw));
    plan.mapped_ptrs[i] = ptr;
  }
  return plan.mapped_words.data();
}

// Launch every kernel of `plan` on `stream` with value slots `vals` (pointer slots 0..n_vals-1).
void launch(const Plan &plan, uint64_t (&slots)[MAX_SLOTS], void *stream) {
  TORCH_CHECK(drv.launch != nullptr && drv.ctx_get != nullptr && drv.encode != nullptr,
              "pycudaflash's C++ host path was loaded without the driver's entry points (pycudaflash_fast_init)");
  for (const auto &d : plan.derived) slots[d[0]] = slots[d[1]] + static_cast<uint64_t>(d[2]);
  ContextScope scope(plan.ctx);
  std::unique_lock<std::mutex> held;
  const uint64_t *words = plan.struct_words.data();
  if (!plan.maps.empty()) {  // (cuLaunchKernel copies the struct: the lock covers encoding and launches)
    held = std::unique_lock<std::mutex>(plan.lock);
    words = mapped_struct(plan, slots);
  }
  for (const Kernel &k : plan.kernels) {
    void *params[MAX_PARAMS];
    const size_t n = k.kinds.size();
    for (size_t p = 0; p < n; ++p) {
      const int64_t kind = k.kinds[p];
      params[p] = kind >= 0 ? static_cast<void *>(&slots[kind])
                  : kind == STRUCT_PARAM ? const_cast<uint64_t *>(words)
                                         : const_cast<uint64_t *>(&k.values[p]);
    }
    check(drv.launch(k.fn, k.grid[0], k.grid[1], k.grid[2], k.block[0], k.block[1], k.block[2], k.smem, stream,
                     params, nullptr),
          "cuLaunchKernel");
  }
}

// ---------------------------------------------------------------- signatures

struct KeyHash {
  size_t operator()(const std::vector<int64_t> &v) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

std::mutex plans_lock;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Plan>, KeyHash> plans;

void add_tensor(std::vector<int64_t> &key, const Tensor &t) {
  key.push_back(t.get_device());
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
}

void add_optional(std::vector<int64_t> &key, const OptTensor &t) {
  if (t.has_value() && t->defined()) {
    key.push_back(1);
    add_tensor(key, *t);
  } else {
    key.push_back(0);
  }
}

void add_options(std::vector<int64_t> &key, c10::string_view causal, int64_t left, int64_t right, double scale,
                 bool deterministic) {
  key.push_back(static_cast<int64_t>(causal.size()));
  for (char c : causal) key.push_back(c);
  key.push_back(left);
  key.push_back(right);
  int64_t bits;
  static_assert(sizeof(bits) == sizeof(scale), "double is 8 bytes");
  std::memcpy(&bits, &scale, sizeof(bits));
  key.push_back(bits);
  key.push_back(deterministic);
}

uint64_t ptr_of(const OptTensor &t) {
  return t.has_value() && t->defined() ? reinterpret_cast<uint64_t>(t->data_ptr()) : 0;
}

// A new tensor shaped like the (B, H, N, D) tensor `t`: contiguous when `t` is, else (B, N, H, D)
// storage viewed as (B, H, N, D) (pycudaflash.torch.empty_like_layout).
Tensor empty_like_layout(const Tensor &t) {
  if (t.is_contiguous()) return at::empty(t.sizes(), t.options());
  const int64_t B = t.size(0), H = t.size(1), N = t.size(2), D = t.size(3);
  return at::empty_strided({B, H, N, D}, {N * H * D, D, H * D, 1}, t.options());
}

void *current_stream(const Tensor &t) {
  const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return s.native_handle();
}

// The plan of `key`, made on a miss by pycudaflash::_fast_plan from the tensors `operands()`
// returns (the pass's inputs and the outputs just allocated).
template <class Operands>
std::shared_ptr<const Plan> find_plan(const std::vector<int64_t> &key, const char *kind, Operands operands,
                                      const OptTensor &mask, const OptTensor &kl, c10::string_view causal,
                                      int64_t left, int64_t right, double scale, bool deterministic,
                                      void *stream) {
  {
    std::lock_guard<std::mutex> g(plans_lock);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
  }
  static const auto plan_op = op<PlanSig>("pycudaflash::_fast_plan");
  const std::vector<Tensor> tensors = operands();
  const Tensor blob = plan_op.call(kind, tensors, mask, kl, causal, left, right, scale, deterministic,
                                   static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)));
  auto plan = parse_plan(blob);
  std::lock_guard<std::mutex> g(plans_lock);
  if (plans.size() >= MAX_PLANS) plans.clear();
  plans.emplace(key, plan);
  return plan;
}

// Workspace of a plan: bytes from torch's caching allocator on the current stream, released
// when the launch returns (reused by later work on that stream only).
void put_workspace(const Plan &plan, const Tensor &like, uint64_t (&slots)[MAX_SLOTS], Tensor &ws) {
  if (plan.ws_bytes > 0) {
    ws = at::empty({plan.ws_bytes}, like.options().dtype(at::kByte));
    slots[plan.ws_slot] = reinterpret_cast<uint64_t>(ws.data_ptr());
  }
  if (plan.cnt_slot >= 0) slots[plan.cnt_slot] = plan.counter;
}

bool host_key_lengths(const OptTensor &kl) { return kl.has_value() && kl->defined() && !kl->is_cuda(); }

struct Options {
  c10::string_view causal;
  int64_t left, right;
  double scale;
  bool deterministic;
};

// Run pass `pass` (0: "fwd", 1: "bwd") of a call on torch's current stream.  `operands`: the
// pass's tensors in the order _fast_plan takes them (for the forward q, k, v, out, lse; for the
// backward dout, q, k, v, out, lse, dq, dk, dv); `keyed`: those whose layouts the signature
// holds (the outputs' layouts follow from them).
template <size_t N>
void run_pass(int64_t pass, const char *kind, const std::array<const Tensor *, N> &operands,
              std::initializer_list<const Tensor *> keyed, const OptTensor &mask, const OptTensor &kl,
              const Options &o) {
  // Value slots, in the order of cuda_backend.ForwardPlan / BackwardPlan: the operands (the
  // backward's dout after out), the mask, then the key lengths and workspace (plan->*_slot).
  static_assert(N == 5 || N == 9, "a forward or backward pass");
  static constexpr int kOrder[2][9] = {{0, 1, 2, 3, 4}, {1, 2, 3, 4, 0, 5, 6, 7, 8}};
  const Tensor &like = *operands[N == 5 ? 0 : 1];
  void *stream = current_stream(like);
  uint64_t slots[MAX_SLOTS] = {};
  uint64_t low = 0;
  for (size_t i = 0; i < N; ++i)
    low |= slots[i] = reinterpret_cast<uint64_t>(operands[kOrder[pass][i]]->data_ptr());
  slots[N] = ptr_of(mask);
  const uint64_t kl_ptr = ptr_of(kl);
  std::vector<int64_t> key;
  key.reserve(96);
  key.push_back(pass);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)));
  key.push_back(((low | slots[N] | kl_ptr) & 15) == 0);
  for (const Tensor *t : keyed) add_tensor(key, *t);
  add_optional(key, mask);
  add_optional(key, kl);
  add_options(key, o.causal, o.left, o.right, o.scale, o.deterministic);
  const auto tensors = [&] {
    std::vector<Tensor> v;
    for (const Tensor *t : operands) v.push_back(*t);
    return v;
  };
  auto plan = find_plan(key, kind, tensors, mask, kl, o.causal, o.left, o.right, o.scale, o.deterministic, stream);
  if (plan->kl_slot >= 0) slots[plan->kl_slot] = kl_ptr;
  Tensor ws;
  put_workspace(*plan, like, slots, ws);
  launch(*plan, slots, stream);
}

// ------------------------------------------------------------ the CUDA kernels

std::tuple<Tensor, Tensor> flash_fwd_cuda(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &mask,
                                          const OptTensor &kl, c10::string_view causal, int64_t left,
                                          int64_t right, double scale, bool deterministic) {
  if (host_key_lengths(kl)) {
    static const auto py = op<FwdSig>("pycudaflash::_flash_fwd_py");
    return py.call(q, k, v, mask, kl, causal, left, right, scale, deterministic);
  }
  // (the one check before validation: the outputs' shapes read q's four sizes; ValueError in Python)
  TORCH_CHECK_VALUE(q.dim() == 4, "q must have 4 dimensions (B, H, Nq, D), got ", q.dim());
  Tensor out = empty_like_layout(q);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  run_pass<5>(0, "fwd", {&q, &k, &v, &out, &lse}, {&q, &k, &v}, mask, kl,
              {causal, left, right, scale, deterministic});
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_bwd_cuda(const Tensor &dout_in, const Tensor &q, const Tensor &k,
                                                  const Tensor &v, const Tensor &out, const Tensor &lse,
                                                  const OptTensor &mask, const OptTensor &kl,
                                                  c10::string_view causal, int64_t left, int64_t right,
                                                  double scale, bool deterministic) {
  if (host_key_lengths(kl)) {
    static const auto py = op<BwdSig>("pycudaflash::_flash_bwd_py");
    return py.call(dout_in, q, k, v, out, lse, mask, kl, causal, left, right, scale, deterministic);
  }
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k and v must have 4 dimensions, got ",
                    q.dim(), ", ", k.dim(), " and ", v.dim());
  // The kernels read rows of D contiguous elements (autograd may hand an expanded gradient).
  const Tensor dout = dout_in.dim() > 0 && dout_in.stride(-1) != 1 && dout_in.size(-1) > 1
                          ? dout_in.contiguous() : dout_in;
  Tensor dq = empty_like_layout(q), dk = empty_like_layout(k), dv = empty_like_layout(v);
  run_pass<9>(1, "bwd", {&dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv}, {&q, &k, &v, &out, &dout, &lse}, mask, kl,
              {causal, left, right, scale, deterministic});
  return {dq, dk, dv};
}

// ------------------------------------------------------------------ autograd

struct Attention : public torch::autograd::Function<Attention> {
  // Forward: the operator below autograd (the CUDA kernel above, or a fake tensor's shapes).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx, const Tensor &q,
                                                const Tensor &k, const Tensor &v, const OptTensor &mask,
                                                const OptTensor &kl, c10::string_view causal, int64_t left,
                                                int64_t right, double scale, bool deterministic) {
    static const auto fwd = op<FwdSig>("pycudaflash::flash_fwd");
    at::AutoDispatchBelowADInplaceOrView below;  // (apply turns grad mode off, but dispatch would reach us again)
    auto [out, lse] = fwd.call(q, k, v, mask, kl, causal, left, right, scale, deterministic);
    ctx->save_for_backward({q, k, v, out, lse, mask.value_or(Tensor()), kl.value_or(Tensor())});
    ctx->saved_data["causal"] = std::string(causal);
    ctx->saved_data["left"] = left;
    ctx->saved_data["right"] = right;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // (no zero-filled gradient of lse for the backward to ignore)
    return {out, lse};
  }

  // Backward: dQ, dK, dV by pycudaflash::flash_bwd; nothing for the other arguments.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return torch::autograd::variable_list(10);  // (out did not reach the loss)
    const auto saved = ctx->get_saved_variables();
    const OptTensor mask = saved[5].defined() ? OptTensor(saved[5]) : std::nullopt;
    const OptTensor kl = saved[6].defined() ? OptTensor(saved[6]) : std::nullopt;
    const std::string causal = ctx->saved_data["causal"].toStringRef();
    static const auto bwd = op<BwdSig>("pycudaflash::flash_bwd");
    auto [dq, dk, dv] = bwd.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], mask, kl,
                                      causal, ctx->saved_data["left"].toInt(), ctx->saved_data["right"].toInt(),
                                      ctx->saved_data["scale"].toDouble(),
                                      ctx->saved_data["deterministic"].toBool());
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> flash_fwd_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                                              const OptTensor &mask, const OptTensor &kl, c10::string_view causal,
                                              int64_t left, int64_t right, double scale, bool deterministic) {
  auto res = Attention::apply(q, k, v, mask, kl, causal, left, right, scale, deterministic);
  return {res[0], res[1]};
}

}  // namespace

// Called once from Python (pycudaflash._fastpath) with the addresses of libcuda's entry points:
// cuLaunchKernel, cuCtxGetCurrent, cuCtxPushCurrent_v2, cuCtxPopCurrent_v2, cuGetErrorName,
// cuTensorMapEncodeTiled.
extern "C" int pycudaflash_fast_init(const uint64_t *addresses, int n) {
  if (n != 6) return 1;
  drv.launch = reinterpret_cast<LaunchFn>(addresses[0]);
  drv.ctx_get = reinterpret_cast<CtxGetFn>(addresses[1]);
  drv.ctx_push = reinterpret_cast<CtxPushFn>(addresses[2]);
  drv.ctx_pop = reinterpret_cast<CtxPopFn>(addresses[3]);
  drv.err_name = reinterpret_cast<ErrNameFn>(addresses[4]);
  drv.encode = reinterpret_cast<EncodeFn>(addresses[5]);
  return 0;
}

// Parse the plan of `n` words (what _fast_plan returns) without keeping it: its number of tensor
// maps, or -1 with the reason in `msg` (for tests of the layout; no driver call).
extern "C" int64_t pycudaflash_fast_parse(const int64_t *words, int64_t n, char *msg, int64_t cap) {
  try {
    const Tensor blob = at::from_blob(const_cast<int64_t *>(words), {n}, at::TensorOptions().dtype(at::kLong));
    return static_cast<int64_t>(parse_plan(blob)->maps.size());
  } catch (const std::exception &e) {
    if (cap > 0) {
      std::strncpy(msg, e.what(), static_cast<size_t>(cap - 1));
      msg[cap - 1] = '\0';
    }
    return -1;
  }
}

// Forget every plan (pycudaflash._calls.clear).
extern "C" void pycudaflash_fast_clear() {
  std::lock_guard<std::mutex> g(plans_lock);
  plans.clear();
}

TORCH_LIBRARY_IMPL(pycudaflash, CUDA, m) {
  m.impl("flash_fwd", &flash_fwd_cuda);
  m.impl("flash_bwd", &flash_bwd_cuda);
}

TORCH_LIBRARY_IMPL(pycudaflash, AutogradCUDA, m) { m.impl("flash_fwd", &flash_fwd_autograd); }
