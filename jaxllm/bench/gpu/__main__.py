"""`python -m jaxllm.bench.gpu --out DIR`: see `jaxllm.bench.gpu`."""

from jaxllm.bench.gpu import main

if __name__ == "__main__":
    raise SystemExit(main())
