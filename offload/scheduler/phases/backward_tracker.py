"""Which backward pass is running, and how many gradients each parameter has received in it.

The engine needs two facts to update a block during backward without changing the maths: that this
backward is the last one before `step()` (only knowable when the user declared
`grad_accumulation_steps`), and that no more gradient will reach the block in it. See docs/design.md
[Note: when a block may update early].
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Set

from offload.errors import OffloadError
from offload.scheduler.modes.clipping import LastBackward
from offload.scheduler.torch_internals import after_backward, graph_task_id


class BackwardTracker:
    """Counts backward passes since the last step and gradient-hook firings per parameter (by `id`: a
    hook runs per gradient, and `Tensor.__hash__` is a Python call, several times slower than `id`).

    A backward pass is an autograd graph task that accumulates a gradient into a parameter's `.grad` (so
    `torch.autograd.grad`, which writes none, is not one, as torch does not count it); several outputs of
    one forward (or two forwards summed into one loss) share the graph task and so count once. The firing counts of the previous backward become the `profile` that
    says how many firings make a parameter's gradient complete.
    """

    def __init__(self, declared_steps: Optional[int], micro_batches_on_device: bool = True) -> None:
        self.declared_steps = declared_steps
        self._on_device = micro_batches_on_device  # the plan's: no device budget, the earlier ones stay there
        self.micro_batches = 0
        self.fires: Dict[int, int] = {}
        self.profile: Optional[Dict[int, int]] = None
        self._graph_task: Optional[int] = None
        self._announced: Optional[int] = None
        self.predicted: Dict[int, int] = {}  # the first backward's profile, from the forward
        self.unpredictable: Set[int] = set()
        self._watched: Optional[int] = None  # the counted graph task told to report its end (`watch_completion`)
        self._completed: Optional[int] = None  # the last watched task that ran to its end
        self.last_step_micro_batches = 0  # backward passes of the last step that had any (undeclared: the guess)

    def is_new(self, graph_task: int) -> bool:
        return graph_task != self._graph_task

    def announce(self, graph_task: int) -> None:
        """A gradient of the module's outputs is being computed in this graph task: it is a backward pass if
        it accumulates a gradient (`accumulating`)."""
        self._announced = graph_task

    def accumulating(self, graph_task: int) -> None:
        """A parameter's `.grad` is written in this graph task. Counts the announced task at its first such
        gradient, or any task when none is counted yet (a backward that bypassed the module's outputs); a
        task nested in the counted one (reentrant checkpointing's recompute) is part of it."""
        if graph_task != self._graph_task and (graph_task == self._announced or self.micro_batches == 0):
            self.begin_backward(graph_task)

    def begin_backward(self, graph_task: int) -> None:
        """Count a backward pass (a no-op for a graph task already counted)."""
        if graph_task == self._graph_task:
            return
        if self.declared_steps is not None and self.micro_batches >= self.declared_steps:
            if self.failed_last_backward:  # a retry of the micro-batch whose backward failed
                raise self.failed_backward_error("backward called again")
            raise OffloadError(
                f"backward called {self.micro_batches + 1} times since the last engine.step(), but "
                f"grad_accumulation_steps={self.declared_steps} was declared and the blocks are already "
                "updated; call engine.step() every N backward calls, or leave grad_accumulation_steps unset")
        self.finish_backward()
        self._graph_task = graph_task
        self.micro_batches += 1

    def watch_completion(self) -> None:
        """Called during the counted backward (once is enough): autograd runs the queued callback only when
        the graph task ends without an error, so a backward that raises partway stays unfinished."""
        task = self._graph_task
        if task is None or task == self._watched or graph_task_id() != task:
            return  # a nested task (reentrant checkpointing's recompute) would report its own end
        self._watched = task
        after_backward(self._finish_watched)

    def _finish_watched(self) -> None:
        self._completed = self._watched

    @property
    def failed_last_backward(self) -> bool:
        """The last declared backward raised before it finished (an out-of-memory, a bad batch)."""
        return self._watched is not None and self._watched == self._graph_task and self._completed != self._watched

    def failed_backward_error(self, attempted: str, block_name: Optional[str] = None) -> OffloadError:
        """What happened when the last declared backward failed after blocks updated during it, and the ways on."""
        which = f" (first: {block_name!r})" if block_name else ""
        return OffloadError(
            f"{attempted} after the last backward of this step (micro-batch {self.micro_batches} of "
            f"grad_accumulation_steps={self.declared_steps}) raised partway: blocks{which} had already been "
            "updated during it with their complete gradients (declared accumulation updates each block as soon "
            "as its gradients are in), so the model is partly stepped and zero_grad() cannot undo that. To go "
            "on exactly, reload your last checkpoint (engine.load(path)); to go on from here, call "
            "engine.step(): the other blocks then step on the gradients they received (this micro-batch's "
            "only in part). Without grad_accumulation_steps, updates wait for step() and a failed backward "
            "changes no weight")

    def fire(self, param_id: int) -> None:
        self.fires[param_id] = self.fires.get(param_id, 0) + 1

    def finish_backward(self) -> None:
        """Keep the firing counts of the backward that just ended as the profile for the next ones."""
        if self.fires:
            self.profile = self.fires
            self.fires = {}

    def end_step(self) -> None:
        self.finish_backward()
        if self.micro_batches:
            self.last_step_micro_batches = self.micro_batches
        self.micro_batches = 0
        self._graph_task = None
        self._watched = self._completed = None

    @property
    def keeps_grads_on_device(self) -> bool:
        """Declared accumulation, not the last micro-batch, no device budget: gradients accumulate on the
        device (under a budget they leave it as for any backward, to their gradient homes)."""
        return self._on_device and self.declared_steps is not None and self.micro_batches < self.declared_steps

    @property
    def is_last_backward(self) -> bool:
        return self.declared_steps is not None and self.micro_batches == self.declared_steps

    @property
    def this_backward(self) -> LastBackward:
        """Whether the running backward is the last before step()."""
        return self._which(self.micro_batches)

    @property
    def next_backward(self) -> LastBackward:
        """Whether the next backward (of the forward now starting) will be the last before step()."""
        return self._which(self.micro_batches + 1)

    def _which(self, count: int) -> LastBackward:
        if self.declared_steps is not None:
            return LastBackward.DECLARED if count == self.declared_steps else LastBackward.NO
        return LastBackward.LIKELY if count == self.last_step_micro_batches else LastBackward.NO

    def predict_from_forward(self, param_ids: Iterable[int], predictable: bool) -> None:
        """Before any backward has given a profile: a block whose modules ran in the root forward with grad
        enabled gets one firing per parameter (autograd runs each parameter's AccumulateGrad once per graph
        task, however often the forward used it); one that also ran under no_grad inside a grad-mode forward
        (reentrant checkpointing: its recompute backward is a nested graph task, a second firing) is not
        predicted, so it waits for `step()`. A wrong prediction is loud: a gradient reaching a block already
        updated raises (pipeline.on_grad)."""
        for pid in param_ids:
            if not predictable:
                self.unpredictable.add(pid)
                self.predicted.pop(pid, None)
            elif pid not in self.unpredictable:
                self.predicted[pid] = 1

    def completes(self, param_ids: Iterable[int]) -> bool:
        """Whether every given parameter has had as many gradient firings as in the previous backward (or, in
        the first backward, as predicted from the forward: `predict_from_forward`).

        False when there is neither, or a parameter got no gradient last time: such blocks wait for
        `step()`, which is always exact.
        """
        profile = self.profile if self.profile is not None else self.predicted
        if not profile:
            return False
        for pid in param_ids:
            expected = profile.get(pid, 0)
            if expected == 0 or self.fires.get(pid, 0) != expected:
                return False
        return True
