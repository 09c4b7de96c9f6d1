"""Devices and the paper's number of workers p, a description of the machine, and how busy it is.

Workers: on the CPU, ``hardware.workers`` sets torch's thread count; left unset it is 1. PyTorch's
OpenMP threads spin while they wait for one another, so with every core in use a single other busy
process stalls them many times over (``python run.py hardware.workers=2`` beside a busy process,
against the same run alone: records.csv's forward_s and other_load); one thread shares the
machine gracefully, and more are the experiment's choice. On a GPU it confines the run
to that many streaming multiprocessors through a CUDA green context
(``torch.cuda.green_contexts``, beta; its API changed between torch 2.11 and 2.13, and both are
handled), so one GPU yields the whole scaling-with-workers curve. Where the build or the driver has
no green contexts, asking for fewer SMs than the GPU has fails with one clear line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import subprocess
import time
from collections.abc import Iterator

import torch

from bppsa_core import denormals, dispatch
from toolbox.cli import cpu_cores
from toolbox.errors import SuiteError

log = logging.getLogger(__name__)


class HardwareError(SuiteError, ValueError):
    """A device or worker setting this machine cannot honour, said in one line."""


def resolve_device(name: str, what: str = "hardware.device", local_rank: int | None = None) -> torch.device:
    """``auto`` is cuda where available, else cpu; anything else must exist here.

    ``what`` names the setting in the messages (``hardware.device`` of a run, a tool's ``--device``).
    ``local_rank``: this process's place among the ranks of a run on this machine, which each take
    a GPU of their own (``cuda``: GPU ``local_rank``); None for a run of one process.
    """
    accepted = "auto, cpu, cuda, cuda:N"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if local_rank is not None and name.startswith("cuda"):
        if name != "cuda":
            raise HardwareError(
                f"{what} {name!r} would put every rank on one GPU; accepted with several ranks: cuda "
                "(each rank its own GPU), auto or cpu"
            )
        name = f"cuda:{local_rank}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise HardwareError(f"unknown {what} {name!r}; accepted: {accepted}") from None
    if device.type not in ("cpu", "cuda"):
        raise HardwareError(f"unknown {what} {name!r}; accepted: {accepted}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise HardwareError(f"{what} {name!r} asked for, but CUDA is not available here; accepted: cpu")
        count = torch.cuda.device_count()
        index = device.index or 0
        if index >= count:
            raise HardwareError(
                f"{what} {name!r}: this machine has {count} GPU(s); accepted: cpu, cuda:0 .. cuda:{count - 1}"
            )
        device = torch.device("cuda", index)
    return device


def worker_counts(device: str = "auto") -> str:
    """Worker counts for a scaling sweep on this machine: powers of two up to its cores (CPU) or
    SMs (GPU), and that count itself, as a comma-separated list (conf/experiment/workers.yaml)."""
    resolved = resolve_device(str(device))
    total = cpu_cores() if resolved.type == "cpu" else sm_count(resolved)
    counts = [2**k for k in range(total.bit_length()) if 2**k < total] + [total]
    return ",".join(str(c) for c in counts)


class LoadMeter:
    """How many cores other work kept busy during an interval (Linux: /proc/stat less this
    process's own CPU time; steal time of a virtual machine counts as other work)."""

    MIN_SECONDS = 0.5

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(ticks[i] for i in (0, 1, 2, 5, 6, 7) if i < len(ticks)) / os.sysconf("SC_CLK_TCK")
        own = sum(os.times()[:2])
        return time.perf_counter(), busy, own

    def own_seconds(self) -> float:
        """CPU seconds this process used since the meter started."""
        return sum(os.times()[:2]) - (self._start[2] if self._start else 0.0)

    def other_cores(self, ours: float = 0.0) -> float | None:
        """Cores other work used on average since the meter started, less ``ours``, the CPU
        seconds of this run's other processes on this machine; None where unknown, or where less
        than ``MIN_SECONDS`` passed (the counters tick in hundredths of a second)."""
        end = self._sample()
        if self._start is None or end is None or end[0] - self._start[0] < self.MIN_SECONDS:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end, strict=True))
        return max(0.0, (busy - own - ours) / wall)


def contended(other_cores: float | None, threads: int, cores: int) -> bool:
    """Whether other work left this run's threads less than a core each (the timings are suspect)."""
    return other_cores is not None and other_cores > cores - threads + 0.25


def check_strategy(mode: str, strategy: str, device: torch.device) -> None:
    """Refuse a scan strategy this run's device cannot run, before anything is written."""
    if mode != "bppsa":
        return
    try:
        dispatch.check_device(strategy, device)
    except ValueError as exc:
        raise HardwareError(f"backward.{exc}") from None


def check_capture(capture: bool, device: torch.device, asked: str) -> None:
    """Refuse a captured training step (``trainer.capture``) where there are no CUDA graphs."""
    if capture and device.type != "cuda":
        raise HardwareError(
            f"trainer.capture=true needs a CUDA device, and this run's is {device} "
            f"(hardware.device={asked}); accepted: hardware.device=cuda (or auto) on a machine with a GPU, "
            "or trainer.capture=false"
        )


