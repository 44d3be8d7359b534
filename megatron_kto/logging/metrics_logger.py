"""Run metrics to ``metrics.jsonl``, TensorBoard and (optionally) Weights & Biases.

Only rank 0 writes; on every other rank the logger is a no-op, so callers need no rank checks.

``metrics.jsonl`` holds one JSON object per :meth:`MetricsLogger.log` call, starting with
``"split"``, ``"step"`` and ``"consumed_samples"``. Each line is flushed as it is written, so a
crash keeps everything logged before it. Non-finite values (a NaN loss) are written as ``null``
because strict JSON has no NaN; TensorBoard and W&B still get the raw value. Training rows
never carry one: `trainer.non_finite` stops the run or leaves the step out of the row
(`algorithms/non_finite.py`); non-finite validation metrics come with a warning line.

A write that fails (a full disk) does not raise on rank 0 alone — the other ranks would wait for
it in their next collective until the timeout. The logger keeps the failure in
:attr:`MetricsLogger.failure`, writes nothing more, and the trainer stops every rank at its
next agreement (`algorithms.dpo.DPOTrainer._should_stop`).

On resume, call :meth:`MetricsLogger.truncate_after` with the restored step before logging
again: it drops the lines of steps the previous run logged after its last checkpoint (they will
be logged again) and tells TensorBoard to hide its events from those steps.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPLITS = ("train", "val")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("split", "step", "consumed_samples")

_tensorboard_warned = False


def _to_number(value: Any) -> float | int | None:
    """A plain JSON number for ``value`` (tensor, numpy or Python scalar); None if not finite."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes run metrics on rank 0.

    Args:
        log_dir: run directory (``exp_manager.explicit_log_dir``); created on rank 0.
        rank0: True only on the global rank 0 process.
        tensorboard: also write TensorBoard scalars under ``<log_dir>/tensorboard``. If the
            ``tensorboard`` package is missing, warn once and carry on without it.
        wandb: keyword arguments for ``wandb.init`` (e.g. ``{"project": ..., "name": ...}``),
            or None to disable W&B. ``dir`` defaults to ``log_dir``.

    Raises:
        ImportError: if ``wandb`` is given but the package is not installed (checked on every
            rank so all of them stop, rather than rank 0 failing while the others wait).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        rank0: bool,
        tensorboard: bool = True,
        wandb: Mapping[str, Any] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.rank0 = rank0
        self.path = self.log_dir / METRICS_FILE
        self._file: Any = None
        self._tb_writer: Any = None
        self._tb_writer_cls: Any = None
        self._tb_purge_step: int | None = None
        self._wandb_run: Any = None
        self.failure: tuple[Path, BaseException] | None = None
        """(what could not be written, why) after a failed write; nothing is written after it."""

        wandb_module = None
        if wandb is not None:
            try:
                wandb_module = importlib.import_module("wandb")
            except ImportError as e:
                raise ImportError(
                    "W&B logging is enabled (a wandb config was given) but the `wandb` package "
                    "is not installed; `pip install wandb` or disable W&B logging"
                ) from e
        if not rank0:
            return

        self.log_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            self._tb_writer_cls = _import_summary_writer()
        if wandb_module is not None:
            kwargs = {"dir": str(self.log_dir), **dict(wandb)}
            self._wandb_run = wandb_module.init(**kwargs)

    def log(self, split: str, step: int, consumed_samples: int, metrics: Mapping[str, Any]) -> None:
        """Append one record for ``split`` at ``step`` to every enabled sink.

        Args:
            split: ``"train"`` or ``"val"``.
            step: optimizer step the metrics belong to.
            consumed_samples: training samples consumed so far (global, all DP ranks).
            metrics: name → number (float, int, 0-d tensor), e.g. ``loss``, ``lr``,
                ``grad_norm``, ``tokens_per_sec``, ``mfu``, ``rewards/chosen``.

        Raises:
            ValueError: on an unknown split or a metric named like a reserved key.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        clash = [k for k in metrics if k in _RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} clash with the reserved keys {_RESERVED}")
        if not self.rank0:
            return

        record: dict[str, Any] = {
            "split": split,
            "step": int(step),
            "consumed_samples": int(consumed_samples),
        }
        raw: dict[str, float] = {}
        for name, value in metrics.items():
            record[name] = _to_number(value)
            raw[name] = float(value.item() if hasattr(value, "item") else value)

        if self.failure is not None:
            return
        try:
            if self._file is None:
                self._file = self._open_for_append()
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            self.failure = (self.path, e)
            return
        try:
            writer = self._tensorboard()
            if writer is not None:
                writer.add_scalar(f"{split}/consumed_samples", record["consumed_samples"], step)
                for name, value in raw.items():
                    writer.add_scalar(f"{split}/{name}", value, step)
                writer.flush()
        except Exception as e:  # noqa: BLE001 — TensorBoard re-raises its writer thread's error
            self.failure = (self.log_dir / TENSORBOARD_DIR, e)
            return
        if self._wandb_run is not None:
            payload = {f"{split}/{k}": v for k, v in raw.items()}
            payload[f"{split}/consumed_samples"] = record["consumed_samples"]
            self._wandb_run.log(payload, step=int(step))

    def truncate_after(self, step: int) -> int:
        """Keep only train/val lines with ``"step" <= step`` in ``metrics.jsonl``.

        The file is rewritten to a temporary file in the same directory, fsynced and renamed
        over the original, so a crash leaves either the old or the new file, never a mix.
        Unparseable lines (a line cut short by a crash) are dropped too. TensorBoard events
        from later steps are purged when its writer next opens.

        Returns:
            The number of lines dropped (0 on ranks other than 0).
        """
        if not self.rank0:
            return 0
        self._close_file()
        if self._tb_writer is not None:
            # Reopen later with purge_step, so TensorBoard hides the stale events.
            self._tb_writer.close()
            self._tb_writer = None
        self._tb_purge_step = step + 1
        if not self.path.exists():
            return 0

        kept: list[str] = []
        dropped = 0
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                if _keep_line(line, step):
                    kept.append(line if line.endswith("\n") else line + "\n")
                elif line.strip():
                    dropped += 1
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}.", dir=self.log_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.writelines(kept)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dropped

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        self._close_file()
        if self._tb_writer is not None:
            writer, self._tb_writer = self._tb_writer, None
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                if self.failure is None:
                    raise  # after a failed write, closing retries it: that error is known
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_for_append(self) -> Any:
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                # A crash mid-write can leave a partial last line; never glue a record onto it.
                needs_newline = f.read(1) != b"\n"
        f = self.path.open("a", encoding="utf-8")
        if needs_newline:
            f.write("\n")
        return f

    def _close_file(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()
            except OSError:
                if self.failure is None:
                    raise  # after a failed write, closing retries it: that error is known

    def _tensorboard(self) -> Any:
        if self._tb_writer is None and self._tb_writer_cls is not None:
            self._tb_writer = self._tb_writer_cls(
                log_dir=str(self.log_dir / TENSORBOARD_DIR), purge_step=self._tb_purge_step
            )
        return self._tb_writer


def _keep_line(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(record, dict)
        and record.get("split") in SPLITS
        and isinstance(record.get("step"), int)
        and record["step"] <= step
    )


def _import_summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or None (warning once) if unavailable."""
    global _tensorboard_warned
    try:
        return importlib.import_module("torch.utils.tensorboard").SummaryWriter
    except ImportError as e:
        if not _tensorboard_warned:
            warnings.warn(
                f"TensorBoard logging requested but unavailable ({e}); continuing without it. "
                "Install it with `pip install tensorboard`.",
                stacklevel=3,
            )
            _tensorboard_warned = True
        return None
