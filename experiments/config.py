"""Checks of the composed configuration: every core key's type and range, said in one line.

``check_group_overrides`` runs before Hydra (an unknown group option would otherwise end in Hydra's
multi-line report); ``validate`` runs on the composed configuration before a run writes anything.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from bppsa_core.dispatch import STRATEGIES

GROUPS = ("model", "dataset", "backward", "trainer", "logger", "hardware", "experiment")


class ConfigError(ValueError):
    """A bad configuration value, said in one line that names the key, the value and what is accepted."""


def check_group_overrides(argv: Sequence[str], conf_dir: Path) -> str | None:
    """The first command-line override naming a group option that has no file, as a message."""
    for arg in argv:
        match = re.fullmatch(r"[+~]{0,2}([a-z_]+)=(.*)", arg)
        if not match or match.group(1) not in GROUPS:
            continue
        group, value = match.groups()
        accepted = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        sweep = re.fullmatch(r"[\w\-]+(,[\w\-]+)*", value)
        for option in value.split(",") if sweep else []:
            if option not in accepted and not (group == "experiment" and option == "null"):
                return f"unknown {group} {option!r}; accepted: {', '.join(accepted)}"
    return None


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_float(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _fraction(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 1


def _one_of(*options: Any) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in options), "one of " + ", ".join(str(o) for o in options)


def _or_null(check: Callable[[Any], bool], what: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or check(v)), f"{what} or null"


POSITIVE_INT = (_positive_int, "a positive integer")
NONNEG_INT = (_nonneg_int, "a non-negative integer")
BOOL = (lambda v: isinstance(v, bool), "true or false")

COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.kind": _one_of("rnn", "gru"),
    "model.hidden_size": POSITIVE_INT,
    "model.num_layers": POSITIVE_INT,
    "model.nonlinearity": _one_of("tanh", "relu"),
    "dataset.kind": _one_of("bitstream", "irmas"),
    "dataset.seed": NONNEG_INT,
    "dataset.train_fraction": (_fraction, "a number strictly between 0 and 1"),
    "backward.mode": _one_of("bppsa", "bptt"),
    "backward.strategy": _one_of(*STRATEGIES),
    "backward.chunk": _or_null(_positive_int, "a positive integer"),
    "backward.levels": _or_null(_nonneg_int, "a non-negative integer"),
    "trainer.epochs": POSITIVE_INT,
    "trainer.batch_size": POSITIVE_INT,
    "trainer.optimizer": _one_of("adam", "sgd"),
    "trainer.lr": (_positive_float, "a positive number"),
    "trainer.warmup_iters": NONNEG_INT,
    "trainer.seed": NONNEG_INT,
    "trainer.resume": BOOL,
    "trainer.eval": BOOL,
    "logger.kind": _one_of("wandb", "csv", "none"),
    "logger.mode": _one_of("offline", "online", "disabled"),
    "hardware.device": (lambda v: isinstance(v, str) and bool(v), "auto, cpu, cuda or cuda:N"),
    "hardware.workers": _or_null(_positive_int, "a positive integer"),
    "hardware.data_workers": NONNEG_INT,
    "hardware.progress": (lambda v: v in ("auto", True, False), "auto, true or false"),
}
BITSTREAM = {"dataset.seq_len": POSITIVE_INT, "dataset.num_samples": POSITIVE_INT}
IRMAS = {
    "dataset.root": (lambda v: isinstance(v, str) and bool(v), "the path of your IRMAS training folder"),
    "dataset.frames": _one_of("s", "m", "l"),
    "dataset.cache_dir": (lambda v: v is None or isinstance(v, str), "a path or null"),
}


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first core key whose value is missing, of the wrong type or out of range."""
    rules = dict(COMMON)
    kind = OmegaConf.select(cfg, "dataset.kind")
    rules.update(BITSTREAM if kind == "bitstream" else IRMAS if kind == "irmas" else {})
    for key, (ok, what) in rules.items():
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=True, default=_ABSENT)
        except MissingMandatoryValue:
            hint = " (pass dataset.root=<folder>)" if key == "dataset.root" else ""
            raise ConfigError(f"{key} is required{hint}; accepted: {what}") from None
        if value is _ABSENT:
            raise ConfigError(f"{key} is missing from the configuration; accepted: {what}")
        if not ok(value):
            raise ConfigError(f"{key} must be {what}, got {value!r}")


_ABSENT = object()
