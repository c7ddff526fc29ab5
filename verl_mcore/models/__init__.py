"""megatron-core GPTModels from Hugging Face checkpoints, and the one HF <-> megatron weight map.

    hf_config.py   config.json -> HFArch (refuses unsupported fields by name) -> TransformerConfig
    rope.py        HF RoPE frequencies (default, linear, llama3) installed into the model
    attention.py   SDPAttention: causal / GQA / packed-THD core attention on torch SDPA
    gpt.py         layer spec choice, ScalarHead, build_gpt_model(arch, config, role=...)
    weight_map.py  pure name/tensor mapping: QKV/gate-up fusion, vocab padding, TP slices, PP stages
    hf_weights.py  safetensors reader; load_hf_weights: this rank's slice straight from HF files
    hub.py         Hugging Face Hub ids -> the cached snapshot directory (local_dir)
    checkpoint.py  load_dist_checkpoint: a megatron dist checkpoint at any TP/PP
    load.py        build_and_load(role, hf_path=..., checkpoint=...): config fields -> filled model

Supported: Llama 2/3/3.1, Mistral (no sliding window in use), Qwen2/2.5, Qwen3.
"""
