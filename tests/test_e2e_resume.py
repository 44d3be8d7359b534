"""Stopping and resuming through the real entry script reproduces an uninterrupted run.

Every run below is `examples/train_gpt_kto.py` in a subprocess (torchrun for two ranks), stopped
the way a user's job stops — SIGKILL, SIGTERM, SIGUSR1 — and rerun with the same
`exp_manager.explicit_log_dir`, as a requeued job would be. Each interrupted-and-resumed run is
compared with an uninterrupted run of the same configuration:

- same layout: the logged metrics of every step (train and validation: loss, rewards, log-probs,
  logits, kl, lr, grad norm, consumed samples) and the final weights must be *bitwise* equal;
- another layout (saved at DP=2, resumed at PP=2): equal to a relative 1e-4 (fp32 reductions are
  ordered differently).

Family A (one rank, `hidden_dropout=0.1`, so an RNG that is not restored exactly shows up; a
warm-up + cosine LR schedule, so the scheduler state matters; 4 steps per epoch, so the resumed
runs cross an epoch boundary; 4 micro-batches per step; validation every 2 steps):

1. SIGKILL while `step_<N>.tmp` is being written: `latest` still names the previous complete
   checkpoint, which the rerun resumes from (the partial directory is removed with a warning).
2. That rerun gets SIGTERM: it saves a checkpoint (the only way one can appear: its
   `save_interval` is 0) and exits 0; a third run finishes the job.
3. A truncated tensor file in the newest checkpoint: the rerun warns, falls back to the previous
   checkpoint and retrains from there; when every checkpoint is damaged it stops with a one-line
   error and exit code 2 instead of training from scratch.

Family B (two ranks, DP=2, distributed optimizer, no dropout): SIGUSR1 delivered to rank 1 only
stops both ranks at the same step with a checkpoint and exit code 0; resuming at DP=2 is bitwise
equal to the uninterrupted DP=2 run, resuming at PP=2 (optimizer state resharded from two DP
shards to one) equal to 1e-4.

The comparisons can fail: the uninterrupted runs move every weight tensor by far more than the
tolerance (asserted), and one skipped RNG draw, a lost Adam moment or a scheduler off by one step
changes the losses of the resumed steps.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from e2e_cli import (
    KTO_SCRIPT,
    QUIET,
    REPO,
    TINY_EXAMPLE,
    cli_env,
    launch,
    launcher,
    load_tp1_state_dicts,
    read_metrics,
    save_initial_checkpoint,
)

from megatron_kto.checkpointing import files

pytestmark = pytest.mark.e2e

STEPS = 6
RTOL = 1e-4
#: Metrics that measure the machine, not the training (excluded from equality checks).
TIMING = {"step_time", "tokens_per_sec", "samples_per_sec", "peak_memory_gb", "mfu"}

#: Family A: one rank; 4 steps per epoch, validation (1 batch) every 2 steps, dropout on,
#: the default warm-up (5 steps) + cosine schedule, every checkpoint kept.
A_ARGS = [
    *QUIET,
    f"trainer.kto.max_steps={STEPS}",
    "trainer.kto.limit_train_batches=4",
    "trainer.kto.val_check_interval=2",
    "trainer.kto.limit_val_batches=1.0",
    "model.hidden_dropout=0.1",
    "exp_manager.checkpoint_callback_params.save_top_k=-1",
]
#: Family B: DP=2 over two ranks with the distributed optimizer; no validation.
B_ARGS = [
    *QUIET,
    f"trainer.kto.max_steps={STEPS}",
    "trainer.kto.save_interval=0",
    "model.optim.name=distributed_fused_adam",
    "model.global_batch_size=8",
    "model.micro_batch_size=2",
    "model.data.data_prefix.validation=[]",
    "exp_manager.checkpoint_callback_params.save_top_k=-1",
]


# ------------------------------------------------------------------------------------- helpers
class Run:
    """The entry script running in the background, its output in `<log_dir>.out`."""

    def __init__(self, log_dir: Path, args: list[str], nproc: int = 1) -> None:
        self.log_dir = log_dir
        self.out_path = log_dir.with_name(log_dir.name + f".{time.monotonic_ns()}.out")
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [
                    *launcher(nproc),
                    str(KTO_SCRIPT),
                    f"exp_manager.explicit_log_dir={log_dir}",
                    *args,
                ],
                cwd=REPO,
                env=cli_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(
                f"run did not finish in {timeout}s\n{self.output[-4000:]}"
            ) from None

    def finish(self, timeout: float = 300) -> str:
        """Wait; assert exit code 0; return the output."""
        rc = self.wait(timeout)
        assert rc == 0, f"exit code {rc}\n{self.output[-6000:]}"
        return self.output

    def poll_until(self, condition, what: str, timeout: float = 240, interval: float = 0.002):
        """Call `condition()` until it returns something truthy (returned); fail if the process
        ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"run ended (exit {self.proc.returncode}) before {what}\n{self.output[-4000:]}"
                )
            time.sleep(interval)
        self.kill_all()
        raise AssertionError(f"no {what} within {timeout}s\n{self.output[-4000:]}")

    def workers(self) -> dict[int, psutil.Process]:
        """Global rank -> training process (the process itself for one rank, torchrun's children
        otherwise)."""
        me = psutil.Process(self.proc.pid)
        children = me.children(recursive=True)
        if not children:
            return {0: me}
        ranks = {}
        for child in children:
            rank = child.environ().get("RANK")
            if rank is not None:
                ranks[int(rank)] = child
        return ranks

    def kill_all(self) -> None:
        for p in [*psutil.Process(self.proc.pid).children(recursive=True)]:
            p.kill()
        self.proc.kill()
        self.proc.wait()


