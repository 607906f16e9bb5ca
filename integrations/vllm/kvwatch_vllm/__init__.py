"""kvwatch for vLLM: a scheduler that pauses, parks and resumes one request on the kvwatch
agent's word, and the API server middleware that carries the agent's commands to it.

    vllm serve MODEL \\
        --scheduler-cls kvwatch_vllm.scheduler.KvwatchAsyncScheduler \\
        --middleware kvwatch_vllm.middleware.Middleware

Modules: `scheduler` (the two scheduler classes), `holds` (pause, park, resume inside vLLM's
scheduler), `transfers` (when a park must wait for a KV transfer), `engine_utility` (the
EngineCore end of the command path), `ids` (HTTP request id -> vLLM request ids), `commands`
(the API server end), `middleware` (the engine hook's handlers), `outcome` (statuses). Importing
this package imports nothing from vLLM.
"""

__version__ = "0.1.0"
