"""What the Hydra entry scripts do: choose the config, prepare it, train, report user errors.

    @hydra.main(config_path="../conf", config_name="gpt_kto", version_base="1.3")
    def train(cfg):
        run_training(cfg, "kto")   # config checked before megatron-core is imported

    run_entry_point(train)         # a config Hydra cannot compose: one `error:` line, exit 2

A user error (bad config, checkpoint or data) is one `error:` line printed by rank 0 — every rank
finds the same one — and exit code 2 on every rank.

Which config a launch means:

- a NeMo-Aligner config (composed without our schema, e.g. `--config-path /their/conf
  --config-name gpt_kto`) is adapted key by key (`config/nemo_aligner.py`);
- our config with neither training data, nor a checkpoint, nor a tokenizer given is the bundled
  tiny example (`conf/example/tiny_<algorithm>.yaml`), recomposed under the same overrides, with
  a note saying so — so `python examples/train_gpt_kto.py` alone trains it, while a real run
  never inherits the demo's values (lr 1e-3, 64 tokens, 60 steps, the tiny model);
- anything else is taken as composed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from megatron_kto.config.keys import composition_error_line
from megatron_kto.console import exit_with_user_error, one_line
from megatron_kto.prepare import ConfigSources, PreparedRun, prepare_run_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def rank() -> int:
    """This process's global rank, known from torchrun's environment before any process group."""
    return int(os.environ.get("RANK", "0"))


def say(message: str, stream: Any = None) -> None:
    """Print once per job (rank 0)."""
    if rank() == 0:
        print(message, file=stream or sys.stdout, flush=True)


def is_foreign(cfg: Any) -> bool:
    """True for a config composed without our schema (a NeMo-Aligner YAML as it is)."""
    from megatron_kto.config.schema import AlignmentConfig

    return isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is not AlignmentConfig


def wants_example(cfg: Any, choices: dict[str, Any]) -> bool:
    """The no-data start: no training files, no checkpoint, no tokenizer, no example chosen."""
    return (
        choices.get("example") is None
        and not cfg.model.data.data_prefix.train
        and not cfg.pretrained_checkpoint.restore_from_path
        and cfg.model.tokenizer.model is None
    )


def _example_note(example: str) -> str:
    return (
        f"no training data and no checkpoint given: running the bundled tiny example "
        f"(conf/example/{example}.yaml: a 2-layer model from scratch with demo settings). For "
        f"a real run set pretrained_checkpoint.restore_from_path and "
        f"model.data.data_prefix.train."
    )


def _sources(overrides: list[str], choices: dict[str, Any]) -> ConfigSources:
    keys = {o.split("=", 1)[0].lstrip("~+") for o in overrides}
    return ConfigSources(
        overrides=tuple(overrides),
        preset=choices.get("model"),
        example=choices.get("example"),
        example_chose_preset=choices.get("example") is not None and "model" not in keys,
    )


def _choose(
    cfg: Any,
    algorithm: str,
    overrides: list[str],
    choices: dict[str, Any],
    recompose: Callable[[list[str]], Any],
) -> tuple[Any, ConfigSources, list[str], list[str]]:
    """(config, sources, notes, warnings) for a composed config — see the module docstring."""
    from megatron_kto.config.nemo_aligner import adapt_nemo_aligner_config, no_effect_warning

    if is_foreign(cfg):
        adapted, ignored = adapt_nemo_aligner_config(cfg, algorithm)
        warnings = [no_effect_warning(ignored)] if ignored else []
        return adapted, ConfigSources(overrides=tuple(overrides)), [], warnings
    notes = []
    if wants_example(cfg, choices):
        example = f"tiny_{algorithm}"
        cfg = recompose([*overrides, f"example={example}"])
        choices = {**choices, "example": example}
        notes.append(_example_note(example))
    return cfg, _sources(overrides, choices), notes, []


def _announce(prepared: PreparedRun, notes: list[str], warnings: list[str]) -> None:
    for line in warnings:
        say(f"warning: {line}", sys.stderr)
    for line in [*notes, *prepared.notes]:
        say(f"note: {line}")


def prepare_from_hydra(cfg: Any, algorithm: str) -> Any:
    """Inside a `@hydra.main` function: choose, adapt, resolve and validate the run's config.

    Prints the start-up notes and warnings once (rank 0). Imports no megatron-core.

    Returns:
        The prepared config (`prepare.prepare_run_config`).

    Raises:
        ConfigError / CheckpointError: one line naming the key or file.
    """
    import hydra
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    choices = dict(hc.runtime.choices)

    def recompose(extra: list[str]) -> Any:
        return hydra.compose(config_name=hc.job.config_name, overrides=extra)

    cfg, sources, notes, warnings = _choose(cfg, algorithm, overrides, choices, recompose)
    prepared = prepare_run_config(cfg, algorithm, sources=sources)
    _announce(prepared, notes, warnings)
    return prepared.cfg


def compose_run_config(
    config_name: str,
    overrides: list[str] | None = None,
    algorithm: str = "kto",
    config_dir: str | Path = CONF_DIR,
    world_size: int | None = None,
) -> PreparedRun:
    """Compose and prepare a config the way the entry scripts do, for tools and tests.

    Args:
        config_name: e.g. 'gpt_kto'.
        overrides: Hydra overrides, as on the command line.
        algorithm: 'kto' or 'dpo'.
        config_dir: where the config lives.
        world_size: launched processes (default $WORLD_SIZE or 1).
    """
    from hydra import compose, initialize_config_dir

    from megatron_kto.config.schema import register

    register()
    overrides = list(overrides or [])
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
        full = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        choices = dict(full.hydra.runtime.choices)
        cfg = compose(config_name=config_name, overrides=overrides)

        def recompose(extra: list[str]) -> Any:
            return compose(config_name=config_name, overrides=extra)

        cfg, sources, notes, warnings = _choose(cfg, algorithm, overrides, choices, recompose)
    prepared = prepare_run_config(cfg, algorithm, world_size=world_size, sources=sources)
    prepared.notes[:0] = [*warnings, *notes]
    return prepared


def report_user_error(message: str) -> NoReturn:
    """`error: <message>` on rank 0 only (every rank finds the same error), exit code 2."""
    exit_with_user_error(message)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (config, checkpoint, data, or a non-finite step under
    `trainer.non_finite=stop`) or a full disk, not a bug.

    `CacheWriterFailedError` is what the other ranks see when the rank tokenising the data
    stopped on a bad row: that rank reports the row; they exit quietly with it.
    """
    from megatron_kto.algorithms.errors import NonFiniteError, OutputError
    from megatron_kto.checkpointing.errors import CheckpointError
    from megatron_kto.config.validate import ConfigError
    from megatron_kto.data.errors import CacheWriteError, CacheWriterFailedError, DataFormatError

    return (
        ConfigError,
        CheckpointError,
        DataFormatError,
        CacheWriteError,
        CacheWriterFailedError,
        NonFiniteError,
        OutputError,
    )


