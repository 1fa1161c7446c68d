import pytest

from harness.config import ConfigError, JobConfig, load_config, validate_parallelism, with_default_config
from harness.config.help import config_help


@pytest.fixture
def toml_file(tmp_path):
    def write(text: str, name: str = "run.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


def cfg_with(**parallel_and_batch) -> JobConfig:
    cfg = JobConfig()
    for key, value in parallel_and_batch.items():
        section = cfg.training if hasattr(cfg.training, key) else cfg.parallelism
        setattr(section, key, value)
    return cfg


# --- loading -------------------------------------------------------------------------------------

def test_defaults_load_without_a_file():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 10 and cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.to_dict()["parallelism"]["data_parallel_shard_degree"] == -1


def test_toml_file_sets_values(toml_file):
    path = toml_file("""
[job]
name = "exp1"
[training]
steps = 20
max_norm = 2          # an int is a valid float
dataset_source = "jsonl"
[lr_scheduler]
decay_ratio = 0.2
[checkpoint]
enable = true
""")
    cfg = load_config(["--config", path])
    assert cfg.job.name == "exp1"
    assert cfg.training.steps == 20 and cfg.training.dataset_source == "jsonl"
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.lr_scheduler.decay_ratio == 0.2
    assert cfg.checkpoint.enable is True
    assert cfg.training.seq_len == 256  # untouched keys keep defaults


@pytest.mark.parametrize("style", ["space", "equals"])
def test_cli_overrides_beat_the_file(toml_file, style):
    path = toml_file("[training]\nsteps = 20\n[optimizer]\nlr = 1e-3\n")
    flags = {"training.steps": "7", "optimizer.lr": "1e-4", "job.description": "a b"}
    args = [x for k, v in flags.items() for x in ([f"--{k}", v] if style == "space" else [f"--{k}={v}"])]
    cfg = load_config(["--config", path, *args])
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.job.description == "a b"


def test_cli_accepts_negative_numbers_and_none():
    cfg = load_config(["--training.aux_loss_coef", "-1", "--lr_scheduler.decay_ratio", "0.1",
                       "--lr_scheduler.decay_ratio=None"])
    assert cfg.training.aux_loss_coef == -1.0
    assert cfg.lr_scheduler.decay_ratio is None  # the later override wins


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("False", False), ("1", True), ("0", False), ("YES", True), ("no", False)])
def test_cli_bool_parsing(text, expected):
    assert load_config([f"--checkpoint.enable={text}"]).checkpoint.enable is expected


def test_betas_from_toml_and_cli(toml_file):
    path = toml_file("[optimizer]\nbetas = [0.8, 0.99]\n")
    assert load_config(["--config", path]).optimizer.betas == [0.8, 0.99]
    assert load_config(["--config", path, "--optimizer.betas", "0.9,0.999"]).optimizer.betas == [0.9, 0.999]


@pytest.mark.parametrize("flag", ['experts,lm_head', '["experts", "lm_head"]', "['experts','lm_head']", "[experts, lm_head,]"])
def test_a_list_of_names_on_the_command_line_may_be_written_as_in_toml(flag):
    """Quotes are no part of a name: a TOML-style list on the command line gives the same names as a bare one."""
    cfg = load_config(["--quantize.grouped_mm_float8_fqns", flag, "--quantize.linear_float8_filter_fqns", '[""]'])
    assert cfg.quantize.grouped_mm_float8_fqns == ["experts", "lm_head"]
    assert cfg.quantize.linear_float8_filter_fqns == []


# --- bad input -----------------------------------------------------------------------------------

def test_missing_config_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(["--config", missing])


def test_malformed_toml_names_file_and_line(toml_file):
    path = toml_file("[training]\nsteps = 5\nseq_len 256\n", name="broken.toml")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    assert "broken.toml" in str(e.value) and "line 3" in str(e.value)


def test_unknown_cli_key_suggests_the_close_one():
    with pytest.raises(ConfigError) as e:
        load_config(["--training.step", "5"])
    assert "training.step" in str(e.value) and "did you mean --training.steps?" in str(e.value)