def run_to_end(log_dir: Path, args: list[str], nproc: int = 1) -> str:
    """A run that is not signalled: `e2e_cli.launch` (forked ranks, NCCL order replayed for
    several). Asserts exit code 0; returns stdout + stderr."""
    argv = [str(KTO_SCRIPT), f"exp_manager.explicit_log_dir={log_dir}", *args]
    proc, _ = launch(argv, nproc, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{output[-6000:]}"
    return output


def train_steps_logged(log_dir: Path) -> list[int]:
    """Steps of the train rows in metrics.jsonl so far (complete lines only)."""
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            row = json.loads(line)
            if row["split"] == "train":
                steps.append(row["step"])
    return steps


def latest_name(log_dir: Path) -> str | None:
    name, problem = files.read_latest(log_dir / "checkpoints")
    assert problem is None, problem
    return name


def all_rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def assert_one_row_per_step(log_dir: Path, val_steps: list[int]) -> None:
    rows = all_rows(log_dir)
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if r["split"] == "val"] == val_steps


def assert_metrics_identical(log_dir: Path, reference: Path) -> int:
    """Every row of both metrics.jsonl files equal, timings aside; returns the rows compared."""
    got, want = all_rows(log_dir), all_rows(reference)
    assert [(r["split"], r["step"]) for r in got] == [(r["split"], r["step"]) for r in want]
    for g, w in zip(got, want):
        keys = set(w) - TIMING
        assert set(g) - TIMING == keys
        diff = {k: (g[k], w[k]) for k in sorted(keys) if g[k] != w[k]}
        assert not diff, f"{g['split']} step {g['step']}: {diff}"
    return len(got)


def metric_rel_diff(log_dir: Path, reference: Path) -> float:
    """Largest relative difference over all train metrics (timings aside) of all steps."""
    got, want = read_metrics(log_dir), read_metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    worst = 0.0
    for g, w in zip(got, want):
        for k in set(w) - TIMING - {"split"}:
            worst = max(worst, abs(g[k] - w[k]) / max(abs(w[k]), 1e-6))
    return worst


def checkpoint_dirs(log_dir: Path) -> list[str]:
    return sorted(p.name for p in (log_dir / "checkpoints").iterdir() if p.is_dir())


