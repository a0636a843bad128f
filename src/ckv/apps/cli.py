"""What the Hydra entry points (``train.py``, ``eval.py``) share: a composition or configuration error reported as
one ``ckv: error: ...`` line with an exit code, instead of Hydra's multi-line report (its config search path, a
hint to append an unknown key with ``+``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from ckv.checks import error_message
from ckv.config import REGISTRY, ConfigError, not_taken_error
from ckv.train.config import TrainConfig

HYDRA_ERRORS = (HydraException, OmegaConfBaseException)  # composition, overrides, interpolation, unknown keys
# eval.py's exit code for an analysis that does not apply to the model (``AnalysisNotApplicable``: no gates to
# analyse, W != S for gate cycling): a study skips it with one line instead of failing (``ckv.apps.study``)
EXIT_NOT_APPLICABLE = 3


def error_line(e: BaseException) -> str:
    """The one line that reports a configuration or data error ``e``: an unknown key names the key (a ``+`` to
    append it only where it is a ``TrainConfig`` field the composed files leave out; an attention field, the kind
    that does not take it), an unknown group option lists the options."""
    cause = e.__cause__
    if isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = cause.full_key or str(cause).splitlines()[0]
        parent = cause.parent_node
        kind = parent.get("kind") if isinstance(parent, DictConfig) and key == f"attention.{cause.key}" else None
        if kind in REGISTRY:
            message = str(not_taken_error([str(cause.key)], kind))
        elif is_train_field(key):
            message = (
                f"{key} is a setting the composed config does not list (its config file leaves it at the "
                f"default): add it with +{key}=VALUE, or set it in an experiment file"
            )
        else:
            message = f"{key} is not a setting ({str(cause).splitlines()[0]}); check its spelling"
    elif isinstance(e, OverrideParseException):
        message = f"cannot parse the override {e.override!r}: {e.message.splitlines()[0]}"
    elif isinstance(e, MissingConfigException) and e.options:
        message = f"{str(e).splitlines()[0]}; choose one of {sorted(e.options)}"
    elif isinstance(e, OmegaConfBaseException) and _raised_by_resolver(e) is not None:
        message = str(_raised_by_resolver(e))
    elif isinstance(e, OmegaConfBaseException):
        message = str(e).splitlines()[0]  # the further lines repeat the key and the node type
    else:
        message = str(e)
    return error_message(message)


def is_train_field(key: str) -> bool:
    """Whether the dotted ``key`` names a field of ``TrainConfig``'s dataclasses (``data.lookup.distinct_queries``):
    a real setting that a config file leaves out, not a misspelling."""
    cls: Any = TrainConfig
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return False
        cls = typing.get_type_hints(cls).get(part)
    return True


def _raised_by_resolver(e: BaseException) -> Optional[ConfigError]:
    """The ConfigError a ckv resolver (``train.py``'s ``ckv_out_dir``) raised, which OmegaConf wraps, if any."""
    while e.__context__ is not None:
        e = e.__context__
        if isinstance(e, ConfigError):
            return e
    return None


@contextmanager
def one_line_errors(errors: tuple[type[BaseException], ...], exit_code: int) -> Iterator[None]:
    """Turn ``errors`` into ``error_line`` on stderr and ``exit_code``; anything else keeps its traceback."""
    try:
        yield
    except errors as e:
        print(error_line(e), file=sys.stderr)
        sys.exit(exit_code)


def run_hydra_main(main: Callable[[], None], errors: tuple[type[BaseException], ...], exit_code: int) -> None:
    """Call a ``@hydra.main`` function with Hydra's own errors (a bad override, an unknown config group option)
    raised to here (``HYDRA_FULL_ERROR``) rather than printed by Hydra, and report them like ``errors``."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    with one_line_errors((*errors, *HYDRA_ERRORS), exit_code):
        main()
