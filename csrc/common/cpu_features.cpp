#include "common/cpu_features.h"

#include <pybind11/pybind11.h>

namespace offload {

namespace {
CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  f.sse42 = __builtin_cpu_supports("sse4.2");
  f.pclmul = __builtin_cpu_supports("pclmul");
  f.vpclmulqdq = __builtin_cpu_supports("vpclmulqdq");
#endif
  return f;
}
}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();  // immutable after first use
  return features;
}

Isa best_isa() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl) return Isa::kAvx512;
  if (f.avx2 && f.fma && f.f16c) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

void bind_cpu_features(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "cpu_features",
      [] {
        const CpuFeatures& f = cpu_features();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512bf16"] = f.avx512bf16;
        d["sse4.2"] = f.sse42;
        d["pclmul"] = f.pclmul;
        d["vpclmulqdq"] = f.vpclmulqdq;
        return d;
      },
      "The CPU features the kernels may use, detected at run time.");
  m.def("best_isa", [] { return std::string(isa_name(best_isa())); },
        "The instruction set the kernels dispatch to on this CPU: 'avx512', 'avx2' or 'scalar'.");
}

}  // namespace offload
