"""Build `offload._C` from csrc/ with pybind11.

Never imports torch (pip's isolated build would otherwise pull a multi-GB wheel) and never needs CUDA.

Environment:
  OFFLOAD_CUDA=auto|0|1   compile csrc/cuda/ (auto: when a CUDA toolkit is found; 1: fail if none)
  OFFLOAD_DEBUG=1         -O0 -g instead of -O3 (-O1 for the Python glue, bindings.cpp)
  MAX_JOBS=N              parallel compile jobs (default: all cores)
"""
import os
import shutil
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

HERE = Path(__file__).parent.resolve()


def find_cuda_home():
    """Where a CUDA toolkit lives, or None: CUDA_HOME/CUDA_PATH, then nvcc on PATH, then /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and Path(home, "include", "cuda_runtime_api.h").exists():
            return Path(home)
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent] if nvcc else []
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if Path(home, "include", "cuda_runtime_api.h").exists():
            return home
    return None


def cuda_setting():
    """Parse OFFLOAD_CUDA once into (enabled, cuda_home)."""
    mode = os.environ.get("OFFLOAD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1", "off", "on"):
        sys.exit(f"OFFLOAD_CUDA={mode!r} is not one of auto, 0, 1")
    if mode in ("0", "off"):
        return False, None
    home = find_cuda_home()
    if home is None:
        if mode in ("1", "on"):
            sys.exit("OFFLOAD_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME to the toolkit's root")
        return False, None
    libdirs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
    if not any((d / "libcudart_static.a").exists() for d in libdirs):
        if mode in ("1", "on"):
            sys.exit(f"OFFLOAD_CUDA=1 but {home} has no libcudart_static.a")
        return False, None
    return True, home


def extension():
    debug = os.environ.get("OFFLOAD_DEBUG", "0") == "1"
    # bindings.cpp #includes every *_bind.cpp (all the Python glue, cuda/'s too): one translation unit.
    sources = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*.cpp") if not p.name.endswith("_bind.cpp"))
    depends = sorted(str(p.relative_to(HERE)) for p in HERE.glob("csrc/**/*") if p.suffix in (".h", ".cpp"))
    macros, include_dirs, library_dirs, libraries = [], ["csrc"], [], ["dl", "pthread"]
    use_cuda, cuda_home = cuda_setting()
    if use_cuda:
        macros.append(("OFFLOAD_WITH_CUDA", "1"))
        include_dirs.append(str(cuda_home / "include"))
        library_dirs += [str(d) for d in (cuda_home / "lib64", cuda_home / "targets" / "x86_64-linux" / "lib") if d.exists()]
        libraries += ["cudart_static", "rt"]
    # No -march=native: one binary for every x86-64 CPU; the kernels pick AVX-512/AVX2/scalar at run time.
    flags = ["-O0", "-g"] if debug else ["-O3", "-fno-math-errno"]
    flags += ["-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"]
    return Pybind11Extension(
        "offload._C",
        sources,
        depends=depends,  # a changed header or *_bind.cpp rebuilds too
        include_dirs=include_dirs,
        define_macros=macros,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_compile_args=flags,
        cxx_std=17,
    )


GLUE = "bindings.cpp"  # all the Python glue (it #includes every *_bind.cpp): pybind11 templates, no kernel


def compile_cost(source):
    """A compile's expected length, to start the longest first: the glue, then the largest files."""
    path = Path(source)
    return (path.name == GLUE, path.stat().st_size if path.exists() else 0)


class BuildExt(build_ext):
    """pybind11's build_ext over its ParallelCompile (MAX_JOBS jobs), with two changes for a 2-core machine
    (issue 33): the files start longest first (distutils sorts the sources, for a reproducible link, and
    the glue and the AVX-512 moments kernel, a third of the compiler's time each, came 11th and 5th), and
    the glue compiles at -O1, 26% less compiler time (12.8 -> 9.8 s) for 10-30 ns more per call from
    Python (crc32c of 64 bytes: 244 -> 260-272 ns). The kernels keep -O3."""

    def build_extensions(self):
        parallel_compile = self.compiler.compile  # ParallelCompile's, installed below
        compile_one = self.compiler._compile
        debug = os.environ.get("OFFLOAD_DEBUG", "0") == "1"

        def compile_file(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if Path(src).name == GLUE and not debug:
                extra_postargs = [*extra_postargs, "-O1"]
            compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

        def compile_longest_first(sources, *args, **kwargs):
            order = sorted(sources, key=compile_cost, reverse=True)
            objects = dict(zip(order, parallel_compile(order, *args, **kwargs)))
            return [objects[source] for source in sources]  # the link keeps distutils' sorted order

        self.compiler._compile = compile_file
        self.compiler.compile = compile_longest_first
        super().build_extensions()


ParallelCompile("MAX_JOBS", default=0).install()
setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExt})