def check_flush(flush: bool, device: torch.device) -> None:
    """Refuse ``hardware.flush_denormals=true`` on a CPU whose threads' floating-point mode this
    process cannot set (``bppsa_core.denormals.available``): its records would say flushed for a
    run that was not. A GPU computes on subnormals at full speed, so there it changes nothing."""
    if flush and device.type == "cpu" and not denormals.available():
        raise HardwareError(
            "hardware.flush_denormals=true needs flush-to-zero set in every thread, which this machine "
            f"does not offer ({platform.system()} {platform.machine()}: Linux on x86-64 or AArch64 with "
            "PyTorch's OpenMP runtime); accepted here: hardware.flush_denormals=false"
        )


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says that memory ran out (a size too large for the machine, not a bug)."""
    return isinstance(exc, MemoryError | torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def memory_cause(exc: BaseException) -> str:
    """The line of ``exc`` that says what ran out: the last one naming memory, as a spawned process's
    error ends its traceback with it, else the first line, else the error's type."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if "memory" in line.lower()]
    return said[-1] if said else lines[0] if lines else type(exc).__name__


def check_data_workers(workers: int) -> None:
    """Refuse more DataLoader worker processes than cores: each is a process, and thousands of them
    stall the machine instead of feeding one run."""
    cores = cpu_cores()
    if workers > cores:
        raise HardwareError(
            f"hardware.data_workers={workers} is more than the {cores} CPU cores this run may use; "
            f"accepted: 0 .. {cores}"
        )


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_sample_count(samples: int | None, train_fraction: float) -> None:
    """Refuse a sample count whose training split this machine cannot shuffle: the shuffle is one
    permutation of 8 bytes a sample, made before the first batch."""
    have = available_memory()
    if samples is None or have is None:
        return
    need = 8 * round(samples * train_fraction)
    if need > have:
        most = int(have / 8 / train_fraction)
        raise HardwareError(
            f"dataset.num_samples={samples} needs {need / 2**30:.3g} GiB to shuffle its training split, "
            f"more than the {have / 2**30:.3g} GiB available here; accepted: at most {most}"
        )


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@contextlib.contextmanager
def limit_workers(device: torch.device, workers: int | None) -> Iterator[int]:
    """Run the body on ``workers`` CPU threads or GPU SMs; yields the number actually used."""
    if device.type == "cpu":
        cores = cpu_cores()
        if workers is not None and workers > cores:
            raise HardwareError(
                f"hardware.workers={workers} is more than the {cores} CPU cores this run may use; "
                f"accepted: 1 .. {cores}"
            )
        before = torch.get_num_threads()
        used = workers or 1
        torch.set_num_threads(used)
        try:
            yield used
        finally:
            torch.set_num_threads(before)
        return
    total = sm_count(device)
    if workers is not None and workers > total:
        raise HardwareError(
            f"hardware.workers={workers} is more than the {total} SMs of "
            f"{torch.cuda.get_device_name(device)}; accepted: 1 .. {total}, or null"
        )
    if workers is None or workers == total:
        yield total
        return
    context = _green_context(device, workers)
    enter = getattr(context, "set_context", None) or context.make_current
    leave = getattr(context, "pop_context", None) or context.pop_current
    enter()
    try:
        yield workers
    finally:
        leave()


def _green_context(device: torch.device, workers: int):  # the type differs by torch version
    """A green context of ``workers`` SMs, or one clear line saying why there is none."""
    try:
        from torch.cuda import green_contexts
    except ImportError:
        green_contexts = None
    if green_contexts is None or not getattr(green_contexts, "SUPPORTED", False):
        raise HardwareError(
            f"hardware.workers={workers} needs CUDA green contexts, which this torch build "
            f"({torch.__version__}) lacks; accepted here: hardware.workers=null (all SMs)"
        )
    try:  # torch 2.13: keyword-only create(num_sms=, device_id=); 2.11: create(num_sms, device_id)
        return green_contexts.GreenContext.create(num_sms=workers, device_id=device.index or 0)
    except Exception as exc:  # the driver's refusal comes as RuntimeError with a long text
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HardwareError(
            f"hardware.workers={workers}: could not create a green context of {workers} SMs ({first}); "
            "accepted here: hardware.workers=null (all SMs)"
        ) from None


def describe(device: torch.device, workers_used: int) -> dict:
    """Device name, worker counts and the versions the timings depend on."""
    info = {
        "device_type": device.type,
        "torch_version": torch.__version__,
        "workers_used": workers_used,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            sm_total=props.multi_processor_count,
            sm_used=workers_used,
            cuda_version=torch.version.cuda,
            cudnn_version=torch.backends.cudnn.version(),
            driver_version=_nvidia_driver(),
        )
    else:
        info.update(
            device_name=cpu_name(),
            cpu_cores=cpu_cores(),
            threads_used=workers_used,
            sm_total=None,
            sm_used=None,
            cuda_version=None,
            cudnn_version=None,
            driver_version=None,
        )
    return info


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None
