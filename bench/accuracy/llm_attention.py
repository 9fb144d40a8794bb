"""How far the chat LLM's decode step moves when its layers attend by visible ranges (the fused
Triton kernel of ``model/range_attention.py``, ``one_query_attention: visible_ranges``) instead
of SDPA over a mask (the engine's default).

Random prompts are prefilled into an LLM cache (SDPA, as the engine's prefill always is); three
copies of that cache then decode ``--steps`` tokens each, teacher-forced with the reference's
greedy tokens so that every step compares next-token distributions given the same history:

- the reference: SDPA over the whole cache (the eager path);
- the floor: SDPA over the shortest key span that holds the rows (what the engine's graphs
  replay without ranges): the same sums in another order, two paths the engine already takes;
- the ranges: the fused kernel (on CUDA; elsewhere the layer runs SDPA over the ranges' mask,
  so off CUDA this measures nothing but that path).

Per step and row: top-1 agreement with the reference (its argmax token), KL(reference || other)
of the next-token distribution at temperature 1 and at chat's default 0.7, and the largest
absolute logit difference. Weights: the tiny golden checkpoint (``--weights tiny``) or full-size
random weights (``--weights random``); trained weights cannot be downloaded where this project
is built (``--weights <checkpoint folder>`` runs on them).

    python -m bench.accuracy.llm_attention --weights random --device cuda --out llm-attention.json
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from bench.accuracy.kv_cache import drift_parser, kl, model_for, summary
from serve_app.engines.minicpmo.device.graphs import shortest_span
from serve_app.engines.minicpmo.device.llm_step import (
    LLMStepInputs,
    llm_decode_logits,
    llm_key_spans,
    llm_prefill,
)
from serve_app.engines.minicpmo.model.layers import SlotKVCache, set_one_query_attention

CHAT_TEMPERATURE = 0.7  # the engine's default sampling temperature for chat (docs/minicpmo.md)


def step_inputs(tokens: torch.Tensor, positions: torch.Tensor) -> LLMStepInputs:
    """A decode step's inputs for every row (only the token, position and activity are read by
    the forward pass; the sampling fields are placeholders)."""
    rows = len(tokens)
    ones = torch.ones(rows, device=tokens.device)
    zeros = torch.zeros(rows, dtype=torch.long, device=tokens.device)
    return LLMStepInputs(token=tokens, position=positions,
                         active=torch.ones(rows, dtype=torch.bool, device=tokens.device),
                         temperature=ones, top_p=ones, top_k=zeros + 1, penalty=ones,
                         greedy=torch.ones(rows, dtype=torch.bool, device=tokens.device),
                         seed=zeros, counter=zeros, window=zeros[:, None])


class Agreement:
    """One arm's figures against the reference, step by step."""

    def __init__(self) -> None:
        self.top1: list[torch.Tensor] = []
        self.kl_1: list[torch.Tensor] = []
        self.kl_chat: list[torch.Tensor] = []
        self.max_abs: list[float] = []

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        reference, other = reference.float(), other.float()
        self.top1.append((reference.argmax(-1) == other.argmax(-1)).float().cpu())
        self.kl_1.append(kl(reference, other, torch.ones(1, device=other.device)).cpu())
        self.kl_chat.append(kl(reference, other,
                               torch.full((1,), CHAT_TEMPERATURE, device=other.device)).cpu())
        self.max_abs.append(float((reference - other).abs().max()))

    def result(self) -> dict:
        return {"top1_agreement": float(torch.stack(self.top1).mean()),
                "kl_nats_temperature_1": summary(torch.stack(self.kl_1).flatten().numpy()),
                f"kl_nats_temperature_{CHAT_TEMPERATURE}": summary(
                    torch.stack(self.kl_chat).flatten().numpy()),
                "max_abs_logit_difference": summary(np.array(self.max_abs))}


