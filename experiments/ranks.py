"""The processes of one run: ``run.py`` over several ranks, each holding a time slice of every sequence.

A run takes its ranks from one of three places:

* ``torchrun --nproc-per-node N run.py ...``: torchrun's ``RANK``, ``WORLD_SIZE`` and
  ``MASTER_ADDR``/``MASTER_PORT``;
* the SLURM launcher with N tasks (``hydra/launcher=slurm hydra.launcher.tasks_per_node=N``): SLURM's
  task numbers, which submitit exports for torch;
* ``hardware.ranks=N`` with neither: ``run.py`` starts N - 1 more processes on this machine, meeting
  through a file in a temporary folder, so ``python run.py -m hardware.ranks=1,2`` sweeps them.

Rank 0 leads: it holds the folder lock, decides what the job does and writes every file. The others
follow: they receive the leader's configuration, build the same data and model, start from the
leader's weights, train in lockstep (the collectives of ``bppsa_core.distributed.SequenceParallel``)
and write nothing. Where one rank alone may fail (the leader's decision, building the data, writing
an epoch's records), the ranks agree (``Ranks.together``), so the failure ends the job on every rank
in one line. A rank that dies makes the others' next collective fail, which each reports in one line.
A rank that stops without dying (SIGSTOP, a suspended machine) is noticed by the others' heartbeats
(``Heartbeat``) after ``hardware.silent_rank_s`` seconds, well before gloo's collective timeout.

Every rank loads whole batches (B, T, I) and keeps its own time slice (``experiments.train.Classifier``):
simple, and the data of the paper's models is small beside the forward's saved states.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolbox.errors import SuiteError

# How long a rank waits in a collective for the others (building IRMAS's features on the leader
# while the others wait takes minutes on the first run).
TIMEOUT_MIN = 30


class RankError(SuiteError, RuntimeError):
    """The job failed on another rank, or a rank left: said in one line on every rank."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


@dataclass
class Ranks:
    """This process's place among the ranks of a run; one rank when nothing is launched."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks on this machine
    processes: list = field(default_factory=list)  # the followers this process started

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def siblings_seconds(self, seconds: float) -> float:
        """The sum of ``seconds`` over the other ranks on this machine (their CPU time, say)."""
        host = socket.gethostname()
        return sum(s for r, (h, s) in enumerate(self.gather((host, seconds))) if h == host and r != self.rank)

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.size == 1:
            return [obj]
        every: list = [None] * self.size
        dist.all_gather_object(every, obj)
        return every

    def together(self, fn: Callable[[], Any] | None, bad_input: tuple[type, ...] = ()) -> Any:
        """Run ``fn`` on this rank (``None``: nothing to do here), then learn whether it failed on
        any rank: this rank's own exception is raised again; another rank's comes as a RankError
        naming that rank (``bad_input`` says which exception types are the user's input)."""
        error: Exception | None = None
        result = None
        try:
            result = fn() if fn is not None else None
        except Exception as exc:  # every rank must reach the exchange below
            error = exc
        if self.size > 1:
            said = self.gather(None if error is None else (first_line(error), isinstance(error, bad_input)))
            if error is None:
                for rank, failure in enumerate(said):
                    if failure is not None:
                        raise RankError(f"rank {rank} of {self.size}: {failure[0]}", bad_input=failure[1])
        if error is not None:
            raise error
        return result


# How often a rank's heartbeat says it is there (a counter in the process group's store).
BEAT_S = 1.0


class Heartbeat:
    """Each rank's sign of life, and its watch over the others': a daemon thread that adds to this
    rank's counter in the process group's store every ``BEAT_S`` seconds and reads the others'. A
    rank whose counter has not moved for ``silent_s`` seconds, and that has not said it left
    (``stop``), is stopped or frozen: ``on_silent`` gets one line naming it, on every rank that
    still runs. The thread beats while the main thread waits in a collective or computes (torch and
    the kernels release the interpreter often), so only a process that stopped as a whole falls
    silent. ``token`` keeps one job's counters apart from another's in the same store."""

    def __init__(self, ranks: Ranks, token: str, silent_s: float, on_silent: Callable[[str], None]) -> None:
        self.ranks, self.silent_s, self.on_silent = ranks, silent_s, on_silent
        self._prefix = f"bppsa/heartbeat/{token}/"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="bppsa-heartbeat", daemon=True)

    def start(self) -> None:
        """Beat and watch, when there are other ranks."""
        if self.ranks.size > 1:
            self._thread.start()

    def stop(self) -> None:
        """Say that this rank left the job (the others stop watching it), and stop beating."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):  # the store may be gone with the process group
                dist.distributed_c10d._get_default_store().set(self._prefix + f"left/{self.ranks.rank}", "1")
            self._stop.set()
            self._thread.join()

    def _beat(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            others = [r for r in range(self.ranks.size) if r != self.ranks.rank]
            seen = {r: (-1, time.monotonic()) for r in others}  # counter, when it last moved
            while not self._stop.wait(BEAT_S):
                store.add(self._prefix + str(self.ranks.rank), 1)
                now = time.monotonic()
                for r in others:
                    count = store.add(self._prefix + str(r), 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.silent_s and not store.check([self._prefix + f"left/{r}"]):
                        self.on_silent(
                            f"rank {r} of {self.ranks.size} has not answered for {self.silent_s:g} s "
                            "(stopped or frozen); the run ends"
                        )
                        return
        except Exception:  # the store went away with the process group: the job is over
            return


def first_line(exc: BaseException) -> str:
    """The first line of what an exception says (its type where it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def left_the_run(exc: BaseException, ranks: Ranks) -> RankError | None:
    """A collective that failed because a rank left (died, or ended its job), as one line; None for
    any other error."""
    text = str(exc)
    lost = isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError) and any(w in text for w in ("gloo", "NCCL", "Connection", "timed out"))
    )
    if ranks.size == 1 or not lost:
        return None
    why = first_line(exc).split("] ", 1)[-1].split(". ")[0][:160]  # gloo's words after its source line
    return RankError(f"a rank left the run (rank {ranks.rank} of {ranks.size} saw: {why})")


