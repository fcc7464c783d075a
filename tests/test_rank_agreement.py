"""Ranks that disagree fail loudly, on every rank, naming the cause (issue 33, third round: "hang or crash").

Before: with `shard_weights=True` another model or dtype on one rank killed it by SIGABRT inside gloo, `max_grad_norm`
on one rank only hung both, another lr per rank trained silently; the engine's own process groups waited gloo's
30 minutes whatever `init_process_group(timeout=)` said; and `state_dict()`, `save_pretrained` or an eval forward
made by rank 0 alone under sharded weights returned on rank 0, which then died by SIGABRT at the next collective.
Now wrap() compares the ranks' options and models (one all_gather_object) and refuses on every rank naming what
differs on which ranks; the engine's groups take the default group's timeout; and every gather of sharded
weights is announced first (a small all-gather of what it is for), so ranks whose gathers went out of step
raise on every rank naming what each was doing, and a rank left alone in one says why when it times out.
The ranks run in tests/rank_agreement_child.py (one torchrun launch a case)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")

SHARDED = dict(tier="cpu", dtype="float32", device="cpu", lr=1e-3, weight_decay=0.0, shard_weights=True,
               device_memory=150_000)


def launch(tmp_path: Path, case: dict, seconds: int = 240) -> subprocess.CompletedProcess:
    spec = tmp_path / f"{case['name']}.json"
    spec.write_text(json.dumps(case))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "rank_agreement_child.py"), str(ROOT), str(tmp_path), str(spec)],
                          capture_output=True, text=True, timeout=seconds, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
    return done


def reports(tmp_path: Path, name: str) -> List[dict]:
    return [json.loads((tmp_path / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("differs, expected", [
    (dict(model=dict(dim=48, heads=2)), r"parameter 'wte.weight' is float32\[64, 32\] on rank 0, float32\[64, 48\]"),
    (dict(dtype="bfloat16", options=dict(dtype="bfloat16")), r"dtype: torch.float32 on rank 0, torch.bfloat16 on rank 1"),
    (dict(options=dict(max_grad_norm=1.0)), r"max_grad_norm: None on rank 0, 1.0 on rank 1"),
    (dict(options=dict(lr=1e-2)), r"lr: 0.001 on rank 0, 0.01 on rank 1"),
], ids=["model", "dtype", "max_grad_norm", "lr"])
def test_ranks_that_disagree_are_refused_at_wrap_on_every_rank(tmp_path, differs, expected):
    import re

    launch(tmp_path, dict(name="differ", options=SHARDED, rank1=differs, timeout=60))
    for report in reports(tmp_path, "differ"):
        assert report.get("error") == "OffloadConfigError", report
        assert not report["wrapped"]
        assert re.search(expected, report["message"]), report["message"]
        assert "every rank" in report["message"].lower(), report["message"]


def test_replicated_ranks_with_another_lr_are_refused_too(tmp_path):
    options = dict(SHARDED, shard_weights=False)
    options.pop("device_memory")
    launch(tmp_path, dict(name="replicated", options=options, rank1=dict(options=dict(weight_decay=0.1)), timeout=60))
    for report in reports(tmp_path, "replicated"):
        assert report.get("error") == "OffloadConfigError", report
        assert "weight_decay: 0.0 on rank 0, 0.1 on rank 1" in report["message"], report["message"]


def test_the_engines_process_groups_take_the_default_groups_timeout(tmp_path):
    launch(tmp_path, dict(name="timeout", options=SHARDED, steps=1, timeout=17))
    for report in reports(tmp_path, "timeout"):
        assert "error" not in report, report
        assert report["timeouts"] == [17.0, 17.0], report["timeouts"]


@pytest.mark.parametrize("what, doing", [
    ("state_dict", r"engine\.state_dict\(\)"),
    ("save_pretrained", r"engine\.save_pretrained\(\)"),
    ("eval_no_grad", r"rank 0: a forward .*a rank made a forward the others did not"),
    ("eval", r"rank 0: a forward .*a rank made a forward the others did not"),
])
def test_a_gathering_call_made_by_one_rank_alone_raises_on_every_rank_naming_it(tmp_path, what, doing):
    """Rank 0 alone after the first step, rank 1 goes on training: both raise, each naming both sides; a read of the
    weights at once, an evaluation forward (which pairs with rank 1's next forward, gathering the same blocks) at
    rank 1's backward, where rank 0 is in its next forward."""
    import re

    launch(tmp_path, dict(name="alone", options=SHARDED, alone=what, steps=3, timeout=60))
    for report in reports(tmp_path, "alone"):
        assert report.get("error") == "OffloadError", report
        message = report["message"]
        assert "out of step" in message and "collective" in message and "every rank" in message, message
        assert re.search(doing, message), message
        assert re.search(r"rank 1: a (forward|backward) \(block", message), message


def test_a_rank_left_alone_in_a_gather_says_why_when_it_times_out(tmp_path):
    """Rank 0 reads the state alone while rank 1 waits at a barrier of the default group: rank 0 warns while it
    waits, then raises at the process group's timeout naming its call; no SIGABRT, no 30 minutes."""
    done = launch(tmp_path, dict(name="left", options=SHARDED, alone="state_dict", other="barrier", steps=2,
                                 timeout=12))
    first = reports(tmp_path, "left")[0]
    assert first.get("error") == "OffloadError", first
    assert "engine.state_dict()" in first["message"] and "timeout" in first["message"], first["message"]
    assert "every rank" in first["message"], first["message"]
    assert "waited" in done.stderr and "engine.state_dict()" in done.stderr, done.stderr[-3000:]


class _Ranks:
    """A DataParallel stand-in whose all_gather_object returns every rank's value, given."""

    def __init__(self, values: list) -> None:
        self.values = values

    def all_gather_object(self, value: object) -> list:
        return self.values


def test_plans_that_differ_name_each_difference_and_its_ranks():
    from offload.distributed.agreement import refuse_differences
    from offload.errors import OffloadConfigError

    plan = {"streamed blocks": "('h.0', 'h.1')", "host budget": "1000"}
    other = dict(plan, **{"host budget": "2000"})
    refuse_differences(_Ranks([plan, plan, plan]), plan, "placement plans")  # the same everywhere: nothing
    with pytest.raises(OffloadConfigError, match=r"different placement plans: host budget: 1000 on ranks 0-1, 3, "
                                                 r"2000 on rank 2\. Every rank must wrap the same model"):
        refuse_differences(_Ranks([plan, plan, other, plan]), plan, "placement plans")
