"""ZeRO++'s quantized gradient reduction (qgZ, `zero_quantized_gradients=True`): the reduce-scatter sent as int8
blocks through all-to-alls equals the exact mean within the quantization error, in one level and in two (within
each machine, then across machines: 4 ranks numbered as 2 machines of 2). The ranks run in
tests/quantized_collectives_child.py; training with it is in tests/test_sharded_weights.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")


@pytest.mark.parametrize("machines", [1, 2])
def test_the_quantized_reduce_scatter_is_the_mean_within_the_quantization_error(tmp_path, machines):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                           str(ROOT / "tests" / "quantized_collectives_child.py"), str(ROOT), str(tmp_path),
                           str(machines)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for result in results:
        assert result["two_levels"] is (machines == 2), result
        # each contribution is off by at most half a step of its block's scale (max / 127); two levels add the
        # re-quantized machine sums' own rounding
        bound = result["scale"] / 254 * (1 if machines == 1 else 3)
        assert result["error"] <= bound, result
        assert result["changed"], "a quantized sum equal to the exact one measures nothing"
