"""One request to the engine: what it asks for, checked where it enters, and the late read of its stop flag."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.sampling.sampler import SamplingParams

MAX_EOS_IDS = 8  # EOS ids live in a fixed-size buffer (padded with -1) so graphs survive a change of EOS


@dataclass
class Request:
    """Prompt `input_ids` [B, T] and `max_new_tokens` new tokens sampled with `params`. Rows that reach one of the
    `eos` ids then emit `pad` (when EOS ids are set, like transformers); `attention_mask` (left padding only) marks
    prompt positions to ignore; each of `criteria` is called as `criterion(input_ids_so_far, logits)` and returns a
    bool per row. `logits_out`, when given, receives a copy of each step's last-position logits [B, V]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    max_new_tokens: int
    params: SamplingParams
    eos: list[int]
    pad: int
    criteria: list[Callable[..., Any]] = field(default_factory=list)
    logits_out: list[torch.Tensor] | None = None

    @classmethod
    def admit(cls, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams,
              eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
              attention_mask: torch.Tensor | None = None, stopping_criteria: Sequence[Callable[..., Any]] = (),
              logits_out: list[torch.Tensor] | None = None) -> Request:
        """The request, or ValueError for what the engine cannot take (`check`)."""
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        request = cls(input_ids, attention_mask, max_new_tokens, params, eos, pad_token_id, list(stopping_criteria),
                      logits_out)
        request.check()
        return request

    def check(self) -> None:
        """ValueError for what the engine cannot take: no new tokens, too many EOS ids."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.eos) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(self.eos)}")


def check_prompt(config: Any, batch: int, prompt: int, max_new_tokens: int) -> None:
    """ValueError for a request the model cannot run: an empty prompt, or more positions than the model has."""
    if batch < 1 or prompt < 1:
        raise ValueError(f"input_ids of shape ({batch}, {prompt}) holds an empty prompt; valid: at least 1 token in "
                         f"each of at least 1 row")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and prompt + max_new_tokens > positions:
        raise ValueError(f"prompt length {prompt} + max_new_tokens {max_new_tokens} = {prompt + max_new_tokens} "
                         f"positions is past the model's max_position_embeddings {positions}; valid: prompt length + "
                         f"max_new_tokens <= {positions}")


def check_input_ids(config: Any, input_ids: Any, *flags: torch.Tensor) -> list[bool]:
    """ValueError for prompt ids no embedding can look up: a float or bool tensor, or an id outside
    [0, vocab_size). Checked before anything runs (one host read of the min and max), so a bad id is this line,
    not an IndexError from deep inside the embedding or a device-side assert. `flags` (device bools of the
    caller's own checks) are read in the same read: their values, in order."""
    if not isinstance(input_ids, torch.Tensor):
        return [bool(flag) for flag in flags]  # transformers' generate() says what it takes
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must hold integer token ids (torch.long), got dtype "
                         f"{str(input_ids.dtype).replace('torch.', '')}; valid: input_ids.long() of ids in "
                         f"[0, vocab_size)")
    vocab = getattr(config, "vocab_size", None)
    if input_ids.numel() == 0 or not isinstance(vocab, int):
        return [bool(v) for v in torch.stack(flags).tolist()] if flags else []
    low, high = torch.aminmax(input_ids)
    # one read of all (one sync on a device)
    low, high, *values = torch.stack([low, high, *(flag.to(low.device, low.dtype) for flag in flags)]).tolist()
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary; valid: 0 <= id < "
                         f"vocab_size {vocab}")
    return [bool(v) for v in values]


class LateStop:
    """"Every row finished?" read one step late: the flag is copied to pinned memory as the step is queued
    and read when the next one has been queued, so the host never waits for the step it just launched."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        if enabled:
            self.flags = [torch.zeros((), dtype=torch.bool, pin_memory=self.cuda) for _ in range(2)]
            self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]

    def finished_before(self, step: int, done: torch.Tensor) -> bool:
        """Queue the copy of this step's flag; True when the previous step had finished every row."""
        if not self.enabled:
            return False
        slot = step % 2
        self.flags[slot].copy_(done, non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        if step == 0:
            return False
        prev = (step - 1) % 2
        if self.cuda:
            self.events[prev].synchronize()
        return bool(self.flags[prev])
