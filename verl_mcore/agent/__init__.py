"""What an agent loop calls: tools and environments in sandbox workers, the parser of tool calls
in the model's text, observation tokens, per-tool metrics.

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

The package imports neither torch nor transformers at its top: the sandbox workers import it.
"""
