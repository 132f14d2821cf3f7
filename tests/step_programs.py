"""Control flow in the programs the engine compiles: what XLA's optimized HLO holds.

XLA on a GPU runs a `while` whose trip count it does not know at compile time by copying the
loop predicate to the host after every iteration, and a `conditional` by reading its branch
index back: a host round trip inside the step. With a trip count from the shapes the
optimized HLO says `known_trip_count` on the loop. `scan_hlo` counts both kinds in a dump
directory (`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`), outside kernel custom calls
(a kernel's own loops are inside its custom call and never appear as HLO `while`s).

Run as a script (`python tests/step_programs.py CASE [CASE ...]`, with the dump flags and the
compilation cache off, so that every program really compiles) it builds an engine for each
case, compiles everything warm-up compiles, and serves greedy, sampled (top-k / top-p,
seeded) and logprobs requests, so that every program the engine builds for that model is
compiled and dumped.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

_WHILE = re.compile(r"\bwhile\(")
_CONDITIONAL = re.compile(r"\bconditional\(")
_MODULE = re.compile(r"module_\d+\.(.+)\.cpu_after_optimizations\.txt$")


@dataclass
class ControlFlow:
    """Per module dumped after optimization: the `while`s without a known trip count and the
    `conditional`s, each as its HLO line."""

    modules: int = 0
    unbounded: dict[str, list[str]] = field(default_factory=dict)
    conditionals: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_unbounded(self) -> int:
        return sum(map(len, self.unbounded.values()))

    @property
    def num_conditionals(self) -> int:
        return sum(map(len, self.conditionals.values()))

    def describe(self) -> str:
        lines = [
            f"{self.modules} modules: {self.num_unbounded} unbounded while(s), {self.num_conditionals} conditional(s)"
        ]
        for kind, found in (("while", self.unbounded), ("conditional", self.conditionals)):
            for module, ops in sorted(found.items()):
                lines += [f"  {kind} in {module}: {op[:160]}" for op in ops[:2]]
        return "\n".join(lines)


def scan_hlo(directory: Path) -> ControlFlow:
    """Count the control flow of every `*.cpu_after_optimizations.txt` module in `directory`."""
    flow = ControlFlow()
    for path in sorted(directory.glob("*after_optimizations.txt")):
        match = _MODULE.search(path.name)
        if match is None:
            continue
        flow.modules += 1
        name = f"{path.name.split('.')[0]}.{match.group(1)}"
        lines = path.read_text().splitlines()
        unbounded = [line.strip() for line in lines if _WHILE.search(line) and "known_trip_count" not in line]
        conditionals = [line.strip() for line in lines if _CONDITIONAL.search(line)]
        if unbounded:
            flow.unbounded[name] = unbounded
        if conditionals:
            flow.conditionals[name] = conditionals
    return flow


_WHILE_OP = re.compile(r"stablehlo\.while\(")
_COUNTED = re.compile(r"stablehlo\.compare\s+LT, %iterArg\w*, (%c\w*),")


def uncounted_stablehlo_loops(text: str) -> tuple[int, int, int]:
    """(`while`s, `while`s that are not counted loops, `if`s + `case`s) in StableHLO text lowered
    for a GPU (`.lower(lowering_platforms=("cuda",))`, which runs on a CPU): a counted loop's
    `cond` compares a loop variable with a constant of its own region, as a `scan` or a
    `fori_loop` over Python ints lowers. A kernel is one `custom_call` whose body is
    serialized into an attribute, so its own loops are not seen."""
    loops = uncounted = 0
    for match in _WHILE_OP.finditer(text):
        loops += 1
        cond = text[match.end() : text.find("} do {", match.end())]
        counted = _COUNTED.search(cond)
        if counted is None or f"{counted.group(1)} = stablehlo.constant" not in cond:
            uncounted += 1
    return loops, uncounted, text.count("stablehlo.if") + text.count("stablehlo.case")


LIMITS = dict(
    dtype="float32",
    max_batch_size=4,
    max_num_tokens=16,
    max_seq_len=96,
    decode_batch_sizes=[1, 2],
    compile_cache=False,
)


def _prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22], [30, 31, 32]]


def _serve(model: str, *, features: bool = False, kv_fields: dict | None = None, **fields) -> None:
    """Build an engine and serve greedy, sampled and logprobs requests; with `features` also
    beam search, penalties, a JSON schema and generation logits. Every program compiles when a
    step first needs it (warm-up off), so each kind of program the requests use compiles."""
    from jaxllm import LLM, KvCacheConfig, SamplingParams
    from jaxllm.sampling import GuidedDecodingParams

    kv = KvCacheConfig(tokens_per_block=8, max_tokens=512, **(kv_fields or {}))
    llm = LLM(model, warmup="none", kv_cache_config=kv, **{**LIMITS, **fields})
    try:
        prompts = _prompts()
        llm.generate(prompts, SamplingParams(max_tokens=6))
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.8, top_k=5, top_p=0.9, seed=1))
        llm.generate(prompts[:2], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))
        if features:
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, use_beam_search=True, n=2))
            llm.generate(
                prompts[:2], SamplingParams(max_tokens=4, repetition_penalty=1.3, return_generation_logits=True)
            )
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(json=schema)))
            # prompts overflowing the device pool, then the first again: offloaded, onboarded
            long = [[(i * 80 + j) % 400 + 3 for j in range(80)] for i in range(8)]
            llm.generate(long, SamplingParams(max_tokens=2))
            llm.generate(long[:1], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def _deepseek_mtp(root: Path) -> str:
    from tests.mtp_helpers import write_engine_checkpoint

    directory = root / "deepseek_mtp"
    directory.mkdir()
    write_engine_checkpoint(directory)
    return str(directory)


def _eagle3(root: Path) -> tuple[str, str]:
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file

    from jaxllm.models import materialize_preset
    from tests.test_eagle3 import HEAD, TARGET, TorchEagle3, _randomize

    gen = torch.Generator().manual_seed(0)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TARGET)).eval()
    _randomize(target, gen)
    target.save_pretrained(root / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (materialize_preset("tiny-moe") / name).exists():
            shutil.copy(materialize_preset("tiny-moe") / name, root / "target" / name)
    hot = np.sort(np.random.default_rng(0).choice(HEAD["vocab_size"], HEAD["draft_vocab_size"], replace=False))
    head = TorchEagle3(transformers.LlamaConfig(**HEAD), HEAD["draft_vocab_size"], hot).eval()
    _randomize(head, gen)
    (root / "head").mkdir()
    (root / "head" / "config.json").write_text(json.dumps(HEAD))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(root / "head" / "model.safetensors"))
    return str(root / "target"), str(root / "head")


def run_case(case: str, root: Path) -> None:
    """Serve one case: a model family, a speculative method or a weight format."""
    from jaxllm.models import materialize_preset
    from jaxllm.speculative_config import (
        DraftTargetDecodingConfig,
        EagleDecodingConfig,
        MTPDecodingConfig,
        NGramDecodingConfig,
    )

    if case == "dense":
        _serve("tiny-dense")
    elif case == "features":  # beam search, penalties, guided decoding, logits outputs, the host KV tier
        _serve("tiny-dense", features=True, kv_fields=dict(host_cache_size=1 << 22))
    elif case == "moe":
        _serve("tiny-moe")
    elif case == "mla_mtp":  # DeepSeek-V3: MLA layers, MoE, and its MTP layer drafting
        _serve(_deepseek_mtp(root), speculative_config=MTPDecodingConfig(num_nextn_predict_layers=2))
    elif case == "ngram":
        _serve("tiny-moe", speculative_config=NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2))
    elif case == "draft_model":
        draft = DraftTargetDecodingConfig(max_draft_len=2, speculative_model_dir=str(materialize_preset("tiny-dense")))
        _serve("tiny-dense", speculative_config=draft)
    elif case == "eagle3":
        target, head = _eagle3(root)
        _serve(target, speculative_config=EagleDecodingConfig(max_draft_len=2, speculative_model_dir=head))
    elif case == "fp8":
        _serve("tiny-moe", quantization="fp8", dequantize_on_load=False)
    elif case == "int4":
        _serve("tiny-dense", quantization="int4", dequantize_on_load=False)
    else:
        raise ValueError(f"unknown case {case!r}")


CASES = ("dense", "features", "moe", "mla_mtp", "ngram", "draft_model", "eagle3", "fp8", "int4")

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    with tempfile.TemporaryDirectory() as scratch:
        for name in sys.argv[1:]:
            (Path(scratch) / name).mkdir()
            run_case(name, Path(scratch) / name)
            print(f"served {name}", flush=True)