# ------------------------------------------------------------------------------ family A runs
@pytest.fixture(scope="module")
def family_a(tmp_path_factory):
    """Runs every family-A scenario; returns what each test checks."""
    root = tmp_path_factory.mktemp("resume_a")
    facts: dict = {"root": root}

    # Uninterrupted reference, checkpoints at steps 3 and 6.
    straight = root / "straight"
    run_to_end(straight, [*A_ARGS, "trainer.kto.save_interval=3"])
    facts["straight"] = straight

    # 1. SIGKILL while a checkpoint is being written (a save after every step: N >= 2 has a
    # complete step_<N-1> before it). Killed once tensor shards appear in the tmp directory.
    chain = root / "chain"
    run = Run(chain, [*A_ARGS, "trainer.kto.save_interval=1"])
    ckpts = chain / "checkpoints"

    def saving() -> tuple[int, list[str]] | None:
        if not ckpts.is_dir():
            return None
        for p in ckpts.iterdir():
            step = files.parse_step(p.name.removesuffix(files.TMP_SUFFIX))
            if p.name.endswith(files.TMP_SUFFIX) and step is not None and step >= 2:
                content = sorted(c.name for c in p.iterdir()) if p.is_dir() else []
                if any(name.endswith(".distcp") for name in content):  # tensors being written
                    return step, content
        return None

    killed_at, tmp_content = run.poll_until(saving, "a step_<N>.tmp directory with tensor shards")
    run.proc.send_signal(signal.SIGKILL)
    facts["kill_rc"] = run.wait()
    facts["killed_at"] = killed_at
    facts["tmp_content"] = tmp_content
    facts["after_kill"] = {
        "latest": latest_name(chain),
        "dirs": checkpoint_dirs(chain),
        "problem": files.check_complete(ckpts / files.step_dir_name(killed_at - 1)),
    }

    # 2. Rerun; SIGTERM once it has logged a step of its own. save_interval=0: the only
    # checkpoint it can write is the one the signal asks for.
    args = [*A_ARGS, "trainer.kto.save_interval=0"]
    # The killed run logged step N before its save; the rerun replaces metrics.jsonl (dropping
    # rows after the checkpoint) before it logs again, so a new file with a row > N-1 is a step
    # trained by the rerun.
    old_inode = (chain / "metrics.jsonl").stat().st_ino
    run = Run(chain, args)
    resumed_from = killed_at - 1

    def trained_after_resume() -> bool:
        try:
            if (chain / "metrics.jsonl").stat().st_ino == old_inode:
                return False
        except FileNotFoundError:
            return False
        return any(s > resumed_from for s in train_steps_logged(chain))

    run.poll_until(trained_after_resume, "a train step logged after the resume")
    run.proc.send_signal(signal.SIGTERM)
    facts["term_rc"] = run.wait()
    facts["term_output"] = run.output
    facts["after_term"] = {"latest": latest_name(chain), "dirs": checkpoint_dirs(chain)}

    # 3. Rerun to the end.
    facts["final_output"] = run_to_end(chain, args)
    facts["chain"] = chain

    # Damaged newest checkpoint: truncate its largest tensor shard.
    corrupt = root / "corrupt"
    shutil.copytree(straight, corrupt)
    shard = max(
        (corrupt / "checkpoints" / "step_6").glob("*.distcp"), key=lambda p: p.stat().st_size
    )
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    facts["corrupt_shard"] = shard.name
    facts["corrupt_output"] = run_to_end(corrupt, [*A_ARGS, "trainer.kto.save_interval=3"])
    facts["corrupt"] = corrupt

    # Every checkpoint damaged: step_6 truncated as above, step_3's trainer state overwritten.
    broken = root / "broken"
    shutil.copytree(straight, broken)
    shard = broken / "checkpoints" / "step_6" / facts["corrupt_shard"]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    state = broken / "checkpoints" / "step_3" / files.TRAINER_STATE
    text = state.read_text()
    assert '"step": 3' in text
    state.write_text(text.replace('"step": 3', '"step": 9'))  # same size: caught by the CRC
    facts["broken_metrics_before"] = (broken / "metrics.jsonl").read_text()
    run = Run(broken, [*A_ARGS, "trainer.kto.save_interval=3"])
    facts["broken_rc"] = run.wait()
    facts["broken_output"] = run.output
    facts["broken"] = broken

    step3 = straight / "checkpoints" / "step_3"
    facts["weights"] = dict(
        zip(
            ("straight", "chain", "corrupt", "straight_step3"),
            load_tp1_state_dicts([straight, chain, corrupt, step3]),
        )
    )
    return facts


