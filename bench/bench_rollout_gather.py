"""The rollout gather of Sampler.generate on gloo ranks: the object gather of Python lists it
replaced (old) against the tensor gather (new, verl_mcore/rollout/gather.py), per rank.

    python bench/bench_rollout_gather.py --path new --samples 16384 --prompt-len 1024 \
        --response-len 4096 --n 16 --world 2 [--repeats 3]

Every rank contributes 1/world of a global batch of --samples samples (--samples / --n prompts
of about --prompt-len tokens, responses of about --response-len tokens, both uniform within
+-25%), so what each rank receives and builds is the global batch, as on 64 ranks: that is what
decides per-rank memory and time. Generation TP is 1 (each rank its own replica).

Measured per rank, from the engine outputs (Python lists, as the engines return them) to
  gather   the global samples in the trainer's order (old: the sorted list of tuples; new: the
           global Rollout)
  build    + the TrainBatch (old: the row-by-row from_sequences it had; new: from_flat), the
           per-sample rows and finish reasons
Text decoding is left out of both (tokenizer-bound; the same lists go to batch_decode).
Seconds are wall time on each rank; memory is the peak RSS during the window minus the RSS at
its start (a sampling thread at 1 ms and ru_maxrss, whichever is higher). Each setting runs in
fresh processes; --repeats run in the same processes, with gc and malloc_trim in between.
Prints one JSON line per setting.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 128_256  # Llama 3
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _PeakRSS:
    """Peak RSS over a window: a 1 ms sampling thread, and ru_maxrss where the window raised it.
    A C call holding the GIL (pickle.loads) hides from the thread while it runs, not after."""

    def __enter__(self):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.start, self.peak, self.maxrss0 = _rss(), _rss(), _maxrss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _rss())

    def read(self) -> int:
        """Bytes above the window's starting RSS, so far."""
        peak = max(self.peak, _rss())
        if _maxrss() > self.maxrss0:
            peak = max(peak, _maxrss())
        return peak - self.start

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _outputs(rank: int, world: int, args):
    """This rank's share: prompts and engine outputs as Python lists, as an engine returns them."""
    import numpy as np

    from verl_mcore.data import PromptBatch
    from verl_mcore.rollout.base import SampleOutput

    rng = np.random.default_rng(rank)
    prompts = args.samples // args.n // world
    lens = lambda mean, k: rng.integers(int(mean * 0.75), int(mean * 1.25) + 1, k)  # noqa: E731
    ids = [rng.integers(0, VOCAB, int(k)).tolist() for k in lens(args.prompt_len, prompts)]
    rows = [{"data_source": "math", "reward_model": {"ground_truth": str(i), "style": "rule"},
             "extra_info": {"index": rank * prompts + i, "split": "train"}} for i in range(prompts)]
    response_lens = lens(args.response_len, prompts * args.n)
    outputs = [SampleOutput(p, s, rng.integers(0, VOCAB, int(response_lens[p * args.n + s])).tolist(),
                            None, "stop" if s % 3 else "length")
               for p in range(prompts) for s in range(args.n)]
    return PromptBatch(indices=list(range(prompts)), input_ids=ids, rows=rows), outputs


def _groups(rank: int, world: int):
    import torch.distributed as dist

    from verl_mcore.distributed.groups import GroupLayout, ParallelGroups

    layout = GroupLayout(world, tp=1, pp=1, tp_gen=1)
    mine = {}
    for name, groups in (("gen_tp", layout.gen_tp_groups()), ("gen_dp", layout.gen_dp_groups())):
        for ranks in groups:  # every rank creates every group
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = g
    return ParallelGroups(layout, rank, train=None, micro_dp=None, **mine)


def _old(groups, world, prompts, outputs):
    """Trainer.generate before the tensor gather (commit c1ad090), decoding left out."""
    from tests.rollout.object_gather import object_gather, old_from_sequences

    samples, group_ids = object_gather(groups, world, prompts, outputs)
    yield "gather"
    train = old_from_sequences([s[0] for s in samples], [s[2] for s in samples], 0)
    rows, finish = [s[1] for s in samples], [s[3] for s in samples]
    yield "build"
    del train, rows, finish


def _new(groups, world, prompts, outputs):
    import torch

    from verl_mcore.engine.batch import TrainBatch
    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.rollout.gather import gather_rollout

    part = gather_rollout(Rollout.from_outputs(prompts, outputs, VOCAB), groups, VOCAB)
    yield "gather"
    train = TrainBatch.from_flat(part.prompt_ids, part.prompt_lens, part.response_ids,
                                 part.response_lens, 0, prompt_of=part.prompt_of)
    rows, finish, group_ids = part.rows, part.finish, part.group_ids
    assert train.num_samples == part.num_samples and group_ids.dtype == torch.int64
    yield "build"
    del train, rows, finish


def _worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = _groups(rank, world)
    prompts, outputs = _outputs(rank, world, args)
    path = {"old": _old, "new": _new}[args.path]
    out = []
    for _ in range(args.repeats):
        dist.barrier()
        with _PeakRSS() as mem:
            t0 = time.perf_counter()
            rec = {}
            for stage in path(groups, world, prompts, outputs):
                rec[f"{stage}_s"] = time.perf_counter() - t0
                rec[f"{stage}_peak_gb"] = mem.read() / 2**30
        out.append(rec)
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    from tests.multiproc import free_port

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", choices=["old", "new"], required=True)
    p.add_argument("--samples", type=int, default=16384, help="global samples per step")
    p.add_argument("--n", type=int, default=16, help="samples per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.samples % (args.n * args.world):
        p.error("--samples must be a multiple of --n x --world")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, results))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join()
    summary = {k: v for k, v in vars(args).items()}
    summary["tokens_global"] = args.samples * (args.prompt_len + args.response_len)  # about
    for rank, recs in sorted(per_rank.items()):
        for key in recs[0]:
            summary[f"rank{rank}_{key}_median"] = round(statistics.median(r[key] for r in recs), 3)
            summary[f"rank{rank}_{key}_all"] = [round(r[key], 3) for r in recs]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
