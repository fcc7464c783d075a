// Python bindings of the compressed-moment Adam step and of the moments' encode/decode. Arguments are raw
// addresses and sizes: offload/optim/moments.py checks dtypes, devices, contiguity and sizes before calling.
// Every call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_moments.h"
#include "bindings.h"
#include "common/crc32c.h"

namespace offload {

namespace py = pybind11;

namespace {

DType dtype_code(int code, const char* what) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument(std::string(what) + ": dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(code));
  }
  return static_cast<DType>(code);
}

MomentFormat format_code(int code) {
  if (code != 1 && code != 2) {
    throw std::invalid_argument("format must be 1 (bf16) or 2 (int8), got " + std::to_string(code));
  }
  return static_cast<MomentFormat>(code);
}

void check_common(int64_t numel, MomentFormat format, uintptr_t scales, uintptr_t scales2) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (format == MomentFormat::kInt8 && (scales == 0 || scales2 == 0)) {
    throw std::invalid_argument("int8 moments need their scales");
  }
}


void check_which(int which) {
  if (which != kExpAvg && which != kExpAvgSq) {
    throw std::invalid_argument("which must be 1 (exp_avg) or 2 (exp_avg_sq), got " + std::to_string(which));
  }
}

}  // namespace

void bind_adam_moments(py::module_& m) {
  m.attr("INT8_BLOCK") = kInt8Block;

  m.def(
      "moment_code_map",
      [](int which) {
        check_which(which);
        const MomentMaps& maps = moment_maps();
        return which == kExpAvg ? std::vector<float>(maps.m, maps.m + 128) : std::vector<float>(maps.v, maps.v + 256);
      },
      py::arg("which"), "The int8 map of exp_avg (which=1: 128 magnitudes) or of sqrt(exp_avg_sq) (which=2: 256).");

  m.def(
      "adam_moments_step",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_scales,
         uintptr_t exp_avg_sq, uintptr_t exp_avg_sq_scales, int format, int64_t numel, uintptr_t out, int out_dtype,
         int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
         double grad_scale, int num_threads, ThreadPool* pool, const std::string& isa, uintptr_t crcs) {
        const MomentFormat f = format_code(format);
        check_common(numel, f, exp_avg_scales, exp_avg_sq_scales);
        if (step < 1) throw std::invalid_argument("step must be >= 1");
        MomentBuffers b{address<float>(param), address<const void>(grad), dtype_code(grad_dtype, "grad"),
                        address<void>(exp_avg), address<float>(exp_avg_scales), address<void>(exp_avg_sq),
                        address<float>(exp_avg_sq_scales), f, address<void>(out), dtype_code(out_dtype, "out")};
        moments_step(b, make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale), numel,
                     pool, num_threads, moment_kernels_for(isa), address<uint32_t>(crcs));
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_scales"),
      py::arg("exp_avg_sq"), py::arg("exp_avg_sq_scales"), py::arg("format"), py::arg("numel"), py::arg("out"),
      py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"), py::arg("num_threads"),
      py::arg("pool") = nullptr, py::arg("isa") = "", py::arg("crcs") = 0, py::call_guard<py::gil_scoped_release>(),
      "Fused Adam/AdamW step over fp32 params and bf16 (format 1) or int8 (format 2) moments, given by address\n"
      "(scales: 0 for bf16; out=0: none). dtype codes: 0 fp32, 1 bf16, 2 fp16. isa: '' (best), or one of\n"
      "moment_isas(). crcs: 0, or the address of 6 uint32 that receive the CRC-32C of each piece written, computed\n"
      "in the same pass: param, exp_avg codes, exp_avg scales, exp_avg_sq codes, exp_avg_sq scales, out (an absent\n"
      "piece: 0).");

  m.def(
      "adam_moments_step_runs",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_scales,
         uintptr_t exp_avg_sq, uintptr_t exp_avg_sq_scales, int64_t numel, uintptr_t out, int out_dtype,
         const std::vector<std::vector<int64_t>>& runs, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool adamw, double grad_scale, int num_threads, int64_t parallel_threshold,
         uintptr_t crcs) {
        check_common(numel, MomentFormat::kInt8, exp_avg_scales, exp_avg_sq_scales);
        if (step < 1) throw std::invalid_argument("step must be >= 1");
        const DType g = dtype_code(grad_dtype, "grad"), o = dtype_code(out_dtype, "out");
        const size_t g_size = dtype_size(g), o_size = out ? dtype_size(o) : 0;
        for (const auto& run : runs) {
          if (run.size() != 3 || run[0] < 0 || run[1] < run[0] || run[1] > numel || run[2] < 0) {
            throw std::invalid_argument("each run is [start, stop, first scale] within the moment");
          }
        }
        const AdamConstants c = make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale);
        uint32_t joined[6] = {0, 0, 0, 0, 0, 0};
        for (size_t i = 0; i < runs.size(); ++i) {
          const int64_t start = runs[i][0], n = runs[i][1] - runs[i][0], first = runs[i][2];
          MomentBuffers b{address<float>(param) + start,
                          static_cast<const char*>(address<const void>(grad)) + g_size * start, g,
                          address<uint8_t>(exp_avg) + start, address<float>(exp_avg_scales) + first,
                          address<uint8_t>(exp_avg_sq) + start, address<float>(exp_avg_sq_scales) + first,
                          MomentFormat::kInt8, out ? static_cast<char*>(address<void>(out)) + o_size * start : nullptr,
                          o};
          uint32_t run_crcs[6] = {0, 0, 0, 0, 0, 0};
          moments_step(b, c, n, nullptr, n < parallel_threshold ? 1 : num_threads, moment_kernels_for(""),
                       crcs ? run_crcs : nullptr);
          if (crcs) {
            const size_t scales = static_cast<size_t>((n + kInt8Block - 1) / kInt8Block);
            const size_t lengths[6] = {4 * static_cast<size_t>(n), static_cast<size_t>(n), 4 * scales,
                                       static_cast<size_t>(n), 4 * scales, o_size * static_cast<size_t>(n)};
            for (int k = 0; k < 6; ++k) {
              if (lengths[k]) joined[k] = crc32c_combine(joined[k], run_crcs[k], lengths[k]);
            }
          }
        }
        if (crcs) {
          for (int k = 0; k < 6; ++k) address<uint32_t>(crcs)[k] = joined[k];
        }
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_scales"),
      py::arg("exp_avg_sq"), py::arg("exp_avg_sq_scales"), py::arg("numel"), py::arg("out"), py::arg("out_dtype"),
      py::arg("runs"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"), py::arg("num_threads"),
      py::arg("parallel_threshold"), py::arg("crcs") = 0, py::call_guard<py::gil_scoped_release>(),
      "adam_moments_step over int8 moments laid out in runs ([start, stop, first scale]: blocks counted from each\n"
      "run's start, its scales from `first scale`), in one call (one GIL release for a layer's many small\n"
      "parameters); a run below parallel_threshold elements on one thread. crcs: those of the whole pieces, the\n"
      "runs' joined with crc32c_combine.");

  m.def("moment_isas", &moment_isas,
        "The moment kernel variants this CPU runs, best first: 'avx512' (with VBMI and AVX512_BF16 the byte-plane\n"
        "kernel, else the F/BW one), 'avx512bw' (the F/BW kernel, listed where it is not 'avx512'), 'avx2', 'scalar'.");
  m.attr("MOMENT_CRC_PIECES") = py::make_tuple("param", "exp_avg", "exp_avg_scales", "exp_avg_sq",
                                                "exp_avg_sq_scales", "out");

  m.def(
      "moments_encode",
      [](uintptr_t src, uintptr_t codes, uintptr_t scales, int format, int which, int64_t numel, int num_threads,
         ThreadPool* pool, const std::string& isa) {
        const MomentFormat f = format_code(format);
        check_common(numel, f, scales, scales);
        check_which(which);
        moments_encode(address<const float>(src), address<void>(codes), address<float>(scales), f, which, numel, pool,
                       num_threads, moment_kernels_for(isa));
      },
      py::arg("src"), py::arg("codes"), py::arg("scales"), py::arg("format"), py::arg("which"), py::arg("numel"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "",
      py::call_guard<py::gil_scoped_release>(), "Encodes fp32 values (v itself for which=2) into a moment.");

  m.def(
      "moments_decode",
      [](uintptr_t codes, uintptr_t scales, int format, int which, int64_t numel, uintptr_t out, int num_threads,
         ThreadPool* pool, const std::string& isa) {
        const MomentFormat f = format_code(format);
        check_common(numel, f, scales, scales);
        check_which(which);
        moments_decode(address<const void>(codes), address<const float>(scales), f, which, address<float>(out), numel,
                       pool, num_threads, moment_kernels_for(isa));
      },
      py::arg("codes"), py::arg("scales"), py::arg("format"), py::arg("which"), py::arg("numel"), py::arg("out"),
      py::arg("num_threads"), py::arg("pool") = nullptr, py::arg("isa") = "",
      py::call_guard<py::gil_scoped_release>(), "Decodes a moment into fp32 values (v itself for which=2).");
}

}  // namespace offload
