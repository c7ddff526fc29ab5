"""HF directory <-> megatron-core dist checkpoint, and a logits check between the two.

    verl-mcore-convert-hf {hf-to-mcore, mcore-to-hf, verify} ...   (python -m verl_mcore.convert_hf;
                                                                   python -m tools.convert_hf
                                                                   from a checkout)
"""
