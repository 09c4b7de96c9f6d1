"""The one GPU command, checked on the CPU: its plan, its dry run end to end, its report, its errors."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, extended_except, run_module

from benchmarks import gpu_check
from benchmarks.common import markdown_tables
from bppsa_core import dispatch


def test_the_plan_on_a_gpu_runs_every_step_on_cuda() -> None:
    steps = gpu_check.plan(dry=False, repeats=10, warmup=3)
    assert set(steps) == set(gpu_check.STEPS)
    (tests,) = steps["tests"]
    assert tests[1:6] == ["-m", "pytest", "-q", "-m", "gpu"]
    assert all((ROOT / f).is_file() for f in tests[6:])  # the GPU test files exist
    n = len(gpu_check.CHUNKS)
    eager_chunks, captured_chunks = steps["chunk"][:n], steps["chunk"][n:]
    for argv in (*steps["backward"], *steps["epoch"], *steps["scan"], *eager_chunks, *steps["blocks"]):
        assert argv[1:3] == ["-m", "benchmarks.backward"]
        assert "--device" in argv and argv[argv.index("--device") + 1] == "cuda"
        assert "--quick" not in argv
    capture, *long = steps["capture"]
    for argv in steps["capture"]:
        assert argv[1:3] == ["-m", "benchmarks.capture"] and argv[argv.index("--device") + 1] == "cuda"
    assert "--T" not in capture and "--H" not in capture  # the tool's defaults: T = 1,000 and 10,000, four H
    assert [a[a.index("--T") + 1 : a.index("--H")] for a in long] == [["10000", "100000"], ["10000"]]
    assert [a[-1] for a in long] == ["20", "thread_local"]
    host, launch = steps["host"]
    assert host[1:3] == ["-m", "benchmarks.host"] and host[host.index("--device") + 1] == "cuda"
    assert launch[1:] == ["-m", "benchmarks.launch", "--device", "cuda"]
    for forward in steps["forward"]:
        assert forward[1:3] == ["-m", "benchmarks.forward"] and "--quick" not in forward
        assert forward[forward.index("--device") + 1] == "cuda"
    assert [a[a.index("--weights") + 1] for a in steps["forward"]] == ["init", "trained"]
    for runs in (eager_chunks, captured_chunks):  # each chunk eagerly, then captured at T = 1,000
        assert [a[a.index("--chunk") + 1] for a in runs] == [str(c) for c in gpu_check.CHUNKS]
    assert all("triton" in a for a in eager_chunks)
    for argv in captured_chunks:
        assert argv[1:3] == ["-m", "benchmarks.capture"] and argv[argv.index("--device") + 1] == "cuda"
        assert argv[argv.index("--T") + 1 : argv.index("--H")] == ["1000"]
    precision_capture, precision_newton = steps["precision"]  # each full float32, then three TF32 products
    assert precision_capture[1:3] == ["-m", "benchmarks.capture"] and "--kernels" in precision_capture
    assert precision_newton[1:3] == ["-m", "benchmarks.forward"] and "newton" in precision_newton
    for argv in steps["precision"]:
        assert argv[argv.index("--device") + 1] == "cuda"
        assert argv[argv.index("--matmul-precision") + 1 :][:2] == ["highest", "high"]
    walk_capture, walk_newton = steps["walks"]  # the walks on their own warps, then on 1 and 2
    assert walk_capture[1:3] == ["-m", "benchmarks.capture"] and "--kernels" in walk_capture
    assert walk_newton[1:3] == ["-m", "benchmarks.forward"] and "newton" in walk_newton
    for argv in steps["walks"]:
        assert argv[argv.index("--device") + 1] == "cuda"
        assert argv[argv.index("--walk-warps") + 1 :][:3] == ["auto", "1", "2"]
    assert [a[a.index("--block-mib") + 1] for a in steps["blocks"]] == [str(b) for b in gpu_check.BLOCK_MIBS]
    assert all(
        a[a.index("--T") + 1 : a.index("--strategies")] == ["1000", "30000", "100000"]
        for a in steps["blocks"]
    )
    ranks, chained, on_gpus = steps["ranks"]
    for argv in (ranks, chained, on_gpus):
        assert argv[1:3] == ["-m", "benchmarks.distributed"]
        assert argv[argv.index("--T") + 1] == "100000" and argv[argv.index("--repeats") + 1] == "3"
        assert "--timeline" in argv  # where each rank waits
    for argv in (ranks, chained):
        assert "--device" not in argv  # CPU ranks: the cost model's measured points
    assert ranks[ranks.index("--out") + 1] == str(Path.cwd() / "gpu_report-ranks")  # beside the report
    assert ranks[ranks.index("--exchange") + 1] == "allgather"  # the default on CPU ranks is the chain
    assert chained[chained.index("--exchange") + 1] == "chain"
    assert chained[chained.index("--out") + 1] == str(Path.cwd() / "gpu_report-ranks-chain")
    assert on_gpus[on_gpus.index("--device") + 1] == "cuda" and "--out" not in on_gpus


def test_the_ranks_step_takes_one_gpu_per_nccl_rank_up_to_four(monkeypatch) -> None:
    for gpus, counts in ((8, [1, 2, 3, 4]), (2, [1, 2]), (1, [1])):
        monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda n=gpus: n)
        _, _, *on_gpus = gpu_check.plan(dry=False, repeats=10, warmup=3)["ranks"]
        assert on_gpus, gpus
        for argv in on_gpus:
            assert argv[argv.index("--ranks") + 1 : argv.index("--T")] == [*map(str, counts)], gpus


def test_several_gpus_time_every_sample_group_count_and_one_gpu_once(monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    _, _, *on_gpus = gpu_check.plan(dry=False, repeats=10, warmup=3)["ranks"]
    groups = [argv[argv.index("--micro-batches") + 1] for argv in on_gpus]
    assert groups == ["1", "2", "4", "8", "16"]  # the CPU's default among them, and one sample a group
    assert all(argv[argv.index("--device") + 1] == "cuda" for argv in on_gpus)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    _, _, on_gpu = gpu_check.plan(dry=False, repeats=10, warmup=3)["ranks"]
    assert "--micro-batches" not in on_gpu  # one rank walks the batch whole: nothing to sweep


def test_the_ranks_step_takes_one_core_per_rank_up_to_four(monkeypatch) -> None:
    for cores, counts in ((16, [1, 2, 3, 4]), (3, [1, 2, 3]), (2, [1, 2]), (None, [1])):
        monkeypatch.setattr(gpu_check.os, "cpu_count", lambda n=cores: n)
        for ranks in gpu_check.plan(dry=False, repeats=10, warmup=3)["ranks"][:2]:
            start = ranks.index("--ranks") + 1
            assert ranks[start : start + len(counts) + 1] == [*map(str, counts), "--T"], cores
    assert gpu_check.rank_counts(dry=True) == [1, 2]


def test_the_reproduction_step_trains_the_rnn_sweeps_on_the_gpu_where_hydra_is(monkeypatch) -> None:
    argv, captured = gpu_check.plan(dry=False, repeats=10, warmup=3)["reproduction"]
    assert argv[:4] == ["bash", "docs/reproduction/run.sh", "--device", "cuda"] and argv[4] == "--only"
    assert captured == [*argv, "--capture"]
    for table in argv[5].split(","):  # tables the CPU's reproduction commits too
        assert table.startswith("rnn_") and (ROOT / "docs" / "reproduction" / f"{table}.csv").is_file()
    assert gpu_check._shown(argv) == argv and gpu_check._shown([sys.executable, "-m", "x"])[0] == "python"
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda m: None if m == "hydra" else real(m))
    said = gpu_check.plan(dry=False, repeats=10, warmup=3)["reproduction"]
    assert said == "needs hydra (the suite's requirements: run.py composes its configs)"
    assert gpu_check.plan(dry=True, repeats=1, warmup=0)["reproduction"] == "needs a CUDA device"


def test_the_tests_step_runs_every_file_that_has_gpu_tests() -> None:
    marker = re.compile(r"^@pytest\.mark\.gpu$", re.MULTILINE)
    files = (ROOT / "tests").rglob("test_*.py")
    marked = {str(p.relative_to(ROOT)) for p in files if marker.search(p.read_text())}
    assert marked == set(gpu_check.GPU_TEST_FILES)


def test_the_dry_plan_skips_what_needs_cuda_and_shrinks_the_rest() -> None:
    steps = gpu_check.plan(dry=True, repeats=1, warmup=0)
    assert steps["tests"] == "needs a CUDA device"
    for name in ("backward", "epoch", "scan", "chunk", "precision", "walks", "blocks"):
        for argv in steps[name]:
            assert argv[argv.index("--device") + 1] == "cpu"
            assert "--quick" in argv or "--T" in argv
    assert steps["kernels"][0][-2:] == ["80", "90"] and "representative" in steps["kernels"][0]
    assert "--quick" in steps["forward"][0] and "cpu" in steps["forward"][0]
    for ranks in steps["ranks"]:  # the two exchanges; no NCCL run without GPUs
        assert ranks[ranks.index("--ranks") + 1 : ranks.index("--T") + 2] == ["1", "2", "--T", "2000"]
    assert len(steps["ranks"]) == 2


def test_the_dry_chunk_sweep_takes_the_compiled_cpu_scan_only_where_it_is_installed(monkeypatch) -> None:
    for installed, strategies in ((True, ["chunked", "numba"]), (False, ["chunked"])):
        monkeypatch.setattr(dispatch, "numba_installed", lambda i=installed: i)
        for argv in gpu_check.plan(dry=True, repeats=1, warmup=0)["chunk"]:
            assert argv[argv.index("--strategies") + 1 : argv.index("--chunk")] == strategies


@pytest.mark.parametrize(
    "module", extended_except(["benchmarks.gpu_check", "experiments.gpu_check"], first=1)
)
def test_without_a_gpu_the_command_says_how_to_check_it(tmp_path, module: str) -> None:
    done = run_module(module, "--out", str(tmp_path / "r.md"))
    assert done.returncode == 2 and not (tmp_path / "r.md").exists()
    assert done.stderr.strip().splitlines() == [
        f"python -m {module}: error: no CUDA device here; accepted: a machine with a GPU, or --dry to "
        "check the command on a CPU"
    ]


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path, monkeypatch) -> None:
    fail = [sys.executable, "-c", "import sys; print('half a table'); sys.exit('boom')"]
    ok = [sys.executable, "-c", "print('| a |\\n|---|\\n| 1 |')"]
    monkeypatch.setattr(gpu_check, "plan", lambda *a: {"backward": [fail], "scan": [ok], "tests": "no GPU"})
    out = tmp_path / "report.md"
    assert gpu_check.main(["--dry", "--out", str(out), "--steps", "tests", "backward", "scan"]) == 1
    text = out.read_text()
    assert "Step `tests`: skipped" in text and "Skipped: no GPU." in text
    assert "Step `backward`: failed" in text and "exit status 1" in text and "boom" in text
    assert "half a table" in text  # what it printed before failing is kept
    assert "Step `scan`: ok" in text and markdown_tables(text)[0][1] == [["1"]]


def test_a_step_stopped_by_its_time_limit_keeps_what_it_printed_on_both_streams() -> None:
    """A benchmark stopped by ``--step-timeout`` keeps its table so far and its progress lines (the
    sequence-parallel benchmark prints each spawn's times to stderr as it ends)."""
    code = (
        "import sys, time; print('| a |', flush=True); "
        "print('[distributed] T = 50, 1 rank(s): bppsa backward 1.0 ms', file=sys.stderr, flush=True); "
        "time.sleep(60)"
    )
    ok, text = gpu_check.run_command([sys.executable, "-c", code], timeout=3)
    assert not ok and "stopped after 3 s (--step-timeout)" in text
    assert "| a |" in text and "[distributed] T = 50, 1 rank(s): bppsa backward 1.0 ms" in text


@pytest.mark.parametrize("stop", [KeyboardInterrupt, gpu_check.Terminated])
def test_a_run_stopped_part_way_keeps_the_steps_it_finished(tmp_path, monkeypatch, capsys, stop) -> None:
    """The report so far is rewritten after every step into ``<report>.partial``: a run stopped in
    its second step (Ctrl-C, or SIGTERM as a time limit sends it) leaves the first step's table
    there, in the order ``--steps`` gave, and an earlier report as it was; a run that ends makes
    the partial report the report."""
    out = tmp_path / "report.md"
    so_far = tmp_path / "report.md.partial"
    out.write_text("an earlier report")
    seen = []

    def run(argv, timeout):
        seen.append(so_far.read_text() if so_far.exists() else None)
        if len(seen) == 2:
            raise stop
        return True, "| a |\n|---|\n| 1 |"

    monkeypatch.setattr(gpu_check, "plan", lambda *a: {"scan": [["s"]], "backward": [["b"]]})
    monkeypatch.setattr(gpu_check, "run_command", run)
    code = gpu_check.main(["--dry", "--out", str(out), "--steps", "scan", "backward"])
    assert code == (143 if stop is gpu_check.Terminated else 130)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"python -m benchmarks.gpu_check: stopped in step backward; the finished steps are in {so_far}"
    )
    assert seen[0] is None and "Step `scan`: ok" in seen[1]  # written before the next step began
    text = so_far.read_text()
    assert "Step `scan`: ok" in text and "Step `backward`" not in text
    assert markdown_tables(text)[0][1] == [["1"]]
    assert out.read_text() == "an earlier report"
    seen.clear()  # the same run to its end
    assert gpu_check.main(["--dry", "--out", str(out), "--steps", "scan"]) == 0
    assert "Step `scan`: ok" in out.read_text() and not so_far.exists()


