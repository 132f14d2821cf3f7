"""Relaxed MTP acceptance inside thinking spans (TensorRT-LLM's `use_relaxed_acceptance_for_thinking`).

On a tiny DeepSeek-V3 checkpoint with a random MTP layer and a word-level tokenizer that has
`<think>` and `</think>`, the same workload (prompts that open a thinking span, prompts that
open and close one, prompts without one) runs on the engine without speculation, with exact
MTP acceptance and with relaxed acceptance at several windows. The oracle is transformers'
DeepseekV3 forward over each finished sequence: every draft the engine verified is checked in
numpy against the target's probabilities at its position (accepted inside a thinking span:
among the top `relaxed_topk` and within `relaxed_delta` of the top probability; accepted
outside one: the argmax; rejected: not so), and every other output token is the argmax.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.sampling import SamplingParams  # noqa: E402
from jaxllm.speculative_config import MTPDecodingConfig, parse_speculative_config  # noqa: E402
from tests.mtp_helpers import write_engine_checkpoint  # noqa: E402

from conftest import tiny_engine  # noqa: E402

BEGIN, END = 126, 127  # the ids of <think> and </think> in the test tokenizer
LIMITS = dict(max_batch_size=4, max_num_tokens=16, compile_ahead=False, decode_batch_sizes=[], max_kv_tokens=2048)
WINDOW = dict(relaxed_topk=8, relaxed_delta=0.3)
TOL = 1e-4  # jax against torch in float32: probabilities within this are ties


def _relaxed(relaxed_topk: int, relaxed_delta: float) -> MTPDecodingConfig:
    return MTPDecodingConfig(
        num_nextn_predict_layers=2,
        use_relaxed_acceptance_for_thinking=True,
        relaxed_topk=relaxed_topk,
        relaxed_delta=relaxed_delta,
    )


def _write_tokenizer(directory) -> None:
    """A word-level tokenizer over the model's 128 ids with ChatML specials and the thinking tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(128)}
    for name, i in (
        ("<|endoftext|>", 0),
        ("<|im_start|>", 1),
        ("<|im_end|>", 2),
        ("<think>", BEGIN),
        ("</think>", END),
    ):
        del vocab[f"t{i}"]
        vocab[name] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    body = [rng.integers(3, 120, n).tolist() for n in (6, 9, 12, 5, 8, 7)]
    return [
        [BEGIN] + body[0],  # thinking from the prompt on (DeepSeek-R1's template ends with <think>)
        [BEGIN] + body[1],
        body[2][:3] + [BEGIN] + body[2][3:],
        [BEGIN] + body[3],
        [BEGIN] + body[4][:4] + [END] + body[4][4:],  # thinking closed in the prompt
        body[5],  # no thinking
    ]


