// The operations of mhc/ops.h, each declared once: its name, its inputs and outputs (with each
// output's shape and dtype rule), and the platforms that have a kernel. From this list come,
// with no code written per operation: the CPU and CUDA XLA FFI handlers (their binding,
// decoding and registration under "mhc_<name>"), the argument names in their errors, mhc._mhc_cpu's
// operations() and run() (the metadata and direct calls the Python bindings are built from).
//
// A row: X(name, platforms, MHC_INPUTS(...), MHC_OUTPUTS(...)).
// - name: the C++ function mhc::<name> (and mhc::cuda::<name> where CUDA has it); its FFI target
//   is "mhc_<name>". Inputs and outputs are listed flat, in the order of the function's
//   parameters, an aggregate (Params, PreForwardOutputs, ...) taking one entry per member:
//   the call is deduced from the function's signature (call_flat below), and a list that does
//   not match it fails to compile.
// - platforms: cpu; cpu_cuda; or cpu_cuda_scratch, whose CUDA kernel takes a workspace of
//   mhc::cuda::<name>_workspace_bytes(config, T) bytes from XLA's scratch allocator.
// - each output: {name, shape, dtype}. shape is "[...]" over T = x.shape[0], n = x.shape[1],
//   D = x.shape[2] (this device's slice), N = phi.shape[1] (the projection's width, 2n + n^2
//   or 2n + n!: only in the rules of operations that take phi), or "shape of <input>"; dtype is
//   "f32" or "dtype of <input>".
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mhc/config.h"
#include "mhc/ops.h"
#include "mhc/tensor.h"

// clang-format off
// The argument groups several operations share, in the order of the aggregates' members.
#define MHC_PARAMS "norm_weight", "phi", "alpha", "bias"
#define MHC_PARAM_GRADS                                                                           \
  {"dnorm_weight", "shape of norm_weight", "f32"}, {"dphi", "shape of phi", "f32"},               \
  {"dalpha", "shape of alpha", "f32"}, {"dbias", "shape of bias", "f32"}
#define MHC_PRE_FORWARD_OUTPUTS(prefix)                                                           \
  {prefix "layer_in", "[T, D]", "dtype of x"}, {prefix "h_pre", "[T, n]", "f32"},                 \
  {prefix "h_post", "[T, n]", "f32"}, {prefix "h_res", "[T, n, n]", "f32"}
#define MHC_POST_BACKWARD_OUTPUTS                                                                 \
  {"dx_partial", "shape of x", "dtype of x"},                                                     \
  {"dlayer_out", "shape of layer_out", "dtype of layer_out"},                                     \
  {"dh_post", "[T, n]", "f32"}, {"dh_res", "[T, n, n]", "f32"}

#define MHC_INPUTS(...) {__VA_ARGS__}
#define MHC_OUTPUTS(...) {__VA_ARGS__}