def test_unknown_section_and_key_in_file_are_named(toml_file):
    path = toml_file("[trainig]\nsteps = 5\n", name="a.toml")
    with pytest.raises(ConfigError, match=r"a\.toml.*\[trainig\].*did you mean \[training\]"):
        load_config(["--config", path])
    path = toml_file("[optimizer]\nlearning_rate = 1.0\n", name="b.toml")
    with pytest.raises(ConfigError, match=r"b\.toml.*optimizer\.learning_rate"):
        load_config(["--config", path])


def test_top_level_key_in_file_points_to_its_section(toml_file):
    path = toml_file("steps = 5\n", name="flat.toml")
    with pytest.raises(ConfigError, match=r"flat\.toml.*'steps'.*\[training\]"):
        load_config(["--config", path])


def test_unknown_cli_section_is_rejected():
    with pytest.raises(ConfigError, match="--trainer.steps"):
        load_config(["--trainer.steps", "5"])


def test_wrong_cli_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as e:
        load_config(["--training.steps", "banana"])
    msg = str(e.value)
    assert "training.steps" in msg and "banana" in msg and "integer" in msg


@pytest.mark.parametrize("toml,key", [
    ('[training]\nsteps = "ten"\n', "training.steps"),
    ("[training]\nsteps = true\n", "training.steps"),  # bool is not an int
    ("[training]\ndeterministic = 1\n", "training.deterministic"),
    ('[optimizer]\nbetas = [0.9, "x"]\n', "optimizer.betas"),
    ("[model]\nflavor = 3\n", "model.flavor"),
])
def test_wrong_type_in_file_names_file_and_key(toml_file, toml, key):
    path = toml_file(toml, name="typed.toml")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    assert "typed.toml" in str(e.value) and key in str(e.value)


def test_bad_bool_on_cli_is_rejected():
    with pytest.raises(ConfigError, match="checkpoint.enable"):
        load_config(["--checkpoint.enable=maybe"])


@pytest.mark.parametrize("argv", [["--training.steps"], ["--training.steps", "--training.seq_len", "8"],
                                  ["--config"]])
def test_flag_without_value_is_rejected(argv):
    with pytest.raises(ConfigError, match=argv[0].lstrip("-")):
        load_config(argv)


def test_positional_argument_is_rejected():
    with pytest.raises(ConfigError, match="stray"):
        load_config(["stray"])


@pytest.mark.parametrize("flag,value", [("activation_checkpoint.mode", "partial"),
                                        ("model.fla_hopper_backward", "on"),  # only auto / off
                                        ("checkpoint.export_dtype", "fp8"),
                                        ("training.dataset_source", "csv")])
def test_value_outside_choices_is_rejected_with_the_choices(flag, value):
    with pytest.raises(ConfigError) as e:
        load_config([f"--{flag}={value}"])
    assert flag in str(e.value) and value in str(e.value) and "one of" in str(e.value)


@pytest.mark.parametrize("flag", ["training.steps", "training.seq_len", "training.local_batch_size",
                                  "metrics.log_freq"])
def test_non_positive_sizes_are_rejected(flag):
    with pytest.raises(ConfigError, match=flag):
        load_config([f"--{flag}=0"])


