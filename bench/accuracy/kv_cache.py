"""How far the TTS model drifts when its KV cache is stored in fp8 (``tts_kv_cache_dtype``).

Streams of random text and a random speaker embedding run through the TTS model twice: once
with the cache in the model's dtype (the reference), once in fp8 (``fp8_e4m3``), on the
engine's own decode path (``visible_ranges``: the fused Triton kernel on CUDA, dequantized SDPA
elsewhere). Measured per stream and audio step, over ``--steps`` steps:

- **teacher-forced**: both caches are fed the reference's frames, so every step compares the
  next-code distributions given the same history: top-1 agreement (the argmax of each codebook's
  logits, the greedy code) and the KL divergence KL(reference || fp8) of each codebook's
  distribution, at temperature 1 and at the engine's sampling temperatures (0.1 / 0.3);
- **free-running greedy**: each run feeds back its own argmax frames; the share of frames equal
  to the reference's and the first frame where they part, and the SNR of the audio the DVAE +
  Vocos make of the fp8 run's codes against the reference's (for the same codes the audio is
  the same: the decoder never reads the cache).

The end-of-audio code is never chosen, so every stream runs all its steps. Weights: the tiny
golden checkpoint (``--weights tiny``, CPU) or full-size random weights (``--weights random``,
a GPU); trained weights cannot be downloaded where this project is built, so neither is what
trained weights give: the script is what to run on them (``--weights <checkpoint folder>``).

    python -m bench.accuracy.kv_cache --weights tiny --device cpu --out docs/benchmarks/kv-fp8-numerics.json
    python -m bench.accuracy.kv_cache --weights random --device cuda --out docs/benchmarks/kv-fp8-numerics.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from harness.service import git_commit
from serve_app.engines.minicpmo.device.audio_step import (
    TTS_TEMPERATURE,
    AudioStepInputs,
    audio_logits,
)
from serve_app.engines.minicpmo.device.tts_prefill import text_prefill_step
from serve_app.engines.minicpmo.model.layers import SlotKVCache, set_one_query_attention

ROOT = Path(__file__).resolve().parents[2]


def load(weights: str, device: str, dtype: torch.dtype):
    if weights == "random":
        from serve_app.engines.minicpmo.model.synthetic import random_speech_model
        return random_speech_model(ROOT / "tests" / "golden" / "chattts_tokenizer", device, dtype)
    from serve_app.engines.minicpmo.model.loader import load_speech_model
    if weights == "tiny":
        from tests.golden.checkpoint import build_tiny_checkpoint
        weights = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tiny-minicpmo-"))))
    return load_speech_model(weights, device=device, dtype=dtype)


def drift_parser(doc: str) -> argparse.ArgumentParser:
    """A drift benchmark's command line: its ``--weights`` and ``--device``, the rest its own."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="tiny",
                        help="tiny (the golden checkpoint), random (full size) or a folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def model_for(weights: str, device: str, module: str) -> tuple[object, dict]:
    """A drift benchmark's model (:func:`load`: bf16 on CUDA, float32 elsewhere) and the head of
    its result: the command that ran (``module`` and this process's arguments), commit, weights,
    dtype and device."""
    on_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    head = {"command": " ".join([f"python -m {module}", *sys.argv[1:]]),
            "git_commit": git_commit(), "weights": weights, "dtype": str(dtype),
            "device": torch.cuda.get_device_name() if on_cuda else "cpu"}
    return load(weights, device, dtype), head


class Streams:
    """``count`` streams' text prefill and their audio steps over one cache."""

    def __init__(self, model, count: int, kv_dtype: str, seed: int) -> None:
        tts = model.tts
        self.tts, self.cfg = tts, tts.config
        self.device = next(tts.parameters()).device
        dtype = next(tts.parameters()).dtype
        self.cache = SlotKVCache(model.config.tts_shape(), count, 1024, self.device, dtype, kv_dtype)
        self.rows = torch.arange(count, device=self.device)
        generator = torch.Generator().manual_seed(seed)
        cfg = self.cfg
        self.text_len = torch.randint(20, cfg.streaming_text_reserved_len - 20, (count,),
                                      generator=generator)
        width = int(self.text_len.max()) + 3
        ids = torch.randint(10, cfg.num_text_tokens, (count, width), generator=generator)
        ids[:, 1] = cfg.spk_emb_token_id
        valid = torch.arange(width)[None] < (self.text_len + 3)[:, None]
        positions = torch.arange(width)[None].expand(count, width)
        speaker = torch.nn.functional.normalize(
            torch.randn(count, cfg.hidden_size, generator=generator), dim=-1)
        on = lambda t: t.to(self.device)  # noqa: E731
        text_prefill_step(tts, self.cache, on(ids), on(positions), on(valid),
                          on(speaker).to(dtype), on(ids == cfg.spk_emb_token_id), self.rows,
                          contiguous=True)
        self.step_index = 0

    def logits(self, frames: torch.Tensor | None) -> torch.Tensor:
        """The next frame's logits [B, num_vq, codes] after ``frames`` [B, num_vq] (None: the
        first step, ``[Ptts]``)."""
        count = self.rows.shape[0]
        column = lambda v: torch.full((count,), v, dtype=torch.long, device=self.device)  # noqa: E731
        x = AudioStepInputs(
            active=column(1), bos=column(int(frames is None)),
            frame=(torch.zeros(count, self.cfg.num_vq, dtype=torch.long, device=self.device)
                   if frames is None else frames),
            position=column(self.cfg.audio_bos_position + self.step_index),
            text_len=self.text_len.to(self.device), call_frames=column(self.step_index),
            eos_after=column(0), warp=column(1), seed=column(0), counter=column(0),
            greedy=column(1), steps_left=column(1))
        self.step_index += 1
        return audio_logits(self.tts, self.cache, x, self.rows, contiguous=True)


