"""Stop cleanly when the scheduler says time is up: SIGUSR1 / SIGTERM -> checkpoint -> requeue.

Slurm warns a job before its time limit with the signal named in `#SBATCH --signal` (our scripts
use USR1), and preempts or cancels it with SIGTERM followed, KillWait seconds later, by SIGKILL.
The trainer's side of the protocol:

    guard = PreemptionGuard().install()          # once, on every rank, before the loop
    for step in ...:
        trainer.step()
        if guard.should_stop():                  # collective: every rank calls it every step
            save_checkpoint(step)                # complete (all ranks' shards) when it returns
            return guard.preempted_exit(step)    # collective; EXIT_PREEMPTED for sys.exit()

The signal handler only sets a flag: doing work inside a Python signal handler would run it at an
arbitrary bytecode, possibly in the middle of a collective. `should_stop()` all-reduces the flags
(MAX) so that one rank receiving the signal is enough and all ranks stop after the *same* step;
a rank that acted on its own flag would leave the others waiting in the next step's collectives.

Two ways to ask, both seen by should_stop():
- a signal to the rank (SIGTERM from Slurm's preemption or time limit, or SIGUSR1 sent by hand);
- the stop-request file named by $VERL_MCORE_STOP_REQUEST, which scripts/slurm/launch.sh creates
  when *it* receives Slurm's warning signal. The launcher does not forward the signal to the job
  step, because Slurm would deliver it to every process of the step, including the trainer's
  helper processes (reward workers, checkpoint writers), which die of a SIGUSR1 they do not
  handle. The file is on the batch host, which also runs rank 0; one rank seeing it is enough.

The launcher turns EXIT_PREEMPTED into `scontrol requeue`; on the rerun `checkpoint.resume=auto`
picks up the newest complete checkpoint.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Iterable, Optional

from verl_mcore.distributed.groups import collective_device
from verl_mcore.utils.files import write_text_atomic

log = logging.getLogger(__name__)

# "Preempted, checkpoint written: requeue me." 75 is EX_TEMPFAIL in BSD sysexits.h ("temporary
# failure; the user is invited to retry"), which is exactly the meaning. It is not produced by
# Python (1 for an uncaught exception, 2 for usage errors), by our train.py (2 config error,
# 3 no trainer), by torchrun (1), by the shell (126, 127, 128+N for signal N, e.g. 143 for
# SIGTERM, 137 for SIGKILL), by `timeout` (124) or by srun (which passes task codes through and
# uses 1 / 253 / 255 for its own failures). scripts/slurm/launch.sh repeats this number.
EXIT_PREEMPTED = 75

# torchrun replaces a worker's exit code by its own (1), so the code alone cannot reach the batch
# script in torchrun mode. When the launcher sets this variable to a path, rank 0 also writes
# that file ("<step>\n") just before exiting with EXIT_PREEMPTED.
MARKER_ENV = "VERL_MCORE_PREEMPT_MARKER"

# The launcher creates this file to ask for a checkpoint-and-stop (see the module docstring).
REQUEST_ENV = "VERL_MCORE_STOP_REQUEST"

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    """Signal flag + a cross-rank agreement on when to stop.

    `group`: the process group to agree over (None: the default group, i.e. all ranks; it must
    contain every rank, since all must stop together). Without torch.distributed initialised the
    local flag decides alone (single-process runs).
    """

    def __init__(self, group=None, signals: Iterable[int] = DEFAULT_SIGNALS,
                 request_file: Optional[str] = None, armed: bool = True):
        """armed=False: until `arm()`, a signal ends the process at once (SystemExit 128 +
        signal): before the training loop there is no step boundary to stop at, and user code
        that blocks there (a dataset's reader) would otherwise keep a killed job alive."""
        self.group = group
        self.armed = armed
        self.signals = tuple(signals)
        # Checked with one stat() per should_stop() call.
        self.request_file = request_file or os.environ.get(REQUEST_ENV) or None
        self.received: Optional[int] = None  # the first signal number seen on this rank
        self._previous: dict[int, object] = {}
        self._stop_agreed = False

    def install(self) -> "PreemptionGuard":
        """Install the handlers (main thread only, as Python requires); returns self.

        The signals are also unblocked: a blocked mask is inherited through exec, and a
        launcher or CI supervisor that blocks SIGTERM would otherwise leave it pending forever,
        so the job could neither checkpoint nor die when the scheduler asks."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def arm(self) -> None:
        """From now on a signal is recorded and acted on at the next step boundary."""
        self.armed = True

    def _handle(self, signum, frame) -> None:
        if not self.armed:
            raise SystemExit(128 + signum)
        # Only record: the trainer acts at the next step boundary.
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        """This rank's view (no communication). Use should_stop() for the decision."""
        return self.received is not None or self._file_requested()

    def _file_requested(self) -> bool:
        return bool(self.request_file) and os.path.exists(self.request_file)

    def should_stop(self) -> bool:
        """True on every rank if any rank received a signal. Collective: call on all ranks.

        One all-reduce of a single integer over `group`; once true it stays true without
        communicating again (all ranks saw the same result, so they stay in step).
        """
        if self._stop_agreed:
            return True
        local = 1 if self.requested else 0
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            import torch

            flag = torch.tensor([local], dtype=torch.int32, device=collective_device(self.group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            local = int(flag.item())
        self._stop_agreed = bool(local)
        if self._stop_agreed:
            if self.received:
                name = signal.Signals(self.received).name
            elif self._file_requested():
                name = f"stop-request file {self.request_file}"
            else:
                name = "by another rank"
            log.warning("preemption requested (%s): stopping at this step boundary", name)
        return self._stop_agreed

    def preempted_exit(self, step: int, rank: Optional[int] = None) -> int:
        """Call on every rank once the checkpoint is complete; returns EXIT_PREEMPTED.

        Rank 0 (`rank`, default the global rank) writes the launcher's marker file (when
        MARKER_ENV is set), then all ranks meet in a barrier, so no rank exits before the marker
        exists: srun --kill-on-bad-exit kills the remaining ranks as soon as the first one exits,
        and the step's exit code may then be 143 instead of 75.
        """
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        path = os.environ.get(MARKER_ENV)
        if path and rank == 0:
            write_text_atomic(path, f"{step}\n")  # the launcher never sees a half-written marker
        if distributed:
            dist.barrier(group=self.group)
        log.warning("checkpoint of step %d written; exiting with %d (EXIT_PREEMPTED) to be requeued",
                    step, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
