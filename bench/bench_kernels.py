"""Time the csrc/ kernels against the torch reference and the functions RL frameworks use today.

    python bench/bench_kernels.py [--quick] [--results bench/RESULTS.md] [--commit SHA] [--json PATH]

Everything runs in one process on one GPU: a device-to-device copy first (the bandwidth roofline,
counting bytes read + written), then GAE (kernel vs the reversed Python time loop of
`verl_mcore.algo.advantages.gae`) and log-prob + entropy (kernel vs the torch reference vs
`log_softmax` + `gather` vs megatron-core's `vocab_parallel_cross_entropy`). Times are the median
of CUDA-event timings after warm-up, rotating between several input sets (each larger than L2) so
no repeat reads a warm cache. "% roofline" is (minimum bytes / copy bandwidth) / time; "extra GB" is
the peak allocation above what was allocated before the call (outputs included). A table is
printed and a dated entry appended to the results file; --json also writes the table's rows
(bench/report.py reads them).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_mcore import ops  # noqa: E402
from verl_mcore.algo import advantages as algo  # noqa: E402
from verl_mcore.ops import reference  # noqa: E402
from verl_mcore.ops._extension import extension, extension_status  # noqa: E402


def time_ms(fn, input_sets, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn(*inputs) over `reps` calls, rotating through `input_sets`."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = input_sets[i % len(input_sets)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, input_sets, reps: int, calls_per_graph: int = 20) -> float:
    """Device time of one fn call: median over `reps` replays of a CUDA graph holding
    `calls_per_graph` calls (rotating inputs), divided by that count. Leaves out the host-side cost
    (Python, dispatch, launch) that dominates kernels of a few tens of microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for inputs in input_sets:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(calls_per_graph):
            fn(*input_sets[k % len(input_sets)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    del graph
    return statistics.median(times)


def peak_extra_gb(fn, inputs) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 1e9


class Table:
    HEAD = ("what", "implementation", "shape", "ms (median)", "% copy roofline", "speed-up vs baseline",
            "peak extra GB")

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth  # bytes/s
        self.rows: list[tuple] = []

    def add(self, group, name, shape, ms, min_bytes=None, baseline_ms=None, extra_gb=None):
        roof = f"{100 * min_bytes / self.bandwidth / (ms / 1e3):.0f}%" if min_bytes else ""
        speedup = f"{baseline_ms / ms:,.1f}x" if baseline_ms else ""
        extra = f"{extra_gb:.2f}" if extra_gb is not None else ""
        self.rows.append((group, name, shape, f"{ms:.3f}", roof, speedup, extra))
        print(f"  {name:<44} {shape:<22} {ms:10.3f} ms  {roof:>5} {speedup:>10} {extra:>8}", flush=True)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.HEAD) + " |", "|" + "---|" * len(self.HEAD)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def bench_copy(reps: int) -> float:
    n = 2 * 1024**3  # 2 GiB each way
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [()], reps)
    bw = 2 * n / (ms / 1e3)
    print(f"device-to-device copy: {2 * n / 1e9:.2f} GB moved in {ms:.3f} ms = {bw / 1e12:.2f} TB/s")
    del src, dst
    return bw


