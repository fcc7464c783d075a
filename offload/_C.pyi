"""Typed stub of the native core `offload._C` (csrc/bindings.cpp). Pointers are plain ints: the Python
layer (offload.optim, offload.tiers.host, offload.io) validates dtype, device and contiguity first."""

from typing import Optional, Sequence, Tuple

built_with_cuda: bool
cuda_runtime_version: int  # only when built_with_cuda
PARALLEL_THRESHOLD: int

# --- CPU features (csrc/common/cpu_features.cpp) ------------------------------------------------------
def cpu_features() -> dict[str, bool]: ...
def best_isa() -> str: ...  # 'avx512' | 'avx2' | 'scalar'

# --- fused Adam (csrc/adam/) ----------------------------------------------------------------------------
class ThreadPool:
    size: int
    def __init__(self, num_threads: int) -> None: ...

def adam_isa() -> str: ...
def adam_step(param: int, grad: int, grad_dtype: int, exp_avg: int, exp_avg_sq: int, numel: int, out: int,
              out_dtype: int, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              adamw: bool, grad_scale: float, num_threads: int, pool: Optional[ThreadPool] = None,
              isa: str = "", crcs: int = 0) -> None: ...
def adam_step_resting(param: int, grad: int, grad_dtype: int, exp_avg: int, exp_avg_sq: int, numel: int, out: int,
                      out_dtype: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, miss_index: int, miss_bits: int, capacity: int, num_threads: int,
                      pool: Optional[ThreadPool] = None, isa: str = "", index_base: int = 0,
                      crcs: int = 0) -> int: ...
def rebuild_gradient(m_old: int, m_new: int, beta1: float, out: int, dtype: int, numel: int, num_threads: int,
                     pool: Optional[ThreadPool] = None, isa: str = "") -> None: ...
def sum_of_squares(data: int, dtype: int, numel: int, num_threads: int, pool: Optional[ThreadPool] = None,
                   isa: str = "") -> float: ...
def memory_traffic_probe(param: int, exp_avg: int, exp_avg_sq: int, grad: int, numel: int, num_threads: int,
                         pool: Optional[ThreadPool] = None) -> None: ...

# --- Adam over compressed moments (csrc/adam/adam_moments.h) ---------------------------------------------
INT8_BLOCK: int
def moment_code_map(which: int) -> list[float]: ...  # which: 1 exp_avg (128 magnitudes), 2 sqrt(exp_avg_sq) (256)
def adam_moments_step(param: int, grad: int, grad_dtype: int, exp_avg: int, exp_avg_scales: int, exp_avg_sq: int,
                      exp_avg_sq_scales: int, format: int, numel: int, out: int, out_dtype: int, step: int,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
                      grad_scale: float, num_threads: int, pool: Optional[ThreadPool] = None,
                      isa: str = "", crcs: int = 0) -> None: ...  # format: 1 bf16, 2 int8 (scales 0 for bf16);
# crcs: 0 or the address of 6 uint32, the CRC-32C of each piece written, in MOMENT_CRC_PIECES order
def adam_moments_step_runs(param: int, grad: int, grad_dtype: int, exp_avg: int, exp_avg_scales: int, exp_avg_sq: int,
                           exp_avg_sq_scales: int, numel: int, out: int, out_dtype: int, runs: list[list[int]],
                           step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                           adamw: bool, grad_scale: float, num_threads: int, parallel_threshold: int,
                           crcs: int = 0) -> None: ...  # int8 runs [start, stop, first scale] in one call
MOMENT_CRC_PIECES: tuple[str, ...]
def moment_isas() -> list[str]: ...  # the moment kernel variants this CPU runs, best first
def moments_encode(src: int, codes: int, scales: int, format: int, which: int, numel: int, num_threads: int,
                   pool: Optional[ThreadPool] = None, isa: str = "") -> None: ...
def moments_decode(codes: int, scales: int, format: int, which: int, numel: int, out: int, num_threads: int,
                   pool: Optional[ThreadPool] = None, isa: str = "") -> None: ...

# --- CRC-32C (csrc/common/crc32c.cpp) -------------------------------------------------------------------
def crc32c(ptr: int, nbytes: int, seed: int = 0) -> int: ...
def crc32c_portable(ptr: int, nbytes: int, seed: int = 0) -> int: ...
def crc32c_path() -> str: ...  # 'vpclmulqdq-avx512' | 'pclmulqdq' | 'sse4.2' | 'table'
def crc32c_combine(crc1: int, crc2: int, len2: int) -> int: ...  # the CRC of A + B from crc(A), crc(B), len(B)
def crc32c_paths() -> list[str]: ...  # those this CPU runs, preferred first
def crc32c_with(path: str, ptr: int, nbytes: int, seed: int = 0) -> int: ...  # ValueError if not runnable here

# --- staging arena (csrc/buffers/) ----------------------------------------------------------------------
class ArenaExhausted(MemoryError): ...

class Lease:  # exports the buffer protocol (writable bytes)
    ptr: int
    nbytes: int
    offset: int

class HostArena:
    base_ptr: int
    capacity: int
    def __init__(self, capacity: int) -> None: ...
    def lease(self, nbytes: int, wait: bool = False, timeout: float = -1.0) -> Lease: ...
    def stats(self) -> dict[str, int]: ...

# --- async file I/O (csrc/io/) --------------------------------------------------------------------------
class IoRequest:
    bytes: int
    error: int
    error_offset: int
    error_size: int
    def done(self) -> bool: ...
    def wait(self, timeout_s: float = -1.0) -> bool: ...

class IoEngine:
    name: str
    def __init__(self, kind: str, queue_depth: int = 32, num_threads: int = 4) -> None: ...
    def submit(self, write: bool, segments: Sequence[Tuple[int, bool, int, int, int]],
               chunk_bytes: int) -> IoRequest: ...
    def close(self) -> None: ...

# --- CUDA host registration (csrc/cuda/, only when built_with_cuda) -------------------------------------
def cuda_host_register(ptr: int, nbytes: int) -> Tuple[bool, str]: ...
def cuda_host_unregister(ptr: int) -> Tuple[bool, str]: ...
def cuda_device_count() -> int: ...
