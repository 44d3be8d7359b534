"""Config keys a user can get wrong before any value is checked: keys the schema does not
define (a `+key=value` override or a NeMo-Aligner-only key), and the one-line report of a config
Hydra/OmegaConf could not compose (unknown key, wrong type, bad override syntax).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from megatron_kto.config.errors import ConfigError, suggestion
from megatron_kto.config.nemo_aligner import describe_key


def _unknown(full_key: str, key: str, known: Iterable[str]) -> str:
    """The message for an unknown key: NeMo-Aligner's keys get what they mean here."""
    nemo = describe_key(full_key)
    if nemo is not None:
        return f"{full_key}: unknown config key: {nemo}"
    return f"{full_key}: unknown config key{suggestion(key, known)}"


def check_known_keys(cfg: Any) -> None:
    """Reject keys the schema does not define.

    Hydra already rejects unknown keys in YAML files and plain `key=value` overrides; a
    `+key=value` override, however, adds a key to any node, and such a key would be silently
    ignored. A dataclass config cannot hold unknown keys and is not checked.

    Raises:
        ConfigError: naming the first unknown key (with the closest known one, if any).
    """
    from omegaconf import DictConfig, OmegaConf

    from megatron_kto.config.schema import AlignmentConfig

    if not isinstance(cfg, DictConfig):
        return

    def walk(node: DictConfig, schema: DictConfig, prefix: str) -> None:
        for key in node.keys():
            if key not in schema:
                raise ConfigError(_unknown(f"{prefix}{key}", str(key), schema.keys()))
            child, expected = node._get_node(key), schema._get_node(key)
            if isinstance(child, DictConfig) and isinstance(expected, DictConfig):
                walk(child, expected, f"{prefix}{key}.")

    walk(cfg, OmegaConf.structured(AlignmentConfig), "")


def _exception_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def composition_error_line(error: BaseException) -> str:
    """One line describing why Hydra/OmegaConf could not compose the config, key first.

    Hydra's own report spans several lines (override, OmegaConf's key/type dump, a hint about
    HYDRA_FULL_ERROR); this keeps what a user needs: the full key and the problem, plus the
    closest known key for a typo.
    """
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    for e in _exception_chain(error):
        if isinstance(e, OmegaConfBaseException) and e.full_key:
            if isinstance(e, ConfigKeyError | ConfigAttributeError):
                known = (
                    [f.name for f in dataclasses.fields(e.object_type)]
                    if dataclasses.is_dataclass(e.object_type)
                    else []
                )
                return _unknown(e.full_key, str(e.key), known)
            # The first line is the problem; the rest is OmegaConf's key/type dump.
            lines = str(e.msg or e).strip().splitlines()
            return f"{e.full_key}: {lines[0] if lines else type(e).__name__}"
    if isinstance(error, OverrideParseException):
        return f"cannot parse override {error.override!r}: {str(error).splitlines()[0]}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    if isinstance(error, MissingConfigException) and error.options:
        first += f" (available: {', '.join(error.options)})"
    return first