def bench_gae(table: Table, quick: bool):
    ext = extension()
    shapes = [(512, 4096), (1024, 8192), (4, 1 << 20), (65536, 128), (64, 32768)]
    for batch, length in shapes:
        sets = []
        for _ in range(3):
            r = torch.randn(batch, length, device="cuda")
            v = torch.randn(batch, length, device="cuda")
            m = torch.rand(batch, length, device="cuda") > 0.1
            sets.append((r, v, m))
        shape = f"B={batch} T={length}"
        min_bytes = batch * length * (4 + 4 + 1 + 4 + 4)
        loop_ms = None
        if (batch, length) in [(512, 4096), (1024, 8192)] and not (quick and length > 4096):
            loop_ms = time_ms(lambda r, v, m: algo.gae(r, v, m, 0.99, 0.95), sets, reps=2, warmup=1)
            table.add("GAE", "python time loop (algo.advantages.gae)", shape, loop_ms, min_bytes)
        eager_ms = time_ms(lambda r, v, m: ops.gae(r, v, m, 0.99, 0.95), sets, reps=50, warmup=5)
        table.add("GAE", "ops.gae eager (host dispatch included)", shape, eager_ms, min_bytes, loop_ms,
                  peak_extra_gb(lambda r, v, m: ops.gae(r, v, m, 0.99, 0.95), sets[0]))
        if (batch, length) == (1024, 8192):
            def unfused(r, v, m):
                return algo.masked_whiten(ops.gae(r, v, m, 0.99, 0.95)[0], m)

            def fused(r, v, m):
                return ops.gae_whitened(r, v, m, 0.99, 0.95)

            base_ms = time_ms(unfused, sets, reps=20, warmup=3)
            table.add("GAE+whiten", "ops.gae + algo.masked_whiten, eager", shape, base_ms, min_bytes)
            table.add("GAE+whiten", "ops.gae_whitened (fused stats), eager", shape,
                      time_ms(fused, sets, reps=20, warmup=3), min_bytes, base_ms, peak_extra_gb(fused, sets[0]))
            # What the trainer's adv phase runs for PPO: the registry entry, whitening on, a float32
            # response mask (TrainBatch.response_mask), as Learner.advantages calls it.
            float_sets = [(r, v, m.float()) for r, v, m in sets]

            def trainer_gae(r, v, m):
                return algo.compute_advantages("gae", r, m, values=v, gamma=1.0, lam=0.95, whiten=True)

            table.add("GAE+whiten", "trainer: compute_advantages('gae'), eager", shape,
                      time_ms(trainer_gae, float_sets, reps=50, warmup=5),
                      batch * length * (4 + 4 + 4 + 4 + 4), base_ms)
        if ext is None:
            continue
        # Device time per tile shape (config -1 = the automatic choice); see csrc/gae.cu kConfigs.
        configs = [-1] + (list(range(2, 7)) if length >= 4096 else [])
        for config in configs:
            def call(r, v, m, config=config):
                return ext.gae(r, v, m, 0.99, 0.95, torch.cuda.current_stream().cuda_stream, config, False)

            ms = graph_time_ms(call, sets, reps=20)
            name = "kernel, CUDA graph, " + ("auto tile" if config < 0 else f"tile config {config}")
            table.add("GAE", name, shape, ms, min_bytes, loop_ms)
        del sets


