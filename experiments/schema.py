"""The configuration's schema: the type and the accepted values of every key of ``conf/``.

Each option of a config group extends one dataclass here (its defaults list starts with
``/schema/<group>/<option>@_here_``), and ``conf/config.yaml`` extends ``Config``. So Hydra refuses a
value of the wrong type or an unknown key while it composes the configuration, and
``experiments.config.check`` refuses a value out of range before a run writes anything. A field's
``metadata`` is its rule: a test and the words for what it accepts, which every message about that
key uses. Values live in the YAML files; defaults here are ``MISSING`` (``???``) so nothing is said
twice.

Importing this module registers the schemas and the resolvers the config files use (``register``).
The nodes with a ``_target_`` are built with Hydra's ``instantiate`` (``experiments.config.build``):
the recurrent layer (``bppsa_core.RNN`` / ``GRU`` / ``LSTM``), the dataset (``datasets.bitstream.Bitstream``,
``datasets.irmas.IRMAS``), the optimizer (``torch.optim``) and the run logger.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from bppsa_core.dispatch import STRATEGIES
from bppsa_core.distributed import EXCHANGES
from bppsa_core.newton import SOLVERS
from bppsa_core.nn import GUESSES
from experiments.hardware import worker_counts
from experiments.records import job_folder, sweep_folder
from toolbox.cli import SEEDS, is_count, is_seed


@dataclass(frozen=True)
class Rule:
    """What a key accepts: ``ok(value)``, said in words as ``what``; ``hint`` helps a missing value."""

    ok: Callable[[Any], bool]
    what: str
    hint: str = ""


def checked(rule: Rule, default: Any = MISSING) -> Any:
    """A dataclass field whose values ``rule`` checks."""
    return field(default=default, metadata={"rule": rule})


def one_of(*options: Any) -> Rule:
    return Rule(lambda v: v in options, "one of " + ", ".join(str(o) for o in options))


def or_null(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.ok(v), f"{rule.what} or null")


POSITIVE_INT = Rule(lambda v: is_count(v, 1), "a positive integer")
NON_NEGATIVE_INT = Rule(lambda v: is_count(v, 0), "a non-negative integer")
POSITIVE_NUMBER = Rule(  # inf is no learning rate: its first step makes the loss nan
    lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf,
    "a finite positive number",
)
# A learning rate multiplies float32 gradients: one beyond float32's range cannot be applied at all.
LEARNING_RATE = Rule(
    lambda v: POSITIVE_NUMBER.ok(v) and v <= 3.4028234663852886e38,
    "a finite positive number a float32 holds (at most 3.4e+38)",
)
FRACTION = Rule(lambda v: isinstance(v, int | float) and 0 < v < 1, "a number strictly between 0 and 1")
NON_EMPTY = Rule(lambda v: isinstance(v, str) and bool(v), "a non-empty string")
# The epoch's shuffle seed is seed * 1,000,003 + epoch.
SEED = Rule(is_seed, SEEDS)
NAME = Rule(  # at least one letter, digit or '_': "." and ".." would name the folders above
    lambda v: isinstance(v, str) and re.fullmatch(r"[\w.-]*\w[\w.-]*", v, re.ASCII) is not None,
    "a name of letters, digits, '.', '_' and '-', with at least one letter, digit or '_'",
)
BOOL = Rule(lambda v: isinstance(v, bool), "true or false")


# --------------------------------------------------------------------------------------------- model


@dataclass
class GRUModel:
    """``bppsa_core.GRU`` or ``bppsa_core.LSTM`` (torch.nn's arguments, and how the forward is
    solved: ``conf/forward/solver.yaml``); the input size comes from the data."""

    _target_: str = MISSING
    hidden_size: int = checked(POSITIVE_INT)
    num_layers: int = checked(POSITIVE_INT)
    forward_solver: str = checked(one_of(*SOLVERS))
    newton_tol: float | None = checked(
        or_null(Rule(lambda v: POSITIVE_NUMBER.ok(v) and v < 1, "a number strictly between 0 and 1"))
    )
    newton_iters: int = checked(POSITIVE_INT)
    newton_guess: str = checked(one_of(*GUESSES))


@dataclass
class RNNModel(GRUModel):
    """``bppsa_core.RNN``: ``GRUModel``'s keys and the nonlinearity."""

    nonlinearity: str = checked(one_of("tanh", "relu"))


# ------------------------------------------------------------------------------------------- dataset


@dataclass
class BitstreamData:
    """``datasets.bitstream.Bitstream``."""

    _target_: str = MISSING
    seq_len: int = checked(POSITIVE_INT)
    num_samples: int = checked(POSITIVE_INT)
    train_fraction: float = checked(FRACTION)
    seed: int = checked(SEED)

    @staticmethod
    def together(node: Any) -> str | None:
        """Both splits must hold a sample."""
        train = round(node.num_samples * node.train_fraction)
        if 0 < train < node.num_samples:
            return None
        empty = "training" if train == 0 else "test"
        return (
            f"dataset.num_samples={node.num_samples} with dataset.train_fraction={node.train_fraction} "
            f"leaves the {empty} split empty; accepted: num_samples x train_fraction rounding to "
            f"1 .. num_samples - 1"
        )


@dataclass
class IRMASData:
    """``datasets.irmas.IRMAS``."""

    _target_: str = MISSING
    root: str = checked(
        Rule(NON_EMPTY.ok, "the path of your IRMAS training folder", " (pass dataset.root=<folder>)")
    )
    frames: str = checked(one_of("s", "m", "l"))
    cache_dir: str | None = checked(or_null(NON_EMPTY))
    train_fraction: float = checked(FRACTION)
    seed: int = checked(SEED)


# ------------------------------------------------------------------------------ backward and training


