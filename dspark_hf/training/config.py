"""What a training run depends on: [`TrainConfig`] (saved next to the checkpoints as train_config.json), whose
fields and help text `dspark train`'s flags are generated from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# the backbone's linear layers (attention and MLP of every draft layer); `fc` (the context projection) may be added
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# heads trained in full next to the adapters (peft `modules_to_save`: copies stored in the adapter file)
LORA_HEADS = {"none": (), "confidence": ("confidence",), "all": ("w1", "w2", "rnn_proj", "confidence")}

# what a resumed invocation may change: how long the run goes, where and in what precision it computes, and how often
# it saves (every other field defines the run: changing one on resuming is refused, see `train`)
RESUMABLE_CHANGES = frozenset({"output_dir", "epochs", "max_steps", "time_budget", "stop_after", "save_every",
                               "log_every", "device", "mixed_precision", "target_dtype", "gpu_memory_fraction",
                               "feature_cache", "compile"})


@dataclass
class TrainConfig:
    """Everything a training run depends on (saved next to the checkpoints as train_config.json)."""

    dataset: str = field(metadata={"help": "JSONL written by `dspark prepare-data`."})
    output_dir: str = field(metadata={"help": "Where checkpoints and the final draft are saved."})
    epochs: float = field(default=4.0, metadata={"help": "Passes over the training split (fresh anchors each)."})
    max_steps: int | None = field(default=None, metadata={"help": "Optimizer steps to take, overriding epochs (a "
                                  "fixed budget across datasets of different sizes)."})
    batch_size: int = field(default=4, metadata={"help": "Sequences per forward and backward pass (per process)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Batches whose gradients add up before "
                                             "each optimizer step: a step learns from batch_size x this x processes "
                                             "sequences (the global batch)."})
    group_by_length: bool = field(default=True, metadata={"help": "Batch answers of similar length together: "
                                  "each stretch of 64 steps' examples is sorted by length and cut into batches, which "
                                  "are shuffled, so that the target's forward and the draft's context compute little "
                                  "padding (the run reports the padded share); --no-group-by-length: shuffled only."})
    anchors_per_sequence: int = field(default=48, metadata={"help": "Random blocks per sequence (reference: 512).",
                                                            "flag": "--anchors"})
    feature_lag: int = field(default=0, metadata={"help": "Train on lagged contexts, as SSD's pre-speculated blocks "
                             "see them: each block's last L tokens before its anchor (L in 0..feature_lag, uniform "
                             "unless feature_lag_weights) enter as tokens without target features; block_size + 1 "
                             "covers every SSD outcome (0: off)."})
    feature_lag_weights: list[float] | None = field(default=None, metadata={"help": "Draw the lags 0..feature_lag "
                                                    "in proportion to these feature_lag + 1 weights instead of "
                                                    "uniformly: e.g. the `verified` counts per lag in `dspark bench "
                                                    "ssd`'s acceptance_by_lag, the lags SSD meets with a draft like it."})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW peak learning rate.", "flag": "--lr"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup_ratio: float = field(default=0.04, metadata={"help": "Linear warm-up share of the run (its steps, or its "
                                                               "time under a time budget), then cosine decay."})
    max_length: int = field(default=640, metadata={"help": "Sequences are cut to this many tokens."})
    heldout_fraction: float = field(default=0.05, metadata={"help": "Share of examples kept for validation and "
                                                                    "calibration (by hashed id)."})
    loss_ce: float = field(default=0.1, metadata={"help": "alpha_ce (eq. 12)."})
    loss_l1: float = field(default=0.9, metadata={"help": "alpha_tv (eq. 12); the term is the full L1 norm."})
    loss_confidence: float = field(default=1.0, metadata={"help": "alpha_conf (eq. 12)."})
    loss_kl: float = field(default=0.0, metadata={"help": "Weight of the forward KL(p_t || p_d) to the target's "
                           "distribution over the draft vocabulary (0: off; not in the paper)."})
    position_decay: float = field(default=4.0, metadata={"help": "w_k = exp(-k / position_decay)."})
    feature_cache: str | None = field(default=None, metadata={"help": "Directory for an on-disk cache of target "
                                                                        "features; None computes them online."})
    mixed_precision: str = field(default="auto", metadata={"choices": ("auto", "bf16", "fp16", "no"), "help":
                                 "'auto': bf16 where the device has bf16 matrix units (a GPU that supports "
                                 "it; a CPU with AVX512-BF16 or AMX, several times the fp32 throughput), else "
                                 "fp32; 'bf16', 'fp16' (GPU only); 'no': fp32. Autocast of the draft: its "
                                 "weights and optimizer state stay fp32, and the target computes in its own dtype "
                                 "(target_dtype). accelerate keeps one setting per process."})
    time_budget: float | None = field(default=None, metadata={"help": "Minutes for the whole run (features, training, "
                                      "held-out report, saving; resumed invocations count together): the "
                                      "learning-rate schedule follows the time spent instead of the steps, and "
                                      "epochs and max_steps are ignored."})
    stop_after: float | None = field(default=None, metadata={"help": "Minutes after which this invocation saves a "
                                     "checkpoint and returns unfinished; run it again to resume (for machines that "
                                     "limit a command's wall time)."})
    device: str = field(default="auto", metadata={"help": "'auto' (the CUDA GPU when torch sees one, else the CPU), "
                        "'cpu', 'cuda' or 'cuda:N'; under `accelerate launch` each process takes its own GPU."})
    target_dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16"), "help":
                              "dtype of the frozen target that gives features and "
                              "the target distribution: 'auto' (bfloat16 where the device has bf16 matrix units, as for "
                              "mixed_precision, else float32), "
                              "'float32' or 'bfloat16'; a target passed to train() is converted too."})
    auto_find_batch_size: bool = field(default=False, metadata={"help": "Halve batch_size until one step on the "
                                       "longest sequences (every block with the longest feature_lag) fits in GPU "
                                       "memory (says which size it took)."})
    gpu_memory_fraction: float | None = field(default=None, metadata={"help": "Share of the GPU's memory this process "
                                              "may take (e.g. 0.45 each for two trainings on one GPU); "
                                              "auto_find_batch_size then fits the batch inside it."})
    compile: str = field(default="no", metadata={"choices": ("no", "inductor", "aot_eager"), "help": "Compile the "
                         "draft's forward and backward with torch.compile and this backend: 'inductor' (kernels "
                         "generated for the device; the first steps compile, about a minute), 'aot_eager' (the "
                         "graphs traced but run eagerly: a check that the step compiles). Lengths are dynamic, so a "
                         "run compiles once, not per batch length. 'no' (default): eager."})
    save_every: int = field(default=200, metadata={"help": "Checkpoint every this many steps (resumable)."})
    log_every: int = field(default=10, metadata={"help": "Steps between reads of the losses from the device (the "
                           "progress bar's figures and the check that the loss is finite; also before every "
                           "checkpoint): the steps between them never wait for the device."})
    seed: int = field(default=0, metadata={"help": "Seeds initialisation, shuffling and anchors."})
    draft: dict = field(default_factory=dict, metadata={"help": "DSparkDraftModel.from_target overrides of a fresh "
                        "draft's shape (default: DSparkConfig's), e.g. {'num_hidden_layers': 3, 'head_type': 'rnn'}; "
                        "draft_vocab_size (default 8192, 0: the full vocabulary) picks the most frequent answer "
                        "tokens. Refused with init_from / lora, which keep the saved draft's shape."})
    copy_target_layers: bool = field(default=False, metadata={"help": "Start a fresh draft from the target's last "
                                     "decoder layers instead of random weights (see copy_target_layers); needs "
                                     "draft layers with the target's shapes and parameter names (Llama, Qwen3)."})
    init_from: str | None = field(default=None, metadata={"help": "Start from this saved draft instead of a fresh "
                                                                    "one (fine-tuning; a LoRA adapter folder is "
                                                                    "merged into its base first); the base draft "
                                                                    "with lora (a whole draft, not an adapter)."})
    add_qk_norm: bool = field(default=False, metadata={"help": "With init_from: add per-head q/k norms (weights at "
                              "one) to a draft made without them, the layer shape vLLM, SGLang and llama.cpp serve; "
                              "every other weight carries over, and training adapts them to the norms."})
    lora: bool = field(default=False, metadata={"help": "Adapt init_from (default: the shipped draft, for the "
                       "default target) with LoRA: its weights stay frozen and the run saves a peft adapter."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scaling numerator (updates scale by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES), metadata={
        "help": "Names of the draft's linear layers that get adapters (default: attention and MLP of every layer)."})
    lora_heads: str = field(default="all", metadata={"choices": tuple(LORA_HEADS), "help":
                            "Heads trained in full and saved in the adapter: "
                            "'all' (default: the Markov/RNN head, where a domain's token transitions live, and "
                            "the confidence head; ~2M weights for the shipped draft, and on code the whole of the "
                            "measured gain); 'confidence' (a few hundred weights); 'none'."})

    def __post_init__(self):
        # checked before train() touches output_dir, so a refused command leaves an existing run as it was
        for name in ("batch_size", "gradient_accumulation_steps", "anchors_per_sequence", "max_length", "save_every",
                     "log_every", "lora_rank") + \
                (("max_steps",) if self.max_steps is not None else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: give a positive whole number.")
        for name in ("epochs", "position_decay", "learning_rate"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: give a positive number.")
        losses = {name: getattr(self, name) for name in ("loss_ce", "loss_l1", "loss_confidence", "loss_kl")}
        if not all(math.isfinite(w) and w >= 0 for w in losses.values()) or sum(losses.values()) <= 0:
            raise ValueError(f"loss weights {losses}: give finite weights >= 0, not all 0.")
        for name in ("weight_decay", "warmup_ratio", "lora_dropout"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)}: give a value in [0, 1].")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: give a share in [0, 1).")
        for name in ("time_budget", "stop_after"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: give a positive number of minutes, or leave it unset.")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction}: give a share in (0, 1].")
        if self.feature_lag < 0:
            raise ValueError(f"feature_lag={self.feature_lag}: give the largest lag in tokens (>= 0; 0 is off).")
        weights = self.feature_lag_weights
        if weights is not None and (self.feature_lag == 0 or len(weights) != self.feature_lag + 1
                                    or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"feature_lag_weights={weights}: give feature_lag + 1 weights >= 0 (not all 0), one per "
                             f"lag 0..feature_lag, with feature_lag > 0 (now {self.feature_lag}).")
        if self.target_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"target_dtype={self.target_dtype!r}: choose 'auto', 'float32' or 'bfloat16'.")
        if self.copy_target_layers and (self.lora or self.init_from):
            raise ValueError("copy_target_layers initialises a fresh draft: drop it, or drop init_from / lora.")
        if self.add_qk_norm and (self.lora or not self.init_from):
            raise ValueError("add_qk_norm (--add-qk-norm) adds q/k norms to the draft init_from names: pass "
                             "--init-from DIR without --lora (a fresh draft has them already).")
        if self.draft and (self.lora or self.init_from):
            raise ValueError(f"The draft shape {self.draft} (--layers, --head-type, ...) applies to a fresh draft; "
                             "fine-tuning (init_from / lora) keeps the saved draft's shape. Drop those settings, or "
                             "train a fresh draft without init_from.")
