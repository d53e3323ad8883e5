"""How fast a run trains, and what share of its device that is: [`StepFlops`] counts a batch's work from its
shapes, [`peak_flops`] is what the device can do, and [`Throughput`] adds up a run's steps.

FLOPs are counted as the matmuls a step computes, padding included (the device computes it), 2 per multiply-add:
- the target's forward: 2 x its decoder's weights x the batch's padded tokens, plus causal attention (2 x layers x
  hidden x L^2 per sequence: scores and values over half the square);
- the teacher: the target's LM head over the answers' positions, where the blocks fall (2 x hidden x vocabulary each);
- the draft, forward and backward (3 x forward): its decoder layers over the block rows (2 x their weights each),
  their attention over context and block, the context projection and every layer's keys and values over the
  padded context, and its LM head over the block rows (forward and the input gradient only: it is frozen).
MFU is the counted FLOPs per second over the peak: a table of dense bf16 and TF32/FP32 tensor-core peaks for the GPUs
people train on, and on a CPU one measured large matmul (`measured_cpu_peak`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# dense peaks, TFLOP/s: bf16 (and fp16) tensor cores; float32 as TF32 tensor cores (what the trainer allows on CUDA)
GPU_PEAKS = {"H200": {"bfloat16": 989.0, "float32": 494.5}, "H100": {"bfloat16": 989.0, "float32": 494.5},
             "A100": {"bfloat16": 312.0, "float32": 156.0}, "L4": {"bfloat16": 121.0, "float32": 60.0}}


def _linear_weights(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


@dataclass(frozen=True)
class Shapes:
    """What a batch's FLOPs depend on: its sequences, their padded length L, the draft's block rows per sequence
    (anchors x rows per block), and the positions the teacher computes (its answers' tokens, all rows together)."""

    batch: int
    length: int
    block_rows: int
    teacher_positions: int


class StepFlops:
    """FLOPs of one batch's forward and backward, by part (see the module), for `target` and `draft`: their sizes
    counted once, each batch's from its shapes."""

    def __init__(self, target, draft):
        t, self.c = target.config.get_text_config(), draft.config
        self.target_layers, self.hidden = t.num_hidden_layers, t.hidden_size
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.decoder = _linear_weights(target.get_decoder())
        self.draft_layers = _linear_weights(draft.layers)
        self.context = draft.fc.weight.numel() + sum(
            _linear_weights(layer.self_attn.k_proj) + _linear_weights(layer.self_attn.v_proj) for layer in draft.layers)
        self.draft_vocab = self.c.draft_vocab_size or self.c.target_vocab_size

    def __call__(self, shapes: Shapes) -> dict[str, float]:
        c, B, L, R = self.c, shapes.batch, shapes.length, shapes.block_rows
        target_forward = 2 * self.decoder * B * L + 2 * self.target_layers * self.hidden * L * L * B
        teacher = 2 * self.hidden * self.vocab * shapes.teacher_positions
        attention = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * R * (L + R)
        draft = 3 * (2 * self.draft_layers * R + attention + 2 * self.context * L) * B \
            + 2 * 2 * self.hidden * self.draft_vocab * R * B
        return {"target_forward": float(target_forward), "teacher": float(teacher), "draft": float(draft)}


def measured_cpu_peak(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 3) -> float | None:
    """FLOP/s of one large square matmul on this CPU in `dtype`, at torch's thread count (the best of `repeats`);
    None where the clock did not move (a clock stopped by a test)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best if best > 0 else None


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(the device's peak FLOP/s in `dtype`, where the figure comes from); None where it is not known (a GPU not in
    the table, a device that is neither CUDA nor CPU)."""
    name = "bfloat16" if dtype in (torch.bfloat16, torch.float16) else "float32"
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
        for model, peaks in GPU_PEAKS.items():
            if model in card:
                return peaks[name] * 1e12, f"{card}: dense {name} peak from the vendor's table"
        return None, f"{card}: not in the table of peaks"
    if device.type == "cpu":
        peak = measured_cpu_peak(dtype)
        return peak, f"this CPU: a 1024 x 1024 {name} matmul, measured" if peak else "this CPU: not measured"
    return None, f"{device.type}: no peak known"


def bfloat16_hint(device: torch.device, dtype: torch.dtype, float32_peak: float | None) -> str | None:
    """For a run in float32 on a CPU whose bfloat16 matmuls measure at least twice as fast (AVX512-BF16, AMX), the
    flags that train in bfloat16 there, as a GPU does; else None."""
    if device.type != "cpu" or dtype != torch.float32 or not float32_peak:
        return None
    peak = measured_cpu_peak(torch.bfloat16)
    if peak is None or peak < 2 * float32_peak:
        return None
    return (f"this CPU multiplies bfloat16 matrices {peak / float32_peak:.1f}x as fast as float32: "
            "--mixed-precision bf16 --target-dtype bfloat16 trains in bfloat16, as on a GPU "
            "(experiments/training-speed-cpu measures both)")


@dataclass
class Throughput:
    """A run's steps added up on the host (nothing read from the device): answers, tokens (unpadded) and FLOPs."""

    steps: int = 0
    answers: int = 0
    tokens: int = 0
    flops: dict[str, float] = field(default_factory=lambda: {"target_forward": 0.0, "teacher": 0.0, "draft": 0.0})
    padded_tokens: int = 0  # tokens the target's forward computed, padding included

    def add(self, examples: list, flops: dict[str, float], length: int) -> None:
        self.answers += len(examples)
        self.tokens += sum(len(e.input_ids) for e in examples)
        self.padded_tokens += len(examples) * length
        for k, v in flops.items():
            self.flops[k] += v

    def report(self, seconds: float, peak: float | None, peak_source: str) -> dict:
        """What heldout.json records, over `seconds` of steps (FLOPs per step by part: the mean step's)."""
        total = sum(self.flops.values())
        rate = total / seconds if seconds > 0 else None
        return {"answers_per_second": round(self.answers / seconds, 3) if seconds > 0 else None,
                "tokens_per_second": round(self.tokens / seconds, 1) if seconds > 0 else None,
                "padded_share": round(1 - self.tokens / self.padded_tokens, 4) if self.padded_tokens else None,
                "tflop_per_step": {k: round(v / max(self.steps, 1) / 1e12, 4) for k, v in self.flops.items()},
                "tflops": round(rate / 1e12, 4) if rate else None,
                "mfu": round(rate / peak, 4) if rate and peak else None,
                "peak_tflops": round(peak / 1e12, 3) if peak else None, "peak_source": peak_source}

    @staticmethod
    def line(report: dict) -> str:
        mfu = f"{report['mfu']:.1%} of the {report['peak_tflops']:g} TFLOP/s peak" if report["mfu"] is not None \
            else "MFU unknown (" + report["peak_source"] + ")"
        return (f"throughput: {report['answers_per_second']} answers/s, {report['tokens_per_second']} tokens/s, "
                f"{report['tflops']} TFLOP/s counted, {mfu}; padded share {report['padded_share']:.1%}")
