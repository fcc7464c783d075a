// Python bindings of the fused Adam step, the sum of squares, the bandwidth probe and the thread pool.
// Arguments are raw addresses and sizes: offload/optim/functional.py checks dtype, device, contiguity and
// sizes before calling. Every call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_kernels.h"
#include "bindings.h"
#include "common/thread_pool.h"

namespace offload {

namespace py = pybind11;

namespace {

DType parse_dtype(int code, const char* what) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument(std::string(what) + ": dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(code));
  }
  return static_cast<DType>(code);
}

void check_numel(int64_t numel) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
}

}  // namespace

void bind_adam(py::module_& m) {
  py::class_<ThreadPool>(m, "ThreadPool",
                         "A persistent pool of worker threads for the CPU kernels; num_threads counts the caller.")
      .def(py::init([](int num_threads) {
             if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
             return new ThreadPool(num_threads);
           }),
           py::arg("num_threads"))
      .def_property_readonly("size", &ThreadPool::size);

  m.attr("PARALLEL_THRESHOLD") = kParallelThreshold;  // fewer elements: one thread, whatever num_threads says

  m.def("adam_isa", [] { return std::string(adam_isa_name()); },
        "The Adam kernel variant in use: 'avx512', 'avx2' or 'scalar'.");

  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t numel,
         uintptr_t out, int out_dtype, int64_t step, double lr, double beta1, double beta2, double eps,
         double weight_decay, bool adamw, double grad_scale, int num_threads, ThreadPool* pool,
         const std::string& isa, uintptr_t crcs) {
        check_numel(numel);
        if (step < 1) throw std::invalid_argument("step must be >= 1");
        AdamBuffers b{address<float>(param), address<float>(exp_avg), address<float>(exp_avg_sq),
                      address<const void>(grad), parse_dtype(grad_dtype, "grad"), address<void>(out),
                      parse_dtype(out_dtype, "out")};
        adam_step(b, make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale), numel, pool,
                  num_threads, adam_kernels_for(isa), address<uint32_t>(crcs));
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("numel"), py::arg("out"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "", py::arg("crcs") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Fused Adam/AdamW step over flat buffers given by address (out=0: none). dtype codes: 0 fp32, 1 bf16, 2 fp16.\n"
      "isa: '' for the best variant on this CPU, or one of avx512/avx2/scalar (tests). crcs: 0, or the address of\n"
      "6 uint32 that receive the CRC-32C of each piece written, in the same pass: param, exp_avg, 0, exp_avg_sq, 0,\n"
      "out (0 without out).");

  m.def(
      "adam_step_resting",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t numel,
         uintptr_t out, int out_dtype, int64_t step, double lr, double beta1, double beta2, double eps,
         double weight_decay, uintptr_t miss_index, uintptr_t miss_bits, int64_t capacity, int num_threads,
         ThreadPool* pool, const std::string& isa, int64_t index_base, uintptr_t crcs) {
        check_numel(numel);
        if (step < 1) throw std::invalid_argument("step must be >= 1");
        const DType g_dtype = parse_dtype(grad_dtype, "grad");
        if (g_dtype == DType::kFloat32) {
          throw std::invalid_argument("adam_step_resting: the gradient must be bf16 or fp16 (fp32 is not rebuilt)");
        }
        if (capacity < 0) throw std::invalid_argument("capacity must be >= 0");
        AdamBuffers b{address<float>(param), address<float>(exp_avg), address<float>(exp_avg_sq),
                      address<const void>(grad), g_dtype, address<void>(out), parse_dtype(out_dtype, "out")};
        return adam_step_resting(b, make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, true, 1.0), numel,
                                 pool, num_threads, adam_kernels_for(isa), address<int64_t>(miss_index),
                                 address<uint16_t>(miss_bits), capacity, index_base, address<uint32_t>(crcs));
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("numel"), py::arg("out"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("miss_index"), py::arg("miss_bits"),
      py::arg("capacity"), py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "",
      py::arg("index_base") = 0, py::arg("crcs") = 0, py::call_guard<py::gil_scoped_release>(),
      "AdamW step (grad_scale 1) that also checks the bf16/fp16 gradient can be rebuilt from the old and new first "
      "moment; the elements it cannot (index + index_base as int64, ascending; bits uint16; at most capacity) are "
      "written out. Returns their count (> capacity: the lists are incomplete and unsorted). crcs: as for adam_step.");

  m.def(
      "rebuild_gradient",
      [](uintptr_t m_old, uintptr_t m_new, double beta1, uintptr_t out, int dtype, int64_t numel, int num_threads,
         ThreadPool* pool, const std::string& isa) {
        check_numel(numel);
        const DType d = parse_dtype(dtype, "out");
        if (d == DType::kFloat32) throw std::invalid_argument("rebuild_gradient: out must be bf16 or fp16");
        rebuild_gradient(address<const float>(m_old), address<const float>(m_new), static_cast<float>(1.0 - beta1),
                         address<void>(out), d, numel, pool, num_threads, adam_kernels_for(isa));
      },
      py::arg("m_old"), py::arg("m_new"), py::arg("beta1"), py::arg("out"), py::arg("dtype"), py::arg("numel"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "",
      py::call_guard<py::gil_scoped_release>(),
      "The bf16/fp16 gradient rebuilt from the first moment before (m_old) and after (m_new) an AdamW step with "
      "beta1; the misses its step kept are the caller's to patch in.");

  m.def(
      "torch_order_norm",
      [](uintptr_t data, int dtype, int64_t numel, int lanes, bool fused, const std::string& isa) {
        check_numel(numel);
        const DType d = parse_dtype(dtype, "data");
        if (d == DType::kFloat32) throw std::invalid_argument("torch_order_norm: data must be bf16 or fp16");
        if (lanes != 8 && lanes != 16) throw std::invalid_argument("torch_order_norm: lanes must be 8 or 16");
        return adam_kernels_for(isa).torch_order_norm(address<const uint16_t>(data), d, numel, lanes, fused);
      },
      py::arg("data"), py::arg("dtype"), py::arg("numel"), py::arg("lanes"), py::arg("fused"), py::arg("isa") = "",
      py::call_guard<py::gil_scoped_release>(),
      "The fp32 L2 norm of bf16/fp16 data in torch's order: `lanes` accumulators, added left to right, then the "
      "tail (csrc/adam/torch_order_norm.h).");

  m.def(
      "torch_order_norms",
      [](const std::vector<uintptr_t>& data, const std::vector<int64_t>& numels, int dtype, int lanes, bool fused,
         int num_threads, ThreadPool* pool, const std::string& isa) {
        if (data.size() != numels.size()) throw std::invalid_argument("torch_order_norms: one numel per vector");
        const DType d = parse_dtype(dtype, "data");
        if (d == DType::kFloat32) throw std::invalid_argument("torch_order_norms: data must be bf16 or fp16");
        if (lanes != 8 && lanes != 16) throw std::invalid_argument("torch_order_norms: lanes must be 8 or 16");
        std::vector<const uint16_t*> xs;
        for (size_t i = 0; i < data.size(); ++i) {
          check_numel(numels[i]);
          xs.push_back(address<const uint16_t>(data[i]));
        }
        std::vector<float> out(data.size());
        const AdamKernels& kernels = adam_kernels_for(isa);
        {
          py::gil_scoped_release release;
          torch_order_norms(xs.data(), numels.data(), static_cast<int64_t>(xs.size()), d, lanes, fused, out.data(),
                            pool, num_threads, kernels);
        }
        return out;
      },
      py::arg("data"), py::arg("numels"), py::arg("dtype"), py::arg("lanes"), py::arg("fused"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "",
      "torch_order_norm of each vector, the vectors spread over the threads (each one whole on one thread).");

  m.def(
      "sum_of_squares",
      [](uintptr_t data, int dtype, int64_t numel, int num_threads, ThreadPool* pool, const std::string& isa) {
        check_numel(numel);
        return sum_of_squares(address<const void>(data), parse_dtype(dtype, "data"), numel, pool, num_threads,
                              adam_kernels_for(isa));
      },
      py::arg("data"), py::arg("dtype"), py::arg("numel"), py::arg("num_threads"), py::arg("pool") = nullptr,
      py::arg("isa") = "",
      py::call_guard<py::gil_scoped_release>(), "Sum of squares with fp64 accumulation; inf/nan propagate.");

  m.def(
      "memory_traffic_probe",
      [](uintptr_t p, uintptr_t m_, uintptr_t v, uintptr_t g, int64_t numel, int num_threads, ThreadPool* pool) {
        check_numel(numel);
        memory_traffic_probe(address<float>(p), address<float>(m_), address<float>(v), address<const float>(g),
                             numel, pool, num_threads);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("numel"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "The fp32 Adam step's memory traffic (28 B/element) with no real arithmetic: the DRAM bound of the "
      "benchmarks. Leaves the values unchanged.");
}

}  // namespace offload
