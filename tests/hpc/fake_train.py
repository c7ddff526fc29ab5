"""Stand-in for `python -m verl_mcore.train` in the Slurm tests, until the trainer exists.

    python -m tests.hpc.fake_train --config FILE [a.b=c ...]

It does what the launcher and the scheduler can see of a training run, with the real pieces:
the config (Config.load), the launch environment (detect_launch: an srun step), a gloo process
group, the PreemptionGuard agreed across ranks at every step boundary, and the exit code
protocol. A "step" is a short sleep plus an all_reduce; the "checkpoint" is
`trainer.run_dir/checkpoint.json` holding the number of completed steps, written by rank 0
after a barrier; `metrics.jsonl` gets one line per step. A rerun resumes from the checkpoint
(checkpoint.resume=auto), as the trainer will.

Every step runs under the collective Watchdog (trainer.collective_timeout_s), as the trainer's
will. Environment: FAKE_TRAIN_STEP_S, seconds per step (default 0.5); FAKE_TRAIN_HANG_STEP: at
that step rank 1 gets stuck computing rewards and never joins rank 0's all_reduce.
"""
from __future__ import annotations

import json
import os
import sys
import time

from verl_mcore.config import Config
from verl_mcore.distributed.launch import detect_launch, setup_logging
from verl_mcore.distributed.preemption import PreemptionGuard
from verl_mcore.distributed.watchdog import Watchdog, process_group_timeout


def _save(path: str, steps_done: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"steps_done": steps_done}, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    from verl_mcore.train import parse_args

    args = parse_args(argv)
    cfg = Config.load(args.config, args.overrides)
    info = detect_launch()
    setup_logging(info.rank)
    guard = PreemptionGuard().install()  # before the slow imports: a signal is never lost

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            rank=info.rank, world_size=info.world_size,
                            timeout=process_group_timeout(cfg.trainer.collective_timeout_s))
    wd = Watchdog(cfg.trainer.collective_timeout_s, rank=info.rank).start(watch_signals=True)
    run_dir = cfg.trainer.run_dir
    ckpt = os.path.join(run_dir, "checkpoint.json")
    start = 0
    if cfg.checkpoint.resume == "auto" and os.path.exists(ckpt):
        with open(ckpt) as f:
            start = json.load(f)["steps_done"]
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    print(f"[rank {info.rank}/{info.world_size}] launcher={info.launcher} restart={restart} "
          f"resuming at step {start}", flush=True)
    step_s = float(os.environ.get("FAKE_TRAIN_STEP_S", "0.5"))
    hang_step = int(os.environ.get("FAKE_TRAIN_HANG_STEP", "-1"))
    for step in range(start, cfg.trainer.total_steps):
        with wd.phase("step", step=step):
            if step == hang_step and info.rank == 1:
                with wd.phase("compute_rewards", op="reward function"):
                    time.sleep(3600)
            with wd.phase("actor_update", op="forward_backward"):
                time.sleep(step_s)
                wd.set_op("all_reduce grads")
                total = torch.tensor([float(info.rank + 1)])
                dist.all_reduce(total)
        if info.rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "restart": restart, "world_size": info.world_size,
                                    "rank_sum": total.item()}) + "\n")
        if guard.should_stop():
            if info.rank == 0:
                _save(ckpt, step + 1)
            dist.barrier()  # the checkpoint is complete before anyone reports preemption
            code = guard.preempted_exit(step)
            dist.destroy_process_group()
            return code
    dist.barrier()
    if info.rank == 0:
        _save(ckpt, cfg.trainer.total_steps)
        with open(os.path.join(run_dir, "done"), "w") as f:
            f.write("ok\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