def test_a_stopped_step_takes_every_process_it_started_with_it() -> None:
    """A step's tool runs in a process group of its own, killed whole when the step is stopped: a
    process the tool started (a rank, a run of run.sh) does not outlive it."""
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(child.pid, flush=True); time.sleep(60)"
    )
    ok, text = gpu_check.run_command([sys.executable, "-c", code], timeout=1.5)
    assert not ok and "stopped after 2 s" in text  # the limit, rounded
    grandchild = int(text.split()[0])
    for _ in range(50):  # killed at once; reaped by init a moment later
        if not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild):
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild)


def test_a_step_stays_in_the_session_of_the_run() -> None:
    """A step's group is its own, but its session is the run's: whatever ends the run's session (a
    job stopped at its time limit) ends the step with it, where a new session would run on."""
    code = "import os; print(os.getpgid(0), os.getsid(0))"
    ok, text = gpu_check.run_command([sys.executable, "-c", code], timeout=30)
    group, session = (int(v) for v in text.split())
    assert ok and group != os.getpgid(0) and session == os.getsid(0)


def _state(pid: int) -> str:
    """A process's state letter from /proc ("Z": ended, not yet reaped); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@pytest.mark.extended  # compiles parallel builds of its own (seconds each); the dry run below runs it too
def test_worker_scaling_times_both_methods_at_every_count() -> None:
    text = gpu_check.worker_scaling(dry=True, repeats=1, warmup=0)
    head, rows = markdown_tables(text)[0]
    assert head == ["CPU threads", "BPTT ms", "BPPSA ms", "BPTT / BPPSA"]
    assert rows[0][0] == "1" and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


@pytest.mark.extended
def test_the_dry_run_goes_end_to_end(tmp_path) -> None:
    """Every step on the CPU, the report whole: the tables of each tool inside it (about 90 s)."""
    out = tmp_path / "report.md"
    done = run_module("benchmarks.gpu_check", "--dry", "--out", str(out), "--repeats", "1", "--warmup", "1")
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("# GPU check (dry run)")
    for name in gpu_check.STEPS:
        assert f"Step `{name}`: " + ("skipped" if name in ("tests", "reproduction") else "ok") in text
    assert len(markdown_tables(text)) >= 10
    assert "| kernel | mode |" in text and "estimate" in text  # the compiled kernels' table
    assert "| T | ranks | backward |" in text  # the sequence-parallel table
    assert "BPPSA backward, T = 2000, 2 rank(s): each rank's spans" in text
    measured = (tmp_path / "report-ranks" / "measured.csv").read_text().splitlines()
    assert len(measured) == 1 + 4  # 1 and 2 ranks, BPPSA and BPTT
    assert (tmp_path / "report-ranks" / "calibration.json").is_file()


def test_the_old_command_name_runs_the_same_tool() -> None:
    """``python -m experiments.gpu_check`` is the name the command has always had: the same main."""
    from experiments import gpu_check as alias

    assert alias.main is gpu_check.main


GLANCE_H200 = {  # measure's start -> BPPSA against cuDNN, from docs/gpu/H200.md's own tables
    "RNN backward, eager": "0.98× / 4.09× / cuDNN refuses, BPPSA 6.142 ms",
    "RNN backward captured": "3.76× / 7.51×",
    "RNN training step captured": "1.85× / 2.29×",
    "GRU / LSTM backward, eager": "0.849× / 0.917×",
    "GRU / LSTM backward captured": "3.09× / 0.871×",
    "RNN backward over T": "0.668–9.67× (T = 10–30,000)",
    "GRU backward at the paper's IRMAS shapes": "0.753–1.8× (T = 259–1,034, B = 16–64)",
    "Training epoch": "0.785× / 1.76×",
    "Layer forward, eager, T = 10": "0.725× / 0.68× / 0.833×",  # the host step's 1.38, 1.47, 1.20 turned over
    "Training step of a layer": "0.613× / 0.719× / 0.595×",
    "RNN backward's peak memory": "25.3 / 4.12 MiB",
}


def _glance_rows(text: str) -> dict[str, str]:
    (head, rows), *_ = markdown_tables(text)
    assert head[1:] == ["step", "BPPSA against cuDNN"]
    return {measure: value for measure, _step, value in rows}


def test_the_glance_gathers_a_reports_headline_ratios_from_its_steps_tables() -> None:
    """Each row of the committed H200 report's glance is the number its step's table shows: the first
    row of a shape (the capture step repeats T = 10,000 in a process of its own), cuDNN's refusal at
    T = 100,000 as such, the ranges over the backward step's RNN T sweep at B = 16 and its GRU rows,
    the host step's ratios turned over (above 1: BPPSA faster, as every row)."""
    rows = _glance_rows(gpu_check.glance(gpu_check.report_steps((ROOT / "docs/gpu/H200.md").read_text())))
    assert len(rows) == len(GLANCE_H200)
    for start, value in GLANCE_H200.items():
        (measure,) = [m for m in rows if m.startswith(start)]
        assert rows[measure] == value, measure