@dataclass
class BPPSABackward:
    """The backward as a scan: ``bppsa_core.dispatch.ScanOptions``."""

    mode: str = checked(one_of("bppsa"))
    strategy: str = checked(one_of(*STRATEGIES))
    chunk: int | None = checked(or_null(POSITIVE_INT))
    levels: int | None = checked(or_null(NON_NEGATIVE_INT))
    exchange: str = checked(one_of(*EXCHANGES))


@dataclass
class BPTTBackward:
    """PyTorch's own backward: no options."""

    mode: str = checked(one_of("bptt"))


@dataclass
class Optimizer:
    """A ``torch.optim`` optimizer; the parameters come from the model."""

    _target_: str = MISSING
    lr: float = checked(LEARNING_RATE)


@dataclass
class Trainer:
    epochs: int = checked(POSITIVE_INT)
    batch_size: int = checked(POSITIVE_INT)
    warmup_iters: int = checked(NON_NEGATIVE_INT)
    seed: int = checked(SEED)
    resume: bool = checked(BOOL)
    eval: bool = checked(BOOL)
    capture: bool = checked(BOOL)


# ---------------------------------------------------------------------------------- logger, hardware


@dataclass
class WandbLogger:
    """``experiments.loggers.WandbLogger``."""

    _target_: str = MISSING
    mode: str = checked(one_of("offline", "online", "disabled"))
    project: str = checked(NON_EMPTY)
    entity: str | None = checked(or_null(NON_EMPTY))


@dataclass
class LocalLogger:
    """``experiments.loggers.LocalLogger``: no options."""

    _target_: str = MISSING


@dataclass
class Hardware:
    device: str = checked(Rule(NON_EMPTY.ok, "auto, cpu, cuda or cuda:N"))
    workers: int | None = checked(or_null(POSITIVE_INT))
    ranks: int | None = checked(or_null(POSITIVE_INT))
    data_workers: int = checked(NON_NEGATIVE_INT)
    progress: Any = checked(one_of("auto", True, False))
    flush_denormals: bool = checked(BOOL)
    silent_rank_s: float = checked(POSITIVE_NUMBER)


@dataclass
class Config:
    """The whole configuration; each group's node has the schema of the option chosen."""

    name: str = checked(NAME)
    model: Any = MISSING
    dataset: Any = MISSING
    backward: Any = MISSING
    optimizer: Any = MISSING
    trainer: Any = MISSING
    logger: Any = MISSING
    hardware: Any = MISSING

    @staticmethod
    def together(node: Any) -> str | None:
        """A Newton forward belongs to the BPPSA layer: BPTT runs PyTorch's own forward and backward.
        A captured step replays without the host: quasi-Newton and an LSTM's Newton forward need it."""
        solver = node.model.get("forward_solver", "native")
        if node.backward.mode == "bptt" and solver != "native":
            return (
                f"model.forward_solver={solver} needs backward=bppsa; accepted with backward=bptt: "
                "model.forward_solver=native"
            )
        lstm = str(node.model.get("_target_", "")).endswith("LSTM")
        if node.trainer.get("capture") and (solver == "quasi-newton" or (lstm and solver == "newton")):
            accepted = "native or newton" if not lstm else "native"
            return (
                f"model.forward_solver={solver} needs the host during the step, which trainer.capture=true "
                f"replays without it; accepted with trainer.capture=true: model.forward_solver={accepted}"
            )
        return None


# Group option -> schema. Every YAML option in conf/<group>/ has an entry (a test checks it).
OPTIONS: dict[str, dict[str, type]] = {
    "model": {"rnn": RNNModel, "gru": GRUModel, "lstm": GRUModel},
    "dataset": {"bitstream": BitstreamData, "irmas": IRMASData},
    "backward": {"bppsa": BPPSABackward, "bptt": BPTTBackward},
    "optimizer": {"adam": Optimizer, "sgd": Optimizer},
    "trainer": {"default": Trainer},
    "logger": {"wandb": WandbLogger, "none": WandbLogger, "csv": LocalLogger},
    "hardware": {"default": Hardware},
}


CONF = Path(__file__).resolve().parents[1] / "conf"


def config_groups(conf: Path) -> str:
    """The config groups and their options, and each preset with the first line of its comment
    (``run.py --help``)."""
    lines = []
    for group in sorted(p for p in conf.iterdir() if p.is_dir() and p.name in OPTIONS):
        lines.append(f"  {group.name}: {', '.join(sorted(o.stem for o in group.glob('*.yaml')))}")
    lines.append("\n== Presets: experiment=<name>, with -m ==")
    for preset in sorted((conf / "experiment").glob("*.yaml")):
        text = " ".join(
            line[2:]
            for line in preset.read_text().splitlines()
            if line.startswith("# ") and "@package" not in line
        )
        sentence = text.split(". ")[0].split("  python")[0]
        if len(sentence) > 96:
            sentence = sentence[:95].rsplit(" ", 1)[0] + " …"
        lines.append(f"  {preset.stem:12} {sentence}")
    return "\n".join(lines)


def register() -> None:
    """Store the schemas where the config files' defaults lists find them, and the resolvers the
    config files use (``job_folder``, ``sweep_folder``, ``worker_counts``, ``config_groups``);
    idempotent."""
    OmegaConf.register_new_resolver("job_folder", job_folder, replace=True)
    OmegaConf.register_new_resolver("sweep_folder", sweep_folder, replace=True)
    OmegaConf.register_new_resolver("worker_counts", worker_counts, replace=True)
    OmegaConf.register_new_resolver("config_groups", lambda: config_groups(CONF), replace=True)
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for group, options in OPTIONS.items():
        for option, schema in options.items():
            store.store(group=f"schema/{group}", name=option, node=schema)


register()
