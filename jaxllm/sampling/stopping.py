"""Host-side stop checks on token ids (stop strings are matched on detokenized text elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from jaxllm.sampling.params import SamplingParams


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    eos_ids: Union[set[int], frozenset[int]],
    num_outputs: Optional[int] = None,
) -> tuple[Optional[str], Optional[int]]:
    """Whether a request is finished after its latest token.

    Returns (finish_reason, stop_reason), as in vLLM: ('stop', None) for an end id (unless
    ignore_eos), ('stop', token_id) for a stop_token_id, ('length', None) at max_tokens,
    else (None, None). End and stop ids never finish a request before min_tokens outputs.
    The stop token stays in output_token_ids; whether it is shown is the caller's choice.
    `num_outputs`: judge only the first `num_outputs` tokens (later ones are still in flight),
    without copying the list.
    """
    n = len(output_token_ids) if num_outputs is None else num_outputs
    if n == 0:
        return None, None
    if n >= params.min_tokens:
        last = output_token_ids[n - 1]
        if not params.ignore_eos and last in eos_ids:
            return "stop", None
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop", last
    if n >= params.max_tokens:
        return "length", None
    return None, None
