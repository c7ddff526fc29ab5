import json
import math

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.tracking import MetricAccumulator, Tracking, read_metrics


def _reduce_body(rank, world_size):
    acc = MetricAccumulator()
    # rank r sees r+1 samples with score r: the mean over all samples weights ranks by count
    acc.add_stats("critic/score", torch.full((rank + 1,), float(rank)))
    acc.add_mean("actor/pg_loss", 0.5 * rank, weight=10)
    acc.set("actor/lr", 1e-3)
    return acc.reduce()


def test_reduce_across_ranks_weights_by_count():
    out = run_on_ranks(_reduce_body, 2)
    assert out[0] == out[1]
    m = out[0]
    assert m["critic/score/mean"] == pytest.approx((0 * 1 + 1 * 2) / 3)
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["actor/pg_loss"] == pytest.approx(0.25)
    assert m["actor/lr"] == pytest.approx(1e-3)


def _mismatch_body(rank, world_size):
    acc = MetricAccumulator()
    acc.add_mean("a" if rank == 0 else "b", 1.0)
    return acc.reduce()


def test_reduce_names_must_agree():
    with pytest.raises(AssertionError, match="metrics differ across ranks"):
        run_on_ranks(_mismatch_body, 2)


def test_single_process_and_empty_values():
    acc = MetricAccumulator()
    acc.add_mean("x", torch.tensor([]))
    acc.add_mean("y", [1.0, 3.0])
    m = acc.reduce()
    assert math.isnan(m["x"]) and m["y"] == 2.0


def test_jsonl_always_on_and_rank0_only(tmp_path):
    t = Tracking(["console"], str(tmp_path), rank=0, console_stream=open(tmp_path / "c.txt", "w"))
    t.log(1, {"critic/score/mean": 0.5, "bad": float("nan")})
    t.log(2, {"critic/score/mean": 0.7})
    t.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["bad"] is None
    assert "score=0.5" in (tmp_path / "c.txt").read_text()
    other = tmp_path / "r1"
    Tracking(["console"], str(other), rank=1).log(1, {"a": 1.0})
    assert not other.exists()


def test_read_metrics_keeps_last_row_of_a_repeated_step_and_skips_torn_line(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "a": 1}) + "\n" + json.dumps({"step": 2, "a": 2}) + "\n")
        f.write(json.dumps({"step": 2, "a": 3}) + "\n" + '{"step": 3, "a"')
    rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["a"]) for r in rows] == [(1, 1), (2, 3)]



def test_a_cut_last_line_is_not_glued_to_the_next_run_and_is_skipped(tmp_path, caplog):
    # Killed while writing its first row: the cut line is line 1 and has no '\n'.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a"')
    t = Tracking([], str(tmp_path), rank=0)
    t.log(1, {"a": 2.0})
    t.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[0] == '{"step": 1, "a"'
    with caplog.at_level("WARNING", logger="verl_mcore.tracking"):
        rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["a"]) for r in rows] == [(1, 2.0)]
    assert f"{tmp_path / 'metrics.jsonl'} line 1" in caplog.text


def test_resume_drops_rows_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    kept = "".join(json.dumps({"step": s, "a": s}) + "\n" for s in (1, 2, 3))
    # A first run checkpointed at step 3 and was killed while writing the row of step 5.
    path.write_text(kept + json.dumps({"step": 4, "a": 4}) + "\n" + '{"step": 5, "a')
    t = Tracking([], str(tmp_path), rank=0)
    t.resumed_at(3)
    assert path.read_text() == kept  # rows up to the checkpoint, unchanged
    t.log(4, {"a": 40.0})
    t.close()
    assert [(r["step"], r["a"]) for r in read_metrics(str(tmp_path))] == [(1, 1), (2, 2), (3, 3), (4, 40.0)]
    Tracking([], str(tmp_path / "r1"), rank=1).resumed_at(0)  # only rank 0 has the file
    assert not (tmp_path / "r1").exists()

def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from verl_mcore.plot import main

    t = Tracking([], str(tmp_path), rank=0)
    for step in range(1, 6):
        t.log(step, {"critic/score/mean": step / 5, "actor/entropy": 1 / step,
                     "response_length/mean": 4.0, "perf/throughput": 100.0, "actor/ppo_kl": 0.01,
                     "val/quickstart/score/mean@1": 0.1 * step})
    t.close()
    assert main([str(tmp_path)]) == 0
    for name in ("reward", "kl", "entropy", "response_length", "throughput", "overview"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000


class _FakeSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter's surface (tensorboard is not a test dependency)."""

    opened: list = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        _FakeSummaryWriter.opened.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_purges_steps_past_the_resume_point(tmp_path, monkeypatch):
    import sys
    import types

    _FakeSummaryWriter.opened = []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                       types.SimpleNamespace(SummaryWriter=_FakeSummaryWriter))
    t = Tracking(["tensorboard"], str(tmp_path), rank=0)
    t.resumed_at(3)
    t.log(4, {"loss": 1.5})
    t.close()
    first, second = _FakeSummaryWriter.opened
    assert first.closed and first.purge_step is None and first.scalars == []
    assert second.purge_step == 4 and second.scalars == [("loss", 1.5, 4)] and second.closed
    assert second.log_dir == str(tmp_path / "tensorboard")


def test_wandb_run_continues_only_when_a_checkpoint_is_resumed(tmp_path, monkeypatch, caplog):
    import sys
    import types

    inits = []

    class Run:
        def __init__(self, **kw):
            # W&B's next step: the run "abc123" has logged steps up to 5
            self.id, self.step, self.rows = kw["id"], 6 if kw["id"] == "abc123" and len(inits) > 1 else 0, []

        def log(self, metrics, step):
            self.rows.append((step, metrics))

        def finish(self):
            pass

    def init(**kw):
        inits.append(kw)
        return Run(**kw)

    ids = iter(["abc123", "fresh1"])
    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = Tracking(["wandb"], str(tmp_path), rank=0, experiment="exp")
    first.log(1, {"a": 1.0})  # a fresh start opens a new W&B run
    first.close()
    requeued = Tracking(["wandb"], str(tmp_path), rank=0, experiment="exp")
    with caplog.at_level("WARNING"):
        requeued.resumed_at(2)  # resumed from the checkpoint of step 2: the same W&B run
    requeued.close()
    assert "ignore steps 3..5" in caplog.text
    restarted = Tracking(["wandb"], str(tmp_path), rank=0, experiment="exp")
    restarted.log(1, {"a": 1.0})  # from step 0 again (no checkpoint): a new W&B run
    restarted.close()
    assert [(kw["id"], kw["resume"], kw["name"]) for kw in inits] == [
        ("abc123", "allow", "exp"), ("abc123", "allow", "exp"), ("fresh1", "allow", "exp")]
    assert (tmp_path / "wandb_run_id").read_text().strip() == "fresh1"
