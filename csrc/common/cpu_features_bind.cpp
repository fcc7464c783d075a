// Python bindings of the CPU feature detection: _C.cpu_features() and _C.best_isa().
#include <string>

#include "bindings.h"
#include "common/cpu_features.h"

namespace offload {

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
