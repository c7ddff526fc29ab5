"""RL algorithms as pure tensor functions, chosen by name from dicts.

advantages   ADV_ESTIMATORS / compute_advantages: gae, grpo, rloo, reinforce_plus_plus,
             reinforce_plus_plus_baseline, remax; masked_whiten
aggregation  loss aggregation modes with mini-batch-global denominators (global_denominators)
policy_loss  POLICY_LOSSES / compute_policy_loss: ppo, gspo, reinforce (= gpg); entropy_bonus
value_loss   clipped value loss
kl           KL_PENALTIES (k1, abs, k2, k3 = low_var_kl), apply_kl_penalty, kl_loss, controllers
overlong     DAPO's overlong punishment (overlong_penalty) and filtering (actor_batch)
"""
