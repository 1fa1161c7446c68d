"""run_train.sh as a user runs it (a subprocess): exit codes, one-line errors, --help, any interpreter and any
directory, the run's account (config.toml, summary)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import load_config

REPO = Path(__file__).resolve().parents[2]
RUN_TRAIN = str(REPO / "run_train.sh")
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "false"]


def run_train(*args, cwd=REPO, ngpu="1", python=sys.executable, timeout=900) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": ngpu, "PYTHON": python, "OMP_NUM_THREADS": "1"}
    return subprocess.run([RUN_TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ngpu", ["1", "2"])
def test_bad_key_is_one_error_line_and_exit_2_before_any_worker_starts(ngpu, tmp_path):
    result = run_train("--training.step", "5", "--job.dump_folder", str(tmp_path / "o"), ngpu=ngpu)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: command line: unknown option --training.step (did you mean "
                                          "--training.steps?)"]
    assert result.stdout == "" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("ngpu", ["8", "1"])
def test_all_unset_placeholders_of_the_35b_config_are_named_at_once(ngpu):
    # Everything is checked before any worker starts, so no GPU is needed. On the 8 GPUs it asks for (EP=8) the
    # placeholders are all that is wrong; on one process the expert-parallel degree is too, and hides none of them.
    result = run_train("--config", str(REPO / "train_configs" / "qwen35_moe.toml"), ngpu=ngpu)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    for key in ("training.dataset_path", "model.tokenizer_path", "checkpoint.initial_load_hf"):
        assert key in result.stderr, key
    assert ("expert_parallel_degree = 8 must divide" in result.stderr) == (ngpu == "1")


def test_an_unknown_key_a_wrong_type_and_a_missing_path_are_one_error_line(tmp_path):
    result = run_train("--training.stesp", "5", "--optimizer.lr", "abc", "--training.dataset_path", "/nope",
                       "--job.dump_folder", str(tmp_path / "o"))
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "o").exists()
    assert result.stderr.splitlines() == [
        "error: the run cannot start, 3 problems: (1) command line: unknown option --training.stesp (did you mean "
        "--training.steps?); (2) command line: optimizer.lr = 'abc' is not a number; (3) training.dataset_path "
        "'/nope' does not exist; set it in the config file or with --training.dataset_path PATH"]


@pytest.mark.parametrize("bad", ["config", "data"])
def test_bad_input_under_torchrun_itself_is_one_error_line_not_one_per_rank(bad, tmp_path):
    """torchrun started by hand, without the launcher's check first (nor its filter of rank 0's output): every rank
    finds the same problems in the config, or learns of the bad line a rank met while the ranks tokenize together;
    rank 0 names them, the others exit with the same code, silently."""
    exits = tmp_path / "exits"  # each rank's exit code (as under the launcher)
    exits.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a fine document"}\n{"text": "cut off\n' + '{"text": "another"}\n' * 40)
    flags = (["--training.stesp", "5"] if bad == "config" else
             ["--training.dataset_path", str(data), "--training.dataset_source", "jsonl", "--training.steps", "1"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "QWEN35_EXIT_DIR": str(exits)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "harness.train",
                             *flags, "--job.dump_folder", str(tmp_path / "o")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    if bad == "config":
        assert errors == ["error: command line: unknown option --training.stesp (did you mean --training.steps?)"]
    else:
        assert len(errors) == 1 and f"{data}:2: not a JSON object" in errors[0], errors
    codes = {p.name: p.read_text() for p in exits.glob("rank*")}  # torchrun may end rank 1 before it records its own
    assert codes["rank0"] == "2" and set(codes.values()) == {"2"}


# Fault injection: Python imports sitecustomize from PYTHONPATH at start-up, in each worker. Rank 1 still reading its
# config (held there, as a loaded machine may hold it) when rank 0 has already exited with its error.
SLOW_RANK_1 = """
import os, time
if os.environ.get("RANK") == "1":
    import harness.config as config
    check = config.check_launch
    def slow(*args):
        time.sleep(60)
        return check(*args)
    config.check_launch = slow
"""
RANK_0_FAILS = """
import os
if os.environ.get("RANK") == "0":
    import harness.trainer as trainer
    from harness.data.errors import DataError
    def failing(self, cfg):
        raise DataError("row 3 of shard 0 is damaged")
    trainer.Trainer.__init__ = failing