def test_sigkill_mid_save_leaves_latest_on_the_previous_checkpoint(family_a):
    n = family_a["killed_at"]
    after = family_a["after_kill"]
    assert family_a["kill_rc"] == -signal.SIGKILL
    print(f"\nkilled while writing step_{n}.tmp (holding {family_a['tmp_content']})")
    assert after["latest"] == f"step_{n - 1}"
    assert after["problem"] is None, after["problem"]
    assert f"step_{n}.tmp" in after["dirs"] and f"step_{n}" not in after["dirs"]


def test_sigterm_saves_and_exits_zero(family_a):
    assert family_a["term_rc"] == 0, family_a["term_output"][-4000:]
    n = family_a["killed_at"]
    out = family_a["term_output"]
    assert f"removed incomplete checkpoint {family_a['chain']}/checkpoints/step_{n}.tmp" in out
    assert f"resumed from step {n - 1}" in out
    assert "received SIGTERM" in out
    latest = family_a["after_term"]["latest"]
    stopped = files.parse_step(latest)
    assert n - 1 < stopped < STEPS, (latest, out[-3000:])
    # save_interval=0: nothing but the signal could have written this checkpoint.
    assert family_a["after_term"]["dirs"] == [f"step_{s}" for s in sorted({*range(1, n), stopped})]
    assert f"done: step {stopped}," in out


def test_interrupted_twice_equals_uninterrupted(family_a):
    chain, straight = family_a["chain"], family_a["straight"]
    stopped = files.parse_step(family_a["after_term"]["latest"])
    assert f"resumed from step {stopped}" in family_a["final_output"]
    assert_one_row_per_step(chain, val_steps=[2, 4, 6])
    rows = assert_metrics_identical(chain, straight)
    got, want = family_a["weights"]["chain"], family_a["weights"]["straight"]
    assert got.keys() == want.keys()
    different = [k for k in want if not got[k].equal(want[k])]
    assert not different, different
    print(
        f"\nkill mid-save of step {family_a['killed_at']} + SIGTERM at step {stopped}: "
        f"{rows} metrics rows and {len(want)} weight tensors bitwise equal"
    )


def test_reference_run_is_not_trivial(family_a):
    """The equality checks are not vacuous: steps 4-6 change every tensor well beyond RTOL,
    every step has its own loss and learning rate."""
    rows = read_metrics(family_a["straight"])
    assert len({r["loss"] for r in rows}) == STEPS
    assert len({r["lr"] for r in rows}) == STEPS  # warm-up then cosine: the schedule matters
    before, after = family_a["weights"]["straight_step3"], family_a["weights"]["straight"]
    moved = {k: float((after[k] - before[k]).abs().max() / before[k].abs().max()) for k in after}
    assert min(moved.values()) > 10 * RTOL, moved


def test_truncated_latest_falls_back_to_previous_checkpoint(family_a):
    out = family_a["corrupt_output"]
    corrupt = family_a["corrupt"]
    assert f"skipping checkpoint {corrupt}/checkpoints/step_6: {family_a['corrupt_shard']}" in out
    assert "truncated" in out
    assert "resumed from step 3" in out
    assert files.check_complete(corrupt / "checkpoints" / "step_6") is None  # rewritten
    assert latest_name(corrupt) == "step_6"
    assert_one_row_per_step(corrupt, val_steps=[2, 4, 6])
    assert_metrics_identical(corrupt, family_a["straight"])
    got, want = family_a["weights"]["corrupt"], family_a["weights"]["straight"]
    assert all(got[k].equal(want[k]) for k in want)


