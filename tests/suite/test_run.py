"""run.py and the experiment configs: composition, runs, sweeps, resume, failures, bad input.

Every run writes into pytest's temporary folders (hydra.run.dir / hydra.sweep.dir), never into the
repository, and logs with logger=csv or logger=none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import CONF, ROOT, TINY, composed, extended_except, run_py
from hydra.errors import HydraException
from omegaconf import OmegaConf

from bppsa_core import GRU, denormals
from experiments import runner, schema, train
from experiments.config import build, check
from experiments.loggers import LocalLogger
from experiments.summary import print_summary

PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


# Each preset's sweep (conf/sweep/), and the values it varies: the paper's figures' axes.
SWEEPS = {
    "gru_curves": ("frames", {"dataset.frames": "s,m,l"}),
    "gru_irmas": ("frames_batch", {"dataset.frames": "s,m,l", "trainer.batch_size": "16,32,64"}),
    "rnn_batch": ("batch", {"trainer.batch_size": "2,4,8,16,32,64,128,256"}),
    "rnn_curve": ("backward", {}),
    "rnn_seq_len": ("seq_len", {"dataset.seq_len": "10,30,100,300,1000,3000,10000,30000"}),
    "workers": ("workers", {}),  # the machine's worker counts: test_the_workers_preset_fits_the_machine
}


def preset_args(preset: str) -> list[str]:
    return [f"experiment={preset}", *(["dataset.root=/data/irmas"] if preset.startswith("gru") else [])]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_validates_and_sweeps_both_backwards(preset: str) -> None:
    cfg = composed(*preset_args(preset), hydra=True)
    check(cfg)
    assert cfg.name == preset
    sweep, varied = SWEEPS[preset]
    assert cfg.hydra.runtime.choices.sweep == sweep
    params = dict(cfg.hydra.sweeper.params)
    assert list(params)[-1] == "backward" and params["backward"] == "bppsa,bptt"  # the innermost loop
    assert {k: v for k, v in params.items() if k in varied} == varied
    assert len(params) == len(varied) + 1 + (preset == "workers")
    text = (CONF / "experiment" / f"{preset}.yaml").read_text()
    assert "figure" in text.lower() or "hardware sensitivity" in text.lower()  # each states its paper result
    assert "hydra:" not in text  # what a preset sweeps is its sweep's


def test_a_preset_runs_without_its_sweep_or_with_another() -> None:
    alone = composed("experiment=rnn_seq_len", "sweep=none", hydra=True)
    assert alone.hydra.sweeper.params is None and alone.hydra.runtime.choices.sweep == "none"
    sized = composed("experiment=rnn_seq_len")
    unswept = composed("experiment=rnn_seq_len", "sweep=none")
    assert OmegaConf.to_container(unswept) == OmegaConf.to_container(sized)  # a sweep sets what varies only
    other = composed("experiment=rnn_seq_len", "sweep=batch", hydra=True)
    assert dict(other.hydra.sweeper.params) == {
        "trainer.batch_size": "2,4,8,16,32,64,128,256",
        "backward": "bppsa,bptt",
    }
    assert other.name == "rnn_seq_len" and other.dataset.num_samples == 50000
    main = composed("sweep=seq_len", hydra=True)  # the main job's sizes, a preset's sweep
    assert main.name == "main" and main.hydra.sweeper.params["dataset.seq_len"].startswith("10,30,")
    assert composed(hydra=True).hydra.sweeper.params is None
    every = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
    assert sorted({s for s, _ in SWEEPS.values()} | {"none"}) == every
    # choosing the sweep names no job: sweep= stays out of the job folders, as experiment= does
    from experiments.records import job_folder

    assert job_folder(["sweep=none", "experiment=rnn_curve", "backward=bptt"]) == "run_backward=bptt"


def test_hydra_settings_come_from_conf_hydra() -> None:
    cfg = composed(hydra=True)
    hc = cfg.hydra
    assert hc.runtime.choices["hydra/help"] == "run" and hc.help.app_name == "run.py"
    assert hc.run.dir.startswith("outputs/") and hc.job.chdir is False and hc.output_subdir is None
    assert sorted(hc.callbacks) == ["merge_results", "note_folders"]
    assert "\nhydra:" not in (CONF / "config.yaml").read_text()  # selected there, written in conf/hydra/


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], {"model._target_": "bppsa_core.RNN", "dataset._target_": "datasets.bitstream.Bitstream"}),
        (
            ["model=gru", "dataset=irmas", "dataset.root=/x", "dataset.frames=l"],
            {"model._target_": "bppsa_core.GRU", "dataset._target_": "datasets.irmas.IRMAS"},
        ),
        (
            ["backward=bptt", "logger=none", "hardware.device=cpu", "hardware.workers=1"],
            {"backward.mode": "bptt", "logger.mode": "disabled"},
        ),
        (
            ["logger=wandb", "logger.mode=online", "backward.strategy=blelloch", "backward.levels=2"],
            {"backward.mode": "bppsa"},
        ),
        (
            [
                "model=lstm",
                "model.forward_solver=quasi-newton",
                "model.newton_guess=previous",
                "model.newton_tol=1e-5",
            ],
            {"model._target_": "bppsa_core.LSTM"},
        ),
    ],
)
def test_group_options_compose_and_validate(overrides: list[str], expected: dict) -> None:
    """Each option and key lands where it was asked for, and the result passes run.py's checks."""
    cfg = composed(*overrides)
    check(cfg)
    for key, value in (o.split("=", 1) for o in overrides if "." in o.split("=", 1)[0]):
        got = OmegaConf.select(cfg, key)
        assert got == (float(value) if isinstance(got, int | float) else value), key
    for key, value in expected.items():  # what the group options chose
        assert OmegaConf.select(cfg, key) == value, key