"""


def test_a_rank_torchrun_ends_while_it_starts_records_nothing_of_its_own(tmp_path):
    """torchrun ends rank 1 (SIGTERM) while it still reads the config rank 0 already refused: rank 1 adds no code of
    its own (143) beside rank 0's 2, and prints nothing."""
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(SLOW_RANK_1)
    exits = tmp_path / "exits"
    exits.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fault'}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "QWEN35_EXIT_DIR": str(exits)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "harness.train",
                             "--training.stesp", "5", "--job.dump_folder", str(tmp_path / "o")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert errors == ["error: command line: unknown option --training.stesp (did you mean --training.steps?)"]
    assert "while starting" not in result.stderr
    assert {p.name: p.read_text() for p in exits.glob("rank*")} == {"rank0": "2"}


def test_the_launcher_exits_with_the_failed_ranks_code_not_the_sigterm_torchrun_gave_a_starting_peer(tmp_path):
    """Under run_train.sh: rank 0 meets bad data building the trainer (its own error, not every rank's) while rank 1
    is still starting; torchrun ends rank 1, and the run exits 2 with rank 0's one line, not 143."""
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(SLOW_RANK_1 + RANK_0_FAILS)
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(tmp_path / "fault")}
    result = subprocess.run([RUN_TRAIN, *FAST, "--job.dump_folder", str(tmp_path / "o")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["error: row 3 of shard 0 is damaged (rank 0)"], result.stderr[-3000:]
    assert "while starting" not in result.stderr


DATA_FAULT = """
import os
if os.environ.get("RANK") == "1":
    import harness.data.cached as cached
    from harness.data.errors import DataError
    fetch, calls = cached.TokenCacheLoader.__next__, []
    def failing(self):
        calls.append(1)
        if len(calls) == 6:
            raise DataError("row 7 of shard 3 is damaged")
        return fetch(self)
    cached.TokenCacheLoader.__next__ = failing
"""


def test_bad_data_met_by_one_hidden_rank_mid_training_is_its_one_error_line_and_no_peer_traceback(tmp_path):
    """Rank 1 alone (its output hidden: LOG_RANK defaults to 0) meets bad data at step 6, after a checkpoint: the
    run exits 2 with rank 1's line, not rank 0's traceback of the collective that broke with it, and the
    checkpoint saved before stays whole."""
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(DATA_FAULT)
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(tmp_path / "fault")}
    env.pop("LOG_RANK", None)
    result = subprocess.run([RUN_TRAIN, *FAST, "--training.steps", "12", "--checkpoint.enable", "true",
                             "--checkpoint.interval", "4", "--job.dump_folder", str(tmp_path / "o")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["error: row 7 of shard 3 is damaged (rank 1)"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    steps = sorted(p.name for p in (tmp_path / "o" / "checkpoint").glob("step-*"))
    assert steps == ["step-4"] and (tmp_path / "o" / "checkpoint" / "step-4" / "COMPLETE").is_file()


@pytest.mark.parametrize("ngpu", ["1", "2"])
def test_divergence_exits_3_with_the_workers_error_and_no_launcher_traceback(ngpu, tmp_path):
    result = run_train(*FAST, "--training.steps", "6", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0",
                       "--job.dump_folder", str(tmp_path / "o"), ngpu=ngpu)
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors and errors[0].startswith("error: step") and (ngpu == "1" or errors[0].endswith("(rank 0)"))
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_sigint_sent_to_the_launcher_alone_saves_and_exits_130_with_two_processes(tmp_path):
    """`kill -INT <launcher pid>`, not the terminal's Ctrl-C to the whole process group: the launcher passes it on to
    each worker once; they save, stop together, and the launcher exits 130 after one line, as after Ctrl-C."""
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = [*FAST, "--training.steps", "20", "--metrics.log_freq", "1", "--checkpoint.enable", "true",
           "--checkpoint.interval", "100", "--checkpoint.export_hf_at_end", "false", "--job.dump_folder",
           str(tmp_path / "o")]
    launcher = subprocess.Popen([RUN_TRAIN, *run], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # a process group of its own, as a shell job has
    for line in launcher.stdout:
        if re.search(r"step +1/20", line):
            os.kill(launcher.pid, signal.SIGINT)
            break
    _, err = launcher.communicate(timeout=900)
    assert launcher.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1 and "saved checkpoint" in lines[0], err[-3000:]
    step = int(re.search(r"interrupted at step (\d+)", lines[0]).group(1))
    assert step < 20 and (tmp_path / "o" / "checkpoint" / f"step-{step}" / "COMPLETE").is_file()
    assert "Traceback" not in err


def test_the_launcher_signals_each_worker_once_and_one_not_yet_started_signals_itself(tmp_path):
    """SignalForwarder: a signal goes to the workers that have left their pid, and to torchrun only while none has
    (it may be waiting for other nodes); a worker that starts later finds it in the `stop` file and takes it then
    (harness.train: one line, exit 130)."""
    from harness.launch import SignalForwarder

    counting = ("import os, signal, sys, time; got = []; signal.signal(signal.SIGINT, lambda *a: got.append(1)); "
                "open(os.environ['QWEN35_EXIT_DIR'] + '/pid.rank0', 'w').write(str(os.getpid())); print(flush=True); "
                "time.sleep(0.5); print(len(got))")
    for folder in (tmp_path / "started", tmp_path / "starting"):
        folder.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "QWEN35_EXIT_DIR": str(folder), "RANK": "0"}
        torchrun = subprocess.Popen(["sleep", "30"])
        try:
            forward = SignalForwarder(folder)
            forward.started(torchrun)
            if folder.name == "started":
                worker = subprocess.Popen([sys.executable, "-c", counting], env=env, stdout=subprocess.PIPE, text=True)
                worker.stdout.readline()  # its pid is recorded
                forward(signal.SIGINT, None)
                assert worker.communicate(timeout=600)[0].strip() == "1" and torchrun.poll() is None
            else:
                forward(signal.SIGINT, None)
                assert torchrun.wait(timeout=600) == -signal.SIGINT
                late = subprocess.run([sys.executable, "-m", "harness.train", "--job.dump_folder", str(folder / "o")],
                                      env=env, capture_output=True, text=True, timeout=600)
                assert late.returncode == 130 and late.stderr == "interrupted while starting; nothing saved\n"
                assert (folder / "rank0").read_text() == "130"
        finally:
            torchrun.kill()


def test_help_lists_every_key_with_the_runs_value_the_builtin_default_and_comment():
    """The values are those of the run the same command line would start: the embedded default's config file,
    then the overrides given with --help."""
    result = run_train("--help")
    assert result.returncode == 0
    from harness.config import ALL_KEYS

    for key in ALL_KEYS:
        assert f"--{key}  (" in result.stdout, key
    assert "--training.steps  (int, 200, built-in 10)\n      optimizer steps to run" in result.stdout
    assert "--optimizer.lr  (float, 0.003, built-in 0.0008)" in result.stdout
    assert "--metrics.enable_tensorboard  (bool, true)" in result.stdout  # the same in both: shown once
    assert "python -m harness.train" not in result.stdout
    assert run_train("-h").stdout == result.stdout
    assert "--training.steps  (int, 7, built-in 10)" in run_train("--training.steps", "7", "--help").stdout


def test_python_variable_picks_the_interpreter_and_one_without_torch_is_one_error_line(tmp_path):
    no_site = tmp_path / "python_without_packages"
    no_site.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages, so no torch
    no_site.chmod(0o755)
    result = run_train("--training.steps", "1", python=str(no_site))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "cannot import torch" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_embedded_default_runs_from_another_directory_and_accounts_for_itself(tmp_path):
    """From an unrelated folder, with the interpreter named by PYTHON (no activated venv, no repo on PATH)."""
    result = run_train(*FAST, "--training.steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "outputs" / "debug_model"  # job.dump_folder is relative to the current directory
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "done: 2 steps, 512 tokens" in result.stdout and str(out) in result.stdout
    # The saved config repeats the run from anywhere: it loads back to the same settings.
    saved = load_config(["--config", str(out / "config.toml")])
    assert saved.training.steps == 2 and saved.training.seq_len == 64
    assert saved.training.dataset_path == str(REPO / "data" / "debug_corpus" / "train.jsonl")
    assert load_config(["--config", str(out / "config.toml")]) == saved


def test_the_code_run_is_the_scripts_own_whatever_the_current_directory_holds(tmp_path):
    (tmp_path / "harness").mkdir()  # as inside another checkout of the project
    (tmp_path / "harness" / "__init__.py").write_text("")
    (tmp_path / "harness" / "launch.py").write_text("print('another checkout')\n")
    result = run_train("--help", cwd=tmp_path)
    assert result.returncode == 0 and "another checkout" not in result.stdout and "--training.steps" in result.stdout


def test_cpu_threads_are_split_over_the_processes_and_wait_passively_unless_set():
    from harness.launch import cpu_thread_settings

    cores = len(os.sched_getaffinity(0))
    assert cpu_thread_settings(1, {}) == {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_thread_settings(2 * cores, {})["OMP_NUM_THREADS"] == "1"  # never 0
    assert cpu_thread_settings(1, {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}) == {}