def _megatron_ce():
    """megatron-core's vocab_parallel_cross_entropy on a 1-rank TP group, or None if unavailable."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError as e:
        print(f"megatron-core not importable ({e}); skipping its rows")
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return vocab_parallel_cross_entropy


def bench_logprob_entropy(table: Table, quick: bool):
    tokens, vocab = (4096, 151936) if quick else (16384, 151936)
    shape = f"{tokens}x{vocab} bf16"
    read = tokens * vocab * 2
    sets = []
    for _ in range(2):
        logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16) * 3
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        sets.append((logits, target))
    ext = extension()
    stream = torch.cuda.current_stream().cuda_stream

    def ref_fwd(x, t):
        return reference.combine_stats(reference.local_stats(x, t, 0, 1.0), None)[:2]

    def logsoftmax_gather(x, t):
        return torch.log_softmax(x.float(), dim=-1).gather(1, t[:, None])

    baseline = time_ms(logsoftmax_gather, sets, reps=5)
    table.add("logprob fwd", "log_softmax + gather (fp32)", shape, baseline, read, None,
              peak_extra_gb(logsoftmax_gather, sets[0]))
    ce = _megatron_ce()
    mc_fwd = mc_fwdbwd = None
    if ce is not None:
        def mc_forward(x, t):
            return ce(x[:, None, :], t[:, None])

        mc_fwd = time_ms(mc_forward, sets, reps=5)
        table.add("logprob fwd", "megatron vocab_parallel_cross_entropy", shape, mc_fwd, read, None,
                  peak_extra_gb(mc_forward, sets[0]))
    ref_ms = time_ms(ref_fwd, sets, reps=3, warmup=1)
    table.add("logprob fwd", "torch reference (ops/reference.py)", shape, ref_ms, read, mc_fwd,
              peak_extra_gb(ref_fwd, sets[0]))
    if ext is not None:
        def kernel_fwd(x, t):
            return ops.logprob_entropy(x, t)

        def stats_only(x, t):
            return ext.lpe_forward(x, t, 0, 1.0, stream)

        ms = time_ms(kernel_fwd, sets, reps=20, warmup=3)
        table.add("logprob fwd", "kernel (ops.logprob_entropy, +entropy)", shape, ms, read, mc_fwd,
                  peak_extra_gb(kernel_fwd, sets[0]))
        ms = time_ms(stats_only, sets, reps=20, warmup=3)
        table.add("logprob fwd", "kernel stats only (_C.lpe_forward)", shape, ms, read, mc_fwd)

    # Backward: the kernel alone (read logits + write grads), then whole fwd+bwd through autograd.
    g = torch.randn(tokens, device="cuda")
    if ext is not None:
        st = reference.combine_stats(ext.lpe_forward(sets[0][0], sets[0][1], 0, 1.0, stream), None)
        logz, ez = st[2].float(), st[3].float()

        def kernel_bwd(x, t):
            return ext.lpe_backward(x, t, 0, 1.0, logz, ez, g, g, stream)

        ms = time_ms(kernel_bwd, sets, reps=20, warmup=3)
        table.add("logprob bwd", "kernel grad-logits (_C.lpe_backward)", shape, ms, 2 * read, None,
                  peak_extra_gb(kernel_bwd, sets[0]))

    leaf_sets = [(x.detach().requires_grad_(True), t) for x, t in sets]

    def run_backward(loss_fn):
        def step(x, t):
            loss_fn(x, t).backward()
            grad, x.grad = x.grad, None  # measured without an older grad held
            return grad
        return step

    if ce is not None:
        step = run_backward(lambda x, t: ce(x[:, None, :], t[:, None]).sum())
        mc_fwdbwd = time_ms(step, leaf_sets, reps=5)
        table.add("logprob fwd+bwd", "megatron vocab_parallel_cross_entropy", shape, mc_fwdbwd, 3 * read, None,
                  peak_extra_gb(step, leaf_sets[0]))
    if ext is not None:
        def loss(x, t):
            logp, ent = ops.logprob_entropy(x, t)
            return (logp * g).sum() + (ent * g).sum()

        step = run_backward(loss)
        ms = time_ms(step, leaf_sets, reps=10, warmup=3)
        table.add("logprob fwd+bwd", "kernel (ops.logprob_entropy, both outputs)", shape, ms, 3 * read, mc_fwdbwd,
                  peak_extra_gb(step, leaf_sets[0]))


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "csrc", "verl_mcore/ops", "bench"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller log-prob size, skip the slowest loop")
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--date", default=None, help="date to record (default: this machine's UTC clock)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the table's rows here")
    parser.add_argument("--only", choices=["gae", "logprob"], default=None, help="run one group")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA device")
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; ops: {extension_status()}")
    t0 = time.time()
    bandwidth = bench_copy(reps=20)
    table = Table(bandwidth)
    print(f"  {'implementation':<44} {'shape':<22} {'median':>13}  {'roof':>5} {'speed-up':>10} {'extra GB':>8}")
    if args.only in (None, "gae"):
        bench_gae(table, args.quick)
    if args.only in (None, "logprob"):
        bench_logprob_entropy(table, args.quick)
    md = table.markdown()
    print("\n" + md)
    entry = (
        f"\n## {args.date or format(datetime.datetime.now(datetime.timezone.utc), '%Y-%m-%d %H:%M UTC')} — bench/bench_kernels.py\n\n"
        f"- device: {device}, torch {torch.__version__}; ops backend: {extension_status()}\n"
        f"- commit: {args.commit or git_commit()}\n"
        f"- command: `python {' '.join(sys.argv)}`\n"
        f"- device-to-device copy: {bandwidth / 1e12:.2f} TB/s (bytes read + written); bench took {time.time() - t0:.0f} s\n\n"
        f"{md}\n"
    )
    new_file = not os.path.exists(args.results)
    with open(args.results, "a") as f:
        if new_file:
            f.write("# Benchmark results\n\nAppend-only, newest last. Each entry: date, device, commit, command.\n")
        f.write(entry)
    print(f"appended to {args.results}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_kernels", "device": device, "torch": torch.__version__,
                       "ops": extension_status(), "copy_bytes_per_s": bandwidth,
                       "headers": list(Table.HEAD), "rows": [list(r) for r in table.rows]}, f, indent=1)


if __name__ == "__main__":
    main()
