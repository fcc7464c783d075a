"""The native build: succeeds without CUDA, never imports torch, and `import offload` survives without it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(tmp_path: Path, env_extra: dict) -> Path:
    """Build offload._C into tmp_path with setup.py; returns the built library directory."""
    poison = tmp_path / "poison"
    (poison / "torch").mkdir(parents=True)
    (poison / "torch" / "__init__.py").write_text("raise ImportError('setup.py must not import torch')\n")
    env = dict(os.environ, PYTHONPATH=str(poison), **env_extra)
    lib, temp = tmp_path / "lib", tmp_path / "temp"
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp", str(temp)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lib


@pytest.mark.slow
def test_builds_without_cuda_and_without_torch(tmp_path):
    lib = _build(tmp_path, {"OFFLOAD_CUDA": "0", "CUDA_HOME": "/nonexistent"})
    built = list((lib / "offload").glob("_C*.so"))
    assert len(built) == 1
    check = textwrap.dedent("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("offload._C", sys.argv[1])
        C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)
        assert C.built_with_cuda is False
        assert not hasattr(C, "cuda_host_register")
        assert C.best_isa() in ("avx512", "avx2", "scalar")
        arena = C.HostArena(1 << 20)
        assert arena.lease(100).ptr % 4096 == 0
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", check, str(built[0])], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.skipif(Path("/usr/local/cuda/include/cuda_runtime_api.h").exists(),
                    reason="a CUDA toolkit is installed under /usr/local/cuda, so OFFLOAD_CUDA=1 would find it")
def test_cuda_forced_on_without_toolkit_fails_clearly(tmp_path):
    env = dict(os.environ, OFFLOAD_CUDA="1", CUDA_HOME="/nonexistent", PATH="/usr/bin:/bin")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "temp")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "OFFLOAD_CUDA=1 but no CUDA toolkit was found" in proc.stderr + proc.stdout


def test_bad_cuda_setting_is_rejected(tmp_path):
    env = dict(os.environ, OFFLOAD_CUDA="maybe")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "OFFLOAD_CUDA='maybe' is not one of auto, 0, 1" in proc.stderr


def test_import_without_native_core_warns_once_and_works():
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["offload._C"] = None  # as if the extension were missing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import offload
            import offload.optim, offload.tiers.host
        msgs = [str(w.message) for w in caught if "native core" in str(w.message)]
        assert len(msgs) == 1, msgs
        assert "python -m offload doctor" in msgs[0]
        assert offload.native_available() is False
        pool = offload.StagingPool(1 << 20)
        assert pool.lease(10).data_ptr % 4096 == 0
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_doctor_reports_every_part():
    proc = subprocess.run([sys.executable, "-m", "offload", "doctor"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for part in ("native core", "fused CPU Adam", "staging buffers", "CPU", "async I/O", "swap disk", "memlock limit",
                 "CUDA"):
        assert part in proc.stdout


def test_doctor_names_the_swap_disks_scheduler(tmp_path, monkeypatch):
    from offload.cli import doctor

    queue = tmp_path / "vdb" / "queue"
    queue.mkdir(parents=True)
    (queue / "scheduler").write_text("none [mq-deadline] kyber bfq\n")
    (queue / "rotational").write_text("1\n")
    monkeypatch.setattr(doctor, "block_queue_of", lambda path: queue)
    row = ("swap disk", "mq-deadline", "/dev/vdb, rotational, I/O scheduler mq-deadline")
    assert doctor.disk_rows(tmp_path) == [row]
    monkeypatch.setattr(doctor, "block_queue_of", lambda path: None)
    assert doctor.disk_rows(tmp_path)[0][1] == "unknown"
