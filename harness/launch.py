"""The launcher behind run_train.sh: validate the config, then start the worker(s) and exit with their code.

    python -m harness.launch [--config FILE] [--section.key value ...]      (no --config: the embedded default)

- A bad config fails here, before any worker starts: one `error:` line, exit 2, in a fraction of a second
  (nothing heavier than the config and the models' plain-Python flavors is imported).
- One process in all (NGPU=1, NNODES=1): the worker runs in this process, with its own exit code.
- Otherwise torchrun starts NGPU workers per node. Worker output passes through as it comes; torchrun's own
  lines are held back and shown only when a worker failed without saying why (a crash). A worker that stops
  for a known reason (2 bad input, 3 divergence, 0 SIGTERM, 130 Ctrl-C) leaves its code in QWEN35_EXIT_DIR
  and the launcher exits with it, after the worker's one line, without torchrun's traceback; that line too, which
  the launcher prints at the end if it came from a rank whose output LOG_RANK hides (bad data met by one rank).
- Signals: torchrun and its workers run in a process group of their own, so a terminal's Ctrl-C reaches this launcher
  alone, as `kill -INT <launcher pid>` does; the launcher passes SIGINT and SIGTERM on to each worker once
  (`SignalForwarder`): one Ctrl-C saves and exits 130, a second stops at once, SIGTERM saves and exits 0, whatever
  the number of processes. (Had torchrun received the terminal's Ctrl-C as well, it would have passed on a second
  one, which a worker takes for "stop now, without saving".)
- CPU runs get their threads chosen, unless OMP_NUM_THREADS / OMP_WAIT_POLICY are set: the usable cores
  split evenly over this node's processes, and OpenMP threads that sleep rather than spin while they wait
  (`cpu_thread_settings`).
Environment: NGPU (processes per node; default: the visible GPUs, else 1), NNODES, RDZV_ENDPOINT, RDZV_ID,
LOG_RANK (ranks whose output is shown, default 0).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .atomic_file import write_whole
from .config import ConfigError, check_launch, with_default_config
from .gpus import visible_gpus
from .train import BAD_INPUT, ERROR_FILE, EXIT_FILE, INTERRUPTED, PID_FILE, STARTING, STOP_FILE, recorded


def _error_line(rank, error: str) -> str:
    """A worker's `error: ...` line as the launcher shows it, `error: ... (rank R)`: it starts with `error:` under
    torchrun too, where torchrun tags each worker line `[rankR]:`."""
    return f"{error.rstrip()} (rank {rank})\n"


def cpu_thread_settings(procs_per_node: int, environ: dict[str, str]) -> dict[str, str]:
    """OpenMP settings for CPU workers, where `environ` does not set them already.

    All usable cores, shared by the node's processes, waiting passively: spinning threads are a little faster on an
    idle host and far slower when another process keeps a core busy (docs/performance.md, "Start-up and CPU"); one
    thread is slower on an idle host ("Tried, not kept")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    settings = {"OMP_NUM_THREADS": str(max(1, cores // procs_per_node)), "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in settings.items() if k not in environ}


def main(argv: list[str] | None = None) -> int:
    # SIGINT stops a launch also where it started ignored (a job put in the background by a script): sent to the
    # launcher, it is a Ctrl-C, as the workers take it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = with_default_config(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .config.help import config_help

        print(config_help(argv))
        return 0
    nproc = int(os.environ.get("NGPU") or visible_gpus() or 1)
    nnodes = int(os.environ.get("NNODES", "1"))
    try:
        check_launch(argv, nproc * nnodes)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    if visible_gpus() == 0:  # before torch loads OpenMP, here or in the workers (who inherit the environment)
        os.environ.update(cpu_thread_settings(nproc, os.environ))
    if nproc * nnodes == 1:
        from .train import main as train

        return train(argv)
    return run_torchrun(argv, nproc, nnodes)


def run_torchrun(argv: list[str], nproc: int, nnodes: int) -> int:
    exit_dir = tempfile.mkdtemp(prefix="qwen35-exit-")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={os.environ.get('RDZV_ENDPOINT', 'localhost:0')}",
           f"--rdzv-id={os.environ.get('RDZV_ID', 'qwen35')}", f"--local-ranks-filter={os.environ.get('LOG_RANK', '0')}",
           "--role=rank", "--tee=3", "-m", "harness.train", *argv]
    env = {**os.environ, "QWEN35_EXIT_DIR": exit_dir}
    held = []  # torchrun's own stderr lines: its traceback after a worker fails, start-up warnings
    forward = SignalForwarder(Path(exit_dir))
    # Caught from before torchrun starts: a signal in between is passed on once it runs.
    handlers = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in (signal.SIGHUP, signal.SIGQUIT):  # a closed terminal, Ctrl-\: torchrun ends its workers
        if signal.getsignal(signum) is not signal.SIG_IGN:  # (under nohup SIGHUP stays ignored)
            handlers[signum] = signal.signal(signum, forward.to_torchrun)
    try:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        forward.started(proc)
        shown = []
        for line in proc.stderr:
            if line.startswith("[rank"):  # a worker's line, tee'd by torchrun
                tag, _, text = line.partition("]:")
                if text.startswith("error: "):  # the one error line starts with `error:` here too, naming its rank
                    line = _error_line(tag.removeprefix("[rank"), text)
                sys.stderr.write(line)
                shown.append(line)
            else:
                held.append(line)
        returncode = proc.wait()
        codes = [int(code) for code in recorded(exit_dir, EXIT_FILE).values()]
        errors = recorded(exit_dir, ERROR_FILE)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        shutil.rmtree(exit_dir, ignore_errors=True)
    if returncode != 0 and codes:  # the workers stopped for a known reason (torchrun reports any stop as failed)
        for rank, error in sorted(errors.items()):
            if not any(error.rstrip() in line for line in shown):  # a rank LOG_RANK hides met it alone: its line
                sys.stderr.write(_error_line(rank, error))
                shown.append(error)
        return max(codes)  # every rank reports the same reason; the larger code wins if they differ
    if returncode != 0 and forward.received is not None:  # stopped before any worker could say so
        interrupted = forward.received == signal.SIGINT
        print(STARTING if interrupted else "stopped on SIGTERM while starting; nothing saved", file=sys.stderr)
        return INTERRUPTED if interrupted else 0
    if returncode != 0:
        sys.stderr.writelines(held)
    return returncode


class SignalForwarder:
    """Passes SIGINT and SIGTERM, received by the launcher, on to this node's workers, each signal to each worker once.

    Straight to the workers, by the pids they leave in QWEN35_EXIT_DIR as they start (`worker_pids`), not through
    torchrun: torchrun would pass the signal on too, but then kill any worker still saving 30 s later. A worker not
    yet started finds the request in the folder's `stop` file, written first, and sends itself the signal
    (harness/train.py): no worker misses it, whenever it starts. torchrun is signalled only while no worker has
    started (it may be waiting for other nodes, and is to stop waiting), once: a second signal would end torchrun at
    once, leaving its workers behind."""

    def __init__(self, exit_dir: Path):
        self.exit_dir = exit_dir
        self.torchrun: subprocess.Popen | None = None
        self.received: int | None = None  # the first signal received
        self.torchrun_signalled = False

    def started(self, torchrun: subprocess.Popen) -> None:
        self.torchrun = torchrun
        if self.received is not None:  # received while torchrun was starting
            self._signal_torchrun_if_no_worker_runs(self.received)

    def __call__(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            write_whole(self.exit_dir / STOP_FILE, str(signum))
        for pid in worker_pids(self.exit_dir):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # it has ended already
                pass
        if self.torchrun is not None:
            self._signal_torchrun_if_no_worker_runs(signum)

    def _signal_torchrun_if_no_worker_runs(self, signum: int) -> None:
        if not worker_pids(self.exit_dir) and not self.torchrun_signalled and self.torchrun.poll() is None:
            self.torchrun_signalled = True
            self.torchrun.send_signal(signum)

    def to_torchrun(self, signum: int, frame) -> None:
        if self.torchrun is not None and self.torchrun.poll() is None:
            self.torchrun.send_signal(signum)


def worker_pids(exit_dir: Path) -> list[int]:
    """The pids this node's workers have recorded (each file written whole: `write_whole`)."""
    return [int(p.read_text()) for p in exit_dir.glob(f"{PID_FILE}*")]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before a worker has its own handler: one line, no traceback
        print(STARTING, file=sys.stderr)
        sys.exit(INTERRUPTED)