@pytest.mark.parametrize("argv, message", [
    (["--training.loss_chunk_tokens=-1"], "training.loss_chunk_tokens must be >= 0"),
    (["--training.mtp_loss_coef=-0.1"], "training.mtp_loss_coef must be >= 0"),
    (["--training.mtp_loss_coef=nan"], "training.mtp_loss_coef must be a finite number"),
    (["--model.mtp_num_hidden_layers=-2"], "model.mtp_num_hidden_layers must be -1"),
    (["--profiling.enable_profiling=true", "--profiling.profile_freq=1"], "profiling.profile_freq must be >= 2"),
])
def test_impossible_loss_chunk_and_profile_freq_are_rejected(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


@pytest.mark.parametrize("lr", ["0", "-1e-3"])
def test_non_positive_lr_is_rejected(lr):
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_config([f"--optimizer.lr={lr}"])


@pytest.mark.parametrize("max_norm", ["0", "-1", "nan"])
def test_non_positive_max_norm_is_rejected_and_none_disables_clipping(max_norm, toml_file):
    # 0 used to zero every gradient (clip to norm 0) and a negative value to skip clipping silently.
    with pytest.raises(ConfigError, match="training.max_norm must be (positive, or none|a finite number)"):
        load_config([f"--training.max_norm={max_norm}"])
    assert load_config(["--training.max_norm", "none"]).training.max_norm is None
    assert load_config(["--config", toml_file('[training]\nmax_norm = "none"\n')]).training.max_norm is None


def test_warmup_running_into_the_decay_window_is_rejected():
    # 100 steps, decay over the last 80: decay starts after step 20, so a 50-step warmup would end with the
    # lr dropping from ~1.0 to the middle of the cosine (0.67) at step 51.
    flags = ["--training.steps", "100", "--lr_scheduler.decay_ratio", "0.8"]
    with pytest.raises(ConfigError, match=r"warmup_steps = 50 runs into the decay phase, which starts after step 20"):
        load_config([*flags, "--lr_scheduler.warmup_steps", "50"])
    assert load_config([*flags, "--lr_scheduler.warmup_steps", "20"]).lr_scheduler.warmup_steps == 20


def test_lr_never_jumps_over_an_accepted_schedule():
    """Every schedule the config accepts moves the lr by at most one warmup increment or one decay step."""
    from harness.optim.lr_schedule import lr_factor

    for steps, warmup, ratio in [(100, 20, 0.8), (100, 10, None), (50, 0, 0.5), (30, 29, 0.0), (10, 20, None)]:
        cfg = load_config(["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup),
                           "--lr_scheduler.decay_ratio", str(ratio).lower()])
        s = cfg.lr_scheduler
        f = [lr_factor(n, steps, s.warmup_steps, s.decay_ratio, "linear", 0.1) for n in range(1, steps + 1)]
        biggest = max(abs(b - a) for a, b in zip(f, f[1:]))
        assert biggest <= max(1 / (min(warmup, steps) + 1), 1 / max(1, round(steps * (ratio or 1)))) + 1e-9, (
            steps, warmup, ratio, biggest)


def test_every_problem_of_a_launch_is_named_at_once(tmp_path):
    """An unknown key, a wrong type and a missing path: one ConfigError numbering all three, not the first alone."""
    from harness.config import check_launch

    with pytest.raises(ConfigError) as e:
        check_launch(["--training.stesp", "5", "--optimizer.lr", "abc", "--training.dataset_path",
                      str(tmp_path / "nope")], world_size=1)
    assert e.value.problems == [
        "command line: unknown option --training.stesp (did you mean --training.steps?)",
        "command line: optimizer.lr = 'abc' is not a number",
        f"training.dataset_path '{tmp_path / 'nope'}' does not exist; set it in the config file or with "
        f"--training.dataset_path PATH"]
    assert str(e.value).startswith("the run cannot start, 3 problems: (1) command line: unknown option")
    assert "(2) command line: optimizer.lr" in str(e.value) and "(3) training.dataset_path" in str(e.value)


def test_problems_of_the_file_and_the_command_line_are_named_together(toml_file):
    path = toml_file('steps = 5\n[trainig]\nx = 1\n[training]\nsteps = "ten"\nsequence = 3\n', name="many.toml")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path, "stray", "--optimizer.lr", "-1", "--metrics.log_freq"])
    text = "\n".join(e.value.problems)
    for expected in ("unexpected argument 'stray'", "--metrics.log_freq needs a value",
                     "many.toml: top-level key 'steps'", "many.toml: unknown section [trainig]",
                     "many.toml: training.steps = 'ten' is not an integer", "many.toml: unknown key training.sequence",
                     "optimizer.lr must be positive, got -1.0"):
        assert expected in text, expected
    assert len(e.value.problems) == 7, text


def test_a_malformed_file_keeps_its_line_beside_the_command_lines_problems(toml_file):
    path = toml_file("[training]\nsteps = 5\nseq_len 256\n", name="broken.toml")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path, "--training.stesp", "3"])
    assert len(e.value.problems) == 2 and e.value.partial is None  # nothing of the file can be checked further
    assert "did you mean --training.steps?" in e.value.problems[0]
    assert "broken.toml: invalid TOML" in e.value.problems[1] and "line 3" in e.value.problems[1]