def greedy(logits: torch.Tensor, eos: int) -> torch.Tensor:
    masked = logits.clone()
    masked[..., eos] = float("-inf")
    return masked.argmax(dim=-1)


def kl(reference: torch.Tensor, other: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference / t) || softmax(other / t)) per row and codebook."""
    p_log = torch.log_softmax(reference / temperature, dim=-1)
    q_log = torch.log_softmax(other / temperature, dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1)


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = float(((reference - other) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((reference ** 2).sum()) / noise)


def summary(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)), "max": float(values.max())}


@torch.inference_mode()
def measure(model, streams: int, steps: int, seed: int) -> dict:
    cfg = model.tts.config
    eos = cfg.eos_code
    device = next(model.tts.parameters()).device
    temperature = torch.tensor(TTS_TEMPERATURE[:cfg.num_vq], device=device)[None, :, None]
    reference = Streams(model, streams, "auto", seed)
    forced = Streams(model, streams, "fp8_e4m3", seed)
    free = Streams(model, streams, "fp8_e4m3", seed)
    # the floor: the model's own dtype, attention computed another way (SDPA over the mask:
    # another order of the same sums), fed the reference's frames too
    floor = Streams(model, streams, "auto", seed)
    ref_frames = free_frames = None
    agree, kl_1, kl_t, ref_codes, free_codes = [], [], [], [], []
    floor_agree, floor_kl_1, floor_kl_t = [], [], []
    ones = torch.ones_like(temperature)
    for _ in range(steps):
        ref_logits = reference.logits(ref_frames)
        forced_logits = forced.logits(ref_frames)  # teacher-forced: the reference's frames
        free_logits = free.logits(free_frames)
        set_one_query_attention(model.tts, "sdpa")
        floor_logits = floor.logits(ref_frames)
        set_one_query_attention(model.tts, "visible_ranges")
        ref_frames, free_frames = greedy(ref_logits, eos), greedy(free_logits, eos)
        for logits, top1, kls_1, kls_t in ((forced_logits, agree, kl_1, kl_t),
                                           (floor_logits, floor_agree, floor_kl_1, floor_kl_t)):
            top1.append((ref_frames == greedy(logits, eos)).float().cpu())
            kls_1.append(kl(ref_logits, logits, ones).cpu())
            kls_t.append(kl(ref_logits, logits, temperature).cpu())
        ref_codes.append(ref_frames.cpu())
        free_codes.append(free_frames.cpu())
    agree_all, ref_all, free_all = torch.stack(agree), torch.stack(ref_codes), torch.stack(free_codes)
    same_frame = (ref_all == free_all).all(dim=-1)  # [steps, streams]
    parted = [int(torch.nonzero(~same_frame[:, s])[0]) if not bool(same_frame[:, s].all())
              else steps for s in range(streams)]
    ref_audio = model.decoder.decode([ref_all[:, s] for s in range(streams)])
    free_audio = model.decoder.decode([free_all[:, s] for s in range(streams)])
    snrs = np.array([snr_db(a.float().cpu(), b.float().cpu())
                     for a, b in zip(ref_audio, free_audio)])
    return {
        "streams": streams, "steps": steps, "seed": seed,
        "teacher_forced": {
            "top1_agreement": float(agree_all.mean()),
            "top1_agreement_per_codebook": [float(v) for v in agree_all.mean(dim=(0, 1))],
            "kl_nats_temperature_1": summary(torch.stack(kl_1).flatten().numpy()),
            "kl_nats_sampling_temperature": summary(torch.stack(kl_t).flatten().numpy()),
        },
        "floor_teacher_forced": {
            "what": "the model's dtype with SDPA in place of the fused kernel: rounding alone",
            "top1_agreement": float(torch.stack(floor_agree).mean()),
            "kl_nats_temperature_1": summary(torch.stack(floor_kl_1).flatten().numpy()),
            "kl_nats_sampling_temperature": summary(torch.stack(floor_kl_t).flatten().numpy()),
        },
        "free_running_greedy": {
            "frames_equal": float(same_frame.float().mean()),
            "first_different_frame": summary(np.array(parted, dtype=float)),
            "streams_all_equal": int(sum(p == steps for p in parted)),
            "audio_snr_db": {"finite_streams": int(np.isfinite(snrs).sum()),
                             **(summary(snrs[np.isfinite(snrs)]) if np.isfinite(snrs).any()
                                else {})},
        },
        "same_codes_audio": "identical: DVAE + Vocos do not read the TTS cache",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="tiny",
                        help="tiny (golden checkpoint), random (full size) or a checkpoint folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "kv-fp8-numerics.json"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load(args.weights, args.device, dtype)
    attention = "visible_ranges"
    set_one_query_attention(model.tts, attention)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"weights": args.weights, "device": device_name, "model_dtype": str(dtype)[6:],
              "one_query_attention": attention, "git_commit": git_commit(),
              "command": f"python -m bench.accuracy.kv_cache --weights {args.weights} "
                         f"--device {args.device} --streams {args.streams} --steps {args.steps}",
              **measure(model, args.streams, args.steps, args.seed)}
    out = Path(args.out)
    runs = json.loads(out.read_text()).get("runs", {}) if out.exists() else {}
    runs[args.weights] = result  # one entry per weights, kept beside the others
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": "fp8 (e4m3) TTS KV cache against the model's dtype",
                               "runs": runs}, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