def test_help_describes_the_app_its_groups_presets_and_sweeps(tmp_path: Path) -> None:
    done = run_py("--help", cwd=tmp_path)
    assert done.returncode == 0
    out = done.stdout
    assert out.startswith("run.py: train the paper's recurrent classifiers")
    assert "python run.py -m key=a,b" in out and "hydra/launcher=slurm" in out
    assert "  model: gru, lstm, rnn" in out and "schema" not in out.split("== The configuration")[0]
    for preset in PRESETS:
        assert f"  {preset} " in out
    lines = out.splitlines()
    for line in [
        "run.py: train the paper's recurrent classifiers with a BPPSA backward (back-propagation as a",
        "parallel scan) or PyTorch's BPTT, time every phase, and record the results.",
        "  python run.py [group=option ...] [key=value ...]    one run, into outputs/<name>/<time>/",
        "  python run.py -m experiment=rnn_seq_len             one of the paper's sweeps",
        "  python run.py -m ... hydra/launcher=slurm hydra.launcher.partition=gpu",
        "== Config groups: group=option ==",
        "  backward: bppsa, bptt",
        "== Presets: experiment=<name>, with -m ==",
        "== The configuration these arguments compose (override any key: key=value) ==",
        "name: main",
        "Bad input ends with one line and exit status 2. README.md explains every option and file;",
        "docs/DESIGN.md the method. --hydra-help: Hydra's own options.",
    ]:
        assert line in lines, line
    assert "hydra:" not in out and "powered by Hydra" not in out  # the composed job only, no Hydra header


def test_the_workers_preset_fits_the_machine() -> None:
    from experiments.hardware import cpu_cores, worker_counts

    counts = [int(c) for c in worker_counts("cpu").split(",")]
    assert counts[-1] == cpu_cores() and counts == sorted(set(counts))
    assert all(c & (c - 1) == 0 for c in counts[:-1])  # powers of two below the core count
    assert composed("experiment=workers", hydra=True).hydra.sweeper.params[
        "hardware.workers"
    ] == worker_counts("cpu")


