"""Host time of a layer backward's Triton launches: Triton's ``kernel[grid](...)`` against the direct
launch to the compiled kernel (``bppsa_core.triton.launch``), on any machine.

    python -m benchmarks.launch                       # no GPU: kernels compiled for sm_90, launches recorded
    python -m benchmarks.launch --device cuda         # on a GPU: the real launches

For each model, the fused Triton layer backward (``rnn_layer_backward``, ``gru_layer_backward``,
``lstm_layer_backward``; the LSTM's with its gates' and cell states' kernels), and one iteration of
a tanh RNN's Newton forward ("newton", ``bppsa_core.triton.newton.FusedIteration``), at T, B = 16,
H = 20, is called three ways, taking turns: every launch through Triton's path (``direct_launches(False)``),
through the direct one, and with the launches skipped, the host work around them. Each cell is the
median host time of one call (``--repeats`` rounds after ``--warmup``, the device synchronized
between calls, never inside one). What separates the first two columns is Python on the host alone,
so it is measured the same with or without a GPU: on a CPU (``--device cpu``) the kernels compile
for sm_90 through the ptxas in the triton wheel and each launch is handed to ``RecordingDriver``,
which keeps its arguments instead of launching; only the launcher's own C call to the GPU is not
there. Triton must run its compiler (no ``TRITON_INTERPRET``; the wheel's ptxas and cuobjdump found).

Prints Markdown; progress goes to stderr. Imports nothing beyond torch and triton.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.common import (
    Progress,
    device_arg,
    machine_line,
    markdown,
    non_negative_int,
    parser,
    positive_int,
    run_tool,
)

MODELS = ("rnn", "gru", "lstm", "newton")  # newton: one Newton iteration of an RNN's forward
ARCH = 90  # what a CPU run compiles for: the H100's and H200's compute capability x 10
BLOCK_SHARED = 232448  # the most shared memory a block may use on sm_90 (bytes)


@dataclass
class Recorded:
    """One launch as the launcher was handed it: kernel name, its binary's handle, grid, arguments and
    whether it came with launch hooks (Triton's own path passes its hook chains, the direct one none)."""

    name: str
    function: int
    grid: tuple[int, int, int]
    args: tuple
    hooked: bool


@dataclass
class RecordingDriver:
    """A stand-in for Triton's CUDA driver where there is no GPU: Triton compiles for sm_``arch`` (its
    ptxas needs no GPU), "loads" each binary as a numbered handle and hands each launch to a launcher
    that records it (``launches``) instead of running it, after calling the launch hooks as the real
    launcher does. Everything above the launcher (binding, specialization, the kernel cache, the
    direct path) runs as it does on a GPU."""

    arch: int = ARCH
    launches: list[Recorded] = field(default_factory=list)
    binaries: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", self.arch, 32)
        self.utils = self  # Triton asks ``driver.utils`` for the two calls below

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": BLOCK_SHARED}

    def load_binary(
        self, name: str, binary: bytes, shared: int, device: int
    ) -> tuple[int, int, int, int, int]:
        """(module, function, registers, spills, most threads a block): the function a new handle."""
        self.binaries.append(name)
        handle = len(self.binaries)
        return handle, handle, 0, 0, 1024

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        def launch(gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args) -> None:
            if enter is not None:
                enter(launch_metadata)
            self.launches.append(Recorded(metadata.name, function, (gx, gy, gz), args, enter is not None))
            if exit_ is not None:
                exit_(launch_metadata)

        return launch


@contextlib.contextmanager
def recording(driver: RecordingDriver | None = None) -> Iterator[RecordingDriver]:
    """Inside, Triton's launches go to ``driver`` (a new ``RecordingDriver`` by default); Triton's
    own driver is active again after. Refuses (``kernels.ToolchainError``) where the kernels cannot be
    compiled: under ``TRITON_INTERPRET``, whose kernels never reach a driver, or without ptxas."""
    from triton.runtime.driver import driver as triton_driver

    from benchmarks.kernels import check_compilable

    check_compilable()

    recorder, before = driver or RecordingDriver(), triton_driver._active  # None: Triton's, made on first use
    triton_driver.set_active(recorder)
    try:
        yield recorder
    finally:
        triton_driver.set_active(before)


def layer_backward(
    model: str, steps: int, batch: int, hidden: int, device: torch.device
) -> Callable[[], object]:
    """One call of ``model``'s fused Triton layer backward at these shapes (inputs made once), as a
    layer's backward calls it: the LSTM's gates and cell states first; "newton": one iteration of a
    tanh RNN's Newton forward (``FusedIteration``: its residual, the scan and the update on the
    device)."""
    from bppsa_core import triton as ts
    from bppsa_core.dispatch import default_chunk

    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g).to(device)

    n, b, h, chunk = steps, batch, hidden, default_chunk(steps)
    if model == "newton":
        from bppsa_core.jacobians import LayerWeights, RNNCell
        from bppsa_core.newton import TOL
        from bppsa_core.triton.newton import FusedIteration

        cell, states = RNNCell("tanh"), r(n + 1, b, h)
        weights = LayerWeights(r(h, 1), r(h, h) / h, r(h), r(h))
        # a stopping rule's record, read on the device only
        record = torch.zeros(TOL + 1, dtype=torch.float64, device=device)
        return FusedIteration(cell, r(n, b, 1), weights, states, *cell.bounds(states[0], n), record, chunk)
    if model == "rnn":
        states, w, last = r(n, b, h), r(h, h), r(b, h)
        return lambda: ts.rnn_layer_backward(states, w, last, None, "tanh", chunk)
    if model == "gru":
        gi, gh, whole, w, last = r(n, b, 3 * h), r(n, b, 3 * h), r(n, b, h), r(3 * h, h), r(b, h)
        return lambda: ts.gru_layer_backward(gi, gh, whole, w, last, None, chunk)
    sums, b_hh, c0, w, last, last_c = r(n, b, 4 * h), r(4 * h), r(b, h), r(4 * h, h), r(b, h), r(b, h)

    def lstm() -> object:
        gates = ts.lstm_gates(sums, b_hh)
        return ts.lstm_layer_backward(gates, ts.lstm_cells(gates, c0), w, last, last_c, None, chunk)

    return lstm


