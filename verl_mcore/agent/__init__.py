"""Multi-turn agent loops over the rollout engine (issue 41), and what they call.

    loop.py         rollout.agent_loop's user class (AgentLoop), the trajectory's context
                    (AgentContext: generate a turn, append an observation), its limits and result
    runtime.py      AgentRuntime: every trajectory of a replica's batch at once over the engine's
                    step-wise serving (rollout/serving.py), the TP_g group's ranks kept in step

    tools.py        ToolCall / ToolResult, a tool's schema (given or derived), argument checks,
                    the start-up probe (load_tools)
    parsers.py      tool calls from model text: PARSERS (hermes), a user's parser (load_parser)
    environment.py  reset(row) / step(action) environments: spec, probe, step results
    sandbox.py      ToolSandbox: worker processes (distributed/worker_process.py) that run
                    tools and environments with timeouts, a memory cap and an output cap;
                    async calls from the agent loop's event loop, a sync wrapper
    sandbox_worker.py   the workers' side
    observation.py  a tool / user turn's token ids from the chat template, special strings as
                    plain text; tool schemas in the prompt
    metrics.py      ToolMetrics: per-tool counts and seconds, mergeable across trajectories

The package imports neither torch nor transformers at its top (the sandbox workers import it).
"""
