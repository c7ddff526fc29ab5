"""The real-model tests' shared pieces (SmolLM2-135M-Instruct, the `smollm2` fixture of
tests/conftest.py): chat prompts, their data file, transformers' greedy answers, and rank bodies
(module level: spawn pickles them by name)."""
from __future__ import annotations

import json

import torch

# Chat questions of varied kinds: some answers end with <|im_end|> within MAX_NEW tokens, others
# run to the length limit (test_real_model_generation checks that both happen).
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?",
    "Name three primary colors.", "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.", "What does a CPU do?",
    "Who wrote Romeo and Juliet?", "List two benefits of exercise.",
    "What is the boiling point of water in Celsius?", "Say hello in a friendly way.",
    "Why is the sky blue?", "Suggest a name for a pet cat.", "What is an API?",
    "How many legs does a spider have?",
]
MAX_NEW = 32
EOS = 2  # <|im_end|>: SmolLM2's EOS and pad


def write_chat_data(path: str, prompts=PROMPTS) -> str:
    """A JSON Lines prompt file in verl's columns: one user message each, its index in
    extra_info (the recording reward below writes it next to the text it was given)."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"data_source": "chat", "prompt": [{"role": "user", "content": p}],
                                "reward_model": {"ground_truth": ""},
                                "extra_info": {"index": i}}) + "\n")
    return path


def write_recording_reward(path: str, log: str) -> str:
    """A reward function that appends (index, the response string it was given) to `log` as
    JSON Lines and scores 0: the test reads exactly what the scorer saw."""
    with open(path, "w") as f:
        f.write("import json\n\n"
                "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                f"    with open({log!r}, 'a') as f:\n"
                "        f.write(json.dumps([extra_info['index'], solution_str]) + '\\n')\n"
                "    return 0.0\n")
    return path


def chat_ids(tokenizer, prompts=PROMPTS) -> list[list[int]]:
    """transformers' own chat-template token ids of each prompt (the generation prompt added)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True)["input_ids"]
            for p in prompts]


def until_eos(ids: list[int]) -> list[int]:
    """A response up to and including its first EOS (what the engine returns with stop ids)."""
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def hf_greedy(hf_dir: str, prompt_ids: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy responses (fp32), cut after the first EOS. One left-padded batch:
    on these prompts it gives the same tokens as one prompt at a time (checked when this was
    written: 16 of 16) in a fifth of the time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=EOS, eos_token_id=EOS)
    return [until_eos(row[width:].tolist()) for row in out]


def overrides(hf_dir: str, run_dir: str, data: str, reward: str, tp: int = 1, pp: int = 1,
              tp_gen: int = 1) -> list[str]:
    """A fp32 GRPO run of the real model on the chat prompts; micro-batching set explicitly."""
    return [f"model.path={hf_dir}", f"trainer.run_dir={run_dir}", "trainer.device=cpu",
            "trainer.total_steps=1", "trainer.val_every=0", "trainer.logger=[]",
            f"data.train_files=[{data}]", f"data.val_files=[{data}]",
            "data.max_prompt_length=64", f"data.max_response_length={MAX_NEW}",
            f"data.train_batch_size={len(PROMPTS)}", "data.shuffle=false",
            f"reward.custom_fn.path={reward}", "reward.custom_fn.name=score",
            "reward.num_workers=0", "algorithm.adv_estimator=grpo", "rollout.n=2",
            "rollout.engine=native", f"rollout.tensor_parallel_size={tp_gen}",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            "actor.dtype=fp32", "reference.dtype=fp32", "actor.use_kl_loss=false",
            f"actor.ppo_mini_batch_size={len(PROMPTS)}", "actor.micro_batch_size_per_gpu=4",
            "actor.max_tokens_per_microbatch=1024"]


def generation_body(rank, world_size, cfg_overrides: list[str], score: bool, sampled: bool):
    """The trainer's own generation path on the chat prompts: greedy (prompt ids, response ids,
    finish reasons, response texts), with `score` the scorer run on them, and with `sampled` one
    sample per prompt at temperature 1 with the engine's log-probs beside the actor's
    recomputation of them (the old-log-prob pass of a training step)."""
    import dataclasses

    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.data import PromptLoader
    from verl_mcore.trainer import Trainer

    trainer = Trainer(Config.load(None, cfg_overrides))
    try:
        shard, replicas = build.prompt_shard(trainer.gen_groups)
        [prompts] = list(PromptLoader(trainer.val_data, len(trainer.val_data), rank=shard,
                                      world_size=replicas, shuffle=False, drop_last=False,
                                      num_epochs=1))
        out = {}
        sampler = trainer.sampler
        sampler.begin(0)
        greedy = sampler.generate(prompts, sampler.sampling(1, 0.0, 0))
        t1 = None
        if sampled:
            t1 = sampler.generate(prompts, dataclasses.replace(sampler.sampling(1, 1.0, 0),
                                                               logprobs=True))
        sampler.end()
        b = greedy.train
        ids, plen, slen = b.input_ids.tolist(), b.prompt_lens.tolist(), b.seq_lens.tolist()
        out["prompt_ids"] = [row[:p] for row, p in zip(ids, plen)]
        out["response_ids"] = [row[p:s] for row, p, s in zip(ids, plen, slen)]
        out["finish"], out["responses"] = greedy.finish, greedy.responses
        if score:
            out["scores"] = trainer.scorer.score(greedy)[0].tolist()
        if t1 is not None:
            logp, _ = trainer.learner.old_log_probs(t1.train)
            out["t1"] = {"engine": t1.engine_log_probs, "actor": logp.cpu(),
                         "mask": t1.train.response_mask.cpu(), "finish": t1.finish}
        return out if rank == 0 else None
    finally:
        trainer.finish()
