"""The composed configuration: its range checks, Hydra's errors in one line, and building its objects.

Types and unknown keys are refused by Hydra while it composes (``experiments.schema``); ``check``
then refuses values out of range, and keys added with ``+`` that the schema does not know (Hydra lets
``+`` add any key), before a run writes anything. Either way the user reads one line
that names the key, the value and what is accepted: ``one_line`` turns Hydra's and OmegaConf's
multi-line reports into that line, and ``refusing_in_one_line`` wraps ``run.py``'s entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from experiments import schema
from toolbox.errors import SuiteError, WriteError


class ConfigError(SuiteError, ValueError):
    """A bad configuration value, said in one line that names the key, the value and what is accepted."""


def _rules(node_type: type) -> dict[str, schema.Rule]:
    """The rules of a schema dataclass's fields, by field name."""
    if not dataclasses.is_dataclass(node_type):
        return {}
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(node_type) if "rule" in f.metadata}


def check(cfg: DictConfig) -> None:
    """Raise ConfigError on the first key whose value is missing or out of range, or on a group whose
    values do not fit together (the schema's ``together``)."""
    for group, options in schema.OPTIONS.items():  # a group removed (``~model``) or set to nothing
        if OmegaConf.is_missing(cfg, group):  # False for a key the config lacks
            raise ConfigError(f"{group} is required; accepted: {', '.join(sorted(options))}")
    nodes = [("", cfg)] + [(f"{group}.", cfg[group]) for group in schema.OPTIONS if group in cfg]
    for prefix, node in nodes:
        node_type = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(node_type):  # a key added with ``+`` passes Hydra's struct check
            known = [f.name for f in dataclasses.fields(node_type)]
            extra = [k for k in node if k not in known and not (prefix == "" and k == "hydra")]
            if extra:
                shown = [k for k in known if not k.startswith("_")]
                raise ConfigError(f"unknown key {prefix}{extra[0]}; accepted: {', '.join(shown)}")
        for key, rule in _rules(node_type).items():
            if OmegaConf.is_missing(node, key):
                raise ConfigError(f"{prefix}{key} is required{rule.hint}; accepted: {rule.what}")
            value = node[key]
            if not rule.ok(value):
                raise ConfigError(f"{prefix}{key} must be {rule.what}, got {value!r}")
        problem = getattr(node_type, "together", lambda node: None)(node)
        if problem:
            raise ConfigError(problem)


def build(node: DictConfig, **kwargs: Any) -> Any:
    """The object a ``_target_`` node describes, called with ``kwargs`` besides the node's own keys.

    The target is called here, not inside Hydra, so its own exceptions (a ValueError naming a bad
    value, an ``IRMASError``) reach the caller instead of Hydra's ``InstantiationException``.
    """
    return instantiate(node, _partial_=True)(**kwargs)


def one_line(exc: BaseException, conf_dir: Path) -> str:
    """What a Hydra or OmegaConf error means, in one line: the key or option, the value, what is accepted."""
    cause = exc.__cause__ if isinstance(exc, ConfigCompositionException) and exc.__cause__ else exc
    if isinstance(exc, MissingConfigException):
        return _missing_config(exc, conf_dir)
    if isinstance(exc, OverrideParseException):  # Hydra's grammar rejected an override as typed
        override = getattr(exc, "override", None) or str(exc).splitlines()[0].split(": ", 1)[-1]
        return (
            f"cannot read the override {override!r}; accepted: key=value, a value of ASCII letters, "
            "digits and _-./: or quoted (key='...')"
        )
    if str(exc).startswith("Ambiguous value for argument"):  # a sweep's values without -m
        override = str(exc).splitlines()[0].split("argument ", 1)[-1]
        return (
            f"{override} lists several values; accepted: -m before the overrides to sweep over them, "
            "key=[a,b] for a list, or key='a,b' for a string"
        )
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, ValidationError) and full_key:
        rule = _rules(getattr(cause, "object_type", None)).get(str(getattr(cause, "key", "")))
        if rule is not None:
            return f"{full_key} must be {rule.what}, got {cause.value!r}"
    if isinstance(cause, ConfigKeyError | AttributeError) and full_key:
        keys = [k for k in _rules(getattr(cause, "object_type", None))]
        if "." not in str(full_key):  # the top level also holds the groups' nodes
            keys += _top_groups(conf_dir)
        accepted = f"; accepted: {', '.join(keys)}" if keys else ""
        return f"unknown key {full_key}{accepted}"
    first = str(cause).strip().splitlines()
    return first[0] if first else type(cause).__name__


def _top_groups(conf_dir: Path) -> list[str]:
    """The groups whose options sit under a top-level key of their own name (``model``, ``trainer``,
    ...): every group of the primary config's defaults but Hydra's own and those whose options set
    keys elsewhere (``@package _global_``: the presets, the sweeps)."""
    defaults = OmegaConf.load(conf_dir / "config.yaml").get("defaults", [])
    groups = [next(iter(d)) for d in defaults if isinstance(d, DictConfig) and "hydra" not in next(iter(d))]
    return [
        g
        for g in groups
        if not any("@package _global_" in f.read_text() for f in (conf_dir / g).glob("*.yaml"))
    ]


def _missing_config(exc: MissingConfigException, conf_dir: Path) -> str:
    """An unknown group option (``model=lstm``) or primary config (``--config-name``)."""
    missing = str(exc.missing_cfg_file or "")
    if "/" in missing:
        group, option = missing.rsplit("/", 1)
        options = exc.options or sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        return f"unknown {group} {option!r}; accepted: {', '.join(options)}"
    configs = sorted(p.stem for p in conf_dir.glob("*.yaml"))
    return f"unknown config {missing!r}; accepted: {', '.join(configs)}"


@contextlib.contextmanager
def _one_line_arguments(prog: str) -> Iterator[None]:
    """Hydra's own command-line parser, its refusals in one line (argparse prints its usage first)."""
    module = importlib.import_module("hydra.main")  # the module: ``hydra.main`` is also the decorator
    real = module.get_args_parser

    def parser() -> argparse.ArgumentParser:
        made = real()

        def error(message: str) -> NoReturn:
            if message.startswith("unrecognized arguments"):  # a flag after the overrides
                message += "; accepted: flags such as -m before the key=value overrides"
            made.exit(2, f"{prog}: error: {message}\n")

        made.error = error  # type: ignore[method-assign]
        return made

    module.get_args_parser = parser
    try:
        yield
    finally:
        module.get_args_parser = real


@contextlib.contextmanager
def refusing_in_one_line(prog: str, conf_dir: Path) -> Iterator[None]:
    """Run a Hydra app so that a configuration it cannot compose ends in one line and status 2.

    Hydra prints its own multi-line report and exits 1 unless HYDRA_FULL_ERROR is set; it is set
    here so the error reaches us. A user who set HYDRA_FULL_ERROR=1 gets Hydra's full traceback.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with _one_line_arguments(prog):
            yield
    except (HydraException, OmegaConfBaseException) as exc:
        from experiments.callbacks import remove_refused_sweep

        remove_refused_sweep()
        print(f"{prog}: error: {one_line(exc, conf_dir)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # outside a job (a job's own interruption is reported by run.py)
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:  # an output folder that cannot be made or written
        where = f"cannot write {exc.filename}: " if exc.filename and not isinstance(exc, WriteError) else ""
        print(
            f"{prog}: error: {where}{exc.strerror or exc}; accepted: a folder you may write in",
            file=sys.stderr,
        )
        sys.exit(2)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
