"""The fine-tuning examples a new user follows (examples/finetune.py, examples/finetune_trainer.py), run as the
user runs them, offline in --make-tiny mode: they train (the loss falls), export a model plain transformers
loads with its tokenizer, and --resume continues from the newest checkpoint with the loss log intact."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
pytest.importorskip("tokenizers", reason="needs tokenizers (installed with transformers)")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = ["--make-tiny", "--steps", "12", "--save-every", "6"]  # about 10 s a run on 2 CPU cores


def run_example(script: str, out: Path, *flags: str) -> str:
    """Run an example as a user would; its stdout and stderr, or a failure showing their end."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--out", str(out), *flags], env=env,
                          cwd=str(out.parent), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def history(out: Path) -> List[Dict[str, float]]:
    return json.loads((out / "history.json").read_text())


def assert_trained_and_exported(out: Path) -> None:
    """The export loads with plain transformers (model and tokenizer), differs from the tiny start, and the
    loss fell; the loss curve exists when matplotlib does."""
    final, start = out / "final", out / "tiny-model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    assert tokenizer.eos_token is not None and tokenizer("the cat")["input_ids"]
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True).state_dict()
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(start), local_files_only=True).state_dict()
    assert trained.keys() == initial.keys()
    changed = [k for k in trained if not (trained[k].float() == initial[k].float()).all()]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(trained) // 2, changed
    losses = [h["loss"] for h in history(out)]
    assert losses[-1] < losses[0] - 0.5, losses
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, str]:
    out = tmp_path_factory.mktemp("finetune") / "out"
    return out, run_example("finetune.py", out, *SMALL)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, str]:
    out = tmp_path_factory.mktemp("trainer") / "out"
    return out, run_example("finetune_trainer.py", out, *SMALL)


def test_finetune_trains_and_exports(finetuned: Tuple[Path, str]) -> None:
    out, output = finetuned
    assert_trained_and_exported(out)
    assert [h["step"] for h in history(out)] == list(range(1, 13))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-12", "step-6"]
    assert "engine.stats():" in output and "sample from" in output


def _resumable_copy(out: Path, target: Path, drop: Tuple[str, ...] = ()) -> Path:
    shutil.copytree(out, target, ignore=shutil.ignore_patterns("swap"))
    for name in drop:
        shutil.rmtree(target / "checkpoints" / name)
    return target


def test_finetune_resume_continues_the_run(finetuned: Tuple[Path, str], tmp_path: Path) -> None:
    """--resume from the newest checkpoint (step 12) to --steps 16: steps 13..16 follow the logged 1..12."""
    out, _ = finetuned
    copy = _resumable_copy(out, tmp_path / "out")
    output = run_example("finetune.py", copy, *SMALL[:1], "--steps", "16", "--save-every", "6", "--resume")
    assert f"resumed from {copy / 'checkpoints' / 'step-12'} at step 12" in output
    assert "training steps 13..16" in output
    steps = history(copy)
    assert [h["step"] for h in steps] == list(range(1, 17))
    assert steps[:12] == history(out)
    assert (copy / "checkpoints" / "step-16").is_dir()


def test_finetune_resume_is_exact(finetuned: Tuple[Path, str], tmp_path: Path) -> None:
    """Resumed from step 6 with the same --steps, steps 7..12 repeat the uninterrupted run's losses: the
    weights, Adam state, LR schedule and data position all came back."""
    out, _ = finetuned
    copy = _resumable_copy(out, tmp_path / "out", drop=("step-12",))
    output = run_example("finetune.py", copy, *SMALL, "--resume")
    assert "training steps 7..12" in output
    for resumed, straight in zip(history(copy), history(out)):
        assert resumed["step"] == straight["step"]
        assert abs(resumed["loss"] - straight["loss"]) <= 1e-5, (resumed, straight)
        assert abs(resumed["lr"] - straight["lr"]) <= 1e-12


def test_trainer_example_trains_and_exports(trainer_run: Tuple[Path, str]) -> None:
    out, output = trainer_run
    assert_trained_and_exported(out)
    assert [h["step"] for h in history(out)] == list(range(1, 13))
    assert (out / "checkpoints" / "checkpoint-12" / "optimizer.pt").is_file()  # the Trainer's files (issue 33)
    assert "engine.stats():" in output and "sample from" in output


def test_trainer_example_resumes(trainer_run: Tuple[Path, str], tmp_path: Path) -> None:
    out, _ = trainer_run
    copy = _resumable_copy(out, tmp_path / "out")
    output = run_example("finetune_trainer.py", copy, *SMALL[:1], "--steps", "16", "--save-every", "6", "--resume")
    assert f"resumed from {copy / 'checkpoints' / 'checkpoint-12'}" in output
    steps = history(copy)
    assert [h["step"] for h in steps] == list(range(1, 17))
    assert [h["loss"] for h in steps[:12]] == [h["loss"] for h in history(out)]


def test_both_examples_see_the_same_data(finetuned: Tuple[Path, str], trainer_run: Tuple[Path, str]) -> None:
    """Same tiny model, same windows in the same micro-batches: the first loss (before any update) agrees."""
    first = history(finetuned[0])[0]["loss"], history(trainer_run[0])[0]["loss"]
    assert abs(first[0] - first[1]) <= 1e-5, first