def test_no_usable_checkpoint_is_one_clear_error(family_a):
    rc, out, broken = family_a["broken_rc"], family_a["broken_output"], family_a["broken"]
    assert rc == 2, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no usable checkpoint" in last, last
    assert "step_6" in last and "step_3" in last, last
    assert "Traceback" not in out
    # Nothing was trained or written: no silent restart from scratch.
    assert (broken / "metrics.jsonl").read_text() == family_a["broken_metrics_before"]
    assert checkpoint_dirs(broken) == ["step_3", "step_6"]


# ------------------------------------------------------------------------------ family B runs
@pytest.fixture(scope="module")
def family_b(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_b")
    facts: dict = {}
    # From a saved starting point, as real runs are: the reference policy is then the same
    # under every layout (a random initialisation is not: see tests/test_checkpoint_resume_guard.py).
    init = save_initial_checkpoint(root / "init", seed=5)
    args = [*B_ARGS, TINY_EXAMPLE, f"pretrained_checkpoint.restore_from_path={init}"]
    straight = root / "straight"
    run_to_end(straight, args, nproc=2)
    facts["straight"] = straight

    stopped = root / "usr1"
    run = Run(stopped, args, nproc=2)
    run.poll_until(lambda: train_steps_logged(stopped), "a logged train step")
    workers = run.workers()
    assert sorted(workers) == [0, 1], workers
    workers[1].send_signal(signal.SIGUSR1)  # one rank only: the ranks must agree to stop
    facts["usr1_rc"] = run.wait()
    facts["usr1_output"] = run.output
    facts["usr1_latest"] = latest_name(stopped)
    facts["usr1_dirs"] = checkpoint_dirs(stopped)

    pp2 = root / "usr1_pp2"
    shutil.copytree(stopped, pp2)
    facts["resume_dp2_output"] = run_to_end(stopped, args, nproc=2)
    facts["resume_pp2_output"] = run_to_end(
        pp2, [*args, "model.pipeline_model_parallel_size=2"], nproc=2
    )
    facts["dp2"], facts["pp2"] = stopped, pp2
    facts["weights"] = dict(
        zip(("straight", "dp2", "pp2"), load_tp1_state_dicts([straight, stopped, pp2]))
    )
    return facts


def test_sigusr1_to_one_rank_stops_all_with_a_checkpoint(family_b):
    assert family_b["usr1_rc"] == 0, family_b["usr1_output"][-4000:]
    assert "received SIGUSR1" in family_b["usr1_output"]
    stopped = files.parse_step(family_b["usr1_latest"])
    assert 1 <= stopped < STEPS
    assert family_b["usr1_dirs"] == [f"step_{stopped}"]
    assert f"done: step {stopped}," in family_b["usr1_output"]


def test_distributed_optimizer_resume_is_bitwise(family_b):
    stopped = files.parse_step(family_b["usr1_latest"])
    assert f"resumed from step {stopped}" in family_b["resume_dp2_output"]
    rows = assert_metrics_identical(family_b["dp2"], family_b["straight"])
    got, want = family_b["weights"]["dp2"], family_b["weights"]["straight"]
    assert all(got[k].equal(want[k]) for k in want)
    print(f"\nDP=2 distributed optimizer, stopped at {stopped}: {rows} rows bitwise equal")


def test_resume_under_another_layout(family_b):
    stopped = files.parse_step(family_b["usr1_latest"])
    out = family_b["resume_pp2_output"]
    assert f"resumed from step {stopped}" in out
    worst_metric = metric_rel_diff(family_b["pp2"], family_b["straight"])
    got, want = family_b["weights"]["pp2"], family_b["weights"]["straight"]
    worst_weight = max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want
    )
    print(
        f"\nsaved DP=2 at step {stopped}, resumed PP=2: max rel diff metrics {worst_metric:.1e}, "
        f"weights {worst_weight:.1e}"
    )
    assert worst_metric <= RTOL and worst_weight <= RTOL
