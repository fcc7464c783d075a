// What the CPU we run on can do, asked once at run time: the binary is built without -march=native,
// so every kernel picks its instruction set from here.
#pragma once

namespace offload {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool sse42 = false;       // crc32 instruction
  bool pclmul = false;      // carry-less multiply, 128-bit
  bool vpclmulqdq = false;  // carry-less multiply on 256/512-bit vectors
};

// Detected on first call, constant afterwards (the CPU does not change under a running process).
const CpuFeatures& cpu_features();

// The widest instruction set all our kernels can use on this CPU.
Isa best_isa();

const char* isa_name(Isa isa);

}  // namespace offload
