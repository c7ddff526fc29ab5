"""HF directory <-> megatron-core dist checkpoint, a LoRA run's checkpoint -> peft adapter
directory or merged HF model (lora_export.py), and a logits check between the two.

    verl-mcore-convert-hf {hf-to-mcore, mcore-to-hf, verify} ...   (python -m verl_mcore.convert_hf;
                                                                   python -m tools.convert_hf
                                                                   from a checkout)
"""
