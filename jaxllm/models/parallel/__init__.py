"""The model's forward pieces that run across devices: the expert-parallel MoE layer
(`ep_moe`) and attention data parallelism (`attention_dp`). The mesh, rules and
shard_map helpers they build on are in the model-independent `sharding` package."""