#define MHC_OPERATIONS(X)                                                                         \
  X(pre_forward, cpu_cuda_scratch, MHC_INPUTS("x", MHC_PARAMS),                                   \
    MHC_OUTPUTS(MHC_PRE_FORWARD_OUTPUTS("")))                                                     \
  X(post_forward, cpu_cuda, MHC_INPUTS("x", "layer_out", "h_post", "h_res"),                      \
    MHC_OUTPUTS({"out", "shape of x", "dtype of x"}))                                             \
  X(post_backward, cpu_cuda, MHC_INPUTS("g", "x", "layer_out", "h_post", "h_res"),                \
    MHC_OUTPUTS(MHC_POST_BACKWARD_OUTPUTS))                                                       \
  X(pre_backward, cpu_cuda_scratch,                                                               \
    MHC_INPUTS("dlayer_in", "dx_partial", "dh_post", "dh_res", "x", MHC_PARAMS),                  \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, MHC_PARAM_GRADS))                             \
  X(boundary_forward, cpu,                                                                        \
    MHC_INPUTS("x", "layer_out", "h_post", "h_res", MHC_PARAMS),                                  \
    MHC_OUTPUTS({"x_next", "shape of x", "dtype of x"}, MHC_PRE_FORWARD_OUTPUTS("next_")))        \
  X(boundary_backward, cpu,                                                                       \
    MHC_INPUTS("next_dlayer_in", "next_dx_partial", "next_dh_post", "next_dh_res", "x",           \
               "layer_out", "h_post", "h_res", MHC_PARAMS),                                       \
    MHC_OUTPUTS(MHC_POST_BACKWARD_OUTPUTS, MHC_PARAM_GRADS))                                      \
  X(head_forward, cpu, MHC_INPUTS("x", "fn", "base", "scale"),                                    \
    MHC_OUTPUTS({"out", "[T, D]", "dtype of x"}, {"gates", "[T, n]", "f32"}))                     \
  X(head_backward, cpu, MHC_INPUTS("dout", "x", "fn", "base", "scale"),                           \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, {"dfn", "shape of fn", "f32"},                \
                {"dbase", "shape of base", "f32"}, {"dscale", "shape of scale", "f32"}))          \
  X(pre_forward_partials, cpu_cuda_scratch, MHC_INPUTS("x", "norm_weight", "phi"),                \
    MHC_OUTPUTS({"partials", "[T, N + 1]", "f32"}))                                               \
  X(pre_forward_finish, cpu_cuda_scratch, MHC_INPUTS("x", "partials", "alpha", "bias"),           \
    MHC_OUTPUTS(MHC_PRE_FORWARD_OUTPUTS("")))                                                     \
  X(pre_backward_partials, cpu_cuda, MHC_INPUTS("dlayer_in", "x"),                                \
    MHC_OUTPUTS({"dh_pre", "[T, n]", "f32"}))                                                     \
  X(pre_backward_finish, cpu_cuda_scratch,                                                        \
    MHC_INPUTS("dlayer_in", "dx_partial", "dh_pre", "dh_post", "dh_res", "x", "partials",         \
               MHC_PARAMS),                                                                       \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, MHC_PARAM_GRADS))                             \
  X(pre_forward_carried, cpu, MHC_INPUTS("x", "carried", MHC_PARAMS),                             \
    MHC_OUTPUTS(MHC_PRE_FORWARD_OUTPUTS("")))                                                     \
  X(pre_backward_carried, cpu,                                                                    \
    MHC_INPUTS("dlayer_in", "dx_partial", "dh_pre", "dh_post", "dh_res", "x", "carried",          \
               MHC_PARAMS),                                                                       \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, {"dcarried", "shape of carried", "f32"},      \
                MHC_PARAM_GRADS))                                                                 \
  X(collapse_forward, cpu, MHC_INPUTS("x", "carried"),                                            \
    MHC_OUTPUTS({"out", "[T, D]", "dtype of x"}))                                                 \
  X(collapse_backward, cpu, MHC_INPUTS("dout", "x", "carried"),                                   \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, {"dcarried", "shape of carried", "f32"}))     \
  X(boundary_forward_carried, cpu,                                                                \
    MHC_INPUTS("x", "layer_out", "h_pre", "h_post", "h_res", MHC_PARAMS),                         \
    MHC_OUTPUTS({"x_next", "shape of x", "dtype of x"}, MHC_PRE_FORWARD_OUTPUTS("next_")))        \
  X(boundary_backward_carried, cpu,                                                               \
    MHC_INPUTS("next_dlayer_in", "next_dx_partial", "next_dh_pre", "next_dh_post",                \
               "next_dh_res", "x", "layer_out", "h_pre", "h_post", "h_res", MHC_PARAMS),          \
    MHC_OUTPUTS(MHC_POST_BACKWARD_OUTPUTS, {"dh_pre", "[T, n]", "f32"}, MHC_PARAM_GRADS))         \
  X(pre_forward_finish_carried, cpu,                                                              \
    MHC_INPUTS("x", "partials", "carried", "alpha", "bias"),                                      \
    MHC_OUTPUTS(MHC_PRE_FORWARD_OUTPUTS("")))                                                     \
  X(pre_backward_finish_carried, cpu,                                                             \
    MHC_INPUTS("dlayer_in", "dx_partial", "dh_pre", "dh_post", "dh_res", "x", "partials",         \
               "carried", MHC_PARAMS),                                                            \
    MHC_OUTPUTS({"dx", "shape of x", "dtype of x"}, MHC_PARAM_GRADS))
// clang-format on

namespace mhc_ffi {

// The most inputs and outputs an operation has (boundary_backward_carried: 14 and 9).
inline constexpr int kMaxInputs = 14;
inline constexpr int kMaxOutputs = 9;

struct OutputRule {
  const char* name;
  const char* shape;
  const char* dtype;
};

struct Platforms {
  bool cuda;
  bool cuda_scratch;
};
inline constexpr Platforms cpu{false, false};
inline constexpr Platforms cpu_cuda{true, false};
inline constexpr Platforms cpu_cuda_scratch{true, true};

struct Operation {
  const char* name;    // mhc::<name>; FFI target "mhc_<name>"
  const char* c_name;  // "mhc::<name>", the operation as its errors name it
  const char* target;  // "mhc_<name>"
  Platforms platforms;
  const char* inputs[kMaxInputs];  // the unused tail is null
  OutputRule outputs[kMaxOutputs];

