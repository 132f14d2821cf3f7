"""Offline batch generation with the LLM API.

python examples/generate_offline.py --model tiny-moe
python examples/generate_offline.py --model /path/to/Qwen3-30B-A3B --dtype bfloat16
"""

import argparse

from jaxllm import LLM, KvCacheConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_batch_size=32,
        max_num_tokens=1024,
        kv_cache_config=KvCacheConfig(tokens_per_block=32, free_gpu_memory_fraction=0.8),
    )
    prompts = ["Hello, my name is", "The president of the United States is", "The future of AI is"]
    params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=0)
    for out in llm.generate(prompts, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
