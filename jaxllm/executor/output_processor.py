"""Turns the engine's token events into per-sequence output deltas (text, stop strings, logprobs).

It runs either on the executor's output thread or inside postprocess worker processes;
both run this same code, so outputs do not depend on where detokenization happens.
Everything crossing a process boundary here is a plain tuple or a small dataclass.

Events (from the engine thread, in order per engine request):
  (ADD, rid, OutputSpec)                          a sequence starts
  (TOKENS, rid, token_ids, logprobs, finish_reason, stop_reason[, score[, logits_outputs]])
                                                  tokens read back; finish_reason set on the last;
                                                  a beam-search beam's final event carries its score,
                                                  a final event the logits outputs asked for
  (ERROR, rid, exception)                         the engine refused or failed this sequence
  (DECODED, rids, token_ids)                      one more token for each of many sequences (the
                                                  plain rows of a decode step; none finishes);
                                                  sequences nobody watches (no streaming, no stop
                                                  strings) skip it: their final event carries all
                                                  their tokens
A sequence's final delta is produced only once the engine has released it (its last
TOKENS event), so a finished result never still holds KV blocks.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from jaxllm.executor.detokenizer import IncrementalDetokenizer, find_stop_string, make_decoder

ADD, TOKENS, ERROR = 0, 1, 2
DECODED = 4  # (3 is the executor's FATAL)


@dataclass
class OutputSpec:
    """The output-side settings of one sequence (a picklable subset of SamplingParams)."""

    prompt_tail: list[int]
    streaming: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    return_logprobs: bool = False
    stream_interval: int = 1

    @property
    def quiet(self) -> bool:
        """Nobody looks at its partial output (no streaming, no stop strings): the engine thread
        sends all its tokens with its last event."""
        return not (self.streaming or self.stop)


@dataclass
class Delta:
    """What one sequence gained since its previous delta."""

    rid: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    stop_hit: bool = False  # a stop string matched: the engine should stop this sequence
    error: Optional[BaseException] = None
    # On the final delta: context_logits / generation_logits / prompt_logprobs, those asked for.
    logits_outputs: Optional[dict] = None


def event_slices(events: list[tuple], size: int) -> list[list[tuple]]:
    """`events` cut into slices of about `size` sequence updates each (a DECODED event counts
    one per row and is itself cut), so that a slice takes about the same time to process."""
    slices: list[list[tuple]] = []
    current: list[tuple] = []
    weight = 0
    for event in events:
        if event[0] == DECODED:
            rids, tokens = event[1], event[2]
            for start in range(0, len(rids), size):
                part = (DECODED, rids[start : start + size], tokens[start : start + size])
                current.append(part)
                weight += len(part[1])
                if weight >= size:
                    slices.append(current)
                    current, weight = [], 0
            continue
        current.append(event)
        weight += 1
        if weight >= size:
            slices.append(current)
            current, weight = [], 0
    if current:
        slices.append(current)
    return slices


def portable_error(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Sequence:
    __slots__ = (
        "spec",
        "detok",
        "num_tokens",
        "cumulative",
        "stop_str",
        "emitted_chars",
        "hold_back",
        "pending_tokens",
        "pending_logprobs",
        "deferred_decode",
        "since_emit",
        "quiet",
    )

    def __init__(self, spec: OutputSpec, tokenizer: Any, decoder) -> None:
        self.spec = spec
        self.detok = (
            IncrementalDetokenizer(
                tokenizer, spec.prompt_tail, skip_special_tokens=spec.skip_special_tokens, decoder=decoder
            )
            if spec.detokenize
            else None
        )
        self.num_tokens = 0
        self.cumulative: Optional[float] = 0.0 if spec.return_logprobs else None
        self.stop_str: Optional[str] = None
        self.emitted_chars = 0
        # Text that could be the start of a stop string is held back while streaming.
        self.hold_back = max(len(s) for s in spec.stop) - 1 if spec.stop and not spec.include_stop_str_in_output else 0
        self.pending_tokens: list[int] = []
        self.pending_logprobs: Optional[list] = [] if spec.return_logprobs else None
        # Without streaming or stop strings nobody looks at partial text: decode once at the end.
        self.deferred_decode: list[int] = []
        self.since_emit = 0
        self.quiet = spec.quiet

    def take_text(self, final: bool) -> str:
        if self.detok is None:
            return ""
        end = len(self.detok.text) - (0 if final else self.hold_back)
        if end <= self.emitted_chars:
            return ""
        text = self.detok.text[self.emitted_chars : end]
        self.emitted_chars = end
        return text


class OutputProcessor:
    """Per-sequence output state, keyed by engine request id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoder = make_decoder(tokenizer)
        self._seqs: dict[int, _Sequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def process(self, events: list[tuple]) -> list[Delta]:
        deltas: list[Delta] = []
        for event in events:
            kind, rid = event[0], event[1]
            try:
                if kind == TOKENS:
                    delta = self._tokens(
                        rid, event[2], event[3], event[4], event[5], event[6] if len(event) > 6 else None
                    )
                    if delta is not None and len(event) > 7 and delta.finish_reason is not None:
                        delta.logits_outputs = event[7]
                    if delta is not None:
                        deltas.append(delta)
                elif kind == DECODED:
                    self._decoded(event[1], event[2], deltas)
                elif kind == ADD:
                    self._seqs[rid] = _Sequence(event[2], self.tokenizer, self._decoder)
                elif kind == ERROR:
                    if self._seqs.pop(rid, None) is not None:
                        deltas.append(Delta(rid, error=event[2]))
            except Exception as exc:  # a failure here concerns this sequence only
                self._seqs.pop(rid, None)
                deltas.append(Delta(rid, error=portable_error(exc)))
        return deltas

    def _decoded(self, rids: list[int], token_ids: list[int], deltas: list[Delta]) -> None:
        """A DECODED event: one token for each watched sequence of `rids`."""
        seqs = self._seqs
        for rid, token in zip(rids, token_ids):
            seq = seqs.get(rid)
            if seq is None or seq.quiet:
                continue
            try:
                delta = self._tokens(rid, [token], None, None, None)
            except Exception as exc:  # a failure here concerns this sequence only
                seqs.pop(rid, None)
                delta = Delta(rid, error=portable_error(exc))
            if delta is not None:
                deltas.append(delta)

    def _tokens(
        self,
        rid: int,
        token_ids: list[int],
        logprobs: Optional[list],
        finish_reason: Optional[str],
        stop_reason,
        score: Optional[float] = None,
    ) -> Optional[Delta]:
        seq = self._seqs.get(rid)
        if seq is None:
            return None
        if score is not None:  # beam search: the beam's score is its cumulative logprob
            seq.cumulative = score
        spec = seq.spec
        if seq.stop_str is not None:
            # Already finished by a stop string; wait for the engine to release the sequence.
            if finish_reason is None:
                return None
            del self._seqs[rid]
            return self._emit(rid, seq, "stop", seq.stop_str, final=True)
        seq.num_tokens += len(token_ids)
        seq.pending_tokens.extend(token_ids)
        if logprobs and seq.pending_logprobs is not None:
            seq.pending_logprobs.extend(logprobs)
            for entry, token in zip(logprobs, token_ids):
                seq.cumulative += entry[token].logprob
        finished = finish_reason is not None
        stop_hit = False
        if seq.detok is not None:
            decodable = token_ids
            if finish_reason == "stop" and token_ids and not spec.include_stop_str_in_output:
                decodable = token_ids[:-1]  # an end id or stop token id is not part of the text
            if not spec.streaming and not spec.stop:
                seq.deferred_decode.extend(decodable)
                if finished:
                    seq.detok.add(seq.deferred_decode)
            else:
                new_chars = seq.detok.add(decodable)
                if spec.stop and seq.num_tokens > spec.min_tokens:
                    hit = find_stop_string(seq.detok.text, new_chars, spec.stop, spec.include_stop_str_in_output)
                    if hit is not None:
                        seq.stop_str, cut = hit
                        if cut != -1:
                            seq.detok.truncate(cut)
                        stop_hit = True
            if finished and not stop_hit:
                seq.detok.flush()
        if stop_hit or finished:
            if finished:
                del self._seqs[rid]
                if stop_hit:
                    return self._emit(rid, seq, "stop", seq.stop_str, final=True)
                return self._emit(rid, seq, finish_reason, stop_reason, final=True)
            delta = self._emit(rid, seq, None, None, final=True)
            delta.stop_hit = True
            return delta
        if not spec.streaming:
            return None
        seq.since_emit += len(token_ids)
        if seq.since_emit < spec.stream_interval:
            return None
        return self._emit(rid, seq, None, None, final=False)

    @staticmethod
    def _emit(rid: int, seq: _Sequence, finish_reason, stop_reason, *, final: bool) -> Delta:
        delta = Delta(
            rid,
            seq.pending_tokens,
            seq.take_text(final),
            seq.pending_logprobs,
            seq.cumulative,
            finish_reason,
            stop_reason,
        )
        seq.pending_tokens = []
        seq.pending_logprobs = [] if seq.pending_logprobs is not None else None
        seq.since_emit = 0
        return delta