  constexpr int input_count() const {
    int count = 0;
    while (count < kMaxInputs && inputs[count] != nullptr) ++count;
    return count;
  }
  constexpr int output_count() const {
    int count = 0;
    while (count < kMaxOutputs && outputs[count].name != nullptr) ++count;
    return count;
  }
};

#define MHC_OPERATION_ENTRY(name, platforms, inputs, outputs) \
  Operation{#name, "mhc::" #name, "mhc_" #name, platforms, inputs, outputs},
inline constexpr Operation kOperations[] = {MHC_OPERATIONS(MHC_OPERATION_ENTRY)};
#undef MHC_OPERATION_ENTRY

// Each operation's index in kOperations, as a named constant: kOperations[op_pre_forward].
#define MHC_OPERATION_INDEX(name, ...) op_##name,
enum OperationIndex : int { MHC_OPERATIONS(MHC_OPERATION_INDEX) kOperationCount };
#undef MHC_OPERATION_INDEX

// Calling an operation from flat lists of views. A parameter of the C++ function is one view
// (TensorRef: an input, MutableTensorRef: an output) or an aggregate of views (Params,
// PreForwardOutputs, ...), which takes as many flat entries as it has members.
template <class Group, class = void>
struct IsInputGroup : std::false_type {};
template <class Group>
struct IsInputGroup<Group, std::void_t<decltype(Group{std::declval<mhc::TensorRef>()})>>
    : std::true_type {};  // brace-initialisable from a read-only view: inputs

static_assert(sizeof(mhc::TensorRef) == sizeof(mhc::MutableTensorRef));

template <class Group>
constexpr size_t flat_size() {
  static_assert(std::is_same_v<Group, mhc::TensorRef> ||
                    std::is_same_v<Group, mhc::MutableTensorRef> || std::is_aggregate_v<Group>,
                "an operation's parameters are views or aggregates of views");
  static_assert(sizeof(Group) % sizeof(mhc::TensorRef) == 0);
  // An aggregate of views counted by its size (the asserts above: only views, all one size).
  return sizeof(Group) / sizeof(mhc::TensorRef);  // NOLINT(bugprone-sizeof-expression)
}

template <class Group, class View, size_t... Member>
Group make_group(const View* views, std::index_sequence<Member...>) {
  return Group{views[Member]...};
}

// The flat entries of one direction (inputs or outputs) taken by the groups before Group K.
template <bool Inputs, class Groups, size_t... Before>
constexpr size_t flat_offset(std::index_sequence<Before...>) {
  return (size_t{0} + ... +
          (IsInputGroup<std::tuple_element_t<Before, Groups>>::value == Inputs
               ? flat_size<std::tuple_element_t<Before, Groups>>()
               : 0));
}

template <size_t K, class Groups>
auto group_at(const mhc::TensorRef* inputs, const mhc::MutableTensorRef* outputs) {
  using Group = std::tuple_element_t<K, Groups>;
  constexpr bool is_input = IsInputGroup<Group>::value;
  constexpr size_t offset = flat_offset<is_input, Groups>(std::make_index_sequence<K>{});
  constexpr auto members = std::make_index_sequence<flat_size<Group>()>{};
  if constexpr (is_input) {
    return make_group<Group>(inputs + offset, members);
  } else {
    return make_group<Group>(outputs + offset, members);
  }
}

template <class... Args, class... Extra, size_t... K>
void call_groups(void (*function)(const mhc::Config&, Args...), const mhc::Config& config,
                 const mhc::TensorRef* inputs, const mhc::MutableTensorRef* outputs,
                 std::index_sequence<K...>, Extra&&... extra) {
  using Groups = std::tuple<std::decay_t<Args>...>;
  function(config, group_at<K, Groups>(inputs, outputs)..., std::forward<Extra>(extra)...);
}

// function(config, <its groups from the flat views>..., extra...): the operation's trailing
// parameters that are not views (the CUDA backend's workspace and stream) come as `extra`.
// InputCount and OutputCount are the declaration's: a declaration that does not match the
// function's parameters fails to compile here.
template <int InputCount, int OutputCount, class... Args, class... Extra>
void call_flat(void (*function)(const mhc::Config&, Args...), const mhc::Config& config,
               const mhc::TensorRef* inputs, const mhc::MutableTensorRef* outputs,
               Extra&&... extra) {
  constexpr size_t groups = sizeof...(Args) - sizeof...(Extra);
  using Groups = std::tuple<std::decay_t<Args>...>;
  static_assert(flat_offset<true, Groups>(std::make_index_sequence<groups>{}) == InputCount,
                "the declaration's inputs do not match the operation's parameters");
  static_assert(flat_offset<false, Groups>(std::make_index_sequence<groups>{}) == OutputCount,
                "the declaration's outputs do not match the operation's parameters");
  call_groups(function, config, inputs, outputs, std::make_index_sequence<groups>{},
              std::forward<Extra>(extra)...);
}

}  // namespace mhc_ffi
