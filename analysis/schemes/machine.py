"""The machine the schemes run on: p identical processors of a FLOP rate, an α–β interconnect, and
the costs a calibration measures (``load_calibration`` reads them)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from analysis.data import AnalysisError
from analysis.schemes.network import Layer


def compiled_steps(layers: Sequence[Layer], cost: float) -> tuple[int, list[Layer]]:
    """How many of ``layers`` are recurrent steps that a compiled ``cost`` (when set) covers, and the
    layers left to charge by their operations."""
    if cost <= 0:
        return 0, list(layers)
    return sum(x.step for x in layers), [x for x in layers if not x.step]


@dataclass(frozen=True)
class Machine:
    """p identical processors of ``flops`` FLOP/s and ``overhead`` seconds per operation, an α–β
    interconnect, ``word`` bytes per number.

    A device that runs ``bppsa_core.distributed`` on its slice of a recurrent network's steps does not
    pay per operation. PyTorch's fused forward (distributed BPTT's, keeping autograd's graph) costs
    ``forward_step`` seconds per step whatever the batch; BPPSA's forward, compiled on a CPU, costs
    ``forward_sample`` seconds per step and sample plus ``forward_group`` per step of each group of
    samples it runs at once (where unset, BPPSA's is the fused one too); BPPSA's backward of the
    slice from a given gradient is a compiled scan, ``walk`` seconds per step and sample; a middle
    device folds its slice into one affine element per sample, ``fold`` seconds per step and sample
    (``python -m benchmarks.distributed`` measures them on one rank). Each 0
    (unset) charges the steps' operations instead. These costs are those of the schemes
    ``bppsa_core.distributed`` runs (sequential BP, distributed BPTT and BPPSA); the others schedule
    operations."""

    flops: float = 1e12
    alpha: float = 5e-6
    beta: float = 1e-10
    word: int = 4
    overhead: float = 0.0
    forward_step: float = 0.0
    walk: float = 0.0
    fold: float = 0.0
    forward_sample: float = 0.0
    forward_group: float = 0.0

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def run(self, layers: Sequence[Layer], part: str, samples: float) -> float:
        """The time of ``part`` (forward, weight_grad, input_grad, backward or work) of ``layers`` for
        ``samples`` samples: its FLOPs at the machine's rate plus ``overhead`` per operation (a
        kernel launch, a step's latency)."""
        parts = {"backward": ("weight_grad", "input_grad"), "work": ("forward", "weight_grad", "input_grad")}
        names = parts.get(part, (part,))
        flops = sum(getattr(x, q) for x in layers for q in names)
        ops = sum(x.operations(q) for x in layers for q in names)
        return self.compute(flops * samples) + self.overhead * ops

    def forward(self, layers: Sequence[Layer], samples: float, compiled: bool = False) -> float:
        """The forward of ``layers`` for ``samples`` samples run at once: per recurrent step
        ``forward_sample`` per sample plus ``forward_group`` where ``compiled`` (BPPSA's forward) and
        ``forward_sample`` is set, else ``forward_step`` where it is set; operations for the rest."""
        if compiled and self.forward_sample > 0:
            steps, rest = compiled_steps(layers, self.forward_sample)
            per_step = self.forward_group + self.forward_sample * samples
            return per_step * steps + self.run(rest, "forward", samples)
        steps, rest = compiled_steps(layers, self.forward_step)
        return self.forward_step * steps + self.run(rest, "forward", samples)

    def send(self, elements: float) -> float:
        """One point-to-point message; an empty one is not sent."""
        return self.alpha + self.beta * self.word * elements if elements > 0 else 0.0

    def all_gather(self, elements: float, group: int) -> float:
        """An all-gather that leaves ``elements`` numbers in total on each of ``group`` processes."""
        if group <= 1 or elements <= 0:
            return 0.0
        return (
            self.alpha * math.ceil(math.log2(group)) + self.beta * (group - 1) / group * self.word * elements
        )

    def all_reduce(self, elements: float, group: int) -> float:
        """An all-reduce of ``elements`` numbers: a reduce-scatter and an all-gather."""
        return 2 * self.all_gather(elements, group)


# What a calibration.json may set: benchmarks.schemes writes the FLOP rate, α and β;
# benchmarks.distributed a device's compiled costs, BPTT's overhead and BPPSA's sample groups.
CALIBRATION = {
    "flops": "a positive number",
    "alpha": "a number >= 0",
    "beta": "a number >= 0",
    "overhead": "a number >= 0",
    "forward_step": "a number >= 0",
    "walk": "a number >= 0",
    "fold": "a number >= 0",
    "forward_sample": "a number >= 0",
    "forward_group": "a number >= 0",
    "groups": "a positive integer",
}
# What the benchmarks also write there: the measurement's size, which sets nothing.
RECORDED = ("T", "B", "iteration_flops")


def _calibrated(key: str, value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if key == "groups":
        return isinstance(value, int) and value >= 1
    return value > 0 if key == "flops" else value >= 0


def load_calibration(path: str | Path) -> dict[str, float]:
    """The settings a measured ``calibration.json`` holds (``CALIBRATION``: the FLOP rate, α and β of
    ``python -m benchmarks.schemes``, the costs of ``python -m benchmarks.distributed``);
    the keys that record the measurement's size (``RECORDED``) are skipped, any other key is an error."""
    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        if path.exists():  # there, but not readable
            raise AnalysisError(f"cannot read {path}: {exc.strerror or exc}") from None
        raise AnalysisError(
            f"no calibration at {str(path)!r}; run python -m benchmarks.schemes "
            "or python -m benchmarks.distributed first"
        ) from None
    except ValueError as exc:
        raise AnalysisError(f"{path} is not JSON: {exc}") from None
    found = {k: v for k, v in values.items() if k in CALIBRATION} if isinstance(values, dict) else {}
    if not found:
        held = ", ".join(map(str, values)) if isinstance(values, dict) and values else "nothing"
        raise AnalysisError(f"{path} sets none of {', '.join(CALIBRATION)}; it holds {held}")
    for key in values:
        if key not in CALIBRATION and key not in RECORDED:
            raise AnalysisError(
                f"{path}: unknown key {key!r}; accepted: {', '.join(CALIBRATION)}"
                f" (and {', '.join(RECORDED)}, which describe the measurement)"
            )
    for key, value in found.items():
        if not _calibrated(key, value):
            raise AnalysisError(f"{path}: {key} is {value!r}; accepted: {CALIBRATION[key]}")
    return {k: (int(v) if k == "groups" else float(v)) for k, v in found.items()}
