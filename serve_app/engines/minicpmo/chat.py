"""Chat mode's LLM side on the host: each stream's sampling inputs, and its sampled tokens
grouped three by three into the text pieces the TTS reads (docs/minicpmo.md, "Chat mode")."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .device.llm_step import LLMStepInputs
from .scheduler import Stream
from .text import PIECE_TOKENS, TERMINATOR_TOKENS, TTS_EOS_MARK, PieceDecoder


class ChatText:
    """Token bookkeeping of chat streams (no tensors but the step inputs it builds)."""

    def __init__(self, tokenizer, gen_prompt_ids: Sequence[int], llm_max_positions: int) -> None:
        self._decode = tokenizer.decode
        self.terminators = [tokenizer.convert_tokens_to_ids(t) for t in TERMINATOR_TOKENS]
        self._tts_eos_id = tokenizer.convert_tokens_to_ids(TTS_EOS_MARK)
        self._gen_prompt_ids = list(gen_prompt_ids)
        self._llm_max_positions = llm_max_positions
        # the repetition penalty sees the generation prompt and the current piece's ids
        self.penalty_width = len(self._gen_prompt_ids) + PIECE_TOKENS + 1

    def start(self, stream: Stream, prompt_length: int) -> None:
        """The stream's prompt is in its LLM slot; its first token is sampled next."""
        stream.llm_len = prompt_length
        stream.penalty_window = list(self._gen_prompt_ids)
        stream.piece_decoder = PieceDecoder(self._decode, self.terminators)

    def accept(self, stream: Stream, token: int) -> bool:
        """Record a sampled token: every 3 tokens (or at the end) a piece for the TTS. True when
        the answer is over (a terminator, the token limit or a full LLM slot)."""
        request = stream.plan.request
        fixed = request.lengths.llm_tokens
        stream.llm_tokens += 1
        stream.group.append(token)
        stream.penalty_window.append(token)
        stream.next_token = token
        terminated = fixed is None and (token in self.terminators or token == self._tts_eos_id)
        limit = fixed if fixed is not None else request.sampling.max_new_tokens
        if len(stream.group) == PIECE_TOKENS or terminated or stream.llm_tokens >= limit:
            stream.pieces.append(stream.piece_decoder.push(stream.group))
            stream.penalty_window = [token]  # upstream penalises only the current call's ids
            stream.group = []
            if (terminated or stream.llm_tokens >= limit
                    or stream.llm_len + 1 >= self._llm_max_positions):
                stream.text_done = True
                return True
        return False

    def inputs(self, streams: Sequence[Stream]) -> LLMStepInputs:
        """The next decode step's inputs for ``streams`` (CPU tensors)."""
        params = [s.plan.request.sampling for s in streams]
        width = self.penalty_width
        window = np.zeros((len(streams), width), dtype=np.int64)
        for row, stream in enumerate(streams):
            ids = stream.penalty_window[-width:]
            window[row, :len(ids)] = ids
            window[row, len(ids):] = ids[0]
        return LLMStepInputs(
            token=torch.tensor([s.next_token or 0 for s in streams]),
            position=torch.tensor([s.llm_len for s in streams]),
            active=torch.ones(len(streams), dtype=torch.bool),
            temperature=torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]),
            top_p=torch.tensor([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params]),
            penalty=torch.tensor([p.repetition_penalty for p in params]),
            greedy=torch.tensor([p.temperature == 0 for p in params]),
            seed=torch.tensor([s.plan.request.seed or 0 for s in streams]),
            counter=torch.tensor([s.llm_tokens for s in streams]),
            window=torch.from_numpy(window))
