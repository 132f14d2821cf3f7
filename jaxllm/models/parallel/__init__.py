"""The model's forward under attention data parallelism (`attention_dp`): attention runs per
rank on its own requests and KV pool, the MoE layers dispatch every rank's tokens to the
experts (`jaxllm.models.ep_moe`). The mesh, rules and shard_map helpers it builds on are in
the model-independent `sharding` package."""