def test_a_malformed_file_keeps_the_command_lines_wrong_values_beside_it(toml_file):
    path = toml_file("[training\nsteps = 5\n", name="broken.toml")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path, "--optimizer.lr", "abc", "--training.steps", "3"])
    assert e.value.problems[0] == "command line: optimizer.lr = 'abc' is not a number"
    assert len(e.value.problems) == 2 and "broken.toml: invalid TOML" in e.value.problems[1]


def test_a_model_hf_config_of_another_model_is_named_beside_the_other_problems(tmp_path):
    from harness.config import check_launch

    other = tmp_path / "config.json"
    other.write_text('{"model_type": "llama", "hidden_size": 64}')  # defaults for the rest: a 40-layer model
    with pytest.raises(ConfigError) as e:
        check_launch(with_default_config(["--training.stesp", "3", "--model.hf_config", str(other)]), world_size=1)
    assert len(e.value.problems) == 2 and "did you mean --training.steps?" in e.value.problems[0]
    assert e.value.problems[1] == (f"model.hf_config {str(other)!r}: model_type 'llama' is not a Qwen3.5-MoE model "
                                   "(one of qwen3_5_moe, qwen3_5_moe_text)")


def test_a_refused_value_is_not_judged_again_through_its_default():
    """training.steps 'q' leaves the default 10 in its place: the warmup-into-decay check (which reads steps) and the
    batch layout (which reads local_batch_size) would judge values nobody gave, so they are skipped."""
    from harness.config import check_launch

    with pytest.raises(ConfigError) as e:
        check_launch(with_default_config([
            "--training.steps", "q", "--lr_scheduler.decay_ratio", "0.9", "--lr_scheduler.warmup_steps", "5",
            "--training.local_batch_size", "x", "--training.global_batch_size", "3"]), world_size=1)
    assert e.value.problems == ["command line: training.steps = 'q' is not an integer",
                                "command line: training.local_batch_size = 'x' is not an integer"]


def test_parallel_degrees_and_batch_problems_join_the_values_problems():
    from harness.config import check_launch

    with pytest.raises(ConfigError) as e:
        check_launch(with_default_config(["--training.steps", "0", "--training.local_batch_size", "0",
                                          "--parallelism.context_parallel_degree", "0"]), world_size=1)
    assert e.value.problems == ["training.steps must be positive, got 0",
                                "training.local_batch_size must be positive, got 0",  # named once
                                "parallelism.context_parallel_degree must be >= 1, got 0"]


@pytest.mark.parametrize("entry_point", ["launch", "train"])
def test_a_config_error_is_one_error_line_and_exit_code_2_from_each_entry_point(entry_point, capsys, monkeypatch):
    """The launcher (before any worker starts) and a worker (under torchrun started by hand) alike."""
    import importlib
    import signal

    main = importlib.import_module(f"harness.{entry_point}").main
    monkeypatch.setenv("NGPU", "1")
    monkeypatch.delenv("QWEN35_EXIT_DIR", raising=False)
    interrupt = signal.getsignal(signal.SIGINT)  # the launcher sets its own
    try:
        assert main(["--training.steps", "0"]) == 2
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert capsys.readouterr().err.strip() == "error: training.steps must be positive, got 0"


# --- parallelism and batch -----------------------------------------------------------------------

def test_parallelism_resolves_shard_degree_from_the_world():
    cfg = cfg_with(data_parallel_replicate_degree=2, context_parallel_degree=2)
    d = validate_parallelism(cfg, world_size=8).dims
    assert (d.dp_replicate, d.dp_shard, d.cp, d.ep, d.dp) == (2, 2, 2, 1, 4)
    assert validate_parallelism(JobConfig(), world_size=1).dims.dp_shard == 1


def test_parallelism_accepts_expert_parallel_over_shard_and_cp():
    cfg = cfg_with(data_parallel_shard_degree=2, context_parallel_degree=2, expert_parallel_degree=4)
    assert validate_parallelism(cfg, world_size=4).dims.ep == 4


