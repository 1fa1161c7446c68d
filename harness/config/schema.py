"""The run's sections and keys: plain dataclasses whose field comments are the documentation (`--help` prints them).

Sections and keys follow torchtitan's JobConfig names where an equivalent exists. Field types drive parsing
(harness/config/load.py): `Literal[...]` fields are choices, `float | None` accepts "none", `list[float]` accepts
"0.9,0.95" on the command line. Keys once read under other names are listed in harness/config/renamed.py.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

from models.qwen35_moe.lora_targets import DEFAULT_TARGETS


@dataclass
class Job:
    name: str = "qwen35_moe"  # run name: prefixes every log line and console metrics line
    dump_folder: str = "./outputs"  # metrics, tensorboard, checkpoints and HF export go under here (relative: to the current directory)
    description: str = ""  # free text, kept in the saved config.toml
    # Another run's metrics.jsonl, config.toml and hf/ found in the dump folder by a launch that does not continue that
    # run (harness/run_outputs.py): "keep" renames them <name>-<its run id> (one log line; a resume of that run brings
    # them back), "delete" deletes them (one log line).
    other_run_outputs: Literal["keep", "delete"] = "keep"
    # With "keep": the outputs of how many earlier runs to keep set aside, the newest ones (the older ones' are
    # deleted, one log line); 0 = all of them.
    other_run_outputs_keep: int = 0


@dataclass
class Model:
    flavor: str = "debugmodel"  # a named model shape from models/qwen35_moe flavors
    # Optional path to a transformers config.json (or its folder); overrides the flavor's shape.
    hf_config: str = ""
    tokenizer_path: str = ""  # empty = the built-in byte tokenizer
    # FLA refuses the gated-delta backward on Hopper with Triton < 3.7.1. "auto" bypasses that guard only
    # where it would trip and a numerical self-check of FLA's gradients on the run's head shapes passes
    # (else the run stops, naming the errors); "off" never bypasses (FLA's own error on such machines).
    fla_hopper_backward: Literal["auto", "off"] = "auto"
    # Multi-token-prediction layers: -1 = as the flavor or config.json has them (the releases: 1); 0 = none, e.g. to
    # resume a checkpoint saved without them or to leave the release's out of the run and its export.
    mtp_num_hidden_layers: int = -1


@dataclass
class Training:
    steps: int = 10  # optimizer steps to run
    seq_len: int = 256  # tokens per row
    local_batch_size: int = 8  # rows per data-parallel rank per micro-batch
    # Rows per optimizer step over all data-parallel ranks; -1 = local_batch_size * dp degree.
    # A larger value (a multiple of that) means gradient accumulation.
    global_batch_size: int = -1
    max_norm: float | None = 1.0  # gradient-norm clipping threshold (> 0); none = no clipping (norm still logged)
    seed: int = 42  # initial weights and any sampling; the same weights at every world size
    deterministic: bool = False  # deterministic algorithms (slower)
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype (FSDP's param dtype)
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"  # FSDP gradient reduce dtype
    # Where the documents come from (harness/data/sources.py): "text" files (blank-line separated documents), "jsonl"
    # or "parquet" files, or "hf", a Hugging Face dataset streamed by name. What a row holds is dataset_content.
    dataset_source: Literal["text", "jsonl", "parquet", "hf"] = "text"
    dataset_path: str = ""  # file, folder or HF dataset name, depending on dataset_source
    dataset_text_field: str = "text"  # field holding the text in jsonl / parquet / hf records
    # Tokenized cache of a local dataset (built once per dataset and tokenizer, then memory-mapped);
    # empty = <dump_folder>/dataset_cache. Point runs that share a dataset at one folder.
    dataset_cache_dir: str = ""
    # Checks of that cache each time a run opens it: "quick" (sizes, counts, document starts, token id range and a
    # sampled sha256; well under a second) or "full" (also the sha256 of every token, ~1.5 s a GB). A cache is
    # checked in full right after it is built.
    dataset_cache_verify: Literal["quick", "full"] = "quick"
    # What a row of the dataset holds, wherever it comes from. "text": a document, every token a target. "chat": a
    # conversation {"messages": [{"role", "content"}, ...], "tools": [...] (optional)}, assistant messages may carry
    # reasoning_content and tool_calls; rendered by the chat template of model.tokenizer_path, packed whole into
    # padded rows (docs/design.md, "Chat data"); from a jsonl, parquet or hf source. The validation set is read the
    # same way, with these chat keys.
    dataset_content: Literal["text", "chat"] = "text"
    chat_messages_field: str = "messages"  # chat: the field (column) of a row that holds its messages
    # chat: the tokens trained on. "assistant": those the template emits for assistant turns (content, the reasoning
    # it keeps, tool calls, the closing <|im_end|>); "all": every token of the rendered conversation.
    chat_targets: Literal["assistant", "all"] = "assistant"
    # chat: a conversation longer than seq_len + 1 tokens is dropped, or truncated to one row (counted in the log)
    chat_overlong: Literal["drop", "truncate"] = "drop"
    # chat: a row larger than this many bytes (its jsonl line; for parquet and hf rows, the UTF-8 bytes of its
    # strings) is left out before it is parsed, rendered or tokenized, counted with the rows that cannot be trained
    # on: a conversation far longer than a row would only be dropped or cut, after seconds and gigabytes of work.
    # -1 = 16 bytes a token of a row, 16 * (seq_len + 1); raise it for rows of more bytes a token (JSON escapes of
    # non-Latin text: 6 bytes a character). The chat cache is keyed by it: another seq_len builds another cache.
    chat_max_row_bytes: int = -1
    aux_loss_coef: float = -1.0  # MoE load-balance loss weight; -1 = router_aux_loss_coef of the model
    # Weight of the multi-token-prediction loss (the mean over the MTP depths of each one's token-mean cross entropy
    # of x_{t+k+2}), for a model with MTP layers (the releases' config.json; flavors 35B-A3B ...): 0.1 as Megatron's
    # default. 0: the MTP layers are neither run nor trained, carried frozen from the initial weights to the export.
    mtp_loss_coef: float = 0.1
    # Cross entropy this many tokens at a time (per rank), never holding the whole (tokens x vocab) logits;
    # 0 = all at once. The peak grows 2 bytes x vocab per chunk token on CUDA (0.5 GiB per 1024 tokens of a 248k
    # vocab), more elsewhere. The default is models/qwen35_moe/kernels/linear_cross_entropy.py's CHUNK_TOKENS;
    # 1024 holds 1.4 GiB less and runs ~4% slower (docs/performance.md, "The loss chunk").
    loss_chunk_tokens: int = 4096
    # Python's cyclic garbage collector runs every N steps (its young generations), not whenever allocations
    # trigger it: a collection pauses the host mid-step, and with the GPU fed by the host (compile.enable) that
    # stalls the GPU too. 0 = Python's own schedule.
    gc_freq: int = 50


@dataclass
class Validation:
    enable: bool = False  # held-out loss every `freq` steps and at the last step
    # Where the held-out documents come from, as training.dataset_source; their content is training.dataset_content
    dataset_source: Literal["text", "jsonl", "parquet", "hf"] = "jsonl"
    dataset_path: str = ""  # file, folder or HF dataset name, depending on dataset_source
    dataset_text_field: str = "text"  # field holding the text in jsonl / parquet / hf records
    freq: int = 100  # validate every N training steps (and after the last one)
    steps: int = 10  # micro-batches per validation (training's local_batch_size and seq_len); -1 = the whole set


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"  # AdamW decouples weight decay; Adam applies it as L2
    lr: float = 8e-4  # peak learning rate
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.1  # on matrices only, never on 1-D parameters (norms, A_log, dt_bias)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # CLI: "0.9,0.95"


@dataclass
class LRScheduler:
    warmup_steps: int = 2  # linear warmup from ~0 to lr
    # None = decay over all steps after warmup; else the fraction of steps in the final decay
    # phase, with a constant lr between warmup and decay (warmup-stable-decay).
    decay_ratio: float | None = None
    decay_type: Literal["linear", "sqrt", "cosine"] = "cosine"
    min_lr_factor: float = 0.1  # lr at the end of decay, as a fraction of lr


@dataclass
class Metrics:
    log_freq: int = 1  # log every N steps
    enable_tensorboard: bool = True  # events under <dump_folder>/<save_tb_folder>/<run start time>
    save_tb_folder: str = "tb"  # under dump_folder
    # Also log to Weights & Biases (rank 0; needs `pip install wandb`): project job.name, run id the run's id, so a
    # resumed run continues its W&B run; the resolved config as the run's config; its files under
    # <dump_folder>/wandb. Where it goes is wandb's own settings (`wandb login`, WANDB_MODE=offline, ...).
    enable_wandb: bool = False


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # DDP / HSDP replicas
    data_parallel_shard_degree: int = -1  # FSDP shards; -1 = the rest of the world
    context_parallel_degree: int = 1  # ranks that split every row (zigzag); divides the GDN heads and seq_len / 2
    expert_parallel_degree: int = 1  # splits the experts; divides dp_shard * cp, a multiple of cp, divides the experts
    # How tokens reach their experts' ranks (parallel/expert_parallel.py). "all_gather": every rank gathers the EP
    # group's tokens, a reduce-scatter returns the outputs; no host sync, compiles whole, moves ep / top_k of the
    # all-to-all's bytes but holds ep x its MoE buffers. "all_to_all": tokens travel only to their experts' ranks;
    # one host sync per layer. "auto": all_gather while ep <= top_k / 2 (faster than the all-to-all at EP=2 and
    # EP=4: docs/performance.md, "Expert parallelism"), all_to_all above.
    expert_parallel_dispatch: Literal["auto", "all_gather", "all_to_all"] = "auto"
    # "auto" (the default): "always" for a launch's first step, then "never" if that step's peak plus the blocks'
    # gathered weights fit in 85% of every rank's GPU memory (parallel/reshard_policy.py; on CPU "always"); faster
    # than "always" for a little memory (docs/performance.md, "FSDP over 2 GPUs against one GPU"). "never": each
    # block keeps its gathered (bf16) weights from forward to backward, sparing the backward's all-gathers and
    # casts, whatever the memory. "always": every block but the last frees them after forward (torchtitan's
    # "default" and "always").
    fsdp_reshard_after_forward: Literal["always", "never", "auto"] = "auto"
    # The embedding and the lm_head vocabulary-parallel (parallel/vocab_parallel.py): their weights stay sharded by
    # rows and each rank serves its rows to every rank's tokens, so FSDP never gathers them nor reduces their whole
    # gradients. "auto": where that moves fewer bytes (FSDP ranks x tokens per rank <= vocabulary size).
    vocab_parallel: Literal["auto", "always", "never"] = "auto"


@dataclass
class Checkpoint:
    enable: bool = False  # DCP checkpoints, and resume from the latest complete one in this dump folder
    folder: str = "checkpoint"  # under dump_folder; DCP steps saved as step-N/
    interval: int = 500  # save every N steps (and at the last step)
    keep_latest_k: int = 2  # older step folders are deleted; 0 = keep all
    async_mode: Literal["disabled", "async"] = "disabled"  # "async": write in the background while training goes on
    export_hf_at_end: bool = False  # write a Hugging Face folder to <dump_folder>/hf at the end
    export_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # A_log, dt_bias, GDN norm: always F32
    # "fp8": the exported model re-quantized block-wise into the FP8 release's layout (float8 weights with 128 x 128
    # block scales, harness/checkpoint/fp8_export.py), what vLLM / SGLang serve as they serve Qwen3.5-35B-A3B-FP8
    export_quantized: Literal["none", "fp8"] = "none"
    initial_load_hf: str = ""  # HF checkpoint folder to initialise weights from (when none to resume)
    # Step to resume from; -1 = the newest that verifies. An older step rolls back: the later ones are moved to
    # <folder>/abandoned-<time>/. Like restart_data, a one-off: the saved config.toml holds the default.
    load_step: int = -1
    # Resume the weights, optimizer and schedule but read the data from its start: what a changed dataset,
    # tokenizer or training.seq_len needs (their saved data position would point into other rows).
    restart_data: bool = False


@dataclass
class ActivationCheckpoint:
    # "full": recompute every block in backward (with compile.enable, in two halves, the MoE half's recompute
    # compiled into the backward: parallel/activation_checkpointing.py); "selective": keep matmul, attention and
    # collective outputs, recompute the elementwise work between them (less memory than none, less recompute than
    # full; with compile.enable it recomputes the compiled graphs whole and is slower than full: docs/performance.md,
    # "Activation checkpointing")
    mode: Literal["none", "full", "selective"] = "none"


@dataclass
class Compile:
    # torch.compile each transformer block (every GPU figure in docs/performance.md is compiled); a run compiles in
    # its first steps, then never again. Off by default: not yet run under CP on GPUs.
    enable: bool = False


@dataclass
class Profiling:
    enable_profiling: bool = False  # torch.profiler trace of one step in every profile_freq steps, per rank
    save_traces_folder: str = "profile_traces"  # under dump_folder: iteration_N/rank{R}_trace.json
    profile_freq: int = 10  # trace steps N = profile_freq, 2 * profile_freq, ... (the step before warms up)
    # CUDA allocator history (every allocation with its stack), dumped at the same steps for
    # https://pytorch.org/memory_viz; CUDA only
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"  # under dump_folder: iteration_N/rank{R}_memory_snapshot.pickle


@dataclass
class Debug:
    # For benchmarks only: every MoE layer sends token n of its N local tokens to experts (n * top_k + j) mod E, not
    # to the router's top-k: an equal load on every expert (Megatron's --moe-router-force-load-balancing), the routing
    # not learned. Checkpoint keys and the HF export are unchanged.
    moe_force_load_balance: bool = False


@dataclass
class Lora:
    # LoRA fine-tuning (models/qwen35_moe/lora.py): the model's weights frozen (held in mixed_precision_param on GPU:
    # no gradient, no optimizer state, no fp32 copy), a trained low-rank update s * B A (s = alpha / rank) beside each
    # targeted projection, one per routed expert for "experts". Checkpoints hold only the updates and a digest of the
    # base; the end-of-run export writes the merged model to hf/ and a PEFT adapter to hf-adapter/.
    enable: bool = False
    rank: int = 16  # a multiple of 8 (the routed experts' grouped GEMMs need 16-byte rows)
    # The routed experts' own rank (0: lora.rank), a multiple of 8: most of the adapters' parameters are the experts'
    # (at rank 16, 0.92B of 35B-A3B's 0.94B), so a smaller one here is where LoRA's memory goes down. Their scale is
    # alpha / expert_rank; the PEFT export states it as rank_pattern.
    expert_rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0  # on each adapter's input
    # Any of: q_proj k_proj v_proj o_proj (gated attention), in_proj_qkv in_proj_z in_proj_a in_proj_b out_proj
    # (Gated DeltaNet), shared_expert, shared_expert_gate, experts (routed, per expert), router, fc (MTP). Never the
    # embedding or the lm_head.
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    # The MTP layers: "frozen" (carried from the initial weights to the export, not run) or "lora" (adapted like the
    # main layers and trained with weight training.mtp_loss_coef)
    mtp: Literal["frozen", "lora"] = "frozen"
    # A base in the FP8 release's layout (checkpoint.initial_load_hf): "held" keeps its quantized weights in float8
    # with their block scales, dequantized where each module computes (one process under full AC; else as
    # "dequantized"); "dequantized" holds them in the compute dtype from the load on, as a bf16 base's: the same
    # values, no per-use dequantization, a bf16 base's memory (a card with room for it, or a baseline run).
    fp8_base: Literal["held", "dequantized"] = "held"


@dataclass
class Quantize:
    # FP8 training of the blocks' dense projections (harness/float8.py; torchao: pip install -e '.[fp8]'; a GPU of
    # compute capability 8.9 or newer): "none", or torchao's recipe, "rowwise" (per-row scales, powers of two),
    # "rowwise_with_gw_hp" (the weight gradient in high precision) or "tensorwise". Weights, optimizer state,
    # checkpoints and exports are unchanged: a run resumes across the modes. Not with lora.enable (nor the experts').
    linear_float8_recipe: Literal["none", "rowwise", "rowwise_with_gw_hp", "tensorwise"] = "none"
    # Projections kept in bf16: those whose name contains one of these (and any whose sizes are not multiples of 16)
    linear_float8_filter_fqns: list[str] = field(default_factory=lambda: [
        "lm_head", "shared_expert_gate", "in_proj_a", "in_proj_b", "mtp."])
    # The routed experts whose grouped GEMMs run in FP8 (torchao's rowwise recipe, each expert's token group padded
    # to 16 rows): those whose module name (layers.N.mlp.experts, mtp.layers.N.mlp.experts) contains one of these,
    # e.g. ["experts"]: every MoE layer's, the MTP layer's too; [] = none
    grouped_mm_float8_fqns: list[str] = field(default_factory=list)
    float8_emulate: bool = False  # the FP8 casts with the GEMMs emulated in high precision: CPU tests only


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)
    lora: Lora = field(default_factory=Lora)
    quantize: Quantize = field(default_factory=Quantize)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# section name -> {key: type hint}
SCHEMA = {f.name: get_type_hints(f.default_factory) for f in dataclasses.fields(JobConfig)}
ALL_KEYS = [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]
# Paths the run reads. In a config file a relative one is relative to the file's folder (dataset paths only
# for local sources: for "hf" it is a dataset name).
INPUT_PATH_KEYS = ("model.hf_config", "model.tokenizer_path", "training.dataset_path", "validation.dataset_path",
                   "checkpoint.initial_load_hf")
OUTPUT_PATH_KEYS = ("job.dump_folder", "training.dataset_cache_dir")


def get_value(cfg: JobConfig, key: str) -> Any:
    """The value of `section.key` in `cfg`."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def names_a_dataset(cfg: JobConfig, key: str) -> bool:
    """Whether the path key `key` holds a Hugging Face dataset name rather than a path (dataset_source "hf")."""
    section, name = key.split(".")
    return name == "dataset_path" and getattr(cfg, section).dataset_source == "hf"