@dataclass
class Row:
    model: str
    steps: int
    launches: int
    triton_us: float  # a call with every launch through Triton's path
    direct_us: float
    skipped_us: float  # the launches skipped: the host work around them


def bench(model: str, steps: int, device: torch.device, warmup: int, repeats: int, batch: int = 16) -> Row:
    """One row: the three ways of one call taking turns, each cell the median host microseconds."""
    from benchmarks.kernels import launches_recorded, recorded_launches
    from bppsa_core.triton.launch import direct_launches

    call = layer_backward(model, steps, batch, 20, device)
    launches = len(recorded_launches(call))
    ways: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "triton": lambda: direct_launches(False),
        "direct": lambda: direct_launches(True),
        "skipped": launches_recorded,  # recorded instead of run: the host work around the launches
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(warmup + repeats):
        for name, way in ways.items():
            with way():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                call()
                seconds = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(seconds * 1e6)
    us = {name: statistics.median(t) for name, t in times.items()}
    return Row(model, steps, launches, us["triton"], us["direct"], us["skipped"])


LEGEND = (
    "Host microseconds of one layer backward's call (medians): 'Triton path', every launch through "
    "Triton's kernel[grid](...); 'direct', straight to the compiled kernel; 'no launches', the call "
    "with its launches skipped; 'per launch' is each path's time above that, divided by the launches."
)


def format_table(rows: Sequence[Row]) -> str:
    head = ["model", "T", "launches", "Triton path µs", "direct µs", "no launches µs"]
    head += ["Triton path per launch µs", "direct per launch µs", "direct / Triton path, launches"]
    body = []
    for r in rows:
        per = [(t - r.skipped_us) / r.launches for t in (r.triton_us, r.direct_us)]
        body.append(
            [r.model, str(r.steps), str(r.launches)]
            + [f"{v:.1f}" for v in (r.triton_us, r.direct_us, r.skipped_us, *per)]
            + [f"{per[1] / per[0]:.2f}" if per[0] > 0 else "–"]
        )
    return markdown(head, body)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value ends the tool with one line and status 2."""
    p = parser("benchmarks.launch", __doc__)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models")
    p.add_argument("--T", type=positive_int, nargs="+", default=[10, 1000], help="sequence lengths")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu (launches recorded) or cuda")
    p.add_argument("--repeats", type=positive_int, default=2000, help="timed rounds (the median is shown)")
    p.add_argument("--warmup", type=non_negative_int, default=200, help="untimed rounds before them")
    return p.parse_args(argv)


def _missing() -> str | None:
    """Why the launches cannot be compiled and timed here (``kernels.check_compilable``), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; accepted: the triton extra installed (pip install '.[triton]')"
    from benchmarks.kernels import ToolchainError, check_compilable

    try:
        check_compilable()
    except ToolchainError as exc:
        return str(exc)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table once every model is measured."""
    args = parse_args(argv)
    missing = _missing()
    if missing:
        print(f"python -m benchmarks.launch: error: {missing}", file=sys.stderr)
        return 2
    progress = Progress("launch")
    torch.set_num_threads(1)
    device = args.device
    print(machine_line(device))
    where = "launched" if device.type == "cuda" else f"compiled for sm_{ARCH}, each launch recorded"
    print(
        f"B = 16, H = 20, float32; kernels {where}; median of {args.repeats} after {args.warmup}", flush=True
    )
    rows = []
    with contextlib.nullcontext() if device.type == "cuda" else recording():
        for model in args.models:
            for t in args.T:
                progress(f"{model} T={t} ...")
                rows.append(bench(model, t, device, args.warmup, args.repeats))
    print(f"\n{LEGEND}\n\n{format_table(rows)}", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_tool("benchmarks.launch", main))