@torch.inference_mode()
def measure(model, streams: int, steps: int, seed: int, longest_prompt: int,
            float32_reference: bool = False) -> dict:
    llm = model.llm
    device = next(llm.parameters()).device
    dtype = next(llm.parameters()).dtype
    # The truth both bf16 paths round: the same weights in float32, its cache in float32
    exact = copy.deepcopy(llm).float() if float32_reference else None
    vocab = llm.model.embed_tokens.num_embeddings
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, longest_prompt + 1, (streams,), generator=generator)
    ids = torch.randint(0, vocab, (streams, int(lengths.max())), generator=generator)
    valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    positions_total = int(lengths.max()) + steps + 1
    rows = torch.arange(streams, device=device)
    reference = SlotKVCache(model.config.llm, streams, positions_total, device, dtype)
    set_one_query_attention(llm, "sdpa")
    hidden = llm_prefill(llm, reference, ids.to(device), valid.to(device), rows, True)
    tokens = llm.logits(hidden[rows, (lengths - 1).to(device)]).argmax(-1)
    floor, ranges = (SlotKVCache(model.config.llm, streams, positions_total, device, dtype)
                     for _ in range(2))
    for other in (floor, ranges):
        other.all_keys.copy_(reference.all_keys)
        other.all_values.copy_(reference.all_values)
    if exact is not None:
        exact_cache = SlotKVCache(model.config.llm, streams, positions_total, device,
                                  torch.float32)
        llm_prefill(exact, exact_cache, ids.to(device), valid.to(device), rows, True)
    spans = llm_key_spans(reference.max_positions + 1)
    positions = lengths.to(device)
    floor_arm, ranges_arm = Agreement(), Agreement()
    sdpa_exact, ranges_exact = Agreement(), Agreement()
    for _ in range(steps):
        x = step_inputs(tokens, positions)
        want = llm_decode_logits(llm, reference, x, rows, True)
        truth = (llm_decode_logits(exact, exact_cache, x, rows, True)
                 if exact is not None else None)
        span = shortest_span(spans, int(positions.max()))
        floor_arm.add(want, llm_decode_logits(llm, floor, x, rows, True, span))
        set_one_query_attention(llm, "visible_ranges")
        try:
            by_ranges = llm_decode_logits(llm, ranges, x, rows, True)
        finally:
            set_one_query_attention(llm, "sdpa")
        ranges_arm.add(want, by_ranges)
        if truth is not None:
            sdpa_exact.add(truth, want)
            ranges_exact.add(truth, by_ranges)
        # teacher-forced: every arm is fed the reference's token (the float32 one's, if run)
        tokens = (truth if truth is not None else want).argmax(-1)
        positions = positions + 1
    against_float32 = {} if exact is None else {"against_float32": {
        "what": "each bf16 path against the same weights run in float32 (cache and all), "
                "which also chose the tokens fed",
        "sdpa": sdpa_exact.result(), "ranges_kernel": ranges_exact.result()}}
    return {"streams": streams, "steps": steps, "seed": seed,
            "prompt_tokens": summary(lengths.float().numpy()),
            "ranges_kernel": {"what": "visible ranges (the fused kernel on CUDA) against SDPA "
                                      "over the whole cache", **ranges_arm.result()},
            "floor": {"what": "SDPA over the shortest span against SDPA over the whole cache: "
                              "two paths the engine already takes", **floor_arm.result()},
            **against_float32}


def main() -> None:
    parser = drift_parser(__doc__)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--longest-prompt", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float32-reference", action="store_true",
                        help="also run the LLM in float32 (a copy: 4 bytes a weight) and compare "
                             "both bf16 paths with it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, head = model_for(args.weights, args.device, "bench.accuracy.llm_attention")
    result = {**head, "kernel_ran": args.device.startswith("cuda"),
              **measure(model, args.streams, args.steps, args.seed, args.longest_prompt,
                        args.float32_reference)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result.get(k) for k in ("weights", "ranges_kernel", "floor",
                                                 "against_float32")}, indent=1))


if __name__ == "__main__":
    main()
