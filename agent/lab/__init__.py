"""What is neither the agent nor the engine hook: the reference engine, the load generator, the
harness that runs engines and agents as processes (and `kvwatch demo`), the network labs and
readers, proxies, ASGI servers and the agent on a thread that the tests, the demo and the
benchmarks share. The agent's own stages never import it."""
