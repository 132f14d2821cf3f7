"""The Hugging Face transformers peer of `jaxllm bench latency`: per-token timestamps of `generate`.

HF at concurrency c runs the requests c at a time as one static batch (`generate` over c
equal-length prompts, greedy, exactly the output length): each request's first token comes
after the batch's prefill, and every later token one decode step of the batch apart. A
`StoppingCriteria` that never stops records when each step ended (it is called once per
generated token), so TTFT and inter-token latency are measured the same way as jaxllm's
streamed chunks. torch on CPU, float32, the same weights and prompts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jaxllm.bench.request_metrics import RequestRecord


def load_hf_model(model_dir: Path) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


class _StepClock:
    """A stopping criterion that stops nothing and notes the time of every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(model: Any, prompts: list[list[int]], output_len: int, concurrency: int) -> list[RequestRecord]:
    """The requests `concurrency` at a time, each batch one greedy `generate` (see module doc)."""
    import torch
    import transformers

    records = []
    for first in range(0, len(prompts), concurrency):
        batch = prompts[first : first + concurrency]
        if len({len(p) for p in batch}) != 1:
            raise ValueError("the HF peer takes prompts of one length (no padding in its batches)")
        clock = _StepClock()
        input_ids = torch.tensor(batch, dtype=torch.long)
        extra = {"pad_token_id": model.config.eos_token_id} if model.config.pad_token_id is None else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                stopping_criteria=transformers.StoppingCriteriaList([clock]),
                **extra,
            )
        generated = int(out.shape[1] - input_ids.shape[1])
        for prompt in batch:
            records.append(
                RequestRecord(
                    input_tokens=len(prompt),
                    start=start,
                    output_tokens=generated,
                    first_token=clock.times[0],
                    end=clock.times[-1],
                    chunk_times=list(clock.times),
                )
            )
    return records
