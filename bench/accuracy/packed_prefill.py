"""How far the admission prefill moves when its prompts are packed into one row
(``packed_prefill``) instead of padded to the longest: what the engine keeps from the pass.

Random prompts (``--prompts`` of 8 to ``--longest-prompt`` tokens, a speaker token near each
end) are prefilled in admissions of ``--group`` (as a step admits them, up to
``prefill_prompts``) by the engine's own :meth:`ModelRunner.prefill_prompts`, eagerly (eager
runs on any device; the engine's graphs replay the same kernels, the padded ones over batches
and lengths rounded up to their buckets), every prompt as a chat row:

- **packed**: the prompts in one row, each token attending to its own prompt;
- **floor**: the padded pass with each prompt alone (no padding): what a batch's shape already
  moves, the rounding the engine lives with today;

both against the padded pass (the engine's default). Per arm: the first-token logits (top-1
agreement, KL at temperature 1 and at chat's 0.7, largest logit difference), the speaker
embeddings the TTS reads (relative error, lowest cosine) and the keys and values left in the
chat slots (relative error). Weights: the tiny golden checkpoint (``--weights tiny``) or
full-size random weights (``--weights random``); trained weights cannot be downloaded where this
project is built (``--weights <checkpoint folder>`` runs on them).

    python -m bench.accuracy.packed_prefill --weights random --device cuda --out packed.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from bench.accuracy.kv_cache import drift_parser, kl, model_for, summary
from bench.accuracy.llm_attention import CHAT_TEMPERATURE
from serve_app.engines.minicpmo.device.runner import ModelRunner
from serve_app.engines.minicpmo.engine import EngineOptions

def random_prompts(count: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts whose last id marks where the pass reads the speaker embedding (the
    vocabulary's last id, which no other token of theirs is)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, longest + 1, (count,), generator=generator).tolist()
    prompts = [torch.randint(0, vocab - 1, (n,), generator=generator).tolist() for n in lengths]
    for prompt in prompts:
        prompt[-3] = vocab - 1
    return prompts


def prefill(runner: ModelRunner, prompts: list[list[int]], packed: bool, groups: list[range]
            ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every prompt's first-token logits [N, V], speaker embedding [N, H] and its chat slot's
    keys and values, the prompts admitted in ``groups`` (slot i for prompt i)."""
    runner.packed_prefill = packed
    speaker = runner.model.llm.model.embed_tokens.num_embeddings - 1
    logits = []
    for group in groups:
        rows = list(range(len(group)))
        logits.append(runner.prefill_prompts([prompts[i] for i in group], [None] * len(group),
                                             list(group), speaker, rows, list(group)).float())
    cache = runner.llm_cache
    kept = [(cache.all_keys[:, i, :, :len(p)].float().clone(),
             cache.all_values[:, i, :, :len(p)].float().clone()) for i, p in enumerate(prompts)]
    return torch.cat(logits), runner.speakers[:len(prompts)].float().clone(), kept


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def compare(reference, other) -> dict:
    (ref_logits, ref_speakers, ref_kv), (logits, speakers, kv) = reference, other
    ones = torch.ones(1, device=logits.device)
    return {
        "top1_agreement": float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
        "kl_nats_temperature_1": summary(kl(ref_logits, logits, ones).cpu().numpy()),
        f"kl_nats_temperature_{CHAT_TEMPERATURE}": summary(
            kl(ref_logits, logits, ones * CHAT_TEMPERATURE).cpu().numpy()),
        "max_abs_logit_difference": float((ref_logits - logits).abs().max()),
        "speaker_relative_error": summary(np.array(
            [relative(s, r) for s, r in zip(speakers, ref_speakers)])),
        "speaker_cosine_min": float(torch.nn.functional.cosine_similarity(
            speakers, ref_speakers, dim=-1).min()),
        "keys_relative_error": summary(np.array(
            [relative(k, r[0]) for (k, _), r in zip(kv, ref_kv)])),
        "values_relative_error": summary(np.array(
            [relative(v, r[1]) for (_, v), r in zip(kv, ref_kv)])),
    }


@torch.inference_mode()
def measure(model, count: int, group: int, longest: int, seed: int) -> dict:
    device = next(model.llm.parameters()).device
    options = EngineOptions(device=device.type, max_slots=count, max_chat_slots=count,
                            llm_max_positions=max(longest, 64), tts_max_positions=1024)
    runner = ModelRunner(model, options, penalty_width=1)
    vocab = model.llm.model.embed_tokens.num_embeddings
    prompts = random_prompts(count, longest, vocab, seed)
    admissions = [range(start, min(start + group, count)) for start in range(0, count, group)]
    padded = prefill(runner, prompts, False, admissions)
    packed = prefill(runner, prompts, True, admissions)
    alone = prefill(runner, prompts, False, [range(i, i + 1) for i in range(count)])
    lengths = np.array([len(p) for p in prompts], dtype=float)
    padded_tokens = sum(len(g) * max(len(prompts[i]) for i in g) for g in admissions)
    return {"prompts": count, "group": group, "seed": seed, "prompt_tokens": summary(lengths),
            "tokens_computed": {"padded_to_longest": padded_tokens, "packed": int(lengths.sum())},
            "packed": {"what": "prompts packed in one row against the padded pass",
                       **compare(padded, packed)},
            "floor": {"what": "each prompt alone against the padded pass: a batch's shape "
                              "alone", **compare(padded, alone)}}


def main() -> None:
    parser = drift_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16, help="prompts a pass (prefill_prompts)")
    parser.add_argument("--longest-prompt", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, head = model_for(args.weights, args.device, "bench.accuracy.packed_prefill")
    result = {**head, **measure(model, args.prompts, args.group, args.longest_prompt, args.seed)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("weights", "tokens_computed", "packed", "floor")},
                     indent=1))


if __name__ == "__main__":
    main()