def launched_follower() -> bool:
    """Whether torchrun started this process as a follower (a rank above 0)."""
    return int(os.environ.get("RANK", "0")) > 0


def launched() -> Ranks | None:
    """The ranks of a launch by torchrun or by SLURM tasks (submitit), joined once per process;
    None when this process was launched alone."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size < 2:
        return None
    ranks = Ranks(
        int(os.environ["RANK"]),
        size,
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    if not dist.is_initialized():
        _join("env://", ranks)
        # part before the interpreter does: a process group left to its destructor at exit may abort
        # the process ("terminate called without an active exception") after a run that succeeded
        atexit.register(_part)
    return ranks


def _part() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(init_method: str, ranks: Ranks) -> None:
    """Join the process group: gloo for CPU tensors, NCCL for GPU tensors where there are GPUs."""
    from datetime import timedelta

    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=ranks.rank,
        world_size=ranks.size,
        timeout=timedelta(minutes=TIMEOUT_MIN),
    )


@contextlib.contextmanager
def started(size: int, follower: Callable[[Ranks], Any]) -> Iterator[Ranks]:
    """Start ``size - 1`` follower processes on this machine, each running ``follower(ranks)`` (a
    module-level function), and join them as rank 0; on leaving, wait for them and part."""
    folder = tempfile.mkdtemp(prefix="bppsa-ranks-")
    store = f"file://{os.path.join(folder, 'store')}"
    context = mp.get_context("spawn")
    ranks = Ranks(0, size, 0, size)
    try:
        for rank in range(1, size):
            process = context.Process(target=_follow, args=(follower, Ranks(rank, size, rank, size), store))
            process.start()
            ranks.processes.append(process)
        _join(store, ranks)
        yield ranks
    finally:
        _part()
        for process in ranks.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _follow(follower: Callable[[Ranks], Any], ranks: Ranks, store: str) -> None:
    """A started follower process: join, follow one job, part. Its failure line is its own output."""
    torch.set_num_threads(1)
    _join(store, ranks)
    try:
        follower(ranks)
    except KeyboardInterrupt:  # Ctrl-C reaches every process; the leader says what was kept
        sys.exit(130)
    finally:
        with contextlib.suppress(Exception):
            _part()
