// XLA FFI handlers for the CPU platform, and the nanobind module that hands their capsules to
// Python (mhc/_ffi.py registers them with jax.ffi), all generated from the declared operations
// (operations.h). Each handler only converts XLA buffers and attributes into mhc views and a
// Config, calls the public C++ operation, and turns mhc::Error into an FFI InvalidArgument error;
// the operations validate everything themselves. The module's run() calls the same operations
// on host arrays, for bindings other than JAX (mhc.torch).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <array>
#include <atomic>
#include <functional>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cpu/thread_pool.h"
#include "../cpu/workspace.h"
#include "handler_common.h"
#include "mhc/ops.h"
#include "mhc/roofline.h"

namespace ffi = xla::ffi;
using mhc_ffi::ArgBuffer;
using mhc_ffi::call_flat;
using mhc_ffi::Decoded;
using mhc_ffi::ffi_entry;
using mhc_ffi::guarded;
using mhc_ffi::handler_binding;
using mhc_ffi::kOperationCount;
using mhc_ffi::kOperations;
using mhc_ffi::RetBuffer;

namespace {

// XLA's intra-op thread pool as the executor of mhc's parallel_for (src/cpu/thread_pool.h).
class XlaPool final : public mhc::cpu::Executor {
 public:
  explicit XlaPool(ffi::ThreadPool& pool) : pool_(pool), threads_(pool.num_threads()) {}
  int threads() const override { return static_cast<int>(threads_); }
  void schedule(std::function<void()> task) const override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
  int64_t threads_;
};

// Whether the kernels' helper threads come from XLA's intra-op pool (the default) or from mhc's
// own pool. Inside jitted steps (2026-12-02, 2 cores shared with other work) XLA's pool was as
// fast or faster and used less CPU (decode-sized chains 1.2-1.8x), and it adds no threads that
// compete with XLA's; results are the same bits either way. use_xla_thread_pool(False) stays for
// measuring the difference (docs/performance.md).
std::atomic<bool> run_on_xla_pool{true};

// guarded (handler_common.h), with the kernels' helper threads taken from XLA's pool when
// run_on_xla_pool is set, else from mhc's own; at most mhc::num_threads() threads either way.
template <class Body>
ffi::Error guarded_on(ffi::ThreadPool& pool, Body body) {
  if (!run_on_xla_pool.load(std::memory_order_relaxed)) return guarded(std::move(body));
  const XlaPool executor(pool);
  const mhc::cpu::ScopedExecutor scope(&executor);
  return guarded(std::move(body));
}

// The declared operation kOperations[Op], the C++ function Function, on decoded views: from XLA
// (CpuHandler) and from Python (run). Its outputs are fresh memory on most calls (XLA and torch
// allocate each anew), so they are advised onto huge pages before the kernel first touches them
// (advise_huge_pages; 4-5x cheaper page faults at T = 8192, D = 4096; docs/jax.md).
template <int Op, auto Function>
void call_declared(const mhc::Config& config, const mhc::TensorRef* inputs,
                   const mhc::MutableTensorRef* outputs) {
  for (int k = 0; k < kOperations[Op].output_count(); ++k) {
    size_t bytes = static_cast<size_t>(mhc::size_of(outputs[k].dtype));
    for (int axis = 0; axis < outputs[k].rank; ++axis) {
      bytes *= static_cast<size_t>(outputs[k].shape[axis]);
    }
    mhc::cpu::advise_huge_pages(outputs[k].data, bytes);
  }
  call_flat<kOperations[Op].input_count(), kOperations[Op].output_count()>(Function, config, inputs,
                                                                           outputs);
}

// The CPU handler of the declared operation kOperations[Op], the C++ function Function: its
// buffers, then the config attributes (handler_binding), with XLA's thread pool as context.
template <int Op, auto Function, class = std::make_index_sequence<kOperations[Op].input_count()>,
          class = std::make_index_sequence<kOperations[Op].output_count()>>
struct CpuHandler;
template <int Op, auto Function, size_t... Input, size_t... Output>
struct CpuHandler<Op, Function, std::index_sequence<Input...>, std::index_sequence<Output...>> {
  static ffi::Error call(ffi::ThreadPool pool, ArgBuffer<Input>... args, RetBuffer<Output>... rets,
                         MHC_CONFIG_PARAMS) {
    return guarded_on(pool, [&] {
      const Decoded<Op> decoded(args..., rets..., MHC_CONFIG_ARGS);
      call_declared<Op, Function>(decoded.config, decoded.inputs.data(), decoded.outputs.data());
    });
  }
  static auto bind() {
    return handler_binding<sizeof...(Input), sizeof...(Output)>(
               ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
        .To(call);
  }
};

// An operation called from Python with host arrays (run below): the flat views and the config.
using FlatCall = void (*)(const mhc::Config&, const mhc::TensorRef*, const mhc::MutableTensorRef*);

struct CpuOperation {
  XLA_FFI_Handler* handler;
  FlatCall call;
};

#define MHC_CPU_OPERATION(name, ...)                                   \
  CpuOperation{&ffi_entry<CpuHandler<mhc_ffi::op_##name, &mhc::name>>, \
               &call_declared<mhc_ffi::op_##name, &mhc::name>},
// Every declared operation's CPU handler and direct call, in the order of kOperations.
const CpuOperation kCpuOperations[] = {MHC_OPERATIONS(MHC_CPU_OPERATION)};
#undef MHC_CPU_OPERATION
static_assert(std::size(kCpuOperations) == kOperationCount);

namespace nb = nanobind;

nb::tuple strings(const char* const* names, int count) {
  nb::list list;
  for (int index = 0; index < count; ++index) list.append(names[index]);
  return nb::tuple(list);
}

nb::list operations() {
  nb::list table;
  for (const mhc_ffi::Operation& op : kOperations) {
    const int outputs = op.output_count();
    const char* names[mhc_ffi::kMaxOutputs];
    const char* shapes[mhc_ffi::kMaxOutputs];
    const char* dtypes[mhc_ffi::kMaxOutputs];
    for (int index = 0; index < outputs; ++index) {
      names[index] = op.outputs[index].name;
      shapes[index] = op.outputs[index].shape;
      dtypes[index] = op.outputs[index].dtype;
    }
    const char* cpu_cuda[] = {"cpu", "cuda"};
    nb::dict entry;
    entry["name"] = op.name;
    entry["target"] = op.target;
    entry["inputs"] = strings(op.inputs, op.input_count());
    entry["outputs"] = strings(names, outputs);
    entry["output_shapes"] = strings(shapes, outputs);
    entry["output_dtypes"] = strings(dtypes, outputs);
    entry["platforms"] = strings(cpu_cuda, op.platforms.cuda ? 2 : 1);
    table.append(entry);
  }
  return table;
}

// One host array of run() as an mhc view, or mhc::Error naming the operation and the argument.
// `array` keeps the import alive (a DLPack capsule's tensor) while the kernel runs.
template <class View, class Array>
View host_view(nb::handle object, Array& array, const mhc_ffi::Operation& op, const char* name) {
  if (!nb::try_cast(object, array, /*convert=*/false)) {
    const bool output = std::is_same_v<View, mhc::MutableTensorRef>;
    throw mhc::Error(op.c_name, name,
                     std::string("expected ") + (output ? "a writable " : "an ") +
                         "array exporting DLPack or the buffer protocol (numpy's ml_dtypes "
                         "bfloat16 exports neither), got " +
                         nb::cast<std::string>(nb::str(object.type())));
  }
  if (array.device_type() != nb::device::cpu::value) {
    throw mhc::Error(op.c_name, name, "expected an array in host memory (CPU)");
  }
  static constexpr mhc::DType f32 = mhc::DType::f32;
  static constexpr mhc::DType bf16 = mhc::DType::bf16;
  constexpr nb::dlpack::dtype kBfloat16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16,
                                        1};
  const mhc::DType* dtype = array.dtype() == nb::dtype<float>() ? &f32
                            : array.dtype() == kBfloat16        ? &bf16
                                                                : nullptr;
  std::vector<int64_t> dims(array.ndim());
  int64_t contiguous_stride = 1;
  bool contiguous = true;
  for (size_t axis = array.ndim(); axis-- > 0;) {
    dims[axis] = static_cast<int64_t>(array.shape(axis));
    if (dims[axis] != 1 && array.stride(axis) != contiguous_stride) contiguous = false;
    contiguous_stride *= dims[axis];
  }
  if (!contiguous && contiguous_stride != 0) {
    throw mhc::Error(op.c_name, name, "expected a C-contiguous array");
  }
  return mhc_ffi::make_view<View>(array.data(), dtype, dims, op.c_name, name);
}

void run(const std::string& name, const nb::sequence& inputs, const nb::sequence& outputs,
         int64_t n, int64_t mix, int64_t sinkhorn_iters, float sinkhorn_eps, float rms_eps,
         float pre_eps, float post_scale, int64_t tensor_parallel) {
  int index = 0;
  while (index < kOperationCount && name != kOperations[index].name) ++index;
  if (index == kOperationCount) {
    throw nb::value_error(("mhc.run: name: no operation named '" + name + "'").c_str());
  }
  const mhc_ffi::Operation& op = kOperations[index];
  std::string failure;
  try {
    const auto check_count = [&](const nb::sequence& arrays, int expected, const char* what) {
      const size_t given = nb::len(arrays);
      if (given != static_cast<size_t>(expected)) {
        throw mhc::Error(
            op.c_name, what,
            "expected " + std::to_string(expected) + " arrays, got " + std::to_string(given));
      }
    };
    check_count(inputs, op.input_count(), "inputs");
    check_count(outputs, op.output_count(), "outputs");
    std::array<nb::ndarray<nb::ro>, mhc_ffi::kMaxInputs> input_arrays;
    std::array<nb::ndarray<>, mhc_ffi::kMaxOutputs> output_arrays;
    std::array<mhc::TensorRef, mhc_ffi::kMaxInputs> input_views;
    std::array<mhc::MutableTensorRef, mhc_ffi::kMaxOutputs> output_views;
    for (int k = 0; k < op.input_count(); ++k) {
      input_views[k] = host_view<mhc::TensorRef>(inputs[k], input_arrays[k], op, op.inputs[k]);
    }
    for (int k = 0; k < op.output_count(); ++k) {
      output_views[k] =
          host_view<mhc::MutableTensorRef>(outputs[k], output_arrays[k], op, op.outputs[k].name);
    }
    const mhc::Config config =
        mhc_ffi::make_config(op.c_name, input_views[mhc_ffi::x_index(op)], n, mix, sinkhorn_iters,
                             sinkhorn_eps, rms_eps, pre_eps, post_scale, tensor_parallel);
    // The imported arrays (destroyed after the GIL is taken back) keep the data alive.
    nb::gil_scoped_release release;
    kCpuOperations[index].call(config, input_views.data(), output_views.data());
  } catch (const mhc::Error& error) {
    failure = error.what();
  }
  if (!failure.empty()) throw nb::value_error(failure.c_str());
}

}  // namespace

NB_MODULE(_mhc_cpu, module) {
  module.doc() = "XLA FFI handlers of mhc for the CPU platform";
  // glibc serves every block over its mmap threshold (at most 32 MiB, whatever mallopt asks) with
  // a fresh mmap, so each large XLA output is zero-filled page by page on first touch: the post
  // operations inside JAX ran at a third to half the speed of the kernels alone. With mmap off and
  // a high trim threshold, freed large blocks stay in the heap and are reused. Process-wide (the
  // heap keeps its high-water mark instead of returning freed large blocks to the system), so
  // nothing calls it by default: mhc.tune_allocator() is the explicit opt-in (mhc/__init__.py).
  // Returns whether it applied (glibc only).
  module.def("keep_large_blocks_in_heap", []() {
#if defined(__GLIBC__)
    constexpr int kTrimThreshold = 1 << 30;
    return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#else
    return false;
#endif
  });
  // Target name -> handler, for every declared operation: Python registers every entry.
  module.def("registrations", []() {
    nanobind::dict table;
    for (int index = 0; index < kOperationCount; ++index) {
      table[kOperations[index].target] =
          nanobind::capsule(reinterpret_cast<void*>(kCpuOperations[index].handler));
    }
    return table;
  });
  module.def(
      "operations", &operations,
      "The declared operations (src/ffi/operations.h): one dict per operation, with its name, "
      "FFI target, inputs, outputs, each output's shape and dtype rule, and platforms.");
  module.def("run", &run, nanobind::arg("name"), nanobind::arg("inputs"), nanobind::arg("outputs"),
             nanobind::arg("n"), nanobind::arg("mix"), nanobind::arg("sinkhorn_iters"),
             nanobind::arg("sinkhorn_eps"), nanobind::arg("rms_eps"), nanobind::arg("pre_eps"),
             nanobind::arg("post_scale"), nanobind::arg("tensor_parallel"),
             "Runs the operation `name` (operations()) on host arrays (DLPack or the buffer "
             "protocol: numpy arrays, torch CPU tensors; float32 or bfloat16, C-contiguous), "
             "writing its outputs, preallocated by the caller, in place. The config as the FFI "
             "attributes; the GIL is released while the kernel runs on mhc's thread pool. Bad "
             "input raises ValueError naming the operation and the argument.");
  // The library's thread count and the roofline ceilings, for mhc.bench and users' own timing.
  module.def("set_num_threads", &mhc::set_num_threads, nanobind::arg("threads"));
  module.def("num_threads", &mhc::num_threads);
  module.def(
      "use_xla_thread_pool", [](bool on) { run_on_xla_pool.store(on); }, nanobind::arg("on"));
  module.def("uses_xla_thread_pool", [] { return run_on_xla_pool.load(); });
  module.def("copy_bandwidth_gbs", &mhc::copy_bandwidth_gbs,
             nanobind::arg("bytes") = int64_t{256} << 20, nanobind::arg("threads") = 0,
             nanobind::arg("repeats") = 5);
  module.def("fma_peak_gflops", &mhc::fma_peak_gflops, nanobind::arg("threads") = 0);
  module.def("widest_simd", &mhc::widest_simd);
}