@pytest.mark.extended
def test_a_warm_up_longer_than_an_epoch_is_said(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_py(*TINY, "logger=csv", "trainer.warmup_iters=100", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0
    assert "covers all 4 iterations of the first epoch: it has no timings" in done.stdout + done.stderr
    assert "no timed iteration (all 4 were warm-up, trainer.warmup_iters=100)" in done.stdout


def test_priming_runs_a_backward_and_leaves_the_training_as_it_was() -> None:
    """The untimed step before the first epoch: a backward runs, then parameters, gradients, the
    random state (a dropout draws from it) and the loader's order are as before."""
    torch.manual_seed(0)
    model = train.Classifier(GRU(3, 4, num_layers=2, dropout=0.5, batch_first=True), classes=2)
    data = torch.utils.data.TensorDataset(torch.randn(12, 5, 3), torch.randint(2, (12,)))
    order = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=order)
    params = [p.detach().clone() for p in model.parameters()]
    rng, loader_rng = torch.get_rng_state(), order.get_state()
    backwards = []
    model.head.weight.register_hook(lambda g: backwards.append(g.clone()))
    train.prime(model, loader, torch.device("cpu"))
    assert len(backwards) == 1 and backwards[0].abs().sum() > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(order.get_state(), loader_rng)


def test_evaluation_records_no_graph_and_scores_as_the_training_forward_does() -> None:
    """Evaluation differentiates nothing: the model runs with autograd off, in eval mode, and its
    loss and accuracy are those of a recorded forward in eval mode; training mode comes back."""
    torch.manual_seed(0)
    model = train.Classifier(GRU(3, 4, num_layers=2, dropout=0.5, batch_first=True), classes=3)
    data = torch.utils.data.TensorDataset(torch.randn(10, 6, 3), torch.randint(3, (10,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    modes = []
    model.head.register_forward_hook(lambda m, i, o: modes.append((torch.is_grad_enabled(), m.training)))
    loss, accuracy = train.evaluate(model, loader, torch.device("cpu"))
    assert modes == [(False, False)] * 3 and model.training
    model.eval()
    logits = model(data.tensors[0])
    assert logits.requires_grad  # the reference is the recorded forward
    expected = torch.nn.functional.cross_entropy(logits, data.tensors[1]).item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert accuracy == (logits.argmax(-1) == data.tensors[1]).float().mean().item()


def test_the_load_meter_sees_other_work_and_flags_the_timings() -> None:
    from experiments.hardware import LoadMeter, contended

    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.2)
        meter = LoadMeter()
        time.sleep(1.0)
        other = meter.other_cores()
    finally:
        busy.kill()
        busy.wait()
    assert other is not None and other > 0.6  # the busy process kept (most of) a core
    assert contended(1.0, threads=2, cores=2) and not contended(1.0, threads=1, cores=2)
    assert not contended(None, threads=2, cores=2)


def test_every_option_of_every_group_extends_its_schema() -> None:
    for group, options in schema.OPTIONS.items():
        assert sorted(options) == sorted(p.stem for p in (CONF / group).glob("*.yaml")), group
        for option in options:
            cfg = composed(f"{group}={option}", *(["dataset.root=/x"] if option == "irmas" else []))
            assert OmegaConf.get_type(cfg[group]) is options[option], (group, option)


def test_the_configured_objects_are_built_from_their_targets() -> None:
    cfg = composed("model=gru", "optimizer=sgd", "optimizer.lr=0.5", "backward=bptt")
    layer = build(cfg.model, input_size=3, batch_first=True, **runner.backward_options(cfg))
    assert isinstance(layer, GRU) and layer.backward_mode == "bptt" and layer.hidden_size == 20
    optimizer = build(cfg.optimizer, params=layer.parameters())
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == 0.5
    data = build(composed("dataset.seq_len=7").dataset)
    assert (data.name, data.classes, data.seq_len) == ("bitstream", 10, 7)
    with pytest.raises(ValueError, match="num_samples must be a positive integer, got 0"):
        build(composed("dataset.num_samples=0").dataset).loaders(4)  # the target's own error
    assert (
        type(build(composed("logger=csv").logger, run_dir=".", group="g", name="n", config={})) is LocalLogger
    )


def test_slurm_launcher_composes_without_a_cluster() -> None:
    cfg = composed("hydra/launcher=slurm", "hydra.launcher.partition=gpu", hydra=True)
    launcher = cfg.hydra.launcher
    assert "submitit" in launcher._target_ and launcher.gpus_per_node == 1
    assert launcher.partition == "gpu" and launcher.timeout_min > 0


def test_the_slurm_launcher_off_a_cluster_is_refused_in_one_line_before_any_folder(tmp_path: Path) -> None:
    """Without srun on the PATH, submitit would raise inside the launcher (a traceback, and the
    sweep's multirun.yaml left behind); the sweep is refused first. With srun there, it is let through."""
    from experiments.callbacks import _check_launcher

    nothing = tmp_path / "bin"
    nothing.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    done = run_py("-m", "experiment=workers", "hydra/launcher=slurm", cwd=work, env={"PATH": str(nothing)})
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "run.py: error: hydra/launcher=slurm submits to a SLURM cluster, but srun is not on the PATH "
        "here; accepted: a machine of the cluster (its login node), or no hydra/launcher to run the "
        "sweep on this machine"
    )
    assert not any(work.iterdir())
    srun = nothing / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", str(nothing))
        _check_launcher(composed("hydra/launcher=slurm", hydra=True))


@pytest.mark.extended
def test_a_sweep_over_one_missing_or_empty_irmas_root_is_refused_once_before_any_job(tmp_path: Path) -> None:
    """The README's IRMAS sweep with a bad root: one line and status 2 instead of 18 failed jobs, no
    folder made. A sweep that varies the root or the dataset, or goes to SLURM, is left to its jobs."""
    from experiments.callbacks import _check_irmas_root

    empty = tmp_path / "empty"
    empty.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    missing = tmp_path / "missing"
    for root, why in [
        (missing, f"IRMAS root '{missing}' does not exist or is not a folder; expected"),
        (empty, f"IRMAS root '{empty}' holds no class folder with .wav clips; expected"),
        (None, "dataset.root is required (pass dataset.root=<folder>); accepted: "),
    ]:
        given = [] if root is None else [f"dataset.root={root}"]
        done = run_py("-m", "experiment=gru_irmas", *given, cwd=work)
        assert done.returncode == 2
        assert done.stderr.strip().startswith(f"run.py: error: {why}")
        assert len(done.stderr.strip().splitlines()) == 1
        assert not any(work.iterdir())
    cfg = composed("experiment=gru_irmas", f"dataset.root={empty}", hydra=True)
    with pytest.raises(HydraException, match="holds no class folder"):
        _check_irmas_root(cfg)
    for swept in (f"dataset.root={empty},{tmp_path}", "dataset=irmas,bitstream"):
        cfg.hydra.overrides.task = [swept]
        _check_irmas_root(cfg)  # the jobs say it, each for its own root
    # SLURM's jobs may see a root this machine does not
    _check_irmas_root(
        composed("experiment=gru_irmas", f"dataset.root={empty}", "hydra/launcher=slurm", hydra=True)
    )


@pytest.mark.parametrize(
    ("task", "line"),
    extended_except(
        [
            (["trainer.epochs=1,0"], "trainer.epochs must be a positive integer, got 0"),
            (["dataset.seq_len=10,abc"], "dataset.seq_len must be a positive integer, got 'abc'"),
            (["model=rnn,elman"], "unknown model 'elman'; accepted: gru, lstm, rnn"),
            (["experiment=rnn_seq_len", "dataset.num_samples=1"], "dataset.num_samples=1 with "),
            (["optimizer.lr=0.1,${oops}"], None),  # each job resolves its own, and reports it
            (["experiment=gru_irmas"], "dataset.root is required (pass dataset.root=<folder>); accepted: "),
            (["experiment=gru_irmas", "hydra/launcher=slurm"], "dataset.root is required (pass "),
            (["dataset=irmas", "dataset.root=/a,/b"], None),  # each job's root, each job's to read
            (["experiment=gru_irmas", "dataset=irmas,bitstream"], "dataset.root is required (pass "),
            (["experiment=gru_irmas", "dataset.root=/a,/b"], None),  # the preset's 36 jobs: seconds
            *[(preset_args(preset), None) for preset in PRESETS],  # each composes a sweep's jobs: seconds
        ],
        first=9,
    ),
)
def test_a_sweep_one_of_whose_jobs_holds_a_bad_value_is_refused_before_it_writes(task, line) -> None:
    """Every job composed and checked before Hydra's sweeper writes the sweep's multirun.yaml: a bad
    value in any job (IRMAS's root not given included) refuses the sweep with a single run's line;
    the presets pass."""
    from hydra import compose, initialize_config_dir

    from experiments.callbacks import _check_jobs

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[o for o in task if "," not in o], return_hydra_config=True)
        cfg.hydra.overrides.task = task
        if line is None:
            _check_jobs(cfg)
            return
        with pytest.raises(HydraException) as refused:
            _check_jobs(cfg)
    assert str(refused.value).startswith(line)


def test_the_default_job_runs_and_records(tmp_path: Path) -> None:
    run_dir, site = tmp_path / "run", tmp_path / "site"
    site.mkdir()  # a sitecustomize that says, as the run ends, whether it imported W&B
    imported = tmp_path / "imported"
    (site / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        f"atexit.register(lambda: open({str(imported)!r}, 'w').write(str('wandb' in sys.modules)))\n"
    )
    env = {"PYTHONPATH": os.pathsep.join((str(site), str(ROOT)))}
    done = run_py(*TINY, "logger=none", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert imported.read_text() == "False"  # logger=none never imports W&B, the versions recorded included
    assert "rnn on bitstream, T=8, B=16, backward=bppsa" in done.stdout
    assert "bwd ms" in done.stdout and "status completed" in done.stdout
    records = pd.read_csv(run_dir / "records.csv")
    assert records["epoch"].tolist() == [1, 2]
    assert {"forward_s", "backward_s", "step_s", "loss", "accuracy", "samples_per_s", "device_name"} <= set(
        records.columns
    )
    assert records["timed_iterations"].sum() == records["iterations"].sum() - 1  # one warm-up iteration
    assert (records["backward_s"] > 0).all()
    assert records["threads_used"].tolist() == [1, 1]  # one thread unless hardware.workers says more
    assert records["capture"].tolist() == [False, False] and records["accuracy"].between(0, 1).all()
    assert {"other_load", "contended", "initial_loss", "cpu_cores"} <= set(records.columns)
    assert (
        records["initial_loss"].nunique() == 1 and records["initial_loss"].iloc[0] > records["loss"].iloc[-1]
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]  # printed as they finish
    assert "per iteration forward" in lines[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["dataset"]["seq_len"] == 8
    assert {"commit", "dirty"} <= set(summary["git"]) and summary["versions"]["torch"] == torch.__version__
    # every row names the code that made it, as the summary does (a merged table keeps it)
    assert records["commit"].tolist() == [summary["git"]["commit"]] * 2
    assert records["torch"].tolist() == [torch.__version__] * 2
    assert summary["device"]["device_type"] == "cpu" and summary["totals"]["epochs"] == 2
    assert not (ROOT / "outputs").exists() or not any((ROOT / "outputs").rglob(run_dir.name))


def test_a_captured_run_records_what_the_eager_run_of_its_configuration_does(
    tmp_path: Path, monkeypatch, cuda_stood_in_for
) -> None:
    """``trainer.capture=true`` through the runner, CUDA's graphs stood in for on a CPU: Adam is made
    capturable, each batch shape's step captured once before the first epoch, and the run records
    the eager run's losses and accuracies, as another configuration that says it was captured."""
    monkeypatch.setattr(runner, "check_capture", lambda *args: None)
    flags = []

    def capture_steps(model, optimizer, loader, device):
        flags.append([group["capturable"] for group in optimizer.param_groups])
        for group in optimizer.param_groups:
            group["capturable"] = False  # a CPU's Adam
        return train.capture_steps(model, optimizer, loader, device)

    monkeypatch.setattr(runner, "capture_steps", capture_steps)
    eager = runner.run_job(composed(*TINY, "logger=none"), tmp_path / "eager")
    captured = runner.run_job(composed(*TINY, "logger=none", "trainer.capture=true"), tmp_path / "captured")
    assert eager.status == captured.status == "completed" and flags == [[True]]
    assert cuda_stood_in_for.count("capture _forward") == 2  # 51 samples to train: 3 batches of 16, one of 3
    assert cuda_stood_in_for.count("_forward") == 8  # every batch of both epochs replayed
    a, b = (pd.read_csv(tmp_path / run / "records.csv") for run in ("eager", "captured"))
    assert a["capture"].tolist() == [False, False] and b["capture"].tolist() == [True, True]
    assert (a["config_hash"] != b["config_hash"]).all() and a["accuracy"].tolist() == b["accuracy"].tolist()
    assert b["loss"].tolist() == pytest.approx(a["loss"].tolist(), rel=1e-6)
    assert b["test_loss"].tolist() == pytest.approx(a["test_loss"].tolist(), rel=1e-6)


@pytest.mark.skipif(not denormals.available(), reason="flush-to-zero cannot be set here")
def test_a_flushed_run_takes_every_step_flushed_and_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    """``hardware.flush_denormals=true`` with BPTT: autograd's backward and the forward run with
    flush-to-zero set (a float32 subnormal doubled reads zero there), the mode is the default again
    after the run, and the records and the run's line say so; false leaves the default mode."""
    seen: list[tuple[str, float]] = []
    plain = train._forward

    def subnormal() -> float:
        return (torch.tensor([1e-39]) * 2).item()  # 2e-39 in the default mode, 0 flushed

    def forward(model, x, y):
        logits, loss = plain(model, x, y)
        seen.append(("forward", subnormal()))
        logits.register_hook(lambda grad: seen.append(("backward", subnormal())))
        return logits, loss

    monkeypatch.setattr(train, "_forward", forward)
    base = (*TINY, "logger=none", "backward=bptt")
    flushed = runner.run_job(composed(*base, "hardware.flush_denormals=true"), tmp_path / "flushed")
    assert flushed.status == "completed" and subnormal() > 0
    assert {phase for phase, _ in seen} == {"forward", "backward"} and {value for _, value in seen} == {0.0}
    seen.clear()
    default = runner.run_job(composed(*base), tmp_path / "default")
    assert default.status == "completed" and seen and all(value > 0 for _, value in seen)
    a, b = (pd.read_csv(tmp_path / run / "records.csv") for run in ("default", "flushed"))
    assert a["flush_denormals"].tolist() == [False, False] and b["flush_denormals"].tolist() == [True, True]
    assert (a["config_hash"] != b["config_hash"]).all() and (a["comparison_key"] != b["comparison_key"]).all()
    capsys.readouterr()
    for run in ("flushed", "default"):
        print_summary(tmp_path / run)
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rnn on bitstream")]
    assert heads[0].endswith(", subnormals flushed") and not heads[1].endswith("flushed")


def test_flushing_is_refused_where_a_cpus_threads_cannot_be_set(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(denormals, "available", lambda: False)
    asked = composed(*TINY, "logger=none", "hardware.flush_denormals=true")
    outcome = runner.run_job(asked, tmp_path / "run")
    assert outcome.status == "failed" and outcome.bad_input
    assert outcome.error.startswith("hardware.flush_denormals=true needs flush-to-zero set in every thread")
    assert outcome.error.endswith("; accepted here: hardware.flush_denormals=false")
    assert not (tmp_path / "run").exists()


@pytest.mark.extended
def test_a_newton_forward_runs_and_records_its_iterations(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_py(
        *TINY, "logger=none", "model.forward_solver=newton", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "forward=newton" in done.stdout and "newton its" in done.stdout
    assert "Newton " in done.stdout and " iterations per layer, 0 fallbacks" in done.stdout
    records = pd.read_csv(run_dir / "records.csv")
    assert records["forward_solver"].tolist() == ["newton", "newton"]
    # T = 8: at least one iteration, at most T + 1 (after k iterations the first k states are exact)
    assert records["newton_iterations"].between(1, 9).all() and (records["newton_fallbacks"] == 0).all()


def test_a_newton_run_is_compared_with_the_bptt_run_of_its_configuration() -> None:
    """The forward solver is a BPPSA variant, like the scan strategy: it leaves the comparison key alone."""
    from experiments import records

    def key(*overrides: str) -> str:
        return records.comparison_key(OmegaConf.to_container(composed(*overrides)))

    bptt = key("backward=bptt")
    assert (
        key("model.forward_solver=newton", "model.newton_iters=7") == bptt == key("backward.strategy=chunked")
    )
    assert key("backward=bptt", "model.hidden_size=21") != bptt


def test_a_sweep_merges_its_jobs_and_skips_them_when_rerun(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "logger=csv", "backward=bppsa,bptt", f"hydra.sweep.dir={sweep}"]
    first = run_py(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    merged = pd.read_csv(sweep / "records.csv")
    assert sorted(merged["backward"].unique()) == ["bppsa", "bptt"] and len(merged) == 4
    jobs = pd.read_csv(sweep / "jobs.csv")
    assert jobs["status"].tolist() == ["completed", "completed"]
    started = {p: json.loads(p.read_text())["started"] for p in sweep.glob("*/summary.json")}
    second = run_py(*args, cwd=tmp_path)
    assert second.returncode == 0 and "skipping" in second.stdout + second.stderr
    assert {p: json.loads(p.read_text())["started"] for p in sweep.glob("*/summary.json")} == started
    assert len(pd.read_csv(sweep / "records.csv")) == 4


@pytest.mark.extended
def test_a_failed_job_is_recorded_and_the_others_kept(tmp_path: Path) -> None:
    """A job refused where it runs (a device this machine lacks: no configuration check can know)
    is recorded with its line and leaves no folder; the other job completes and is merged. A value
    out of range refuses the whole sweep before it writes anything."""
    sweep = tmp_path / "sweep"
    base = ["-m", *TINY, "logger=csv", f"hydra.sweep.dir={sweep}"]
    out_of_range = run_py(*base, "trainer.epochs=2,0", cwd=tmp_path)
    assert out_of_range.returncode == 2 and not sweep.exists()
    assert out_of_range.stderr.strip() == "run.py: error: trainer.epochs must be a positive integer, got 0"
    if torch.cuda.is_available():
        pytest.skip("every device asked for is here")
    done = run_py(*base, "hardware.device=cpu,cuda", cwd=tmp_path)
    assert done.returncode == 1
    assert "1 of 2 jobs completed" in done.stdout
    jobs = pd.read_csv(sweep / "jobs.csv").set_index("run")
    assert sorted(jobs["outcome"]) == ["completed", "failed"]
    refused = jobs[jobs["outcome"] == "failed"].iloc[0]
    assert "hardware.device 'cuda' asked for, but CUDA is not available here" in refused["error"]
    assert pd.isna(refused["status"]) and not (sweep / refused.name).exists()  # refused: no folder
    assert pd.read_csv(sweep / "records.csv")["seq_len"].unique().tolist() == [8]


@pytest.mark.extended
def test_resume_continues_a_killed_run_without_duplicate_rows(tmp_path: Path) -> None:
    """Killed once it has finished an epoch (however long that takes), resumed: the same rows."""
    run_dir = tmp_path / "run"
    args = ["dataset.seq_len=50", "dataset.num_samples=400", "trainer.epochs=30", "logger=csv"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while records_of(run_dir) is None:  # written whole before the checkpoint: no deadline to miss
        assert proc.poll() is None, "the run ended before it finished an epoch"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = pd.read_csv(run_dir / "records.csv")
    assert 1 <= len(killed) < 30  # killed before the end
    done = run_py(*args, "trainer.resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = pd.read_csv(run_dir / "records.csv")
    assert rows["epoch"].tolist() == list(range(1, 31))
    assert rows.loc[: len(killed) - 1, "loss"].tolist() == killed["loss"].tolist()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def records_of(run_dir: Path) -> pd.DataFrame | None:
    from experiments.records import read_table

    return read_table(run_dir / "records.csv")


@pytest.mark.extended
@pytest.mark.parametrize(
    ("sent", "status", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_or_sigterm_says_in_one_line_what_was_kept_and_how_to_go_on(
    tmp_path: Path, sent, status, said
) -> None:
    """Ctrl-C, and SIGTERM (what SLURM sends first), stop a run after recording what it finished."""
    run_dir = tmp_path / "run"
    args = ["dataset.seq_len=50", "dataset.num_samples=400", "trainer.epochs=1000", "logger=csv"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    while records_of(run_dir) is None:
        assert proc.poll() is None, "the run ended before it finished an epoch"
        time.sleep(0.05)
    proc.send_signal(sent)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == status
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"run.py: {said} after epoch "), lines
    assert f"kept in {run_dir}: records.csv, checkpoint.pt" in lines[0]
    command = lines[0].split("to continue: python run.py ")[1]
    assert command.endswith(f"trainer.resume=true hydra.run.dir={run_dir}")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    kept = len(pd.read_csv(run_dir / "records.csv"))
    resumed = run_py(
        *command.replace("trainer.epochs=1000", f"trainer.epochs={kept + 1}").split(), cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert pd.read_csv(run_dir / "records.csv")["epoch"].tolist() == list(range(1, kept + 2))


def test_a_run_out_of_memory_before_it_begins_is_recorded_failed_without_a_traceback(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    done = tmp_path / "done"
    assert runner.run_job(composed(*TINY, "logger=none"), done).status == "completed"
    before = (done / "summary.json").read_bytes()

    def too_large(*args, **kwargs):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 360000000000 bytes"
        )

    monkeypatch.setattr(runner, "Classifier", too_large)
    outcome = runner.run_job(composed(*TINY, "logger=none"), tmp_path / "run")
    assert outcome.status == "failed" and not outcome.bad_input and "can't allocate memory" in outcome.error
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == outcome.error
    assert "run failed" not in caplog.text  # a size too large for the machine is not a bug to trace
    # resuming an earlier run: that run's summary is left as it was
    more = composed(*TINY, "logger=none", "trainer.epochs=3", "trainer.resume=true")
    assert runner.run_job(more, done).status == "failed"
    assert (done / "summary.json").read_bytes() == before


def test_a_nan_loss_stops_the_run_and_records_it_failed(tmp_path: Path, monkeypatch) -> None:
    real = train.F.cross_entropy
    monkeypatch.setattr(train.F, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan"))
    cfg = composed(*TINY, "logger=none")
    outcome = runner.run_job(cfg, tmp_path)
    assert outcome.status == "failed" and not outcome.bad_input
    assert "training loss became nan at epoch 1, iteration 1" in outcome.error
    assert f"try an optimizer.lr below {cfg.optimizer.lr:g}" in outcome.error
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "loss became nan" in summary["error"]
    assert not (tmp_path / "records.csv").exists()  # no epoch finished


def test_a_non_finite_test_loss_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    """A test loss that is not finite (features with NaN, a diverged model) is no result: the run
    is recorded failed, and that epoch not kept."""
    real, calls = runner.evaluate, []

    def nan_on_test(model, loader, device):
        calls.append(loader)
        loss, accuracy = real(model, loader, device)
        return (float("nan"), accuracy) if len(calls) > 1 else (loss, accuracy)  # the first: t = 0

    monkeypatch.setattr(runner, "evaluate", nan_on_test)
    outcome = runner.run_job(composed(*TINY, "logger=none"), tmp_path)
    assert outcome.status == "failed" and not outcome.bad_input
    assert "test loss became nan at epoch 1" in outcome.error
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "records.csv").exists()


def test_a_run_out_of_memory_fails_in_one_line_naming_the_sizes(tmp_path: Path, monkeypatch) -> None:
    """Memory that runs out is a size too large for the machine: the line says so and which sizes to
    make smaller, with the allocator's own words, not an error type to debug."""
    said = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 25600000000 bytes."

    def too_large(*args, **kwargs):
        raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {said}")

    monkeypatch.setattr(runner, "evaluate", too_large)
    outcome = runner.run_job(composed(*TINY, "logger=none"), tmp_path)
    assert outcome.status == "failed" and not outcome.bad_input
    assert outcome.error.startswith("out of memory: [enforce fail at alloc_cpu.cpp:127] err == 0. ")
    assert outcome.error.endswith(f"{said}; accepted: {runner.SMALLER}")
    assert json.loads((tmp_path / "summary.json").read_text())["error"] == outcome.error


LR = "a finite positive number a float32 holds (at most 3.4e+38)"
# Bad input and the one line it fails with; the default run takes the first three, .ci/run all.
BAD_INPUT = [
    (["model=elman"], "unknown model 'elman'; accepted: gru, lstm, rnn"),
    (["dataset=mnist"], "unknown dataset 'mnist'; accepted: bitstream, irmas"),
    (["dataset.seq_len=0"], "dataset.seq_len must be a positive integer, got 0"),
    (["trainer.batch_size=-4"], "trainer.batch_size must be a positive integer, got -4"),
    (["trainer.batch_size=abc"], "trainer.batch_size must be a positive integer, got 'abc'"),
    (["dataset=irmas"], "dataset.root is required"),
    (["dataset=irmas", "dataset.root=/no/such/irmas"], "IRMAS root '/no/such/irmas' does not exist"),
    (["hardware.device=tpu"], "unknown hardware.device 'tpu'; accepted: auto, cpu, cuda"),
    (["hardware.workers=999"], "hardware.workers=999 is more than the "),
    (["hardware.data_workers=999"], "hardware.data_workers=999 is more than the "),
    (["model=rnn", "-m"], "unrecognized arguments: logger=csv hydra.run.dir="),
    (["model=rnn", "-m"], "; accepted: flags such as -m before the key=value overrides"),
    (["--cfg", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
    (["name=ü"], "cannot read the override 'name=ü'; accepted: key=value, a value of ASCII letters"),
    (["model=["], "cannot read the override 'model=['"),
    (["~model"], "model is required; accepted: gru, lstm, rnn"),
    (["model=rnn,gru"], "'model=rnn,gru' lists several values; accepted: -m before the overrides to sweep"),
    (["trainer.foo=1"], "unknown key trainer.foo; accepted: epochs, batch_size, warmup_iters"),
    (["foo=1"], "unknown key foo; accepted: name, model, dataset, backward, optimizer, trainer, logger"),
    (["trainer.epochs=1e26"], "trainer.epochs must be a positive integer, got 1e+26"),
    (["optimizer.lr=fast"], f"optimizer.lr must be {LR}, got 'fast'"),
    (["optimizer.lr=inf"], f"optimizer.lr must be {LR}, got inf"),
    (["optimizer=sgd", "optimizer.lr=1e308"], f"optimizer.lr must be {LR}, got 1e+308"),
    (["+foo=1"], "unknown key foo; accepted: name, model, dataset, backward, optimizer, trainer, logger"),
    (["+trainer.foo=1"], "unknown key trainer.foo; accepted: epochs, batch_size, warmup_iters"),
    (["dataset.num_samples=9223372036854775807"], "GiB to shuffle its training split, more than the "),
    (["optimizer=adamw"], "unknown optimizer 'adamw'; accepted: adam, sgd"),
    (
        ["model.forward_solver=jacobi"],
        "model.forward_solver must be one of native, newton, quasi-newton, got 'jacobi'",
    ),
    (
        ["backward=bptt", "model.forward_solver=newton"],
        "model.forward_solver=newton needs backward=bppsa; accepted with backward=bptt: "
        "model.forward_solver=native",
    ),
    (["model.newton_iters=0"], "model.newton_iters must be a positive integer, got 0"),
    (["model.newton_tol=2"], "model.newton_tol must be a number strictly between 0 and 1 or null, got 2"),
    (["model="], "unknown model ''; accepted: gru, lstm, rnn"),
    (["hydra/launcher=nope"], "unknown hydra/launcher 'nope'; accepted: basic"),
    (["--config-name=nope"], "unknown config 'nope'; accepted: config"),
    (
        ["hardware.device=cpu", "backward.strategy=graph"],
        "backward.strategy='graph' needs a CUDA device, and this device is cpu; accepted here: auto",
    ),
    (
        ["hardware.device=cpu", "trainer.capture=true"],
        "trainer.capture=true needs a CUDA device, and this run's is cpu (hardware.device=cpu); accepted: "
        "hardware.device=cuda (or auto) on a machine with a GPU, or trainer.capture=false",
    ),
    (["trainer.capture=maybe"], "trainer.capture must be true or false, got 'maybe'"),
    (["hardware.flush_denormals=on2"], "hardware.flush_denormals must be true or false, got 'on2'"),
    (["backward.exchange=ring"], "backward.exchange must be one of auto, allgather, chain, got 'ring'"),
    (
        ["trainer.capture=true", "model=lstm", "model.forward_solver=newton"],
        "model.forward_solver=newton needs the host during the step, which trainer.capture=true replays "
        "without it; accepted with trainer.capture=true: model.forward_solver=native",
    ),
    (
        ["trainer.capture=true", "model.forward_solver=quasi-newton"],
        "accepted with trainer.capture=true: model.forward_solver=native or newton",
    ),
    (
        ["trainer.capture=true", "hardware.ranks=2"],
        "trainer.capture=true is not taken on 2 ranks (the ranks' exchanges are not captured); accepted: "
        "trainer.capture=false, or hardware.ranks=1",
    ),
]


@pytest.mark.parametrize(("args", "message"), extended_except(BAD_INPUT, first=1))
def test_bad_input_fails_in_one_line_and_leaves_no_files(tmp_path: Path, args, message: str) -> None:
    run_dir = tmp_path / "run"
    done = run_py(*args, "logger=csv", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.py: error: ") and message in lines[0]
    assert not run_dir.exists()


@pytest.mark.extended
def test_a_refusal_leaves_the_users_own_folder_as_it_was(tmp_path: Path) -> None:
    empty, kept = tmp_path / "empty", tmp_path / "kept"
    empty.mkdir()
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for folder in (empty, kept):
        done = run_py("dataset.seq_len=0", "logger=csv", f"hydra.run.dir={folder}", cwd=tmp_path)
        assert done.returncode == 2 and "dataset.seq_len must be a positive integer" in done.stderr
    assert empty.is_dir() and not any(empty.iterdir())  # not removed, nothing added
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    # Parents made for the run folder go with it; those that stood before stay, empty or not.
    done = run_py("dataset.seq_len=0", "logger=csv", f"hydra.run.dir={empty}/a/b/c", cwd=tmp_path)
    assert done.returncode == 2 and empty.is_dir() and not any(empty.iterdir())


@pytest.mark.extended
def test_a_refusal_in_the_default_folders_leaves_no_empty_folders_behind(tmp_path: Path) -> None:
    for args in (["dataset.seq_len=0"], ["-m", "model=rnn,elman"]):
        done = run_py(*args, "logger=csv", cwd=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # no outputs/main/, no multirun/main/
    (tmp_path / "outputs" / "main").mkdir(parents=True)  # made by the user: it stays
    assert run_py("dataset.seq_len=0", "logger=csv", cwd=tmp_path).returncode == 2
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "outputs",
        "outputs/main",
    ]


def test_a_sweep_refused_whole_leaves_no_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = run_py("-m", "model=rnn,elman", "logger=csv", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "run.py: error: unknown model 'elman'; accepted: gru, lstm, rnn"
    ]
    assert not sweep.exists()


@pytest.mark.extended
def test_an_empty_irmas_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "irmas").mkdir()
    done = run_py(
        "dataset=irmas",
        f"dataset.root={tmp_path / 'irmas'}",
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "holds no class folder with .wav clips" in done.stderr


@pytest.mark.extended
def test_gru_on_irmas_trains_from_a_generated_tree(tmp_path: Path) -> None:
    from helpers import write_tree

    tree = write_tree(tmp_path / "IRMAS-TrainingData", per_class=1)
    run_dir = tmp_path / "run"
    done = run_py(
        "model=gru",
        "dataset=irmas",
        f"dataset.root={tree}",
        "dataset.frames=l",
        f"dataset.cache_dir={tmp_path / 'cache'}",
        "trainer.epochs=1",
        "trainer.batch_size=4",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "gru on irmas, T=1034, B=4, backward=bppsa" in done.stdout
    records = pd.read_csv(run_dir / "records.csv")
    assert records[["seq_len", "features", "frames"]].iloc[0].tolist() == [1034, 12, "l"]


@pytest.mark.extended
def test_wandb_runs_offline_in_the_run_folder_with_one_cpu_thread(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY, "hardware.workers=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={**env_free, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1  # the default logger: W&B, offline, no network
    records = pd.read_csv(run_dir / "records.csv")
    assert records["threads_used"].tolist() == [1, 1]
