#include "bindings.h"
namespace offload {
void bind_adam(pybind11::module_&) {}  // filled in by the Adam kernel work
}