@pytest.mark.parametrize("degrees,world,match", [
    (dict(data_parallel_shard_degree=2, context_parallel_degree=2), 8, r"multiply to 4.*world size is 8"),
    (dict(context_parallel_degree=3), 8, "divisible"),
    (dict(context_parallel_degree=0), 8, "context_parallel_degree"),
    (dict(data_parallel_shard_degree=0), 8, "data_parallel_shard_degree"),
    (dict(data_parallel_replicate_degree=-1), 8, "data_parallel_replicate_degree"),
    (dict(expert_parallel_degree=4), 6, "expert_parallel_degree"),
    (dict(data_parallel_replicate_degree=2, expert_parallel_degree=8), 8, "expert_parallel_degree"),
    (dict(context_parallel_degree=4, expert_parallel_degree=2), 8, "multiple of context_parallel_degree"),
])
def test_parallelism_rejects_impossible_layouts(degrees, world, match):
    with pytest.raises(ConfigError, match=match):
        validate_parallelism(cfg_with(**degrees), world_size=world)


def test_grad_accumulation_from_global_batch_size():
    cfg = cfg_with(local_batch_size=4, data_parallel_replicate_degree=2)  # dp = 2 * 2 on 4 ranks
    d = validate_parallelism(cfg, world_size=4)
    assert (d.global_batch_size, d.grad_accum_steps) == (16, 1)
    cfg.training.global_batch_size = 64
    assert validate_parallelism(cfg, world_size=4).grad_accum_steps == 4


@pytest.mark.parametrize("gbs", [24, 0, -2])
def test_global_batch_not_a_multiple_of_local_times_dp_is_rejected(gbs):
    cfg = cfg_with(local_batch_size=4, global_batch_size=gbs)
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_parallelism(cfg, world_size=4)  # 4 * 4 = 16 rows per micro-step


@pytest.mark.parametrize("name, world", [("debug_model.toml", 1), ("qwen35_moe.toml", 8), ("qwen35_moe_long.toml", 8)])
def test_shipped_configs_are_valid_except_for_the_paths_a_user_must_set(name, world):
    from pathlib import Path

    from tests.runs import run_requirements_error

    cfg = load_config(["--config", str(Path(__file__).resolve().parents[2] / "train_configs" / name)])
    dims = validate_parallelism(cfg, world_size=world).dims
    if name == "debug_model.toml":
        run_requirements_error(cfg)  # runs as shipped
    else:  # the placeholder paths of the 35B configs are reported, and nothing else
        with pytest.raises(ConfigError, match="/path/to/") as raised:
            run_requirements_error(cfg)
        for other in ("flavor", "context_parallel", "seq_len", "tokenizer has", "not available"):
            assert other not in str(raised.value), str(raised.value)
    if name == "qwen35_moe_long.toml":
        assert (dims.cp, dims.dp_shard, cfg.training.seq_len) == (4, 2, 65536)


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_is_named_before_anything_starts():
    from pathlib import Path

    from tests.runs import run_requirements_error

    data = str(Path(__file__).resolve().parents[2] / "data" / "debug_corpus" / "train.jsonl")
    cfg = load_config(["--training.dataset_path", data, "--parallelism.expert_parallel_degree", "3"])
    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 3 must divide the number of experts \(8\)"):
        run_requirements_error(cfg)
    run_requirements_error(load_config(["--training.dataset_path", data, "--parallelism.expert_parallel_degree", "4"]))


# --- every numeric key has a range: nothing that passes here crashes torch or diverges later ----------------------

def _numeric_keys(kind) -> list[str]:
    from typing import get_args

    from harness.config import SCHEMA
    return [f"{section}.{key}" for section, keys in SCHEMA.items() for key, hint in keys.items()
            if hint is kind or kind in get_args(hint) or (kind is float and hint == list[float])]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", _numeric_keys(float))
def test_nan_and_infinity_are_refused_for_every_float_key(key, value):
    flag = f"{value},0.95" if key == "optimizer.betas" else value
    with pytest.raises(ConfigError) as e:
        load_config([f"--{key}={flag}"])
    assert e.value.problems == [f"{key} must be a finite number, got {value}" if key != "optimizer.betas"
                                else f"{key} must be finite numbers, got [{value}, 0.95]"]