def run_training(cfg: Any, algorithm: str) -> None:
    """The body of a trainer's `@hydra.main` function: prepare the config (no megatron-core
    import until it is valid), then train.

    User errors are reported here, inside the task function: raised out of it, Hydra would
    first print its own "Error executing job with overrides: [...]" line on every rank.
    """
    from megatron_kto.runtime.errors import PeerLost

    try:
        cfg = prepare_from_hydra(cfg, algorithm)
        from megatron_kto.run import main

        main(cfg, algorithm)
    except user_error_types() as e:
        report_user_error(one_line(e))
    except PeerLost as e:
        # Not a user error (exit code 1): the lowest surviving rank names the dead one.
        if e.reporter:
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(1)


#: How every run uses Hydra, whatever its config file says (conf/gpt_*.yaml say the same): no
#: `outputs/<date>/` directory and log file in the working directory (the run's outputs are
#: under exp_manager.explicit_log_dir), plain log lines on stdout.
HYDRA_SETTINGS = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout")


def _missing_hydra_settings(argv: list[str]) -> list[str]:
    """The HYDRA_SETTINGS the command line does not set itself (a NeMo-Aligner config file
    leaves Hydra's defaults, which would create `outputs/` in the working directory)."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a and not a.startswith("-")}
    return [s for s in HYDRA_SETTINGS if s.split("=", 1)[0] not in given]


def run_entry_point(hydra_main: Callable[[], Any]) -> None:
    """Call a `@hydra.main` function; a config Hydra cannot compose (unknown key, value of the
    wrong type, override syntax, missing config file or group option) exits with code 2 and one
    `error:` line from rank 0 instead of Hydra's multi-line report.

    Anything else keeps its traceback: that is a bug to report.
    """
    from hydra.errors import HydraException

    from megatron_kto.console import quiet_third_party

    quiet_third_party()
    from megatron_kto.runtime.launcher_env import adopt_launcher_env

    try:
        # srun without torchrun: SLURM's task variables become RANK / WORLD_SIZE / LOCAL_RANK
        # before anything reads them (validation's world size, rank 0's error line).
        adopt_launcher_env()
    except RuntimeError as e:
        report_user_error(str(e))
    # Without this Hydra prints its report itself and exits 1; with it, Hydra re-raises.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    sys.argv.extend(_missing_hydra_settings(sys.argv[1:]))
    try:
        hydra_main()
    except HydraException as e:
        report_user_error(composition_error_line(e))