def test_a_report_opens_with_its_glance_where_a_step_has_a_table_this_reads(monkeypatch) -> None:
    capture = gpu_check.report_steps((ROOT / "docs/gpu/H200.md").read_text())["capture"]
    sections = {
        "tests": gpu_check.Section(gpu_check.TITLES["tests"], body="221 passed"),
        "capture": gpu_check.Section(gpu_check.TITLES["capture"], body=capture),
    }
    monkeypatch.setattr(gpu_check, "environment", lambda dry, argv: "- GPU: a stand-in")  # no GPU here
    text = gpu_check.render(sections, False, [])
    assert text.index("## At a glance") < text.index("## " + gpu_check.TITLES["capture"])
    rows = _glance_rows(text.split("## At a glance")[1])
    assert rows["RNN backward captured in a CUDA graph, GPU time, T = 1,000 / 10,000"] == "3.76× / 7.51×"
    assert rows["Training epoch, bitstream RNN, T = 1,000: eager / steps captured"] == "– / –"  # not run
    assert "At a glance" not in gpu_check.render({"tests": sections["tests"]}, False, [])  # no table
    assert "At a glance" not in gpu_check.render(sections, True, [])  # a dry run's baseline is not cuDNN


def test_written_reports_glances_are_printed_side_by_side_and_bad_files_refused(tmp_path, capsys) -> None:
    """A column per report, named by its GPU (the file's name where the report names none), "–"
    where a report lacks a step; a missing file, or files with no table it reads, refused."""
    h200 = (ROOT / "docs/gpu/H200.md").read_text()
    other = h200.replace("- GPU: NVIDIA H200,", "- GPU: NVIDIA H100 80GB HBM3,")
    other = other.replace("| 0.98 | 90 | 1.85 | 3.76 |", "| 1.5 | 90 | 1.85 | 3.76 |")  # its own T = 1,000
    (tmp_path / "h100.md").write_text(other)
    (tmp_path / "capture-only.md").write_text(h200.split("Step `backward`:")[0].replace("- GPU:", "- no:"))
    reports = [str(ROOT / "docs/gpu/H200.md"), str(tmp_path / "h100.md"), str(tmp_path / "capture-only.md")]
    assert gpu_check.main(["--glance", *reports]) == 0
    (head, rows), *_ = markdown_tables(capsys.readouterr().out)
    assert head[2:] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "capture-only.md"]
    by_measure = {row[0]: row[2:] for row in rows}
    eager = by_measure["RNN backward, eager, T = 1,000 / 10,000 / 100,000"]
    assert [e.split(" / ")[0] for e in eager] == ["0.98×", "1.5×", "0.98×"]
    epoch = by_measure["Training epoch, bitstream RNN, T = 1,000: eager / steps captured"]
    assert epoch == ["0.785× / 1.76×", "0.785× / 1.76×", "– / –"]
    with pytest.raises(SystemExit) as missing:
        gpu_check.main(["--glance", reports[0], str(tmp_path / "none.md")])
    assert missing.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m benchmarks.gpu_check: error: --glance {tmp_path / 'none.md'}: no such file; accepted: a "
        "report this command wrote"
    ]
    (tmp_path / "notes.md").write_text("# notes\n\nno tables\n")
    assert gpu_check.main(["--glance", str(tmp_path / "notes.md")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m benchmarks.gpu_check: error: --glance {tmp_path / 'notes.md'}: no capture, backward, "
        "epoch or host table in them; accepted: reports this command wrote"
    ]


def test_a_step_cut_short_leaves_dashes_in_the_glance_not_a_failure() -> None:
    """The report is drawn after every step, so tables cut short (a step stopped part-way, a cell
    that is no number, a missing column) give "–" where they lack a figure, and whole rows count."""
    rule = "|---|---|---|---|---|"
    bodies = {
        "capture": f"| model | T | B | H | cuDNN eager ms |\n{rule}\n| rnn | 1000 | 16 | 20 | error |\n| rnn",
        "backward": f"| model | T | B | H | BPTT / best |\n{rule}\n| rnn | 10 | 16 | 20 | 0.5 |\n| rnn | x |",
        "host": "| model | T | forward ratio |\n|---|---|---|\n| rnn | 10 | 0 |\n| gru | 10 | 2 |",
    }
    rows = _glance_rows(gpu_check.glance(bodies))
    assert rows["RNN backward, eager, T = 1,000 / 10,000 / 100,000"] == "cuDNN refuses, BPPSA – ms / – / –"
    assert rows["RNN backward over T, BPPSA's best strategy"] == "0.5× (T = 10)"  # the cut row left out
    assert rows["GRU backward at the paper's IRMAS shapes, best strategy"] == "–"
    assert rows["Layer forward, eager, T = 10: RNN / GRU / LSTM"] == "– / 0.5× / –"
    assert rows["RNN backward's peak memory, T = 1,000: cuDNN / BPPSA"] == "– / – MiB"