OUT_OF_RANGE = {  # key: values of the right type that no run can use, each named by the config check
    "job.other_run_outputs_keep": ["-1"],
    "lora.expert_rank": ["-8", "4", "12"],
    "optimizer.lr": ["0", "-1e-3"],
    "optimizer.eps": ["0", "-1"],
    "optimizer.weight_decay": ["-5"],
    "optimizer.betas": ["1.5,-1", "0.9,1", "-0.1,0.95", "0.9"],
    "training.aux_loss_coef": ["-0.5", "-2"],
    "training.seed": [str(2 ** 64), str(-2 ** 63 - 1)],
    "training.steps": ["0"], "training.seq_len": ["0"], "training.local_batch_size": ["-1"],
    "training.loss_chunk_tokens": ["-1"], "training.gc_freq": ["-1"], "training.mtp_loss_coef": ["-0.1"],
    "training.max_norm": ["0", "-1"], "training.chat_max_row_bytes": ["0", "-2"],
    "validation.freq": ["0"], "validation.steps": ["0", "-2"],
    "lr_scheduler.warmup_steps": ["-1"], "lr_scheduler.decay_ratio": ["1.5", "-0.1"],
    "lr_scheduler.min_lr_factor": ["1.5", "-0.1"],
    "metrics.log_freq": ["0"], "checkpoint.interval": ["0"], "checkpoint.keep_latest_k": ["-1"],
    "checkpoint.load_step": ["-2"], "model.mtp_num_hidden_layers": ["-2"],
    "lora.rank": ["0", "12"], "lora.alpha": ["0"], "lora.dropout": ["1", "-0.1"],
}
WORLD_SIZE_KEYS = {"training.global_batch_size", "parallelism.data_parallel_replicate_degree",
                   "parallelism.data_parallel_shard_degree", "parallelism.context_parallel_degree",
                   "parallelism.expert_parallel_degree"}  # checked against the world size: validate_parallelism
IN_RANGE = {"optimizer.betas": "0,0.999", "training.aux_loss_coef": "-1", "training.seed": str(2 ** 64 - 1),
            "optimizer.weight_decay": "0", "training.chat_max_row_bytes": "-1", "validation.steps": "-1",
            "job.other_run_outputs_keep": "0", "lora.expert_rank": "0"}


def test_every_numeric_key_has_its_range_checked():
    numeric = set(_numeric_keys(int) + _numeric_keys(float))
    assert numeric - WORLD_SIZE_KEYS - {"profiling.profile_freq"} == set(OUT_OF_RANGE)  # profile_freq: above


@pytest.mark.parametrize("key, value", [(k, v) for k, values in OUT_OF_RANGE.items() for v in values])
def test_a_value_out_of_its_keys_range_is_named_with_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        load_config([f"--{key}={value}"])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"{key} must be"), e.value.problems


@pytest.mark.parametrize("key, value", IN_RANGE.items())
def test_values_at_the_ends_of_a_range_are_accepted(key, value):
    load_config([f"--{key}={value}"])


def test_every_problem_of_the_optimizer_is_named_in_one_error():
    with pytest.raises(ConfigError) as e:
        load_config(["--optimizer.lr", "nan", "--optimizer.betas", "1.5,-1", "--optimizer.eps", "-1",
                     "--optimizer.weight_decay", "-5", "--training.aux_loss_coef", "nan"])
    assert e.value.problems == ["training.aux_loss_coef must be a finite number, got nan",
                                "optimizer.lr must be a finite number, got nan",
                                "optimizer.eps must be positive, got -1.0",
                                "optimizer.weight_decay must be >= 0, got -5.0",
                                "optimizer.betas must be two values in [0, 1) (beta1, beta2), got [1.5, -1.0]"]


def test_a_toml_nan_is_refused_like_a_command_line_one(toml_file):
    with pytest.raises(ConfigError, match=r"optimizer\.lr must be a finite number, got nan"):
        load_config(["--config", toml_file("[optimizer]\nlr = nan\n")])


def test_help_names_each_lists_items_and_shows_it_as_the_command_line_takes_it():
    """`--lora.targets` holds names, `--optimizer.betas` numbers (before: both "list of floats")."""
    text = config_help([])
    assert "--lora.targets  (list of names, q_proj,k_proj,v_proj,o_proj," in text
    assert "--optimizer.betas  (list of numbers, 0.9,0.95)" in text
