"""Synthetic checkpoints, built offline and deterministic by seed: the one builder that the
demo (`ram-dist demo`), the tests and the benchmarks share.

* `llama`: the tensor names, shapes and `config.json` of a Llama-shaped model of any size
  (the tiny one of the demo and the tests, one of a chosen parameter count, Llama-3.1-405B);
* `deepseek`: DeepSeek-V3's tensors (FP8 weights with their block scales, 256 experts per MoE
  layer, the multi-token-prediction layer), its 163 shards and its `config.json`;
* `gpt_oss`: gpt-oss-120b's tensors (its experts' weights MXFP4 blocks and scales, or bf16 as
  an agent's), its 15 shards from `model-00000-of-00014` and its `config.json`, and
  gpt-oss-shaped models of a chosen size;
* `kimi`: Kimi-K2-Thinking's tensors (DeepSeek-V3's architecture, 384 experts per MoE layer,
  the experts' weights compressed-tensors INT4 triples, or bf16 as an agent's), its 62 shards
  and its `config.json`;
* `weights`: a random base, and RL-like agents whose task vectors are sparse;
* `files`: Hugging Face style folders (one safetensors file, or greedy shards and their
  index, written one shard in memory at a time), and sparse files that hold only headers
  (of any safetensors dtypes, with a `config.json`).
"""
