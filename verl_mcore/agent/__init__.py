"""Multi-turn agent loops over the rollout engine (issue 41).

    loop.py     rollout.agent_loop's user class (AgentLoop), the trajectory's context
                (AgentContext: generate a turn, append an observation), its limits and result
    runtime.py  AgentRuntime: every trajectory of a replica's batch at once over the engine's
                step-wise serving (rollout/serving.py), the TP_g group's ranks kept in step

The package imports neither torch nor transformers at its top.
"""