def _run(directory, config):
    """Each prompt's output tokens, the drafts the engine verified as (request index, sequence
    before the drafts, drafts), and the engine's (accepted, drafted) totals."""
    engine = tiny_engine(directory, speculative_config=config, **LIMITS)
    verified: list[tuple[int, list[int], list[int]]] = []
    try:
        spec = engine.speculation
        index: dict[int, int] = {}
        if spec is not None:
            spec.adaptive = False  # every step drafts
            prepare = spec.prepare

            def recording(plan, output, drafts):
                for request in output.generation_requests:
                    if drafts.get(request.request_id):
                        verified.append((index[request.request_id], request.all_token_ids, drafts[request.request_id]))
                return prepare(plan, output, drafts)

            spec.prepare = recording
        outputs: dict[int, list[int]] = {}
        for i, prompt in enumerate(_prompts()):
            request = engine.add_request(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
            index[request.request_id] = i
            outputs[i] = []
        steps = 0
        while engine.has_unfinished_requests():
            for update in engine.step():
                outputs[index[update.request.request_id]] += update.new_token_ids
            steps += 1
            assert steps < 500
        totals = (spec.num_accepted_tokens, spec.num_draft_tokens) if spec is not None else (0, 0)
        engine.kv_cache_manager.check_invariants()
    finally:
        engine.close()
    return [outputs[i] for i in range(len(outputs))], verified, totals


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_mtp_thinking")
    model, _ = write_engine_checkpoint(directory)
    _write_tokenizer(directory)
    configs = {
        "plain": None,
        "exact": MTPDecodingConfig(num_nextn_predict_layers=2),
        "top1": _relaxed(1, 0.0),
        "window": _relaxed(**WINDOW),
        "wide": _relaxed(128, 1.0),
    }
    return model, {name: _run(str(directory), config) for name, config in configs.items()}


def _thinking(tokens: list[int]) -> bool:
    """Whether `tokens` end inside a thinking span (numpy, from the token ids alone)."""
    a = np.asarray(tokens)
    begins, ends = np.flatnonzero(a == BEGIN), np.flatnonzero(a == END)
    last_begin = begins[-1] if begins.size else -1
    last_end = ends[-1] if ends.size else -1
    return bool(last_begin > last_end)


def _probs(model, tokens: list[int]) -> np.ndarray:
    """The target's next-token probabilities [len(tokens), V] at every position (transformers)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].double().numpy()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _in_window(p: np.ndarray, token: int, topk: int, delta: float, margin: float) -> bool:
    """Whether `token` is among the top `topk` of `p` and within `delta` of the top probability,
    by `margin` (positive: clearly in, near-ties counted against it; negative: not clearly out)."""
    above = int((np.delete(p, token) > p[token] - margin).sum())  # tokens ranked above it
    return above < topk and p[token] >= p.max() - delta + margin


def test_relaxed_acceptance_configs_parse_from_json_yaml_and_cli(tmp_path):
    import argparse

    from jaxllm.cli.args import add_engine_args, engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig

    expected = _relaxed(**WINDOW)
    fields = '"use_relaxed_acceptance_for_thinking": true, "relaxed_topk": 8, "relaxed_delta": 0.3'
    assert parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2, ' + fields + "}") == expected
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"decoding_type": "MTP", "num_nextn_predict_layers": 2, ' + fields + "}"]
    )
    assert EngineConfig(model="tiny-moe", **engine_kwargs(args)).speculative_config == expected
    path = tmp_path / "extra.yaml"
    path.write_text(
        "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 2\n"
        "  use_relaxed_acceptance_for_thinking: true\n  relaxed_topk: 8\n  relaxed_delta: 0.3\n"
    )
    args = parser.parse_args(["--extra_llm_api_options", str(path)])
    assert EngineConfig(model="tiny-moe", **engine_kwargs(args)).speculative_config == expected
    with pytest.raises(ValueError, match="relaxed_delta must be >= 0"):
        parse_speculative_config({"decoding_type": "MTP", "relaxed_delta": -0.1})


def test_a_tokenizer_without_thinking_tokens_is_refused(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_mtp_no_think")
    write_engine_checkpoint(directory)  # the tiny-moe tokenizer: no <think>
    with pytest.raises(ValueError, match="tokenizer has no <think> or </think> token"):
        tiny_engine(str(directory), speculative_config=_relaxed(4, 0.1), **LIMITS)
    shutil.rmtree(directory, ignore_errors=True)


def test_top1_with_zero_delta_is_exact_acceptance(runs):
    _, results = runs
    plain, exact, top1 = results["plain"][0], results["exact"][0], results["top1"][0]
    assert top1 == exact == plain
    assert results["top1"][2] == results["exact"][2]


def test_outside_thinking_the_output_is_the_engine_without_speculation(runs):
    _, results = runs
    plain, window, wide = results["plain"][0], results["window"][0], results["wide"][0]
    prompts = _prompts()
    compared = 0
    for prompt, expected, got_window, got_wide in zip(prompts, plain, window, wide):
        if _thinking(prompt):
            continue
        # Up to the model's own <think>, if it writes one: from there on drafts are relaxed.
        n = expected.index(BEGIN) + 1 if BEGIN in expected else len(expected)
        assert got_window[:n] == expected[:n] and got_wide[:n] == expected[:n]
        compared += n
    assert compared >= 32


def test_every_verified_draft_follows_the_rule_of_its_span(runs):
    model, results = runs
    prompts = _prompts()
    outputs, verified, _ = results["window"]
    topk, delta = WINDOW["relaxed_topk"], WINDOW["relaxed_delta"]
    probs = [_probs(model, p + o) for p, o in zip(prompts, outputs)]
    relaxed_accepts = rejects = 0
    from_drafts: set[tuple[int, int]] = set()  # (request, position) of accepted drafts
    for i, before, drafts in verified:
        sequence = prompts[i] + outputs[i]
        assert sequence[: len(before)] == before
        for j, draft in enumerate(drafts):
            position = len(before) + j  # the draft's position in the sequence
            p = probs[i][position - 1]
            thinking = _thinking(before + drafts[:j])
            accepted = position < len(sequence) and sequence[position] == draft
            if accepted:
                from_drafts.add((i, position))
                if thinking:
                    assert _in_window(p, draft, topk, delta, -TOL), (i, position, draft)
                    relaxed_accepts += p[draft] < p.max() - TOL
                else:
                    assert p[draft] >= p.max() - TOL, (i, position, draft)
                continue
            rejects += 1
            if thinking:
                assert not _in_window(p, draft, topk, delta, TOL), (i, position, draft)
            else:
                assert p[draft] < p.max() + TOL
            break  # drafts after a rejected one were not verified
    assert relaxed_accepts >= 3 and rejects > 0
    # Every other output token is the target's argmax.
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        for position in range(len(prompt), len(prompt) + len(output)):
            if (i, position) not in from_drafts:
                p = probs[i][position - 1]
                assert p[(prompt + output)[position]] >= p.max() - TOL, (i, position)


def test_a_wide_window_accepts_more_drafts_than_exact_acceptance(runs):
    _, results = runs
    (exact_accepted, exact_drafted), (wide_accepted, wide_drafted) = results["exact"][2], results["wide"][2]
    assert exact_drafted > 0 and wide_drafted > 0
    assert wide_accepted / wide_drafted > 2 * exact_accepted / exact_drafted
    assert wide_accepted > 20
